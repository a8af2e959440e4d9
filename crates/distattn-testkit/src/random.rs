//! Seeded random inputs. Every test draws fresh inputs from a seed printed on standard error
//! (`cargo test -- --nocapture` shows it; a failing test should print it in its message);
//! `DISTATTN_SEED=<n>` replays one.

use distattn_core::Element;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// The seed for `test`: `DISTATTN_SEED` if set (an unparsable value is reported and replaced
/// by a fresh seed), else fresh; printed either way.
pub fn seed(test: &str) -> u64 {
    let fresh = || rand::rng().random();
    let s = match std::env::var("DISTATTN_SEED") {
        Ok(v) => v.parse().unwrap_or_else(|_| {
            eprintln!("[{test}] DISTATTN_SEED={v:?} is not an integer; drawing a fresh seed");
            fresh()
        }),
        Err(_) => fresh(),
    };
    eprintln!("[{test}] seed {s} (replay with DISTATTN_SEED={s})");
    s
}

/// A generator seeded by [`seed`], and its seed.
pub fn seeded_rng(test: &str) -> (StdRng, u64) {
    let s = seed(test);
    (StdRng::seed_from_u64(s), s)
}

/// `n` values from the normal distribution with standard deviation `sd`.
pub fn randn(rng: &mut StdRng, n: usize, sd: f32) -> Vec<f32> {
    (0..n).map(|_| rng.sample::<f32, _>(StandardNormal) * sd).collect()
}

/// `n` values uniform in `[lo, hi)`.
pub fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// `x` stored as `T` (rounded to nearest even).
pub fn cast<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}
