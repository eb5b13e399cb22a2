// Runs decode.cu's kernel on the CPU: each CUDA thread of a block is a
// std::thread, __syncthreads and __shfl_up_sync are block barriers, so the
// kernel's own code (not a port of it) decodes blobs the Rust encoder wrote.
// Usage: emu <blob> <copies> <misalign elems> <out>: decodes `copies`
// copies of the blob in one launch (a table of `copies` tensors), the
// outputs back to back, starting `misalign` bf16 elements past a 16-byte
// boundary; writes the outputs and prints the error flag.
#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct uint4 { unsigned int x, y, z, w; };
struct dim3 { unsigned int x, y, z; };
thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
static std::barrier<>* g_bar;
static unsigned int g_shfl[128];
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
inline unsigned int __popc(unsigned int x) { return (unsigned int)__builtin_popcount(x); }
inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline unsigned int __shfl_up_sync(unsigned int, unsigned int v, unsigned int d) {
    const unsigned int t = threadIdx.x;
    g_shfl[t] = v;
    g_bar->arrive_and_wait();
    const unsigned int r = ((t & 31u) >= d) ? g_shfl[t - d] : v;
    g_bar->arrive_and_wait();
    return r;
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)

#include "decode.cu"

int main(int argc, char** argv) {
    if (argc != 5) return 2;
    FILE* f = fopen(argv[1], "rb");
    if (!f) return 3;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char* blob = (unsigned char*)aligned_alloc(64, (len + 63) / 64 * 64);
    if (fread(blob, 1, len, f) != (size_t)len) return 4;
    fclose(f);
    const unsigned int copies = (unsigned int)atoi(argv[2]);
    const unsigned int misalign = (unsigned int)atoi(argv[3]);
    unsigned long long n, tiles32;
    memcpy(&n, blob + 8, 8);
    n /= 2;
    unsigned int tiles;
    memcpy(&tiles, blob + 20, 4);
    tiles32 = tiles;
    std::vector<unsigned short> out_buf(copies * n + misalign + 64, 0xdead);
    unsigned short* out = out_buf.data();
    while (((unsigned long long)out & 15ull) != 0) ++out;
    out += misalign;
    std::vector<OpkTensor> table(copies);
    for (unsigned int c = 0; c < copies; ++c) {
        table[c] = OpkTensor{blob, out + c * n, c * tiles32};
    }
    int error = 0;
    for (unsigned long long g = 0; g < copies * tiles32; ++g) {
        std::barrier<> bar(128);
        g_bar = &bar;
        std::vector<std::thread> threads;
        for (unsigned int t = 0; t < 128; ++t) {
            threads.emplace_back([&, t, g] {
                threadIdx = dim3{t, 0, 0};
                blockIdx = dim3{(unsigned int)g, 0, 0};
                opk_decode_window3(table.data(), copies, &error);
            });
        }
        for (auto& th : threads) th.join();
    }
    FILE* o = fopen(argv[4], "wb");
    fwrite(out, 2, copies * n, o);
    fclose(o);
    printf("error=%d\n", error);
    return 0;
}
