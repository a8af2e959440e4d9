#pragma once
#include "sm90/primitives.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && FWD_WG && (D == 64 || D == 96 || D == 128 || D == 192 || D == 256)
// ---------------------------------------------------------------- forward (sm_90a)
// One block per query tile of 64 rows per consumer warpgroup (Ops::NC of them; bf16/f16:
// FWD_WARPS / 4, 3 at d 64 and 96, where two do not keep the tensor cores busy through the
// softmax, else 2; FP8: 3; d 96: tiles of DK = 128 columns, products over the 96, see
// primitives.cuh). Per key tile (Ops::BN keys; in bf16/f16 FWD_BN: 128 at d 64, 96 at d 96 (what
// three consumers' registers hold), 192 at d 128; above d 128, where O takes 96 or 128 registers
// a thread, as many as two stages of K and V fit beside Q in the shared memory: 96 at d 192, 80
// at d 256; the short-grid tilings: at d 96 two consumers over 192 keys, at d 64 four over 64) and
// consumer warpgroup: S = Q K^T (shared x shared), online softmax in registers,
// O += P V with P as the register A operand and V read N-major. The P V product of tile e-1
// runs on the tensor cores while the softmax of tile e runs on the other pipes.

// The block's consumer warpgroups (NC, 2 to 4), its query rows (BM = 64 NC) and threads, and
// the registers a consumer thread takes from the producer warpgroup's (24 left a producer
// thread): the most that the block's registers at launch (the most of the SM's 64K that its
// threads get, 8 at a time) hold, in steps of 8 (2: 240, 3: 160, 4: 112). setmaxnreg moves
// registers within the block only: asking for more than it holds waits forever.
template <int NC_>
struct FwdConsumers {
    static constexpr int NC = NC_, BM = 64 * NC_, THREADS = 128 * (1 + NC_);
    static constexpr int REGS = (65536 / THREADS / 8 * 8 * THREADS - 24 * 128) / (128 * NC_) / 8 * 8;
    static_assert(NC_ >= 2 && NC_ <= 4, "2 to 4 consumer warpgroups (setmaxnreg takes at most 256)");
};
#define LAZY_MAX (D == 128) // see fwd_softmax
#define FW_STAGES 2          // K/V stages (see FwdPipe)

// Masks and exponentiates one 64 x BN tile of scores (a warpgroup's accumulators) in place,
// updating the running max m (log2 units) and sum l of the thread's two rows; returns in
// alpha the factor by which the rows' earlier output must be rescaled.
template <int BN>
__device__ __forceinline__ void fwd_softmax(float (&s)[BN / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            const u32* bits, int moff, int rq, int t, float sl2) {
    if (moff >= 0) { // partial tile: apply the bitmask
        constexpr int W = (BN + 31) / 32; // mask words a row (TilePlan::words_per_row)
        const u32* r0w = bits + moff + rq * W;
        const u32* r1w = r0w + 8 * W;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
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
        for (int j = 0; j < BN / 8; ++j) mx = fmax_nan(mx, fmax_nan(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        // At head dim 128 the running max moves only when the tile's exceeds it by more than 8
        // (log2 units): exponentials stay below 2^8, well inside f32 and e4m3 (448), and most
        // tiles leave O unscaled (1% faster in bf16, 10% in FP8 on an H100; at d 64, where O
        // is half the size, 1-2% slower). A NaN max always moves it; an empty row's -inf never.
        const float mt = mx * sl2;
        const float mn = !(mt <= m[r] + (LAZY_MAX ? 8.f : 0.f)) ? fmax_nan(m[r], mt) : m[r];
        const float mu = mn == NEG_INF ? 0.f : mn;
        alpha[r] = fast_exp2(m[r] - mu);
        m[r] = mn;
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            s[4 * j + 2 * r] = fast_exp2(fmaf(s[4 * j + 2 * r], sl2, -mu));
            s[4 * j + 2 * r + 1] = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl2, -mu));
            rs += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
        }
        l[r] = l[r] * alpha[r] + rs;
    }
}

__device__ __forceinline__ void fwd_rescale(float (&o)[D / 2], const float (&alpha)[2]) {
    if (LAZY_MAX && !__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) return; // (the usual case)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        o[4 * i] *= alpha[0]; o[4 * i + 1] *= alpha[0];
        o[4 * i + 2] *= alpha[1]; o[4 * i + 3] *= alpha[1];
    }
}

// Where a consumer's O goes through shared memory (fwd_ws, `on`): its 64 rows of the Q tile, of
// DK / 64 column blocks `block` bytes apart; addr: the thread's first row in column block 0, at
// byte 4t of a 16-byte chunk (before the swizzle).
struct FwdOTile { bool on; u32 addr, block; };

// Normalises (and multiplies by o_scale) and writes the thread's two output rows (row, row + 8)
// of O (and the optional f32 copy) and their LSE: O's element-type copy into the consumer's tile
// ot where it has one, for fwd_ws to store by TMA. With p.merge, o_f32 and lse hold an earlier
// partial result of these rows, and the rows are merged into it by LSE weights instead (what the
// executor's separate merge kernel would do). O's element-type copy is skipped where p.o is null
// (merging only).
__device__ __forceinline__ void fwd_store(const FwdParams& p, const float (&o)[D / 2], const float (&m)[2],
                                          const float (&l)[2], int b, int h, int row0, int t, float o_scale,
                                          FwdOTile ot) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffff, lt, 1);
        lt += __shfl_xor_sync(0xffffffff, lt, 2);
        // lt = 0: the row saw no key (O = 0, LSE = -inf); a NaN lt is passed on.
        float inv = lt != 0.f ? o_scale / lt : 0.f;
        const int row = row0 + 8 * r;
        const size_t li = ((size_t)b * p.heads + h) * p.q_len + row;
        float lse = lt != 0.f ? (m[r] + __log2f(lt)) * LN2 : NEG_INF;
        float w_old = 0.f;
        if (p.merge) {
            // Lane t = 0 reads the earlier LSE for its quad (before it overwrites it below).
            float old = t == 0 && row < p.q_len ? p.lse[li] : NEG_INF;
            old = __shfl_sync(0xffffffff, old, (threadIdx.x & 31) & ~3);
            float w_new;
            lse = lse_merge(old, lse, w_old, w_new);
            inv *= w_new;
        }
        if (row >= p.q_len) continue;
        if (t == 0) p.lse[li] = lse;
        if (ot.on) {
            // Rows r0 and r0 + 8 share the swizzle (r0 % 8 = g): column chunk i % 8 at (i % 8) ^ g.
            const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
            for (int i = 0; i < D / 8; ++i)
                asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ot.addr + (i >> 3) * ot.block + r * 8 * 128 + (((i & 7) ^ g) << 4)),
                             "r"(pack2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv)));
            continue;
        }
        const size_t off = (((size_t)b * p.q_len + row) * p.heads + h) * D + 2 * t;
        // The earlier partial is read CH column pairs at a time before any of them is written:
        // the stores may alias the loads, so loads interleaved with them would each wait for
        // the one before.
        constexpr int CH = (D / 8) % 8 == 0 ? 8 : 4;
#pragma unroll
        for (int i0 = 0; i0 < D / 8; i0 += CH) {
            float2 prev[CH];
#pragma unroll
            for (int j = 0; j < CH; ++j)
                prev[j] = p.merge ? *(const float2*)(p.o_f32 + off + (i0 + j) * 8) : make_float2(0.f, 0.f);
#pragma unroll
            for (int j = 0; j < CH; ++j) {
                const int i = i0 + j;
                const float x0 = fmaf(w_old, prev[j].x, o[4 * i + 2 * r] * inv);
                const float x1 = fmaf(w_old, prev[j].y, o[4 * i + 2 * r + 1] * inv);
                if (p.o) *(u32*)(p.o + off + i * 8) = pack2(x0, x1);
                if (p.o_f32) *(float2*)(p.o_f32 + off + i * 8) = make_float2(x0, x1);
            }
        }
    }
}

// The operations of the bf16/f16 pipeline on NC consumers over BN-key tiles: Q, K and V tiles in
// [rows][DK] (DK/64 swizzled column blocks), k = 16 products, P packed in pairs.
template <int NC, int BN_>
struct FwdHalf : FwdConsumers<NC> {
    using FwdConsumers<NC>::BM;
    static constexpr int BN = BN_;
    static constexpr u32 Q_BYTES = BM * DK * 2, TILE_BYTES = BN * DK * 2;
    static constexpr bool TURNS = true;
    static constexpr bool O_VIA_TILE = true; // (O takes as many bytes as Q)
    using PFrag = u32[BN / 16][4];
    __device__ static __forceinline__ void load_q(u32 dst, const TmaMap* m, u32 bar, int q0, int h, int b) {
        tma_load_rows<BM>(dst, m, bar, q0, h, b);
    }
    __device__ static __forceinline__ void prefetch_q(const TmaMap* m, int q0, int h, int b) { tma_prefetch_rows(m, q0, h, b); }
    __device__ static __forceinline__ void load_k(u32 dst, const TmaMap* m, u32 bar, int k0, int kvh, int b) {
        tma_load_rows<BN>(dst, m, bar, k0, kvh, b);
    }
    __device__ static __forceinline__ void load_v(u32 dst, const TmaMap* m, u32 bar, int k0, int kvh, int b) {
        tma_load_rows<BN>(dst, m, bar, k0, kvh, b);
    }
    __device__ static __forceinline__ void qk(float (&s)[BN / 2], u32 qs, int cw, u32 ks) {
        wg_gemm_kmajor(s, qs, BM, 64 * cw, ks, BN);
    }
    __device__ static __forceinline__ void pack_p(PFrag& pa, const float (&s)[BN / 2]) { wg_pack_a<BN>(pa, s); }
    __device__ static __forceinline__ void pv(float (&o)[D / 2], const PFrag& pa, u32 vs) { wg_gemm_rs_nD<BN>(o, pa, vs); }
};

// Where tile i of a block's list lives: stage i % FW_STAGES, whose barriers are then in phase
// (i / FW_STAGES) & 1.
struct FwdSlot {
    int stage, phase;
    __device__ __forceinline__ static FwdSlot of(int i) { return {i % FW_STAGES, (i / FW_STAGES) & 1}; }
};

// The shared-memory pipeline of a forward block: the query tile, FW_STAGES key and value tiles,
// and their mbarriers (8 bytes each), addressed by FwdSlot. (3 stages were no faster than 2.)
template <class Ops>
struct FwdPipe {
    u32 Qs, Ks, Vs, full_q, full_k, full_v, free_k, free_v;
    __device__ __forceinline__ FwdPipe(u32 raw) {
        Qs = (raw + 1023) & ~1023u;
        Ks = Qs + Ops::Q_BYTES;
        Vs = Ks + FW_STAGES * Ops::TILE_BYTES;
        full_q = Vs + FW_STAGES * Ops::TILE_BYTES;
        full_k = full_q + 8;
        full_v = full_k + 8 * FW_STAGES;
        free_k = full_v + 8 * FW_STAGES;
        free_v = free_k + 8 * FW_STAGES;
    }
    __device__ __forceinline__ u32 k_tile(FwdSlot x) const { return Ks + x.stage * Ops::TILE_BYTES; }
    __device__ __forceinline__ u32 v_tile(FwdSlot x) const { return Vs + x.stage * Ops::TILE_BYTES; }
    __device__ __forceinline__ void wait_k(FwdSlot x) const { mbar_wait(full_k + 8 * x.stage, x.phase); }
    __device__ __forceinline__ void wait_v(FwdSlot x) const { mbar_wait(full_v + 8 * x.stage, x.phase); }
    // One arrival per consumer warp (lane 0) once the product that read the tile completed.
    __device__ __forceinline__ void release_k(FwdSlot x, int lane) const { if (lane == 0) mbar_arrive(free_k + 8 * x.stage); }
    __device__ __forceinline__ void release_v(FwdSlot x, int lane) const { if (lane == 0) mbar_arrive(free_v + 8 * x.stage); }
};

// What a consumer thread carries: its rows' output accumulators, running max and sum.
struct FwdRows {
    float o[D / 2];
    float m[2], l[2], alpha[2];
};

// Turn-taking of the consumer warpgroups, round robin: consumer cw issues its products after
// named barrier 1 + cw, then lets the next one go, so that the others' softmax runs under its
// products. Every consumer takes the same number of turns; the last one hands on nothing after
// its last turn. (ON = false: no turns, each consumer issues when it is ready: the FP8
// pipeline, whose products are short beside its softmax; see FwdE4m3.)
template <bool ON, int NC>
struct FwdTurns {
    int mine, next, cw;
    __device__ __forceinline__ explicit FwdTurns(int cw_) : mine(1 + cw_), next(1 + (cw_ + 1) % NC), cw(cw_) {
        if (ON && cw == NC - 1) named_arrive(next, 256); // consumer 0 goes first
    }
    __device__ __forceinline__ void begin() const { if (ON) named_sync(mine, 256); }
    __device__ __forceinline__ void end() const { if (ON) named_arrive(next, 256); }
    __device__ __forceinline__ void end_last() const { if (ON && cw != NC - 1) named_arrive(next, 256); }
};

// The scores of tile 0, waited for (both consumers start so).
template <class Ops, class Turns>
__device__ __forceinline__ void fwd_first_scores(const FwdPipe<Ops>& sp, const Turns& turn, float (&s)[Ops::BN / 2], int cw,
                                                 int lane) {
    const FwdSlot first = FwdSlot::of(0);
    mbar_wait(sp.full_q, 0);
    sp.wait_k(first);
    turn.begin();
    wg_fence();
    Ops::qk(s, sp.Qs, cw, sp.k_tile(first));
    wg_commit();
    turn.end();
    wg_wait<0>();
    wg_pin(s);
    sp.release_k(first, lane);
}

// O += P(n-1) V(n-1), waited for (both consumers end so).
template <class Ops, class Turns>
__device__ __forceinline__ void fwd_last_pv(const FwdPipe<Ops>& sp, const Turns& turn, FwdRows& r,
                                            const typename Ops::PFrag& pa, int n) {
    const FwdSlot last = FwdSlot::of(n - 1);
    sp.wait_v(last);
    turn.begin();
    wg_fence();
    Ops::pv(r.o, pa, sp.v_tile(last));
    wg_commit();
    turn.end_last();
    wg_wait<0>();
    wg_pin(r.o);
}

// What the steps of fwd_consume share.
template <class Ops>
struct FwdStepState {
    typename Ops::PFrag pa;
    float s[Ops::BN / 2];
};

// Step i of fwd_consume (0 < i < n): S(i) = Q K(i)^T and O += P(i-1) V(i-1) issued, the
// softmax of tile i under P(i-1) V(i-1). k: tile i's slot, v: tile i-1's.
template <class Ops, class Turns>
__device__ __forceinline__ void fwd_step(const FwdParams& p, const FwdPipe<Ops>& sp, const Turns& turn, FwdRows& r,
                                         FwdStepState<Ops>& x, FwdSlot k, FwdSlot v, int mask_off, int cw, int rq,
                                         int t, int lane, float sl2) {
    sp.wait_k(k);
    sp.wait_v(v);
    turn.begin();
    wg_fence();
    Ops::qk(x.s, sp.Qs, cw, sp.k_tile(k));
    wg_commit();
    Ops::pv(r.o, x.pa, sp.v_tile(v));
    wg_commit();
    turn.end();
    wg_wait<1>();
    wg_pin(x.s);
    sp.release_k(k, lane);
    fwd_softmax<Ops::BN>(x.s, r.m, r.l, r.alpha, p.bits, mask_off, rq, t, sl2);
    wg_wait<0>();
    wg_pin(r.o);
    sp.release_v(v, lane);
    fwd_rescale(r.o, r.alpha);
    Ops::pack_p(x.pa, x.s);
}

// One score tile in flight: step i issues S(i) = Q K(i)^T and O += P(i-1) V(i-1), for i =
// 0..n, and the softmax of tile i runs under P(i-1) V(i-1). The first and last steps are
// peeled so that no product is issued under a branch (ptxas would serialize them). At d 128 (bf16,
// f16 and FP8) the steps between go in pairs, the first of each on an odd tile (stage 1), the second
// on an even one (stage 0): stages known when compiling make the barriers' and tiles' addresses
// and the products' descriptors constants of the loop (an FP8 consumer warp spent ~46 of its
// ~250 instructions a 64-key tile on that arithmetic with stages computed at run time).
template <class Ops>
__device__ __forceinline__ void fwd_consume(const FwdParams& p, const FwdPipe<Ops>& sp, FwdRows& r, int e0, int n,
                                            int cw, int rq, int t, int lane, float sl2) {
    static_assert(FW_STAGES == 2, "the steps go in pairs, one a stage");
    FwdStepState<Ops> x;
    const FwdTurns<Ops::TURNS, Ops::NC> turn(cw);
    fwd_first_scores(sp, turn, x.s, cw, lane);
    fwd_softmax<Ops::BN>(x.s, r.m, r.l, r.alpha, p.bits, p.tiles[e0].y, rq, t, sl2);
    Ops::pack_p(x.pa, x.s);
    int i = 1;
    // (At d 96, 192 and 256 ptxas then serializes the products for want of registers, at d 64
    // it spills.)
    if constexpr (D == 128)
        for (; i + 1 < n; i += 2) {
            const int ph = (i >> 1) & 1; // tiles i - 1 and i; i + 1 is in the other phase
            fwd_step(p, sp, turn, r, x, FwdSlot{1, ph}, FwdSlot{0, ph}, p.tiles[e0 + i].y, cw, rq, t, lane, sl2);
            fwd_step(p, sp, turn, r, x, FwdSlot{0, ph ^ 1}, FwdSlot{1, ph}, p.tiles[e0 + i + 1].y, cw, rq, t, lane, sl2);
        }
    for (; i < n; ++i)
        fwd_step(p, sp, turn, r, x, FwdSlot::of(i), FwdSlot::of(i - 1), p.tiles[e0 + i].y, cw, rq, t, lane, sl2);
    fwd_last_pv(sp, turn, r, x.pa, n);
}

// Prefetches into the L2 the Q tile of the block p.prefetch places later in the launch order (one
// block an SM: the block that starts about a wave after this one), once this block's last tiles
// are requested, so that blocks do not start by reading their Q tiles from memory all at once.
template <class Ops>
__device__ __forceinline__ void fwd_prefetch_q(const FwdParams& p, const TmaMap* tq) {
    const unsigned next = blockIdx.x + (unsigned)p.prefetch;
    if (p.prefetch <= 0 || next >= gridDim.x) return;
    const FwdBlock f = fwd_block_at(p, next);
    Ops::prefetch_q(tq, f.qt * Ops::BM, f.h, f.b);
}

// The block is warp-specialized: warp 0 of warpgroup 0 (the producer, 24 registers) streams Q
// and the K/V tiles with TMA into FW_STAGES stages each, signalled by mbarriers; warpgroups 1
// to Ops::NC (Ops::REGS registers) compute 64 rows each (fwd_consume) and release a stage as
// soon as the product reading it has completed.
// The tiles' layouts and products come from Ops (FwdHalf; FwdE4m3 in forward_e4m3.cu); fb is
// the block's fwd_block, sl2 the scale of the scores in log2 units and o_scale multiplies the
// output; to is O's map (64-row boxes), read only where Ops::O_VIA_TILE (null for FP8).
template <class Ops>
__device__ __forceinline__ void fwd_ws(const FwdParams& p, const FwdBlock& fb, const TmaMap* tq, const TmaMap* tk,
                                       const TmaMap* tv, const TmaMap* to, const float sl2, const float o_scale) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const FwdPipe<Ops> sp(smem_u32(smem_raw));
    const int qt = fb.qt, h = fb.h, kvh = fb.kvh, b = fb.b;
    const int tid = threadIdx.x, wg = warpgroup_index();
    const int q0 = qt * Ops::BM;
    const int e0 = p.tile_ptr[qt], e1 = p.tile_ptr[qt + 1];

    if (tid == 0) {
        mbar_init(sp.full_q, 1);
        for (int i = 0; i < FW_STAGES; ++i) {
            mbar_init(sp.full_k + 8 * i, 1);
            mbar_init(sp.full_v + 8 * i, 1);
            mbar_init(sp.free_k + 8 * i, 4 * Ops::NC); // one arrival per consumer warp
            mbar_init(sp.free_v + 8 * i, 4 * Ops::NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) { // producer
        reg_dealloc<24>();
        if (tid == 0 && e1 > e0) { // (no tiles: the consumers only write empty rows)
            mbar_expect_tx(sp.full_q, Ops::Q_BYTES);
            Ops::load_q(sp.Qs, tq, sp.full_q, q0, h, b);
            for (int e = e0; e < e1; ++e) {
                const int i = e - e0, kt = p.tiles[e].x;
                const FwdSlot x = FwdSlot::of(i);
                if (i >= FW_STAGES) mbar_wait(sp.free_k + 8 * x.stage, x.phase ^ 1);
                mbar_expect_tx(sp.full_k + 8 * x.stage, Ops::TILE_BYTES);
                Ops::load_k(sp.k_tile(x), tk, sp.full_k + 8 * x.stage, kt * Ops::BN, kvh, b);
                if (i >= FW_STAGES) mbar_wait(sp.free_v + 8 * x.stage, x.phase ^ 1);
                mbar_expect_tx(sp.full_v + 8 * x.stage, Ops::TILE_BYTES);
                Ops::load_v(sp.v_tile(x), tv, sp.full_v + 8 * x.stage, kt * Ops::BN, kvh, b);
            }
            fwd_prefetch_q<Ops>(p, tq);
        }
        return;
    }
    reg_alloc<Ops::REGS>();
    const int cw = wg - 1, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rq = 64 * cw + 16 * wi + g; // this thread's query rows in the tile: rq, rq + 8

    FwdRows r;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) r.o[i] = 0.f;
    r.m[0] = r.m[1] = NEG_INF;
    r.l[0] = r.l[1] = 0.f;
    const int n = e1 - e0;
    if (n > 0) fwd_consume<Ops>(p, sp, r, e0, n, cw, rq, t, lane, sl2);
    // O of the plain forward leaves through the consumer's rows of the Q tile (its own score
    // products, the only ones to read them, have completed) and TMA stores of whole 128-byte rows:
    // each thread's 4-byte pairs stored directly took 2.2k cycles a block at d 128 and 7.3k at
    // d 256 (H100).
    const bool via_tile = Ops::O_VIA_TILE && p.o && !p.o_f32 && !p.merge;
    const FwdOTile ot{via_tile, sp.Qs + rq * 128 + 4 * t, Ops::BM * 128};
    fwd_store(p, r.o, r.m, r.l, b, h, q0 + rq, t, o_scale, ot);
    if (via_tile) {
        fence_async_smem();
        named_sync(8 + cw, 128); // the consumer's rows are in shared memory
        if ((tid & 127) == 0 && q0 + 64 * cw < p.q_len) {
#pragma unroll
            for (int cb = 0; cb < DK / 64; ++cb)
                tma_store_box(to, sp.Qs + cb * ot.block + 64 * cw * 128, cb * 64, q0 + 64 * cw, h, b);
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); // before the block's memory goes
        }
    }
}

// The module's forward on FWD_WARPS / 4 consumers over FWD_BN-key tiles (flash_fwd_ws) and, where
// the host gives it one, a second tiling for grids of few blocks (flash_fwd_ws_short:
// FWD_SHORT_WARPS, FWD_SHORT_BN; KernelConfig::fwd_short).
#define FWD_HALF_KERNEL(WARPS, BN, NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(FwdHalf<WARPS / 4, BN>::THREADS, 1)                              \
    NAME(const FwdParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,                 \
         const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap to) {                                  \
        fwd_ws<FwdHalf<WARPS / 4, BN>>(p, fwd_block(p), &tq, &tk, &tv, &to, p.scale_log2, 1.f);                   \
    }
FWD_HALF_KERNEL(FWD_WARPS, FWD_BN, flash_fwd_ws)
#if FWD_SHORT_WARPS
FWD_HALF_KERNEL(FWD_SHORT_WARPS, FWD_SHORT_BN, flash_fwd_ws_short)
#endif
#endif // FWD_WG && (D == 64 || D == 96 || D == 128 || D == 192 || D == 256)
