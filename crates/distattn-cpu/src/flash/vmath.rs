//! Row operations of the softmax, vectorised: `exp2` as a degree-5 minimax polynomial on
//! `[-1/2, 1/2]` plus an exponent shift (relative error ≈ 2.4e-7), with a portable fallback.
//!
//! Scores arrive unscaled; `c = scale · log2(e)` folds the softmax scale and the change of
//! base into one multiply, so every exponential is a base-2 one.
//!
//! `simd` asks for the AVX2/FMA versions; they run only where the CPU has both features
//! ([`super::gemm::has_avx2_fma`]), the portable ones otherwise.

#[cfg(target_arch = "x86_64")]
use super::gemm::has_avx2_fma;

/// Online-softmax step of one row in the forward pass. `s` holds the raw scores of the tile
/// (masked entries already −inf); on return it holds `p = 2^(c·s − m_new)`. Returns
/// `(m_new, alpha, rowsum)` with `alpha = 2^(m_old − m_new)` the rescale of earlier state.
/// A row that has seen no key yet (`m_new = −inf`) gets `p = 0`, `alpha = 1`. A NaN score (or
/// an earlier NaN `m_old`) makes `m_new` NaN, so the row's p, alpha and sum all become NaN: a
/// non-finite input reaches the outputs that depend on it instead of looking like a masked key.
#[inline]
pub fn fwd_row(simd: bool, s: &mut [f32], c: f32, m_old: f32) -> (f32, f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked on the line above), all `x86::fwd_row` needs;
        // it addresses `s` only below `s.len()`.
        return unsafe { x86::fwd_row(s, c, m_old) };
    }
    let _ = simd;
    let mx = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let m_new = if m_old.is_nan() || s.iter().any(|x| x.is_nan()) { f32::NAN } else { m_old.max(c * mx) };
    if m_new == f32::NEG_INFINITY {
        s.fill(0.0);
        return (m_new, 1.0, 0.0);
    }
    let mut sum = 0.0;
    for x in s.iter_mut() {
        *x = (c * *x - m_new).exp2();
        sum += *x;
    }
    (m_new, (m_old - m_new).exp2(), sum)
}

/// Backward row: `p = 2^(c·s − lse2)` into `s`, `ds = p ∘ (dp − delta)` into `dp`.
/// A row with `lse2 = −inf` (no key anywhere) gets zeros. Masked keys (`s = −inf`) get zeros
/// even when `lse2` or `delta` is NaN, so a NaN row's dS reaches only the keys it sees.
#[inline]
pub fn bwd_row(simd: bool, s: &mut [f32], dp: &mut [f32], c: f32, lse2: f32, delta: f32) {
    if lse2 == f32::NEG_INFINITY {
        s.fill(0.0);
        dp.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked on the line above), all `x86::bwd_row` needs;
        // it addresses `s` and `dp` only below the shorter length.
        return unsafe { x86::bwd_row(s, dp, c, lse2, delta) };
    }
    let _ = simd;
    for (x, g) in s.iter_mut().zip(dp.iter_mut()) {
        (*x, *g) = if *x == f32::NEG_INFINITY {
            (0.0, 0.0)
        } else {
            let p = (c * *x - lse2).exp2();
            (p, p * (*g - delta))
        };
    }
}

/// `x *= a`.
#[inline]
pub fn scale(simd: bool, x: &mut [f32], a: f32) {
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked on the line above), all `x86::scale` needs; it
        // addresses `x` only below `x.len()`.
        return unsafe { x86::scale(x, a) };
    }
    let _ = simd;
    x.iter_mut().for_each(|v| *v *= a);
}

/// Σ a·b in f32.
#[inline]
pub fn dot(simd: bool, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked on the line above), all `x86::dot` needs; it
        // reads `a` and `b` only below the shorter length.
        return unsafe { x86::dot(a, b) };
    }
    let _ = simd;
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The AVX2/FMA versions, `unsafe` because they run AVX2 and FMA instructions (each `# Safety`
/// says so). Slices are addressed only below their lengths (the shorter one of two).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    // 2^f on [-1/2, 1/2]: degree-5 polynomial fitted for minimax relative error
    // (max 2.4e-7 evaluated in f32 Horner form).
    const C0: f32 = 1.000_000_1;
    const C1: f32 = 0.693_146_94;
    const C2: f32 = 0.240_221_2;
    const C3: f32 = 0.055_507_13;
    const C4: f32 = 0.009_675_542;
    const C5: f32 = 0.001_327_647_1;

    /// 2^x for 8 lanes; x ≤ −127 (and −inf) give exactly 0.
    ///
    /// Rounding without `round`/`cvt`: adding `MAGIC = 1.5·2^23 + 127` rounds x to an integer
    /// held in the low mantissa bits, already biased by 127, so a left shift by 23 of those
    /// bits is the f32 `2^n` (the high bits of the magic shift out).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline(always)]
    pub unsafe fn exp2_ps(x: __m256) -> __m256 {
        // minps returns its second operand when either is NaN: x, so NaN stays NaN.
        exp2_ps_le127(_mm256_min_ps(_mm256_set1_ps(127.0), x))
    }

    /// [`exp2_ps`] for `x ≤ 127` (the forward's `x = c·s − m_new ≤ 0` needs no upper clamp).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline(always)]
    pub unsafe fn exp2_ps_le127(x: __m256) -> __m256 {
        const MAGIC: f32 = 12_582_912.0 + 127.0;
        // maxps returns its second operand when either is NaN: x, so NaN stays NaN.
        let x = _mm256_max_ps(_mm256_set1_ps(-127.0), x);
        let t = _mm256_add_ps(x, _mm256_set1_ps(MAGIC));
        let n = _mm256_sub_ps(t, _mm256_set1_ps(MAGIC));
        let f = _mm256_sub_ps(x, n);
        let mut p = _mm256_set1_ps(C5);
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C4));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C3));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C2));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C1));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(C0));
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(t));
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }

    /// The largest of the 8 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX (AVX2 and FMA where it is inlined).
    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }

    /// The sum of the 8 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX (AVX2 and FMA where it is inlined).
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_add_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }

    /// [`super::fwd_row`] on AVX2/FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fwd_row(s: &mut [f32], c: f32, m_old: f32) -> (f32, f32, f32) {
        let n = s.len();
        let p = s.as_mut_ptr();
        let mut vm = _mm256_set1_ps(f32::NEG_INFINITY);
        // maxps drops NaN depending on operand order, so NaN lanes are collected apart.
        let mut vnan = _mm256_setzero_ps();
        let mut j = 0;
        while j + 8 <= n {
            let x = _mm256_loadu_ps(p.add(j));
            vm = _mm256_max_ps(vm, x);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            j += 8;
        }
        let mut mx = hmax(vm);
        let mut nan = _mm256_movemask_ps(vnan) != 0 || m_old.is_nan();
        for t in j..n {
            mx = mx.max(*p.add(t));
            nan |= (*p.add(t)).is_nan();
        }
        let m_new = if nan { f32::NAN } else { m_old.max(c * mx) };
        if m_new == f32::NEG_INFINITY {
            s.fill(0.0);
            return (m_new, 1.0, 0.0);
        }
        let vc = _mm256_set1_ps(c);
        let vmn = _mm256_set1_ps(-m_new);
        let mut vs = _mm256_setzero_ps();
        let mut vs2 = _mm256_setzero_ps();
        let mut j = 0;
        while j + 16 <= n {
            let e = exp2_ps_le127(_mm256_fmadd_ps(_mm256_loadu_ps(p.add(j)), vc, vmn));
            let e2 = exp2_ps_le127(_mm256_fmadd_ps(_mm256_loadu_ps(p.add(j + 8)), vc, vmn));
            _mm256_storeu_ps(p.add(j), e);
            _mm256_storeu_ps(p.add(j + 8), e2);
            vs = _mm256_add_ps(vs, e);
            vs2 = _mm256_add_ps(vs2, e2);
            j += 16;
        }
        while j + 8 <= n {
            let e = exp2_ps_le127(_mm256_fmadd_ps(_mm256_loadu_ps(p.add(j)), vc, vmn));
            _mm256_storeu_ps(p.add(j), e);
            vs = _mm256_add_ps(vs, e);
            j += 8;
        }
        let mut sum = hsum(_mm256_add_ps(vs, vs2));
        for t in j..n {
            let e = (c * *p.add(t) - m_new).exp2();
            *p.add(t) = e;
            sum += e;
        }
        (m_new, (m_old - m_new).exp2(), sum)
    }

    /// [`super::bwd_row`] on AVX2/FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn bwd_row(s: &mut [f32], dp: &mut [f32], c: f32, lse2: f32, delta: f32) {
        let n = s.len().min(dp.len());
        let (ps, pd) = (s.as_mut_ptr(), dp.as_mut_ptr());
        let vc = _mm256_set1_ps(c);
        let vl = _mm256_set1_ps(-lse2);
        let vd = _mm256_set1_ps(delta);
        let mut j = 0;
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        while j + 8 <= n {
            let x = _mm256_loadu_ps(ps.add(j));
            let masked = _mm256_cmp_ps::<_CMP_EQ_OQ>(x, ninf);
            let e = _mm256_andnot_ps(masked, exp2_ps(_mm256_fmadd_ps(x, vc, vl)));
            _mm256_storeu_ps(ps.add(j), e);
            let g = _mm256_andnot_ps(masked, _mm256_mul_ps(e, _mm256_sub_ps(_mm256_loadu_ps(pd.add(j)), vd)));
            _mm256_storeu_ps(pd.add(j), g);
            j += 8;
        }
        for t in j..n {
            let x = *ps.add(t);
            let (e, g) = if x == f32::NEG_INFINITY {
                (0.0, 0.0)
            } else {
                let e = (c * x - lse2).exp2();
                (e, e * (*pd.add(t) - delta))
            };
            *ps.add(t) = e;
            *pd.add(t) = g;
        }
    }

    /// [`super::scale`] on AVX2/FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scale(x: &mut [f32], a: f32) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let va = _mm256_set1_ps(a);
        let mut j = 0;
        while j + 8 <= n {
            _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), va));
            j += 8;
        }
        for t in j..n {
            *p.add(t) *= a;
        }
    }

    /// [`super::dot`] on AVX2/FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut v = _mm256_setzero_ps();
        let mut j = 0;
        while j + 8 <= n {
            v = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(j)), _mm256_loadu_ps(pb.add(j)), v);
            j += 8;
        }
        let mut s = hsum(v);
        for t in j..n {
            s += *pa.add(t) * *pb.add(t);
        }
        s
    }

    #[cfg(test)]
    #[test]
    fn exp2_accuracy() {
        if !super::super::gemm::simd_available() {
            return;
        }
        let mut worst = 0f64;
        let mut x = -130.0f32;
        while x < 20.0 {
            let mut buf = [0f32; 8];
            // SAFETY: simd_available() said above that the CPU has AVX2 and FMA; the store
            // writes the 8 floats `buf` holds.
            unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), exp2_ps(_mm256_set1_ps(x))) };
            let want = (x as f64).exp2();
            if x > -126.0 {
                worst = worst.max(((buf[0] as f64 - want) / want).abs());
            } else {
                assert!(buf[0] < 1e-37);
            }
            x += 0.01237;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        let mut buf = [1f32; 8];
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), exp2_ps(_mm256_set1_ps(f32::NEG_INFINITY))) };
        assert_eq!(buf[0], 0.0);
    }
}
