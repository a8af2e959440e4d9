//! Decode cases: random ragged batches in a paged KV cache whose pages are handed out in a
//! shuffled order (so a request's pages are never adjacent by accident), and the f64 reference
//! of decode attention over them, computed row by row from the definition.

use crate::random::randn;
use distattn_core::decode::{DecodeOptions, DecodeShape, PagedCache, PagedLayout};
use distattn_core::Element;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// One decode step's inputs (f32 values; cast them for other dtypes).
#[derive(Debug, Clone)]
pub struct DecodeCase {
    pub shape: DecodeShape,
    pub layout: PagedLayout,
    /// `[batch, max_pages]`; unused entries are -1.
    pub page_table: Vec<i32>,
    /// Keys per request, the step's new tokens included.
    pub lengths: Vec<usize>,
    pub q: Vec<f32>,
    pub k_cache: Vec<f32>,
    pub v_cache: Vec<f32>,
}

impl DecodeCase {
    /// Requests of `lengths` keys in pages of `page_size` (a few spare pages, shuffled), random
    /// queries and caches of unit scale.
    pub fn random(rng: &mut StdRng, shape: DecodeShape, page_size: usize, lengths: &[usize]) -> DecodeCase {
        let per: Vec<usize> = lengths.iter().map(|&l| l.div_ceil(page_size).max(1)).collect();
        let max_pages = *per.iter().max().unwrap_or(&1);
        let pages = per.iter().sum::<usize>() + 3;
        let mut order: Vec<i32> = (0..pages as i32).collect();
        order.shuffle(rng);
        let mut page_table = vec![-1; shape.batch * max_pages];
        let mut next = order.into_iter();
        for (b, &n) in per.iter().enumerate() {
            for slot in &mut page_table[b * max_pages..b * max_pages + n] {
                *slot = next.next().unwrap_or(0);
            }
        }
        let layout = PagedLayout { pages, page_size, kv_heads: shape.kv_heads, head_dim: shape.head_dim };
        DecodeCase {
            shape,
            layout,
            page_table,
            lengths: lengths.to_vec(),
            q: randn(rng, shape.q_elems(), 1.0),
            k_cache: randn(rng, layout.elems(), 1.0),
            v_cache: randn(rng, layout.elems(), 1.0),
        }
    }

    /// The case's cache with the values `k`, `v` (the case's, cast to a storage type).
    pub fn cache<'a, T>(&'a self, k: &'a [T], v: &'a [T]) -> PagedCache<'a, T> {
        PagedCache { k, v, layout: self.layout, page_table: &self.page_table, lengths: &self.lengths }
    }

    /// Element offset of request `b`'s token `t`, KV head `h` in either cache.
    pub fn kv_offset(&self, b: usize, t: usize, h: usize) -> usize {
        let max_pages = self.page_table.len() / self.shape.batch;
        let page = self.page_table[b * max_pages + t / self.layout.page_size] as usize;
        self.layout.offset(page, t % self.layout.page_size, h)
    }
}

/// f64 decode attention on the case's values as stored in `T`: O `[batch, q_rows, heads, d]`
/// and LSE `[batch, heads, q_rows]` (natural log, −inf where a row sees no key).
pub fn reference<T: Element>(
    case: &DecodeCase,
    q: &[T],
    k: &[T],
    v: &[T],
    opts: &DecodeOptions,
) -> (Vec<f64>, Vec<f64>) {
    let s = &case.shape;
    let d = s.head_dim;
    let scale = opts.attn.scale_for(d).expect("a valid scale") as f64;
    let mut o = vec![0f64; s.q_elems()];
    let mut lse = vec![f64::NEG_INFINITY; s.lse_elems()];
    for b in 0..s.batch {
        let len = case.lengths[b];
        for i in 0..s.q_rows {
            let visible = if opts.causal { (len + i + 1).saturating_sub(s.q_rows) } else { len };
            for h in 0..s.heads {
                let kvh = h / s.group();
                let qo = ((b * s.q_rows + i) * s.heads + h) * d;
                let scores: Vec<f64> = (0..visible)
                    .map(|t| {
                        let ko = case.kv_offset(b, t, kvh);
                        scale * (0..d).map(|c| q[qo + c].to_f32() as f64 * k[ko + c].to_f32() as f64).sum::<f64>()
                    })
                    .collect();
                if scores.is_empty() {
                    continue;
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                for (t, x) in scores.iter().enumerate() {
                    let w = (x - m).exp() / sum;
                    let vo = case.kv_offset(b, t, kvh);
                    for c in 0..d {
                        o[qo + c] += w * v[vo + c].to_f32() as f64;
                    }
                }
                lse[(b * s.heads + h) * s.q_rows + i] = m + sum.ln();
            }
        }
    }
    (o, lse)
}
