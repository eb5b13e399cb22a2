// offload-pack's window3 decoder, CUDA C for nvrtc (no includes, no host
// code). The format is docs/PACKED_FORMAT.md; `Packed::decode_tile` in
// offload-pack/src/format.rs is the CPU reference of the same steps.
//
// One 128-thread block decodes one 4096-weight tile; thread w owns code
// word w of the tile (weights 32w .. 32w + 32):
//   1. load word w of the three bit planes (coalesced u32 loads), form the
//      escape mask ~(p0 | p1 | p2), bits past the tensor's end cleared;
//   2. a block-wide exclusive scan of the masks' popcounts (warp shuffles,
//      then four warp sums in shared memory) gives the thread's first
//      escape slot, from index[tile]; the scan's total must equal
//      index[tile + 1] - index[tile], else *error is set;
//   3. rebuild 32 bf16 values: exponent lo + code - 1, or for code 0 the
//      escape byte at slot + popc(mask & ((1 << b) - 1)); sign and mantissa
//      from the weight's byte (two 16-byte loads); store 64 bytes (four
//      16-byte stores when the output is 16-byte aligned and the word full).
//
// Two kernels share it: opk_decode_window3 (a table of window3 tensors,
// grid = their tiles, block = 128; raw-coded tensors are not in its table:
// their bytes are the tensor, from blob + 64) and opk_decode_block (one
// coded block, `OPB1`, below: its table is in the blob, raw entries
// copied by the kernel).

#define OPK_TILE 4096u
#define OPK_WORDS 128u
#define OPK_PLANE_WORDS 128u
#define OPK_TILE_CODE_BYTES 1536u

// One window3 tensor of a launch. `first_tile`: tiles of the tensors before
// it in the table (an exclusive prefix sum; the table sorted by it).
struct OpkTensor {
    const unsigned char* blob;      // the blob, 64-byte aligned on the device
    unsigned short* out;            // the decoded bf16 tensor
    unsigned long long first_tile;
};

__device__ __forceinline__ unsigned long long opk_u64(const unsigned char* p)
{
    return *(const unsigned long long*)p; // header fields are 8-byte aligned
}

__device__ __forceinline__ unsigned short opk_value(unsigned int sm_byte, unsigned int exp)
{
    return (unsigned short)(((sm_byte & 0x80u) << 8) | (exp << 7) | (sm_byte & 0x7fu));
}

// A window3 blob's header fields the tile decoder uses, and `blob_len`:
// the bytes of the blob the caller vouches for (an escape slot past them
// sets *error and writes nothing).
struct OpkHeader {
    unsigned long long n;
    unsigned long long sm_off;
    unsigned long long codes_off;
    unsigned long long idx_off;
    unsigned long long esc_off;
    unsigned long long blob_len;
    unsigned int lo;
};

__device__ __forceinline__ OpkHeader opk_header(const unsigned char* blob)
{
    OpkHeader h;
    h.lo = blob[7];
    h.n = opk_u64(blob + 8) >> 1;
    h.sm_off = opk_u64(blob + 24);
    h.codes_off = opk_u64(blob + 32);
    h.idx_off = opk_u64(blob + 40);
    h.esc_off = opk_u64(blob + 48);
    h.blob_len = opk_u64(blob + 56);
    return h;
}

// Decodes tile `tile` of the window3 blob `blob` (its header `h`, read
// once by the caller) into the tensor whose first byte is `out` (any
// alignment: 16-byte vector stores where the output allows them, else
// 2-byte stores, else bytes).
__device__ __forceinline__ void opk_decode_tile(const unsigned char* blob, const OpkHeader h,
                                                unsigned char* out, unsigned int tile, int* error)
{
    __shared__ unsigned int warp_sums[4];
    const unsigned int w = threadIdx.x;
    const unsigned int lane = w & 31u;
    const unsigned int warp = w >> 5;

    const unsigned int lo = h.lo;
    const unsigned long long n = h.n;
    const unsigned long long sm_off = h.sm_off;
    const unsigned long long codes_off = h.codes_off;
    const unsigned long long idx_off = h.idx_off;
    const unsigned long long esc_off = h.esc_off;
    const unsigned long long blob_len = h.blob_len;

    // 1. The thread's code word and escape mask.
    const unsigned int* planes =
        (const unsigned int*)(blob + codes_off + (unsigned long long)tile * OPK_TILE_CODE_BYTES);
    const unsigned int p0 = planes[w];
    const unsigned int p1 = planes[OPK_PLANE_WORDS + w];
    const unsigned int p2 = planes[2u * OPK_PLANE_WORDS + w];
    const unsigned long long first = (unsigned long long)tile * OPK_TILE + 32ull * w;
    unsigned int live = 0;
    if (n > first) {
        live = (n - first >= 32ull) ? 32u : (unsigned int)(n - first);
    }
    const unsigned int live_mask = (live == 32u) ? 0xffffffffu : ((1u << live) - 1u);
    const unsigned int esc = ~(p0 | p1 | p2) & live_mask;
    const unsigned int count = __popc(esc);

    // 2. Block-wide exclusive scan of the counts.
    unsigned int incl = count;
    for (unsigned int d = 1; d < 32u; d <<= 1) {
        const unsigned int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) {
            incl += v;
        }
    }
    if (lane == 31u) {
        warp_sums[warp] = incl;
    }
    __syncthreads();
    unsigned int before = 0;
    for (unsigned int k = 0; k < warp; ++k) {
        before += warp_sums[k];
    }
    const unsigned int total = warp_sums[0] + warp_sums[1] + warp_sums[2] + warp_sums[3];
    const unsigned int* index = (const unsigned int*)(blob + idx_off);
    const unsigned int start = index[tile];
    const unsigned int end = index[tile + 1u];
    if (end < start || end - start != total || esc_off + end > blob_len) {
        if (w == 0u) {
            atomicExch(error, 1);
        }
        return; // every thread returns: no barrier follows
    }
    const unsigned char* escapes = blob + esc_off + start + (before + incl - count);

    // 3. The thread's 32 weights.
    const uint4* smv = (const uint4*)(blob + sm_off + (unsigned long long)tile * OPK_TILE + 32ull * w);
    const uint4 s0 = smv[0];
    const uint4 s1 = smv[1];
    const unsigned int sw[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    unsigned char* dst = out + 2ull * first;
    unsigned int packed[16];
#pragma unroll
    for (unsigned int b = 0; b < 32u; ++b) {
        const unsigned int code = ((p0 >> b) & 1u) | (((p1 >> b) & 1u) << 1) | (((p2 >> b) & 1u) << 2);
        const unsigned int sm_byte = (sw[b >> 2] >> ((b & 3u) * 8u)) & 0xffu;
        unsigned int exp;
        // A weight past the tensor's end (b >= live) is never stored and
        // never an escape: it reads no escape byte (a stale blob's padding
        // could otherwise read one past the blob).
        if (code != 0u || b >= live) {
            exp = lo + code - 1u;
        } else {
            exp = escapes[__popc(esc & ((1u << b) - 1u))];
        }
        const unsigned int v = opk_value(sm_byte, exp);
        if (b & 1u) {
            packed[b >> 1] |= v << 16;
        } else {
            packed[b >> 1] = v;
        }
    }
    if (live == 32u && (((unsigned long long)dst) & 15ull) == 0ull) {
        uint4* d = (uint4*)dst;
        d[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        d[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
        d[2] = make_uint4(packed[8], packed[9], packed[10], packed[11]);
        d[3] = make_uint4(packed[12], packed[13], packed[14], packed[15]);
    } else if ((((unsigned long long)dst) & 1ull) == 0ull) {
        unsigned short* d = (unsigned short*)dst;
#pragma unroll
        for (unsigned int b = 0; b < 32u; ++b) {
            if (b < live) {
                d[b] = (unsigned short)(packed[b >> 1] >> ((b & 1u) * 16u));
            }
        }
    } else {
        // An odd output address (a tensor at an odd offset of its slot).
#pragma unroll
        for (unsigned int b = 0; b < 32u; ++b) {
            if (b < live) {
                const unsigned int v = packed[b >> 1] >> ((b & 1u) * 16u);
                dst[2u * b] = (unsigned char)(v & 0xffu);
                dst[2u * b + 1u] = (unsigned char)((v >> 8) & 0xffu);
            }
        }
    }
}

// Decodes every tile of the `n_tensors` window3 tensors of `tensors`
// (grid.x = their tiles in all, blockDim.x = 128). A tile whose escape
// index disagrees with its codes sets *error to 1 and writes nothing.
extern "C" __global__ void __launch_bounds__(128) opk_decode_window3(
    const OpkTensor* tensors, unsigned int n_tensors, int* error)
{
    const unsigned long long g = blockIdx.x;
    unsigned int a = 0;
    unsigned int z = n_tensors;
    while (z - a > 1u) {
        const unsigned int mid = a + (z - a) / 2u;
        if (tensors[mid].first_tile <= g) {
            a = mid;
        } else {
            z = mid;
        }
    }
    const OpkTensor t = tensors[a];
    opk_decode_tile(t.blob, opk_header(t.blob), (unsigned char*)t.out,
                    (unsigned int)(g - t.first_tile), error);
}

// ---------------------------------------------------------------------------
// One coded block (offload-pack/src/block.rs, `OPB1`): the blob a ring
// engine copied into a staging buffer, decoded into the block's slot in one
// launch. The table is in the blob itself (device memory):
//   u32 entries at byte 8, u64 work items at byte 24; entry i at
//   64 + 32 i: u64 tensor blob offset, u64 output offset, u64 first work
//   item, u32 work items, u8 code id.
// Each 128-thread block finds its entry by binary search over the first
// work items; a window3 entry (code 1) decodes one tile with the tile
// decoder above, a raw entry (code 0) copies one OPK_RAW_CHUNK-byte chunk
// of its tensor blob's data (at +64) to its output, the last chunk partial.
// The kernel also bounds what it reads and writes by `blob_bytes` (the
// coded bytes in the staging buffer) and `out_bytes` (the unit): an entry
// that does not hold the work item, an unknown code, or a table, tensor
// header or output range outside those bounds sets *error to 2 and writes
// nothing (`BlockView::parse` rules all of them out; a staging buffer read
// before its copy landed, a planted ordering bug, does not).

#define OPK_RAW_CHUNK 8192u
#define OPK_BLOCK_HEADER 64u
#define OPK_ENTRY_BYTES 32u

// Copies `len` (≤ OPK_RAW_CHUNK) bytes from `src` to `dst`: 16-byte
// vectors (coalesced, thread w takes vectors w, w + 128, ...) where both
// are 16-byte aligned, bytes for the rest and for any other alignment.
__device__ __forceinline__ void opk_copy_chunk(const unsigned char* src, unsigned char* dst,
                                               unsigned int len)
{
    const unsigned int w = threadIdx.x;
    unsigned int done = 0;
    if (((((unsigned long long)src) | ((unsigned long long)dst)) & 15ull) == 0ull) {
        const unsigned int vectors = len >> 4;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (unsigned int v = w; v < vectors; v += OPK_WORDS) {
            d[v] = s[v];
        }
        done = vectors << 4;
    }
    for (unsigned int i = done + w; i < len; i += OPK_WORDS) {
        dst[i] = src[i];
    }
}

// The block kernel's decision for work item `g` (thread 0 alone): the
// entry holding it and whether every bound holds.
__device__ __forceinline__ void opk_block_entry(const unsigned char* blob,
                                                unsigned long long blob_bytes,
                                                unsigned long long out_bytes,
                                                unsigned long long g,
                                                unsigned long long* entry, unsigned int* code_ok,
                                                OpkHeader* header)
{
    unsigned int n = 0;
    if (blob_bytes >= OPK_BLOCK_HEADER) {
        n = *(const unsigned int*)(blob + 8);
    }
    if ((unsigned long long)n * OPK_ENTRY_BYTES + OPK_BLOCK_HEADER > blob_bytes) {
        n = 0; // a table past the coded bytes: refused below
    }
    const unsigned char* table = blob + OPK_BLOCK_HEADER;
    unsigned int a = 0;
    unsigned int z = n;
    while (z - a > 1u) {
        const unsigned int mid = a + (z - a) / 2u;
        if (opk_u64(table + (unsigned long long)mid * OPK_ENTRY_BYTES + 16u) <= g) {
            a = mid;
        } else {
            z = mid;
        }
    }
    bool ok = n != 0u;
    unsigned long long first = 0, blob_off = 0, out_off = 0, bytes = 0, t_len = 0;
    unsigned int items = 0, code = 0;
    if (ok) {
        const unsigned char* e = table + (unsigned long long)a * OPK_ENTRY_BYTES;
        blob_off = opk_u64(e);
        out_off = opk_u64(e + 8);
        first = opk_u64(e + 16);
        items = *(const unsigned int*)(e + 24);
        code = e[28];
        ok = g >= first && g - first < (unsigned long long)items && code <= 1u
            && (blob_off & 63ull) == 0ull && blob_off <= blob_bytes
            && blob_bytes - blob_off >= 64ull;
    }
    if (ok) {
        const unsigned char* t = blob + blob_off;
        bytes = opk_u64(t + 8);
        t_len = opk_u64(t + 56);
        ok = t[6] == code && t_len >= 64ull && t_len <= blob_bytes - blob_off && out_off <= out_bytes
            && bytes <= out_bytes - out_off;
        if (ok && code == 0u) {
            ok = bytes <= t_len - 64ull
                && (unsigned long long)items * OPK_RAW_CHUNK >= bytes
                && (g - first) * OPK_RAW_CHUNK < bytes;
        } else if (ok) {
            // Every section offset inside the blob, the tile among its
            // tiles: checked on the copy the block will use (the bytes may
            // change under a racing copy; the decision may not).
            OpkHeader h = opk_header(t);
            h.n = bytes >> 1;
            h.blob_len = t_len;
            const unsigned long long tiles = *(const unsigned int*)(t + 20);
            ok = (bytes & 1ull) == 0ull && g - first < tiles && h.sm_off == 64ull
                && h.codes_off == 64ull + 4096ull * tiles
                && h.idx_off == 64ull + 5632ull * tiles && h.esc_off <= t_len
                && h.idx_off + 4ull * (tiles + 1ull) <= t_len && bytes <= 8192ull * tiles;
            *header = h;
        }
    }
    entry[0] = blob_off;
    entry[1] = out_off;
    entry[2] = first;
    entry[3] = bytes;
    entry[4] = t_len;
    code_ok[0] = code;
    code_ok[1] = ok ? 1u : 0u;
}

// Decodes the coded block `blob` (the staging buffer: 256-byte aligned, so
// every tensor blob is 64-byte aligned; `blob_bytes` of it are the block's)
// into `out` (the slot; `out_bytes` of it are the unit's), grid.x = the
// block's work items (header u64 at byte 24), blockDim.x = 128. A tile
// whose escape index disagrees with its codes sets *error to 1.
extern "C" __global__ void __launch_bounds__(128) opk_decode_block(
    const unsigned char* blob, unsigned long long blob_bytes, unsigned char* out,
    unsigned long long out_bytes, int* error)
{
    const unsigned long long g = blockIdx.x;
    // Thread 0 reads the header and the entry and decides; the block reads
    // its decision from shared memory, so that every thread takes the same
    // path even when the staging bytes change under it (a planted bug's
    // decode racing its copy): no thread leaves a barrier or a shuffle
    // the others reach.
    __shared__ unsigned long long s_entry[5]; // blob_off, out_off, first, bytes, t_len
    __shared__ unsigned int s_code[2];        // code, ok
    __shared__ OpkHeader s_header;            // a window3 entry's, as checked
    if (threadIdx.x == 0u) {
        opk_block_entry(blob, blob_bytes, out_bytes, g, s_entry, s_code, &s_header);
    }
    __syncthreads();
    const unsigned long long blob_off = s_entry[0];
    const unsigned long long out_off = s_entry[1];
    const unsigned long long first = s_entry[2];
    const unsigned long long bytes = s_entry[3];
    const unsigned int code = s_code[0];
    if (s_code[1] == 0u) {
        if (threadIdx.x == 0u) {
            atomicExch(error, 2);
        }
        return; // uniform over the block: every thread returns
    }
    const unsigned int item = (unsigned int)(g - first);
    const unsigned char* t = blob + blob_off;
    unsigned char* dst = out + out_off;
    if (code == 1u) {
        opk_decode_tile(t, s_header, dst, item, error);
    } else {
        const unsigned long long at = (unsigned long long)item * OPK_RAW_CHUNK;
        const unsigned long long left = bytes - at;
        const unsigned int len = left < OPK_RAW_CHUNK ? (unsigned int)left : OPK_RAW_CHUNK;
        opk_copy_chunk(t + 64u + at, dst + at, len);
    }
}
