// ---------------------------------------------------------------- forward (mma.sync, sm_80+)
#include "common.cuh"
#include "params.cuh"

#ifndef FWD_MR
#define FWD_MR 1 // 16-row MMA tiles per warp: K/V fragments read from smem are reused MR times
#endif
#define FWD_WM (16 * FWD_MR)
#define FWD_BM (FWD_WM * FWD_WARPS)
#define FWD_NT (32 * FWD_WARPS)
#define Q_IN_REGS (D * FWD_MR <= 128)

#ifndef FWD_WG
#define FWD_WG 0
#endif
#if !FWD_WG // (sm_90a at d 64/128: flash_fwd_ws in sm90/forward.cu)
extern "C" __global__ void __launch_bounds__(FWD_NT) flash_fwd(const FwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* Qs = (elem_t*)smem_raw;
    elem_t* Ks = Qs + FWD_BM * LDS;
    elem_t* Vs = Ks + 2 * FWD_BN * LDS;

    const FwdBlock fb = fwd_block(p);
    const int qt = fb.qt, h = fb.h, kvh = fb.kvh, b = fb.b;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int q0 = qt * FWD_BM;
    const int wr0 = warp * FWD_WM; // this warp's first row in the tile
    const size_t qs = (size_t)p.heads * D, ks = (size_t)p.kv_heads * D;
    const elem_t* qbase = p.q + ((size_t)b * p.q_len * p.heads + h) * D;
    const elem_t* kbase = p.k + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    const elem_t* vbase = p.v + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    const int e0 = p.tile_ptr[qt], e1 = p.tile_ptr[qt + 1];

    load_rows<FWD_BM, FWD_NT>(Qs, qbase, qs, q0, p.q_len, tid);
    cp_async_commit();
    if (e0 < e1) {
        int kt = p.tiles[e0].x;
        load_rows<FWD_BN, FWD_NT>(Ks, kbase, ks, kt * FWD_BN, p.k_len, tid);
        load_rows<FWD_BN, FWD_NT>(Vs, vbase, ks, kt * FWD_BN, p.k_len, tid);
    }
    cp_async_commit();

    float o[FWD_MR][D / 8][4];
    // Running row max (log2 units) and partial row sums live in shared memory, one slot per
    // thread: 8 registers fewer in the hottest loop (the difference between spilling or not).
    float* mls = (float*)(Vs + 2 * FWD_BN * LDS);
#define MROW(mi, r) mls[((mi) * 2 + (r)) * FWD_NT + tid]
#define LROW(mi, r) mls[(2 * FWD_MR + (mi) * 2 + (r)) * FWD_NT + tid]
#pragma unroll
    for (int mi = 0; mi < FWD_MR; ++mi) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[mi][i][0] = o[mi][i][1] = o[mi][i][2] = o[mi][i][3] = 0.f;
        MROW(mi, 0) = MROW(mi, 1) = NEG_INF;
        LROW(mi, 0) = LROW(mi, 1) = 0.f;
    }

    const elem_t* qrow_ptr = Qs + (wr0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;
#if Q_IN_REGS
    u32 qf[FWD_MR][D / 16][4];
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < FWD_MR; ++mi)
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ldsm_x4(qf[mi][kk][0], qf[mi][kk][1], qf[mi][kk][2], qf[mi][kk][3], qrow_ptr + mi * 16 * LDS + kk * 16);
#endif

    for (int e = e0; e < e1; ++e) {
        const int stage = (e - e0) & 1;
        if (e + 1 < e1) {
            int kt = p.tiles[e + 1].x;
            load_rows<FWD_BN, FWD_NT>(Ks + (stage ^ 1) * FWD_BN * LDS, kbase, ks, kt * FWD_BN, p.k_len, tid);
            load_rows<FWD_BN, FWD_NT>(Vs + (stage ^ 1) * FWD_BN * LDS, vbase, ks, kt * FWD_BN, p.k_len, tid);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        // Per-lane ldmatrix addresses of this stage (bytes, shared window).
        const u32 kaddr = smem_u32(Ks) + 2 * (stage * FWD_BN * LDS + ((lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8);
        const u32 vaddr = smem_u32(Vs) + 2 * (stage * FWD_BN * LDS + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);

        // S = Q K^T for this warp's rows.
        float s[FWD_MR][FWD_BN / 8][4];
#pragma unroll
        for (int mi = 0; mi < FWD_MR; ++mi)
#pragma unroll
            for (int j = 0; j < FWD_BN / 8; ++j) s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[FWD_MR][4];
#pragma unroll
            for (int mi = 0; mi < FWD_MR; ++mi) {
#if Q_IN_REGS
                a[mi][0] = qf[mi][kk][0]; a[mi][1] = qf[mi][kk][1]; a[mi][2] = qf[mi][kk][2]; a[mi][3] = qf[mi][kk][3];
#else
                ldsm_x4(a[mi][0], a[mi][1], a[mi][2], a[mi][3], qrow_ptr + mi * 16 * LDS + kk * 16);
#endif
            }
#pragma unroll
            for (int nj = 0; nj < FWD_BN / 16; ++nj) {
                u32 b0, b1, b2, b3;
                ldsm_x4a(b0, b1, b2, b3, kaddr + 2 * (nj * 16 * LDS + kk * 16));
#pragma unroll
                for (int mi = 0; mi < FWD_MR; ++mi) {
                    mma16816(s[mi][2 * nj], a[mi], b0, b1);
                    mma16816(s[mi][2 * nj + 1], a[mi], b2, b3);
                }
            }
        }
        const int moff = p.tiles[e].y;
        const float sl2 = p.scale_log2;
#pragma unroll
        for (int mi = 0; mi < FWD_MR; ++mi) {
            if (moff >= 0) { // partial tile: apply the bitmask
                constexpr int W = FWD_BN / 32;
                const u32* r0w = p.bits + moff + (wr0 + mi * 16 + g) * W;
                const u32* r1w = r0w + 8 * W;
#pragma unroll
                for (int j = 0; j < FWD_BN / 8; ++j) {
                    int c = 8 * j + 2 * t;
                    u32 w0 = r0w[c >> 5] >> (c & 31), w1 = r1w[c >> 5] >> (c & 31);
                    if (!(w0 & 1)) s[mi][j][0] = NEG_INF;
                    if (!(w0 & 2)) s[mi][j][1] = NEG_INF;
                    if (!(w1 & 1)) s[mi][j][2] = NEG_INF;
                    if (!(w1 & 2)) s[mi][j][3] = NEG_INF;
                }
            }
            // Online softmax (log2 domain).
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = NEG_INF;
#pragma unroll
                for (int j = 0; j < FWD_BN / 8; ++j) mx = fmax_nan(mx, fmax_nan(s[mi][j][2 * r], s[mi][j][2 * r + 1]));
                mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                // m is kept in scaled (log2) units; scores are scaled inside the exponent.
                const float mo = MROW(mi, r);
                const float mn = fmax_nan(mo, mx * sl2);
                const float mu = mn == NEG_INF ? 0.f : mn;
                const float alpha = fast_exp2(mo - mu);
                MROW(mi, r) = mn;
                float rs = 0.f;
#pragma unroll
                for (int j = 0; j < FWD_BN / 8; ++j) {
                    s[mi][j][2 * r] = fast_exp2(fmaf(s[mi][j][2 * r], sl2, -mu));
                    s[mi][j][2 * r + 1] = fast_exp2(fmaf(s[mi][j][2 * r + 1], sl2, -mu));
                    rs += s[mi][j][2 * r] + s[mi][j][2 * r + 1];
                }
                LROW(mi, r) = LROW(mi, r) * alpha + rs;
#pragma unroll
                for (int i = 0; i < D / 8; ++i) { o[mi][i][2 * r] *= alpha; o[mi][i][2 * r + 1] *= alpha; }
            }
        }
        // O += P V
#pragma unroll
        for (int kk = 0; kk < FWD_BN / 16; ++kk) {
            u32 a[FWD_MR][4];
#pragma unroll
            for (int mi = 0; mi < FWD_MR; ++mi) {
                a[mi][0] = pack2(s[mi][2 * kk][0], s[mi][2 * kk][1]);
                a[mi][1] = pack2(s[mi][2 * kk][2], s[mi][2 * kk][3]);
                a[mi][2] = pack2(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
                a[mi][3] = pack2(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dj = 0; dj < D / 16; ++dj) {
                u32 b0, b1, b2, b3;
                ldsm_x4a_t(b0, b1, b2, b3, vaddr + 2 * (kk * 16 * LDS + dj * 16));
#pragma unroll
                for (int mi = 0; mi < FWD_MR; ++mi) {
                    mma16816(o[mi][2 * dj], a[mi], b0, b1);
                    mma16816(o[mi][2 * dj + 1], a[mi], b2, b3);
                }
            }
        }
        __syncthreads();
    }

    // Finalize: normalise, write O (staged through this warp's rows of Qs), LSE.
    cp_async_wait<0>();
    __syncwarp();
    elem_t* wrows = Qs + wr0 * LDS;
#pragma unroll
    for (int mi = 0; mi < FWD_MR; ++mi) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float lt = LROW(mi, r);
            lt += __shfl_xor_sync(0xffffffff, lt, 1);
            lt += __shfl_xor_sync(0xffffffff, lt, 2);
            // lt = 0: the row saw no key (O = 0, LSE = -inf); a NaN lt is passed on.
            inv[r] = lt != 0.f ? 1.f / lt : 0.f;
            const int row = q0 + wr0 + mi * 16 + g + 8 * r;
            if (t == 0 && row < p.q_len)
                p.lse[((size_t)b * p.heads + h) * p.q_len + row] = lt != 0.f ? (MROW(mi, r) + __log2f(lt)) * LN2 : NEG_INF;
            if (p.o_f32 && row < p.q_len) {
                float* dst = p.o_f32 + (((size_t)b * p.q_len + row) * p.heads + h) * D;
#pragma unroll
                for (int i = 0; i < D / 8; ++i)
                    *(float2*)(dst + i * 8 + 2 * t) = make_float2(o[mi][i][2 * r] * inv[r], o[mi][i][2 * r + 1] * inv[r]);
            }
        }
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            *(u32*)(wrows + (mi * 16 + g) * LDS + i * 8 + 2 * t) = pack2(o[mi][i][0] * inv[0], o[mi][i][1] * inv[0]);
            *(u32*)(wrows + (mi * 16 + g + 8) * LDS + i * 8 + 2 * t) = pack2(o[mi][i][2] * inv[1], o[mi][i][3] * inv[1]);
        }
    }
    __syncwarp();
    constexpr int CPR = D / 8;
    for (int c = lane; c < FWD_WM * CPR; c += 32) {
        int r = c / CPR, ch = c % CPR;
        int row = q0 + wr0 + r;
        if (row < p.q_len)
            *(uint4*)(p.o + (((size_t)b * p.q_len + row) * p.heads + h) * D + ch * 8) = *(const uint4*)(wrows + r * LDS + ch * 8);
    }
}
#endif // !FWD_WG
