//! Backward against finite differences on tiny shapes: the f64 reference (central differences
//! of its own forward) and the flash kernel in f32, plus fully masked rows and input checks.

mod common;
use common::*;
use distattn_core::{AttnOptions, AttnShape, Error, Mask};
use distattn_cpu::{backward, forward, row_delta, TileConfig};

fn shapes_and_masks() -> Vec<(AttnShape, Mask)> {
    vec![
        (AttnShape::new(1, 3, 4, 2, 1, 3).unwrap(), Mask::causal(3, 4).unwrap()),
        (AttnShape::new(2, 4, 3, 2, 2, 2).unwrap(), Mask::full(4, 3).unwrap()),
        (AttnShape::new(1, 5, 5, 4, 2, 4).unwrap(), Mask::sliding_window(5, 5, Some(1), Some(1)).unwrap()),
    ]
}

/// A scalar loss of (q, k, v).
type Loss<'a> = dyn Fn(&[f64], &[f64], &[f64]) -> f64 + 'a;

/// L = <dO, O>; returns (L(x+eps e_i) − L(x−eps e_i)) / 2eps for every element of q, k, v.
fn fd_grads(f: &Loss<'_>, q: &[f64], k: &[f64], v: &[f64], eps: f64) -> [Vec<f64>; 3] {
    let mut out = [vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]];
    for which in 0..3 {
        let base = [q, k, v][which];
        for i in 0..base.len() {
            let mut p = [q.to_vec(), k.to_vec(), v.to_vec()];
            p[which][i] += eps;
            let lp = f(&p[0], &p[1], &p[2]);
            p[which][i] -= 2.0 * eps;
            let lm = f(&p[0], &p[1], &p[2]);
            out[which][i] = (lp - lm) / (2.0 * eps);
        }
    }
    out
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let n: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let d: f64 = b.iter().map(|y| y * y).sum();
    (n / d.max(1e-300)).sqrt()
}

#[test]
fn reference_backward_matches_finite_differences() {
    let (mut rng, seed) = rng("reference_backward_matches_finite_differences");
    for (shape, mask) in shapes_and_masks() {
        let x = inputs(&mut rng, &shape);
        let opts = AttnOptions::default();
        // f64 inputs: the reference takes Element (f32), so FD runs on an f64 copy of its math
        // through tiny perturbations representable in f32 — instead perturb in f32 with a
        // step large enough (1e-3) and evaluate the loss in f64.
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let c = |t: &[f64]| t.iter().map(|&a| a as f32).collect::<Vec<f32>>();
            let r = reference::forward(&c(q), &c(k), &c(v), &shape, &mask, &opts).unwrap();
            r.o.iter().zip(&x.d_o).map(|(a, b)| a * *b as f64).sum()
        };
        let up = |t: &[f32]| t.iter().map(|&a| a as f64).collect::<Vec<f64>>();
        let eps = 2f64.powi(-8); // exact in f32 for these magnitudes' perturbation
        let fd = fd_grads(&loss, &up(&x.q), &up(&x.k), &up(&x.v), eps);
        let g = reference::backward(&x.q, &x.k, &x.v, &x.d_o, &shape, &mask, &opts).unwrap();
        for (name, a, b) in [("dq", &g.dq, &fd[0]), ("dk", &g.dk, &fd[1]), ("dv", &g.dv, &fd[2])] {
            let e = rel(a, b);
            assert!(e < 1e-4, "reference {name} vs FD: {e} ({shape}, DISTATTN_SEED={seed})");
        }
    }
}

#[test]
fn flash_backward_matches_finite_differences() {
    let (mut rng, seed) = rng("flash_backward_matches_finite_differences");
    for (shape, mask) in shapes_and_masks() {
        let x = inputs(&mut rng, &shape);
        let opts = AttnOptions::default();
        for tiles in [TileConfig { fwd_q: 2, fwd_k: 16, bwd_q: 1, bwd_k: 16 }, TileConfig::for_head_dim(shape.head_dim)]
        {
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                let c = |t: &[f64]| t.iter().map(|&a| a as f32).collect::<Vec<f32>>();
                let f = distattn_cpu::forward_with(&c(q), &c(k), &c(v), &shape, &mask, &opts, tiles).unwrap();
                f.o.iter().zip(&x.d_o).map(|(a, b)| *a as f64 * *b as f64).sum()
            };
            let up = |t: &[f32]| t.iter().map(|&a| a as f64).collect::<Vec<f64>>();
            let fd = fd_grads(&loss, &up(&x.q), &up(&x.k), &up(&x.v), 2f64.powi(-7));
            let f = distattn_cpu::forward_with(&x.q, &x.k, &x.v, &shape, &mask, &opts, tiles).unwrap();
            let delta = row_delta(&f.o, &x.d_o, &shape).unwrap();
            let g = distattn_cpu::backward_with(&x.q, &x.k, &x.v, &x.d_o, &f.lse, &delta, &shape, &mask, &opts, tiles)
                .unwrap();
            for (name, a, b) in [("dq", &g.dq, &fd[0]), ("dk", &g.dk, &fd[1]), ("dv", &g.dv, &fd[2])] {
                let e = rel(&up(a), b);
                assert!(e < 2e-3, "flash {name} vs FD: {e} ({shape}, DISTATTN_SEED={seed})");
            }
        }
    }
}

#[test]
fn fully_masked_rows_are_zero_and_minus_inf() {
    let (mut rng, seed) = rng("fully_masked_rows_are_zero_and_minus_inf");
    // causal with q_len > k_len: the first 30 rows see nothing; block mask with an empty row block.
    let keep = [false, false, true, false, true, true, false, false, false];
    let cases = [
        (AttnShape::new(2, 50, 20, 2, 1, 32).unwrap(), Mask::causal(50, 20).unwrap()),
        (AttnShape::new(1, 45, 45, 2, 2, 32).unwrap(), Mask::block_mask(45, 45, 16, 16, &keep).unwrap()),
    ];
    for (shape, mask) in cases {
        let x = inputs(&mut rng, &shape);
        let opts = AttnOptions::default();
        let f = forward(&x.q, &x.k, &x.v, &shape, &mask, &opts).unwrap();
        let delta = row_delta(&f.o, &x.d_o, &shape).unwrap();
        let g = backward(&x.q, &x.k, &x.v, &x.d_o, &f.lse, &delta, &shape, &mask, &opts).unwrap();
        let d = shape.head_dim;
        let mut empty_rows = 0;
        for b in 0..shape.batch {
            for i in 0..shape.q_len {
                let reached = mask.row_intervals(i).next().is_some();
                for h in 0..shape.heads {
                    let l = f.lse[shape.lse_offset(b, h, i)];
                    let o = &f.o[shape.q_offset(b, i, h)..][..d];
                    let dq = &g.dq[shape.q_offset(b, i, h)..][..d];
                    if reached {
                        assert!(l.is_finite());
                    } else {
                        empty_rows += 1;
                        assert_eq!(l, f32::NEG_INFINITY, "row {i} (DISTATTN_SEED={seed})");
                        assert!(o.iter().all(|&v| v == 0.0) && dq.iter().all(|&v| v == 0.0));
                    }
                }
            }
        }
        assert!(empty_rows > 0);
        for t in [&f.o, &g.dq, &g.dk, &g.dv] {
            assert!(t.iter().all(|v| v.is_finite()));
        }
        assert!(f.lse.iter().all(|v| !v.is_nan()));
        let r = reference::forward(&x.q, &x.k, &x.v, &shape, &mask, &opts).unwrap();
        assert!(lse_err(&f.lse, &r.lse) < 1e-5);
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let shape = AttnShape::new(1, 4, 6, 2, 1, 8).unwrap();
    let mask = Mask::causal(4, 6).unwrap();
    let q = vec![0f32; shape.q_elems()];
    let k = vec![0f32; shape.kv_elems()];
    let lse = vec![0f32; shape.lse_elems()];
    let o = AttnOptions::default();
    let short = &q[1..];
    assert!(matches!(forward(short, &k, &k, &shape, &mask, &o), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(forward(&q, &k[1..], &k, &shape, &mask, &o), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(forward(&q, &k, &k[1..], &shape, &mask, &o), Err(Error::ShapeMismatch { .. })));
    let wrong_mask = Mask::causal(4, 5).unwrap();
    assert!(matches!(forward(&q, &k, &k, &shape, &wrong_mask, &o), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(backward(&q, &k, &k, short, &lse, &lse, &shape, &mask, &o), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(backward(&q, &k, &k, &q, &lse[1..], &lse, &shape, &mask, &o), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(backward(&q, &k, &k, &q, &lse, &lse[1..], &shape, &mask, &o), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(row_delta(&q, short, &shape), Err(Error::ShapeMismatch { tensor, .. }) if tensor == "d_o"));
    let bad = AttnShape { kv_heads: 3, ..shape };
    assert!(matches!(forward(&q, &k, &k, &bad, &mask, &o), Err(Error::HeadsNotDivisible { .. })));
    let zero = AttnShape { head_dim: 0, ..shape };
    assert!(matches!(forward(&q, &k, &k, &zero, &mask, &o), Err(Error::ZeroDim { .. })));
    let neg = AttnOptions { scale: Some(-1.0) };
    let r = forward(&q, &k, &k, &shape, &mask, &neg);
    assert!(matches!(&r, Err(Error::InvalidArgument { what, .. }) if what == "softmax scale"), "{r:?}");
    let r = reference::forward(short, &k, &k, &shape, &mask, &o);
    assert!(matches!(&r, Err(Error::ShapeMismatch { tensor, .. }) if tensor == "q"), "{r:?}");
    let r = reference::backward(&q, &k, &k, short, &shape, &mask, &o);
    assert!(matches!(&r, Err(Error::ShapeMismatch { tensor, .. }) if tensor == "d_o"), "{r:?}");
}
