
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
__device__ __forceinline__ void cp_async16_u(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Loads ROWS x D elements (rows r0.. of a strided tensor) into a swizzled tile at `s` with 256
// threads; rows at or past `limit` are zero-filled. Each thread keeps one 16-byte chunk column,
// and its rows step by 16, so the swizzle term is the same for all of them.
template <int ROWS>
__device__ __forceinline__ void load_rows_sw(u32 s, const elem_t* base, size_t row_stride, int r0, int limit, int tid) {
    constexpr int CPR = D / 8, RPP = 256 / CPR;
    const int ch = tid % CPR, rr = tid / CPR;
    const u32 dst = s + (ch >> 3) * ROWS * 128 + rr * 128 + (((ch & 7) ^ (rr & 7)) << 4);
    const elem_t* src = base + (size_t)(r0 + rr) * row_stride + ch * 8;
#pragma unroll
    for (int i = 0; i < ROWS / RPP; ++i) {
        const bool ok = r0 + rr + i * RPP < limit;
        cp_async16_u(dst + i * RPP * 128, ok ? src + (size_t)i * RPP * row_stride : base, ok ? 16 : 0);
    }
}

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
template <int NA>
__device__ __forceinline__ void wg_gemm_kmajor(float (&acc)[NA], u32 a, int a_rows, int a_row0, u32 b, int b_rows) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u64 da = wg_desc(a + (kk >> 2) * a_rows * 128 + a_row0 * 128 + (kk & 3) * 32, 16, 1024);
        const u64 db = wg_desc(b + (kk >> 2) * b_rows * 128 + (kk & 3) * 32, 16, 1024);
        if constexpr (NA == 32) wgmma_ss64<0, 0>(acc, da, db, kk);
        else wgmma_ss128<0, 0>(acc, da, db, kk);
    }
}

// The register-A product whose N is the head dim (O += P V, dV += P^T dO, dK += dS^T Q).
#if D == 128
#define wgmma_rs_nD wgmma_rs_n128
#else
#define wgmma_rs_nD wgmma_rs_n64
#endif


#if BWD_WG && (D == 128 || D == 64)
// ---------------------------------------------------------------- backward on wgmma (sm_90a)
// Same job and tile plan as flash_bwd_dkdv2 (one block per 128-key tile, a loop over the
// 64-row query tiles of every query head of the KV head). Warpgroup w owns keys 64w..64w+63:
//   S^T = K Q^T, dP^T = V dO^T      (shared x shared, 64 x 64 per warpgroup)
//   P^T, dS^T = P^T (dP^T - delta)  (registers, reused as the A operand:)
//   dV += P^T dO, dK += dS^T Q      (registers x shared, 64 x D per warpgroup)
//   dQ = dS K                       (dS^T through shared memory; d 128: warpgroup w takes dQ
//                                    columns 64w.. over all 128 keys; d 64: all columns over
//                                    its own 64 keys, so only its own dS^T rows)
// followed by f32 reductions of dQ into global memory, issued while the tensor cores do dK.
#define WG_BN 128
#define WG_BM 64

extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_wg(const BwdParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    const u32 Ks = (raw + 1023) & ~1023u;          // [WG_BN][D]
    const u32 Vs = Ks + WG_BN * D * 2;             // [WG_BN][D]
    const u32 Qs = Vs + WG_BN * D * 2;             // 2 stages of [WG_BM][D]
    const u32 dOs = Qs + 2 * WG_BM * D * 2;        // 2 stages of [WG_BM][D]
    const u32 dSs = dOs + 2 * WG_BM * D * 2;       // [WG_BN][WG_BM], dS^T
    float* lse_s = (float*)(smem_raw + (dSs - raw) + WG_BN * WG_BM * 2); // 2 stages
    float* del_s = lse_s + 2 * WG_BM;                                    // 2 stages

    const int kt = blockIdx.x; // key tile 0 first: the heaviest under a causal mask
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int G = p.heads / p.kv_heads;
    const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int k0 = kt * WG_BN;
    const size_t qstr = (size_t)p.heads * D, kstr = (size_t)p.kv_heads * D;
    const int e0 = p.tile_ptr[kt], ne = p.tile_ptr[kt + 1] - e0;
    const int total = G * ne;

    const elem_t* kbase = p.k + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    const elem_t* vbase = p.v + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    load_rows_sw<WG_BN>(Ks, kbase, kstr, k0, p.k_len, tid);
    load_rows_sw<WG_BN>(Vs, vbase, kstr, k0, p.k_len, tid);
    cp_async_commit();

    auto load_item = [&](int h, int qt, int st) {
        const elem_t* qb = p.q + ((size_t)b * p.q_len * p.heads + h) * D;
        const elem_t* db = p.dout + ((size_t)b * p.q_len * p.heads + h) * D;
        load_rows_sw<WG_BM>(Qs + st * WG_BM * D * 2, qb, qstr, qt * WG_BM, p.q_len, tid);
        load_rows_sw<WG_BM>(dOs + st * WG_BM * D * 2, db, qstr, qt * WG_BM, p.q_len, tid);
        if (tid < 2 * WG_BM) {
            const int i = tid % WG_BM;
            const int row = qt * WG_BM + i;
            const bool ok = row < p.q_len;
            const size_t off = ((size_t)b * p.heads + h) * p.q_len + (ok ? row : 0);
            if (tid < WG_BM) cp_async4(lse_s + st * WG_BM + i, p.lse + off, ok ? 4 : 0);
            else cp_async4(del_s + st * WG_BM + i, p.delta + off, ok ? 4 : 0);
        }
    };
    // (head, tile entry) of items it (…_c) and it+1 (…_n), advanced without divisions.
    int h_c = kvh * G, h_n = kvh * G, ei_n = 1;
    if (ei_n == ne) { ei_n = 0; ++h_n; }
    int2 te_c = total > 0 ? p.tiles[e0] : make_int2(0, -1);
    int2 te_n = total > 1 ? p.tiles[e0 + ei_n] : te_c;
    if (total > 0) load_item(h_c, te_c.x, 0);
    cp_async_commit();

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    const int rk = 64 * wg + 16 * wi + g; // this thread's key rows in the tile: rk, rk + 8
    // This thread's dS^T pair (key row rk, query column 8j + 2t) sits in chunk j ^ g of row rk.
    const u32 ds_row = dSs + rk * 128 + 4 * t;

    for (int it = 0; it < total; ++it) {
        const int st = it & 1;
        // (1) This item's tiles have landed, and every warp is done with item it-1 (whose
        // stage st^1 is refilled next).
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (it + 1 < total) load_item(h_n, te_n.x, st ^ 1);
        cp_async_commit();
        const int h = h_c;
        const int2 te = te_c;
        const u32 qst = Qs + st * WG_BM * D * 2, dost = dOs + st * WG_BM * D * 2;
        const float* lse_st = lse_s + st * WG_BM;
        const float* del_st = del_s + st * WG_BM;

        float s[32], dp[32];
        wg_fence();
        wg_gemm_kmajor(s, Ks, WG_BN, 64 * wg, qst, WG_BM);
        wg_gemm_kmajor(dp, Vs, WG_BN, 64 * wg, dost, WG_BM);
        wg_commit();
        wg_wait<0>();
        wg_pin(s);
        wg_pin(dp);

        // P^T and dS^T as A fragments: k-step kq covers query columns 16kq..16kq+15, i.e. the
        // accumulator column blocks j = 2kq (fragments 0, 1) and 2kq + 1 (fragments 2, 3).
        u32 pa[4][4], sa[4][4];
        constexpr int W = WG_BN / 32;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float pv[4], dsv[4];
#pragma unroll
            for (int c2 = 0; c2 < 2; ++c2) {
                const int c = 8 * j + 2 * t + c2;
                const float lv = lse_st[c];
                const float l2 = lv == NEG_INF ? POS_INF : lv * LOG2E;
                const float dl = del_st[c];
                float p0 = fast_exp2(fmaf(s[4 * j + c2], p.scale_log2, -l2));
                float p1 = fast_exp2(fmaf(s[4 * j + 2 + c2], p.scale_log2, -l2));
                if (te.y >= 0) {
                    const u32 w = p.bits[te.y + c * W + (rk >> 5)] >> (rk & 31);
                    if (!(w & 1)) p0 = 0.f;
                    if (!(w & 0x100)) p1 = 0.f;
                }
                pv[c2] = p0;
                pv[2 + c2] = p1;
                dsv[c2] = p0 * (dp[4 * j + c2] - dl);
                dsv[2 + c2] = p1 * (dp[4 * j + 2 + c2] - dl);
            }
            pa[j >> 1][(j & 1) * 2] = pack2(pv[0], pv[1]);
            pa[j >> 1][(j & 1) * 2 + 1] = pack2(pv[2], pv[3]);
            sa[j >> 1][(j & 1) * 2] = pack2(dsv[0], dsv[1]);
            sa[j >> 1][(j & 1) * 2 + 1] = pack2(dsv[2], dsv[3]);
        }
        // dV += P^T dO (B = dO, N-major: D columns in D/64 blocks of WG_BM rows).
        wg_fence();
#pragma unroll
        for (int kq = 0; kq < 4; ++kq)
            wgmma_rs_nD<1>(dv, pa[kq], wg_desc(dost + kq * 16 * 128, WG_BM * 128, 1024), 1);
        // dS^T -> shared memory for dQ.
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 a = ds_row + ((j ^ g) << 4); // rows rk and rk + 8 share the swizzle (rk % 8 = g)
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(sa[j >> 1][(j & 1) * 2]));
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a + 8 * 128), "r"(sa[j >> 1][(j & 1) * 2 + 1]));
        }
        wg_commit();
        fence_async_smem();
#if D == 128
        // (2) dS^T of both warpgroups is in shared memory.
        __syncthreads();
#else
        // (2) this warpgroup's dS^T rows are in shared memory (the only ones it reads).
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
#endif
        h_c = h_n;
        te_c = te_n;
        if (++ei_n == ne) { ei_n = 0; ++h_n; }
        if (it + 2 < total) te_n = p.tiles[e0 + ei_n];

#if D == 128
        // dQ[:, 64wg..] = dS K[:, 64wg..]: A = dS (M-major: dS^T rows are keys), B = K (N-major).
        float dq[32];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BN / 16; ++kk)
            wgmma_ss64<1, 1>(dq, wg_desc(dSs + kk * 16 * 128, WG_BN * 128, 1024),
                               wg_desc(Ks + wg * WG_BN * 128 + kk * 16 * 128, WG_BN * 128, 1024), kk);
#else
        // dQ (partial) = dS[:, 64wg..] K[64wg.., :]: this warpgroup's keys only.
        float dq[32];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_ss64<1, 1>(dq, wg_desc(dSs + (64 * wg + 16 * kk) * 128, WG_BN * 128, 1024),
                               wg_desc(Ks + (64 * wg + 16 * kk) * 128, WG_BN * 128, 1024), kk);
#endif
        wg_commit();
        // dK += dS^T Q after dQ: the dQ reductions below run while the tensor cores do dK.
#pragma unroll
        for (int kq = 0; kq < 4; ++kq)
            wgmma_rs_nD<1>(dk, sa[kq], wg_desc(qst + kq * 16 * 128, WG_BM * 128, 1024), 1);
        wg_commit();
        wg_wait<1>(); // dV and dQ (dK may still run)
        wg_pin(dq);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = te.x * WG_BM + 16 * wi + g + 8 * r;
            if (row < p.q_len) {
                float* dst = p.dq_acc + (((size_t)b * p.q_len + row) * p.heads + h) * D + (D == 128 ? 64 * wg : 0) + 2 * t;
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    red_add2(dst + i * 8, dq[4 * i + 2 * r] * p.scale, dq[4 * i + 2 * r + 1] * p.scale);
            }
        }
        wg_wait<0>(); // dK: its operand stage is refilled after the next barrier
    }
    cp_async_wait<0>();
    wg_wait<0>();
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
// ---------------------------------------------------------------- forward on wgmma (sm_90a)
// One block per 128-row query tile, two warpgroups of 64 rows each, 128-key K/V tiles streamed
// through cp.async. Per key tile and warpgroup: S = Q K^T (shared x shared), online softmax in
// registers, O += P V with P as the register A operand and V read N-major. The P V product of
// tile e-1 runs on the tensor cores while the softmax of tile e runs on the other pipes, so K/V
// take 3 stages (V of tile e-1 is still read during tile e).
#define FW_BM 128
#define FW_BN 128
#define FW_STAGES 3

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
#pragma unroll
    for (int kk = 0; kk < FW_BN / 16; ++kk)
        wgmma_rs_nD<1>(o, pa[kk], wg_desc(vst + kk * 16 * 128, FW_BN * 128, 1024), 1);
}

extern "C" __global__ void __launch_bounds__(256, 1) flash_fwd_wg(const FwdParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    const u32 Qs = (raw + 1023) & ~1023u;          // [FW_BM][D]
    const u32 Ks = Qs + FW_BM * D * 2;             // FW_STAGES x [FW_BN][D]
    const u32 Vs = Ks + FW_STAGES * FW_BN * D * 2; // FW_STAGES x [FW_BN][D]

    const int qt = p.n_tiles - 1 - blockIdx.x; // heavy (late causal) tiles first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (p.heads / p.kv_heads);
    const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int q0 = qt * FW_BM;
    const int rq = 64 * wg + 16 * wi + g; // this thread's query rows in the tile: rq, rq + 8
    const size_t qs = (size_t)p.heads * D, ks = (size_t)p.kv_heads * D;
    const elem_t* qbase = p.q + ((size_t)b * p.q_len * p.heads + h) * D;
    const elem_t* kbase = p.k + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    const elem_t* vbase = p.v + ((size_t)b * p.k_len * p.kv_heads + kvh) * D;
    const int e0 = p.tile_ptr[qt], e1 = p.tile_ptr[qt + 1];
    auto load_kv = [&](int e, int st) {
        const int kt = p.tiles[e].x;
        load_rows_sw<FW_BN>(Ks + st * FW_BN * D * 2, kbase, ks, kt * FW_BN, p.k_len, tid);
        load_rows_sw<FW_BN>(Vs + st * FW_BN * D * 2, vbase, ks, kt * FW_BN, p.k_len, tid);
    };

    load_rows_sw<FW_BM>(Qs, qbase, qs, q0, p.q_len, tid);
    if (e0 < e1) load_kv(e0, 0);
    cp_async_commit();

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, alpha[2];
    u32 pa[FW_BN / 16][4];
    const float sl2 = p.scale_log2;

    for (int e = e0; e < e1; ++e) {
        const int st = (e - e0) % FW_STAGES;
        // Tile e has landed, and every warp is done with the stage refilled next (tile e-2's).
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (e + 1 < e1) load_kv(e + 1, (e + 1 - e0) % FW_STAGES);
        cp_async_commit();
        const u32 kst = Ks + st * FW_BN * D * 2;

        float s[64];
        wg_fence();
        wg_gemm_kmajor(s, Qs, FW_BM, 64 * wg, kst, FW_BN);
        wg_commit();
        if (e > e0) fwd_issue_pv(o, pa, Vs + ((e - 1 - e0) % FW_STAGES) * FW_BN * D * 2);
        wg_commit();
        wg_wait<1>();
        wg_pin(s);
        fwd_softmax(s, m, l, alpha, p.bits, p.tiles[e].y, rq, t, sl2);
        wg_wait<0>();
        wg_pin(o);
        fwd_rescale(o, alpha);
        fwd_pack_p(pa, s);
    }
    if (e1 > e0) { // the last tile's P V
        wg_fence();
        fwd_issue_pv(o, pa, Vs + ((e1 - 1 - e0) % FW_STAGES) * FW_BN * D * 2);
        wg_commit();
        wg_wait<0>();
        wg_pin(o);
    }
    cp_async_wait<0>();

    // Finalize: normalise, write O (and the optional f32 copy) and LSE.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffff, lt, 1);
        lt += __shfl_xor_sync(0xffffffff, lt, 2);
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        const int row = q0 + rq + 8 * r;
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
#endif // FWD_WG && (D == 128 || D == 64)
#endif // __CUDA_ARCH_FEAT_SM90_ALL
