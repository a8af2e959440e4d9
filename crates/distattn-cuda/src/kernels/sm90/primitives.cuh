// ================================================================ Hopper (sm_90a): warpgroup MMA
// Kernels on `wgmma`: a warpgroup (4 warps) multiplies 64-row tiles with both operands read by
// the tensor cores straight from shared memory (no ldmatrix), asynchronously. Operands live in
// shared memory in the 128-byte swizzled layout the instruction reads: a tile of R rows x D
// columns is stored as D/64 column blocks of R x 128 bytes, and the 16-byte chunk c of row r sits
// at chunk c ^ (r % 8). Tile bases are 1024-byte aligned.
#pragma once
#include "common.cuh"
#include "params.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#if DA_BF16
#define WG_AB ".bf16.bf16"
#else
#define WG_AB ".f16.f16"
#endif

// The register list of a 64-register (m64n128, f32) accumulator in inline PTX (operands
// %0..%63).
#define WG_ACC64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// ... of a 32-register (m64n64), a 48-register (m64n96) and a 96-register (m64n192) one
// (operands %0..%31, %0..%47, %0..%95).
#define WG_ACC32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define WG_ACC96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"

// Shared-memory matrix descriptor; layout: the swizzle, WG_SW128 (the tiles' usual one) or
// WG_SW64. lbo/sbo in bytes: for K-major operands sbo is the stride of 8-row groups (8 rows of
// the swizzle's width: 1024 or 512) and lbo is unused; for MN-major operands lbo is the stride
// of 64-element column blocks along M/N and sbo the stride of 8-row groups along K.
constexpr u64 WG_SW128 = 1, WG_SW64 = 2;
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo, u64 layout = WG_SW128) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (layout << 62);
}
// The descriptor of the tile `bytes` further on. Only the low word changes (shared addresses stay
// below 2^18, so the 14-bit address field never carries): with a base descriptor built once per
// tile, each k-step's descriptor is one integer add, not a rebuild.
__device__ __forceinline__ u64 wg_desc_add(u64 d, u32 bytes) {
    u32 lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(d));
    lo += bytes >> 4;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(hi));
    return d;
}
// The warpgroup index, read through a shuffle so that the compiler knows it is the same in the
// whole warp and keeps values derived from it (tile addresses, descriptors) in uniform registers.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads of accumulators above the wait that completes them.
template <int N>
__device__ __forceinline__ void wg_pin(float (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(a[i])::"memory");
}
// Ordinary shared-memory writes (st.shared, cp.async) made visible to the tensor cores' reads.
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- mbarriers and TMA (the tensor memory accelerator): a producer warp fills shared-memory
// stages with bulk tensor copies that complete on an mbarrier; consumers wait on its phase.
// Tensor maps: TmaMap in params.cuh.
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Copies one box of the map's 4-d tensor, starting at element (c0, r0, h, b), to dst.
__device__ __forceinline__ void tma_box(u32 dst, const TmaMap* map, u32 bar, int c0, int r0, int h, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        ::"r"(dst), "l"((u64)map), "r"(bar), "r"(c0), "r"(r0), "r"(h), "r"(b) : "memory");
}
// Fetches the same box into the L2 only (no shared memory, no mbarrier).
__device__ __forceinline__ void tma_prefetch_box(const TmaMap* map, int c0, int r0, int h, int b) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n"
                 ::"l"((u64)map), "r"(c0), "r"(r0), "r"(h), "r"(b) : "memory");
}
// Writes the box of the map's tensor at element (c0, r0, h, b) from src (rows past the tensor's
// end are dropped); completes in the thread's bulk group.
__device__ __forceinline__ void tma_store_box(const TmaMap* map, u32 src, int c0, int r0, int h, int b) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"((u64)map), "r"(src), "r"(c0), "r"(r0), "r"(h), "r"(b) : "memory");
}
// The head dim of the warpgroup kernels' shared-memory tiles: whole 64-column (128-byte) swizzled
// blocks. At d 96 the tiles are padded to 128 columns (TMA fills the columns past the tensor's
// end with zeros); the products over the head dim take its 96 columns only (wg_gemm_kmajor's
// k-steps, wgmma_rs_nD's N): the padded ones cost a third more tensor-core work (d 96 forward
// 6-8% faster, backward 2-7%, on an H100).
#define DK ((D + 63) / 64 * 64)
// Copies rows r0..r0+R-1 of (head h, batch b) of a bf16/f16 tensor into the swizzled tile at
// dst (DK/64 boxes).
template <int R>
__device__ __forceinline__ void tma_load_rows(u32 dst, const TmaMap* map, u32 bar, int r0, int h, int b) {
#pragma unroll
    for (int cb = 0; cb < DK / 64; ++cb) tma_box(dst + cb * R * 128, map, bar, cb * 64, r0, h, b);
}
// The same rows into the L2 only.
__device__ __forceinline__ void tma_prefetch_rows(const TmaMap* map, int r0, int h, int b) {
#pragma unroll
    for (int cb = 0; cb < DK / 64; ++cb) tma_prefetch_box(map, cb * 64, r0, h, b);
}
// Registers per thread handed between warpgroups (warp-specialized kernels).
template <int N>
__device__ __forceinline__ void reg_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void reg_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

// Constraints binding the accumulators d[i..i + 7], read-write (WG_RW8) or write-only (WG_W8).
#define WG_RW8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_W8(d, i) "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), "=f"(d[i + 6]), "=f"(d[i + 7])
// wgmma_ss_n<N>: D[64 x N] (+)= A[64 x 16] B[16 x N], A and B from shared memory; ACC = 0: D's
// earlier values are not read (the first k-step). REGS: the PTX list of D's N / 2 registers; DA,
// DB, TA_, TB_: the operand numbers after them; BIND(C): D's constraints, C = WG_RW8 or WG_W8.
#define WG_SS_PRODUCT(N, REGS, DA, DB, TA_, TB_, BIND)                                                          \
    template <int ACC, int TA, int TB>                                                                         \
    __device__ __forceinline__ void wgmma_ss_n##N(float (&d)[N / 2], u64 da, u64 db) {                        \
        if constexpr (ACC)                                                                                     \
            asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32" WG_AB " " REGS ", %" #DA ", %" #DB   \
                         ", 1, 1, 1, %" #TA_ ", %" #TB_ ";\n"                                                  \
                         : BIND(WG_RW8)                                                                        \
                         : "l"(da), "l"(db), "n"(TA), "n"(TB));                                                \
        else                                                                                                   \
            asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32" WG_AB " " REGS ", %" #DA ", %" #DB   \
                         ", 0, 1, 1, %" #TA_ ", %" #TB_ ";\n"                                                  \
                         : BIND(WG_W8)                                                                         \
                         : "l"(da), "l"(db), "n"(TA), "n"(TB));                                                \
    }
#define WG_BIND16(C) C(d, 0), C(d, 8)
#define WG_BIND24(C) WG_BIND16(C), C(d, 16)
#define WG_BIND32(C) WG_BIND24(C), C(d, 24)
#define WG_BIND40(C) WG_BIND32(C), C(d, 32)
#define WG_BIND48(C) WG_BIND40(C), C(d, 40)
#define WG_BIND56(C) WG_BIND48(C), C(d, 48)
#define WG_BIND64(C) WG_BIND56(C), C(d, 56)
#define WG_BIND72(C) WG_BIND64(C), C(d, 64)
#define WG_BIND80(C) WG_BIND72(C), C(d, 72)
#define WG_BIND88(C) WG_BIND80(C), C(d, 80)
#define WG_BIND96(C) WG_BIND88(C), C(d, 88)
// N = 32: the d 192/256 backward's score tiles; 80, 96, 192: the forward's key tiles at d 256,
// 192 and 128 (64 and 128 serve everything else).
WG_SS_PRODUCT(32, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}", 16, 17, 18, 19, WG_BIND16)
WG_SS_PRODUCT(64, WG_ACC32, 32, 33, 34, 35, WG_BIND32)
WG_SS_PRODUCT(80, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}", 40, 41, 42, 43, WG_BIND40)
WG_SS_PRODUCT(96, WG_ACC48, 48, 49, 50, 51, WG_BIND48)
WG_SS_PRODUCT(128, WG_ACC64, 64, 65, 66, 67, WG_BIND64)
WG_SS_PRODUCT(192, WG_ACC96, 96, 97, 98, 99, WG_BIND96)

// wgmma_rs_n<N>: D[64 x N] += A[64 x 16] B[16 x N], A from registers (mma.sync A-fragment
// layout per warp), B from shared memory; acc = 0: D's earlier values are not read. REGS: D's
// N / 2 registers; A0..A3, DB, ACC_, TB_: the operand numbers after them.
#define WG_RS_PRODUCT(N, REGS, A0, A1, A2, A3, DB, ACC_, TB_, BIND)                                                \
    template <int TB>                                                                                         \
    __device__ __forceinline__ void wgmma_rs_n##N(float (&d)[N / 2], const u32 (&a)[4], u64 db, int acc) {    \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #ACC_ ", 0;\n"                                       \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32" WG_AB " " REGS ", "                      \
                     "{%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #DB ", p, 1, 1, %" #TB_ ";\n}\n"            \
                     : BIND(WG_RW8)                                                                           \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));               \
    }
// N = 64, 128: the head-dim products (and their halves above d 128); 96: d 96's (B's 96 columns
// are one 64-column block and half of the next).
WG_RS_PRODUCT(64, WG_ACC32, 32, 33, 34, 35, 36, 37, 38, WG_BIND32)
WG_RS_PRODUCT(96, WG_ACC48, 48, 49, 50, 51, 52, 53, 54, WG_BIND48)
WG_RS_PRODUCT(128, WG_ACC64, 64, 65, 66, 67, 68, 69, 70, WG_BIND64)

// The shared x shared product whose D has NA accumulators (N = 2 NA), from a WG_SS_PRODUCT.
template <int NA, int ACC, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[NA], u64 da, u64 db) {
    if constexpr (NA == 16) wgmma_ss_n32<ACC, TA, TB>(d, da, db);
    else if constexpr (NA == 32) wgmma_ss_n64<ACC, TA, TB>(d, da, db);
    else if constexpr (NA == 40) wgmma_ss_n80<ACC, TA, TB>(d, da, db);
    else if constexpr (NA == 48) wgmma_ss_n96<ACC, TA, TB>(d, da, db);
    else if constexpr (NA == 64) wgmma_ss_n128<ACC, TA, TB>(d, da, db);
    else wgmma_ss_n192<ACC, TA, TB>(d, da, db);
}
// k-step kk of a shared x shared product: the first one starts the accumulators from zero.
template <int TA, int TB, int NA>
__device__ __forceinline__ void wgmma_ss_step(float (&d)[NA], u64 da, u64 db, int kk) {
    if (kk == 0) wgmma_ss<NA, 0, TA, TB>(d, da, db);
    else wgmma_ss<NA, 1, TA, TB>(d, da, db);
}

// acc = A B^T over the head dim, both operands K-major in swizzled [rows][DK] tiles: A is the 64
// rows from a_row0 of a tile of a_rows rows, B the N = 2 NA rows at b of a tile of b_rows rows.
// ACC: add to acc's values instead of starting from zero. (The k-steps cover the D columns only:
// at d 96 the padded ones would add zeros.)
template <int NA, bool ACC = false>
__device__ __forceinline__ void wg_gemm_kmajor(float (&acc)[NA], u32 a, int a_rows, int a_row0, u32 b, int b_rows) {
    const u64 da0 = wg_desc(a + a_row0 * 128, 16, 1024), db0 = wg_desc(b, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u64 da = wg_desc_add(da0, (kk >> 2) * a_rows * 128 + (kk & 3) * 32);
        const u64 db = wg_desc_add(db0, (kk >> 2) * b_rows * 128 + (kk & 3) * 32);
        wgmma_ss_step<0, 0>(acc, da, db, ACC ? 1 : kk); // (a k-step index of 0 starts from zero)
    }
}

// ---- FP8 (e4m3) products, k = 32. 8-bit wgmma reads both shared operands K-major only, so
// the P V product takes V transposed ([D][keys] tiles).

// wgmma_e4m3_ss_n<N>: D[64 x N] (+)= A[64 x 32] B[32 x N], A and B from shared memory (K-major);
// ACC = 0: D's earlier values are not read (the first k-step). Arguments as WG_SS_PRODUCT's.
#define WG_E4M3_SS_PRODUCT(N, REGS, DA, DB, BIND)                                                               \
    template <int ACC>                                                                                         \
    __device__ __forceinline__ void wgmma_e4m3_ss_n##N(float (&d)[N / 2], u64 da, u64 db) {                   \
        if constexpr (ACC)                                                                                     \
            asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", %" #DA ", %" #DB \
                         ", 1, 1, 1;\n"                                                                        \
                         : BIND(WG_RW8)                                                                        \
                         : "l"(da), "l"(db));                                                                  \
        else                                                                                                   \
            asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", %" #DA ", %" #DB \
                         ", 0, 1, 1;\n"                                                                        \
                         : BIND(WG_W8)                                                                         \
                         : "l"(da), "l"(db));                                                                  \
    }
// The FP8 forward's score tiles (64 or 128 keys).
WG_E4M3_SS_PRODUCT(64, WG_ACC32, 32, 33, WG_BIND32)
WG_E4M3_SS_PRODUCT(128, WG_ACC64, 64, 65, WG_BIND64)
// k-step kk of the FP8 score product over N = 2 NA keys: the first one starts from zero.
template <int NA>
__device__ __forceinline__ void wgmma_e4m3_ss_step(float (&d)[NA], u64 da, u64 db, int kk) {
    static_assert(NA == 32 || NA == 64, "FP8 score tiles of 64 or 128 keys");
    if (kk == 0) {
        if constexpr (NA == 32) wgmma_e4m3_ss_n64<0>(d, da, db);
        else wgmma_e4m3_ss_n128<0>(d, da, db);
    } else {
        if constexpr (NA == 32) wgmma_e4m3_ss_n64<1>(d, da, db);
        else wgmma_e4m3_ss_n128<1>(d, da, db);
    }
}
// D[64 x 128] += A[64 x 32] B[32 x 128], A from registers: per warp, thread (g, t) holds rows g
// and g + 8, columns 4t..4t+3 (a[0], a[1]) and 16 + 4t..16 + 4t+3 (a[2], a[3]), byte 0 first.
__device__ __forceinline__ void wgmma_e4m3_rs_n128(float (&d)[64], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " WG_ACC64 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : WG_BIND64(WG_RW8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// Four f32 as e4m3 (round to nearest, saturating at +-448), x0 in the lowest byte.
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | ((u32)hi << 16);
}

// The register-A product whose N is the head dim, up to 128 (O += P V, dV += P^T dO, dK += dS^T
// Q): at d 96 the padded columns are not computed.
#if D == 128
#define wgmma_rs_nD wgmma_rs_n128
#elif D == 96
#define wgmma_rs_nD wgmma_rs_n96
#else
#define wgmma_rs_nD wgmma_rs_n64
#endif

// An m64 x N accumulator (f32, N = 16 K) as the register A operand of a product over its N
// columns: k-step kk covers columns 16kk.. = accumulator blocks 2kk, 2kk + 1.
template <int K>
__device__ __forceinline__ void wg_pack_a(u32 (&pa)[K / 16][4], const float (&s)[K / 2]) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int f = 0; f < 4; ++f) pa[kk][f] = pack2(s[8 * kk + 2 * f], s[8 * kk + 2 * f + 1]);
}

// acc (64 x D) += A B: A as register fragments over K rows of B, an N-major [K][DK] tile
// (O += P V, dQ += dS K).
template <int K>
__device__ __forceinline__ void wg_gemm_rs_nD(float (&acc)[D / 2], const u32 (&pa)[K / 16][4], u32 b) {
    const u64 db = wg_desc(b, K * 128, 1024);
#if D > 128
    // N = D as two products: N = 128 over the first 128 columns (B's column blocks 0, 1) and
    // N = D - 128 over the rest (blocks 2..).
    float(&lo)[64] = *reinterpret_cast<float(*)[64]>(&acc[0]);
    float(&hi)[D / 2 - 64] = *reinterpret_cast<float(*)[D / 2 - 64]>(&acc[64]);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        wgmma_rs_n128<1>(lo, pa[kk], wg_desc_add(db, kk * 16 * 128), 1);
#if D == 256
        wgmma_rs_n128<1>(hi, pa[kk], wg_desc_add(db, 2 * K * 128 + kk * 16 * 128), 1);
#else
        wgmma_rs_n64<1>(hi, pa[kk], wg_desc_add(db, 2 * K * 128 + kk * 16 * 128), 1);
#endif
    }
#else
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) wgmma_rs_nD<1>(acc, pa[kk], wg_desc_add(db, kk * 16 * 128), 1);
#endif
}
#endif // __CUDA_ARCH_FEAT_SM90_ALL
