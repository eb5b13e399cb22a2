//! The CUDA C source of the GPU decoder, for offload-cuda to compile with
//! nvrtc (`docs/PACKED_FORMAT.md` §Decoding on the GPU).

/// `decode.cu`: the kernels `opk_decode_window3` (grid = tiles, 128
/// threads a block) with its tensor table `OpkTensor`, and
/// `opk_decode_block` (one coded block, [`crate::block`]: grid = its work
/// items over [`DECODE_BLOCK_ITEMS`], 128 threads a block, the table read
/// from the blob). No includes,
/// no host code: nvrtc compiles it as it is.
pub const DECODE_CU: &str = include_str!("decode.cu");

/// The kernel's name in [`DECODE_CU`].
pub const DECODE_KERNEL: &str = "opk_decode_window3";

/// The coded-block kernel's name in [`DECODE_CU`]:
/// `opk_decode_block(const unsigned char* blob, unsigned long long
/// blob_bytes, unsigned char* out, unsigned long long out_bytes, int*
/// error)`, `blob` the block blob in device memory (256-byte aligned, its
/// `blob_bytes` coded bytes), `out` the unit's first byte (`out_bytes`
/// of room), grid = the block's work items
/// ([`crate::block::EncodedBlock::work`]) divided by
/// [`DECODE_BLOCK_ITEMS`], rounded up, [`DECODE_BLOCK_THREADS`] threads a
/// block. `*error` becomes 1 on a tile whose escape index
/// disagrees with its codes, 2 on a table entry that does not hold its
/// work item, names an unknown code, or points outside either bound, or a
/// header whose work count is not its table's (then that work item writes
/// nothing: stale staging bytes never write outside the slot). Items at or
/// past the work count (the last thread block's padding) do nothing.
pub const BLOCK_KERNEL: &str = "opk_decode_block";

/// Threads of one block of [`DECODE_KERNEL`] and [`BLOCK_KERNEL`] (one per code word of a tile).
pub const DECODE_BLOCK_THREADS: u32 = crate::format::WORDS_PER_TILE as u32;

/// Work items one thread block of [`BLOCK_KERNEL`] decodes (`decode.cu`'s
/// `OPK_BLOCK_ITEMS` default): its grid is the block's work items divided
/// by this, rounded up. Consecutive items share their table entry, so the
/// entry's lookup and checks are paid once per thread block and entry.
pub const DECODE_BLOCK_ITEMS: u32 = 4;

/// A host C++ shim that lets a C++ compiler check [`DECODE_CU`]'s syntax
/// and types where there is no CUDA toolkit (the CUDA built-ins declared,
/// not implemented): `c++ -fsyntax-only -x c++ -include shim.h decode.cu`.
pub const HOST_SHIM_H: &str = r#"
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)
struct uint4 { unsigned int x, y, z, w; };
struct dim3 { unsigned int x, y, z; };
extern dim3 threadIdx, blockIdx, blockDim;
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
unsigned int __popc(unsigned int);
unsigned int __shfl_up_sync(unsigned int, unsigned int, unsigned int);
void __syncthreads();
int atomicExch(int*, int);
"#;

#[cfg(test)]
mod tests {
    /// The host's items per thread block are the kernel's default.
    #[test]
    fn the_block_items_are_the_kernels_default() {
        let line = format!("#define OPK_BLOCK_ITEMS {}u", super::DECODE_BLOCK_ITEMS);
        assert!(super::DECODE_CU.contains(&line), "decode.cu lacks `{line}`");
    }
}
