//! Dense, quadratic, f64 attention: the oracle every test compares the kernels against.
//! Work is `q_len · k_len · head_dim` per head, parallel over (batch, head); memory is one row
//! of scores at a time, plus per-head dK/dV partials in the backward.

use distattn_core::{AttnOptions, AttnShape, Element, Mask, Result};
use rayon::prelude::*;

/// Reference forward output in f64 (same layouts as [`distattn_core::Forward`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RefForward {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

/// Reference gradients in f64 (same layouts as [`distattn_core::Grads`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RefGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// `x` widened to f64.
pub fn widen<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f32() as f64).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn check(shape: &AttnShape, mask: &Mask, opts: &AttnOptions, lens: &[(&str, usize, usize)]) -> Result<f64> {
    shape.validate()?;
    for &(name, got, want) in lens {
        shape.check_len(name, got, want)?;
    }
    mask.check_fits(shape)?;
    Ok(opts.scale_for(shape.head_dim)? as f64)
}

/// One (batch, head) of the problem, in f64.
struct Head<'a> {
    shape: &'a AttnShape,
    mask: &'a Mask,
    scale: f64,
    b: usize,
    h: usize,
    q: &'a [f64],
    k: &'a [f64],
    v: &'a [f64],
}

impl Head<'_> {
    fn q_row(&self, i: usize) -> usize {
        self.shape.q_offset(self.b, i, self.h)
    }

    fn kv_row(&self, j: usize) -> usize {
        self.shape.kv_offset(self.b, j, self.h / self.shape.group())
    }

    /// The kept keys of row `i` and their scaled scores.
    fn scores(&self, i: usize) -> Vec<(usize, f64)> {
        let d = self.shape.head_dim;
        let qr = &self.q[self.q_row(i)..][..d];
        let mut out = Vec::new();
        for (lo, hi) in self.mask.row_intervals(i) {
            for j in lo..hi {
                out.push((j, self.scale * dot(qr, &self.k[self.kv_row(j)..][..d])));
            }
        }
        out
    }

    /// O rows (`[q_len, d]`) and LSE of this head.
    fn forward(&self) -> (Vec<f64>, Vec<f64>) {
        let d = self.shape.head_dim;
        let mut o = vec![0f64; self.shape.q_len * d];
        let mut lse = vec![f64::NEG_INFINITY; self.shape.q_len];
        for i in 0..self.shape.q_len {
            let s = self.scores(i);
            if s.is_empty() {
                continue;
            }
            let m = s.iter().fold(f64::NEG_INFINITY, |a, x| a.max(x.1));
            let l = m + s.iter().map(|x| (x.1 - m).exp()).sum::<f64>().ln();
            lse[i] = l;
            let orow = &mut o[i * d..(i + 1) * d];
            for &(j, sj) in &s {
                let p = (sj - l).exp();
                for (x, y) in orow.iter_mut().zip(&self.v[self.kv_row(j)..][..d]) {
                    *x += p * y;
                }
            }
        }
        (o, lse)
    }

    /// dQ rows (`[q_len, d]`) of this head and its dK, dV contributions (`[k_len, d]`).
    fn backward(&self, d_o: &[f64]) -> [Vec<f64>; 3] {
        let d = self.shape.head_dim;
        let (o, lse) = self.forward();
        let mut dq = vec![0f64; self.shape.q_len * d];
        let mut dk = vec![0f64; self.shape.k_len * d];
        let mut dv = vec![0f64; self.shape.k_len * d];
        for i in 0..self.shape.q_len {
            if lse[i] == f64::NEG_INFINITY {
                continue;
            }
            let (qo, dor) = (self.q_row(i), &d_o[self.q_row(i)..][..d]);
            let delta = dot(dor, &o[i * d..(i + 1) * d]);
            for (j, sj) in self.scores(i) {
                let ko = self.kv_row(j);
                let p = (sj - lse[i]).exp();
                let ds = p * (dot(dor, &self.v[ko..ko + d]) - delta);
                for c in 0..d {
                    dq[i * d + c] += self.scale * ds * self.k[ko + c];
                    dk[j * d + c] += self.scale * ds * self.q[qo + c];
                    dv[j * d + c] += p * dor[c];
                }
            }
        }
        [dq, dk, dv]
    }
}

/// The (batch, head) pairs of `shape`, as heads over `q`, `k`, `v`.
fn heads<'a>(
    shape: &'a AttnShape,
    mask: &'a Mask,
    scale: f64,
    q: &'a [f64],
    k: &'a [f64],
    v: &'a [f64],
) -> Vec<Head<'a>> {
    (0..shape.batch * shape.heads)
        .map(|bh| Head { shape, mask, scale, b: bh / shape.heads, h: bh % shape.heads, q, k, v })
        .collect()
}

/// Dense f64 forward: O and LSE (natural log, −inf for rows that see no key).
pub fn forward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<RefForward> {
    let scale = check(
        shape,
        mask,
        opts,
        &[("q", q.len(), shape.q_elems()), ("k", k.len(), shape.kv_elems()), ("v", v.len(), shape.kv_elems())],
    )?;
    let (q, k, v) = (widen(q), widen(k), widen(v));
    let per: Vec<(Vec<f64>, Vec<f64>)> = heads(shape, mask, scale, &q, &k, &v).par_iter().map(Head::forward).collect();
    let d = shape.head_dim;
    let mut out = RefForward { o: vec![0f64; shape.q_elems()], lse: vec![f64::NEG_INFINITY; shape.lse_elems()] };
    for (bh, (o, lse)) in per.into_iter().enumerate() {
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        for i in 0..shape.q_len {
            out.o[shape.q_offset(b, i, h)..][..d].copy_from_slice(&o[i * d..(i + 1) * d]);
            out.lse[shape.lse_offset(b, h, i)] = lse[i];
        }
    }
    Ok(out)
}

/// Dense f64 backward of `O = softmax(scale · Q Kᵀ + mask) V` with upstream gradient `d_o`
/// (dK and dV summed over the query heads of each KV head, in head order).
pub fn backward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    d_o: &[T],
    shape: &AttnShape,
    mask: &Mask,
    opts: &AttnOptions,
) -> Result<RefGrads> {
    let scale = check(
        shape,
        mask,
        opts,
        &[
            ("q", q.len(), shape.q_elems()),
            ("k", k.len(), shape.kv_elems()),
            ("v", v.len(), shape.kv_elems()),
            ("d_o", d_o.len(), shape.q_elems()),
        ],
    )?;
    let (q, k, v, d_o) = (widen(q), widen(k), widen(v), widen(d_o));
    let per: Vec<[Vec<f64>; 3]> =
        heads(shape, mask, scale, &q, &k, &v).par_iter().map(|head| head.backward(&d_o)).collect();
    let d = shape.head_dim;
    let mut g = RefGrads {
        dq: vec![0f64; shape.q_elems()],
        dk: vec![0f64; shape.kv_elems()],
        dv: vec![0f64; shape.kv_elems()],
    };
    for (bh, [dq, dk, dv]) in per.into_iter().enumerate() {
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        for i in 0..shape.q_len {
            g.dq[shape.q_offset(b, i, h)..][..d].copy_from_slice(&dq[i * d..(i + 1) * d]);
        }
        let kh = h / shape.group();
        for j in 0..shape.k_len {
            let off = shape.kv_offset(b, j, kh);
            for c in 0..d {
                g.dk[off + c] += dk[j * d + c];
                g.dv[off + c] += dv[j * d + c];
            }
        }
    }
    Ok(g)
}
