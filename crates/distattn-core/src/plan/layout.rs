//! Token sets and sequence layouts: which global tokens each rank holds.
//!
//! A [`TokenSet`] is an ascending set of global token positions, either a list of runs or an
//! arithmetic progression (the striped layout). Because it is ascending, the local index of a
//! token is its rank in the set, and any global interval maps to one contiguous local interval:
//! that is what lets [`sub_mask`] and [`area`] re-index a mask onto a rank's tokens in closed form
//! (run × run restriction) or in one pass over the rows (strided sets), never per pair.

use super::Tensor;
use crate::mask::{slices_from_rows, Mask, MaskSlice};
use crate::{Error, Result};
use std::ops::Range;

/// An ascending set of global token positions.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenSet {
    /// Disjoint, ascending, non-adjacent, non-empty runs.
    Runs(Vec<Range<usize>>),
    /// `start, start + step, …` (`count` tokens).
    Strided { start: usize, step: usize, count: usize },
}

impl TokenSet {
    /// The empty set.
    pub fn empty() -> Self {
        TokenSet::Runs(Vec::new())
    }

    /// One contiguous run.
    pub fn range(r: Range<usize>) -> Self {
        TokenSet::from_runs(vec![r])
    }

    /// Normalises any runs (sorts, drops empty ones, joins touching ones). Overlapping runs
    /// are joined too (the set semantics).
    pub fn from_runs(mut runs: Vec<Range<usize>>) -> Self {
        runs.retain(|r| r.start < r.end);
        runs.sort_by_key(|r| r.start);
        let mut out: Vec<Range<usize>> = Vec::with_capacity(runs.len());
        for r in runs {
            match out.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => out.push(r),
            }
        }
        TokenSet::Runs(out)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            TokenSet::Runs(r) => r.iter().map(|r| r.len()).sum(),
            TokenSet::Strided { count, .. } => *count,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The set as runs (a strided set with step > 1 becomes one run per token).
    pub fn to_runs(&self) -> Vec<Range<usize>> {
        match self {
            TokenSet::Runs(r) => r.clone(),
            TokenSet::Strided { start, step, count } => {
                if *step == 1 || *count <= 1 {
                    if *count == 0 {
                        Vec::new()
                    } else {
                        let run = *start..start + (count - 1) * step + 1;
                        vec![run]
                    }
                } else {
                    (0..*count).map(|i| start + i * step).map(|t| t..t + 1).collect()
                }
            }
        }
    }

    /// Number of tokens of the set below `x` (the local index of `x` if it is a member).
    pub fn rank_of(&self, x: usize) -> usize {
        match self {
            TokenSet::Runs(runs) => {
                let mut n = 0;
                for r in runs {
                    if x <= r.start {
                        break;
                    }
                    n += x.min(r.end) - r.start;
                }
                n
            }
            TokenSet::Strided { start, step, count } => {
                if x <= *start {
                    0
                } else {
                    ((x - start).div_ceil(*step)).min(*count)
                }
            }
        }
    }

    /// Local interval of the members in the global interval `[lo, hi)`.
    pub fn local_range(&self, lo: usize, hi: usize) -> Range<usize> {
        if lo >= hi {
            let r = self.rank_of(lo);
            return r..r;
        }
        self.rank_of(lo)..self.rank_of(hi)
    }

    /// The first and one-past-last member, if any.
    pub fn span(&self) -> Option<Range<usize>> {
        match self {
            TokenSet::Runs(r) => Some(r.first()?.start..r.last()?.end),
            TokenSet::Strided { start, step, count } => (*count > 0).then(|| *start..start + (count - 1) * step + 1),
        }
    }

    /// Members of `self` that are also in `other`, as `(local index in self, local index in
    /// other, length)` pieces, ascending.
    pub fn pieces_into(&self, other: &TokenSet) -> Vec<(usize, usize, usize)> {
        let a = self.to_runs();
        let b = other.to_runs();
        let (mut i, mut j) = (0, 0);
        let (mut la, mut lb) = (0, 0); // local offsets of a[i], b[j]
        let mut out: Vec<(usize, usize, usize)> = Vec::new();
        while i < a.len() && j < b.len() {
            let lo = a[i].start.max(b[j].start);
            let hi = a[i].end.min(b[j].end);
            if lo < hi {
                let (sa, sb, n) = (la + lo - a[i].start, lb + lo - b[j].start, hi - lo);
                match out.last_mut() {
                    Some(p) if p.0 + p.2 == sa && p.1 + p.2 == sb => p.2 += n,
                    _ => out.push((sa, sb, n)),
                }
            }
            if a[i].end <= b[j].end {
                la += a[i].len();
                i += 1;
            } else {
                lb += b[j].len();
                j += 1;
            }
        }
        out
    }

    /// Whether every member of `self` is in `other`.
    pub fn is_subset_of(&self, other: &TokenSet) -> bool {
        self.pieces_into(other).iter().map(|p| p.2).sum::<usize>() == self.len()
    }

    /// Members of both sets, as runs.
    pub fn intersect(&self, other: &TokenSet) -> TokenSet {
        let (a, b) = (self.to_runs(), other.to_runs());
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        while i < a.len() && j < b.len() {
            let (lo, hi) = (a[i].start.max(b[j].start), a[i].end.min(b[j].end));
            if lo < hi {
                out.push(lo..hi);
            }
            if a[i].end <= b[j].end {
                i += 1;
            } else {
                j += 1;
            }
        }
        TokenSet::from_runs(out)
    }

    /// Union of several sets, as runs.
    pub fn union<'a>(sets: impl IntoIterator<Item = &'a TokenSet>) -> TokenSet {
        TokenSet::from_runs(sets.into_iter().flat_map(|s| s.to_runs()).collect())
    }

    /// The members with local index in `r` (a sub-range of the set, in order).
    pub fn local_slice(&self, r: Range<usize>) -> TokenSet {
        match self {
            TokenSet::Strided { start, step, count } => {
                let e = r.end.min(*count);
                let s = r.start.min(e);
                TokenSet::Strided { start: start + s * step, step: *step, count: e - s }
            }
            TokenSet::Runs(runs) => {
                let mut out = Vec::new();
                let mut off = 0;
                for run in runs {
                    let (a, b) = (off, off + run.len());
                    let lo = r.start.max(a);
                    let hi = r.end.min(b);
                    if lo < hi {
                        out.push(run.start + lo - a..run.start + hi - a);
                    }
                    off = b;
                }
                TokenSet::Runs(out)
            }
        }
    }

    /// Whether the set is a few runs (closed-form mask queries) rather than strided.
    fn is_runs(&self) -> bool {
        matches!(self, TokenSet::Runs(_)) || matches!(self, TokenSet::Strided { step: 1, .. })
    }

    /// Runs of a set that [`TokenSet::is_runs`].
    fn run_count(&self) -> usize {
        match self {
            TokenSet::Runs(r) => r.len(),
            TokenSet::Strided { count, .. } => usize::from(*count > 0),
        }
    }
}

impl std::fmt::Display for TokenSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSet::Runs(r) if r.is_empty() => write!(f, "∅"),
            TokenSet::Runs(r) if r.len() <= 3 => {
                let v: Vec<String> = r.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
                write!(f, "{}", v.join("+"))
            }
            TokenSet::Runs(r) => write!(f, "{} runs/{} tok", r.len(), self.len()),
            TokenSet::Strided { start, step, count } => write!(f, "{start}::{step} ×{count}"),
        }
    }
}

/// Number of kept (query, key) pairs between two token sets.
pub fn area(mask: &Mask, q: &TokenSet, k: &TokenSet) -> u64 {
    if q.is_empty() || k.is_empty() {
        return 0;
    }
    if few_run_pairs(q, k) {
        let (qr, kr) = (q.to_runs(), k.to_runs());
        let mut a = 0;
        for qa in &qr {
            for kb in &kr {
                a += mask.tile(qa.clone(), kb.clone()).area;
            }
        }
        return a;
    }
    let mut a = 0u64;
    let k_local = local_ranges(k);
    for s in mask.slices() {
        let rows = q.local_range(s.q.start, s.q.end);
        if rows.is_empty() {
            continue;
        }
        for_each_row(q, rows, |i| {
            let (lo, hi) = s.row(i);
            a += k_local(lo, hi).len() as u64;
        });
    }
    a
}

/// [`TokenSet::local_range`] of one set for many intervals: O(log runs) a call where the set's
/// own walks its runs.
fn local_ranges(set: &TokenSet) -> impl Fn(usize, usize) -> Range<usize> + '_ {
    let runs = match set {
        TokenSet::Runs(r) => r.as_slice(),
        TokenSet::Strided { .. } => &[],
    };
    // Members before each run.
    let before: Vec<usize> = runs
        .iter()
        .scan(0, |n, r| {
            let b = *n;
            *n += r.len();
            Some(b)
        })
        .collect();
    let rank_of = move |x: usize| match (set, runs.partition_point(|r| r.start < x)) {
        (TokenSet::Strided { .. }, _) => set.rank_of(x),
        (_, 0) => 0,
        (_, i) => before[i - 1] + x.min(runs[i - 1].end) - runs[i - 1].start,
    };
    move |lo: usize, hi: usize| rank_of(lo)..rank_of(hi.max(lo))
}

/// Calls `f` with the global token of each local row in `rows`.
fn for_each_row(set: &TokenSet, rows: Range<usize>, mut f: impl FnMut(usize)) {
    match set {
        TokenSet::Strided { start, step, .. } => rows.for_each(|r| f(start + r * step)),
        TokenSet::Runs(_) => {
            for run in set.local_slice(rows).to_runs() {
                run.for_each(&mut f);
            }
        }
    }
}

/// Whether [`area`] and [`sub_mask`] go run pair by run pair (each pair visits the mask's
/// slices over its query rows) rather than row by row (a binary search over the key runs per
/// query row): while both sets are runs and the pairs are few. A long prompt's queries against
/// a KV cache in 16-token pages make thousands of pairs, each over every row: 0.5 s to plan and
/// 1 s to prepare a 256k-token step on 2 ranks that way, 20 ms row by row.
fn few_run_pairs(q: &TokenSet, k: &TokenSet) -> bool {
    const MAX_RUN_PAIRS: usize = 256;
    q.is_runs() && k.is_runs() && q.run_count().saturating_mul(k.run_count()) <= MAX_RUN_PAIRS
}

/// The mask between two token sets, re-indexed to local positions (query `a` of the result is
/// the `a`-th member of `q`, key `b` the `b`-th member of `k`).
pub fn sub_mask(mask: &Mask, q: &TokenSet, k: &TokenSet) -> Result<Mask> {
    let (nq, nk) = (q.len(), k.len());
    if nq == 0 || nk == 0 {
        return Err(Error::InvalidMask("sub-mask of an empty token set".into()));
    }
    if let (Some(qs), Some(ks)) = (q.span(), k.span()) {
        if qs.end > mask.q_len() || ks.end > mask.k_len() {
            return Err(Error::InvalidMask(format!(
                "token sets reach {}x{} beyond the {}x{} mask",
                qs.end,
                ks.end,
                mask.q_len(),
                mask.k_len()
            )));
        }
    }
    let mut slices: Vec<MaskSlice> = Vec::new();
    if few_run_pairs(q, k) {
        let (qr, kr) = (q.to_runs(), k.to_runs());
        let mut qo = 0;
        for qa in &qr {
            let mut ko = 0;
            for kb in &kr {
                if mask.tile(qa.clone(), kb.clone()).area > 0 {
                    let m = mask.restrict(qa.clone(), kb.clone())?;
                    for s in m.slices() {
                        slices.push(MaskSlice::new(s.q.start + qo..s.q.end + qo, s.k.start + ko..s.k.end + ko, s.kind));
                    }
                }
                ko += kb.len();
            }
            qo += qa.len();
        }
    } else {
        let k_local = local_ranges(k);
        for s in mask.slices() {
            let rows = q.local_range(s.q.start, s.q.end);
            if rows.is_empty() {
                continue;
            }
            let mut bounds = Vec::with_capacity(rows.len());
            for_each_row(q, rows.clone(), |i| {
                let (lo, hi) = s.row(i);
                let r = k_local(lo, hi);
                bounds.push((r.start, r.end));
            });
            let base = rows.start;
            slices.extend(slices_from_rows(rows, |a| bounds[a - base]));
        }
    }
    Mask::from_slices_unchecked(nq, nk, slices)
}

/// `[r·n/parts, (r+1)·n/parts)` for each part: sizes differ by at most one.
pub fn split_even(n: usize, parts: usize) -> Vec<Range<usize>> {
    (0..parts).map(|r| even_part(n, parts, r)).collect()
}

/// Part `r` of [`split_even`]`(n, parts)`.
pub fn even_part(n: usize, parts: usize, r: usize) -> Range<usize> {
    r * n / parts..(r + 1) * n / parts
}

/// How tokens are placed on ranks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayoutKind {
    /// Rank r holds the r-th of P contiguous, near-equal pieces.
    Contiguous,
    /// 2P chunks; rank r holds chunks r and 2P−1−r.
    Zigzag,
    /// Token i on rank i mod P.
    Striped,
    /// Zig-zag inside every document of a packed batch.
    DocZigzag { lens: Vec<usize> },
    /// Zig-zag over R groups of U ranks, each group's chunks split evenly inside the group.
    GroupedZigzag { groups: usize, group_size: usize },
    /// The grouped zig-zag inside every document of a packed batch.
    GroupedDocZigzag { lens: Vec<usize>, groups: usize, group_size: usize },
    /// Arbitrary chunks chosen by a solver (mask-aware dispatch).
    Dispatched,
    /// Given by the caller: where a KV cache's tokens and the requests' queries live.
    Placed,
}

impl LayoutKind {
    /// Short name (for tables and JSON).
    pub fn name(&self) -> &'static str {
        match self {
            LayoutKind::Contiguous => "contiguous",
            LayoutKind::Zigzag => "zigzag",
            LayoutKind::Striped => "striped",
            LayoutKind::DocZigzag { .. } => "doc-zigzag",
            LayoutKind::GroupedZigzag { .. } => "grouped-zigzag",
            LayoutKind::GroupedDocZigzag { .. } => "grouped-doc-zigzag",
            LayoutKind::Dispatched => "dispatched",
            LayoutKind::Placed => "placed",
        }
    }
}

/// Which query tokens and which key tokens each rank holds. Q, dO, O, LSE, D and dQ follow
/// `q`; K, V, dK and dV follow `k`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    pub kind: LayoutKind,
    pub q: Vec<TokenSet>,
    pub k: Vec<TokenSet>,
}

fn contiguous_sets(n: usize, p: usize) -> Vec<TokenSet> {
    split_even(n, p).into_iter().map(TokenSet::range).collect()
}

/// The zig-zag family over consecutive documents of lengths `lens`: each document is cut into
/// 2·`groups` chunks, group g takes chunks g and 2·groups−1−g of every document, and each chunk
/// is split evenly over the group's `size` adjacent ranks (one document of n tokens and groups of
/// one rank: the plain zig-zag).
fn grouped_zigzag_sets(lens: &[usize], groups: usize, size: usize) -> Vec<TokenSet> {
    let mut runs: Vec<Vec<Range<usize>>> = vec![Vec::new(); groups * size];
    let mut off = 0;
    for &len in lens {
        let c = split_even(len, 2 * groups);
        for g in 0..groups {
            for chunk in [&c[g], &c[2 * groups - 1 - g]] {
                for (u, part) in split_even(chunk.len(), size).into_iter().enumerate() {
                    let start = off + chunk.start;
                    runs[g * size + u].push(start + part.start..start + part.end);
                }
            }
        }
        off += len;
    }
    runs.into_iter().map(TokenSet::from_runs).collect()
}

fn striped_sets(n: usize, p: usize) -> Vec<TokenSet> {
    (0..p)
        .map(|r| TokenSet::Strided { start: r, step: p, count: if r < n { (n - r).div_ceil(p) } else { 0 } })
        .collect()
}

impl Layout {
    pub fn world(&self) -> usize {
        self.q.len()
    }

    /// The tokens of `tensor` that `rank` holds: its key set for K, V, dK, dV, else its query set.
    pub fn tokens(&self, tensor: Tensor, rank: usize) -> &TokenSet {
        if tensor.is_kv() {
            &self.k[rank]
        } else {
            &self.q[rank]
        }
    }

    pub fn contiguous(q_len: usize, k_len: usize, p: usize) -> Layout {
        Layout { kind: LayoutKind::Contiguous, q: contiguous_sets(q_len, p), k: contiguous_sets(k_len, p) }
    }

    pub fn zigzag(q_len: usize, k_len: usize, p: usize) -> Layout {
        Layout {
            kind: LayoutKind::Zigzag,
            q: grouped_zigzag_sets(&[q_len], p, 1),
            k: grouped_zigzag_sets(&[k_len], p, 1),
        }
    }

    pub fn striped(q_len: usize, k_len: usize, p: usize) -> Layout {
        Layout { kind: LayoutKind::Striped, q: striped_sets(q_len, p), k: striped_sets(k_len, p) }
    }

    /// Zig-zag over `groups` groups of `group_size` adjacent ranks (the hybrid layout).
    pub fn grouped_zigzag(q_len: usize, k_len: usize, groups: usize, group_size: usize) -> Layout {
        Layout {
            kind: LayoutKind::GroupedZigzag { groups, group_size },
            q: grouped_zigzag_sets(&[q_len], groups, group_size),
            k: grouped_zigzag_sets(&[k_len], groups, group_size),
        }
    }

    /// Document-aware zig-zag for a packed batch (self-attention): every document is cut into
    /// 2P chunks and rank r holds chunks r and 2P−1−r of each, so every document is balanced
    /// on its own.
    pub fn doc_zigzag(lens: &[usize], p: usize) -> Layout {
        let sets = grouped_zigzag_sets(lens, p, 1);
        Layout { kind: LayoutKind::DocZigzag { lens: lens.to_vec() }, q: sets.clone(), k: sets }
    }

    /// The hybrid layout inside every document of a packed batch: each document cut into
    /// 2·`groups` chunks as [`Layout::doc_zigzag`] cuts it for ranks, each group's chunks split
    /// over its `group_size` ranks.
    pub fn grouped_doc_zigzag(lens: &[usize], groups: usize, group_size: usize) -> Layout {
        let sets = grouped_zigzag_sets(lens, groups, group_size);
        Layout {
            kind: LayoutKind::GroupedDocZigzag { lens: lens.to_vec(), groups, group_size },
            q: sets.clone(),
            k: sets,
        }
    }

    /// Checks that `q` and `k` each partition `0..q_len` / `0..k_len`.
    pub fn validate(&self, q_len: usize, k_len: usize) -> Result<()> {
        for (sets, n, what) in [(&self.q, q_len, "query"), (&self.k, k_len, "key")] {
            let total: usize = sets.iter().map(|s| s.len()).sum();
            let union = TokenSet::union(sets.iter());
            if total != n || union != TokenSet::range(0..n) {
                return Err(Error::invalid(
                    "layout",
                    format!("{:?} does not partition the {n} {what} tokens", self.kind),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::DocKind;

    fn members(s: &TokenSet) -> Vec<usize> {
        s.to_runs().into_iter().flatten().collect()
    }

    #[test]
    fn layouts_partition() {
        for n in [1usize, 7, 37, 64, 70] {
            for p in [1usize, 2, 3, 4, 8] {
                Layout::contiguous(n, n, p).validate(n, n).unwrap();
                Layout::zigzag(n, n, p).validate(n, n).unwrap();
                Layout::striped(n, n, p).validate(n, n).unwrap();
                if p % 2 == 0 {
                    Layout::grouped_zigzag(n, n, p / 2, 2).validate(n, n).unwrap();
                }
            }
        }
        let l = Layout::doc_zigzag(&[10, 3, 24], 4);
        l.validate(37, 37).unwrap();
        Layout::grouped_doc_zigzag(&[10, 3, 24], 2, 2).validate(37, 37).unwrap();
        assert_eq!(members(&Layout::zigzag(16, 16, 4).q[1]), vec![2, 3, 12, 13]);
        // Groups of 2 over 2 groups: group 0 takes chunks 0 and 3 of 4, its ranks half of each.
        let hybrid = Layout::grouped_zigzag(16, 16, 2, 2);
        assert_eq!(members(&hybrid.q[0]), vec![0, 1, 12, 13]);
        assert_eq!(members(&hybrid.q[3]), vec![6, 7, 10, 11]);
        // Inside documents: every document cut alike; one document is the plain layout.
        let docs = Layout::grouped_doc_zigzag(&[8, 16], 2, 2);
        assert_eq!(members(&docs.q[0]), vec![0, 6, 8, 9, 20, 21]);
        assert_eq!(Layout::grouped_doc_zigzag(&[16], 2, 2).q, hybrid.q);
        assert_eq!(Layout::grouped_doc_zigzag(&[10, 3, 24], 4, 1).q, l.q);
        assert_eq!(members(&Layout::striped(10, 10, 4).q[1]), vec![1, 5, 9]);
    }

    #[test]
    fn ranks_and_pieces() {
        let s = TokenSet::from_runs(vec![2..5, 8..10]);
        assert_eq!(s.rank_of(0), 0);
        assert_eq!(s.rank_of(4), 2);
        assert_eq!(s.rank_of(9), 4);
        assert_eq!(s.rank_of(100), 5);
        let st = TokenSet::Strided { start: 1, step: 3, count: 4 }; // 1 4 7 10
        assert_eq!(st.local_range(2, 8), 1..3);
        assert_eq!(members(&st.local_slice(1..3)), vec![4, 7]);
        let t = TokenSet::range(0..12);
        assert_eq!(st.pieces_into(&t), vec![(0, 1, 1), (1, 4, 1), (2, 7, 1), (3, 10, 1)]);
        assert_eq!(s.pieces_into(&t), vec![(0, 2, 3), (3, 8, 2)]);
        assert!(s.is_subset_of(&t));
        assert!(!t.is_subset_of(&s));
        assert_eq!(members(&s.local_slice(2..4)), vec![4, 8]);
        assert_eq!(members(&s.intersect(&TokenSet::from_runs(vec![0..3, 4..9]))), vec![2, 4, 8]);
        assert_eq!(members(&st.intersect(&TokenSet::range(3..8))), vec![4, 7]);
    }

    #[test]
    fn sub_masks_match_dense() {
        let masks = [
            Mask::causal(37, 37).unwrap(),
            Mask::sliding_window(37, 37, Some(5), Some(0)).unwrap(),
            Mask::documents(&[10, 3, 24], DocKind::Causal).unwrap(),
            Mask::prefix_lm(37, 9).unwrap(),
            Mask::window_global(37, Some(3), Some(2), 4).unwrap(),
        ];
        let sets = [
            TokenSet::from_runs(vec![2..9, 20..30]),
            TokenSet::Strided { start: 1, step: 3, count: 12 },
            TokenSet::range(0..37),
            TokenSet::range(30..37),
            // One-token pages: 19 runs, so a pair with itself (361 run pairs) goes row by row.
            TokenSet::from_runs((0..37).step_by(2).map(|i| i..i + 1).collect()),
            // Two-token pages, every other one: 10 runs.
            TokenSet::from_runs((0..37).step_by(4).map(|i| i..(i + 2).min(37)).collect()),
        ];
        for m in &masks {
            for q in &sets {
                for k in &sets {
                    let sm = sub_mask(m, q, k).unwrap();
                    let (qm, km) = (members(q), members(k));
                    let mut cnt = 0;
                    for (a, &i) in qm.iter().enumerate() {
                        let kept: Vec<bool> =
                            (0..m.k_len()).map(|j| m.row_intervals(i).any(|(lo, hi)| lo <= j && j < hi)).collect();
                        for (b, &j) in km.iter().enumerate() {
                            let got = sm.row_intervals(a).any(|(lo, hi)| lo <= b && b < hi);
                            assert_eq!(got, kept[j], "q={q} k={k} a={a} b={b}");
                            cnt += kept[j] as u64;
                        }
                    }
                    assert_eq!(area(m, q, k), cnt);
                    assert_eq!(sm.area(), cnt);
                }
            }
        }
    }
}
