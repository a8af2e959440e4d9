#include "sm90/backward_loads.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && BWD_WG && (D == 128 || D == 96 || D == 64)
// ---------------------------------------------------------------- backward (sm_90a)
// One block per 128-key tile, a loop over the query "items" (WG_BM rows: 64 at d 96 and 128,
// 128 at d 64) of every query head of the KV head. Consumer warpgroup c owns keys 64c..64c+63:
//   S^T = K Q^T, dP^T = V dO^T      (shared x shared, 64 x WG_BM per warpgroup)
//   P^T, dS^T = P^T (dP^T - delta)  (registers, reused as the A operand:)
//   dV += P^T dO, dK += dS^T Q      (registers x shared, 64 x D per warpgroup)
//   dQ = dS K                       (dS^T through shared memory, over all 128 keys; d 128:
//                                    warpgroup c takes dQ's columns 64c.., d 96 too (1: 64..95),
//                                    d 64 its rows 64c..)
// At d 64 an item of 64 rows gave each barrier and each wait half the tensor-core work, and the
// kernel was bound by that chain of waits (0.83-0.98x cuDNN); 128-row items double the work
// between them and halve the dQ reductions per product.
// At d 96 the tiles have DK = 128 columns (primitives.cuh): S^T and dP^T take the 96 columns'
// k-steps only, dV and dK are 96 columns wide, and warpgroup 1's dQ block 32 (one staged box,
// one reduction). Against the padded products the d 96 backward is 8-19% faster on an H100
// (full masks at 16k the most).
// The block is warp-specialized: warpgroup 0 moves memory (warp 0 brings K and V once and, per
// item, Q and dO with TMA and the item's LSE and delta rows with plain loads, into BS_STAGES
// stages signalled by mbarriers; warp 1 adds each item's dQ, left by the consumers in shared
// memory, into dq_acc with TMA reductions), warpgroups 1 and 2 compute. They order their
// products so that each elementwise step runs while a product is in flight (P^T under dP^T,
// dS^T under dV, the dQ staging under dK). dS^T is double-buffered, so one barrier per item
// (dS^T of both consumers stored) orders its reuse.
#define WG_BN 128
#define WG_BM BWD_BM
#define BS_STAGES BWD_STAGES
static_assert(WG_BM == (DK == 64 ? 128 : 64), "the host plans 128-row items at d 64, 64-row ones above");
// The 32-column boxes of consumer c's staged dQ block: 2, but 1 for consumer 1 at d 96, whose
// columns 64..95 are the head dim's last (an N = 32 product).
__device__ __forceinline__ constexpr int bwd_dq_boxes(int c) { return D == 96 && c == 1 ? 1 : 2; }
// dQ's block of a consumer, dS K over the tile's 128 keys into dq (N = 2 NA: 64, or 32 for one
// box), A and B the k-step 0 descriptors.
template <int NA>
__device__ __forceinline__ void bwd_dq_product(float (&dq)[NA], u64 dds, u64 dk_b) {
#pragma unroll
    for (int kk = 0; kk < WG_BN / 16; ++kk)
        wgmma_ss_step<1, 1>(dq, wg_desc_add(dds, kk * 16 * 128), wg_desc_add(dk_b, kk * 16 * 128), kk);
}
// Adds a swizzled f32 tile of 64 rows x 32 columns (128-byte rows) at src into rows r0.. and
// columns c0.. of (head h, batch b) of an f32 tensor (its map's boxes); rows past its end are
// dropped.
__device__ __forceinline__ void tma_reduce_add(const TmaMap* map, u32 src, int c0, int r0, int h, int b) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"((u64)map), "r"(src), "r"(c0), "r"(r0), "r"(h), "r"(b) : "memory");
}
extern "C" __global__ void __launch_bounds__(384, 1)
flash_bwd_ws(const BwdParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tdo,
             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,
             const __grid_constant__ TmaMap tdq) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    const u32 Ks = (raw + 1023) & ~1023u;             // [WG_BN][DK]
    const u32 Vs = Ks + WG_BN * DK * 2;               // [WG_BN][DK]
    const u32 Qs = Vs + WG_BN * DK * 2;               // BS_STAGES x [WG_BM][DK]
    const u32 dOs = Qs + BS_STAGES * WG_BM * DK * 2;  // BS_STAGES x [WG_BM][DK]
    const u32 dSs = dOs + BS_STAGES * WG_BM * DK * 2; // 2 x [WG_BN][WG_BM], dS^T
    const u32 dQs = dSs + 2 * WG_BN * WG_BM * 2;     // 2 consumers x 2 x [64][32] f32, swizzled
    const u32 lse_a = dQs + 2 * 64 * 64 * 4;         // BS_STAGES x [WG_BM] f32
    const u32 del_a = lse_a + BS_STAGES * WG_BM * 4; // BS_STAGES x [WG_BM] f32
    const u32 bars = del_a + BS_STAGES * WG_BM * 4;  // mbarriers, 8 bytes each:
    const u32 full_kv = bars;                         //   K, V landed
    const u32 full = bars + 8, freed = full + 8 * BS_STAGES; // item stage landed / read
    const u32 dq_full = freed + 8 * BS_STAGES, dq_free = dq_full + 16; // per consumer
    float* lse_s = (float*)(smem_raw + (lse_a - raw));
    float* del_s = (float*)(smem_raw + (del_a - raw));

    const auto [kt, kvh, b, G, e0, ne, total] = bwd_key_block(p, blockIdx.x);
    const int tid = threadIdx.x, wg = warpgroup_index(), wi = (tid >> 5) & 3, lane = tid & 31;
    const int k0 = kt * WG_BN;

    if (tid == 0) {
        mbar_init(full_kv, 1);
        for (int i = 0; i < BS_STAGES; ++i) {
            mbar_init(full + 8 * i, 1);
            mbar_init(freed + 8 * i, 8); // one arrival per consumer warp
        }
        for (int c = 0; c < 2; ++c) {
            mbar_init(dq_full + 8 * c, 4); // one arrival per warp of consumer c
            mbar_init(dq_free + 8 * c, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Registers: 384 x 168 at launch, rebalanced: 24 for the producers, 240 for the consumers.
    if (wg == 0) {
        reg_dealloc<24>();
        if (wi == 0 && total > 0)
            bwd_load<WG_BN, WG_BM, BS_STAGES>(p, &tq, &tdo, &tk, &tv, Ks, Vs, Qs, dOs, WG_BM * DK * 2, lse_s, del_s,
                                              full_kv, full, freed, k0, kvh, b, e0, ne, total, lane);
        else if (wi == 1 && lane == 0 && total > 0) { // dQ reductions: 2 boxes of 64 rows per consumer
            int h = kvh * G, ei = 0;
#pragma unroll 1
            for (int it = 0; it < total; ++it) {
                const int qt = p.tiles[e0 + ei].x;
#pragma unroll 1
                for (int c = 0; c < 2; ++c) {
                    mbar_wait(dq_full + 8 * c, it & 1);
                    for (int cb = 0; cb < bwd_dq_boxes(c); ++cb)
                        tma_reduce_add(&tdq, dQs + (2 * c + cb) * 64 * 128, (DK == 128 ? 64 * c : 0) + 32 * cb,
                                       qt * WG_BM + (WG_BM == 128 ? 64 * c : 0), h, b);
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                    mbar_arrive(dq_free + 8 * c);
                }
                if (++ei == ne) { ei = 0; ++h; }
            }
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        }
        return;
    }
    reg_alloc<240>();
    const int cw = wg - 1;
    const int g = lane >> 2, t = lane & 3;
    const int rk = 64 * cw + 16 * wi + g; // this thread's key rows in the tile: rk, rk + 8

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    // This thread's staged dQ pairs: rows 16wi + g (+8), columns 8i + 2t, in box i / 4 at 16-byte
    // chunk (2(i % 4) + t / 2) ^ g (the row's swizzle; rows g and g + 8 share it). Rows g and g ^ 1
    // would hit the same banks if stored in the same order, so store k of an odd row writes
    // column block i = k ^ 2 (within the box): the 16 lanes of each half-warp then cover all 32
    // banks (flipping bit 1 of the block is enough; bit 0 is not).
    const u32 dq_row = dQs + cw * 2 * 64 * 128 + (16 * wi + g) * 128 + 8 * (t & 1);
    const int dq_rot = (g & 1) << 1;
    // S^T starts from -LSE / scale (per query column), so that P^T = 2^(S^T scale_log2): no
    // register holds the LSE across the products. (The producer stores the LSE in log2 units.)
    const float lse_to_acc = -1.f / p.scale_log2;
    constexpr int NJ = WG_BM / 8; // the score accumulators' blocks of 8 query columns
    if (total > 0) mbar_wait(full_kv, 0);
    int2 te_next = total > 0 ? p.tiles[e0] : make_int2(0, -1); // loaded an item ahead
    int e_next = 0; // its entry, stepped (a division by ne per item costs ~20 instructions)
    for (int it = 0; it < total; ++it) {
        const int st = it % BS_STAGES, ph = (it / BS_STAGES) & 1;
        const int2 te = te_next;
        if (++e_next == ne) e_next = 0;
        if (it + 1 < total) te_next = p.tiles[e0 + e_next];
        const u32 qst = Qs + st * WG_BM * DK * 2, dost = dOs + st * WG_BM * DK * 2;
        const u32 dsb = dSs + (it & 1) * WG_BN * WG_BM * 2;
        const float* lse_st = lse_s + st * WG_BM;
        const float* ndel_st = del_s + st * WG_BM; // minus delta
        mbar_wait(full + 8 * st, ph);

        // The item's LSE and minus delta (this thread's query columns 8j + 2t, +1) start the
        // accumulators. dP^T starts from -delta, so it ends as dP^T - delta: no subtraction
        // between the wait and dS^T.
        float s[WG_BM / 2], dp[WG_BM / 2];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const float2 l2 = ((const float2*)(lse_st + 2 * t))[4 * j];
            const float2 nd = ((const float2*)(ndel_st + 2 * t))[4 * j];
            s[4 * j] = s[4 * j + 2] = l2.x * lse_to_acc;
            s[4 * j + 1] = s[4 * j + 3] = l2.y * lse_to_acc;
            dp[4 * j] = dp[4 * j + 2] = nd.x;
            dp[4 * j + 1] = dp[4 * j + 3] = nd.y;
        }
        // (ptxas waits for S^T before issuing dP^T, because dP^T's initial values are written
        // while S^T is in flight. Writing them first, so that the two issue back to back, was
        // 2% slower at d 128 and no faster at d 64: the other consumer's products fill the gap.)
        wg_fence();
        wg_gemm_kmajor<WG_BM / 2, true>(s, Ks, WG_BN, 64 * cw, qst, WG_BM);
        wg_commit();
        wg_fence();
        wg_gemm_kmajor<WG_BM / 2, true>(dp, Vs, WG_BN, 64 * cw, dost, WG_BM);
        wg_commit();
        wg_wait<1>(); // S^T (dP^T may run)
        wg_pin(s);

        // P^T as A fragments: k-step kq covers query columns 16kq..16kq+15, i.e. the
        // accumulator column blocks j = 2kq (fragments 0, 1) and 2kq + 1 (fragments 2, 3).
        u32 pa[WG_BM / 16][4], sa[WG_BM / 16][4];
#pragma unroll
        for (int i = 0; i < WG_BM / 2; ++i) s[i] = fast_exp2(s[i] * p.scale_log2);
        if (te.y >= 0) { // a partial tile: zero P where the mask drops the pair (a branch, not predication)
            constexpr int W = WG_BN / 32;
            const u32* bits = p.bits + te.y + (rk >> 5);
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int c2 = 0; c2 < 2; ++c2) {
                    const u32 w = bits[(8 * j + 2 * t + c2) * W] >> (rk & 31);
                    if (!(w & 1)) s[4 * j + c2] = 0.f;
                    if (!(w & 0x100)) s[4 * j + 2 + c2] = 0.f;
                }
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            pa[j >> 1][(j & 1) * 2] = pack2(s[4 * j], s[4 * j + 1]);
            pa[j >> 1][(j & 1) * 2 + 1] = pack2(s[4 * j + 2], s[4 * j + 3]);
        }
        // dV += P^T dO (B = dO, N-major: DK columns in DK/64 blocks of WG_BM rows).
        const u64 ddo = wg_desc(dost, WG_BM * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kq = 0; kq < WG_BM / 16; ++kq) wgmma_rs_nD<1>(dv, pa[kq], wg_desc_add(ddo, kq * 16 * 128), 1);
        wg_commit();
        wg_wait<1>(); // dP^T (dV may run)
        wg_pin(dp);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const float dsv[4] = {s[4 * j] * dp[4 * j], s[4 * j + 1] * dp[4 * j + 1], s[4 * j + 2] * dp[4 * j + 2],
                                  s[4 * j + 3] * dp[4 * j + 3]};
            sa[j >> 1][(j & 1) * 2] = pack2(dsv[0], dsv[1]);
            sa[j >> 1][(j & 1) * 2 + 1] = pack2(dsv[2], dsv[3]);
            // dS^T -> shared memory for dQ (query columns in blocks of 64); rows rk and rk + 8
            // share the swizzle (rk % 8 = g).
            const u32 a = dsb + (j >> 3) * WG_BN * 128 + rk * 128 + 4 * t + (((j & 7) ^ g) << 4);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(sa[j >> 1][(j & 1) * 2]));
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a + 8 * 128), "r"(sa[j >> 1][(j & 1) * 2 + 1]));
        }
        fence_async_smem();
        float dq[32];
        named_sync(1, 256); // dS^T of both warpgroups is in shared memory
        // dQ's 64 x 64 block of this warpgroup = dS K over all 128 keys: A = dS (M-major: dS^T
        // rows are keys; d 64: query block cw), B = K (N-major; d 128: column block cw).
        const u64 dds = wg_desc(dsb + (WG_BM == 128 ? cw : 0) * WG_BN * 128, WG_BN * 128, 1024);
        const u64 dk_b = wg_desc(Ks + (DK == 128 ? cw : 0) * WG_BN * 128, WG_BN * 128, 1024);
        wg_fence();
        if (bwd_dq_boxes(cw) == 2)
            bwd_dq_product(dq, dds, dk_b);
        else // (dq[0..15])
            bwd_dq_product(*reinterpret_cast<float(*)[16]>(&dq[0]), dds, dk_b);
        wg_commit();
        // dK += dS^T Q, issued after dQ: dQ is staged while dK runs on the tensor cores.
        const u64 dq_b = wg_desc(qst, WG_BM * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kq = 0; kq < WG_BM / 16; ++kq) wgmma_rs_nD<1>(dk, sa[kq], wg_desc_add(dq_b, kq * 16 * 128), 1);
        wg_commit();
        if (it > 0) mbar_wait(dq_free + 8 * cw, (it - 1) & 1); // the previous dQ has been read
        wg_wait<1>(); // dV and dQ (dK may run)
        wg_pin(dq);
        // Column blocks permuted by dq_rot (selects: registers are not indexable).
        float dqr[32];
#pragma unroll
        for (int k = 0; k < 32; ++k) dqr[k] = dq_rot ? dq[k ^ 8] : dq[k];
#pragma unroll
        for (int k = 0; k < 4 * bwd_dq_boxes(cw); ++k) { // (4 stores a box)
            const int i = (k & 4) | ((k & 3) ^ dq_rot);
            const u32 a = dq_row + (k >> 2) * 64 * 128 + (((2 * (i & 3) + (t >> 1)) ^ g) << 4);
#pragma unroll
            for (int r = 0; r < 2; ++r)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a + r * 8 * 128),
                             "f"(dqr[4 * k + 2 * r] * p.scale), "f"(dqr[4 * k + 2 * r + 1] * p.scale));
        }
        fence_async_smem();
        __syncwarp();
        if (lane == 0) mbar_arrive(dq_full + 8 * cw);
        wg_wait<0>(); // dK: the stage's Q and dO are no longer read
        if (lane == 0) mbar_arrive(freed + 8 * st);
    }
    wg_pin(dk);
    wg_pin(dv);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = k0 + rk + 8 * r;
        if (key < p.k_len) {
            const size_t off = (((size_t)b * p.k_len + key) * p.kv_heads + kvh) * D + 2 * t;
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                put_grad_pair(p.dk, p.dkdv_acc, off + i * 8, dk[4 * i + 2 * r] * p.scale, dk[4 * i + 2 * r + 1] * p.scale);
                put_grad_pair(p.dv, p.dkdv_acc, off + i * 8, dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
            }
        }
    }
}
#endif // BWD_WG && (D == 128 || D == 96 || D == 64)
