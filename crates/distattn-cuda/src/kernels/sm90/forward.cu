#pragma once
#include "sm90/primitives.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && FWD_WG && (D == 128 || D == 64)
// ---------------------------------------------------------------- forward (sm_90a)
// One block per 128-row query tile. Per 128-key tile and consumer warpgroup (64 rows each):
// S = Q K^T (shared x shared), online softmax in registers, O += P V with P as the register A
// operand and V read N-major. The P V product of tile e-1 runs on the tensor cores while the
// softmax of tile e runs on the other pipes.
#define FW_BM 128
#define FW_BN 128

// Masks and exponentiates one 64 x FW_BN tile of scores (a warpgroup's accumulators) in place,
// updating the running max m (log2 units) and sum l of the thread's two rows; returns in
// alpha the factor by which the rows' earlier output must be rescaled.
__device__ __forceinline__ void fwd_softmax(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            const u32* bits, int moff, int rq, int t, float sl2) {
    if (moff >= 0) { // partial tile: apply the bitmask
        constexpr int W = FW_BN / 32;
        const u32* r0w = bits + moff + rq * W;
        const u32* r1w = r0w + 8 * W;
#pragma unroll
        for (int j = 0; j < FW_BN / 8; ++j) {
            const int c = 8 * j + 2 * t;
            const u32 w0 = r0w[c >> 5] >> (c & 31), w1 = r1w[c >> 5] >> (c & 31);
            if (!(w0 & 1)) s[4 * j] = NEG_INF;
            if (!(w0 & 2)) s[4 * j + 1] = NEG_INF;
            if (!(w1 & 1)) s[4 * j + 2] = NEG_INF;
            if (!(w1 & 2)) s[4 * j + 3] = NEG_INF;
        }
    }
    // Accumulator column block j holds keys 8j + 2t, +1; values 0, 1 row rq, values 2, 3 row rq + 8.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = NEG_INF;
#pragma unroll
        for (int j = 0; j < FW_BN / 8; ++j) mx = fmax_nan(mx, fmax_nan(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float mn = fmax_nan(m[r], mx * sl2);
        const float mu = mn == NEG_INF ? 0.f : mn;
        alpha[r] = fast_exp2(m[r] - mu);
        m[r] = mn;
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < FW_BN / 8; ++j) {
            s[4 * j + 2 * r] = fast_exp2(fmaf(s[4 * j + 2 * r], sl2, -mu));
            s[4 * j + 2 * r + 1] = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl2, -mu));
            rs += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
        }
        l[r] = l[r] * alpha[r] + rs;
    }
}

// P (f32 accumulators) as A fragments: k-step kk covers keys 16kk.. = accumulator blocks 2kk, 2kk+1.
__device__ __forceinline__ void fwd_pack_p(u32 (&pa)[FW_BN / 16][4], const float (&s)[64]) {
#pragma unroll
    for (int kk = 0; kk < FW_BN / 16; ++kk)
#pragma unroll
        for (int f = 0; f < 4; ++f) pa[kk][f] = pack2(s[8 * kk + 2 * f], s[8 * kk + 2 * f + 1]);
}

__device__ __forceinline__ void fwd_rescale(float (&o)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        o[4 * i] *= alpha[0]; o[4 * i + 1] *= alpha[0];
        o[4 * i + 2] *= alpha[1]; o[4 * i + 3] *= alpha[1];
    }
}

__device__ __forceinline__ void fwd_issue_pv(float (&o)[D / 2], const u32 (&pa)[FW_BN / 16][4], u32 vst) {
    const u64 dv = wg_desc(vst, FW_BN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < FW_BN / 16; ++kk) wgmma_rs_nD<1>(o, pa[kk], wg_desc_add(dv, kk * 16 * 128), 1);
}

// Normalises (and multiplies by o_scale) and writes the thread's two output rows (row, row + 8)
// of O (and the optional f32 copy) and their LSE.
__device__ __forceinline__ void fwd_store(const FwdParams& p, const float (&o)[D / 2], const float (&m)[2],
                                          const float (&l)[2], int b, int h, int row0, int t, float o_scale) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffff, lt, 1);
        lt += __shfl_xor_sync(0xffffffff, lt, 2);
        // lt = 0: the row saw no key (O = 0, LSE = -inf); a NaN lt is passed on.
        const float inv = lt != 0.f ? o_scale / lt : 0.f;
        const int row = row0 + 8 * r;
        if (row >= p.q_len) continue;
        if (t == 0)
            p.lse[((size_t)b * p.heads + h) * p.q_len + row] = lt != 0.f ? (m[r] + __log2f(lt)) * LN2 : NEG_INF;
        const size_t off = (((size_t)b * p.q_len + row) * p.heads + h) * D + 2 * t;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            const float x0 = o[4 * i + 2 * r] * inv, x1 = o[4 * i + 2 * r + 1] * inv;
            *(u32*)(p.o + off + i * 8) = pack2(x0, x1);
            if (p.o_f32) *(float2*)(p.o_f32 + off + i * 8) = make_float2(x0, x1);
        }
    }
}

// The operations of the bf16/f16 pipeline: Q, K and V tiles in [rows][D] (D/64 swizzled column
// blocks), k = 16 products, P packed in pairs.
struct FwdHalf {
    static constexpr u32 Q_BYTES = FW_BM * D * 2, TILE_BYTES = FW_BN * D * 2;
    using PFrag = u32[FW_BN / 16][4];
    __device__ static __forceinline__ void load_q(u32 dst, const TmaMap* m, u32 bar, int q0, int h, int b) {
        tma_load_rows<FW_BM>(dst, m, bar, q0, h, b);
    }
    __device__ static __forceinline__ void load_k(u32 dst, const TmaMap* m, u32 bar, int k0, int kvh, int b) {
        tma_load_rows<FW_BN>(dst, m, bar, k0, kvh, b);
    }
    __device__ static __forceinline__ void load_v(u32 dst, const TmaMap* m, u32 bar, int k0, int kvh, int b) {
        tma_load_rows<FW_BN>(dst, m, bar, k0, kvh, b);
    }
    __device__ static __forceinline__ void qk(float (&s)[64], u32 qs, int cw, u32 ks) {
        wg_gemm_kmajor(s, qs, FW_BM, 64 * cw, ks, FW_BN);
    }
    __device__ static __forceinline__ void pack_p(PFrag& pa, const float (&s)[64]) { fwd_pack_p(pa, s); }
    __device__ static __forceinline__ void pv(float (&o)[D / 2], const PFrag& pa, u32 vs) { fwd_issue_pv(o, pa, vs); }
};

// The block is warp-specialized: warp 0 of warpgroup 0 (the producer, 24 registers) streams Q
// and the K/V tiles with TMA into 2 stages each, signalled by mbarriers; warpgroups 1 and 2
// (240 registers) compute 64 rows each and release a stage as soon as the product reading it
// has completed. The two consumers take turns issuing their products (named barriers 1 and 2),
// so one's softmax runs under the other's tensor-core work.
// The tiles' layouts and products come from Ops (FwdHalf; FwdE4m3 in forward_e4m3.cu); sl2 is
// the scale of the scores in log2 units and o_scale multiplies the output.
#define FS_STAGES 2
template <class Ops>
__device__ __forceinline__ void fwd_ws(const FwdParams& p, const TmaMap* tq, const TmaMap* tk, const TmaMap* tv,
                                       const float sl2, const float o_scale) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr u32 TILE_BYTES = Ops::TILE_BYTES;
    const u32 raw = smem_u32(smem_raw);
    const u32 Qs = (raw + 1023) & ~1023u;             // the query tile
    const u32 Ks = Qs + Ops::Q_BYTES;                 // FS_STAGES key tiles
    const u32 Vs = Ks + FS_STAGES * TILE_BYTES;       // FS_STAGES value tiles
    const u32 bars = Vs + FS_STAGES * TILE_BYTES;     // mbarriers, 8 bytes each:
    const u32 full_q = bars;                          //   Q landed
    const u32 full_k = bars + 8, full_v = full_k + 8 * FS_STAGES;   // stage landed
    const u32 free_k = full_v + 8 * FS_STAGES, free_v = free_k + 8 * FS_STAGES; // stage read

    const FwdBlock fb = fwd_block(p);
    const int qt = fb.qt, h = fb.h, kvh = fb.kvh, b = fb.b;
    const int tid = threadIdx.x, wg = warpgroup_index();
    const int q0 = qt * FW_BM;
    const int e0 = p.tile_ptr[qt], e1 = p.tile_ptr[qt + 1];

    if (tid == 0) {
        mbar_init(full_q, 1);
        for (int i = 0; i < FS_STAGES; ++i) {
            mbar_init(full_k + 8 * i, 1);
            mbar_init(full_v + 8 * i, 1);
            mbar_init(free_k + 8 * i, 8); // one arrival per consumer warp
            mbar_init(free_v + 8 * i, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) { // producer
        reg_dealloc<24>();
        if (tid == 0 && e1 > e0) { // (no tiles: the consumers only write empty rows)
            mbar_expect_tx(full_q, Ops::Q_BYTES);
            Ops::load_q(Qs, tq, full_q, q0, h, b);
            for (int e = e0; e < e1; ++e) {
                const int i = e - e0, st = i % FS_STAGES, ph = (i / FS_STAGES) & 1;
                const int kt = p.tiles[e].x;
                if (i >= FS_STAGES) mbar_wait(free_k + 8 * st, ph ^ 1);
                mbar_expect_tx(full_k + 8 * st, TILE_BYTES);
                Ops::load_k(Ks + st * TILE_BYTES, tk, full_k + 8 * st, kt * FW_BN, kvh, b);
                if (i >= FS_STAGES) mbar_wait(free_v + 8 * st, ph ^ 1);
                mbar_expect_tx(full_v + 8 * st, TILE_BYTES);
                Ops::load_v(Vs + st * TILE_BYTES, tv, full_v + 8 * st, kt * FW_BN, kvh, b);
            }
        }
        return;
    }
    reg_alloc<240>();
    const int cw = wg - 1, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rq = 64 * cw + 16 * wi + g; // this thread's query rows in the tile: rq, rq + 8
    // Turn-taking: consumer cw issues after named barrier 1 + cw, then lets the other one go.
    const int my_turn = 1 + cw, other_turn = 2 - cw;

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, alpha[2];
    typename Ops::PFrag pa;

    // Step i issues S(i) = Q K(i)^T and O += P(i-1) V(i-1), for i = 0..n; the first and last
    // steps are peeled so that no product is issued under a branch (ptxas would serialize them).
    const int n = e1 - e0;
    if (n > 0) {
        if (cw == 1) named_arrive(1, 256);
        mbar_wait(full_q, 0);
        mbar_wait(full_k, 0);
        named_sync(my_turn, 256);
        float s[64];
        wg_fence();
        Ops::qk(s, Qs, cw, Ks);
        wg_commit();
        named_arrive(other_turn, 256);
        wg_wait<0>();
        wg_pin(s);
        if (lane == 0) mbar_arrive(free_k);
        fwd_softmax(s, m, l, alpha, p.bits, p.tiles[e0].y, rq, t, sl2);
        Ops::pack_p(pa, s);
        for (int i = 1; i < n; ++i) {
            const int st = i % FS_STAGES, ph = (i / FS_STAGES) & 1;
            const int sp = (i - 1) % FS_STAGES, php = ((i - 1) / FS_STAGES) & 1;
            mbar_wait(full_k + 8 * st, ph);
            mbar_wait(full_v + 8 * sp, php);
            named_sync(my_turn, 256);
            wg_fence();
            Ops::qk(s, Qs, cw, Ks + st * TILE_BYTES);
            wg_commit();
            Ops::pv(o, pa, Vs + sp * TILE_BYTES);
            wg_commit();
            named_arrive(other_turn, 256);
            wg_wait<1>();
            wg_pin(s);
            if (lane == 0) mbar_arrive(free_k + 8 * st);
            fwd_softmax(s, m, l, alpha, p.bits, p.tiles[e0 + i].y, rq, t, sl2);
            wg_wait<0>();
            wg_pin(o);
            if (lane == 0) mbar_arrive(free_v + 8 * sp);
            fwd_rescale(o, alpha);
            Ops::pack_p(pa, s);
        }
        const int sp = (n - 1) % FS_STAGES;
        mbar_wait(full_v + 8 * sp, ((n - 1) / FS_STAGES) & 1);
        named_sync(my_turn, 256);
        wg_fence();
        Ops::pv(o, pa, Vs + sp * TILE_BYTES);
        wg_commit();
        if (cw == 0) named_arrive(other_turn, 256); // consumer 1 issues last: nothing to hand on
        wg_wait<0>();
        wg_pin(o);
    }
    fwd_store(p, o, m, l, b, h, q0 + rq, t, o_scale);
}

extern "C" __global__ void __launch_bounds__(384, 1)
flash_fwd_ws(const FwdParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
             const __grid_constant__ TmaMap tv) {
    fwd_ws<FwdHalf>(p, &tq, &tk, &tv, p.scale_log2, 1.f);
}
#endif // FWD_WG && (D == 128 || D == 64)
