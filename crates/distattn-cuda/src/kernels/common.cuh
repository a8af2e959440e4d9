// distattn CUDA kernels: what every kernel shares. Element types, constants and small helpers
// (conversions, exp2, cp.async, ldmatrix, mma.sync, row loads, f32 reductions).
//
// The host passes compile-time parameters as -D defines (compile.rs): DA_BF16 (1 for bf16, 0 for
// f16) in every module, HEAD_DIM in the attention kernels' (the auxiliary kernels' module,
// aux.cu, defines DA_AUX instead: it has no head dim and takes row lengths as arguments). No
// system headers are needed: conversions and tensor-core instructions are inline PTX (sm_80+);
// the kernel files include each other from NVRTC's in-memory headers.
#pragma once

typedef unsigned short elem_t;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#ifndef DA_AUX
#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#define D HEAD_DIM
#define LDS (D + 8) // smem row stride in elements (16-byte pad: conflict-free ldmatrix)
#endif

#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define QNAN (__int_as_float(0x7fffffff))

// ---------------------------------------------------------------- small helpers

// The larger of a and b, NaN if either is NaN (fmaxf drops NaN): a NaN score must make its row
// NaN, not vanish as if masked.
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// The LSE merge of a row's partial result so far (LSE la) with another over other keys (lb):
// the weights of the two (summing to 1) and the merged LSE. A partial no key reached (LSE −inf)
// weighs 0; a NaN in either makes weights and LSE NaN, so the row turns NaN.
__device__ __forceinline__ float lse_merge(float la, float lb, float& wa, float& wb) {
    const float m = fmax_nan(la, lb);
    if (m == NEG_INF) {
        wa = wb = 0.f;
        return NEG_INF;
    }
    wa = expf(la - m);
    wb = expf(lb - m);
    const float sum = wa + wb;
    wa /= sum;
    wb /= sum;
    return m + logf(sum);
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if DA_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// The two values of a pack2 word as f32, lo first.
__device__ __forceinline__ float2 unpack2(u32 w) {
#if DA_BF16
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
#else
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}" : "=f"(lo), "=f"(hi) : "r"(w));
    return make_float2(lo, hi);
#endif
}

// Writes a pair of dK or dV values at element `off` of `dst`: packed into the input type, or,
// where `dst` is an f32 accumulator (a context-parallel block's, BwdParams::dkdv_acc), added
// into it, which spares the separate add kernel and its zeroed buffer.
__device__ __forceinline__ void put_grad_pair(elem_t* dst, int acc, size_t off, float x, float y) {
    if (acc) {
        float2* a = reinterpret_cast<float2*>(reinterpret_cast<float*>(dst) + off);
        float2 v = *a;
        v.x += x;
        v.y += y;
        *a = v;
    } else {
        *(u32*)(dst + off) = pack2(x, y);
    }
}

__device__ __forceinline__ float to_f32(elem_t x) {
#if DA_BF16
    return __uint_as_float(((u32)x) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

__device__ __forceinline__ elem_t from_f32(float x) {
    elem_t r;
#if DA_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
    return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

// dst[0] += a, dst[1] += b (8-byte aligned): one vector reduction on sm_90, two otherwise.
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

__device__ __forceinline__ void ldsm_x4a(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4a_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// C += A(16x16, row) * B(16x8, col), f32 accumulators.
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
#if DA_BF16
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

#ifndef DA_AUX
// Loads ROWS x D elements (rows r0.. of a strided tensor) into smem (row stride LDS) with
// cp.async; rows at or past `limit` are zero-filled.
template <int ROWS, int NT>
__device__ __forceinline__ void load_rows(elem_t* s, const elem_t* base, size_t row_stride, int r0,
                                          int limit, int tid) {
    constexpr int CPR = D / 8; // 16-byte chunks per row
    if constexpr (NT % CPR == 0) {
        // Each thread keeps one chunk column and walks rows: one pointer, no divisions.
        constexpr int RPP = NT / CPR; // rows per pass
        const int ch = tid % CPR, rr = tid / CPR;
        const elem_t* src = base + (size_t)(r0 + rr) * row_stride + ch * 8;
        elem_t* dst = s + rr * LDS + ch * 8;
#pragma unroll
        for (int i = 0; i < ROWS / RPP; ++i) {
            const bool ok = r0 + rr + i * RPP < limit;
            cp_async16(dst + i * RPP * LDS, ok ? src + (size_t)i * RPP * row_stride : base, ok ? 16 : 0);
        }
    } else {
#pragma unroll
        for (int c = tid; c < ROWS * CPR; c += NT) {
            int r = c / CPR, ch = c % CPR;
            int gr = r0 + r;
            bool ok = gr < limit;
            const elem_t* src = base + (size_t)(ok ? gr : 0) * row_stride + ch * 8;
            cp_async16(s + r * LDS + ch * 8, src, ok ? 16 : 0);
        }
    }
}
#endif // !DA_AUX
