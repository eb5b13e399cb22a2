// The compute proxy's own kernels, compiled at run time with nvrtc (see
// proxy.rs). Checked by compiling it with libnvrtc 13.0 and 13.5.
//
// fold:  adds every byte of p[0..n) into *sum, each weighted by its
//        position: (p[i] + 1) * (2i + 1), an integer sum mod 2^64, so the
//        order threads run in does not change it. The aligned middle is
//        read 16 bytes at a time (the same per-byte term, so the value does
//        not depend on the range's alignment); one atomic per warp. It
//        reads at memory bandwidth: about 6 ms for Flux's 23.8 GB.
// chain: one block. Thread 0 folds *sum into *state with a non-commutative
//        mix, clears *sum and publishes the new state; then every thread
//        rewrites its share of x[0..k) (bf16 activations) from the state as
//        small finite values (high byte 0x3c or 0x3d, sign from the hash),
//        so the next block's GEMMs depend on everything folded before.

typedef unsigned long long u64;
typedef unsigned short u16;

__device__ __forceinline__ u64 splitmix(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

__device__ __forceinline__ u64 term(u64 byte, u64 i) {
    return (byte + 1ull) * (2ull * i + 1ull);
}

extern "C" __global__ void fold(const unsigned char* p, u64 n, u64* sum) {
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 head = (16ull - ((u64)p & 15ull)) & 15ull;
    if (head > n) head = n;
    const u64 words = (n - head) / 16ull;
    const u64 tail = head + words * 16ull;
    u64 acc = 0ull;
    for (u64 i = tid; i < head; i += stride) acc += term(p[i], i);
    for (u64 i = tail + tid; i < n; i += stride) acc += term(p[i], i);
    const uint4* q = (const uint4*)(p + head);
    for (u64 w = tid; w < words; w += stride) {
        const uint4 v = q[w];
        const unsigned int parts[4] = {v.x, v.y, v.z, v.w};
        const u64 base = head + w * 16ull;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            acc += term((parts[k >> 2] >> ((k & 3) * 8)) & 0xffu, base + (u64)k);
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_down_sync(0xffffffffu, acc, off);
    }
    if ((threadIdx.x & 31u) == 0u) atomicAdd(sum, acc);
}

extern "C" __global__ void chain(u64* state, u64* sum, u16* x, u64 k) {
    __shared__ u64 next;
    if (threadIdx.x == 0) {
        u64 h = splitmix(*state ^ *sum);
        h = (h << 23) | (h >> 41);
        *state = h;
        *sum = 0ull;
        next = h;
    }
    __syncthreads();
    const u64 s = next;
    for (u64 i = threadIdx.x; i < k; i += blockDim.x) {
        const u64 h = splitmix(s ^ (i * 0xd1b54a32d192ed03ull));
        const unsigned int high = 0x3cu + (unsigned int)((h >> 8) & 1ull);
        const unsigned int sign = (unsigned int)((h >> 9) & 1ull) << 15;
        x[i] = (u16)(sign | (high << 8) | (unsigned int)(h & 0xffull));
    }
}

// touch: memory traffic standing for a model's elementwise work (norms,
//        modulation, activations, residual adds): `passes` times over
//        dst[0..words) = src[0..words) ^ pass, 16 bytes per access; each
//        thread rewrites the same words every pass (no two threads write
//        one word). Moves 2 · 16 · words · passes bytes.
extern "C" __global__ void touch(const uint4* src, uint4* dst, u64 words, u64 passes) {
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 p = 0; p < passes; ++p) {
        const unsigned int k = (unsigned int)p;
        for (u64 w = tid; w < words; w += stride) {
            uint4 v = src[w];
            v.x ^= k;
            v.y ^= k;
            v.z ^= k;
            v.w ^= k;
            dst[w] = v;
        }
    }
}
