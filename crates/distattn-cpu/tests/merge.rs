//! The LSE merge: splitting keys into disjoint sets, running forward per set on the
//! restricted mask and merging gives the full result; backward over each set with the merged
//! LSE sums to the full gradients; merge_backward matches finite differences.

mod common;
use common::*;
use distattn_core::{AttnOptions, AttnShape, Mask};
use distattn_cpu::{backward, forward, merge, row_delta};
use rand::Rng;

fn split_points(rng: &mut rand::rngs::StdRng, n: usize, parts: usize) -> Vec<usize> {
    let mut cuts: Vec<usize> = (0..parts - 1).map(|_| rng.random_range(1..n)).collect();
    cuts.push(0);
    cuts.push(n);
    cuts.sort_unstable();
    cuts.dedup();
    cuts
}

/// Forward on key ranges of a split, returned as (O, LSE) in the full query layout.
fn partials(x: &Inputs, shape: &AttnShape, mask: &Mask, cuts: &[usize]) -> Vec<(Vec<f32>, Vec<f32>)> {
    let d = shape.head_dim;
    let mut out = Vec::new();
    for w in cuts.windows(2) {
        let (k0, k1) = (w[0], w[1]);
        let sub = AttnShape { k_len: k1 - k0, ..*shape };
        let m = mask.restrict(0..shape.q_len, k0..k1).unwrap();
        let per = shape.kv_heads * d;
        let take = |t: &[f32]| -> Vec<f32> {
            (0..shape.batch)
                .flat_map(|b| t[(b * shape.k_len + k0) * per..(b * shape.k_len + k1) * per].to_vec())
                .collect()
        };
        let f = forward(&x.q, &take(&x.k), &take(&x.v), &sub, &m, &AttnOptions::default()).unwrap();
        out.push((f.o, f.lse));
    }
    out
}

#[test]
fn merge_of_key_splits_equals_full() {
    let (mut rng, seed) = rng("merge_of_key_splits_equals_full");
    for mask_pick in 0..4 {
        let (nq, nk) = (90, 140);
        let mask = match mask_pick {
            0 => Mask::full(nq, nk).unwrap(),
            1 => Mask::causal(nq, nk).unwrap(),
            2 => Mask::sliding_window(nq, nk, Some(10), Some(0)).unwrap(),
            _ => Mask::causal(nk, nk).unwrap().restrict(0..nq, 0..nk).unwrap(),
        };
        let shape = AttnShape::new(2, nq, nk, 4, 2, 32).unwrap();
        let x = inputs(&mut rng, &shape);
        let full = forward(&x.q, &x.k, &x.v, &shape, &mask, &AttnOptions::default()).unwrap();
        let r = reference::forward(&x.q, &x.k, &x.v, &shape, &mask, &AttnOptions::default()).unwrap();
        for parts in [2, 3, 6] {
            let cuts = split_points(&mut rng, nk, parts);
            let ps = partials(&x, &shape, &mask, &cuts);
            let refs: Vec<(&[f32], &[f32])> = ps.iter().map(|(o, l)| (o.as_slice(), l.as_slice())).collect();
            let merged = merge::merge(&refs, &shape).unwrap();
            assert!(merged.o.iter().all(|v| v.is_finite()), "NaN in merged O (DISTATTN_SEED={seed})");
            let (eo, el) = (rel_err(&merged.o, &r.o), lse_err(&merged.lse, &r.lse));
            assert!(eo < 1e-5 && el < 1e-5, "mask {mask_pick} cuts {cuts:?}: {eo} {el} (DISTATTN_SEED={seed})");
            // Merged vs single-pass flash: equal to rounding.
            assert!(rel_err(&merged.o, &full.o.iter().map(|&v| v as f64).collect::<Vec<_>>()) < 1e-6);

            // Backward per key set with the merged LSE: partial grads add up to the full ones.
            let delta = row_delta(&merged.o, &x.d_o, &shape).unwrap();
            let rg = reference::backward(&x.q, &x.k, &x.v, &x.d_o, &shape, &mask, &AttnOptions::default()).unwrap();
            let mut dq = vec![0f32; shape.q_elems()];
            let mut dkv = Vec::new();
            for w in cuts.windows(2) {
                let (k0, k1) = (w[0], w[1]);
                let sub = AttnShape { k_len: k1 - k0, ..shape };
                let m = mask.restrict(0..nq, k0..k1).unwrap();
                let per = shape.kv_heads * shape.head_dim;
                let take = |t: &[f32]| -> Vec<f32> {
                    (0..shape.batch).flat_map(|b| t[(b * nk + k0) * per..(b * nk + k1) * per].to_vec()).collect()
                };
                let g = backward(
                    &x.q,
                    &take(&x.k),
                    &take(&x.v),
                    &x.d_o,
                    &merged.lse,
                    &delta,
                    &sub,
                    &m,
                    &AttnOptions::default(),
                )
                .unwrap();
                dq.iter_mut().zip(&g.dq).for_each(|(a, b)| *a += b);
                dkv.push((k0, k1, g.dk, g.dv));
            }
            // Reassemble dK and dV in the full layout.
            let per = shape.kv_heads * shape.head_dim;
            let (mut dk_full, mut dv_full) = (vec![0f32; shape.kv_elems()], vec![0f32; shape.kv_elems()]);
            for (k0, k1, dk, dv) in dkv {
                let n = k1 - k0;
                for b in 0..shape.batch {
                    let (dst, src) = ((b * nk + k0) * per..(b * nk + k1) * per, b * n * per..(b + 1) * n * per);
                    dk_full[dst.clone()].copy_from_slice(&dk[src.clone()]);
                    dv_full[dst].copy_from_slice(&dv[src]);
                }
            }
            assert!(rel_err(&dq, &rg.dq) < 1e-5, "dq (DISTATTN_SEED={seed})");
            assert!(rel_err(&dk_full, &rg.dk) < 1e-5, "dk (DISTATTN_SEED={seed})");
            assert!(rel_err(&dv_full, &rg.dv) < 1e-5, "dv (DISTATTN_SEED={seed})");
        }
    }
}

#[test]
fn merge_keeps_unreached_rows_and_is_overflow_safe() {
    let shape = AttnShape::new(1, 3, 1, 1, 1, 2).unwrap();
    let ninf = f32::NEG_INFINITY;
    // row 0: both empty; row 1: only part b; row 2: huge LSEs.
    let a_o = [0.0, 0.0, 0.0, 0.0, 1.0, 2.0];
    let a_l = [ninf, ninf, 1.0e30];
    let b_o = [0.0, 0.0, 5.0, 6.0, 3.0, 4.0];
    let b_l = [ninf, 80.0, 1.0e30];
    let m = merge::merge(&[(&a_o, &a_l), (&b_o, &b_l)], &shape).unwrap();
    assert_eq!(m.lse[0], ninf);
    assert_eq!(&m.o[0..2], &[0.0, 0.0]);
    assert_eq!(m.lse[1], 80.0);
    assert_eq!(&m.o[2..4], &[5.0, 6.0]);
    assert!(m.lse[2].is_finite() && (m.o[4] - 2.0).abs() < 1e-6 && (m.o[5] - 3.0).abs() < 1e-6);
    // In f32 a naive exp(LSE) would overflow at 89.
    let l = [100.0f32, 100.0 + 2f32.ln()];
    let m = merge::merge(&[(&[1.0, 1.0], &l[..1]), (&[4.0, 4.0], &l[1..])], &AttnShape::new(1, 1, 1, 1, 1, 2).unwrap())
        .unwrap();
    assert!((m.o[0] - 3.0).abs() < 1e-5 && (m.lse[0] - (100.0 + 3f32.ln())).abs() < 1e-4);
    // Bad lengths are errors.
    assert!(merge::merge(&[(&a_o[..4], &a_l)], &shape).is_err());
}

#[test]
fn merge_backward_matches_finite_differences() {
    let (mut rng, seed) = rng("merge_backward_matches_finite_differences");
    let shape = AttnShape::new(1, 3, 1, 2, 1, 4).unwrap();
    let n = shape.q_elems();
    let nl = shape.lse_elems();
    let parts: Vec<(Vec<f32>, Vec<f32>)> =
        (0..3).map(|_| (randn(&mut rng, n, 1.0), randn(&mut rng, nl, 2.0))).collect();
    let g_o = randn(&mut rng, n, 1.0);
    let g_l = randn(&mut rng, nl, 1.0);
    // Loss = <g_o, O> + <g_l, LSE> in f64 from the f32 merge.
    let loss = |ps: &[(Vec<f32>, Vec<f32>)]| -> f64 {
        let refs: Vec<(&[f32], &[f32])> = ps.iter().map(|(o, l)| (o.as_slice(), l.as_slice())).collect();
        let m = merge::merge(&refs, &shape).unwrap();
        m.o.iter().zip(&g_o).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>()
            + m.lse.iter().zip(&g_l).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>()
    };
    let refs: Vec<(&[f32], &[f32])> = parts.iter().map(|(o, l)| (o.as_slice(), l.as_slice())).collect();
    let m = merge::merge(&refs, &shape).unwrap();
    let eps = 1e-2f32;
    for s in 0..parts.len() {
        let g = merge::merge_backward(&m.o, &m.lse, &g_o, Some(&g_l), &parts[s].0, &parts[s].1, &shape).unwrap();
        for idx in 0..n + nl {
            let mut p = parts.clone();
            let mut mn = parts.clone();
            if idx < n {
                p[s].0[idx] += eps;
                mn[s].0[idx] -= eps;
            } else {
                p[s].1[idx - n] += eps;
                mn[s].1[idx - n] -= eps;
            }
            let fd = (loss(&p) - loss(&mn)) / (2.0 * eps as f64);
            let an = if idx < n { g.d_o[idx] } else { g.d_lse[idx - n] } as f64;
            assert!(
                (fd - an).abs() < 2e-3 * (1.0 + fd.abs()),
                "part {s} idx {idx}: fd {fd} vs {an} (DISTATTN_SEED={seed})"
            );
        }
    }
}
