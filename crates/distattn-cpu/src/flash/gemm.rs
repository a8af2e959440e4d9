//! Small-tile GEMM: `C[m×n] (+)= A[m×k] · B[k×n]` on f32, for the tiles of flash attention.
//!
//! `A` is read element by element through two strides (`rs` between rows, `cs` between
//! columns), so a transposed operand (`Pᵀ`, `dSᵀ`) costs nothing extra. `B` is row-major or
//! in column panels ([`BOp`]), `C` row-major ([`COp`]); `n` must be a multiple of [`NR`]
//! (callers pad B with zeros). The AVX2/FMA micro-kernel computes `MR × NR = 6 × 16` blocks in
//! 12 ymm accumulators; a portable scalar kernel serves other machines.

/// Rows of a micro-tile.
pub const MR: usize = 6;
/// Columns of a micro-tile (two 8-lane vectors).
pub const NR: usize = 16;

/// The sizes of one product `C[m×n] (+)= A[m×k] · B[k×n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// One operand `A` described by a pointer and strides.
#[derive(Clone, Copy)]
pub struct AOp {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}

/// The operand `B`, stored as column panels of [`NR`] columns: element `(p, j)` is at
/// `ptr + (j / NR)·ps + p·ld + j % NR`. `ps = NR` is a plain row-major `B` ([`BOp::rows`]);
/// `ld = NR, ps = NR·k` is a panel-packed `B` that the micro-kernel streams with unit stride.
#[derive(Clone, Copy)]
pub struct BOp {
    pub ptr: *const f32,
    /// Floats between rows `p` and `p + 1` of a panel.
    pub ld: usize,
    /// Floats between panels.
    pub ps: usize,
}

impl BOp {
    /// A row-major `B` with `ld` floats between rows.
    pub fn rows(ptr: *const f32, ld: usize) -> BOp {
        BOp { ptr, ld, ps: NR }
    }
}

/// The output `C`, row-major with `ld` floats between rows.
#[derive(Clone, Copy)]
pub struct COp {
    pub ptr: *mut f32,
    pub ld: usize,
}

/// `C[m×n] (+)= A[m×k] · B[k×n]` (`accumulate`: add to `C`, else overwrite it). `simd` asks
/// for the AVX2/FMA kernel, which runs where the CPU has both features.
///
/// # Safety
/// Every addressed element must be in bounds of one live allocation: `A` at
/// `ptr + i·rs + p·cs` for `i < m, p < k`; `B` as [`BOp`] says for `p < k, j < n`; `C` at
/// `ptr + i·ld + j` for `i < m, j < n`. `n % NR == 0`. `C` must not overlap `A` or `B`, and
/// nothing else may access those elements of `C` during the call.
#[inline]
pub unsafe fn gemm(simd: bool, dims: Dims, a: AOp, b: BOp, c: COp, accumulate: bool) {
    debug_assert_eq!(dims.n % NR, 0);
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2_fma() {
        // The CPU has the kernel's features (checked on the line above); the operands are the
        // caller's, under this function's contract.
        return x86::gemm(dims, a, b, c, accumulate);
    }
    let _ = simd;
    scalar_gemm(dims, a, b, c, accumulate)
}

/// The portable kernel of [`gemm`].
///
/// # Safety
/// As [`gemm`].
unsafe fn scalar_gemm(dims: Dims, a: AOp, b: BOp, c: COp, accumulate: bool) {
    let Dims { m, n, k } = dims;
    let BOp { ptr: b, ld: ldb, ps: bps } = b;
    let COp { ptr: c, ld: ldc } = c;
    let mut acc = [0f32; NR];
    for i in 0..m {
        for j0 in (0..n).step_by(NR) {
            let crow = c.add(i * ldc + j0);
            for (t, x) in acc.iter_mut().enumerate() {
                *x = if accumulate { *crow.add(t) } else { 0.0 };
            }
            for p in 0..k {
                let av = *a.ptr.add(i * a.rs + p * a.cs);
                let brow = b.add(j0 / NR * bps + p * ldb);
                for (t, x) in acc.iter_mut().enumerate() {
                    *x += av * *brow.add(t);
                }
            }
            for (t, x) in acc.iter().enumerate() {
                *crow.add(t) = *x;
            }
        }
    }
}

/// True when the AVX2/FMA kernels can run here and are wanted (`DISTATTN_CPU_NO_SIMD` unset).
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if std::env::var_os("DISTATTN_CPU_NO_SIMD").is_some() {
            return false;
        }
        has_avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has AVX2 and FMA, all the `x86` kernels (here and in `vmath`) need. The
/// answer is detected once and cached, so a call is a load and a test.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{AOp, BOp, COp, Dims, MR, NR};
    use std::arch::x86_64::*;

    /// The AVX2/FMA kernel of [`super::gemm`]: `MR × NR` blocks, the last rows of `C` in a
    /// block of fewer rows.
    ///
    /// # Safety
    /// As [`super::gemm`], on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemm(dims: Dims, a: AOp, b: BOp, c: COp, accumulate: bool) {
        let Dims { m, n, k } = dims;
        let BOp { ptr: b, ld: ldb, ps: bps } = b;
        let COp { ptr: c, ld: ldc } = c;
        let mut j0 = 0;
        while j0 < n {
            let bp = b.add(j0 / NR * bps);
            let mut i0 = 0;
            while i0 < m {
                let ap = AOp { ptr: a.ptr.add(i0 * a.rs), ..a };
                let cp = c.add(i0 * ldc + j0);
                match m - i0 {
                    1 => ukr::<1>(k, ap, bp, ldb, cp, ldc, accumulate),
                    2 => ukr::<2>(k, ap, bp, ldb, cp, ldc, accumulate),
                    3 => ukr::<3>(k, ap, bp, ldb, cp, ldc, accumulate),
                    4 => ukr::<4>(k, ap, bp, ldb, cp, ldc, accumulate),
                    5 => ukr::<5>(k, ap, bp, ldb, cp, ldc, accumulate),
                    _ => ukr::<MR>(k, ap, bp, ldb, cp, ldc, accumulate),
                }
                i0 += MR;
            }
            j0 += NR;
        }
    }

    /// One block: `C[R×16] (+)= A[R×k] · B[k×16]`, `B` rows `ldb` apart, `C` rows `ldc` apart.
    ///
    /// # Safety
    /// As [`super::gemm`] for those sizes, on a CPU with AVX2 and FMA (it is inlined into the
    /// `target_feature` kernel above).
    #[inline(always)]
    unsafe fn ukr<const R: usize>(
        k: usize,
        a: AOp,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        let mut c0 = [_mm256_setzero_ps(); R];
        let mut c1 = [_mm256_setzero_ps(); R];
        if accumulate {
            for r in 0..R {
                c0[r] = _mm256_loadu_ps(c.add(r * ldc));
                c1[r] = _mm256_loadu_ps(c.add(r * ldc + 8));
            }
        }
        let mut ap = a.ptr;
        let mut bp = b;
        // Two k steps per iteration: halves the loop overhead.
        for _ in 0..k / 2 {
            let b0 = _mm256_loadu_ps(bp);
            let b1 = _mm256_loadu_ps(bp.add(8));
            for r in 0..R {
                let av = _mm256_broadcast_ss(&*ap.add(r * a.rs));
                c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
                c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
            }
            let b0 = _mm256_loadu_ps(bp.add(ldb));
            let b1 = _mm256_loadu_ps(bp.add(ldb + 8));
            for r in 0..R {
                let av = _mm256_broadcast_ss(&*ap.add(r * a.rs + a.cs));
                c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
                c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
            }
            // After the last step these point past A's column k − 1 and B's row k − 1, possibly
            // beyond their allocations (A transposed, or B's later panels): `wrapping_add`, since
            // `add` must stay in bounds. They are dereferenced again only when k is odd, and
            // then they are at column / row k − 1.
            ap = ap.wrapping_add(2 * a.cs);
            bp = bp.wrapping_add(2 * ldb);
        }
        if k % 2 == 1 {
            let b0 = _mm256_loadu_ps(bp);
            let b1 = _mm256_loadu_ps(bp.add(8));
            for r in 0..R {
                let av = _mm256_broadcast_ss(&*ap.add(r * a.rs));
                c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
                c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(c.add(r * ldc), c0[r]);
            _mm256_storeu_ps(c.add(r * ldc + 8), c1[r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(dims: Dims, a: &[f32], rs: usize, cs: usize, b: &[f32], ldb: usize) -> Vec<f32> {
        let Dims { m, n, k } = dims;
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    s += a[i * rs + p * cs] as f64 * b[p * ldb + j] as f64;
                }
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    #[test]
    fn kernels_match_naive() {
        for simd in [false, simd_available()] {
            for &(m, n, k) in &[(1, 16, 1), (7, 32, 5), (13, 48, 64), (6, 16, 3), (96, 64, 128)] {
                for trans in [false, true] {
                    let a: Vec<f32> = (0..m * k).map(|x| ((x * 37 % 101) as f32 - 50.0) / 25.0).collect();
                    let b: Vec<f32> = (0..k * (n + 3)).map(|x| ((x * 53 % 97) as f32 - 48.0) / 30.0).collect();
                    let (rs, cs) = if trans { (1, m) } else { (k, 1) };
                    let dims = Dims { m, n, k };
                    let want = naive(dims, &a, rs, cs, &b, n + 3);
                    let mut c = vec![1f32; m * n];
                    let (ao, bo) = (AOp { ptr: a.as_ptr(), rs, cs }, BOp::rows(b.as_ptr(), n + 3));
                    // SAFETY: `a` holds the m·k floats (rs, cs) address, (k, 1) or (1, m); `b` holds
                    // k rows of n + 3 floats, of which the first n are read; `c` holds m rows of n;
                    // every n listed is a multiple of 16; the three are separate vectors.
                    unsafe { gemm(simd, dims, ao, bo, COp { ptr: c.as_mut_ptr(), ld: n }, true) };
                    for (x, w) in c.iter().zip(&want) {
                        assert!((x - 1.0 - w).abs() < 1e-4 * (1.0 + w.abs()), "{x} vs {w}");
                    }
                    // SAFETY: the same operands as above.
                    unsafe { gemm(simd, dims, ao, bo, COp { ptr: c.as_mut_ptr(), ld: n }, false) };
                    for (x, w) in c.iter().zip(&want) {
                        assert!((x - w).abs() < 1e-4 * (1.0 + w.abs()));
                    }
                }
            }
        }
    }
}
