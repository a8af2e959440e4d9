// What the host passes to the kernels: the parameter structs and the mapping of the forward's
// launch grid onto blocks. The host defines each struct once, in src/params.rs, and every module
// compiled ends with static_asserts that the declarations here have its sizes and offsets.
//
// Layouts (elements): Q/O/dO/dQ [b, nq, h, d], K/V/dK/dV [b, nk, hkv, d], LSE/delta [b, h, nq]
// in f32 (natural log for LSE). Masks arrive as per-tile lists built on the host:
// tile_ptr[t]..tile_ptr[t+1] index into `tiles` (x = other-axis tile, y = offset in u32 words
// of the tile's bitmask in `bits`, or -1 for a full tile). Bitmask rows are query rows of the
// tile, BN bits per row (bit = key column), so full tiles need no mask arithmetic at all.
#pragma once
#include "common.cuh"

struct FwdParams {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    elem_t* o;
    float* o_f32; // optional (null)
    float* lse;
    const int* tile_ptr;
    const int2* tiles;
    const u32* bits;
    int batch, q_len, k_len, heads, kv_heads, n_tiles;
    float scale_log2;
    int group; // (batch, KV head) pairs per group of the launch order (grid_slot)
    int merge; // o_f32 and lse hold a partial result to merge into (sm_90a warp-specialized kernel)
    int prefetch; // launch-order distance to the block whose Q tile a block prefetches into the L2 (0: none)
};

// The launch order of the attention kernels' one-dimensional grids. Blocks start in launch
// order, so the order decides which blocks form the tail. The (batch, KV head) pairs are taken
// in groups of `group` (the last group also takes the remainder); a group's blocks go
// rank-major (rank 0: the tile with the most work under a causal mask) over its pairs and each
// pair's `subs` blocks. A group's blocks share their K/V (forward) or Q/dO (backward) through
// the L2, which one pair per group would keep best (long sequences outgrow the L2); but then the
// last pair's heaviest blocks start late and run alone at the end. The host makes a group at
// least two waves of blocks (launch_group in attention.rs), so the heavy blocks of the last
// group start while others still run.
struct GridSlot { int rank, pair, sub; };
// (block: the block's index in the grid, or in its part of a grid that launches two jobs.)
__device__ __forceinline__ GridSlot grid_slot_at(unsigned block, int n_ranks, int subs, int pairs, int group) {
    const int n_groups = max(1, pairs / group);
    const unsigned per_group = (unsigned)(group * n_ranks * subs);
    const int gi = min((int)(block / per_group), n_groups - 1), first = gi * group;
    const int width = (gi == n_groups - 1 ? pairs - first : group) * subs; // blocks per rank in this group
    const int r = block - gi * per_group;
    const int rank = r / width, w = r - rank * width;
    return {rank, first + w / subs, w % subs};
}
__device__ __forceinline__ GridSlot grid_slot(int n_ranks, int subs, int pairs, int group) {
    return grid_slot_at(blockIdx.x, n_ranks, subs, pairs, group);
}

// A forward block's query tile, head, KV head and batch: rank = query tile from the last (the
// heaviest under a causal mask), subs = the G query heads of a KV head, which read the same
// K/V tiles side by side.
struct FwdBlock { int qt, h, kvh, b; };
__device__ __forceinline__ FwdBlock fwd_block_at(const FwdParams& p, unsigned block) {
    const int G = p.heads / p.kv_heads;
    const GridSlot s = grid_slot_at(block, p.n_tiles, G, p.batch * p.kv_heads, p.group);
    const int kvh = s.pair % p.kv_heads;
    return {p.n_tiles - 1 - s.rank, kvh * G + s.sub, kvh, s.pair / p.kv_heads};
}
__device__ __forceinline__ FwdBlock fwd_block(const FwdParams& p) { return fwd_block_at(p, blockIdx.x); }

// The FP8 forward's (`flash_fwd_e4m3_*`): the forward's (q, k, v: e4m3, v transposed; o: the
// module's dtype), and per-(batch, KV head) f32 descales of Q, K and V (null: 1).
struct E4m3FwdParams {
    FwdParams f;
    const float* q_descale;
    const float* k_descale;
    const float* v_descale;
};

// V's transpose for the FP8 forward (`transpose_v_e4m3`): v [b, nk, hkv, D] -> vt [b, hkv, D,
// k_pad], k_pad a multiple of 128.
struct TransposeVParams {
    const unsigned char* v;
    unsigned char* vt;
    int k_len, kv_heads, k_pad, pad_;
};

struct BwdParams {
    const elem_t* q;
    const elem_t* k;
    const elem_t* v;
    const elem_t* dout;
    const float* lse;
    const float* delta;
    float* dq_acc;
    elem_t* dq; // dQ in the input type, written where one block computes each row whole (the
                // by-query dQ job of a whole backward), else null: dQ is added into dq_acc
    elem_t* dk;
    elem_t* dv;
    const int* tile_ptr; // per key tile
    const int2* tiles;   // x = query tile, y = bitmask offset or -1
    const u32* bits;     // rows = BWD_BM query rows, BWD_BN key bits per row
    int batch, q_len, k_len, heads, kv_heads, n_tiles;
    float scale_log2, scale;
    int group; // (batch, KV head) pairs per group of the launch order (grid_slot)
    int dkdv_acc; // dk and dv are f32 accumulators to add into (else the input type, written)
};

// A tensor map (CUtensorMap, encoded on the host) describes a [batch][rows][heads][D] tensor
// as 4-d {D, rows, heads, batch}; boxes are 64 columns (128 bytes, swizzled like wgmma's
// operands) x R rows, rows past the end read as zeros. The Hopper kernels take them by value.
struct __align__(64) TmaMap { u64 v[16]; };

// ---- the auxiliary kernels' (aux.cu)

// D = rowsum(dO * O) of `rows` rows of head_dim values.
struct DeltaParams {
    const void* o; // elem_t (delta_o_elem) or float (delta_o_f32)
    const elem_t* dout;
    float* delta;
    long long rows; // batch * q_len * heads
    int head_dim, q_len, heads;
    int lanes; // lanes a row: head_dim / 8 rounded up to a power of two, at most 32
};

// A merge of a partial (O, LSE) into accumulators (f32, O rows of d values): rows (b, h, t) for
// b < batch, h < nh, t < total; t is a token of the pieces `tp` (n_pieces quads), h the source's
// head hs0 + h of hs and the accumulator's head hd0 + h of hd; the source has ns tokens and the
// accumulator nd.
struct MergeParams {
    const float* o; const float* lse; float* oacc; float* lacc;
    const i64* tp;  // per token piece: src token, dst token, length, start in the flattened pieces
    i64 total; i64 ns; i64 nd;
    int n_pieces; int batch; int nh; int hs; int hd; int hs0; int hd0; int d;
};

// ---- decode (decode.cu, and the plan and append kernels of aux.cu)

// One decode step: Q/O [batch, q_rows, heads, D], LSE [batch, heads, q_rows] (f32, natural log);
// K/V caches [pages, page_size, kv_heads, D] with page_table [batch, max_pages] (or a row table,
// see row_table); request b has
// seqlens[b] + seqlen_add keys (clamped to its pages); cu_tiles [batch + 1] are the prefix sums of
// its tiles (decode_plan); part_o [2 * blocks, 16, D] and part_lse [2 * blocks, 16] hold cut
// segments' partials (blocks = the grid); counters [batch * segs_per_request] start at zero and end there.
struct DecodeParams {
    const elem_t* q; const elem_t* k; const elem_t* v; elem_t* o; float* lse;
    const int* page_table; const int* seqlens; const i64* cu_tiles;
    float* part_o; float* part_lse; int* counters;
    int batch, q_rows, heads, kv_heads, page_size, max_pages, segs_per_request, seqlen_add;
    int causal;
    int page_shift; // log2(page_size) for a power of two, else -1
    float scale_log2;
    // 1: page_table[b] is request b's first key row of one contiguous cache (max_pages 1, page_size
    // the cache's rows), as a block of a spread cache's decode holds its keys.
    int row_table;
    // 1: O is written as f32 at `o` (a distributed step's partial, merged in f32) instead of in
    // the input dtype.
    int o_f32;
    int pad_;
};

// Appends new_tokens tokens per request (k_new/v_new [batch, new_tokens, kv_heads, head_dim])
// at positions seqlens[b].. of the paged caches; `chunks` = 16-byte chunks of k_new.
struct AppendParams {
    const elem_t* k_new; const elem_t* v_new; elem_t* k_cache; elem_t* v_cache;
    const int* page_table; const int* seqlens;
    i64 chunks;
    int new_tokens, row_chunks, page_size, max_pages;
};
