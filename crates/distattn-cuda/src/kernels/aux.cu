// The attention module's auxiliary kernels: the backward's row delta and dQ conversion, and the
// LSE merge of partial results.
#include "common.cuh"
#include "params.cuh"

// ---------------------------------------------------------------- backward: delta = rowsum(dO * O)

extern "C" __global__ void __launch_bounds__(256) bwd_delta(const DeltaParams p) {
    const long long row = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= p.rows) return;
    const elem_t* o = p.o + row * D;
    const elem_t* d = p.dout + row * D;
    float acc = 0.f;
    for (int c = lane * 2; c < D; c += 64) {
        u32 a = *(const u32*)(o + c), bb = *(const u32*)(d + c);
        acc += to_f32((elem_t)(a & 0xffff)) * to_f32((elem_t)(bb & 0xffff)) +
               to_f32((elem_t)(a >> 16)) * to_f32((elem_t)(bb >> 16));
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, s);
    if (lane == 0) {
        const int h = (int)(row % p.heads);
        const long long bi = row / p.heads; // b * q_len + i
        const int i = (int)(bi % p.q_len);
        const long long bb = bi / p.q_len;
        p.delta[(bb * p.heads + h) * p.q_len + i] = acc;
    }
}

// ---------------------------------------------------------------- backward: dQ f32 -> dtype

extern "C" __global__ void __launch_bounds__(256) convert_f32(const float* src, elem_t* dst, long long n2) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n2) {
        float2 v = ((const float2*)src)[i];
        ((u32*)dst)[i] = pack2(v.x, v.y);
    }
}

// ---------------------------------------------------------------- merge of partial (O, LSE)

extern "C" __global__ void __launch_bounds__(256) lse_merge(const MergeParams p) {
    const long long row = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= p.rows) return;
    const int h = (int)(row % p.heads);
    const long long bi = row / p.heads;
    const int i = (int)(bi % p.q_len);
    const long long bb = bi / p.q_len;
    const long long li = (bb * p.heads + h) * p.q_len + i;
    const long long lse_stride = p.rows, o_stride = p.rows * D;
    float mx = NEG_INF;
    for (int s = 0; s < p.n_parts; ++s) mx = fmaxf(mx, p.lse_parts[s * lse_stride + li]);
    float sum = 0.f;
    if (mx != NEG_INF)
        for (int s = 0; s < p.n_parts; ++s) sum += __expf(p.lse_parts[s * lse_stride + li] - mx);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int c = lane * 2; c < D; c += 64) {
        float a0 = 0.f, a1 = 0.f;
        if (mx != NEG_INF)
            for (int s = 0; s < p.n_parts; ++s) {
                const float w = __expf(p.lse_parts[s * lse_stride + li] - mx) * inv;
                const float2 v = *(const float2*)(p.o_parts + s * o_stride + row * D + c);
                a0 += w * v.x;
                a1 += w * v.y;
            }
        *(float2*)(p.o_out + row * D + c) = make_float2(a0, a1);
        if (p.o_out_t) *(u32*)(p.o_out_t + row * D + c) = pack2(a0, a1);
    }
    if (lane == 0) p.lse_out[li] = mx == NEG_INF ? NEG_INF : mx + __logf(sum);
}
