// ---------------------------------------------------------------- decode (mma.sync, sm_80+)
//
// Few query rows per request against a paged KV cache, split stream-K over a fixed grid (Lean
// Attention; the host's distattn_core::decode::DecodeSplit is the same arithmetic). A segment is
// (request b, KV head, block of 16 query rows: the query heads that share the KV head x the
// request's rows); its tiles of DEC_BN keys are laid end to end after the previous segments', and
// block c of W takes tiles [c*T/W, (c+1)*T/W). A block walks its segments: a segment it holds
// whole is written to O and LSE directly; a cut segment leaves a normalised partial (O, LSE) in
// slot 2c (the block's first segment) or 2c+1 (its last), and the block that completes the
// segment's set of pieces (an atomic count per segment; in two levels past DEC_GROUP pieces)
// merges them by LSE and resets the count: one launch does all, and no block waits for another.
//
// Inside a block the DEC_WARPS warps split each K/V tile's keys (16 each), each with its own
// online softmax over the block's 16 rows; the warps' states are merged at the end of the piece.
// K/V tiles stream through DEC_STAGES cp.async stages; a tile's rows are looked up in the page
// table one by one, so any page size works.
#include "common.cuh"
#include "params.cuh"

#ifndef DEC_WARPS
#define DEC_WARPS 8
#endif
#ifndef DEC_STAGES
#define DEC_STAGES 3
#endif
#define DEC_BN (16 * DEC_WARPS) // keys per tile: 16 per warp
#define DEC_ROWS 16
#define DEC_NT (32 * DEC_WARPS)
#define DEC_Q_IN_REGS (D <= 128)

__device__ __forceinline__ int dec_len(const DecodeParams& p, int b) {
    // Clamped to the request's pages: a length past them never reads outside its table row.
    const i64 len = (i64)p.seqlens[b] + p.seqlen_add;
    const i64 cap = (i64)p.max_pages * p.page_size;
    return (int)(len < 0 ? 0 : len > cap ? cap : len);
}

// The segment holding global tile t, and its first tile.
__device__ __forceinline__ void dec_segment(const DecodeParams& p, i64 t, int& seg, i64& start, i64& n) {
    const i64 S = p.segs_per_request;
    int lo = 0, hi = p.batch - 1; // the last b with cu_tiles[b] * S <= t
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (p.cu_tiles[mid] * S <= t) lo = mid; else hi = mid - 1;
    }
    n = p.cu_tiles[lo + 1] - p.cu_tiles[lo];
    const i64 j = (t - p.cu_tiles[lo] * S) / n;
    seg = (int)(lo * S + j);
    start = p.cu_tiles[lo] * S + j * n;
}

// old = *p; *p += v, a release of this thread's (and, after a barrier, its block's) writes and an
// acquire of those released by the earlier adds, at GPU scope.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Block c's first tile, and the block whose share holds tile t, of `workers` shares of `total`.
__device__ __forceinline__ i64 dec_share(i64 c, i64 total, i64 workers) { return c * total / workers; }
__device__ __forceinline__ int dec_worker_of(i64 t, i64 total, i64 workers) { return (int)(((t + 1) * workers - 1) / total); }

// The workers of a step (distattn_core::decode::DecodeSplit::new): fewer tiles than blocks, one
// tile each; equal segments no more than the blocks, the same whole number of blocks each (no
// block straddles two segments, whose pipeline would restart mid-share; segments are taken as
// equal when the first request's tiles times the batch make the total); else every block.
__device__ __forceinline__ i64 dec_workers(i64 blocks, i64 total, i64 segments, bool equal) {
    if (total <= blocks) return total;
    if (equal && segments <= blocks) return blocks / segments * segments;
    return blocks;
}

// The partial slot of the k-th piece of a segment that starts at tile seg_start and whose first
// piece is block c0's: every later block starts its share inside the segment (its first piece,
// slot 2c); block c0's piece is its first only if its share starts with the segment.
__device__ __forceinline__ int dec_slot(int k, int c0, i64 seg_start, i64 total, i64 workers) {
    const int c = c0 + k;
    return 2 * c + (k == 0 && dec_share(c0, total, workers) < seg_start);
}

// Reads of other blocks' partials: from L2 (never a stale L1 line); volatile, so that they stay
// after the count and barrier that order them after the other blocks' writes (a few are issued
// before their first use, to overlap).
__device__ __forceinline__ float ldcg(const float* p) {
    float x;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}
__device__ __forceinline__ float4 ldcg4(const float* p) {
    float4 x;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
    return x;
}

// Element offset of request b's key in the cache, KV head 0: the page from the table, found with
// a shift for a power-of-two page size and without a division for a single page (or the row
// from a row table).
__device__ __forceinline__ size_t dec_key_off(const DecodeParams& p, const int* table, int key, size_t row_stride,
                                              size_t page_stride) {
    if (p.row_table) return ((size_t)table[0] + key) * row_stride;
    int page_idx, slot;
    if (p.max_pages == 1) { page_idx = 0; slot = key; }
    else if (p.page_shift >= 0) { page_idx = key >> p.page_shift; slot = key & (p.page_size - 1); }
    else { page_idx = key / p.page_size; slot = key - page_idx * p.page_size; }
    return (size_t)table[page_idx] * page_stride + (size_t)slot * row_stride;
}

// Loads key tile `kt` of request b (rows past `len` zero-filled) for KV head kvh into Ks / Vs.
// Consecutive lanes copy consecutive 16-byte chunks of a row; where whole rows fit a pass, each
// thread keeps one chunk column and finds one row's page per pass.
__device__ __forceinline__ void dec_load_kv(const DecodeParams& p, elem_t* Ks, elem_t* Vs, int b, int kvh, int kt,
                                            int len, int tid) {
    constexpr int CPR = D / 8; // chunks per row
    const int* table = p.page_table + (size_t)b * p.max_pages;
    const size_t row_stride = (size_t)p.kv_heads * D, page_stride = (size_t)p.page_size * row_stride;
    if constexpr (DEC_NT % CPR == 0) {
        constexpr int RPP = DEC_NT / CPR; // rows per pass
        const int ch = tid % CPR, r0 = tid / CPR;
        const size_t head_off = (size_t)kvh * D + ch * 8;
#pragma unroll
        for (int i = 0; i < DEC_BN / RPP; ++i) {
            const int r = r0 + i * RPP, key = kt * DEC_BN + r;
            const bool ok = key < len;
            const size_t off = ok ? dec_key_off(p, table, key, row_stride, page_stride) + head_off : 0;
            cp_async16(Ks + r * LDS + ch * 8, p.k + off, ok ? 16 : 0);
            cp_async16(Vs + r * LDS + ch * 8, p.v + off, ok ? 16 : 0);
        }
    } else {
#pragma unroll
        for (int c = tid; c < DEC_BN * CPR; c += DEC_NT) {
            const int r = c / CPR, ch = c % CPR, key = kt * DEC_BN + r;
            const bool ok = key < len;
            const size_t off = ok ? dec_key_off(p, table, key, row_stride, page_stride) + (size_t)kvh * D + ch * 8 : 0;
            cp_async16(Ks + r * LDS + ch * 8, p.k + off, ok ? 16 : 0);
            cp_async16(Vs + r * LDS + ch * 8, p.v + off, ok ? 16 : 0);
        }
    }
}

// Where a merge writes: the rows of segment (request b, KV head kvh, block from row r0).
struct DecMergeAt { int b, kvh, r0, G, rows; };

// At most this many blocks' pieces are merged by one block (see flash_decode's end).
#define DEC_GROUP 16
__device__ __forceinline__ int dec_max_groups() { return (gridDim.x + DEC_GROUP - 1) / DEC_GROUP; }

// Merges the n partials of slots[0..n) (shared memory) by LSE, with weights in Wr: into the
// step's O and LSE (out_slot < 0) or into partial slot out_slot (which may be slots[0]: every
// value is read before it is written, by the same thread).
__device__ __forceinline__ void dec_merge(const DecodeParams& p, const int* slots, int n, float* Wr, int out_slot,
                                          const DecMergeAt& at) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, rows = at.rows;
    for (int e = tid; e < n * rows; e += DEC_NT) {
        const int k = e / rows, r = e % rows;
        Wr[k * DEC_ROWS + r] = ldcg(p.part_lse + slots[k] * DEC_ROWS + r);
    }
    __syncthreads();
    // A warp per row: the merged LSE and each partial's weight exp(lse_k - LSE).
    for (int r = warp; r < rows; r += DEC_NT / 32) {
        float M = NEG_INF;
        for (int k = lane; k < n; k += 32) M = fmax_nan(M, Wr[k * DEC_ROWS + r]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmax_nan(M, __shfl_xor_sync(0xffffffff, M, o));
        const float mu = M == NEG_INF ? 0.f : M;
        float L = 0.f;
        for (int k = lane; k < n; k += 32) {
            const float w = fast_exp2((Wr[k * DEC_ROWS + r] - mu) * LOG2E);
            Wr[k * DEC_ROWS + r] = w;
            L += w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffff, L, o);
        const float inv = L != 0.f ? 1.f / L : 0.f;
        for (int k = lane; k < n; k += 32) Wr[k * DEC_ROWS + r] *= inv;
        if (lane == 0) {
            const float lse = L != 0.f ? M + __logf(L) : NEG_INF;
            if (out_slot >= 0) {
                p.part_lse[out_slot * DEC_ROWS + r] = lse;
            } else {
                const int gr = at.r0 + r, qi = gr / at.G, h = at.kvh * at.G + gr % at.G;
                p.lse[((size_t)at.b * p.heads + h) * p.q_rows + qi] = lse;
            }
        }
    }
    __syncthreads();
    // O: 4 columns per item, T threads (adjacent lanes) per item splitting the partials, 16
    // loads in flight each (a merge is bound by the latency of L2 reads).
    constexpr int C4 = D / 4;
    const int items = rows * C4;
    const int T = items * 4 <= DEC_NT ? 4 : items * 2 <= DEC_NT ? 2 : 1;
    for (int e0 = 0; e0 < items * T; e0 += DEC_NT) {
        const int e = e0 + tid, item = e / T, sub = e % T;
        const int r = item / C4, col = 4 * (item % C4);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (item < items) {
            for (int k0 = sub; k0 < n; k0 += 16 * T) {
                float4 x[16];
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    const int k = k0 + u * T;
                    x[u] = k < n ? ldcg4(p.part_o + ((size_t)slots[k] * DEC_ROWS + r) * D + col) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    const int k = k0 + u * T;
                    const float w = k < n ? Wr[k * DEC_ROWS + r] : 0.f;
                    acc.x += w * x[u].x; acc.y += w * x[u].y; acc.z += w * x[u].z; acc.w += w * x[u].w;
                }
            }
        }
        for (int o = 1; o < T; o <<= 1) { // the item's T partial sums (T divides 32)
            acc.x += __shfl_xor_sync(0xffffffff, acc.x, o);
            acc.y += __shfl_xor_sync(0xffffffff, acc.y, o);
            acc.z += __shfl_xor_sync(0xffffffff, acc.z, o);
            acc.w += __shfl_xor_sync(0xffffffff, acc.w, o);
        }
        if (item < items && sub == 0) {
            if (out_slot >= 0) {
                *(float4*)(p.part_o + ((size_t)out_slot * DEC_ROWS + r) * D + col) = acc;
            } else {
                const int gr = at.r0 + r, qi = gr / at.G, h = at.kvh * at.G + gr % at.G;
                const size_t i = (((size_t)at.b * p.q_rows + qi) * p.heads + h) * D + col;
                if (p.o_f32) *(float4*)((float*)p.o + i) = acc;
                else *(uint2*)(p.o + i) = make_uint2(pack2(acc.x, acc.y), pack2(acc.z, acc.w));
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(DEC_NT, 1) flash_decode(const DecodeParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* Qs = (elem_t*)smem_raw;
    elem_t* Ks = Qs + DEC_ROWS * LDS;
    elem_t* Vs = Ks + DEC_STAGES * DEC_BN * LDS;
    // After a piece's tiles, the stages hold the warps' states: O (16 x D f32 per warp), m, l.
    float* Ow = (float*)Ks;
    float* Mw = Ow + DEC_WARPS * DEC_ROWS * D;
    float* Lw = Mw + DEC_WARPS * DEC_ROWS;
    float* Wr = Lw + DEC_WARPS * DEC_ROWS; // per (piece or warp, row) weights of a merge
    __shared__ float rowM[DEC_ROWS], rowL[DEC_ROWS];
    __shared__ int s_last;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int G = p.heads / p.kv_heads, RB = p.segs_per_request / p.kv_heads, rows_all = G * p.q_rows;
    const int c = blockIdx.x;
    const i64 total = p.cu_tiles[p.batch] * p.segs_per_request;
    const i64 workers = dec_workers(gridDim.x, total, (i64)p.batch * p.segs_per_request, p.cu_tiles[1] * p.batch == p.cu_tiles[p.batch]);
    if (c >= workers) return;
    const i64 t0 = dec_share(c, total, workers), t1 = dec_share(c + 1, total, workers);
    const float sl2 = p.scale_log2;

    bool first_piece = true;
    for (i64 t = t0; t < t1;) {
        int seg; i64 seg_start, n;
        dec_segment(p, t, seg, seg_start, n);
        const i64 seg_end = seg_start + n, end = seg_end < t1 ? seg_end : t1;
        const int b = seg / p.segs_per_request, j = seg % p.segs_per_request;
        const int kvh = j / RB, r0 = (j % RB) * DEC_ROWS;
        const int rows = min(DEC_ROWS, rows_all - r0); // real rows of this block
        const int len = dec_len(p, b);
        const int kt0 = (int)(t - seg_start), kt1 = (int)(end - seg_start);

        // Q rows of the block (row r: query row (r0+r)/G of head kvh*G + (r0+r)%G), zero past `rows`.
        for (int e = tid; e < DEC_ROWS * (D / 8); e += DEC_NT) {
            const int r = e / (D / 8), ch = e % (D / 8);
            const bool ok = r < rows;
            const int gr = r0 + r, qi = gr / G, h = kvh * G + gr % G;
            const elem_t* src = p.q + (((size_t)b * p.q_rows + qi) * p.heads + h) * D + ch * 8;
            cp_async16(Qs + r * LDS + ch * 8, ok ? src : p.q, ok ? 16 : 0);
        }
        cp_async_commit();
#pragma unroll
        for (int s = 0; s < DEC_STAGES - 1; ++s) {
            if (kt0 + s < kt1) dec_load_kv(p, Ks + s * DEC_BN * LDS, Vs + s * DEC_BN * LDS, b, kvh, kt0 + s, len, tid);
            cp_async_commit();
        }
        // This thread's two rows (g, g+8): the keys they see end at lim (causal: the row's own
        // position, the new tokens being the request's last); keys past it are masked.
        int lim[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int gr = r0 + g + 8 * r, qi = gr / G;
            lim[r] = (p.causal && gr < rows_all) ? min(len, len - p.q_rows + qi + 1) : len;
        }
        const int mask_from = p.causal ? min(len, len - p.q_rows + r0 / G + 1) : len; // the block's least lim

        float o[D / 8][4];
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
        const elem_t* qrow_ptr = Qs + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;
#if DEC_Q_IN_REGS
        u32 qf[D / 16][4];
        cp_async_wait<DEC_STAGES - 1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], qrow_ptr + kk * 16);
#endif

        for (int kt = kt0; kt < kt1; ++kt) {
            const int i = kt - kt0, stage = i % DEC_STAGES;
            {
                const int nxt = kt + DEC_STAGES - 1, ns = (i + DEC_STAGES - 1) % DEC_STAGES;
                if (nxt < kt1) dec_load_kv(p, Ks + ns * DEC_BN * LDS, Vs + ns * DEC_BN * LDS, b, kvh, nxt, len, tid);
                cp_async_commit();
            }
            cp_async_wait<DEC_STAGES - 1>();
            __syncthreads();
            // This warp's 16 keys of the tile.
            const int key0 = warp * 16;
            const u32 kaddr = smem_u32(Ks) + 2 * ((stage * DEC_BN + key0 + (lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8);
            const u32 vaddr = smem_u32(Vs) + 2 * ((stage * DEC_BN + key0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
            float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 a[4];
#if DEC_Q_IN_REGS
                a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
#else
                ldsm_x4(a[0], a[1], a[2], a[3], qrow_ptr + kk * 16);
#endif
                u32 b0, b1, b2, b3;
                ldsm_x4a(b0, b1, b2, b3, kaddr + 2 * kk * 16);
                mma16816(s[0], a, b0, b1);
                mma16816(s[1], a, b2, b3);
            }
            if ((kt + 1) * DEC_BN > mask_from) {
#pragma unroll
                for (int jn = 0; jn < 2; ++jn) {
                    const int key = kt * DEC_BN + key0 + 8 * jn + 2 * t4;
                    if (key >= lim[0]) s[jn][0] = NEG_INF;
                    if (key + 1 >= lim[0]) s[jn][1] = NEG_INF;
                    if (key >= lim[1]) s[jn][2] = NEG_INF;
                    if (key + 1 >= lim[1]) s[jn][3] = NEG_INF;
                }
            }
            float al[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = fmax_nan(fmax_nan(s[0][2 * r], s[0][2 * r + 1]), fmax_nan(s[1][2 * r], s[1][2 * r + 1]));
                mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmax_nan(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                const float mn = fmax_nan(m[r], mx * sl2);
                const float mu = mn == NEG_INF ? 0.f : mn;
                const float alpha = fast_exp2(m[r] - mu);
                m[r] = mn;
                float rs = 0.f;
#pragma unroll
                for (int jn = 0; jn < 2; ++jn) {
                    s[jn][2 * r] = fast_exp2(fmaf(s[jn][2 * r], sl2, -mu));
                    s[jn][2 * r + 1] = fast_exp2(fmaf(s[jn][2 * r + 1], sl2, -mu));
                    rs += s[jn][2 * r] + s[jn][2 * r + 1];
                }
                l[r] = l[r] * alpha + rs;
                al[r] = alpha;
            }
            // O is rescaled only when a row's max moved (rarely, once a long row has settled).
            if (__any_sync(0xffffffff, al[0] != 1.f || al[1] != 1.f)) {
#pragma unroll
                for (int d8 = 0; d8 < D / 8; ++d8) {
                    o[d8][0] *= al[0]; o[d8][1] *= al[0]; o[d8][2] *= al[1]; o[d8][3] *= al[1];
                }
            }
            u32 a[4];
            a[0] = pack2(s[0][0], s[0][1]);
            a[1] = pack2(s[0][2], s[0][3]);
            a[2] = pack2(s[1][0], s[1][1]);
            a[3] = pack2(s[1][2], s[1][3]);
#pragma unroll
            for (int dj = 0; dj < D / 16; ++dj) {
                u32 b0, b1, b2, b3;
                ldsm_x4a_t(b0, b1, b2, b3, vaddr + 2 * dj * 16);
                mma16816(o[2 * dj], a, b0, b1);
                mma16816(o[2 * dj + 1], a, b2, b3);
            }
            __syncthreads();
        }
        cp_async_wait<0>();
        __syncthreads();

        // The warps' states into shared memory: unnormalised O, m (log2 units), l.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float lt = l[r];
            lt += __shfl_xor_sync(0xffffffff, lt, 1);
            lt += __shfl_xor_sync(0xffffffff, lt, 2);
            const int row = g + 8 * r;
            if (t4 == 0) { Mw[warp * DEC_ROWS + row] = m[r]; Lw[warp * DEC_ROWS + row] = lt; }
#pragma unroll
            for (int d8 = 0; d8 < D / 8; ++d8)
                *(float2*)(Ow + (warp * DEC_ROWS + row) * D + d8 * 8 + 2 * t4) = make_float2(o[d8][2 * r], o[d8][2 * r + 1]);
        }
        __syncthreads();
        // Per row: the merged max and sum, and each warp's weight.
        if (tid < DEC_ROWS) {
            float M = NEG_INF;
            for (int w = 0; w < DEC_WARPS; ++w) M = fmax_nan(M, Mw[w * DEC_ROWS + tid]);
            const float mu = M == NEG_INF ? 0.f : M;
            float L = 0.f;
            for (int w = 0; w < DEC_WARPS; ++w) L += Lw[w * DEC_ROWS + tid] * fast_exp2(Mw[w * DEC_ROWS + tid] - mu);
            const float inv = L != 0.f ? 1.f / L : 0.f;
            for (int w = 0; w < DEC_WARPS; ++w) Wr[w * DEC_ROWS + tid] = fast_exp2(Mw[w * DEC_ROWS + tid] - mu) * inv;
            // L = 0: the row saw no key (O = 0, LSE = -inf); a NaN passes on.
            rowL[tid] = L != 0.f ? (M + __log2f(L)) * LN2 : NEG_INF;
        }
        __syncthreads();

        const bool whole = seg_start >= t0 && seg_end <= t1;
        const int slot = 2 * c + (first_piece ? 0 : 1);
        for (int e = tid; e < rows * D; e += DEC_NT) {
            const int r = e / D, col = e % D;
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < DEC_WARPS; ++w) acc += Wr[w * DEC_ROWS + r] * Ow[(w * DEC_ROWS + r) * D + col];
            if (whole) {
                const int gr = r0 + r, qi = gr / G, h = kvh * G + gr % G;
                const size_t i = (((size_t)b * p.q_rows + qi) * p.heads + h) * D + col;
                if (p.o_f32) ((float*)p.o)[i] = acc;
                else p.o[i] = from_f32(acc);
            } else {
                p.part_o[((size_t)slot * DEC_ROWS + r) * D + col] = acc;
            }
        }
        if (tid < rows) {
            const int gr = r0 + tid, qi = gr / G, h = kvh * G + gr % G;
            if (whole) p.lse[((size_t)b * p.heads + h) * p.q_rows + qi] = rowL[tid];
            else p.part_lse[slot * DEC_ROWS + tid] = rowL[tid];
        }

        if (!whole) {
            // Publish the piece. Up to DEC_GROUP pieces, the block that completes the segment's
            // count merges them; more, in two levels: the block that completes a group of
            // DEC_GROUP pieces merges it into the group's first slot, and the block that
            // completes the groups merges those (a single block would read every piece). One
            // thread per block counts, with release and acquire at GPU scope after a barrier:
            // that orders the block's writes before, and the other blocks' after, the count.
            __syncthreads();
            const int c0 = dec_worker_of(seg_start, total, workers), c1 = dec_worker_of(seg_end - 1, total, workers);
            const int pieces = c1 - c0 + 1, groups = (pieces + DEC_GROUP - 1) / DEC_GROUP;
            int* slots = (int*)(Wr + (pieces < DEC_GROUP ? pieces : DEC_GROUP) * DEC_ROWS + groups * DEC_ROWS);
            const DecMergeAt at{b, kvh, r0, G, rows};
            bool final_level = groups == 1;
            if (!final_level) {
                const int g = (c - c0) / DEC_GROUP, n = min(DEC_GROUP, pieces - g * DEC_GROUP);
                int* gcount = p.counters + (size_t)p.batch * p.segs_per_request + (size_t)seg * dec_max_groups() + g;
                if (tid == 0) s_last = atomic_add_acq_rel(gcount, 1) == n - 1;
                __syncthreads();
                if (s_last) {
                    for (int k = tid; k < n; k += DEC_NT) slots[k] = dec_slot(g * DEC_GROUP + k, c0, seg_start, total, workers);
                    __syncthreads();
                    dec_merge(p, slots, n, Wr, slots[0], at);
                    if (tid == 0) *gcount = 0;
                    __syncthreads();
                    final_level = true;
                }
            }
            if (final_level) {
                if (tid == 0) s_last = atomic_add_acq_rel(p.counters + seg, 1) == (groups == 1 ? pieces : groups) - 1;
                __syncthreads();
                if (s_last) {
                    const int n = groups == 1 ? pieces : groups, step = groups == 1 ? 1 : DEC_GROUP;
                    for (int k = tid; k < n; k += DEC_NT) slots[k] = dec_slot(k * step, c0, seg_start, total, workers);
                    __syncthreads();
                    dec_merge(p, slots, n, Wr, -1, at);
                    if (tid == 0) p.counters[seg] = 0;
                }
            }
        }
        __syncthreads();
        first_piece = false;
        t = end;
    }
}
