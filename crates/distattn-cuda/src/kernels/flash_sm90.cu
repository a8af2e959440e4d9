
// ================================================================ Hopper (sm_90a): warpgroup MMA
// Kernels on `wgmma`: a warpgroup (4 warps) multiplies 64-row tiles with both operands read by
// the tensor cores straight from shared memory (no ldmatrix), asynchronously. Operands live in
// shared memory in the 128-byte swizzled layout the instruction reads: a tile of R rows x D
// columns is stored as D/64 column blocks of R x 128 bytes, and the 16-byte chunk c of row r sits
// at chunk c ^ (r % 8). Tile bases are 1024-byte aligned.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
typedef unsigned long long u64;

#if DA_BF16
#define WG_AB ".bf16.bf16"
#else
#define WG_AB ".f16.f16"
#endif

// Shared-memory matrix descriptor, 128-byte swizzle. lbo/sbo in bytes: for K-major operands sbo
// is the stride of 8-row groups (1024) and lbo is unused; for MN-major operands lbo is the stride
// of 64-element column blocks along M/N and sbo the stride of 8-row groups along K.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
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
// A tensor map (CUtensorMap, encoded on the host) describes a [batch][rows][heads][D] tensor
// as 4-d {D, rows, heads, batch}; boxes are 64 columns (128 bytes, swizzled like wgmma's
// operands) x R rows, rows past the end read as zeros.
struct __align__(64) TmaMap { u64 v[16]; };
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
// Copies rows r0..r0+R-1 of (head h, batch b) of a bf16/f16 tensor into the swizzled tile at
// dst (D/64 boxes).
template <int R>
__device__ __forceinline__ void tma_load_rows(u32 dst, const TmaMap* map, u32 bar, int r0, int h, int b) {
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb)
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
            ::"r"(dst + cb * R * 128), "l"((u64)map), "r"(bar), "r"(cb * 64), "r"(r0), "r"(h), "r"(b) : "memory");
}
// Registers per thread handed between warpgroups (warp-specialized kernels).
template <int N>
__device__ __forceinline__ void reg_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void reg_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B from shared memory (descriptors).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" WG_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B from shared memory (descriptors).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32" WG_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
}

// D[64 x 64] = A[64 x 16] B[16 x 64] (the first k-step: D's earlier values are not read).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n64_z(float (&d)[32], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" WG_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
        : "l"(da), "l"(db), "r"(0), "n"(TA), "n"(TB));
}

// D[64 x 128] = A[64 x 16] B[16 x 128] (the first k-step: D's earlier values are not read).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n128_z(float (&d)[64], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32" WG_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])
        : "l"(da), "l"(db), "r"(0), "n"(TA), "n"(TB));
}

// D[64 x 64] += A[64 x 16] B[16 x 64], A from registers (mma.sync A-fragment layout per warp), B from shared memory.
template <int TB>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32 (&a)[4], u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" WG_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}

// D[64 x 128] += A[64 x 16] B[16 x 128], A from registers (mma.sync A-fragment layout per warp), B from shared memory.
template <int TB>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32 (&a)[4], u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32" WG_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}

// k-step kk of a shared x shared product: the first one starts the accumulators from zero.
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss64(float (&d)[32], u64 da, u64 db, int kk) {
    if (kk == 0) wgmma_ss_n64_z<TA, TB>(d, da, db);
    else wgmma_ss_n64<TA, TB>(d, da, db, 1);
}
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss128(float (&d)[64], u64 da, u64 db, int kk) {
    if (kk == 0) wgmma_ss_n128_z<TA, TB>(d, da, db);
    else wgmma_ss_n128<TA, TB>(d, da, db, 1);
}

// acc = A B^T over the head dim, both operands K-major in swizzled [rows][D] tiles: A is the 64
// rows from a_row0 of a tile of a_rows rows, B all b_rows (= N) rows of its tile.
// ACC: add to acc's values instead of starting from zero.
template <int NA, bool ACC = false>
__device__ __forceinline__ void wg_gemm_kmajor(float (&acc)[NA], u32 a, int a_rows, int a_row0, u32 b, int b_rows) {
    const u64 da0 = wg_desc(a + a_row0 * 128, 16, 1024), db0 = wg_desc(b, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u64 da = wg_desc_add(da0, (kk >> 2) * a_rows * 128 + (kk & 3) * 32);
        const u64 db = wg_desc_add(db0, (kk >> 2) * b_rows * 128 + (kk & 3) * 32);
        // (a k-step index of 0 starts from zero)
        if constexpr (NA == 32) wgmma_ss64<0, 0>(acc, da, db, ACC ? 1 : kk);
        else wgmma_ss128<0, 0>(acc, da, db, ACC ? 1 : kk);
    }
}

// The register-A product whose N is the head dim (O += P V, dV += P^T dO, dK += dS^T Q).
#if D == 128
#define wgmma_rs_nD wgmma_rs_n128
#else
#define wgmma_rs_nD wgmma_rs_n64
#endif


#if BWD_WG && (D == 128 || D == 64)
// ---------------------------------------------------------------- backward (sm_90a)
// Same job and tile plan as flash_bwd_dkdv2 (one block per 128-key tile, a loop over the
// 64-row query "items" of every query head of the KV head). Consumer warpgroup c owns keys
// 64c..64c+63:
//   S^T = K Q^T, dP^T = V dO^T      (shared x shared, 64 x 64 per warpgroup)
//   P^T, dS^T = P^T (dP^T - delta)  (registers, reused as the A operand:)
//   dV += P^T dO, dK += dS^T Q      (registers x shared, 64 x D per warpgroup)
//   dQ = dS K                       (dS^T through shared memory; d 128: warpgroup w takes dQ
//                                    columns 64w.. over all 128 keys; d 64: all columns over
//                                    its own 64 keys, so only its own dS^T rows)
// The block is warp-specialized: warpgroup 0 moves memory (warp 0 brings K and V once and, per
// item, Q and dO with TMA and the item's LSE and delta rows with plain loads, into BS_STAGES
// stages signalled by mbarriers; warp 1 adds each item's dQ, left by the consumers in shared
// memory, into dq_acc with TMA reductions), warpgroups 1 and 2 compute. They order their
// products so that each elementwise step runs while a product is in flight (P^T under dP^T,
// dS^T under dV, the dQ staging under dK). dS^T is double-buffered, so one barrier per item
// (dS^T of both consumers stored) orders its reuse.
#define WG_BN 128
#define WG_BM 64
#define BS_STAGES 2
// Adds a swizzled f32 tile of R rows x 32 columns (128-byte rows) at src into rows r0.. and
// columns c0.. of (head h, batch b) of an f32 tensor; rows past its end are dropped.
template <int R>
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
    const u32 Ks = (raw + 1023) & ~1023u;            // [WG_BN][D]
    const u32 Vs = Ks + WG_BN * D * 2;               // [WG_BN][D]
    const u32 Qs = Vs + WG_BN * D * 2;               // BS_STAGES x [WG_BM][D]
    const u32 dOs = Qs + BS_STAGES * WG_BM * D * 2;  // BS_STAGES x [WG_BM][D]
    const u32 dSs = dOs + BS_STAGES * WG_BM * D * 2; // 2 x [WG_BN][WG_BM], dS^T
    const u32 dQs = dSs + 2 * WG_BN * WG_BM * 2;     // 2 consumers x 2 x [WG_BM][32] f32, swizzled
    const u32 lse_a = dQs + 2 * WG_BM * 64 * 4;      // BS_STAGES x [WG_BM] f32
    const u32 del_a = lse_a + BS_STAGES * WG_BM * 4; // BS_STAGES x [WG_BM] f32
    const u32 bars = del_a + BS_STAGES * WG_BM * 4;  // mbarriers, 8 bytes each:
    const u32 full_kv = bars;                         //   K, V landed
    const u32 full = bars + 8, freed = full + 8 * BS_STAGES; // item stage landed / read
    const u32 dq_full = freed + 8 * BS_STAGES, dq_free = dq_full + 16; // per consumer
    float* lse_s = (float*)(smem_raw + (lse_a - raw));
    float* del_s = (float*)(smem_raw + (del_a - raw));

    const int kt = blockIdx.x; // key tile 0 first: the heaviest under a causal mask
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int G = p.heads / p.kv_heads;
    const int tid = threadIdx.x, wg = warpgroup_index(), wi = (tid >> 5) & 3, lane = tid & 31;
    const int k0 = kt * WG_BN;
    const int e0 = p.tile_ptr[kt], ne = p.tile_ptr[kt + 1] - e0;
    const int total = G * ne;
    constexpr u32 ITEM_BYTES = 2 * WG_BM * D * 2;

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

    // Registers: 384 x 168 at launch, rebalanced (the d 128 consumers need 240).
    constexpr int PROD_REGS = D == 128 ? 24 : 40, CONS_REGS = D == 128 ? 240 : 232;
    if (wg == 0) {
        reg_dealloc<PROD_REGS>();
        if (wi == 0 && total > 0) { // loads
            if (lane == 0) {
                mbar_expect_tx(full_kv, 2 * WG_BN * D * 2);
                tma_load_rows<WG_BN>(Ks, &tk, full_kv, k0, kvh, b);
                tma_load_rows<WG_BN>(Vs, &tv, full_kv, k0, kvh, b);
            }
            // (24 registers: the item's head and tile entry are stepped, not divided out.)
            int h = kvh * G, ei = 0;
#pragma unroll 1
            for (int it = 0; it < total; ++it) {
                const int st = it % BS_STAGES, ph = (it / BS_STAGES) & 1;
                const int qt = p.tiles[e0 + ei].x;
                if (it >= BS_STAGES) mbar_wait(freed + 8 * st, ph ^ 1);
                // LSE (in log2 units) and minus delta of the item's rows; rows past the end, and rows
                // that see no key (LSE -inf), get +inf: P = 2^(s - inf) = 0.
#pragma unroll
                for (int r = lane; r < WG_BM; r += 32) {
                    const int row = qt * WG_BM + r;
                    const size_t off = ((size_t)b * p.heads + h) * p.q_len + row;
                    const bool ok = row < p.q_len;
                    const float lv = ok ? p.lse[off] : NEG_INF;
                    lse_s[st * WG_BM + r] = lv == NEG_INF ? POS_INF : lv * LOG2E;
                    del_s[st * WG_BM + r] = ok ? -p.delta[off] : 0.f;
                }
                __syncwarp();
                if (lane == 0) { // the arrival releases the rows stored above with the copies' bytes
                    mbar_expect_tx(full + 8 * st, ITEM_BYTES);
                    tma_load_rows<WG_BM>(Qs + st * WG_BM * D * 2, &tq, full + 8 * st, qt * WG_BM, h, b);
                    tma_load_rows<WG_BM>(dOs + st * WG_BM * D * 2, &tdo, full + 8 * st, qt * WG_BM, h, b);
                }
                if (++ei == ne) { ei = 0; ++h; }
            }
        } else if (wi == 1 && lane == 0 && total > 0) { // dQ reductions: 2 boxes per consumer
            int h = kvh * G, ei = 0;
#pragma unroll 1
            for (int it = 0; it < total; ++it) {
                const int qt = p.tiles[e0 + ei].x;
#pragma unroll 1
                for (int c = 0; c < 2; ++c) {
                    mbar_wait(dq_full + 8 * c, it & 1);
                    for (int cb = 0; cb < 2; ++cb)
                        tma_reduce_add<WG_BM>(&tdq, dQs + (2 * c + cb) * WG_BM * 128, (D == 128 ? 64 * c : 0) + 32 * cb,
                                              qt * WG_BM, h, b);
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
    reg_alloc<CONS_REGS>();
    const int cw = wg - 1;
    const int g = lane >> 2, t = lane & 3;
    const int rk = 64 * cw + 16 * wi + g; // this thread's key rows in the tile: rk, rk + 8

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    // This thread's staged dQ pairs: rows 16wi + g (+8), columns 8i + 2t, in box i / 4 at 16-byte
    // chunk (2(i % 4) + t / 2) ^ g (the row's swizzle; rows g and g + 8 share it). Rows g and g ^ 1
    // would hit the same banks if stored in the same order, so store k writes column block
    // i = k ^ (g % 4) (within the box): the 16 lanes of each half-warp then cover all 32 banks.
    const u32 dq_row = dQs + cw * 2 * WG_BM * 128 + (16 * wi + g) * 128 + 8 * (t & 1);
    const int dq_rot = g & 3;
    if (total > 0) mbar_wait(full_kv, 0);
    int2 te_next = total > 0 ? p.tiles[e0] : make_int2(0, -1); // loaded an item ahead
    for (int it = 0; it < total; ++it) {
        const int st = it % BS_STAGES, ph = (it / BS_STAGES) & 1;
        const int2 te = te_next;
        if (it + 1 < total) te_next = p.tiles[e0 + (it + 1) % ne];
        const u32 qst = Qs + st * WG_BM * D * 2, dost = dOs + st * WG_BM * D * 2;
        const u32 dsb = dSs + (it & 1) * WG_BN * WG_BM * 2;
        const float* lse_st = lse_s + st * WG_BM;
        const float* ndel_st = del_s + st * WG_BM; // minus delta
        mbar_wait(full + 8 * st, ph);

        float s[32], dp[32];
        wg_fence();
        wg_gemm_kmajor(s, Ks, WG_BN, 64 * cw, qst, WG_BM);
        wg_commit();
        // dP^T starts from -delta (per query column), so it ends as dP^T - delta: no delta load
        // or subtraction between the wait and dS^T. This thread's query columns are 8j + 2t (+1).
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 nd = ((const float2*)(ndel_st + 2 * t))[4 * j];
            dp[4 * j] = dp[4 * j + 2] = nd.x;
            dp[4 * j + 1] = dp[4 * j + 3] = nd.y;
        }
        wg_fence();
        wg_gemm_kmajor<32, true>(dp, Vs, WG_BN, 64 * cw, dost, WG_BM);
        wg_commit();
        // The item's LSE, read before the wait (the wait is a compiler barrier to loads): under
        // the tensor cores' shared-memory traffic these loads take long.
        float2 lse_j[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) lse_j[j] = ((const float2*)(lse_st + 2 * t))[4 * j];
        wg_wait<1>(); // S^T (dP^T may run)
        wg_pin(s);

        // P^T as A fragments: k-step kq covers query columns 16kq..16kq+15, i.e. the
        // accumulator column blocks j = 2kq (fragments 0, 1) and 2kq + 1 (fragments 2, 3).
        u32 pa[4][4], sa[4][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 l2 = lse_j[j];
            s[4 * j] = fast_exp2(fmaf(s[4 * j], p.scale_log2, -l2.x));
            s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], p.scale_log2, -l2.y));
            s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], p.scale_log2, -l2.x));
            s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], p.scale_log2, -l2.y));
        }
        if (te.y >= 0) { // a partial tile: zero P where the mask drops the pair (a branch, not predication)
            constexpr int W = WG_BN / 32;
            const u32* bits = p.bits + te.y + (rk >> 5);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c2 = 0; c2 < 2; ++c2) {
                    const u32 w = bits[(8 * j + 2 * t + c2) * W] >> (rk & 31);
                    if (!(w & 1)) s[4 * j + c2] = 0.f;
                    if (!(w & 0x100)) s[4 * j + 2 + c2] = 0.f;
                }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            pa[j >> 1][(j & 1) * 2] = pack2(s[4 * j], s[4 * j + 1]);
            pa[j >> 1][(j & 1) * 2 + 1] = pack2(s[4 * j + 2], s[4 * j + 3]);
        }
        // dV += P^T dO (B = dO, N-major: D columns in D/64 blocks of WG_BM rows).
        const u64 ddo = wg_desc(dost, WG_BM * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kq = 0; kq < 4; ++kq) wgmma_rs_nD<1>(dv, pa[kq], wg_desc_add(ddo, kq * 16 * 128), 1);
        wg_commit();
        wg_wait<1>(); // dP^T (dV may run)
        wg_pin(dp);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float dsv[4] = {s[4 * j] * dp[4 * j], s[4 * j + 1] * dp[4 * j + 1], s[4 * j + 2] * dp[4 * j + 2],
                                  s[4 * j + 3] * dp[4 * j + 3]};
            sa[j >> 1][(j & 1) * 2] = pack2(dsv[0], dsv[1]);
            sa[j >> 1][(j & 1) * 2 + 1] = pack2(dsv[2], dsv[3]);
            // dS^T -> shared memory for dQ; rows rk and rk + 8 share the swizzle (rk % 8 = g).
            const u32 a = dsb + rk * 128 + 4 * t + ((j ^ g) << 4);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(sa[j >> 1][(j & 1) * 2]));
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a + 8 * 128), "r"(sa[j >> 1][(j & 1) * 2 + 1]));
        }
        fence_async_smem();
        float dq[32];
#if D == 128
        named_sync(1, 256); // dS^T of both warpgroups is in shared memory
        // dQ[:, 64cw..] = dS K[:, 64cw..]: A = dS (M-major: dS^T rows are keys), B = K (N-major).
        const u64 dds = wg_desc(dsb, WG_BN * 128, 1024), dk_b = wg_desc(Ks + cw * WG_BN * 128, WG_BN * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BN / 16; ++kk)
            wgmma_ss64<1, 1>(dq, wg_desc_add(dds, kk * 16 * 128), wg_desc_add(dk_b, kk * 16 * 128), kk);
#else
        named_sync(1 + cw, 128); // this warpgroup's dS^T rows (the only ones it reads) are stored
        // dQ (partial) = dS[:, 64cw..] K[64cw.., :]: this warpgroup's keys only.
        const u64 dds = wg_desc(dsb + 64 * cw * 128, WG_BN * 128, 1024), dk_b = wg_desc(Ks + 64 * cw * 128, WG_BN * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_ss64<1, 1>(dq, wg_desc_add(dds, kk * 16 * 128), wg_desc_add(dk_b, kk * 16 * 128), kk);
#endif
        wg_commit();
        // dK += dS^T Q, issued after dQ: dQ is staged while dK runs on the tensor cores.
        const u64 dq_b = wg_desc(qst, WG_BM * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kq = 0; kq < 4; ++kq) wgmma_rs_nD<1>(dk, sa[kq], wg_desc_add(dq_b, kq * 16 * 128), 1);
        wg_commit();
        if (it > 0) mbar_wait(dq_free + 8 * cw, (it - 1) & 1); // the previous dQ has been read
        wg_wait<1>(); // dV and dQ (dK may run)
        wg_pin(dq);
        // Column blocks permuted by dq_rot (two rounds of selects: registers are not indexable).
        float dqr[32];
#pragma unroll
        for (int k = 0; k < 32; ++k) dqr[k] = (dq_rot & 1) ? dq[k ^ 4] : dq[k];
#pragma unroll
        for (int k = 0; k < 32; ++k) dq[k] = (dq_rot & 2) ? dqr[k ^ 8] : dqr[k];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = (k & 4) | ((k & 3) ^ dq_rot);
            const u32 a = dq_row + (k >> 2) * WG_BM * 128 + (((2 * (i & 3) + (t >> 1)) ^ g) << 4);
#pragma unroll
            for (int r = 0; r < 2; ++r)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a + r * 8 * 128),
                             "f"(dq[4 * k + 2 * r] * p.scale), "f"(dq[4 * k + 2 * r + 1] * p.scale));
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
                *(u32*)(p.dk + off + i * 8) = pack2(dk[4 * i + 2 * r] * p.scale, dk[4 * i + 2 * r + 1] * p.scale);
                *(u32*)(p.dv + off + i * 8) = pack2(dv[4 * i + 2 * r], dv[4 * i + 2 * r + 1]);
            }
        }
    }
}
#endif // BWD_WG && (D == 128 || D == 64)

#if FWD_WG && (D == 128 || D == 64)
// ---------------------------------------------------------------- forward (sm_90a)
// One block per 128-row query tile. Per 128-key tile and consumer warpgroup (64 rows each):
// S = Q K^T (shared x shared), online softmax in registers, O += P V with P as the register A
// operand and V read N-major. The P V product of tile e-1 runs on the tensor cores while the
// softmax of tile e runs on the other pipes.
#define FW_BM 128
#define FW_BN 128

// Masks and exponentiates one 64 x FW_BN tile of scores (a warpgroup's accumulators) in place,
// updating the running max m (log2 units) and sum l of the thread's two rows; returns in
// alpha the factor by which the rows' earlier output must be rescaled.
__device__ __forceinline__ void fwd_softmax(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            const u32* bits, int moff, int rq, int t, float sl2) {
    if (moff >= 0) { // partial tile: apply the bitmask
        constexpr int W = FW_BN / 32;
        const u32* r0w = bits + moff + rq * W;
        const u32* r1w = r0w + 8 * W;
#pragma unroll
        for (int j = 0; j < FW_BN / 8; ++j) {
            const int c = 8 * j + 2 * t;
            const u32 w0 = r0w[c >> 5] >> (c & 31), w1 = r1w[c >> 5] >> (c & 31);
            if (!(w0 & 1)) s[4 * j] = NEG_INF;
            if (!(w0 & 2)) s[4 * j + 1] = NEG_INF;
            if (!(w1 & 1)) s[4 * j + 2] = NEG_INF;
            if (!(w1 & 2)) s[4 * j + 3] = NEG_INF;
        }
    }
    // Accumulator column block j holds keys 8j + 2t, +1; values 0, 1 row rq, values 2, 3 row rq + 8.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = NEG_INF;
#pragma unroll
        for (int j = 0; j < FW_BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float mn = fmaxf(m[r], mx * sl2);
        const float mu = mn == NEG_INF ? 0.f : mn;
        alpha[r] = fast_exp2(m[r] - mu);
        m[r] = mn;
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < FW_BN / 8; ++j) {
            s[4 * j + 2 * r] = fast_exp2(fmaf(s[4 * j + 2 * r], sl2, -mu));
            s[4 * j + 2 * r + 1] = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl2, -mu));
            rs += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
        }
        l[r] = l[r] * alpha[r] + rs;
    }
}

// P (f32 accumulators) as A fragments: k-step kk covers keys 16kk.. = accumulator blocks 2kk, 2kk+1.
__device__ __forceinline__ void fwd_pack_p(u32 (&pa)[FW_BN / 16][4], const float (&s)[64]) {
#pragma unroll
    for (int kk = 0; kk < FW_BN / 16; ++kk)
#pragma unroll
        for (int f = 0; f < 4; ++f) pa[kk][f] = pack2(s[8 * kk + 2 * f], s[8 * kk + 2 * f + 1]);
}

__device__ __forceinline__ void fwd_rescale(float (&o)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        o[4 * i] *= alpha[0]; o[4 * i + 1] *= alpha[0];
        o[4 * i + 2] *= alpha[1]; o[4 * i + 3] *= alpha[1];
    }
}

__device__ __forceinline__ void fwd_issue_pv(float (&o)[D / 2], const u32 (&pa)[FW_BN / 16][4], u32 vst) {
    const u64 dv = wg_desc(vst, FW_BN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < FW_BN / 16; ++kk) wgmma_rs_nD<1>(o, pa[kk], wg_desc_add(dv, kk * 16 * 128), 1);
}

// Normalises and writes the thread's two output rows (row, row + 8) of O (and the optional f32
// copy) and their LSE.
__device__ __forceinline__ void fwd_store(const FwdParams& p, const float (&o)[D / 2], const float (&m)[2],
                                          const float (&l)[2], int b, int h, int row0, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffff, lt, 1);
        lt += __shfl_xor_sync(0xffffffff, lt, 2);
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        const int row = row0 + 8 * r;
        if (row >= p.q_len) continue;
        if (t == 0)
            p.lse[((size_t)b * p.heads + h) * p.q_len + row] = lt > 0.f ? (m[r] + __log2f(lt)) * LN2 : NEG_INF;
        const size_t off = (((size_t)b * p.q_len + row) * p.heads + h) * D + 2 * t;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            const float x0 = o[4 * i + 2 * r] * inv, x1 = o[4 * i + 2 * r + 1] * inv;
            *(u32*)(p.o + off + i * 8) = pack2(x0, x1);
            if (p.o_f32) *(float2*)(p.o_f32 + off + i * 8) = make_float2(x0, x1);
        }
    }
}

// The block is warp-specialized: warp 0 of warpgroup 0 (the producer, 24 registers) streams Q
// and the K/V tiles with TMA into 2 stages each, signalled by mbarriers; warpgroups 1 and 2
// (240 registers) compute 64 rows each and release a stage as soon as the product reading it
// has completed. The two consumers take turns issuing their products (named barriers 1 and 2),
// so one's softmax runs under the other's tensor-core work.
#define FS_STAGES 2
extern "C" __global__ void __launch_bounds__(384, 1)
flash_fwd_ws(const FwdParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
             const __grid_constant__ TmaMap tv) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    const u32 Qs = (raw + 1023) & ~1023u;             // [FW_BM][D]
    const u32 Ks = Qs + FW_BM * D * 2;                // FS_STAGES x [FW_BN][D]
    const u32 Vs = Ks + FS_STAGES * FW_BN * D * 2;    // FS_STAGES x [FW_BN][D]
    const u32 bars = Vs + FS_STAGES * FW_BN * D * 2;  // mbarriers, 8 bytes each:
    const u32 full_q = bars;                          //   Q landed
    const u32 full_k = bars + 8, full_v = full_k + 8 * FS_STAGES;   // stage landed
    const u32 free_k = full_v + 8 * FS_STAGES, free_v = free_k + 8 * FS_STAGES; // stage read

    const FwdBlock fb = fwd_block(p);
    const int qt = fb.qt, h = fb.h, kvh = fb.kvh, b = fb.b;
    const int tid = threadIdx.x, wg = warpgroup_index();
    const int q0 = qt * FW_BM;
    const int e0 = p.tile_ptr[qt], e1 = p.tile_ptr[qt + 1];
    constexpr u32 TILE_BYTES = FW_BN * D * 2;

    if (tid == 0) {
        mbar_init(full_q, 1);
        for (int i = 0; i < FS_STAGES; ++i) {
            mbar_init(full_k + 8 * i, 1);
            mbar_init(full_v + 8 * i, 1);
            mbar_init(free_k + 8 * i, 8); // one arrival per consumer warp
            mbar_init(free_v + 8 * i, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) { // producer
        reg_dealloc<24>();
        if (tid == 0 && e1 > e0) { // (no tiles: the consumers only write empty rows)
            mbar_expect_tx(full_q, FW_BM * D * 2);
            tma_load_rows<FW_BM>(Qs, &tq, full_q, q0, h, b);
            for (int e = e0; e < e1; ++e) {
                const int i = e - e0, st = i % FS_STAGES, ph = (i / FS_STAGES) & 1;
                const int kt = p.tiles[e].x;
                if (i >= FS_STAGES) mbar_wait(free_k + 8 * st, ph ^ 1);
                mbar_expect_tx(full_k + 8 * st, TILE_BYTES);
                tma_load_rows<FW_BN>(Ks + st * TILE_BYTES, &tk, full_k + 8 * st, kt * FW_BN, kvh, b);
                if (i >= FS_STAGES) mbar_wait(free_v + 8 * st, ph ^ 1);
                mbar_expect_tx(full_v + 8 * st, TILE_BYTES);
                tma_load_rows<FW_BN>(Vs + st * TILE_BYTES, &tv, full_v + 8 * st, kt * FW_BN, kvh, b);
            }
        }
        return;
    }
    reg_alloc<240>();
    const int cw = wg - 1, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rq = 64 * cw + 16 * wi + g; // this thread's query rows in the tile: rq, rq + 8
    // Turn-taking: consumer cw issues after named barrier 1 + cw, then lets the other one go.
    const int my_turn = 1 + cw, other_turn = 2 - cw;

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, alpha[2];
    u32 pa[FW_BN / 16][4];
    const float sl2 = p.scale_log2;

    // Step i issues S(i) = Q K(i)^T and O += P(i-1) V(i-1), for i = 0..n; the first and last
    // steps are peeled so that no product is issued under a branch (ptxas would serialize them).
    const int n = e1 - e0;
    if (n > 0) {
        if (cw == 1) named_arrive(1, 256);
        mbar_wait(full_q, 0);
        mbar_wait(full_k, 0);
        named_sync(my_turn, 256);
        float s[64];
        wg_fence();
        wg_gemm_kmajor(s, Qs, FW_BM, 64 * cw, Ks, FW_BN);
        wg_commit();
        named_arrive(other_turn, 256);
        wg_wait<0>();
        wg_pin(s);
        if (lane == 0) mbar_arrive(free_k);
        fwd_softmax(s, m, l, alpha, p.bits, p.tiles[e0].y, rq, t, sl2);
        fwd_pack_p(pa, s);
        for (int i = 1; i < n; ++i) {
            const int st = i % FS_STAGES, ph = (i / FS_STAGES) & 1;
            const int sp = (i - 1) % FS_STAGES, php = ((i - 1) / FS_STAGES) & 1;
            mbar_wait(full_k + 8 * st, ph);
            mbar_wait(full_v + 8 * sp, php);
            named_sync(my_turn, 256);
            wg_fence();
            wg_gemm_kmajor(s, Qs, FW_BM, 64 * cw, Ks + st * TILE_BYTES, FW_BN);
            wg_commit();
            fwd_issue_pv(o, pa, Vs + sp * TILE_BYTES);
            wg_commit();
            named_arrive(other_turn, 256);
            wg_wait<1>();
            wg_pin(s);
            if (lane == 0) mbar_arrive(free_k + 8 * st);
            fwd_softmax(s, m, l, alpha, p.bits, p.tiles[e0 + i].y, rq, t, sl2);
            wg_wait<0>();
            wg_pin(o);
            if (lane == 0) mbar_arrive(free_v + 8 * sp);
            fwd_rescale(o, alpha);
            fwd_pack_p(pa, s);
        }
        const int sp = (n - 1) % FS_STAGES;
        mbar_wait(full_v + 8 * sp, ((n - 1) / FS_STAGES) & 1);
        named_sync(my_turn, 256);
        wg_fence();
        fwd_issue_pv(o, pa, Vs + sp * TILE_BYTES);
        wg_commit();
        if (cw == 0) named_arrive(other_turn, 256); // consumer 1 issues last: nothing to hand on
        wg_wait<0>();
        wg_pin(o);
    }
    fwd_store(p, o, m, l, b, h, q0 + rq, t);
}
#endif // FWD_WG && (D == 128 || D == 64)
#endif // __CUDA_ARCH_FEAT_SM90_ALL
