#include "sm90/backward_loads.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && BWD_WG && (D == 192 || D == 256)
// ---------------------------------------------------------------- backward, d 192 and 256 (sm_90a)
// Above d 128 the d <= 128 kernel's plan does not fit: a warpgroup's dK and dV over every column
// would take 256 registers a thread, and a staged f32 dQ tile the shared memory that two stages
// of Q and dO leave. So flash_bwd_ws runs two jobs, each accumulating in registers what it
// writes: the dK/dV blocks, then the dQ blocks, which take the SMs the first job's last blocks
// leave (one launch instead of two: 1-3% faster at d 192, the same at d 256).
//
// wb_dkdv (dK, dV): one block per 64-key tile and a loop over the 64-row query items of every
// query head of the KV head (the d <= 128 kernel's tile plan and loads). The two consumer
// warpgroups split the gradients by column, dV_c += P^T dO_c and dK_c += dS^T Q_c (columns
// 128c..128c+127; A = P^T, dS^T read transposed from [query][key] tiles in shared memory), and
// share the score products (64 x 64, shared x shared):
// - d 256, whole: consumer 0 computes S = Q K^T and P, consumer 1 dP = dO V^T and dS = P (dP -
//   delta), reading P back rounded to the input type. Consumer 0 issues S before consumer 1
//   issues dP (barrier 3), so P is computed while dP runs and dS while the dV products run.
// - d 192, split by key: consumer c computes S_c, dP_c, P_c, dS_c over keys 32c..32c+31.
// (A 64 x 32 product reads 3 KB of operands per k-step for 32K multiply-adds, a 64 x 64 one
// 4 KB for 64K. On an H100 the whole products were 2-3% faster at d 256 under causal masks and
// at 4k, the same on full masks at 8k-16k; at d 192, 1-4% slower.)
// P and dS are double-buffered, so one barrier per product (P stored, dS stored) orders their
// use and reuse.
//
// wb_dq (dQ): one block per 128-row query tile of one query head, a loop over its 32-key tiles
// like the forward's; consumer c owns rows 64c..64c+63:
//   S = Q K^T, dP = dO V^T (64 x 32), dS = P (dP - delta), dQ += dS K (dS as the register A
//   operand), then scale dQ written in the input type (a whole backward: the block has each row's
//   every key) or added into dq_acc (a context-parallel block's).
// Recomputing S and dP (7 products per 64 x 64 x d block instead of 5) costs less than adding
// dQ into dq_acc from the dK/dV blocks: with 64-key tiles that is 64 KB of f32 reductions per
// item, which bound such a kernel (the L2 at 84% of its throughput; on an H100 at 16k, 18.2 ms
// against 15.2 for the two jobs, 8 heads of d 256).
//
// At d 192 the tiles keep 256 columns: the fourth block of Q, K, V and dO is never loaded, the
// scores read only the first three, and the gradients' columns past 192 are not stored.
#define WB_BN 64
#define WB_BM 64
static_assert(BWD_BM == WB_BM, "the host plans the dK/dV job's items of 64 query rows");
#define WB_STAGES 2
#define WB_BLOCK (64 * 128) // bytes of one 64-row column block
#define WB_TILE (4 * WB_BLOCK) // bytes of a [64][256] bf16/f16 tile
#define WQ_BM 128
#define WQ_BN 32
#define WQ_STAGES 3

// The mbarriers of both jobs: `once` for the tiles loaded once (one arrival with their bytes),
// then STAGES `full` (the same) and `freed` (one arrival per consumer warp) ones, 8 bytes each.
template <int STAGES>
__device__ __forceinline__ void wb_init_barriers(u32 once, u32 full, u32 freed) {
    if (threadIdx.x == 0) {
        mbar_init(once, 1);
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full + 8 * i, 1);
            mbar_init(freed + 8 * i, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// Word i of a partial tile's bitmask at bits + moff, all ones for a full tile (moff < 0).
__device__ __forceinline__ u32 wb_mask_word(const u32* bits, int moff, int i) { return moff >= 0 ? bits[moff + i] : ~0u; }

// P = 2^(S scale_log2 - LSE) of a thread's 64 x 32 scores (rows' LSE l0, l1), +0 where the mask
// drops the pair (a dropped NaN score too), into p. Mask words w0, w1 of the rows: bit 8j + 2t
// (+1) is accumulator block j's key; tbit = 1 << 2t, shifted here by constants only. (The other
// forms tried — shifts by 2t in the loop, float selects, branches or predicated stores on the
// bits — made ptxas serialize the warpgroup products around it, C7515.)
__device__ __forceinline__ void wb_probs(float (&p)[16], const float (&s)[16], float l0, float l1, u32 w0, u32 w1,
                                         u32 tbit, float sl2) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const u32 bit = tbit << (8 * (j >> 2) + (j & 1));
        const u32 k = ((j & 2 ? w1 : w0) & bit) ? ~0u : 0u;
        p[j] = __uint_as_float(__float_as_uint(fast_exp2(fmaf(s[j], sl2, j & 2 ? -l1 : -l0))) & k);
    }
}

// A thread's two words of key chunk j (keys 8j..8j+7) of a [query][key] tile (P, dS): rows r0
// and r0 + 8, at a = tile + r0 * 128 + 4t + ((j ^ g) << 4) and 8 rows on (both swizzled by g).
__device__ __forceinline__ void wb_put_rows(u32 a, u32 lo, u32 hi) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(lo));
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a + 8 * 128), "r"(hi));
}
__device__ __forceinline__ void wb_get_rows(u32 a, u32& lo, u32& hi) {
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(lo) : "r"(a));
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(hi) : "r"(a + 8 * 128));
}

// acc (64 x 128) += X^T Y: X a [query][key] tile (read transposed: M = keys), Y's column blocks
// 2c, 2c + 1 (N-major), K = the 64 queries.
__device__ __forceinline__ void wb_grad(float (&acc)[64], u32 x, u32 y, int c) {
    const u64 dx = wg_desc(x, WB_BLOCK, 1024), dy = wg_desc(y + 2 * c * WB_BLOCK, WB_BLOCK, 1024);
#pragma unroll
    for (int kq = 0; kq < WB_BM / 16; ++kq)
        wgmma_ss_n128<1, 1, 1>(acc, wg_desc_add(dx, kq * 16 * 128), wg_desc_add(dy, kq * 16 * 128));
}

// Item it of a dK/dV block: its Q/dO stage and the stage's mbarrier phase, the stage's Q and dO
// tiles, and the P and dS buffers of the item's parity.
struct WbItem { int st, ph; u32 q, dO, p, ds; };
__device__ __forceinline__ WbItem wb_item(int it, u32 Qs, u32 dOs, u32 Ps, u32 dSs) {
    const int st = it % WB_STAGES;
    return {st, (it / WB_STAGES) & 1, Qs + st * WB_TILE, dOs + st * WB_TILE, Ps + (it & 1) * WB_BLOCK,
            dSs + (it & 1) * WB_BLOCK};
}

// dK and dV of block `block` of the key-major plan p (maps: 64-row boxes).
__device__ __forceinline__ void wb_dkdv(const BwdParams& p, const TmaMap* tq, const TmaMap* tdo, const TmaMap* tk,
                                        const TmaMap* tv, unsigned block) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    const u32 Ks = (raw + 1023) & ~1023u;
    const u32 Vs = Ks + WB_TILE;
    const u32 Qs = Vs + WB_TILE;              // WB_STAGES tiles
    const u32 dOs = Qs + WB_STAGES * WB_TILE; // WB_STAGES tiles
    const u32 Ps = dOs + WB_STAGES * WB_TILE; // 2 x [WB_BM][WB_BN]
    const u32 dSs = Ps + 2 * WB_BLOCK;        // 2 x [WB_BM][WB_BN]
    const u32 lse_a = dSs + 2 * WB_BLOCK;     // WB_STAGES x [WB_BM] f32
    const u32 del_a = lse_a + WB_STAGES * WB_BM * 4;
    const u32 bars = del_a + WB_STAGES * WB_BM * 4;
    const u32 full_kv = bars, full = bars + 8, freed = full + 8 * WB_STAGES;
    float* lse_s = (float*)(smem_raw + (lse_a - raw));
    float* del_s = (float*)(smem_raw + (del_a - raw));

    const auto [kt, kvh, b, G, e0, ne, total] = bwd_key_block(p, block);
    const int tid = threadIdx.x, wg = warpgroup_index(), wi = (tid >> 5) & 3, lane = tid & 31;
    const int k0 = kt * WB_BN;

    wb_init_barriers<WB_STAGES>(full_kv, full, freed);

    if (wg == 0) {
        reg_dealloc<24>();
        if (wi == 0 && total > 0)
            bwd_load<WB_BN, WB_BM, WB_STAGES>(p, tq, tdo, tk, tv, Ks, Vs, Qs, dOs, WB_TILE, lse_s, del_s, full_kv,
                                              full, freed, k0, kvh, b, e0, ne, total, lane);
        return;
    }
    reg_alloc<240>();
    const int cw = wg - 1;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = 16 * wi + g; // this thread's query rows in an item: r0, r0 + 8
    const u32 tbit = 1u << (2 * t);

    float dk[64], dv[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;
    if (total > 0) mbar_wait(full_kv, 0);
    const u32 row_off = r0 * 128 + 4 * t; // this thread's words in a [query][key] tile (wb_put_rows)
    if constexpr (D == 256) { // whole score products, one per consumer
        if (cw == 0) { // S and P
            float s[32];
            int ei = 0; // the item's tile entry, stepped (a division by ne per item costs ~20 instructions)
            for (int it = 0; it < total; ++it) {
                const auto [st, ph, qst, dost, pb, dsb] = wb_item(it, Qs, dOs, Ps, dSs);
                const int2 te = p.tiles[e0 + ei]; // (query tile, bitmask offset or -1)
                if (++ei == ne) ei = 0;
                mbar_wait(full + 8 * st, ph);
                wg_fence();
                wg_gemm_kmajor(s, qst, WB_BM, 0, Ks, WB_BN);
                wg_commit();
                named_arrive(3, 256); // S is issued: consumer 1 may issue dP behind it
                const float l0 = lse_s[st * WB_BM + r0], l1 = lse_s[st * WB_BM + r0 + 8];
                u32 w0[2], w1[2]; // the rows' two mask words (keys 0..31, 32..63)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    w0[h] = wb_mask_word(p.bits, te.y, r0 * (WB_BN / 32) + h);
                    w1[h] = wb_mask_word(p.bits, te.y, (r0 + 8) * (WB_BN / 32) + h);
                }
                wg_wait<0>(); // S, and the item before's dV and dK
                wg_pin(s);
                __syncwarp();
                if (it > 0 && lane == 0) mbar_arrive(freed + 8 * ((it - 1) % WB_STAGES)); // its Q and dO are read
                float pr[32];
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    wb_probs(*reinterpret_cast<float(*)[16]>(&pr[16 * h]),
                             *reinterpret_cast<const float(*)[16]>(&s[16 * h]), l0, l1, w0[h], w1[h], tbit,
                             p.scale_log2);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    wb_put_rows(pb + row_off + ((j ^ g) << 4), pack2(pr[4 * j], pr[4 * j + 1]),
                                pack2(pr[4 * j + 2], pr[4 * j + 3]));
                }
                fence_async_smem();
                named_sync(1, 256); // P is stored
                wg_fence();
                wb_grad(dv, pb, dost, 0); // dV_0 += P^T dO_0
                wg_commit();
                named_sync(2, 256); // dS is stored
                wg_fence();
                wb_grad(dk, dsb, qst, 0); // dK_0 += dS^T Q_0
                wg_commit();
            }
        } else { // dP and dS
            float dp[32];
            for (int it = 0; it < total; ++it) {
                const auto [st, ph, qst, dost, pb, dsb] = wb_item(it, Qs, dOs, Ps, dSs);
                mbar_wait(full + 8 * st, ph);
                named_sync(3, 256); // S is issued
                wg_fence();
                wg_gemm_kmajor(dp, dost, WB_BM, 0, Vs, WB_BN);
                wg_commit();
                const float nd0 = del_s[st * WB_BM + r0], nd1 = del_s[st * WB_BM + r0 + 8];
                named_sync(1, 256); // P is stored
                wg_fence();
                wb_grad(dv, pb, dost, 1); // dV_1 += P^T dO_1
                wg_commit();
                wg_wait<1>(); // dP, and the item before's dK (dV may run)
                wg_pin(dp);
                __syncwarp();
                if (it > 0 && lane == 0) mbar_arrive(freed + 8 * ((it - 1) % WB_STAGES)); // its Q and dO are read
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    u32 p0, p1;
                    wb_get_rows(pb + row_off + ((j ^ g) << 4), p0, p1);
                    const float2 q0 = unpack2(p0), q1 = unpack2(p1);
                    wb_put_rows(dsb + row_off + ((j ^ g) << 4), pack2(q0.x * (dp[4 * j] + nd0), q0.y * (dp[4 * j + 1] + nd0)),
                                pack2(q1.x * (dp[4 * j + 2] + nd1), q1.y * (dp[4 * j + 3] + nd1)));
                }
                fence_async_smem();
                named_sync(2, 256); // dS is stored
                wg_fence();
                wb_grad(dk, dsb, qst, 1); // dK_1 += dS^T Q_1
                wg_commit();
            }
        }
    } else { // d 192: both products split by key
        int ei = 0; // the item's tile entry, stepped (a division by ne per item costs ~20 instructions)
        for (int it = 0; it < total; ++it) {
            const auto [st, ph, qst, dost, pb, dsb] = wb_item(it, Qs, dOs, Ps, dSs);
            const int2 te = p.tiles[e0 + ei]; // (query tile, bitmask offset or -1)
            if (++ei == ne) ei = 0;
            const float* lse_st = lse_s + st * WB_BM;
            const float* ndel_st = del_s + st * WB_BM;
            mbar_wait(full + 8 * st, ph);

            const u32 w0 = wb_mask_word(p.bits, te.y, r0 * (WB_BN / 32) + cw);
            const u32 w1 = wb_mask_word(p.bits, te.y, (r0 + 8) * (WB_BN / 32) + cw);
            float s[16], dp[16];
            wg_fence();
            wg_gemm_kmajor(s, qst, WB_BM, 0, Ks + 32 * cw * 128, WB_BN);
            wg_commit();
            wg_gemm_kmajor(dp, dost, WB_BM, 0, Vs + 32 * cw * 128, WB_BN);
            wg_commit();
            const float l0 = lse_st[r0], l1 = lse_st[r0 + 8];
            wg_wait<2>(); // the previous item's dV and dK
            __syncwarp();
            if (it > 0 && lane == 0) mbar_arrive(freed + 8 * ((it - 1) % WB_STAGES)); // its Q and dO are read
            wg_wait<1>(); // S (dP may run)
            wg_pin(s);
            float pr[16];
            wb_probs(pr, s, l0, l1, w0, w1, tbit, p.scale_log2);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                wb_put_rows(pb + row_off + (((4 * cw + j) ^ g) << 4), pack2(pr[4 * j], pr[4 * j + 1]),
                            pack2(pr[4 * j + 2], pr[4 * j + 3]));
            }
            fence_async_smem();
            named_sync(1, 256); // P of both consumers is stored
            wg_fence();
            wb_grad(dv, pb, dost, cw); // dV += P^T dO
            wg_commit();
            wg_wait<1>(); // dP (dV may run)
            wg_pin(dp);
            const float nd0 = ndel_st[r0], nd1 = ndel_st[r0 + 8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                wb_put_rows(dsb + row_off + (((4 * cw + j) ^ g) << 4),
                            pack2(pr[4 * j] * (dp[4 * j] + nd0), pr[4 * j + 1] * (dp[4 * j + 1] + nd0)),
                            pack2(pr[4 * j + 2] * (dp[4 * j + 2] + nd1), pr[4 * j + 3] * (dp[4 * j + 3] + nd1)));
            }
            fence_async_smem();
            named_sync(2, 256); // dS of both consumers is stored
            wg_fence();
            wb_grad(dk, dsb, qst, cw); // dK += dS^T Q
            wg_commit();
        }
    }
    wg_wait<0>();
    wg_pin(dk);
    wg_pin(dv);
    // dK, dV: rows (keys) 16wi + g, +8; columns 128c + 8i + 2t, +1.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = k0 + 16 * wi + g + 8 * r;
        if (key >= p.k_len) continue;
        const size_t off = (((size_t)b * p.k_len + key) * p.kv_heads + kvh) * D + 128 * cw + 2 * t;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            if (128 * cw + 8 * i >= D) break;
            put_grad_pair(p.dk, p.dkdv_acc, off + i * 8, dk[4 * i + 2 * r] * p.scale, dk[4 * i + 2 * r + 1] * p.scale);
            put_grad_pair(p.dv, p.dkdv_acc, off + i * 8, dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
        }
    }
}

// dQ of block `block` of the by-query plan p (WQ_BM x WQ_BN tiles, bitmask rows of one word;
// n_tiles its query tiles); the maps' boxes are WQ_BM rows (Q, dO) and WQ_BN rows (K, V).
__device__ __forceinline__ void wb_dq(const BwdParams& p, const TmaMap* tq, const TmaMap* tdo, const TmaMap* tk,
                                      const TmaMap* tv, unsigned block) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr u32 ROWS_TILE = 4 * WQ_BM * 128, KV_TILE = 4 * WQ_BN * 128; // [rows][256] bf16/f16
    const u32 raw = smem_u32(smem_raw);
    const u32 Qs = (raw + 1023) & ~1023u;
    const u32 dOs = Qs + ROWS_TILE;
    const u32 Ks = dOs + ROWS_TILE;             // WQ_STAGES tiles
    const u32 Vs = Ks + WQ_STAGES * KV_TILE;    // WQ_STAGES tiles
    const u32 lse_a = Vs + WQ_STAGES * KV_TILE; // [WQ_BM] f32
    const u32 del_a = lse_a + WQ_BM * 4;
    const u32 bars = del_a + WQ_BM * 4;
    const u32 full_q = bars, full = bars + 8, freed = full + 8 * WQ_STAGES;
    float* lse_s = (float*)(smem_raw + (lse_a - raw));
    float* del_s = (float*)(smem_raw + (del_a - raw));

    // Query tile from the last (the heaviest under a causal mask); the G query heads of a KV
    // head side by side.
    const int G = p.heads / p.kv_heads;
    const GridSlot slot = grid_slot_at(block, p.n_tiles, G, p.batch * p.kv_heads, p.group);
    const int qt = p.n_tiles - 1 - slot.rank, kvh = slot.pair % p.kv_heads, b = slot.pair / p.kv_heads;
    const int h = kvh * G + slot.sub, q0 = qt * WQ_BM;
    const int e0 = p.tile_ptr[qt], n = p.tile_ptr[qt + 1] - e0;
    if (n == 0) { // no key reaches the tile: nothing to add, or zeros to write
        if (p.dq)
            for (int i = threadIdx.x; i < WQ_BM * D / 8; i += blockDim.x) {
                const int row = q0 + i / (D / 8);
                if (row < p.q_len)
                    *(uint4*)(p.dq + (((size_t)b * p.q_len + row) * p.heads + h) * D + 8 * (i % (D / 8))) =
                        make_uint4(0, 0, 0, 0);
            }
        return;
    }
    const int tid = threadIdx.x, wg = warpgroup_index(), wi = (tid >> 5) & 3, lane = tid & 31;

    wb_init_barriers<WQ_STAGES>(full_q, full, freed);

    if (wg == 0) {
        reg_dealloc<24>();
        if (wi == 0) {
            bwd_load_rows<WQ_BM>(p, lse_s, del_s, q0, h, b, lane);
            if (lane == 0) { // the arrival releases the rows stored above with the copies' bytes
                mbar_expect_tx(full_q, 2 * WQ_BM * DK * 2);
                tma_load_rows<WQ_BM>(Qs, tq, full_q, q0, h, b);
                tma_load_rows<WQ_BM>(dOs, tdo, full_q, q0, h, b);
#pragma unroll 1
                for (int i = 0; i < n; ++i) {
                    const int st = i % WQ_STAGES, ph = (i / WQ_STAGES) & 1;
                    const int kt = p.tiles[e0 + i].x;
                    if (i >= WQ_STAGES) mbar_wait(freed + 8 * st, ph ^ 1);
                    mbar_expect_tx(full + 8 * st, 2 * WQ_BN * DK * 2);
                    tma_load_rows<WQ_BN>(Ks + st * KV_TILE, tk, full + 8 * st, kt * WQ_BN, kvh, b);
                    tma_load_rows<WQ_BN>(Vs + st * KV_TILE, tv, full + 8 * st, kt * WQ_BN, kvh, b);
                }
            }
        }
        return;
    }
    reg_alloc<240>();
    const int cw = wg - 1;
    const int g = lane >> 2, t = lane & 3;
    const int rq = 64 * cw + 16 * wi + g; // this thread's rows in the tile: rq, rq + 8
    const u32 tbit = 1u << (2 * t);

    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
    mbar_wait(full_q, 0);
    const float l0 = lse_s[rq], l1 = lse_s[rq + 8], nd0 = del_s[rq], nd1 = del_s[rq + 8];
    const u32 qa = Qs + 64 * cw * 128, doa = dOs + 64 * cw * 128;
    for (int i = 0; i < n; ++i) {
        const int st = i % WQ_STAGES, ph = (i / WQ_STAGES) & 1;
        const int moff = p.tiles[e0 + i].y;
        const u32 kst = Ks + st * KV_TILE, vst = Vs + st * KV_TILE;
        mbar_wait(full + 8 * st, ph);
        const u32 w0 = wb_mask_word(p.bits, moff, rq), w1 = wb_mask_word(p.bits, moff, rq + 8);
        float s[16], dp[16];
        wg_fence();
        wg_gemm_kmajor(s, qa, WQ_BM, 0, kst, WQ_BN);
        wg_commit();
        wg_gemm_kmajor(dp, doa, WQ_BM, 0, vst, WQ_BN);
        wg_commit();
        wg_wait<1>(); // S, and the previous tile's dQ product (dP may run)
        wg_pin(s);
        __syncwarp();
        if (i > 0 && lane == 0) mbar_arrive(freed + 8 * ((i - 1) % WQ_STAGES)); // its K and V are read
        float pr[16];
        wb_probs(pr, s, l0, l1, w0, w1, tbit, p.scale_log2);
        wg_wait<0>(); // dP
        wg_pin(dp);
#pragma unroll
        for (int k = 0; k < 16; ++k) pr[k] *= dp[k] + (k & 2 ? nd1 : nd0);
        u32 pa[WQ_BN / 16][4];
        wg_pack_a<WQ_BN>(pa, pr);
        wg_fence();
        wg_gemm_rs_nD<WQ_BN>(dq, pa, kst); // dQ += dS K
        wg_commit();
    }
    wg_wait<0>();
    wg_pin(dq);
    // scale dQ, written to dq or added into dq_acc: rows rq, rq + 8; columns 8i + 2t, +1.
    elem_t* const dst = p.dq ? p.dq : reinterpret_cast<elem_t*>(p.dq_acc);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + rq + 8 * r;
        if (row >= p.q_len) continue;
        const size_t off = (((size_t)b * p.q_len + row) * p.heads + h) * D + 2 * t;
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
            put_grad_pair(dst, !p.dq, off + 8 * i, dq[4 * i + 2 * r] * p.scale, dq[4 * i + 2 * r + 1] * p.scale);
    }
}
// Both jobs in one launch: the key-major plan pk's blocks first, then the by-query plan pq's,
// which take the SMs the first job's last blocks leave (its tail). kq*: the first job's maps
// (64-row boxes), q*: the second's (Q, dO WQ_BM rows; K, V WQ_BN rows).
extern "C" __global__ void __launch_bounds__(384, 1)
flash_bwd_ws(const BwdParams pk, const BwdParams pq, const __grid_constant__ TmaMap kq, const __grid_constant__ TmaMap kdo,
             const __grid_constant__ TmaMap kk, const __grid_constant__ TmaMap kv, const __grid_constant__ TmaMap qq,
             const __grid_constant__ TmaMap qdo, const __grid_constant__ TmaMap qk, const __grid_constant__ TmaMap qv) {
    const unsigned kv_blocks = (unsigned)pk.n_tiles * pk.batch * pk.kv_heads;
    if (blockIdx.x < kv_blocks) wb_dkdv(pk, &kq, &kdo, &kk, &kv, blockIdx.x);
    else wb_dq(pq, &qq, &qdo, &qk, &qv, blockIdx.x - kv_blocks);
}
#endif // BWD_WG && (D == 192 || D == 256)
