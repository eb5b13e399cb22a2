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

// The escape slot of bit b of a word whose escape mask is `esc`, from the
// word's first escape: the escapes before it (every kernel's one place for
// it: a checking run plants its off-by-one here).
__device__ __forceinline__ unsigned int opk_slot(unsigned int esc, unsigned int b)
{
    return __popc(esc & ((1u << b) - 1u));
}

// Rebuilds the 32 bf16 values of one code word (planes p0, p1, p2, the
// 32 sign+mantissa bytes s0, s1, escape mask `esc`, `live` weights before
// the tensor's end, its first escape byte at `escapes`) into `packed`, two
// values a u32 (step 3 above).
__device__ __forceinline__ void opk_rebuild(unsigned int p0, unsigned int p1, unsigned int p2,
                                            const uint4 s0, const uint4 s1, unsigned int esc,
                                            unsigned int live, const unsigned char* escapes,
                                            unsigned int lo, unsigned int packed[16])
{
    const unsigned int sw[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
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
            exp = escapes[opk_slot(esc, b)];
        }
        const unsigned int v = opk_value(sm_byte, exp);
        if (b & 1u) {
            packed[b >> 1] |= v << 16;
        } else {
            packed[b >> 1] = v;
        }
    }
}

// Stores one word's `live` values (`packed`) at `dst`: four 16-byte stores
// when the output is 16-byte aligned and the word full, else 2-byte
// stores, else bytes (an odd output address: a tensor at an odd offset of
// its slot).
__device__ __forceinline__ void opk_store_word(unsigned char* dst, const unsigned int packed[16],
                                               unsigned int live)
{
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
    unsigned int packed[16];
    opk_rebuild(p0, p1, p2, smv[0], smv[1], esc, live, escapes, lo, packed);
    opk_store_word(out + 2ull * first, packed, live);
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
// Each 128-thread block takes OPK_BLOCK_ITEMS consecutive work items
// (block b: items b·OPK_BLOCK_ITEMS ..); thread 0 finds the entry of the
// first by binary search over the first work items, checks it, and the
// block keeps that decision (in shared memory, then registers) for every
// later item the entry holds: consecutive items share their entry, so the
// serial chain of header loads is paid once per entry and block, not once
// per item. A window3 entry's item (code 1) decodes one tile, a raw
// entry's (code 0) copies one OPK_RAW_CHUNK-byte chunk of its tensor
// blob's data (at +64) to its output, the last chunk partial. An item at
// or past the header's work count (the last thread block's padding, when
// the work items are no multiple of OPK_BLOCK_ITEMS) does nothing, once
// the header agrees with its table (the count is the last entry's first
// work item plus its work items).
// The kernel also bounds what it reads and writes by `blob_bytes` (the
// coded bytes in the staging buffer) and `out_bytes` (the unit): an entry
// that does not hold the work item, an unknown code, a header whose work
// count disagrees with its table, or a table, tensor header or output
// range outside those bounds sets *error to 2 and writes nothing for that
// item (`BlockView::parse` rules all of them out; a staging buffer read
// before its copy landed, a planted ordering bug, does not). Every branch
// around a barrier or a shuffle reads shared memory or the block's
// registers, never the blob: control flow stays uniform over the block
// even when the staging bytes change under it.
//
// Tunables (each `#ifndef`: a benchmark compiles variants with `#define`s
// before the source; the defaults are the variant measured fastest,
// `decode_bench --variants` on the H200 2026-12-02: 4 items, OPK_PATCH 2,
// 10 resident blocks (48 registers), 2.20 TB/s on a Flux double block and
// 2.10 on a single one, against 1.17 for one item a block and the
// per-weight escape test; `offload_pack::kernels::DECODE_BLOCK_ITEMS` is
// OPK_BLOCK_ITEMS):
//   OPK_BLOCK_ITEMS       work items per thread block;
//   OPK_BLOCK_MIN_BLOCKS  __launch_bounds__'s resident blocks per SM (0:
//                         none given);
//   OPK_PREFETCH          1: a tile's planes, sign+mantissa bytes and
//                         escape index are loaded while the tile before it
//                         in the same entry is rebuilt and stored;
//   OPK_SMEM_STORE        1: a full, 16-byte aligned tile's values go
//                         through shared memory (a warp's 2 KiB, XOR
//                         swizzled, no bank conflicts) and out as 512-byte
//                         contiguous warp stores instead of each thread's
//                         64 contiguous bytes;
//   OPK_PATCH             1 (2: four weights at a time in byte and 16-bit
//                         lanes of a u32): a tile's 32 values a thread
//                         are built with no escape test per weight
//                         (an escape's exponent is wrong), staged in shared
//                         memory as OPK_SMEM_STORE stages them (a full,
//                         aligned tile stored as it does, any other a
//                         thread's own values), then each escape
//                         (2-4 % of weights) is patched there from its
//                         escape byte before the warp stores: the
//                         per-weight escape select, slot popcount and
//                         predicated byte load leave the hot loop.

#ifndef OPK_BLOCK_ITEMS
#define OPK_BLOCK_ITEMS 4u
#endif
#ifndef OPK_BLOCK_MIN_BLOCKS
#define OPK_BLOCK_MIN_BLOCKS 10
#endif
#ifndef OPK_PREFETCH
#define OPK_PREFETCH 0
#endif
#ifndef OPK_SMEM_STORE
#define OPK_SMEM_STORE 0
#endif
#ifndef OPK_PATCH
#define OPK_PATCH 2
#endif

// A host build (the CPU emulator in offload-pack/tests/cuda_emu, the
// syntax shim) has a one-argument __launch_bounds__ and no __syncwarp;
// there every OPK_SYNCWARP is block-uniform, so a block barrier stands in.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define OPK_SYNCWARP() __syncwarp()
#if OPK_BLOCK_MIN_BLOCKS > 0
#define OPK_BLOCK_BOUNDS __launch_bounds__(128, OPK_BLOCK_MIN_BLOCKS)
#endif
#else
#define OPK_SYNCWARP() __syncthreads()
#endif
#ifndef OPK_BLOCK_BOUNDS
#define OPK_BLOCK_BOUNDS __launch_bounds__(128)
#endif

#define OPK_RAW_CHUNK 8192u
#define OPK_BLOCK_HEADER 64u
#define OPK_ENTRY_BYTES 32u

// Copies `len` (≤ OPK_RAW_CHUNK) bytes from `src` to `dst`: 16-byte
// vectors (coalesced, thread w takes vectors w, w + 128, ...) where both
// are 16-byte aligned (a full chunk's four loads issued before its
// stores), bytes for the rest and for any other alignment.
__device__ __forceinline__ void opk_copy_chunk(const unsigned char* src, unsigned char* dst,
                                               unsigned int len)
{
    const unsigned int w = threadIdx.x;
    unsigned int done = 0;
    if (((((unsigned long long)src) | ((unsigned long long)dst)) & 15ull) == 0ull) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        if (len == OPK_RAW_CHUNK) {
            const uint4 a = s[w];
            const uint4 b = s[w + OPK_WORDS];
            const uint4 c = s[w + 2u * OPK_WORDS];
            const uint4 e = s[w + 3u * OPK_WORDS];
            d[w] = a;
            d[w + OPK_WORDS] = b;
            d[w + 2u * OPK_WORDS] = c;
            d[w + 3u * OPK_WORDS] = e;
            return;
        }
        const unsigned int vectors = len >> 4;
        for (unsigned int v = w; v < vectors; v += OPK_WORDS) {
            d[v] = s[v];
        }
        done = vectors << 4;
    }
    for (unsigned int i = done + w; i < len; i += OPK_WORDS) {
        dst[i] = src[i];
    }
}

// Thread 0's decision for a run of work items: the entry holding work item
// `g`, checked, and the items of it this decision covers.
struct OpkRun {
    unsigned long long blob_off; // the tensor blob's offset in the block blob
    unsigned long long out_off;  // its output's offset in the unit
    unsigned long long first;    // its first work item
    unsigned long long end;      // one past the last item the decision covers
    unsigned long long bytes;    // its decoded bytes
    OpkHeader h;                 // a window3 entry's header fields, as checked
    unsigned int code;
    unsigned int state;          // 0: refused (flag 2), 1: decode, 2: padding
};

// The block kernel's decision for work item `g` (thread 0 alone): the
// entry holding it and whether every bound holds. `end` is the first item
// past it the decision does not cover: the entry's end, its tiles' or
// chunks' end, or the header's work count, whichever is first (so every
// item in [g, end) passes every check `g` passed).
__device__ __forceinline__ void opk_block_entry(const unsigned char* blob,
                                                unsigned long long blob_bytes,
                                                unsigned long long out_bytes,
                                                unsigned long long g, OpkRun* run)
{
    unsigned int n = 0;
    unsigned long long work = 0;
    if (blob_bytes >= OPK_BLOCK_HEADER) {
        n = *(const unsigned int*)(blob + 8);
        work = opk_u64(blob + 24);
    }
    if ((unsigned long long)n * OPK_ENTRY_BYTES + OPK_BLOCK_HEADER > blob_bytes) {
        n = 0; // a table past the coded bytes: refused below
    }
    const unsigned char* table = blob + OPK_BLOCK_HEADER;
    bool ok = n != 0u;
    if (ok) {
        // The work count must be the table's: the last entry's end.
        const unsigned char* last = table + (unsigned long long)(n - 1u) * OPK_ENTRY_BYTES;
        const unsigned long long last_first = opk_u64(last + 16);
        const unsigned long long last_items = *(const unsigned int*)(last + 24);
        ok = last_first <= work && work - last_first == last_items;
    }
    if (ok && g >= work) {
        run->end = g;
        run->state = 2u; // padding past the block's work items
        return;
    }
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
    unsigned long long first = 0, blob_off = 0, out_off = 0, bytes = 0, t_len = 0, end = 0;
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
        end = first + (unsigned long long)items; // no wrap: g - first < items
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
            // Items whose chunk starts before the data's end.
            const unsigned long long chunks =
                bytes / OPK_RAW_CHUNK + ((bytes % OPK_RAW_CHUNK) != 0ull ? 1ull : 0ull);
            if (first + chunks < end) {
                end = first + chunks;
            }
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
            if (first + tiles < end) {
                end = first + tiles;
            }
            run->h = h;
        }
    }
    if (work < end) {
        end = work;
    }
    run->blob_off = blob_off;
    run->out_off = out_off;
    run->first = first;
    run->end = ok ? end : g + 1u;
    run->bytes = bytes;
    run->code = code;
    run->state = ok ? 1u : 0u;
}

// One tile's inputs, loaded before they are used: thread w's three plane
// words and 32 sign+mantissa bytes, and (thread 0) the tile's escape
// index pair.
struct OpkTileIn {
    unsigned int p0, p1, p2;
    uint4 s0, s1;
    unsigned int start, end;
};

__device__ __forceinline__ OpkTileIn opk_tile_load(const unsigned char* t, unsigned long long codes_off,
                                                   unsigned long long idx_off, unsigned int tile)
{
    const unsigned int w = threadIdx.x;
    OpkTileIn in;
    const unsigned int* planes =
        (const unsigned int*)(t + codes_off + (unsigned long long)tile * OPK_TILE_CODE_BYTES);
    in.p0 = planes[w];
    in.p1 = planes[OPK_PLANE_WORDS + w];
    in.p2 = planes[2u * OPK_PLANE_WORDS + w];
    const uint4* smv = (const uint4*)(t + 64ull + (unsigned long long)tile * OPK_TILE + 32ull * w);
    in.s0 = smv[0];
    in.s1 = smv[1];
    in.start = 0;
    in.end = 0;
    if (w == 0u) {
        const unsigned int* index = (const unsigned int*)(t + idx_off);
        in.start = index[tile];
        in.end = index[tile + 1u];
    }
    return in;
}

// __byte_perm (PRMT); a host build has none: the same selection in C.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define OPK_PRMT(x, y, s) __byte_perm((x), (y), (s))
#else
__device__ __forceinline__ unsigned int OPK_PRMT(unsigned int x, unsigned int y, unsigned int s)
{
    const unsigned long long xy = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (unsigned int i = 0; i < 4u; ++i) {
        r |= (unsigned int)((xy >> (8u * ((s >> (4u * i)) & 7u))) & 0xffu) << (8u * i);
    }
    return r;
}
#endif

// Bit k of the nibble `n` to bit 8k (k < 4): the partial products of
// n · (1 + 2^7 + 2^14 + 2^21) never overlap.
__device__ __forceinline__ unsigned int opk_spread4(unsigned int n)
{
    return (n * 0x00204081u) & 0x01010101u;
}

// Decodes tile `tile` of the window3 blob at `t` (its checked header `h`)
// from its loaded inputs `in` into the tensor at `out`. `sums` (6 words of
// shared memory, the caller alternating two sets tile by tile) carry the
// warp sums and thread 0's escape index pair across the barrier, so that
// every thread takes the decision on the same values. `stage` (shared,
// 2 KiB a warp) is the OPK_SMEM_STORE staging.
__device__ __forceinline__ void opk_block_tile(const unsigned char* t, const OpkHeader& h,
                                               unsigned char* out, unsigned int tile,
                                               const OpkTileIn& in, unsigned int* sums,
                                               uint4* stage, int* error)
{
    const unsigned int w = threadIdx.x;
    const unsigned int lane = w & 31u;
    const unsigned int warp = w >> 5;
    const unsigned long long n = h.n;
    const unsigned long long first = (unsigned long long)tile * OPK_TILE + 32ull * w;
    unsigned int live = 0;
    if (n > first) {
        live = (n - first >= 32ull) ? 32u : (unsigned int)(n - first);
    }
    const unsigned int live_mask = (live == 32u) ? 0xffffffffu : ((1u << live) - 1u);
    const unsigned int esc = ~(in.p0 | in.p1 | in.p2) & live_mask;
    const unsigned int count = __popc(esc);

    unsigned int incl = count;
    for (unsigned int d = 1; d < 32u; d <<= 1) {
        const unsigned int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) {
            incl += v;
        }
    }
    if (lane == 31u) {
        sums[warp] = incl;
    }
    if (w == 0u) {
        sums[4] = in.start;
        sums[5] = in.end;
    }
    __syncthreads();
    const unsigned int before = (warp > 0u ? sums[0] : 0u) + (warp > 1u ? sums[1] : 0u)
        + (warp > 2u ? sums[2] : 0u);
    const unsigned int total = sums[0] + sums[1] + sums[2] + sums[3];
    const unsigned int start = sums[4];
    const unsigned int end = sums[5];
    if (end < start || end - start != total || h.esc_off + end > h.blob_len) {
        if (w == 0u) {
            atomicExch(error, 1);
        }
        return; // uniform: every thread read the same shared values
    }
    const unsigned char* escapes = t + h.esc_off + start + (before + incl - count);
#if OPK_PATCH
    {
        uint4* s = stage + warp * 128u;
        unsigned short* s16 = (unsigned short*)s;
        const unsigned int x = (lane >> 1) & 3u;
        const unsigned int p0 = in.p0, p1 = in.p1, p2 = in.p2;
        const unsigned int sw[8] = {in.s0.x, in.s0.y, in.s0.z, in.s0.w,
                                    in.s1.x, in.s1.y, in.s1.z, in.s1.w};
        const unsigned int lo = h.lo;
        OPK_SYNCWARP(); // the warp's reads of the previous tile's staging are done
        // Value b of the thread is u16 (lane·4 + ((b >> 3) ^ x))·8 + (b & 7)
        // of the warp's staging: its 16-byte chunks XOR swizzled, so that
        // neither these stores nor the warp's reads below conflict.
#if OPK_PATCH == 2
        // Four weights at a time: their 3-bit codes spread into byte lanes
        // (a nibble of each plane times 0x204081), two weights a u32 in
        // 16-bit lanes, exponent (code + lo + 255) mod 256 = lo + code - 1
        // (no lane carries: at most 517), sign and mantissa from the byte
        // doubled into its lane (s · 0x101: bit 7 lands on bit 15).
        const unsigned int l2 = ((lo + 255u) | ((lo + 255u) << 16)) << 7;
#pragma unroll
        for (unsigned int j = 0; j < 4u; ++j) {
            unsigned int q[4];
#pragma unroll
            for (unsigned int hf = 0; hf < 2u; ++hf) {
                const unsigned int g = 2u * j + hf; // weights 4g .. 4g + 3
                const unsigned int c = opk_spread4((p0 >> (4u * g)) & 15u)
                    | (opk_spread4((p1 >> (4u * g)) & 15u) << 1)
                    | (opk_spread4((p2 >> (4u * g)) & 15u) << 2);
                const unsigned int smw = sw[g];
#pragma unroll
                for (unsigned int k = 0; k < 2u; ++k) {
                    // Bytes 2k, 2k + 1 to the low bytes of the two lanes.
                    const unsigned int sel = k == 0u ? 0x4140u : 0x4342u;
                    const unsigned int cp = OPK_PRMT(c, 0u, sel);
                    const unsigned int sp = OPK_PRMT(smw, 0u, sel);
                    const unsigned int e7 = cp * 128u + l2;
                    const unsigned int t2 = sp * 0x101u;
                    // Bits 15 and 0..6 of each lane from t2, 7..14 from e7.
                    q[2u * hf + k] = e7 ^ ((e7 ^ t2) & 0x807f807fu);
                }
            }
            s[lane * 4u + (j ^ x)] = make_uint4(q[0], q[1], q[2], q[3]);
        }
#else
#pragma unroll
        for (unsigned int j = 0; j < 4u; ++j) {
            unsigned int q[4];
#pragma unroll
            for (unsigned int i = 0; i < 4u; ++i) {
                unsigned int v[2];
#pragma unroll
                for (unsigned int k = 0; k < 2u; ++k) {
                    const unsigned int b = 8u * j + 2u * i + k;
                    const unsigned int code =
                        ((p0 >> b) & 1u) | (((p1 >> b) & 1u) << 1) | (((p2 >> b) & 1u) << 2);
                    const unsigned int sm_byte = (sw[b >> 2] >> ((b & 3u) * 8u)) & 0xffu;
                    v[k] = opk_value(sm_byte, lo + code - 1u); // an escape's: patched below
                }
                q[i] = v[0] | (v[1] << 16);
            }
            s[lane * 4u + (j ^ x)] = make_uint4(q[0], q[1], q[2], q[3]);
        }
#endif
        // The thread's escapes (bits of `esc`: none past the tensor's end),
        // two loads in flight a round: the exponent bits (7..14) of each
        // escape's staged value replaced by its escape byte.
        unsigned int m = esc;
        while (m != 0u) {
            const unsigned int b0 = __popc((m & (0u - m)) - 1u);
            m &= m - 1u;
            const bool two = m != 0u;
            const unsigned int b1 = two ? __popc((m & (0u - m)) - 1u) : b0;
            if (two) {
                m &= m - 1u;
            }
            const unsigned int e0 = escapes[opk_slot(esc, b0)];
            const unsigned int e1 = two ? (unsigned int)escapes[opk_slot(esc, b1)] : e0;
            unsigned short* a0 = s16 + (lane * 4u + ((b0 >> 3) ^ x)) * 8u + (b0 & 7u);
            *a0 = (unsigned short)((*a0 & 0x807fu) | (e0 << 7));
            if (two) {
                unsigned short* a1 = s16 + (lane * 4u + ((b1 >> 3) ^ x)) * 8u + (b1 & 7u);
                *a1 = (unsigned short)((*a1 & 0x807fu) | (e1 << 7));
            }
        }
        unsigned char* dst = out + 2ull * first;
        // The whole tile full and its output 16-byte aligned (the same for
        // every thread of the block): 512-byte warp stores.
        if (n >= (unsigned long long)(tile + 1u) * OPK_TILE
            && (((unsigned long long)(out + 2ull * (unsigned long long)tile * OPK_TILE)) & 15ull) == 0ull) {
            OPK_SYNCWARP();
            uint4* d = (uint4*)(out + 2ull * ((unsigned long long)tile * OPK_TILE + 1024ull * warp));
#pragma unroll
            for (unsigned int i = 0; i < 4u; ++i) {
                const unsigned int c = i * 32u + lane;
                const unsigned int owner = c >> 2;
                d[c] = s[owner * 4u + ((c & 3u) ^ ((owner >> 1) & 3u))];
            }
        } else if (live == 32u && (((unsigned long long)dst) & 15ull) == 0ull) {
            // The thread's own values back (no other thread's: no barrier).
            uint4* d = (uint4*)dst;
#pragma unroll
            for (unsigned int j = 0; j < 4u; ++j) {
                d[j] = s[lane * 4u + (j ^ x)];
            }
        } else if ((((unsigned long long)dst) & 1ull) == 0ull) {
            unsigned short* d = (unsigned short*)dst;
            for (unsigned int b = 0; b < live; ++b) {
                d[b] = s16[(lane * 4u + ((b >> 3) ^ x)) * 8u + (b & 7u)];
            }
        } else {
            // An odd output address (a tensor at an odd offset of its slot).
            for (unsigned int b = 0; b < live; ++b) {
                const unsigned int v = s16[(lane * 4u + ((b >> 3) ^ x)) * 8u + (b & 7u)];
                dst[2u * b] = (unsigned char)(v & 0xffu);
                dst[2u * b + 1u] = (unsigned char)((v >> 8) & 0xffu);
            }
        }
        return;
    }
#else
    unsigned int packed[16];
    opk_rebuild(in.p0, in.p1, in.p2, in.s0, in.s1, esc, live, escapes, h.lo, packed);
    unsigned char* dst = out + 2ull * first;
#if OPK_SMEM_STORE
    // The whole tile full and its output 16-byte aligned: the same for
    // every thread of the block.
    const unsigned char* tile_out = out + 2ull * (unsigned long long)tile * OPK_TILE;
    if (n >= (unsigned long long)(tile + 1u) * OPK_TILE && (((unsigned long long)tile_out) & 15ull) == 0ull) {
        uint4* s = stage + warp * 128u;
        const unsigned int x = (lane >> 1) & 3u;
        OPK_SYNCWARP(); // the warp's reads of the previous tile's staging are done
#pragma unroll
        for (unsigned int j = 0; j < 4u; ++j) {
            s[lane * 4u + (j ^ x)] =
                make_uint4(packed[4u * j], packed[4u * j + 1u], packed[4u * j + 2u], packed[4u * j + 3u]);
        }
        OPK_SYNCWARP();
        uint4* d = (uint4*)(out + 2ull * ((unsigned long long)tile * OPK_TILE + 1024ull * warp));
#pragma unroll
        for (unsigned int i = 0; i < 4u; ++i) {
            const unsigned int c = i * 32u + lane;
            const unsigned int owner = c >> 2;
            d[c] = s[owner * 4u + ((c & 3u) ^ ((owner >> 1) & 3u))];
        }
        return;
    }
#else
    (void)stage;
#endif
    opk_store_word(dst, packed, live);
#endif
}

// Decodes the coded block `blob` (the staging buffer: 256-byte aligned, so
// every tensor blob is 64-byte aligned; `blob_bytes` of it are the block's)
// into `out` (the slot; `out_bytes` of it are the unit's), grid.x = the
// block's work items (header u64 at byte 24) divided by OPK_BLOCK_ITEMS,
// rounded up (a larger grid is harmless: its items are padding),
// blockDim.x = 128. A tile whose escape index disagrees with its codes
// sets *error to 1.
extern "C" __global__ void OPK_BLOCK_BOUNDS opk_decode_block(
    const unsigned char* blob, unsigned long long blob_bytes, unsigned char* out,
    unsigned long long out_bytes, int* error)
{
    // Thread 0 reads the header and the entry and decides; the block reads
    // its decision from shared memory, so that every thread takes the same
    // path even when the staging bytes change under it (a planted bug's
    // decode racing its copy): no thread leaves a barrier or a shuffle
    // the others reach.
    __shared__ OpkRun s_run;
    __shared__ unsigned int s_sums[2][6];
#if OPK_SMEM_STORE || OPK_PATCH
    __shared__ uint4 s_stage[4u * 128u];
    uint4* stage = s_stage;
#else
    uint4* stage = 0;
#endif
    const unsigned long long g0 = (unsigned long long)blockIdx.x * OPK_BLOCK_ITEMS;
    // The decision in force is s_run (items [s_run.first, s_run.end) of its
    // entry are decoded with it): read from shared memory where used, not
    // held in registers across the loop, and rewritten only between two
    // barriers every thread reaches.
    bool have = false;
    unsigned int parity = 0;
#if OPK_PREFETCH
    OpkTileIn next;
    bool have_next = false;
#endif
#pragma unroll 1
    for (unsigned int k = 0; k < OPK_BLOCK_ITEMS; ++k) {
        const unsigned long long g = g0 + k;
        if (!(have && g < s_run.end)) {
            __syncthreads(); // every thread is done reading the last decision
            if (threadIdx.x == 0u) {
                opk_block_entry(blob, blob_bytes, out_bytes, g, &s_run);
            }
            __syncthreads();
            const unsigned int state = s_run.state;
            if (state == 2u) {
                break; // padding: so is every later item
            }
            if (state == 0u) {
                if (threadIdx.x == 0u) {
                    atomicExch(error, 2);
                }
                have = false;
                continue; // uniform over the block
            }
            have = true;
#if OPK_PREFETCH
            have_next = false;
#endif
        }
        const unsigned int item = (unsigned int)(g - s_run.first);
        const unsigned char* t = blob + s_run.blob_off;
        unsigned char* dst = out + s_run.out_off;
        if (s_run.code == 1u) {
#if OPK_PREFETCH
            const OpkTileIn in =
                have_next ? next : opk_tile_load(t, s_run.h.codes_off, s_run.h.idx_off, item);
            have_next = k + 1u < OPK_BLOCK_ITEMS && g + 1u < s_run.end;
            if (have_next) {
                next = opk_tile_load(t, s_run.h.codes_off, s_run.h.idx_off, item + 1u);
            }
#else
            const OpkTileIn in = opk_tile_load(t, s_run.h.codes_off, s_run.h.idx_off, item);
#endif
            opk_block_tile(t, s_run.h, dst, item, in, s_sums[parity], stage, error);
            parity ^= 1u;
        } else {
            const unsigned long long at = (unsigned long long)item * OPK_RAW_CHUNK;
            const unsigned long long left = s_run.bytes - at;
            const unsigned int len = left < OPK_RAW_CHUNK ? (unsigned int)left : OPK_RAW_CHUNK;
            opk_copy_chunk(t + 64u + at, dst + at, len);
        }
    }
}
