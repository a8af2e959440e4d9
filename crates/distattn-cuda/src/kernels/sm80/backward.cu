// ---------------------------------------------------------------- backward: dK, dV (+ dQ atomics)
// On mma.sync (sm_80+): flash_bwd_dkdv (v1) and flash_bwd_dkdv2 (v2, sm_90+ where it fits).
#include "common.cuh"
#include "params.cuh"

#ifndef BWD_V2
#define BWD_V2 0
#endif

#define BWD_BN (16 * BWD_WARPS)
#define BWD_NT (32 * BWD_WARPS)
#define LDSS (BWD_BM + 8)

#if !BWD_V2 && !BWD_WG // the one-warp-per-16-keys kernel (sm_80; above d 128 everywhere)
// A warp holds dK and dV of its 16 keys in registers, which room allows for up to 128 columns:
// above that, each key tile has BWD_PARTS blocks, block part c owning dK, dV and dQ columns
// c * BWD_DC.. (S^T and dP^T, over all D columns, are computed by every part).
#define BWD_DC (D > 128 ? D / 2 : D)
#define BWD_PARTS (D / BWD_DC)
#define DQ_RG (BWD_BM / 16)          // dQ row groups of 16
#define DQ_CP (BWD_WARPS / DQ_RG)    // dQ column parts
#define DQ_DC (BWD_DC / DQ_CP)       // dQ columns per warp
// dQ passes of 32 columns where they divide a warp's columns; else one pass, or above d 128
// (where dK and dV leave fewer registers) passes of 16.
#define DQ_PASSES (DQ_DC % 32 == 0 ? DQ_DC / 32 : D > 128 ? DQ_DC / 16 : 1)
#define DQ_PC (DQ_DC / DQ_PASSES)     // columns per pass
// acc = A B^T for one warp: A's 16 rows at a_addr, B's BWD_BM rows at b_addr (addresses carry
// the lane's ldmatrix offset), both D wide with row stride LDS. The v1 backward's S^T = K Q^T
// and dP^T = V dO^T.
__device__ __forceinline__ void mma_warp_16xbm(float (&acc)[BWD_BM / 8][4], u32 a_addr, u32 b_addr) {
#pragma unroll
    for (int j = 0; j < BWD_BM / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a[4];
        ldsm_x4a(a[0], a[1], a[2], a[3], a_addr + 2 * kk * 16);
#pragma unroll
        for (int nj = 0; nj < BWD_BM / 16; ++nj) {
            u32 b0, b1, b2, b3;
            ldsm_x4a(b0, b1, b2, b3, b_addr + 2 * (nj * 16 * LDS + kk * 16));
            mma16816(acc[2 * nj], a, b0, b1);
            mma16816(acc[2 * nj + 1], a, b2, b3);
        }
    }
}

// acc (16 x BWD_DC) += P B for one warp: P its BWD_BM-column f32 accumulators (packed here into
// the A operand), B the BWD_BM rows of BWD_DC columns at b_addr (lane offset and the part's
// first column included), read transposed. The v1 backward's dV += P^T dO and dK += dS^T Q.
__device__ __forceinline__ void mma_warp_pb(float (&acc)[BWD_DC / 8][4], const float (&pm)[BWD_BM / 8][4], u32 b_addr) {
#pragma unroll
    for (int kk = 0; kk < BWD_BM / 16; ++kk) {
        u32 a[4];
        a[0] = pack2(pm[2 * kk][0], pm[2 * kk][1]);
        a[1] = pack2(pm[2 * kk][2], pm[2 * kk][3]);
        a[2] = pack2(pm[2 * kk + 1][0], pm[2 * kk + 1][1]);
        a[3] = pack2(pm[2 * kk + 1][2], pm[2 * kk + 1][3]);
#pragma unroll
        for (int dj = 0; dj < BWD_DC / 16; ++dj) {
            u32 b0, b1, b2, b3;
            ldsm_x4a_t(b0, b1, b2, b3, b_addr + 2 * (kk * 16 * LDS + dj * 16));
            mma16816(acc[2 * dj], a, b0, b1);
            mma16816(acc[2 * dj + 1], a, b2, b3);
        }
    }
}

extern "C" __global__ void __launch_bounds__(BWD_NT) flash_bwd_dkdv(const BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* Ks = (elem_t*)smem_raw;
    elem_t* Vs = Ks + BWD_BN * LDS;
    elem_t* Qs = Vs + BWD_BN * LDS;          // 2 stages
    elem_t* dOs = Qs + 2 * BWD_BM * LDS;     // 2 stages
    elem_t* dSs = dOs + 2 * BWD_BM * LDS;    // [BWD_BN][LDSS], dS^T
    float* lse_s = (float*)(dSs + BWD_BN * LDSS); // 2 stages
    float* del_s = lse_s + 2 * BWD_BM;            // 2 stages

    const GridSlot slot = grid_slot(p.n_tiles, BWD_PARTS, p.batch * p.kv_heads, p.group);
    const int kt = slot.rank; // key tile 0 first: the heaviest under a causal mask
    const int kvh = slot.pair % p.kv_heads, b = slot.pair / p.kv_heads;
    const int dc0 = slot.sub * BWD_DC; // this part's first dK/dV/dQ column
    const int G = p.heads / p.kv_heads;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int k0 = kt * BWD_BN;
    const size_t qstr = (size_t)p.heads * D, kstr = (size_t)p.kv_heads * D;
    const int e0 = p.tile_ptr[kt], ne = p.tile_ptr[kt + 1] - e0;
    const int total = G * ne;

    const elem_t* kbase = p.k + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    const elem_t* vbase = p.v + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    load_rows<BWD_BN, BWD_NT>(Ks, kbase, kstr, k0, p.k_len, tid);
    load_rows<BWD_BN, BWD_NT>(Vs, vbase, kstr, k0, p.k_len, tid);
    cp_async_commit();

    auto load_item = [&](int it, int st) {
        const int hh = it / ne, e = e0 + it % ne;
        const int h = kvh * G + hh;
        const int qt = p.tiles[e].x;
        const elem_t* qb = p.q + ((size_t)b * p.q_len * p.heads + h) * D;
        const elem_t* db = p.dout + ((size_t)b * p.q_len * p.heads + h) * D;
        load_rows<BWD_BM, BWD_NT>(Qs + st * BWD_BM * LDS, qb, qstr, qt * BWD_BM, p.q_len, tid);
        load_rows<BWD_BM, BWD_NT>(dOs + st * BWD_BM * LDS, db, qstr, qt * BWD_BM, p.q_len, tid);
        if (tid < 2 * BWD_BM) {
            const int i = tid % BWD_BM;
            const int row = qt * BWD_BM + i;
            const bool ok = row < p.q_len;
            const size_t off = ((size_t)b * p.heads + h) * p.q_len + (ok ? row : 0);
            if (tid < BWD_BM) cp_async4(lse_s + st * BWD_BM + i, p.lse + off, ok ? 4 : 0);
            else cp_async4(del_s + st * BWD_BM + i, p.delta + off, ok ? 4 : 0);
        }
    };
    if (total > 0) load_item(0, 0);
    cp_async_commit();

    float dk[BWD_DC / 8][4], dv[BWD_DC / 8][4];
#pragma unroll
    for (int i = 0; i < BWD_DC / 8; ++i) {
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
        dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
    }
    // Per-lane ldmatrix byte offsets: "A" = rows (lane&7)+8*bit3, col 8*bit4 (A operands and
    // transposed B operands); "B" = rows (lane&7)+8*bit4, col 8*bit3 (plain B operands).
    const u32 laneA = 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
    const u32 laneB = 2 * (((lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8);
    const u32 krow = smem_u32(Ks) + 2 * warp * 16 * LDS + laneA;
    const u32 vrow = smem_u32(Vs) + 2 * warp * 16 * LDS + laneA;
    const u32 kbase_s = smem_u32(Ks) + laneA;

    for (int it = 0; it < total; ++it) {
        const int st = it & 1;
        if (it + 1 < total) load_item(it + 1, st ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int hh = it / ne, e = e0 + it % ne;
        const int h = kvh * G + hh;
        const int2 te = p.tiles[e];
        const u32 qst = smem_u32(Qs) + 2 * st * BWD_BM * LDS;
        const u32 dost = smem_u32(dOs) + 2 * st * BWD_BM * LDS;
        const float* lse_st = lse_s + st * BWD_BM;
        const float* del_st = del_s + st * BWD_BM;

        // S^T = K Q^T (this warp's 16 keys x BWD_BM queries)
        float sp[BWD_BM / 8][4];
        mma_warp_16xbm(sp, krow, qst + laneB);
        // P^T = exp2(S^T * scale_log2 - lse2), masked entries 0.
        {
            constexpr int W = BWD_BN / 32;
            const int rk = warp * 16 + g; // key row within the tile (and rk + 8)
#pragma unroll
            for (int j = 0; j < BWD_BM / 8; ++j) {
#pragma unroll
                for (int c2 = 0; c2 < 2; ++c2) {
                    const int c = 8 * j + 2 * t + c2;
                    const float lv = lse_st[c];
                    const float l2 = lv == NEG_INF ? POS_INF : lv * LOG2E;
                    float p0 = fast_exp2(sp[j][c2] * p.scale_log2 - l2);
                    float p1 = fast_exp2(sp[j][2 + c2] * p.scale_log2 - l2);
                    if (te.y >= 0) {
                        u32 w = p.bits[te.y + c * W + (rk >> 5)] >> (rk & 31);
                        if (!(w & 1)) p0 = 0.f;
                        if (!(w & 0x100)) p1 = 0.f;
                    }
                    sp[j][c2] = p0;
                    sp[j][2 + c2] = p1;
                }
            }
        }
        // dV += P^T dO
        mma_warp_pb(dv, sp, dost + laneA + 2 * dc0);
        // dP^T = V dO^T
        float dp[BWD_BM / 8][4];
        mma_warp_16xbm(dp, vrow, dost + laneB);
        // dS^T = P^T * (dP^T - delta); stage it (bf16/f16) for dQ.
#pragma unroll
        for (int j = 0; j < BWD_BM / 8; ++j) {
            const int c = 8 * j + 2 * t;
            const float d0 = del_st[c], d1 = del_st[c + 1];
            sp[j][0] = sp[j][0] * (dp[j][0] - d0);
            sp[j][1] = sp[j][1] * (dp[j][1] - d1);
            sp[j][2] = sp[j][2] * (dp[j][2] - d0);
            sp[j][3] = sp[j][3] * (dp[j][3] - d1);
            *(u32*)(dSs + (warp * 16 + g) * LDSS + c) = pack2(sp[j][0], sp[j][1]);
            *(u32*)(dSs + (warp * 16 + g + 8) * LDSS + c) = pack2(sp[j][2], sp[j][3]);
        }
        // dK += dS^T Q
        mma_warp_pb(dk, sp, qst + laneA + 2 * dc0);
        __syncthreads();
        // dQ (BWD_BM x D) += scale * dS K, split over warps, accumulated with f32 atomics;
        // each warp's DQ_DC columns in DQ_PASSES passes to bound register pressure.
        {
            const int rg = warp % DQ_RG, cp = warp / DQ_RG;
            const int qrow0 = te.x * BWD_BM + rg * 16 + g;
#pragma unroll 1
            for (int pass = 0; pass < DQ_PASSES; ++pass) {
                const int c0 = dc0 + cp * DQ_DC + pass * DQ_PC;
                float dq[DQ_PC / 8][4];
#pragma unroll
                for (int i = 0; i < DQ_PC / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < BWD_BN / 16; ++kk) {
                    u32 a[4];
                    ldsm_x4_t(a[0], a[1], a[2], a[3],
                              dSs + (kk * 16 + (lane & 7) + (lane >> 4) * 8) * LDSS + rg * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                    for (int dj = 0; dj < DQ_PC / 16; ++dj) {
                        u32 b0, b1, b2, b3;
                        ldsm_x4a_t(b0, b1, b2, b3, kbase_s + 2 * (kk * 16 * LDS + c0 + dj * 16));
                        mma16816(dq[2 * dj], a, b0, b1);
                        mma16816(dq[2 * dj + 1], a, b2, b3);
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = qrow0 + 8 * r;
                    if (row < p.q_len) {
                        float* dst = p.dq_acc + (((size_t)b * p.q_len + row) * p.heads + h) * D + c0 + 2 * t;
#pragma unroll
                        for (int i = 0; i < DQ_PC / 8; ++i) red_add2(dst + i * 8, dq[i][2 * r] * p.scale, dq[i][2 * r + 1] * p.scale);
                    }
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

    // Write dK (scaled) and dV for this warp's 16 keys.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = k0 + warp * 16 + g + 8 * r;
        if (key < p.k_len) {
            const size_t off = (((size_t)b * p.k_len + key) * p.kv_heads + kvh) * D + dc0 + 2 * t;
#pragma unroll
            for (int i = 0; i < BWD_DC / 8; ++i) {
                put_grad_pair(p.dk, p.dkdv_acc, off + i * 8, dk[i][2 * r] * p.scale, dk[i][2 * r + 1] * p.scale);
                put_grad_pair(p.dv, p.dkdv_acc, off + i * 8, dv[i][2 * r], dv[i][2 * r + 1]);
            }
        }
    }
}
#endif

#if BWD_V2 && (D == 64 || D == 128) && BWD_WARPS == 8 && BWD_BM == 64
// ---------------------------------------------------------------- backward v2 (sm_90 default)
// Same job as flash_bwd_dkdv (one block per 128-key tile, loop over the query tiles of every
// query head of the KV head), with every GEMM tiled over the 8 warps instead of one warp per 16
// keys: S^T and dP^T as 4 (keys) x 2 (queries) warps of 32 x 32, P^T and dS^T through shared
// memory, dV/dK as 4 (keys) x 2 (head-dim halves) warps of 32 x D/2, dQ as 2 (queries) x 4
// (head-dim quarters) warps of 32 x D/4. About 30 % fewer shared-memory operand bytes per FLOP.
#define LDP (BWD_BM + 8)
#define V2_DKC (D / 2)
#define V2_DQC (D / 4)

// acc += A B^T for one warp's 32 × 32 block, both operands D wide in shared memory (row
// stride LDS): A's 32 rows at a_addr, B's 32 rows at b_addr, addresses already carrying the
// lane's ldmatrix offset. The v2 backward's S^T = K Q^T and dP^T = V dO^T.
__device__ __forceinline__ void mma_warp_32x32(float (&acc)[2][4][4], u32 a_addr, u32 b_addr) {
#pragma unroll 2 // (full unrolling spills at d 128)
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
            ldsm_x4a(a[mi][0], a[mi][1], a[mi][2], a[mi][3], a_addr + 2 * (16 * mi * LDS + kk * 16));
#pragma unroll
        for (int nq = 0; nq < 2; ++nq) {
            u32 b0, b1, b2, b3;
            ldsm_x4a(b0, b1, b2, b3, b_addr + 2 * (16 * nq * LDS + kk * 16));
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                mma16816(acc[mi][2 * nq], a[mi], b0, b1);
                mma16816(acc[mi][2 * nq + 1], a[mi], b2, b3);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) flash_bwd_dkdv2(const BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* Ks = (elem_t*)smem_raw;
    elem_t* Vs = Ks + BWD_BN * LDS;
    elem_t* Qs = Vs + BWD_BN * LDS;          // 2 stages
    elem_t* dOs = Qs + 2 * BWD_BM * LDS;     // 2 stages
    elem_t* Ps = dOs + 2 * BWD_BM * LDS;     // 2 x [BWD_BN][LDP], P^T
    elem_t* dSs = Ps + 2 * BWD_BN * LDP;     // 2 x [BWD_BN][LDP], dS^T
    float* lse_s = (float*)(dSs + 2 * BWD_BN * LDP); // 2 stages
    float* del_s = lse_s + 2 * BWD_BM;            // 2 stages

    // Key tile 0 first: with a causal mask it has the most query tiles, so the heaviest blocks
    // start first and the lightest fill the tail (+6.5 % causal at 16k, no change without a
    // mask).
    const GridSlot slot = grid_slot(p.n_tiles, 1, p.batch * p.kv_heads, p.group);
    const int kt = slot.rank;
    const int kvh = slot.pair % p.kv_heads, b = slot.pair / p.kv_heads;
    const int G = p.heads / p.kv_heads;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int k0 = kt * BWD_BN;
    const size_t qstr = (size_t)p.heads * D, kstr = (size_t)p.kv_heads * D;
    const int e0 = p.tile_ptr[kt], ne = p.tile_ptr[kt + 1] - e0;
    const int total = G * ne;
    const int wm = warp & 3;  // key group of 32 (S, dP, dV, dK)
    const int wn = warp >> 2; // query half (S, dP) / head-dim half (dV, dK)
    const int wq = warp & 1;  // query half (dQ)
    const int wd = warp >> 1; // head-dim quarter (dQ)

    const elem_t* kbase = p.k + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    const elem_t* vbase = p.v + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    load_rows<BWD_BN, 256>(Ks, kbase, kstr, k0, p.k_len, tid);
    load_rows<BWD_BN, 256>(Vs, vbase, kstr, k0, p.k_len, tid);
    cp_async_commit();

    auto load_item_at = [&](int h, int qt, int st) {
        const elem_t* qb = p.q + ((size_t)b * p.q_len * p.heads + h) * D;
        const elem_t* db = p.dout + ((size_t)b * p.q_len * p.heads + h) * D;
        load_rows<BWD_BM, 256>(Qs + st * BWD_BM * LDS, qb, qstr, qt * BWD_BM, p.q_len, tid);
        load_rows<BWD_BM, 256>(dOs + st * BWD_BM * LDS, db, qstr, qt * BWD_BM, p.q_len, tid);
        if (tid < 2 * BWD_BM) {
            const int i = tid % BWD_BM;
            const int row = qt * BWD_BM + i;
            const bool ok = row < p.q_len;
            const size_t off = ((size_t)b * p.heads + h) * p.q_len + (ok ? row : 0);
            if (tid < BWD_BM) cp_async4(lse_s + st * BWD_BM + i, p.lse + off, ok ? 4 : 0);
            else cp_async4(del_s + st * BWD_BM + i, p.delta + off, ok ? 4 : 0);
        }
    };
    if (total > 0) load_item_at(kvh * G, p.tiles[e0].x, 0);
    cp_async_commit();
    // (head, tile) of items it (…_c) and it+1 (…_n) kept in registers and advanced without
    // divisions; the tile entry of it+1 is loaded during item it-1 (off the barrier's path).
    int h_c = kvh * G, h_n = kvh * G, ei_n = 1;
    if (ei_n == ne) { ei_n = 0; ++h_n; }
    int2 te_c = total > 0 ? p.tiles[e0] : make_int2(0, -1);
    int2 te_n = total > 1 ? p.tiles[e0 + ei_n] : te_c;

    float dk[2][V2_DKC / 8][4], dv[2][V2_DKC / 8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int i = 0; i < V2_DKC / 8; ++i) {
            dk[mi][i][0] = dk[mi][i][1] = dk[mi][i][2] = dk[mi][i][3] = 0.f;
            dv[mi][i][0] = dv[mi][i][1] = dv[mi][i][2] = dv[mi][i][3] = 0.f;
        }
    // Per-lane ldmatrix byte offsets ("A": A operands / transposed B; "B": plain B).
    const u32 laneA = 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
    const u32 laneB = 2 * (((lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8);
    const u32 laneAP = 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * LDP + (lane >> 4) * 8);
    const u32 laneSP = 2 * (((lane & 7) + (lane >> 4) * 8) * LDP + ((lane >> 3) & 1) * 8);
    const u32 ks_u = smem_u32(Ks), vs_u = smem_u32(Vs);

    // Two barriers per query tile: (1) this tile's loads have landed and every warp is done
    // with tile it-1, so stage st^1 (Q, dO, P^T, dS^T of tile it-1) may be refilled; (2) P^T and
    // dS^T of this tile are complete. P^T/dS^T are double-buffered like Q/dO for that.
    for (int it = 0; it < total; ++it) {
        const int st = it & 1;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < total) load_item_at(h_n, te_n.x, st ^ 1);
        cp_async_commit();
        const int h = h_c;
        const int2 te = te_c;
        elem_t* Pst = Ps + st * BWD_BN * LDP;
        elem_t* dSst = dSs + st * BWD_BN * LDP;
        const u32 ps_u = smem_u32(Pst), ds_u = smem_u32(dSst);
        const u32 qst = smem_u32(Qs) + 2 * st * BWD_BM * LDS;
        const u32 dost = smem_u32(dOs) + 2 * st * BWD_BM * LDS;
        const float* lse_st = lse_s + st * BWD_BM;
        const float* del_st = del_s + st * BWD_BM;

        {
            // S^T = K Q^T and dP^T = V dO^T, this warp's 32 keys x 32 queries.
            float sp[2][4][4], dp[2][4][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) sp[mi][j][c] = dp[mi][j][c] = 0.f;
            mma_warp_32x32(sp, ks_u + laneA + 2 * (32 * wm * LDS), qst + laneB + 2 * (32 * wn * LDS));
            mma_warp_32x32(dp, vs_u + laneA + 2 * (32 * wm * LDS), dost + laneB + 2 * (32 * wn * LDS));
            // P^T, dS^T = P^T (dP^T - delta) -> shared memory (bf16/f16).
            constexpr int W = BWD_BN / 32;
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int rk = 32 * wm + 16 * mi + g; // key row in the tile (and rk + 8)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c = 32 * wn + 8 * j + 2 * t; // query column (and c + 1)
                    float pv[4], dsv[4];
#pragma unroll
                    for (int c2 = 0; c2 < 2; ++c2) {
                        const float lv = lse_st[c + c2];
                        const float l2 = lv == NEG_INF ? POS_INF : lv * LOG2E;
                        const float dl = del_st[c + c2];
                        float p0 = fast_exp2(fmaf(sp[mi][j][c2], p.scale_log2, -l2));
                        float p1 = fast_exp2(fmaf(sp[mi][j][2 + c2], p.scale_log2, -l2));
                        if (te.y >= 0) {
                            const u32 w = p.bits[te.y + (c + c2) * W + (rk >> 5)] >> (rk & 31);
                            if (!(w & 1)) p0 = 0.f;
                            if (!(w & 0x100)) p1 = 0.f;
                        }
                        pv[c2] = p0;
                        pv[2 + c2] = p1;
                        dsv[c2] = p0 * (dp[mi][j][c2] - dl);
                        dsv[2 + c2] = p1 * (dp[mi][j][2 + c2] - dl);
                    }
                    *(u32*)(Pst + rk * LDP + c) = pack2(pv[0], pv[1]);
                    *(u32*)(Pst + (rk + 8) * LDP + c) = pack2(pv[2], pv[3]);
                    *(u32*)(dSst + rk * LDP + c) = pack2(dsv[0], dsv[1]);
                    *(u32*)(dSst + (rk + 8) * LDP + c) = pack2(dsv[2], dsv[3]);
                }
            }
        }
        __syncthreads();
        h_c = h_n;
        te_c = te_n;
        if (++ei_n == ne) { ei_n = 0; ++h_n; }
        if (it + 2 < total) te_n = p.tiles[e0 + ei_n];
        // dV += P^T dO and dK += dS^T Q: this warp's 32 keys x D/2 columns.
#pragma unroll
        for (int kq = 0; kq < BWD_BM / 16; ++kq) {
            u32 ap[2][4], as[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                ldsm_x4a(ap[mi][0], ap[mi][1], ap[mi][2], ap[mi][3], ps_u + laneAP + 2 * ((32 * wm + 16 * mi) * LDP + kq * 16));
                ldsm_x4a(as[mi][0], as[mi][1], as[mi][2], as[mi][3], ds_u + laneAP + 2 * ((32 * wm + 16 * mi) * LDP + kq * 16));
            }
#pragma unroll
            for (int dj = 0; dj < V2_DKC / 16; ++dj) {
                u32 b0, b1, b2, b3;
                ldsm_x4a_t(b0, b1, b2, b3, dost + laneA + 2 * (kq * 16 * LDS + V2_DKC * wn + dj * 16));
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    mma16816(dv[mi][2 * dj], ap[mi], b0, b1);
                    mma16816(dv[mi][2 * dj + 1], ap[mi], b2, b3);
                }
                ldsm_x4a_t(b0, b1, b2, b3, qst + laneA + 2 * (kq * 16 * LDS + V2_DKC * wn + dj * 16));
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    mma16816(dk[mi][2 * dj], as[mi], b0, b1);
                    mma16816(dk[mi][2 * dj + 1], as[mi], b2, b3);
                }
            }
        }
        // dQ += scale * dS K: this warp's 32 queries x D/4 columns, f32 reductions.
        {
            float dq[2][V2_DQC / 8][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int i = 0; i < V2_DQC / 8; ++i) dq[mi][i][0] = dq[mi][i][1] = dq[mi][i][2] = dq[mi][i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BWD_BN / 16; ++kk) {
                u32 a[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
                    ldsm_x4a_t(a[mi][0], a[mi][1], a[mi][2], a[mi][3], ds_u + laneSP + 2 * (kk * 16 * LDP + 32 * wq + 16 * mi));
#pragma unroll
                for (int dj = 0; dj < V2_DQC / 16; ++dj) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4a_t(b0, b1, b2, b3, ks_u + laneA + 2 * (kk * 16 * LDS + V2_DQC * wd + dj * 16));
#pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        mma16816(dq[mi][2 * dj], a[mi], b0, b1);
                        mma16816(dq[mi][2 * dj + 1], a[mi], b2, b3);
                    }
                }
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = te.x * BWD_BM + 32 * wq + 16 * mi + g + 8 * r;
                    if (row < p.q_len) {
                        float* dst = p.dq_acc + (((size_t)b * p.q_len + row) * p.heads + h) * D + V2_DQC * wd + 2 * t;
#pragma unroll
                        for (int i = 0; i < V2_DQC / 8; ++i)
                            red_add2(dst + i * 8, dq[mi][i][2 * r] * p.scale, dq[mi][i][2 * r + 1] * p.scale);
                    }
                }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = k0 + 32 * wm + 16 * mi + g + 8 * r;
            if (key < p.k_len) {
                const size_t off = (((size_t)b * p.k_len + key) * p.kv_heads + kvh) * D + V2_DKC * wn + 2 * t;
#pragma unroll
                for (int i = 0; i < V2_DKC / 8; ++i) {
                    put_grad_pair(p.dk, p.dkdv_acc, off + i * 8, dk[mi][i][2 * r] * p.scale, dk[mi][i][2 * r + 1] * p.scale);
                    put_grad_pair(p.dv, p.dkdv_acc, off + i * 8, dv[mi][i][2 * r], dv[mi][i][2 * r + 1]);
                }
            }
        }
}
#endif
