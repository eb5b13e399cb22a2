// Flux's elementwise work as three kernels (see fused.rs), compiled once
// per process with nvrtc. No headers: bf16 is carried as its 16 bits and
// widened or rounded here, as the hardware's conversions do (round to
// nearest even; a NaN stays a quiet NaN of its sign).
//
// qk_norm_rope: in place over x [rows, heads, 128] bf16 (q or k in
//        [B, L, H, D]), one warp per (row, head), four values per lane:
//        diffusers' RMSNorm (f32 mean of squares, x·rsqrt(mean + eps)
//        rounded to bf16, times the weight rounded again; rows below
//        `split` take w0, the rest w1, so the text and image halves of a
//        double block's joint sequence are one launch) then its RoPE on
//        interleaved pairs in f32 (x·cos + rot(x)·sin, each product rounded
//        to f32 before the sum, as PyTorch's separate kernels do), one
//        rounding to bf16. cos and sin are [rows, 64] f32.
// gate_residual: out = x + g ⊙ y for x, y, out [n] and g [h] broadcast over
//        rows, eight values (16 bytes) a thread: the product rounded to
//        bf16, then the sum, as diffusers' two kernels round.
// copy_cols: src [rows, cols] into columns off.. of dst [rows, ld], 16
//        bytes a thread (the attention's output beside the single block's
//        MLP, in the buffer its output projection reads).

typedef unsigned short bf16;
typedef unsigned int u32;

__device__ __forceinline__ float wide(u32 bits) {
    return __uint_as_float((bits & 0xffffu) << 16);
}

__device__ __forceinline__ u32 round_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return ((u >> 16) | 0x40u) & 0xffffu;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

__device__ __forceinline__ float bf(float f) {
    return wide(round_bf16(f));
}

extern "C" __global__ void qk_norm_rope(
    bf16* x, const bf16* w0, const bf16* w1, const float* cos_t, const float* sin_t,
    int rows, int heads, int split, float eps) {
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= (long long)rows * heads) {
        return;
    }
    int row = (int)(warp / heads);
    uint2* p = (uint2*)(x + warp * 128) + lane;
    uint2 v = *p;
    float a[4] = {wide(v.x), wide(v.x >> 16), wide(v.y), wide(v.y >> 16)};
    float ss = __fmul_rn(a[0], a[0]);
    ss = __fadd_rn(ss, __fmul_rn(a[1], a[1]));
    ss = __fadd_rn(ss, __fmul_rn(a[2], a[2]));
    ss = __fadd_rn(ss, __fmul_rn(a[3], a[3]));
    for (int o = 16; o > 0; o >>= 1) {
        ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
    }
    float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, 128.0f), eps));
    uint2 wv = ((const uint2*)(row < split ? w0 : w1))[lane];
    float w[4] = {wide(wv.x), wide(wv.x >> 16), wide(wv.y), wide(wv.y >> 16)};
    float y[4];
    for (int i = 0; i < 4; ++i) {
        y[i] = bf(__fmul_rn(bf(__fmul_rn(a[i], r)), w[i]));
    }
    float2 c = ((const float2*)(cos_t + (long long)row * 64))[lane];
    float2 s = ((const float2*)(sin_t + (long long)row * 64))[lane];
    u32 o0 = round_bf16(__fadd_rn(__fmul_rn(y[0], c.x), -__fmul_rn(y[1], s.x)));
    u32 o1 = round_bf16(__fadd_rn(__fmul_rn(y[1], c.x), __fmul_rn(y[0], s.x)));
    u32 o2 = round_bf16(__fadd_rn(__fmul_rn(y[2], c.y), -__fmul_rn(y[3], s.y)));
    u32 o3 = round_bf16(__fadd_rn(__fmul_rn(y[3], c.y), __fmul_rn(y[2], s.y)));
    uint2 out;
    out.x = o0 | (o1 << 16);
    out.y = o2 | (o3 << 16);
    *p = out;
}

__device__ __forceinline__ u32 gate_pair(u32 x, u32 y, u32 g) {
    u32 lo = round_bf16(__fadd_rn(wide(x), bf(__fmul_rn(wide(y), wide(g)))));
    u32 hi = round_bf16(__fadd_rn(wide(x >> 16), bf(__fmul_rn(wide(y >> 16), wide(g >> 16)))));
    return lo | (hi << 16);
}

extern "C" __global__ void gate_residual(
    const bf16* x, const bf16* y, const bf16* g, bf16* out, long long n8, int h8) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) {
        return;
    }
    int col = (int)(i % h8);
    uint4 xv = ((const uint4*)x)[i];
    uint4 yv = ((const uint4*)y)[i];
    uint4 gv = ((const uint4*)g)[col];
    uint4 o;
    o.x = gate_pair(xv.x, yv.x, gv.x);
    o.y = gate_pair(xv.y, yv.y, gv.y);
    o.z = gate_pair(xv.z, yv.z, gv.z);
    o.w = gate_pair(xv.w, yv.w, gv.w);
    ((uint4*)out)[i] = o;
}

extern "C" __global__ void copy_cols(
    const bf16* src, bf16* dst, long long rows, int cols8, int ld8, int off8) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols8) {
        return;
    }
    long long r = i / cols8;
    int c = (int)(i % cols8);
    ((uint4*)dst)[r * ld8 + off8 + c] = ((const uint4*)src)[i];
}
