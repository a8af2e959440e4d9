#include "sm90/forward.cu"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && FWD_WG && D == 128
// ---------------------------------------------------------------- FP8 forward (sm_90a)
// The forward pipeline of forward.cu on e4m3 tiles: Q, K and V are 8-bit, O is the module's
// dtype. 8-bit wgmma reads B K-major only, so V arrives transposed, [batch][KV head][D][keys]
// (transpose_v_e4m3, below), with the keys of every 32-key block in the order in which the
// score accumulators already sit in the threads: P goes from accumulators to the A operand of
// P V without a shuffle. Per-(batch, KV head) descales fold into the score scale (Q, K) and the
// output scale (V). Its products take half the bf16 ones' time, so the softmax dominates.

// The key of position pos of a permuted row of V^T (pos < 32 within its block): the A operand
// of a k = 32 step wants, in thread t's bytes 0..3, keys 4t..4t+3, where the score accumulators
// hold keys 2t, 2t+1, 8+2t, 9+2t (and 16 more for bytes of the second half).
__device__ __forceinline__ int e4m3_key_of(int pos) {
    const int e = pos & 3, t = (pos >> 2) & 3;
    return (pos & 16) + ((e >> 1) << 3) + 2 * t + (e & 1);
}

// NC consumer warpgroups (64 query rows each) over BN-key tiles, without turns (its products
// are short beside its softmax; turns were 3-14% slower). Two block shapes, which the host picks
// by the grid's size: 192 x 64 (three consumers, whose 160 registers a thread hold O, a 64-key
// score tile and P; at 16k on an H100 3-7% faster than 128 x 128 or 128 x 192 with two) and
// 128 x 128 (two consumers; more blocks where a grid of 192-row ones would leave SMs idle in its
// last wave: 8-16% faster at 4k).
template <int NC, int BN_>
struct FwdE4m3 : FwdConsumers<NC> {
    // Q and K tiles are one 128-byte swizzled column block (a head dim of 128 bytes); V^T's are
    // BN / 64 blocks of D rows of 64 bytes (a TMA box each) in the 64-byte swizzle.
    static constexpr int BN = BN_;
    static_assert(BN == 64 || BN == 128, "score products of 64 or 128 keys");
    static constexpr u32 Q_BYTES = FwdConsumers<NC>::BM * D, TILE_BYTES = BN * D, VT_BLOCK = 64 * D;
    static constexpr bool TURNS = false;
    static constexpr bool O_VIA_TILE = false; // (an e4m3 Q tile holds half of O; no O map)
    using PFrag = u32[BN / 32][4];
    __device__ static __forceinline__ void load_q(u32 dst, const TmaMap* m, u32 bar, int q0, int h, int b) {
        tma_box(dst, m, bar, 0, q0, h, b);
    }
    __device__ static __forceinline__ void prefetch_q(const TmaMap* m, int q0, int h, int b) { tma_prefetch_box(m, 0, q0, h, b); }
    __device__ static __forceinline__ void load_k(u32 dst, const TmaMap* m, u32 bar, int k0, int kvh, int b) {
        tma_box(dst, m, bar, 0, k0, kvh, b);
    }
    // V^T's tile: D rows of BN keys, in blocks of 64 keys.
    __device__ static __forceinline__ void load_v(u32 dst, const TmaMap* m, u32 bar, int k0, int kvh, int b) {
#pragma unroll
        for (int kb = 0; kb < BN / 64; ++kb) tma_box(dst + kb * VT_BLOCK, m, bar, k0 + 64 * kb, 0, kvh, b);
    }
    __device__ static __forceinline__ void qk(float (&s)[BN / 2], u32 qs, int cw, u32 ks) {
        const u64 da = wg_desc(qs + 64 * cw * 128, 16, 1024), db = wg_desc(ks, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) wgmma_e4m3_ss_step(s, wg_desc_add(da, 32 * kk), wg_desc_add(db, 32 * kk), kk);
    }
    // k-step kk covers accumulator column blocks 4kk..4kk+3 (see e4m3_key_of).
    __device__ static __forceinline__ void pack_p(PFrag& pa, const float (&s)[BN / 2]) {
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk) {
            const float* x = s + 16 * kk;
            pa[kk][0] = pack4_e4m3(x[0], x[1], x[4], x[5]);
            pa[kk][1] = pack4_e4m3(x[2], x[3], x[6], x[7]);
            pa[kk][2] = pack4_e4m3(x[8], x[9], x[12], x[13]);
            pa[kk][3] = pack4_e4m3(x[10], x[11], x[14], x[15]);
        }
    }
    // k-step kk: 32 keys, half a 64-key block of V^T.
    __device__ static __forceinline__ void pv(float (&o)[D / 2], const PFrag& pa, u32 vs) {
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk)
            wgmma_e4m3_rs_n128(o, pa[kk], wg_desc(vs + (kk >> 1) * VT_BLOCK + 32 * (kk & 1), 16, 512, WG_SW64));
    }
};

// The FP8 forward of one block on the tiles of Ops: descales folded into the score and output
// scales.
template <class Ops>
__device__ __forceinline__ void fwd_e4m3(const E4m3FwdParams& p, const TmaMap* tq, const TmaMap* tk, const TmaMap* tvt) {
    const FwdBlock fb = fwd_block(p.f);
    const int bh = fb.b * p.f.kv_heads + fb.kvh;
    const float qd = p.q_descale ? p.q_descale[bh] : 1.f;
    const float kd = p.k_descale ? p.k_descale[bh] : 1.f;
    const float vd = p.v_descale ? p.v_descale[bh] : 1.f;
    fwd_ws<Ops>(p.f, fb, tq, tk, tvt, nullptr, p.f.scale_log2 * qd * kd, vd);
}

// The kernels are named by their blocks' query rows x keys (the host's E4m3Tiling).
#define FWD_E4M3_KERNEL(NC, BN, NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(FwdE4m3<NC, BN>::THREADS, 1)                                     \
    NAME(const E4m3FwdParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,             \
         const __grid_constant__ TmaMap tvt) {                                                                    \
        fwd_e4m3<FwdE4m3<NC, BN>>(p, &tq, &tk, &tvt);                                                             \
    }
FWD_E4M3_KERNEL(3, 64, flash_fwd_e4m3_192x64)
FWD_E4M3_KERNEL(2, 128, flash_fwd_e4m3_128x128)

// V [batch][keys][KV heads][D] -> V^T [batch][KV heads][D][k_pad], keys permuted per 32-key
// block (e4m3_key_of), zeros past k_len. Grid: (k_pad / 64, KV heads, batch), 256 threads. The
// 64 keys' rows go through shared memory in words (rows of 33 words: the reads below fall on
// distinct banks but for pairs); each thread then turns 4 words (keys k, k + 1, k + 8, k + 9 of
// 4 columns: the 4 positions of one output word, see e4m3_key_of) into 4 output words (one per
// column) with byte permutes, and half-warps store 64 contiguous bytes of a V^T row.
extern "C" __global__ void __launch_bounds__(256) transpose_v_e4m3(const TransposeVParams p) {
    __shared__ u32 tile[64][D / 4 + 1];
    const int k0 = blockIdx.x * 64, kvh = blockIdx.y, b = blockIdx.z;
    for (int i = threadIdx.x; i < 64 * D / 16; i += blockDim.x) {
        const int r = i / (D / 16), c = i % (D / 16), key = k0 + r;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (key < p.k_len) x = *(const uint4*)(p.v + (((size_t)b * p.k_len + key) * p.kv_heads + kvh) * D + 16 * c);
        tile[r][4 * c] = x.x;
        tile[r][4 * c + 1] = x.y;
        tile[r][4 * c + 2] = x.z;
        tile[r][4 * c + 3] = x.w;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int pw = lane & 15;                          // output word: positions 4pw..4pw+3
    const int kb = (4 * pw & ~31) + e4m3_key_of(4 * pw & 31); // its keys: kb, kb + 1, kb + 8, kb + 9
    unsigned char* vt = p.vt + ((size_t)b * p.kv_heads + kvh) * D * p.k_pad + k0 + 4 * pw;
#pragma unroll
    for (int it = 0; it < D / 64; ++it) {
        const int d = 8 * (8 * it + wi) + 4 * (lane >> 4); // columns d..d+3
        const u32 a0 = tile[kb][d / 4], a1 = tile[kb + 1][d / 4], a2 = tile[kb + 8][d / 4], a3 = tile[kb + 9][d / 4];
        const u32 lo01 = __byte_perm(a0, a1, 0x5140), hi01 = __byte_perm(a0, a1, 0x7362);
        const u32 lo23 = __byte_perm(a2, a3, 0x5140), hi23 = __byte_perm(a2, a3, 0x7362);
        const u32 w[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                          __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
        for (int r = 0; r < 4; ++r) *(u32*)(vt + (size_t)(d + r) * p.k_pad) = w[r];
    }
}
#endif // FWD_WG && D == 128
