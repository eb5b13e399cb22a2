// The compute proxy's attention as the models' runtimes compute it: a
// FlashAttention-2-style fused forward (Dao, 2023), compiled at run time
// with nvrtc for compute_80 (mma.sync and ldmatrix; see proxy.rs). The
// scores never leave the SM: each CTA holds 64 query rows (16 per warp) in
// registers, walks the keys 64 at a time through shared memory, and keeps
// an online softmax (running row max m and sum l, the output rescaled by
// exp2(m_old - m_new) whenever the max moves).
//
//   O[h, t, :] = softmax(Q[h, t, :] · K[h, :, :]ᵀ / sqrt(D)) · V[h, :, :]
//
// Q, K, V and O are [heads][T][D] bf16 (row-major), f32 accumulation, P
// rounded to bf16 before P·V (as FlashAttention does). Non-causal, any
// T >= 1: keys past T are masked, query rows past T are not written.
// Deterministic: each output element is summed by one thread in a fixed
// order, so equal inputs give equal bits on every run.
//
// Grid (ceil(T / 64), heads), 128 threads, 2 · 64 · (D + 8) · 2 bytes of
// static shared memory (34,816 for D = 128): K's tile first holds Q.
// Rows are padded by 8 elements so ldmatrix's eight row addresses fall in
// distinct banks.

typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c (16x8 f32) += a (16x16 bf16, row) · b (16x8 bf16, col).
__device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 to a bf16 pair, `lo` in the low half (the lower column).
__device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

template <int D>
__device__ __forceinline__ void flash(const u16* __restrict__ q, const u16* __restrict__ k,
                                      const u16* __restrict__ v, u16* __restrict__ o, int T,
                                      float scale_log2) {
    constexpr int BM = 64, BN = 64, LD = D + 8, CH = D / 8, KS = D / 16, NS = BN / 8;
    __shared__ __align__(16) u16 ks[BN * LD];
    __shared__ __align__(16) u16 vs[BN * LD];
    const float neg_inf = __int_as_float(0xff800000u);
    const long long base = (long long)blockIdx.y * T * D;
    const int m0 = blockIdx.x * BM;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tig = lane & 3;
    // ldmatrix.x4: lane l gives row (l & 7) of matrix (l >> 3).
    const int mi = lane >> 3, ri = lane & 7;

    // Q's tile through K's shared memory into registers (A fragments).
    for (int i = tid; i < BM * CH; i += 128) {
        const int r = i / CH, c = i % CH;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (m0 + r < T) val = *(const uint4*)(q + base + (long long)(m0 + r) * D + c * 8);
        *(uint4*)(ks + r * LD + c * 8) = val;
    }
    __syncthreads();
    u32 qa[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        const int row = warp * 16 + ri + (mi & 1) * 8, col = kk * 16 + (mi >> 1) * 8;
        ldsm_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], smem_u32(ks + row * LD + col));
    }

    float acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    // Rows g and g + 8 of the warp's 16: running max (log2 units) and sum.
    float mrow[2] = {neg_inf, neg_inf}, lrow[2] = {0.f, 0.f};

    for (int n0 = 0; n0 < T; n0 += BN) {
        __syncthreads();  // every warp is done with the previous tile (and Q)
        for (int i = tid; i < BN * CH; i += 128) {
            const int r = i / CH, c = i % CH;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
            if (n0 + r < T) {
                const long long at = base + (long long)(n0 + r) * D + c * 8;
                kv = *(const uint4*)(k + at);
                vv = *(const uint4*)(v + at);
            }
            *(uint4*)(ks + r * LD + c * 8) = kv;
            *(uint4*)(vs + r * LD + c * 8) = vv;
        }
        __syncthreads();

        // S (16 x 64 per warp) = Q · Kᵀ.
        float s[NS][4];
#pragma unroll
        for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int j = 0; j < NS; j += 2) {
                const int key = j * 8 + ri + (mi >> 1) * 8, col = kk * 16 + (mi & 1) * 8;
                u32 b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, smem_u32(ks + key * LD + col));
                mma(s[j], qa[kk], b0, b1);
                mma(s[j + 1], qa[kk], b2, b3);
            }
        }

        // Online softmax in log2 units; keys past T masked.
        float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + j * 8 + 2 * tig + (e & 1);
                s[j][e] = key < T ? s[j][e] * scale_log2 : neg_inf;
            }
            mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        const float alpha[2] = {ex2(mrow[0] - mx[0]), ex2(mrow[1] - mx[1])};
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < NS; ++j) {
            s[j][0] = ex2(s[j][0] - mx[0]);
            s[j][1] = ex2(s[j][1] - mx[0]);
            s[j][2] = ex2(s[j][2] - mx[1]);
            s[j][3] = ex2(s[j][3] - mx[1]);
            rs[0] += s[j][0] + s[j][1];
            rs[1] += s[j][2] + s[j][3];
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lrow[r] = lrow[r] * alpha[r] + rs[r];
            mrow[r] = mx[r];
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            acc[j][0] *= alpha[0];
            acc[j][1] *= alpha[0];
            acc[j][2] *= alpha[1];
            acc[j][3] *= alpha[1];
        }

        // O += P · V, P's A fragments straight from S's accumulators.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 pa[4] = {pack(s[2 * kk][0], s[2 * kk][1]), pack(s[2 * kk][2], s[2 * kk][3]),
                               pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < D / 8; j += 2) {
                const int key = kk * 16 + ri + (mi & 1) * 8, col = j * 8 + (mi >> 1) * 8;
                u32 b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, smem_u32(vs + key * LD + col));
                mma(acc[j], pa, b0, b1);
                mma(acc[j + 1], pa, b2, b3);
            }
        }
    }

    // The four lanes of a quad hold parts of the same two rows' sums.
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = lrow[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = 1.f / l;
    }
    const int r0 = m0 + warp * 16 + g, r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        const int col = j * 8 + 2 * tig;
        if (r0 < T) {
            *(u32*)(o + base + (long long)r0 * D + col) = pack(acc[j][0] * inv[0], acc[j][1] * inv[0]);
        }
        if (r1 < T) {
            *(u32*)(o + base + (long long)r1 * D + col) = pack(acc[j][2] * inv[1], acc[j][3] * inv[1]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) flash_d64(const u16* q, const u16* k, const u16* v,
                                                            u16* o, int T, float scale_log2) {
    flash<64>(q, k, v, o, T, scale_log2);
}

extern "C" __global__ void __launch_bounds__(128) flash_d128(const u16* q, const u16* k, const u16* v,
                                                             u16* o, int T, float scale_log2) {
    flash<128>(q, k, v, o, T, scale_log2);
}
