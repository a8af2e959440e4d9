// distattn auxiliary kernels: the backward's row delta and dQ conversion, the multi-GPU
// executor's piece copies and adds, the LSE merge of partial results and a deterministic random
// fill. Launched by src/aux.rs.
//
// Compiled at run time by NVRTC as a module of its own per element type (DA_BF16), for the GPU's
// architecture and without fast math (the merge's exp and log are the accurate ones). It has no
// head dim: row lengths are arguments.
#define DA_AUX 1
#include "common.cuh"
#include "params.cuh"

__device__ __forceinline__ float to_f32(float x) { return x; }

// ---------------------------------------------------------------- backward: delta = rowsum(dO * O)

// 8 consecutive values (16-byte aligned) as loaded, of the element type or f32, and as f32.
template <typename T> struct Chunk8;
template <> struct Chunk8<elem_t> { uint4 v; };
template <> struct Chunk8<float> { float4 a, b; };
__device__ __forceinline__ void load8(Chunk8<elem_t>& x, const elem_t* p) { x.v = *(const uint4*)p; }
__device__ __forceinline__ void load8(Chunk8<float>& x, const float* p) {
    x.a = ((const float4*)p)[0];
    x.b = ((const float4*)p)[1];
}
__device__ __forceinline__ void zero8(Chunk8<elem_t>& x) { x.v = make_uint4(0, 0, 0, 0); }
__device__ __forceinline__ void zero8(Chunk8<float>& x) { x.a = x.b = make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ void as_f32x8(float (&f)[8], const Chunk8<elem_t>& x) {
    const u32 w[4] = {x.v.x, x.v.y, x.v.z, x.v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = to_f32((elem_t)(w[i] & 0xffff));
        f[2 * i + 1] = to_f32((elem_t)(w[i] >> 16));
    }
}
__device__ __forceinline__ void as_f32x8(float (&f)[8], const Chunk8<float>& x) {
    f[0] = x.a.x, f[1] = x.a.y, f[2] = x.a.z, f[3] = x.a.w, f[4] = x.b.x, f[5] = x.b.y, f[6] = x.b.z, f[7] = x.b.w;
}

// DELTA_GROUPS (defined by the host, src/aux.rs): row groups a warp takes, every load issued
// before the first product.
// p.lanes lanes a row (a power of two, head_dim / 8 rounded up: some idle at d 96 and 192), 8
// columns a lane, 16-byte loads; a warp takes DELTA_GROUPS groups of 32 / p.lanes rows, so that
// enough bytes are in flight to run at the memory's rate. (One warp a row, 4 bytes a lane, ran
// at a third of it at d 64 and half at d 128.) O of type OT: the element type (a forward's
// output) or f32 (the merged O of the multi-GPU backward).
template <typename OT>
__device__ __forceinline__ void row_delta(const DeltaParams& p) {
    const int lane = threadIdx.x & 31, sub = lane & (p.lanes - 1), c = 8 * sub, per_group = 32 / p.lanes;
    const long long row0 = ((long long)blockIdx.x * 8 + (threadIdx.x >> 5)) * DELTA_GROUPS * per_group + lane / p.lanes;
    Chunk8<OT> o[DELTA_GROUPS];
    Chunk8<elem_t> g[DELTA_GROUPS];
#pragma unroll
    for (int u = 0; u < DELTA_GROUPS; u++) {
        const long long row = row0 + u * per_group;
        if (row < p.rows && c < p.head_dim) {
            load8(o[u], (const OT*)p.o + row * p.head_dim + c);
            load8(g[u], p.dout + row * p.head_dim + c);
        } else {
            zero8(o[u]);
            zero8(g[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < DELTA_GROUPS; u++) {
        float x[8], y[8], acc = 0.f;
        as_f32x8(x, o[u]);
        as_f32x8(y, g[u]);
#pragma unroll
        for (int i = 0; i < 8; i++) acc += x[i] * y[i];
        for (int s = p.lanes >> 1; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, s);
        const long long row = row0 + u * per_group;
        if (sub == 0 && row < p.rows) {
            const int h = (int)(row % p.heads);
            const long long bi = row / p.heads; // b * q_len + i
            const int i = (int)(bi % p.q_len);
            const long long bb = bi / p.q_len;
            p.delta[(bb * p.heads + h) * p.q_len + i] = acc;
        }
    }
}
extern "C" __global__ void __launch_bounds__(256) delta_o_elem(const DeltaParams p) { row_delta<elem_t>(p); }
extern "C" __global__ void __launch_bounds__(256) delta_o_f32(const DeltaParams p) { row_delta<float>(p); }

// ---------------------------------------------------------------- backward: dQ f32 -> dtype

extern "C" __global__ void __launch_bounds__(256) convert_f32(const float* src, elem_t* dst, long long n2) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n2) {
        float2 v = ((const float2*)src)[i];
        ((u32*)dst)[i] = pack2(v.x, v.y);
    }
}

// ---------------------------------------------------------------- piece copies and adds

// For each piece of `pieces` (blockIdx.x picks it; six i64: src, dst, len, rows, src stride,
// dst stride, in elements of the kernel's type), blockIdx.y and the threads stride through its
// rows × len elements: dst[d + r·ds + i] = src[s + r·ss + i] (copy: same type, the host picking
// the widest type that every offset allows; or two values converted between f32 and the element
// type) or += src as f32 (ADD).
// A unit of type S as one of type T: the same unit, or two f32 values as two of the element type (a
// final output narrowed for a link) and back.
template <typename T, typename S> __device__ __forceinline__ T as_unit(S x) { return x; }
template <> __device__ __forceinline__ u32 as_unit<u32, float2>(float2 v) { return pack2(v.x, v.y); }
template <> __device__ __forceinline__ float2 as_unit<float2, u32>(u32 a) {
    return make_float2(to_f32((elem_t)(a & 0xffff)), to_f32((elem_t)(a >> 16)));
}

template <bool ADD, typename S, typename T>
__device__ __forceinline__ void run_piece(const S* __restrict__ src, T* __restrict__ dst,
                                          const i64* __restrict__ pieces) {
    const i64* p = pieces + 6 * (i64)blockIdx.x;
    const i64 s = p[0], d = p[1], len = p[2], total = len * p[3], ss = p[4], ds = p[5];
    for (i64 j = (i64)blockIdx.y * blockDim.x + threadIdx.x; j < total; j += (i64)gridDim.y * blockDim.x) {
        const i64 r = j / len, i = j - r * len;
        if constexpr (ADD) dst[d + r * ds + i] += to_f32(src[s + r * ss + i]);
        else dst[d + r * ds + i] = as_unit<T>(src[s + r * ss + i]);
    }
}
extern "C" __global__ void copy_u16(const unsigned short* src, unsigned short* dst, const i64* pieces) {
    run_piece<false>(src, dst, pieces);
}
extern "C" __global__ void copy_u32(const u32* src, u32* dst, const i64* pieces) { run_piece<false>(src, dst, pieces); }
extern "C" __global__ void copy_u64(const unsigned long long* src, unsigned long long* dst, const i64* pieces) {
    run_piece<false>(src, dst, pieces);
}
extern "C" __global__ void copy_u128(const uint4* src, uint4* dst, const i64* pieces) { run_piece<false>(src, dst, pieces); }
extern "C" __global__ void narrow_f32(const float2* src, u32* dst, const i64* pieces) { run_piece<false>(src, dst, pieces); }
extern "C" __global__ void widen_elem(const u32* src, float2* dst, const i64* pieces) { run_piece<false>(src, dst, pieces); }
extern "C" __global__ void add_f32(const float* src, float* dst, const i64* pieces) { run_piece<true>(src, dst, pieces); }
extern "C" __global__ void add_elem(const elem_t* src, float* dst, const i64* pieces) {
    run_piece<true>(src, dst, pieces);
}

// ---------------------------------------------------------------- merge of partial (O, LSE)

__device__ __forceinline__ void merge_one(const float* o, const float* lse, float* oacc, float* lacc,
                                          i64 sl, i64 dl, i64 so, i64 dof, int d, int lane) {
    const float lb = lse[sl];
    const float la = lacc[dl];
    __syncwarp();
    if (lb == NEG_INF && !isnan(la)) return;  // the partial saw no key: nothing to add
    float wa, wb;
    const float l = lse_merge(la, lb, wa, wb);
    for (int c = lane; c < d; c += 32) oacc[dof + c] = wa * oacc[dof + c] + wb * o[so + c];
    if (lane == 0) lacc[dl] = l;
}

// One warp per (batch, head, token) row of the token pieces.
extern "C" __global__ void merge_pieces(MergeParams a) {
    const i64 row = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= (i64)a.batch * a.nh * a.total) return;
    const i64 t = row % a.total;
    const i64 bh = row / a.total;
    const int h = (int)(bh % a.nh), b = (int)(bh / a.nh);
    int lo = 0, hi = a.n_pieces - 1;
    while (lo < hi) { int mid = (lo + hi + 1) / 2; if (a.tp[4 * mid + 3] <= t) lo = mid; else hi = mid - 1; }
    const i64 off = t - a.tp[4 * lo + 3];
    const i64 i = a.tp[4 * lo] + off, j = a.tp[4 * lo + 1] + off;
    const int hsl = a.hs0 + h, hdl = a.hd0 + h;
    merge_one(a.o, a.lse, a.oacc, a.lacc,
              ((i64)b * a.hs + hsl) * a.ns + i, ((i64)b * a.hd + hdl) * a.nd + j,
              (((i64)b * a.ns + i) * a.hs + hsl) * a.d, (((i64)b * a.nd + j) * a.hd + hdl) * a.d, a.d, lane);
}

// ---------------------------------------------------------------- deterministic random fill

// Deterministic pseudo-random fill, uniform in [-a, a).
__device__ __forceinline__ float hash_unit(unsigned long long x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return (float)(x >> 40) * (1.0f / 16777216.0f);
}
extern "C" __global__ void rand_fill(elem_t* dst, i64 n, unsigned long long seed, float a) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = from_f32((hash_unit(seed * 0x9e3779b97f4a7c15ULL + i) * 2.f - 1.f) * a);
}

// ---------------------------------------------------------------- decode: plan and append

// cu_tiles[b] = sum over requests before b of max(1, ceil(len / tile)), len = seqlens + add
// clamped to [0, cap]: the split of one decode step, computed on the device from the device's
// lengths (no host round trip) once per step for every layer; and the decode's merge counters
// zeroed. One block of 256 threads.
extern "C" __global__ void __launch_bounds__(256) decode_plan(const int* seqlens, int add, int batch, int cap,
                                                              int tile, i64* cu_tiles, int* counters, i64 n_counters) {
    __shared__ i64 part[256];
    for (i64 i = threadIdx.x; i < n_counters; i += 256) counters[i] = 0;
    const int tid = threadIdx.x, per = (batch + 255) / 256, b0 = tid * per, b1 = min(batch, b0 + per);
    auto tiles = [&](int b) {
        i64 len = (i64)seqlens[b] + add;
        len = len < 0 ? 0 : len > cap ? cap : len;
        const i64 n = (len + tile - 1) / tile;
        return n > 0 ? n : (i64)1;
    };
    i64 sum = 0;
    for (int b = b0; b < b1; ++b) sum += tiles(b);
    part[tid] = sum;
    __syncthreads();
    for (int s = 1; s < 256; s <<= 1) { // inclusive scan (Hillis-Steele)
        const i64 x = tid >= s ? part[tid - s] : 0;
        __syncthreads();
        part[tid] += x;
        __syncthreads();
    }
    i64 run = part[tid] - sum;
    if (tid == 0) cu_tiles[0] = 0;
    for (int b = b0; b < b1; ++b) cu_tiles[b + 1] = (run += tiles(b));
}

// One thread per 16-byte chunk of the new K (and V) rows.
extern "C" __global__ void __launch_bounds__(256) append_kv(const AppendParams p) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.chunks) return;
    const i64 token = i / p.row_chunks; // b * new_tokens + j
    const int ch = (int)(i % p.row_chunks), b = (int)(token / p.new_tokens), j = (int)(token % p.new_tokens);
    const int pos = p.seqlens[b] + j;
    if (pos < 0 || pos >= p.max_pages * p.page_size) return; // past the request's pages: dropped
    const int page = p.page_table[(i64)b * p.max_pages + pos / p.page_size];
    const i64 dst = ((i64)page * p.page_size + pos % p.page_size) * p.row_chunks + ch;
    ((uint4*)p.k_cache)[dst] = ((const uint4*)p.k_new)[i];
    ((uint4*)p.v_cache)[dst] = ((const uint4*)p.v_new)[i];
}
