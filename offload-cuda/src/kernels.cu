// The compute proxy's own kernels, compiled at run time with nvrtc (see
// proxy.rs). Checked by compiling it with libnvrtc 13.0 and 13.5.
//
// fold:  adds every byte of p[0..n), weighted by its position, into *sum
//        (an integer sum: the order threads run in does not change it).
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

extern "C" __global__ void fold(const unsigned char* p, u64 n, u64* sum) {
    u64 acc = 0ull;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        acc += ((u64)p[i] + 1ull) * ((i % 65521ull) + 1ull);
    }
    atomicAdd(sum, acc);
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
