//! Deterministic long-tailed document lengths, for packed-batch benchmarks and tests.

/// splitmix64: a tiny, well-mixed, seedable generator (no dependency, same on every platform).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

/// Document lengths adding up to `total`, drawn from a Pareto law (shape 1.1, minimum
/// `max(1, total / 512)`, capped at `total / 2`): many short documents and a few long ones,
/// like packed pre-training corpora. The same `(total, seed)` always gives the same lengths;
/// the last document is truncated to fit.
pub fn long_tailed_doc_lens(total: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix(seed ^ 0xD1B5_4A32_D192_ED03);
    let min = (total / 512).max(1) as f64;
    let cap = (total / 2).max(1);
    let mut lens = Vec::new();
    let mut left = total;
    while left > 0 {
        let x = (min * rng.unit().powf(-1.0 / 1.1)).floor() as usize;
        let len = x.clamp(1, cap).min(left);
        lens.push(len);
        left -= len;
    }
    lens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_long_tailed() {
        let a = long_tailed_doc_lens(131072, 7);
        assert_eq!(a, long_tailed_doc_lens(131072, 7));
        assert_ne!(a, long_tailed_doc_lens(131072, 8));
        assert_eq!(a.iter().sum::<usize>(), 131072);
        let max = *a.iter().max().unwrap();
        let mut sorted = a.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2];
        assert!(max >= 10 * median, "max {max} median {median}");
        for n in [1, 5, 37, 70] {
            assert_eq!(long_tailed_doc_lens(n, 1).iter().sum::<usize>(), n);
        }
    }
}
