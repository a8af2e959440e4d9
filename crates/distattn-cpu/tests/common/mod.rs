//! Shared helpers of the distattn-cpu tests: the test kit (seeded inputs, the f64 reference,
//! relative errors) applied to the CPU kernels, and the one tolerance.
// Each test crate that includes this module uses only some of its helpers.
#![allow(dead_code)]

use distattn_core::{AttnOptions, AttnShape, DType, Element, Mask};
use distattn_cpu::{backward_with, forward_with, row_delta, TileConfig};
use half::{bf16, f16};
use rand::rngs::StdRng;

/// The relative error bound (`distattn_testkit::rel_err`) for every storage dtype:
/// `ref` is the f64 reference on the inputs *as stored* (bf16/f16 values widened), so the
/// bound covers what the kernels add, f32 accumulation order and the polynomial exp2
/// (≈ 2e-7), and not the storage rounding of the inputs, whose effect depends on the
/// conditioning of each case (a single key, a head dim of 1) rather than on the kernels.
pub const TOLERANCE: f64 = 1e-5;

pub use distattn_testkit::{cast, lse_err, randn, reference, rel_err};

/// The run's generator and seed (printed; `DISTATTN_SEED` replays it).
pub fn rng(test: &str) -> (StdRng, u64) {
    distattn_testkit::seeded_rng(test)
}

/// Root mean square of `x`.
fn rms<T: Copy + Into<f64>>(x: &[T]) -> f64 {
    (x.iter().map(|&v| v.into().powi(2)).sum::<f64>() / x.len().max(1) as f64).sqrt()
}

/// Errors of one forward + backward case.
#[derive(Debug)]
pub struct Errs {
    pub o: f64,
    pub lse: f64,
    pub dq: f64,
    pub dk: f64,
    pub dv: f64,
}

impl Errs {
    pub fn max(&self) -> f64 {
        [self.o, self.lse, self.dq, self.dk, self.dv].into_iter().fold(0.0, f64::max)
    }
}

pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub d_o: Vec<f32>,
}

pub fn inputs(rng: &mut StdRng, shape: &AttnShape) -> Inputs {
    Inputs {
        q: randn(rng, shape.q_elems(), 1.0),
        k: randn(rng, shape.kv_elems(), 1.0),
        v: randn(rng, shape.kv_elems(), 1.0),
        d_o: randn(rng, shape.q_elems(), 1.0),
    }
}

/// Runs flash forward + backward in storage type `T` and the f64 reference on the same stored
/// inputs; returns the relative errors. Panics on any NaN, or if storing the inputs changed
/// them by more than bf16's rounding.
pub fn errors<T: Element>(x: &Inputs, shape: &AttnShape, mask: &Mask, tiles: TileConfig) -> Errs {
    let opts = AttnOptions::default();
    let (q, k, v, d_o) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v), cast::<T>(&x.d_o));
    let f = forward_with(&q, &k, &v, shape, mask, &opts, tiles).unwrap();
    assert!(f.o.iter().all(|x| x.is_finite()), "non-finite O");
    assert!(f.lse.iter().all(|x| !x.is_nan()), "NaN LSE");
    let stored = |t: &[T], orig: &[f32]| {
        let s: Vec<f32> = t.iter().map(|v| v.to_f32()).collect();
        let e = rel_err(&s, &orig.iter().map(|&v| v as f64).collect::<Vec<_>>());
        assert!(e <= 2f64.powi(-8), "storing as {} changed the inputs by {e:.1e}", T::DTYPE);
        s
    };
    let (sq, sk, sv, sd_o) = (stored(&q, &x.q), stored(&k, &x.k), stored(&v, &x.v), stored(&d_o, &x.d_o));
    let r = reference::forward(&sq, &sk, &sv, shape, mask, &opts).unwrap();
    let delta = row_delta(&f.o, &d_o, shape).unwrap();
    let g = backward_with(&q, &k, &v, &d_o, &f.lse, &delta, shape, mask, &opts, tiles).unwrap();
    for t in [&g.dq, &g.dk, &g.dv] {
        assert!(t.iter().all(|x| x.is_finite()), "non-finite gradient");
    }
    let rg = reference::backward(&sq, &sk, &sv, &sd_o, shape, mask, &opts).unwrap();
    // With a single key, dS = P·(dP − D) is exactly zero, so the exact dQ and dK are zero and
    // the kernel's are f32 rounding noise (dK's summed over rows and heads): measure them
    // against the scale of the same key's dV rather than against the floor of an all-zero
    // reference (against which noise of 1e-5 of a unit fails).
    let noise = |x: &[f32]| rms(x) / rms(&rg.dv).max(distattn_testkit::compare::FLOOR);
    let (dq, dk) =
        if shape.k_len == 1 { (noise(&g.dq), noise(&g.dk)) } else { (rel_err(&g.dq, &rg.dq), rel_err(&g.dk, &rg.dk)) };
    Errs { o: rel_err(&f.o, &r.o), lse: lse_err(&f.lse, &r.lse), dq, dk, dv: rel_err(&g.dv, &rg.dv) }
}

pub fn errors_dtype(dtype: DType, x: &Inputs, shape: &AttnShape, mask: &Mask, tiles: TileConfig) -> Errs {
    match dtype {
        DType::F32 => errors::<f32>(x, shape, mask, tiles),
        DType::BF16 => errors::<bf16>(x, shape, mask, tiles),
        DType::F16 => errors::<f16>(x, shape, mask, tiles),
    }
}

/// Asserts one case within the dtype's tolerance, naming the case and seed on failure.
pub fn check(name: &str, seed: u64, dtype: DType, x: &Inputs, shape: &AttnShape, mask: &Mask, tiles: TileConfig) {
    let e = errors_dtype(dtype, x, shape, mask, tiles);
    let tol = TOLERANCE;
    if std::env::var_os("DISTATTN_TEST_VERBOSE").is_some() {
        eprintln!("{name} [{dtype}, {shape}]: max error {:.2e} ({e:?})", e.max());
    }
    assert!(
        e.max() <= tol,
        "{name} [{dtype}, {shape}, tiles {tiles:?}]: errors {e:?} exceed {tol} (DISTATTN_SEED={seed})"
    );
}

/// Small tiles (many partial tiles and ragged edges) and the defaults.
pub fn tile_configs(d: usize) -> [TileConfig; 2] {
    [TileConfig { fwd_q: 7, fwd_k: 16, bwd_q: 5, bwd_k: 16 }, TileConfig::for_head_dim(d)]
}
