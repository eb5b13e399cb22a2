// Runs decode.cu's opk_decode_block on the CPU, as emu.cc runs
// opk_decode_window3 (each CUDA thread of a block a std::thread,
// __syncthreads and __shfl_up_sync block barriers): the kernel's own code
// decodes a coded block (OPB1) the Rust encoder wrote.
// Usage: emu_block <block blob> <misalign bytes> <out>: the blob in a
// 256-byte aligned "staging buffer", the output starting `misalign` bytes
// past a 16-byte boundary, grid = the header's work items; writes the
// decoded unit and prints the error flag.
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
    if (argc != 4) return 2;
    FILE* f = fopen(argv[1], "rb");
    if (!f) return 3;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char* blob = (unsigned char*)aligned_alloc(256, (len + 255) / 256 * 256);
    if (fread(blob, 1, len, f) != (size_t)len) return 4;
    fclose(f);
    const unsigned int misalign = (unsigned int)atoi(argv[2]);
    unsigned long long decoded, work;
    memcpy(&decoded, blob + 16, 8);
    memcpy(&work, blob + 24, 8);
    std::vector<unsigned char> out_buf(decoded + misalign + 64, 0xa5);
    unsigned char* out = out_buf.data();
    while (((unsigned long long)out & 15ull) != 0) ++out;
    out += misalign;
    int error = 0;
    for (unsigned long long g = 0; g < work; ++g) {
        std::barrier<> bar(128);
        g_bar = &bar;
        std::vector<std::thread> threads;
        for (unsigned int t = 0; t < 128; ++t) {
            threads.emplace_back([&, t, g] {
                threadIdx = dim3{t, 0, 0};
                blockIdx = dim3{(unsigned int)g, 0, 0};
                opk_decode_block(blob, (unsigned long long)len, out, decoded, &error);
            });
        }
        for (auto& th : threads) th.join();
    }
    FILE* o = fopen(argv[3], "wb");
    fwrite(out, 1, decoded, o);
    fclose(o);
    printf("error=%d\n", error);
    return 0;
}
