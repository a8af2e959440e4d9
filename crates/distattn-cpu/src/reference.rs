//! Dense, quadratic, f64 attention: the oracle the tests compare the kernels against.
//! Memory is one row of scores at a time; time is `q_len · k_len · head_dim`.

use crate::{check_qkv, check_scale};
use distattn_core::{AttnOptions, AttnShape, Element, Mask, Result};

/// Reference forward output in f64 (same layouts as [`crate::Forward`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RefForward {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

/// Reference gradients in f64 (same layouts as [`crate::Grads`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RefGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

fn to_f64<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f32() as f64).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Kept keys and their scaled scores for row `(b, i, h)`.
#[allow(clippy::too_many_arguments)]
fn scores(
    q: &[f64],
    k: &[f64],
    shape: &AttnShape,
    mask: &Mask,
    scale: f64,
    b: usize,
    i: usize,
    h: usize,
) -> Vec<(usize, f64)> {
    let d = shape.head_dim;
    let kh = h / shape.group();
    let qr = &q[shape.q_offset(b, i, h)..][..d];
    let mut out = Vec::new();
    for (lo, hi) in mask.row_intervals(i) {
        for j in lo..hi {
            out.push((j, scale * dot(qr, &k[shape.kv_offset(b, j, kh)..][..d])));
        }
    }
    out
}

fn forward_f64(q: &[f64], k: &[f64], v: &[f64], shape: &AttnShape, mask: &Mask, scale: f64) -> RefForward {
    let d = shape.head_dim;
    let mut o = vec![0f64; shape.q_elems()];
    let mut lse = vec![f64::NEG_INFINITY; shape.lse_elems()];
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let kh = h / shape.group();
            for i in 0..shape.q_len {
                let s = scores(q, k, shape, mask, scale, b, i, h);
                if s.is_empty() {
                    continue;
                }
                let m = s.iter().fold(f64::NEG_INFINITY, |a, x| a.max(x.1));
                let sum: f64 = s.iter().map(|x| (x.1 - m).exp()).sum();
                let l = m + sum.ln();
                lse[shape.lse_offset(b, h, i)] = l;
                let orow = &mut o[shape.q_offset(b, i, h)..][..d];
                for &(j, sj) in &s {
                    let p = (sj - l).exp();
                    for (x, y) in orow.iter_mut().zip(&v[shape.kv_offset(b, j, kh)..][..d]) {
                        *x += p * y;
                    }
                }
            }
        }
    }
    RefForward { o, lse }
}

/// Dense f64 forward.
pub fn forward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<RefForward> {
    check_qkv(shape, mask, q.len(), k.len(), v.len())?;
    let scale = check_scale(opts, shape.head_dim)? as f64;
    Ok(forward_f64(&to_f64(q), &to_f64(k), &to_f64(v), shape, mask, scale))
}

/// Dense f64 backward of `O = softmax(scale · Q Kᵀ + mask) V` with upstream gradient `d_o`.
pub fn backward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    d_o: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<RefGrads> {
    check_qkv(shape, mask, q.len(), k.len(), v.len())?;
    shape.check_len("d_o", d_o.len(), shape.q_elems())?;
    let scale = check_scale(opts, shape.head_dim)? as f64;
    let (q, k, v, d_o) = (to_f64(q), to_f64(k), to_f64(v), to_f64(d_o));
    let fwd = forward_f64(&q, &k, &v, shape, mask, scale);
    let d = shape.head_dim;
    let mut dq = vec![0f64; shape.q_elems()];
    let mut dk = vec![0f64; shape.kv_elems()];
    let mut dv = vec![0f64; shape.kv_elems()];
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let kh = h / shape.group();
            for i in 0..shape.q_len {
                let l = fwd.lse[shape.lse_offset(b, h, i)];
                if l == f64::NEG_INFINITY {
                    continue;
                }
                let qo = shape.q_offset(b, i, h);
                let dor = &d_o[qo..qo + d];
                let delta = dot(dor, &fwd.o[qo..qo + d]);
                for (j, sj) in scores(&q, &k, shape, mask, scale, b, i, h) {
                    let ko = shape.kv_offset(b, j, kh);
                    let p = (sj - l).exp();
                    let dp = dot(dor, &v[ko..ko + d]);
                    let ds = p * (dp - delta);
                    for c in 0..d {
                        dq[qo + c] += scale * ds * k[ko + c];
                        dk[ko + c] += scale * ds * q[qo + c];
                        dv[ko + c] += p * dor[c];
                    }
                }
            }
        }
    }
    Ok(RefGrads { dq, dk, dv })
}
