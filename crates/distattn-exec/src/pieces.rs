//! Where the part of one plan buffer that another buffer also holds lies in each: element
//! [`Piece`]s for copies and adds, and a compact [`MergeSpec`] for LSE merges. Both are pure
//! data computed from buffer descriptors, once per program (see [`crate::prepare()`]).

use distattn_core::plan::BufDesc;
use distattn_core::AttnShape;

/// A strided block of elements moved by one copy or add: `rows` rows of `len` elements, row
/// `r` starting at `src + r·src_stride` in the source and `dst + r·dst_stride` in the
/// destination. A head slice of a token run is one piece (a row per token), so a copy's list
/// stays a few entries long however many tokens it moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Piece {
    pub src: usize,
    pub dst: usize,
    pub len: usize,
    pub rows: usize,
    pub src_stride: usize,
    pub dst_stride: usize,
}

impl Piece {
    /// `rows` rows of `len` elements; rows that follow each other on both sides fold into one.
    pub fn strided(src: usize, dst: usize, len: usize, rows: usize, src_stride: usize, dst_stride: usize) -> Piece {
        if rows > 1 && src_stride == len && dst_stride == len {
            return Piece { src, dst, len: len * rows, rows: 1, src_stride: len * rows, dst_stride: len * rows };
        }
        Piece { src, dst, len, rows, src_stride, dst_stride }
    }

    /// One run of `len` elements.
    pub fn run(src: usize, dst: usize, len: usize) -> Piece {
        Piece::strided(src, dst, len, 1, len, len)
    }

    /// `(source offset, destination offset, length)` of each row.
    pub fn row_runs(self) -> impl Iterator<Item = (usize, usize, usize)> {
        (0..self.rows).map(move |r| (self.src + r * self.src_stride, self.dst + r * self.dst_stride, self.len))
    }

    /// One past the last source and destination elements the piece touches (0 if empty).
    pub fn ends(&self) -> (usize, usize) {
        if self.rows == 0 || self.len == 0 {
            return (0, 0);
        }
        let last = self.rows - 1;
        (self.src + last * self.src_stride + self.len, self.dst + last * self.dst_stride + self.len)
    }

    /// Whether the piece lies inside a source of `src_len` and a destination of `dst_len` elements.
    pub fn fits(&self, src_len: usize, dst_len: usize) -> bool {
        let (s, d) = self.ends();
        s <= src_len && d <= dst_len
    }
}

/// Pieces copying the (tokens ∩, heads ∩) part of `src` into `dst`: one per batch entry and
/// shared token run.
pub fn pieces(src: &BufDesc, dst: &BufDesc, shape: &AttnShape) -> Vec<Piece> {
    let tp = src.tokens.pieces_into(&dst.tokens);
    let (h0, h1) = (src.heads.start.max(dst.heads.start), src.heads.end.min(dst.heads.end));
    let mut out = Vec::new();
    if h0 >= h1 || tp.is_empty() {
        return out;
    }
    let (ns, nd) = (src.tokens.len(), dst.tokens.len());
    let (hs, hd) = (src.heads.len(), dst.heads.len());
    let (hs0, hd0) = (h0 - src.heads.start, h0 - dst.heads.start);
    for b in 0..shape.batch {
        for &(sa, sb, n) in &tp {
            out.push(if src.tensor.is_stats() {
                // [b, heads, tokens]: a row per head.
                Piece::strided((b * hs + hs0) * ns + sa, (b * hd + hd0) * nd + sb, n, h1 - h0, ns, nd)
            } else {
                // [b, tokens, heads, d]: a row per token.
                let d = shape.head_dim;
                Piece::strided(
                    ((b * ns + sa) * hs + hs0) * d,
                    ((b * nd + sb) * hd + hd0) * d,
                    (h1 - h0) * d,
                    n,
                    hs * d,
                    hd * d,
                )
            });
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

    /// Position → token of a set, by its runs.
    fn tokens_of(set: &TokenSet) -> Vec<usize> {
        set.to_runs().into_iter().flatten().collect()
    }

    #[test]
    fn strided_pieces_move_exactly_the_shared_elements() {
        // Per tensor layout, batch 2: every destination element the source shares is written
        // with the source's value, and no other.
        let shape = AttnShape::new(2, 40, 40, 6, 6, 3).unwrap();
        let cases = [
            (TokenSet::range(0..20), 0..6, TokenSet::range(0..40), 2..5),
            (TokenSet::from_runs(vec![0..5, 30..40]), 1..4, TokenSet::from_runs(vec![0..8, 28..36]), 0..6),
            (TokenSet::Strided { start: 1, step: 3, count: 9 }, 0..6, TokenSet::range(0..30), 3..6),
            (TokenSet::range(10..30), 2..4, TokenSet::range(0..40), 0..6),
        ];
        for tensor in [Tensor::Q, Tensor::Lse] {
            for (st, sh, dt, dh) in cases.clone() {
                let src = BufDesc::new(tensor, st.clone(), sh.clone());
                let dst = BufDesc::new(tensor, dt.clone(), dh.clone());
                let (ns, nd, d) = (st.len(), dt.len(), if tensor.is_stats() { 1 } else { shape.head_dim });
                let at = |b: usize, t: usize, h: usize, n: usize, hs: usize, c: usize| {
                    if tensor.is_stats() {
                        (b * hs + h) * n + t
                    } else {
                        ((b * n + t) * hs + h) * d + c
                    }
                };
                let mut out = vec![usize::MAX; dst.elems(&shape)];
                for (s, o, n) in pieces(&src, &dst, &shape).iter().flat_map(|p| p.row_runs()) {
                    for i in 0..n {
                        out[o + i] = s + i;
                    }
                }
                let (src_tokens, dst_tokens) = (tokens_of(&st), tokens_of(&dt));
                for b in 0..2 {
                    for (ti, tok) in dst_tokens.iter().enumerate() {
                        for h in dh.clone() {
                            for c in 0..d {
                                let want = match src_tokens.iter().position(|x| x == tok) {
                                    Some(si) if sh.contains(&h) => at(b, si, h - sh.start, ns, sh.len(), c),
                                    _ => usize::MAX,
                                };
                                assert_eq!(
                                    out[at(b, ti, h - dh.start, nd, dh.len(), c)],
                                    want,
                                    "{tensor:?} {src:?} -> {dst:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_head_slice_of_a_run_is_one_piece_and_whole_rows_fold() {
        let shape = AttnShape::new(1, 64, 64, 8, 8, 4).unwrap();
        let all = BufDesc::new(Tensor::Q, TokenSet::range(0..64), 0..8);
        let slice = BufDesc::new(Tensor::Q, TokenSet::range(0..64), 2..4);
        assert_eq!(pieces(&all, &slice, &shape), vec![Piece::strided(8, 0, 8, 64, 32, 8)]);
        let half = BufDesc::new(Tensor::Q, TokenSet::range(32..64), 0..8);
        assert_eq!(
            pieces(&half, &all, &shape),
            vec![Piece { src: 0, dst: 1024, len: 1024, rows: 1, src_stride: 1024, dst_stride: 1024 }]
        );
        assert_eq!(Piece::strided(0, 0, 0, 5, 3, 3).ends(), (0, 0));
        assert!(Piece::strided(2, 0, 3, 4, 5, 3).fits(2 + 3 * 5 + 3, 12));
        assert!(!Piece::strided(2, 0, 3, 4, 5, 3).fits(2 + 3 * 5 + 2, 12));
    }

    #[test]
    fn pieces_copy_the_shared_part() {
        // A [1, 10 tokens, 4 heads, d 2] buffer into one holding tokens 4..14 and heads 1..3.
        let shape = AttnShape::new(1, 20, 20, 4, 4, 2).unwrap();
        let src = BufDesc::new(Tensor::Q, TokenSet::range(0..10), 0..4);
        let dst = BufDesc::new(Tensor::Q, TokenSet::range(4..14), 1..3);
        let values: Vec<usize> = (0..src.elems(&shape)).collect();
        let mut out = vec![usize::MAX; dst.elems(&shape)];
        let list = pieces(&src, &dst, &shape);
        assert_eq!(list.len(), 1, "one token run, one piece");
        for (s, d, n) in list.iter().flat_map(|p| p.row_runs()) {
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
