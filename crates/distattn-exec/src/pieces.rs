//! Where the part of one plan buffer that another buffer also holds lies in each: element
//! [`Piece`]s for copies and adds, and a compact [`MergeSpec`] for LSE merges. Both are pure
//! data computed from buffer descriptors, once per program (see [`crate::prepare`]).

use distattn_core::plan::BufDesc;
use distattn_core::AttnShape;

/// `(source offset, destination offset, length)` in elements.
pub type Piece = (usize, usize, usize);

/// Element pieces copying the (tokens ∩, heads ∩) part of `src` into `dst`.
pub fn pieces(src: &BufDesc, dst: &BufDesc, shape: &AttnShape) -> Vec<Piece> {
    let tp = src.tokens.pieces_into(&dst.tokens);
    let (h0, h1) = (src.heads.start.max(dst.heads.start), src.heads.end.min(dst.heads.end));
    let mut out = Vec::new();
    if h0 >= h1 || tp.is_empty() {
        return out;
    }
    let (ns, nd) = (src.tokens.len(), dst.tokens.len());
    let (hs, hd) = (src.heads.len(), dst.heads.len());
    if src.tensor.is_stats() {
        for b in 0..shape.batch {
            for h in h0..h1 {
                let (bs, bd) = ((b * hs + h - src.heads.start) * ns, (b * hd + h - dst.heads.start) * nd);
                out.extend(tp.iter().map(|&(sa, sb, n)| (bs + sa, bd + sb, n)));
            }
        }
        return out;
    }
    let d = shape.head_dim;
    for b in 0..shape.batch {
        for &(sa, sb, n) in &tp {
            if hs == h1 - h0 && hd == h1 - h0 {
                out.push((((b * ns + sa) * hs) * d, ((b * nd + sb) * hd) * d, n * hs * d));
            } else {
                for t in 0..n {
                    let so = ((b * ns + sa + t) * hs + h0 - src.heads.start) * d;
                    let dof = ((b * nd + sb + t) * hd + h0 - dst.heads.start) * d;
                    out.push((so, dof, (h1 - h0) * d));
                }
            }
        }
    }
    out
}

/// One merged row: `(source LSE index, destination LSE index, source O offset, destination O
/// offset)`; O rows are `head_dim` long.
pub type MergeRow = (usize, usize, usize, usize);

/// A merge of a partial (O, LSE) covering the tokens and heads of one descriptor into an
/// accumulator covering another, compactly: the shared tokens as runs and the shared heads as a
/// range, so a device kernel finds any row's offsets from a few numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeSpec {
    pub batch: usize,
    /// Shared heads.
    pub heads: usize,
    /// Heads of the source and of the destination.
    pub src_heads: usize,
    pub dst_heads: usize,
    /// Index of the first shared head in the source and in the destination.
    pub src_head0: usize,
    pub dst_head0: usize,
    /// Tokens of the source and of the destination.
    pub src_tokens: usize,
    pub dst_tokens: usize,
    pub head_dim: usize,
    /// Shared token runs as `(source token, destination token, length, start)` quads; `start`
    /// is the run's first position in the concatenation of all runs.
    pub runs: Vec<[i64; 4]>,
    /// Shared tokens (the sum of the run lengths).
    pub tokens: usize,
}

impl MergeSpec {
    /// The merge of a partial covering `src` into an accumulator covering `dst`.
    pub fn new(src: &BufDesc, dst: &BufDesc, shape: &AttnShape) -> MergeSpec {
        let (h0, h1) = (src.heads.start.max(dst.heads.start), src.heads.end.min(dst.heads.end));
        let mut runs = Vec::new();
        let mut tokens = 0usize;
        for (sa, sb, n) in src.tokens.pieces_into(&dst.tokens) {
            runs.push([sa as i64, sb as i64, n as i64, tokens as i64]);
            tokens += n;
        }
        MergeSpec {
            batch: shape.batch,
            heads: h1.saturating_sub(h0),
            src_heads: src.heads.len(),
            dst_heads: dst.heads.len(),
            src_head0: h0.saturating_sub(src.heads.start),
            dst_head0: h0.saturating_sub(dst.heads.start),
            src_tokens: src.tokens.len(),
            dst_tokens: dst.tokens.len(),
            head_dim: shape.head_dim,
            runs,
            tokens,
        }
    }

    /// Rows merged (batch × shared heads × shared tokens).
    pub fn row_count(&self) -> usize {
        self.batch * self.heads * self.tokens
    }

    /// Every merged row, for host backends (a device kernel computes them from the spec).
    pub fn rows(&self) -> impl Iterator<Item = MergeRow> + '_ {
        let (ns, nd, d) = (self.src_tokens, self.dst_tokens, self.head_dim);
        (0..self.batch).flat_map(move |b| {
            (0..self.heads).flat_map(move |h| {
                let (hs, hd) = (self.src_head0 + h, self.dst_head0 + h);
                self.runs.iter().flat_map(move |run| {
                    (0..run[2] as usize).map(move |t| {
                        let (i, j) = (run[0] as usize + t, run[1] as usize + t);
                        (
                            (b * self.src_heads + hs) * ns + i,
                            (b * self.dst_heads + hd) * nd + j,
                            ((b * ns + i) * self.src_heads + hs) * d,
                            ((b * nd + j) * self.dst_heads + hd) * d,
                        )
                    })
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distattn_core::plan::{Tensor, TokenSet};

    /// Rows of a merge found the slow way: every shared (batch, head, token) by membership.
    fn rows_by_membership(src: &BufDesc, dst: &BufDesc, shape: &AttnShape) -> Vec<MergeRow> {
        let members = |s: &TokenSet| s.to_runs().into_iter().flatten().collect::<Vec<_>>();
        let (ts, td) = (members(&src.tokens), members(&dst.tokens));
        let d = shape.head_dim;
        let mut out = Vec::new();
        for b in 0..shape.batch {
            for h in src.heads.clone().filter(|h| dst.heads.contains(h)) {
                let (hs, hd) = (h - src.heads.start, h - dst.heads.start);
                for (i, tok) in ts.iter().enumerate() {
                    if let Some(j) = td.iter().position(|x| x == tok) {
                        out.push((
                            (b * src.heads.len() + hs) * ts.len() + i,
                            (b * dst.heads.len() + hd) * td.len() + j,
                            ((b * ts.len() + i) * src.heads.len() + hs) * d,
                            ((b * td.len() + j) * dst.heads.len() + hd) * d,
                        ));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn merge_spec_rows_are_the_shared_rows() {
        let shape = AttnShape::new(2, 64, 64, 8, 4, 16).unwrap();
        let o = |tokens: TokenSet, heads| BufDesc::new(Tensor::O, tokens, heads);
        let cases = [
            (o(TokenSet::range(8..24), 0..8), o(TokenSet::range(0..32), 0..8)),
            (o(TokenSet::range(0..32), 2..6), o(TokenSet::range(0..64), 0..8)),
            (o(TokenSet::from_runs(vec![0..8, 40..48]), 0..4), o(TokenSet::from_runs(vec![0..16, 32..48]), 2..8)),
            (o(TokenSet::Strided { start: 1, step: 3, count: 9 }, 0..8), o(TokenSet::range(0..30), 0..8)),
        ];
        for (src, dst) in cases {
            let spec = MergeSpec::new(&src, &dst, &shape);
            let mut got: Vec<MergeRow> = spec.rows().collect();
            let mut want = rows_by_membership(&src, &dst, &shape);
            assert_eq!(got.len(), spec.row_count());
            got.sort();
            want.sort();
            assert_eq!(got, want, "{src:?} -> {dst:?}");
        }
    }

    #[test]
    fn pieces_copy_the_shared_part() {
        // A [1, 10 tokens, 4 heads, d 2] buffer into one holding tokens 4..14 and heads 1..3.
        let shape = AttnShape::new(1, 20, 20, 4, 4, 2).unwrap();
        let src = BufDesc::new(Tensor::Q, TokenSet::range(0..10), 0..4);
        let dst = BufDesc::new(Tensor::Q, TokenSet::range(4..14), 1..3);
        let values: Vec<usize> = (0..src.elems(&shape)).collect();
        let mut out = vec![usize::MAX; dst.elems(&shape)];
        for (s, d, n) in pieces(&src, &dst, &shape) {
            out[d..d + n].copy_from_slice(&values[s..s + n]);
        }
        for t in 0..10 {
            for h in 0..2 {
                for c in 0..2 {
                    let got = out[(t * 2 + h) * 2 + c];
                    let want = if t < 6 { ((t + 4) * 4 + h + 1) * 2 + c } else { usize::MAX };
                    assert_eq!(got, want, "token {t} head {h} col {c}");
                }
            }
        }
    }
}
