//! Non-finite inputs reach the outputs that depend on them as NaN (as in other attention
//! libraries) instead of looking like a row that sees no key (O = 0, LSE = −inf); the other
//! rows checked here are unchanged. (A masked key's non-finite V, or in the backward a masked
//! pair's Q or dO, can still reach the other rows of its tile through zero weights; the README
//! says so.)

use distattn_core::{AttnOptions, AttnShape, Mask};
use distattn_cpu::{backward, forward, row_delta};

const N: usize = 40;
const D: usize = 64;

fn shape() -> AttnShape {
    AttnShape::new(1, N, N, 2, 1, D).unwrap()
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 1000.0 - 1.0).collect()
}

/// (O row, LSE) of query `i`, head `h`.
fn row(f: &distattn_core::Forward, s: &AttnShape, i: usize, h: usize) -> (Vec<f32>, f32) {
    let off = s.q_offset(0, i, h);
    (f.o[off..off + s.head_dim].to_vec(), f.lse[s.lse_offset(0, h, i)])
}

#[test]
fn a_non_finite_query_row_gives_nan_in_that_row_only() {
    let s = shape();
    let (q, k, v) = (values(s.q_elems(), 1), values(s.kv_elems(), 2), values(s.kv_elems(), 3));
    let opts = AttnOptions::default();
    for mask in [Mask::causal(N, N).unwrap(), Mask::full(N, N).unwrap()] {
        let clean = forward(&q, &k, &v, &s, &mask, &opts).unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut q2 = q.clone();
            q2[s.q_offset(0, 7, 1) + 5] = bad;
            let got = forward(&q2, &k, &v, &s, &mask, &opts).unwrap();
            for i in 0..N {
                for h in 0..2 {
                    let (o, lse) = row(&got, &s, i, h);
                    if (i, h) == (7, 1) {
                        assert!(o.iter().all(|x| x.is_nan()) && lse.is_nan(), "{bad}: {o:?} {lse}");
                    } else {
                        assert_eq!((o, lse), row(&clean, &s, i, h), "{bad}: row {i} head {h}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_non_finite_key_reaches_exactly_the_rows_that_see_it() {
    let s = shape();
    let (q, k, v) = (values(s.q_elems(), 4), values(s.kv_elems(), 5), values(s.kv_elems(), 6));
    let opts = AttnOptions::default();
    let mask = Mask::causal(N, N).unwrap();
    let clean = forward(&q, &k, &v, &s, &mask, &opts).unwrap();
    let j = 20;
    let mut k2 = k.clone();
    k2[s.kv_offset(0, j, 0) + 3] = f32::NAN;
    let got = forward(&q, &k2, &v, &s, &mask, &opts).unwrap();
    for i in 0..N {
        for h in 0..2 {
            let (o, lse) = row(&got, &s, i, h);
            if i >= j {
                assert!(o.iter().all(|x| x.is_nan()) && lse.is_nan(), "row {i} head {h} sees key {j}");
            } else {
                assert_eq!((o, lse), row(&clean, &s, i, h), "row {i} head {h} does not see key {j}");
            }
        }
    }
}

#[test]
fn a_non_finite_value_makes_o_nan_and_keeps_lse() {
    let s = shape();
    let (q, k, v) = (values(s.q_elems(), 7), values(s.kv_elems(), 8), values(s.kv_elems(), 9));
    let opts = AttnOptions::default();
    let mask = Mask::full(N, N).unwrap();
    let clean = forward(&q, &k, &v, &s, &mask, &opts).unwrap();
    let mut v2 = v.clone();
    v2[s.kv_offset(0, 11, 0) + 9] = f32::NAN;
    let got = forward(&q, &k, &v2, &s, &mask, &opts).unwrap();
    assert_eq!(got.lse, clean.lse);
    for i in 0..N {
        for h in 0..2 {
            assert!(row(&got, &s, i, h).0[9].is_nan(), "row {i} head {h}");
        }
    }
}

#[test]
fn backward_passes_nan_on_to_the_gradients_that_depend_on_it() {
    let s = shape();
    let (q, k, v, d_o) =
        (values(s.q_elems(), 10), values(s.kv_elems(), 11), values(s.kv_elems(), 12), values(s.q_elems(), 13));
    let opts = AttnOptions::default();
    let mask = Mask::causal(N, N).unwrap();
    let mut q2 = q.clone();
    q2[s.q_offset(0, 30, 0)] = f32::NAN;
    let f = forward(&q2, &k, &v, &s, &mask, &opts).unwrap();
    let delta = row_delta(&f.o, &d_o, &s).unwrap();
    let g = backward(&q2, &k, &v, &d_o, &f.lse, &delta, &s, &mask, &opts).unwrap();
    let dq_row = &g.dq[s.q_offset(0, 30, 0)..s.q_offset(0, 30, 0) + D];
    assert!(dq_row.iter().all(|x| x.is_nan()));
    // Keys 0..=30 are seen by query 30: their dK and dV are NaN. (Keys after it in the same
    // tile are too: the tile's dSᵀ·Q product multiplies their zero dS by the NaN query.)
    for j in [0, 17, 30] {
        assert!(g.dk[s.kv_offset(0, j, 0)..s.kv_offset(0, j, 0) + D].iter().all(|x| x.is_nan()), "dk {j}");
        assert!(g.dv[s.kv_offset(0, j, 0)..s.kv_offset(0, j, 0) + D].iter().all(|x| x.is_nan()), "dv {j}");
    }
    // Every other query's dQ is untouched by it.
    for i in (0..N).filter(|&i| i != 30) {
        for h in 0..2 {
            let off = s.q_offset(0, i, h);
            assert!(g.dq[off..off + D].iter().all(|x| x.is_finite()), "dq row {i} head {h}");
        }
    }
}

#[test]
fn merging_a_nan_partial_gives_nan() {
    use distattn_cpu::merge::merge_row;
    let (mut o, mut lse) = (vec![1.0f32, 2.0], 0.5f32);
    merge_row(&mut o, &mut lse, &[3.0, 4.0], f32::NEG_INFINITY);
    assert_eq!((o.clone(), lse), (vec![1.0, 2.0], 0.5), "a partial that sees no key changes nothing");
    merge_row(&mut o, &mut lse, &[3.0, 4.0], f32::NAN);
    assert!(o.iter().all(|x| x.is_nan()) && lse.is_nan());
    merge_row(&mut o, &mut lse, &[3.0, 4.0], 1.0);
    assert!(o.iter().all(|x| x.is_nan()) && lse.is_nan(), "NaN stays NaN");
}
