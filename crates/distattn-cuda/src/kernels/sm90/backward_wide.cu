#include "sm90/backward_loads.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && BWD_WG && (D == 192 || D == 256)
// ---------------------------------------------------------------- backward, d 192 and 256 (sm_90a)
// The job of flash_bwd_ws (backward.cu) where dK and dV of a warpgroup's 64 keys over every
// column would take 256 registers a thread: one block per 64-key tile, a loop over the 64-row
// query items of every query head of the KV head, and the two consumer warpgroups split the
// work by key for the scores and by column for the gradients. Consumer c:
//   S_c = Q K_c^T, dP_c = dO V_c^T     (keys 32c..32c+31: 64 x 32, shared x shared)
//   P_c, dS_c = P_c (dP_c - delta)     (registers -> shared memory, [query][key] tiles)
//   dV_c += P^T dO_c, dK_c += dS^T Q_c (columns 128c..128c+127, all 64 keys: A = P^T, dS^T
//                                       read transposed from shared memory)
//   dQ_c = dS K_c                      (the same columns, in two 64-column halves added into
//                                       dq_acc with vector reductions from registers: a
//                                       staged 64 x 256 f32 tile would not fit the shared
//                                       memory beside two stages of Q and dO)
// At d 192 the tiles keep 256 columns: the fourth block of Q, K, V and dO is never loaded, the
// scores read only the first three, and the gradients' columns past 192 are neither added
// nor stored. Warpgroup 0 loads (warp 0: K and V once; per item Q and dO with TMA and the LSE
// and delta rows, into WB_STAGES stages). The second dQ half of an item is added while the
// next item's scores run on the tensor cores; P and dS are double-buffered, so one barrier per
// product (P of both consumers stored, dS of both stored) orders their use and reuse.
#define WB_BN 64
#define WB_BM BWD_ITEM_ROWS
#define WB_STAGES 2
#define WB_COLS 256 // tile columns: four 64-column swizzled blocks of WB_BM (= WB_BN) rows
#define WB_BLOCK (64 * 128) // bytes of one column block of a tile

// acc += A B^T over the first DK columns (K-major [64 rows][WB_COLS] tiles; B: the 32 rows from
// b_row0).
__device__ __forceinline__ void wb_scores(float (&acc)[16], u32 a, u32 b, int b_row0) {
    const u64 da0 = wg_desc(a, 16, 1024), db0 = wg_desc(b + b_row0 * 128, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
        const u32 off = (kk >> 2) * WB_BLOCK + (kk & 3) * 32;
        wgmma_ss_n32<0, 0>(acc, wg_desc_add(da0, off), wg_desc_add(db0, off));
    }
}

// acc (64 x 128) += X^T Y: X a [query][key] tile (read transposed: M = keys), Y's column blocks
// 2c, 2c + 1 (N-major), K = the 64 queries.
__device__ __forceinline__ void wb_grad(float (&acc)[64], u32 x, u32 y, int c) {
    const u64 dx = wg_desc(x, WB_BLOCK, 1024), dy = wg_desc(y + 2 * c * WB_BLOCK, WB_BLOCK, 1024);
#pragma unroll
    for (int kq = 0; kq < WB_BM / 16; ++kq)
        wgmma_ss_n128<1, 1>(acc, wg_desc_add(dx, kq * 16 * 128), wg_desc_add(dy, kq * 16 * 128), 1);
}

// acc (64 x 64) = dS K[:, 64 cb..]: dS a [query][key] tile (K-major), K's column block cb (N-major).
__device__ __forceinline__ void wb_dq(float (&acc)[32], u32 ds, u32 ks, int cb) {
    const u64 da = wg_desc(ds, 16, 1024), db = wg_desc(ks + cb * WB_BLOCK, WB_BLOCK, 1024);
#pragma unroll
    for (int kk = 0; kk < WB_BN / 16; ++kk)
        wgmma_ss64<0, 1>(acc, wg_desc_add(da, kk * 32), wg_desc_add(db, kk * 16 * 128), kk);
}

// Adds scale x a thread's dQ half (rows r0, r0 + 8 of query tile qt; columns c0 + 8i + 2t, +1)
// into dq_acc; rows past the end are dropped.
__device__ __forceinline__ void wb_add_dq(const BwdParams& p, const float (&dq)[32], int b, int h, int qt, int r0,
                                          int c0, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = qt * WB_BM + r0 + 8 * r;
        if (row >= p.q_len) continue;
        float* dst = p.dq_acc + (((size_t)b * p.q_len + row) * p.heads + h) * D + c0 + 2 * t;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst + 8 * i), "f"(dq[4 * i + 2 * r] * p.scale),
                         "f"(dq[4 * i + 2 * r + 1] * p.scale)
                         : "memory");
    }
}

extern "C" __global__ void __launch_bounds__(384, 1)
flash_bwd_ws(const BwdParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tdo,
             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,
             const __grid_constant__ TmaMap tdq) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr u32 TILE = 4 * WB_BLOCK; // [64][WB_COLS] bf16/f16
    const u32 raw = smem_u32(smem_raw);
    const u32 Ks = (raw + 1023) & ~1023u;
    const u32 Vs = Ks + TILE;
    const u32 Qs = Vs + TILE;                     // WB_STAGES tiles
    const u32 dOs = Qs + WB_STAGES * TILE;        // WB_STAGES tiles
    const u32 Ps = dOs + WB_STAGES * TILE;        // 2 x [WB_BM][WB_BN]
    const u32 dSs = Ps + 2 * WB_BLOCK;            // 2 x [WB_BM][WB_BN]
    const u32 lse_a = dSs + 2 * WB_BLOCK;         // WB_STAGES x [WB_BM] f32
    const u32 del_a = lse_a + WB_STAGES * WB_BM * 4;
    const u32 bars = del_a + WB_STAGES * WB_BM * 4;
    const u32 full_kv = bars, full = bars + 8, freed = full + 8 * WB_STAGES;
    float* lse_s = (float*)(smem_raw + (lse_a - raw));
    float* del_s = (float*)(smem_raw + (del_a - raw));

    const GridSlot slot = grid_slot(p.n_tiles, 1, p.batch * p.kv_heads, p.group);
    const int kt = slot.rank;
    const int kvh = slot.pair % p.kv_heads, b = slot.pair / p.kv_heads;
    const int G = p.heads / p.kv_heads;
    const int tid = threadIdx.x, wg = warpgroup_index(), wi = (tid >> 5) & 3, lane = tid & 31;
    const int k0 = kt * WB_BN;
    const int e0 = p.tile_ptr[kt], ne = p.tile_ptr[kt + 1] - e0;
    const int total = G * ne;

    if (tid == 0) {
        mbar_init(full_kv, 1);
        for (int i = 0; i < WB_STAGES; ++i) {
            mbar_init(full + 8 * i, 1);
            mbar_init(freed + 8 * i, 8); // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        reg_dealloc<24>();
        if (wi == 0 && total > 0)
            bwd_load<WB_BN, WB_STAGES>(p, &tq, &tdo, &tk, &tv, Ks, Vs, Qs, dOs, TILE, lse_s, del_s, full_kv, full,
                                       freed, k0, kvh, b, e0, ne, total, lane);
        return;
    }
    reg_alloc<240>();
    const int cw = wg - 1;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = 16 * wi + g; // this thread's query rows in an item: r0, r0 + 8
    // dQ's second half exists where its columns start before D (at d 192 only consumer 0's).
    const bool dq_hi = 128 * cw + 64 < D;

    float dk[64], dv[64], dq[32];
#pragma unroll
    for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;
    if (total > 0) mbar_wait(full_kv, 0);
    int prev_qt = 0, prev_h = 0; // the item whose second dQ half is in flight
    for (int it = 0; it < total; ++it) {
        const int st = it % WB_STAGES, ph = (it / WB_STAGES) & 1;
        const int2 te = p.tiles[e0 + it % ne]; // (query tile, bitmask offset or -1)
        const int qt = te.x, moff = te.y;
        const int h = kvh * G + it / ne;
        const u32 qst = Qs + st * TILE, dost = dOs + st * TILE;
        const u32 pb = Ps + (it & 1) * WB_BLOCK, dsb = dSs + (it & 1) * WB_BLOCK;
        const float* lse_st = lse_s + st * WB_BM;
        const float* ndel_st = del_s + st * WB_BM;
        mbar_wait(full + 8 * st, ph);

        float s[16], dp[16];
        const float nd0 = ndel_st[r0], nd1 = ndel_st[r0 + 8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            s[4 * j] = s[4 * j + 1] = s[4 * j + 2] = s[4 * j + 3] = 0.f;
            dp[4 * j] = dp[4 * j + 1] = nd0; // dP starts from -delta, so it ends as dP - delta
            dp[4 * j + 2] = dp[4 * j + 3] = nd1;
        }
        wg_fence();
        wb_scores(s, qst, Ks, 32 * cw);
        wg_commit();
        wb_scores(dp, dost, Vs, 32 * cw);
        wg_commit();
        const float l0 = lse_st[r0], l1 = lse_st[r0 + 8];
        if (it > 0) {
            wg_wait<2>(); // the previous item's dK and second dQ half
            wg_pin(dq);
            if (dq_hi) wb_add_dq(p, dq, b, prev_h, prev_qt, r0, 128 * cw + 64, t);
            __syncwarp();
            if (lane == 0) mbar_arrive(freed + 8 * ((it - 1) % WB_STAGES)); // its Q and dO are read
        }
        wg_wait<1>(); // S (dP may run)
        wg_pin(s);
        // Accumulator block j holds keys 32c + 8j + 2t, +1 of rows r0 (values 0, 1) and r0 + 8 (2, 3).
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            s[4 * j] = fast_exp2(fmaf(s[4 * j], p.scale_log2, -l0));
            s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], p.scale_log2, -l0));
            s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], p.scale_log2, -l1));
            s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], p.scale_log2, -l1));
        }
        if (moff >= 0) { // a partial tile: zero P where the mask drops the pair
            constexpr int W = WB_BN / 32;
            const u32 w0 = p.bits[moff + r0 * W + cw], w1 = p.bits[moff + (r0 + 8) * W + cw];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c2 = 0; c2 < 2; ++c2) {
                    const int bit = 8 * j + 2 * t + c2;
                    if (!((w0 >> bit) & 1)) s[4 * j + c2] = 0.f;
                    if (!((w1 >> bit) & 1)) s[4 * j + 2 + c2] = 0.f;
                }
        }
        // P -> [query][key] tile: key chunk 4c + j of rows r0, r0 + 8 (both swizzled by g).
        const u32 row_off = r0 * 128 + 4 * t;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 a = pb + row_off + (((4 * cw + j) ^ g) << 4);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(pack2(s[4 * j], s[4 * j + 1])));
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a + 8 * 128), "r"(pack2(s[4 * j + 2], s[4 * j + 3])));
        }
        fence_async_smem();
        named_sync(1, 256); // P of both consumers is stored
        wg_fence();
        wb_grad(dv, pb, dost, cw); // dV += P^T dO
        wg_commit();
        wg_wait<1>(); // dP (dV may run)
        wg_pin(dp);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 a = dsb + row_off + (((4 * cw + j) ^ g) << 4);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(pack2(s[4 * j] * dp[4 * j], s[4 * j + 1] * dp[4 * j + 1])));
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a + 8 * 128),
                         "r"(pack2(s[4 * j + 2] * dp[4 * j + 2], s[4 * j + 3] * dp[4 * j + 3])));
        }
        fence_async_smem();
        named_sync(2, 256); // dS of both consumers is stored
        wg_fence();
        wb_dq(dq, dsb, Ks, 2 * cw); // first dQ half, then dK under its reductions
        wg_commit();
        wb_grad(dk, dsb, qst, cw); // dK += dS^T Q
        wg_commit();
        wg_wait<1>(); // dV and the first dQ half (dK may run)
        wg_pin(dq);
        wb_add_dq(p, dq, b, h, qt, r0, 128 * cw, t);
        if (dq_hi) {
            wg_fence();
            wb_dq(dq, dsb, Ks, 2 * cw + 1);
        }
        wg_commit(); // (an empty group where there is no second half: the waits count groups)
        prev_qt = qt;
        prev_h = h;
    }
    wg_wait<0>();
    wg_pin(dq);
    wg_pin(dk);
    wg_pin(dv);
    if (total > 0 && dq_hi) wb_add_dq(p, dq, b, prev_h, prev_qt, r0, 128 * cw + 64, t);
    // dK, dV: rows (keys) 16wi + g, +8; columns 128c + 8i + 2t, +1.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = k0 + 16 * wi + g + 8 * r;
        if (key >= p.k_len) continue;
        const size_t off = (((size_t)b * p.k_len + key) * p.kv_heads + kvh) * D + 128 * cw + 2 * t;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            if (128 * cw + 8 * i >= D) break;
            *(u32*)(p.dk + off + i * 8) = pack2(dk[4 * i + 2 * r] * p.scale, dk[4 * i + 2 * r + 1] * p.scale);
            *(u32*)(p.dv + off + i * 8) = pack2(dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
        }
    }
}
#endif // BWD_WG && (D == 192 || D == 256)
