//! Named mask constructors: every mask of the long-context attention benchmark.

use super::{slices_from_rows, Mask, MaskSlice, SliceKind};
use crate::{Error, Result, MAX_SEQ_LEN};

/// Attention inside each document of a packed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DocKind {
    /// Every token sees its whole document.
    Full,
    /// Every token sees the tokens of its document up to itself.
    Causal,
}

fn positive(v: usize, what: &str) -> Result<()> {
    if v == 0 {
        return Err(Error::InvalidMask(format!("{what} must be positive")));
    }
    Ok(())
}

/// Checks a sequence length before anything proportional to it is built: positive and at
/// most [`MAX_SEQ_LEN`].
fn seq_len(v: usize, what: &str) -> Result<usize> {
    positive(v, what)?;
    if v > MAX_SEQ_LEN {
        return Err(Error::InvalidMask(format!("{what} {v} is more than the supported {MAX_SEQ_LEN} tokens")));
    }
    Ok(v)
}

/// The sum of document lengths, checked like a sequence length (without wrapping).
fn total_len(lens: impl IntoIterator<Item = usize>, what: &str) -> Result<usize> {
    let sum = lens.into_iter().try_fold(0usize, |acc, l| acc.checked_add(l).filter(|&t| t <= MAX_SEQ_LEN));
    match sum {
        Some(total) => seq_len(total, what),
        None => Err(Error::InvalidMask(format!("{what} is more than the supported {MAX_SEQ_LEN} tokens"))),
    }
}

/// Start offsets of consecutive documents, with the total.
fn offsets(lens: &[usize], what: &str) -> Result<(Vec<usize>, usize)> {
    let total = total_len(lens.iter().copied(), what)?;
    let starts = lens.iter().scan(0, |a, &l| Some(std::mem::replace(a, *a + l))).collect();
    Ok((starts, total))
}

impl Mask {
    /// Every query sees every key.
    pub fn full(q_len: usize, k_len: usize) -> Result<Mask> {
        Mask::from_slices(q_len, k_len, vec![MaskSlice::new(0..q_len, 0..k_len, SliceKind::Full)])
    }

    /// Causal, aligned to the bottom-right corner when `q_len != k_len` (query `i` sees keys
    /// `j <= i + k_len - q_len`), as FlashAttention. When `q_len > k_len` the first rows see
    /// nothing and produce O = 0, LSE = −inf.
    pub fn causal(q_len: usize, k_len: usize) -> Result<Mask> {
        Mask::from_slices(q_len, k_len, vec![MaskSlice::new(0..q_len, 0..k_len, SliceKind::Causal)])
    }

    /// Sliding window around the bottom-right-aligned diagonal: query `i` sees keys
    /// `[p − left, p + right]` with `p = i + k_len − q_len`. `None` means unbounded on that side,
    /// so `(Some(w), Some(0))` is causal sliding window attention.
    pub fn sliding_window(q_len: usize, k_len: usize, left: Option<usize>, right: Option<usize>) -> Result<Mask> {
        seq_len(q_len, "query length")?;
        seq_len(k_len, "key length")?;
        let shift = k_len as i64 - q_len as i64;
        // Widths past i64 (say usize::MAX for "no bound") saturate rather than wrap negative.
        let width = |w: usize| i64::try_from(w).unwrap_or(i64::MAX);
        let slices = slices_from_rows(0..q_len, |i| {
            let p = i as i64 + shift;
            let lo = left.map_or(0, |l| p.saturating_sub(width(l)).max(0));
            let hi = right.map_or(k_len as i64, |r| p.saturating_add(width(r)).saturating_add(1).min(k_len as i64));
            (lo.clamp(0, k_len as i64) as usize, hi.max(0) as usize)
        });
        Ok(Mask::new_unchecked(q_len, k_len, slices))
    }

    /// Sliding window plus `global` leading tokens that see and are seen by every token
    /// (self-attention over `n` tokens).
    pub fn window_global(n: usize, left: Option<usize>, right: Option<usize>, global: usize) -> Result<Mask> {
        seq_len(n, "sequence length")?;
        let g = global.min(n);
        let mut slices = Vec::new();
        if g > 0 {
            slices.push(MaskSlice::new(0..g, 0..n, SliceKind::Full));
            if g < n {
                slices.push(MaskSlice::new(g..n, 0..g, SliceKind::Full));
            }
        }
        slices.extend(slices_from_rows(g..n, |i| {
            let lo = left.map_or(g, |l| i.saturating_sub(l).max(g));
            let hi = right.map_or(n, |r| i.saturating_add(r).saturating_add(1).min(n));
            (lo, hi)
        }));
        Ok(Mask::new_unchecked(n, n, slices))
    }

    /// Packed documents (self-attention): tokens see only their own document.
    pub fn documents(lens: &[usize], kind: DocKind) -> Result<Mask> {
        Mask::documents_qk(lens, lens, kind)
    }

    /// Packed documents with separate query and key lengths per document (varlen
    /// cross-attention or decoding); causal is bottom-right aligned inside each document.
    pub fn documents_qk(q_lens: &[usize], k_lens: &[usize], kind: DocKind) -> Result<Mask> {
        Mask::per_document(q_lens, k_lens, |q_len, k_len| match kind {
            DocKind::Full => Mask::full(q_len, k_len),
            DocKind::Causal => Mask::causal(q_len, k_len),
        })
    }

    /// Packed sequences, each under its own mask (the packed variable-length layout):
    /// document `d` has `q_lens[d]` queries and `k_lens[d]` keys, sees only its own keys, and
    /// `part(q_len, k_len)` says which of them. A document with no queries or no keys keeps
    /// nothing, and `part` is not called for it.
    pub fn per_document(
        q_lens: &[usize],
        k_lens: &[usize],
        part: impl Fn(usize, usize) -> Result<Mask>,
    ) -> Result<Mask> {
        if q_lens.len() != k_lens.len() {
            return Err(Error::InvalidMask(format!(
                "{} query documents but {} key documents",
                q_lens.len(),
                k_lens.len()
            )));
        }
        let (qs, q_total) = offsets(q_lens, "total query length")?;
        let (ks, k_total) = offsets(k_lens, "total key length")?;
        let mut slices = Vec::new();
        for d in (0..q_lens.len()).filter(|&d| q_lens[d] > 0 && k_lens[d] > 0) {
            let m = part(q_lens[d], k_lens[d])?;
            if (m.q_len(), m.k_len()) != (q_lens[d], k_lens[d]) {
                return Err(Error::Internal(format!(
                    "document {d}: a {}x{} mask for {}x{} tokens",
                    m.q_len(),
                    m.k_len(),
                    q_lens[d],
                    k_lens[d]
                )));
            }
            // A slice's kept pairs are defined relative to its own ranges, so moving it to the
            // document's offsets keeps its meaning.
            slices.extend(m.slices().iter().map(|s| {
                MaskSlice::new(qs[d] + s.q.start..qs[d] + s.q.end, ks[d] + s.k.start..ks[d] + s.k.end, s.kind)
            }));
        }
        Ok(Mask::new_unchecked(q_total, k_total, slices))
    }

    /// Documents given by cumulative offsets `[0, l0, l0+l1, …]` (the packed varlen layout).
    pub fn from_cu_seqlens(cu_seqlens: &[usize], kind: DocKind) -> Result<Mask> {
        if cu_seqlens.first() != Some(&0) || cu_seqlens.windows(2).any(|w| w[1] < w[0]) {
            return Err(Error::InvalidMask("cu_seqlens must start at 0 and never decrease".into()));
        }
        let lens: Vec<usize> = cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
        Mask::documents(&lens, kind)
    }

    /// Prefix-LM over `n` tokens: the first `prefix` tokens see each other both ways, the rest
    /// are causal.
    pub fn prefix_lm(n: usize, prefix: usize) -> Result<Mask> {
        Mask::prefix_lm_documents(&[(n, prefix)])
    }

    /// Prefix-LM inside each document: `docs` holds `(length, prefix)` pairs.
    pub fn prefix_lm_documents(docs: &[(usize, usize)]) -> Result<Mask> {
        total_len(docs.iter().map(|d| d.0), "sequence length")?;
        let mut slices = Vec::new();
        let mut a = 0;
        for &(len, prefix) in docs {
            if prefix > len {
                return Err(Error::InvalidMask(format!("prefix {prefix} longer than its document ({len})")));
            }
            let p = a + prefix;
            slices.extend(slices_from_rows(a..a + len, |i| (a, if i < p { p } else { i + 1 })));
            a += len;
        }
        Ok(Mask::new_unchecked(a, a, slices))
    }

    /// Shared question: a question of `question` tokens (causal) followed by answers that each
    /// see the whole question and themselves causally, but not each other.
    pub fn shared_question(question: usize, answers: &[usize]) -> Result<Mask> {
        total_len(std::iter::once(question).chain(answers.iter().copied()), "sequence length")?;
        let mut slices = Vec::new();
        if question > 0 {
            slices.push(MaskSlice::new(0..question, 0..question, SliceKind::Causal));
        }
        let mut a = question;
        for &len in answers.iter().filter(|&&l| l > 0) {
            if question > 0 {
                slices.push(MaskSlice::new(a..a + len, 0..question, SliceKind::Full));
            }
            slices.push(MaskSlice::new(a..a + len, a..a + len, SliceKind::Causal));
            a += len;
        }
        Ok(Mask::new_unchecked(a, a, slices))
    }

    /// Causal at block granularity over `n` tokens: a token sees every key up to the end of its
    /// own block.
    pub fn block_causal(n: usize, block: usize) -> Result<Mask> {
        Mask::block_causal_documents(&[n], block)
    }

    /// Block-causal inside each document.
    pub fn block_causal_documents(lens: &[usize], block: usize) -> Result<Mask> {
        positive(block, "block size")?;
        total_len(lens.iter().copied(), "sequence length")?;
        let mut slices = Vec::new();
        let mut a = 0;
        for &len in lens {
            let b = a + len;
            // End of row i's block, saturating: a block larger than the document is the whole
            // document.
            let block_end = |i: usize| ((i - a) / block + 1).saturating_mul(block).saturating_add(a).min(b);
            slices.extend(slices_from_rows(a..b, |i| (a, block_end(i))));
            a = b;
        }
        Ok(Mask::new_unchecked(a, a, slices))
    }

    /// An arbitrary block mask: `keep` is row-major over `ceil(q_len/block_q) ×
    /// ceil(k_len/block_k)` blocks; a kept block keeps all its pairs.
    pub fn block_mask(q_len: usize, k_len: usize, block_q: usize, block_k: usize, keep: &[bool]) -> Result<Mask> {
        positive(block_q, "query block size")?;
        positive(block_k, "key block size")?;
        seq_len(q_len, "query length")?;
        seq_len(k_len, "key length")?;
        let (nq, nk) = (q_len.div_ceil(block_q), k_len.div_ceil(block_k));
        if nq.checked_mul(nk) != Some(keep.len()) {
            return Err(Error::InvalidMask(format!("block mask needs {nq}x{nk} entries, got {}", keep.len())));
        }
        let mut slices = Vec::new();
        for bi in 0..nq {
            for bj in (0..nk).filter(|&bj| keep[bi * nk + bj]) {
                let q = bi * block_q..(bi * block_q).saturating_add(block_q).min(q_len);
                let k = bj * block_k..(bj * block_k).saturating_add(block_k).min(k_len);
                slices.push(MaskSlice::new(q, k, SliceKind::Full));
            }
        }
        Ok(Mask::new_unchecked(q_len, k_len, super::merge_adjacent(slices)))
    }
}
