// The loads of the warp-specialized backward kernels (backward.cu, backward_wide.cu), run by one
// producer warp: a block's K and V tiles (BN rows) once, then per item (BM query rows of one
// query head) the LSE (log2 units) and minus delta rows with plain loads and Q and dO with TMA,
// into STAGES stages `stage_bytes` apart, each signalled on its `full` mbarrier and reused once
// its `freed` one says the consumers have read it.
#pragma once
#include "sm90/primitives.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A key-major block (`block`: its index within its job): its key tile (rank 0 first, the
// heaviest under a causal mask), batch entry and KV head, the tile plan's entries e0..e0+ne, and
// its G x ne items (every query head of the KV head).
struct BwdKeyBlock { int kt, kvh, b, G, e0, ne, total; };
__device__ __forceinline__ BwdKeyBlock bwd_key_block(const BwdParams& p, unsigned block) {
    const GridSlot s = grid_slot_at(block, p.n_tiles, 1, p.batch * p.kv_heads, p.group);
    const int G = p.heads / p.kv_heads, e0 = p.tile_ptr[s.rank], ne = p.tile_ptr[s.rank + 1] - e0;
    return {s.rank, s.pair % p.kv_heads, s.pair / p.kv_heads, G, e0, ne, G * ne};
}
// One warp stores the LSE (log2 units) and minus delta of R query rows from row0 of head h,
// batch b. Rows past the end, and rows that see no key (LSE -inf), get LSE +inf: P =
// 2^(s - inf) = 0.
template <int R>
__device__ __forceinline__ void bwd_load_rows(const BwdParams& p, float* lse_s, float* del_s, int row0, int h, int b,
                                              int lane) {
#pragma unroll
    for (int r = lane; r < R; r += 32) {
        const int row = row0 + r;
        const size_t off = ((size_t)b * p.heads + h) * p.q_len + row;
        const bool ok = row < p.q_len;
        const float lv = ok ? p.lse[off] : NEG_INF;
        lse_s[r] = lv == NEG_INF ? POS_INF : lv * LOG2E;
        del_s[r] = ok ? -p.delta[off] : 0.f;
    }
    __syncwarp();
}

template <int BN, int BM, int STAGES>
__device__ __forceinline__ void bwd_load(const BwdParams& p, const TmaMap* tq, const TmaMap* tdo, const TmaMap* tk,
                                         const TmaMap* tv, u32 Ks, u32 Vs, u32 Qs, u32 dOs, u32 stage_bytes,
                                         float* lse_s, float* del_s, u32 full_kv, u32 full, u32 freed, int k0,
                                         int kvh, int b, int e0, int ne, int total, int lane) {
    constexpr u32 ITEM_BYTES = 2 * BM * DK * 2;
    const int G = p.heads / p.kv_heads;
    if (lane == 0) {
        mbar_expect_tx(full_kv, 2 * BN * DK * 2);
        tma_load_rows<BN>(Ks, tk, full_kv, k0, kvh, b);
        tma_load_rows<BN>(Vs, tv, full_kv, k0, kvh, b);
    }
    // (Few registers: the item's head and tile entry are stepped, not divided out.)
    int h = kvh * G, ei = 0;
#pragma unroll 1
    for (int it = 0; it < total; ++it) {
        const int st = it % STAGES, ph = (it / STAGES) & 1;
        const int qt = p.tiles[e0 + ei].x;
        if (it >= STAGES) mbar_wait(freed + 8 * st, ph ^ 1);
        bwd_load_rows<BM>(p, lse_s + st * BM, del_s + st * BM, qt * BM, h, b, lane);
        if (lane == 0) { // the arrival releases the rows stored above with the copies' bytes
            mbar_expect_tx(full + 8 * st, ITEM_BYTES);
            tma_load_rows<BM>(Qs + st * stage_bytes, tq, full + 8 * st, qt * BM, h, b);
            tma_load_rows<BM>(dOs + st * stage_bytes, tdo, full + 8 * st, qt * BM, h, b);
        }
        if (++ei == ne) { ei = 0; ++h; }
    }
}
#endif
