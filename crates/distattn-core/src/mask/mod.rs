//! Attention masks as data.
//!
//! A [`Mask`] over a `q_len × k_len` score matrix is a list of disjoint [`MaskSlice`]s, each a
//! (query range, key range, [`SliceKind`]) triple — the representation used by MagiAttention and
//! the long-context attention benchmark. Every row of a slice keeps one contiguous run of keys,
//! so a mask answers in closed form, for any rectangle of the score matrix, how many
//! (query, key) pairs it keeps ([`Mask::tile`]) and whether that rectangle is
//! [`TileClass::Full`], [`TileClass::Partial`] or [`TileClass::Empty`]. Kernels skip empty tiles
//! and apply no mask arithmetic on full ones; planners balance by area. Nothing here ever builds
//! a dense `q_len × k_len` matrix.

mod build;
mod random;
mod spec;

pub use build::DocKind;
pub use random::long_tailed_doc_lens;
pub use spec::MaskSpec;

use crate::{Error, Result};
use std::ops::Range;

/// How the kept keys of each row of a slice are placed.
///
/// With `t` the row index inside the slice, `[ks, ke)` its key range and
/// `off = (ke - ks) - (q rows)` the offset of the bottom-right-aligned diagonal:
///
/// | kind | row `t` keeps keys |
/// |---|---|
/// | `Full` | `[ks, ke)` |
/// | `Causal` | `[ks, ks + t + off + 1)` (bottom-right aligned, as FlashAttention) |
/// | `InverseCausal` | `[ks + t, ke)` (top-left aligned) |
/// | `BiCausal` | `[ks + t, ks + t + off + 1)` (both: a band) |
///
/// Every interval is clipped to `[ks, ke)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SliceKind {
    Full,
    Causal,
    InverseCausal,
    BiCausal,
}

impl SliceKind {
    /// Slopes (per row) of the lower and upper key bounds.
    fn slopes(self) -> (i64, i64) {
        match self {
            SliceKind::Full => (0, 0),
            SliceKind::Causal => (0, 1),
            SliceKind::InverseCausal => (1, 0),
            SliceKind::BiCausal => (1, 1),
        }
    }

    fn from_slopes(lo: i64, hi: i64) -> SliceKind {
        match (lo, hi) {
            (0, 0) => SliceKind::Full,
            (0, _) => SliceKind::Causal,
            (_, 0) => SliceKind::InverseCausal,
            _ => SliceKind::BiCausal,
        }
    }
}

/// One rectangle of the score matrix with the rule for which of its pairs are kept.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MaskSlice {
    pub q: Range<usize>,
    pub k: Range<usize>,
    pub kind: SliceKind,
}

/// Whether a tile of the score matrix keeps all, some or none of its pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TileClass {
    Empty,
    Partial,
    Full,
}

/// Class and kept-pair count of a tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TileInfo {
    pub class: TileClass,
    pub area: u64,
}

impl MaskSlice {
    pub fn new(q: Range<usize>, k: Range<usize>, kind: SliceKind) -> Self {
        MaskSlice { q, k, kind }
    }

    /// Unclamped lower and upper key bound of the slice's first row, and their slopes.
    fn bounds(&self) -> (i64, i64, i64, i64) {
        let ks = self.k.start as i64;
        let off = self.k.len() as i64 - self.q.len() as i64;
        let (sl, sh) = self.kind.slopes();
        let lo0 = ks;
        let hi0 = if sh == 1 { ks + off + 1 } else { self.k.end as i64 };
        (lo0, sl, hi0, sh)
    }

    /// Keys `[lo, hi)` kept by absolute query row `i` (which must lie in `self.q`); `lo >= hi`
    /// means none.
    pub fn row(&self, i: usize) -> (usize, usize) {
        let (lo0, sl, hi0, sh) = self.bounds();
        let t = (i - self.q.start) as i64;
        let (ks, ke) = (self.k.start as i64, self.k.end as i64);
        let lo = (lo0 + sl * t).clamp(ks, ke);
        let hi = (hi0 + sh * t).clamp(ks, ke);
        (lo as usize, hi.max(lo) as usize)
    }

    /// Cuts the slice to the rectangle `q × k`. Returns uniform segments: rows
    /// `[s, t)` whose kept keys are `[lo + sl·(i−s), hi + sh·(i−s))`, every row non-empty.
    fn segments(&self, q: &Range<usize>, k: &Range<usize>) -> Vec<Segment> {
        let r0 = self.q.start.max(q.start) as i64;
        let r1 = self.q.end.min(q.end) as i64;
        let c = self.k.start.max(k.start) as i64;
        let e = self.k.end.min(k.end) as i64;
        if r0 >= r1 || c >= e {
            return Vec::new();
        }
        let (lo0, sl, hi0, sh) = self.bounds();
        let qs = self.q.start as i64;
        let lo_at = |r: i64| lo0 + sl * (r - qs);
        let hi_at = |r: i64| hi0 + sh * (r - qs);
        // Rows where a raw bound crosses the clip edge split the range into linear pieces.
        let mut cuts = vec![r0, r1];
        if sh == 1 {
            cuts.push(e - hi0 + qs);
        }
        if sl == 1 {
            cuts.push(c - lo0 + qs);
        }
        cuts.retain(|&x| x >= r0 && x <= r1);
        cuts.sort_unstable();
        cuts.dedup();
        let mut out = Vec::new();
        for w in cuts.windows(2) {
            let (s, t) = (w[0], w[1]);
            let hi_slope = if sh == 1 && hi_at(s) < e { 1 } else { 0 };
            let lo_slope = if sl == 1 && lo_at(s) >= c { 1 } else { 0 };
            let lo_s = lo_at(s).max(c);
            let hi_s = hi_at(s).min(e);
            // g(r) = hi(r) - lo(r) is linear on [s, t); keep the rows where it is positive.
            let g0 = hi_s - lo_s;
            let dg = hi_slope - lo_slope;
            let (a, b) = positive_run(g0, dg, t - s);
            if a < b {
                out.push(Segment {
                    rows: (s + a) as usize..(s + b) as usize,
                    lo: (lo_s + lo_slope * a) as usize,
                    hi: (hi_s + hi_slope * a) as usize,
                    lo_slope,
                    hi_slope,
                });
            }
        }
        out
    }
}

/// Rows `[s, t)` of a slice cut to a rectangle: bounds linear in the row, every row non-empty.
#[derive(Debug, Clone, PartialEq)]
struct Segment {
    rows: Range<usize>,
    lo: usize,
    hi: usize,
    lo_slope: i64,
    hi_slope: i64,
}

impl Segment {
    fn area(&self) -> u64 {
        let n = self.rows.len() as i64;
        let g0 = (self.hi - self.lo) as i64;
        let dg = self.hi_slope - self.lo_slope;
        // Arithmetic series, all terms positive by construction.
        (n * g0 + dg * n * (n - 1) / 2) as u64
    }

    /// The segment as a slice; rows all non-empty, so the kind's formula reproduces it.
    fn to_slice(&self) -> MaskSlice {
        let n = self.rows.len();
        let kind = SliceKind::from_slopes(self.lo_slope, self.hi_slope);
        let k_end = if self.hi_slope == 1 { self.hi + n - 1 } else { self.hi };
        MaskSlice { q: self.rows.clone(), k: self.lo..k_end, kind }
    }
}

/// The sub-range `[a, b)` of `0..n` where `g0 + dg·t > 0` (contiguous since `g` is linear).
fn positive_run(g0: i64, dg: i64, n: i64) -> (i64, i64) {
    match dg.signum() {
        0 => {
            if g0 > 0 {
                (0, n)
            } else {
                (0, 0)
            }
        }
        1 => {
            // g0 + t > 0  <=>  t > -g0
            let a = (1 - g0).max(0).min(n);
            (a, n)
        }
        _ => {
            // g0 - t > 0  <=>  t < g0
            (0, g0.clamp(0, n))
        }
    }
}

/// Rows per bucket of the slice index.
const BUCKET: usize = 64;

/// An attention mask: disjoint slices over a `q_len × k_len` score matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Mask {
    q_len: usize,
    k_len: usize,
    slices: Vec<MaskSlice>,
    /// For each bucket of [`BUCKET`] query rows, the slices that touch it.
    index: Vec<Vec<u32>>,
}

impl Mask {
    /// Checks that this mask is `q_len x k_len` of `shape`.
    pub fn check_fits(&self, shape: &crate::AttnShape) -> Result<()> {
        if self.q_len() != shape.q_len || self.k_len() != shape.k_len {
            return Err(Error::ShapeMismatch {
                tensor: "mask".into(),
                expected: format!("{}x{} (q_len x k_len of {shape})", shape.q_len, shape.k_len),
                got: format!("{}x{}", self.q_len(), self.k_len()),
            });
        }
        Ok(())
    }

    /// A mask from explicit slices. Fails if a slice leaves the matrix, is empty, or two
    /// slices keep the same (query, key) pair.
    pub fn from_slices(q_len: usize, k_len: usize, slices: Vec<MaskSlice>) -> Result<Self> {
        if q_len == 0 || k_len == 0 {
            return Err(Error::InvalidMask("query and key lengths must be positive".into()));
        }
        if q_len.max(k_len) > crate::MAX_SEQ_LEN {
            return Err(Error::InvalidMask(format!(
                "a {q_len}x{k_len} mask is longer than the supported {} tokens",
                crate::MAX_SEQ_LEN
            )));
        }
        for s in &slices {
            if s.q.start >= s.q.end || s.k.start >= s.k.end || s.q.end > q_len || s.k.end > k_len {
                return Err(Error::InvalidMask(format!(
                    "slice q={:?} k={:?} is empty or outside the {q_len}x{k_len} matrix",
                    s.q, s.k
                )));
            }
        }
        let mask = Self::new_unchecked(q_len, k_len, slices);
        mask.check_disjoint()?;
        Ok(mask)
    }

    /// A mask from slices known to be in bounds and disjoint (re-indexed restrictions).
    pub(crate) fn from_slices_unchecked(q_len: usize, k_len: usize, slices: Vec<MaskSlice>) -> Result<Mask> {
        Ok(Self::new_unchecked(q_len, k_len, slices))
    }

    /// Builds the index; callers guarantee bounds and disjointness.
    fn new_unchecked(q_len: usize, k_len: usize, mut slices: Vec<MaskSlice>) -> Self {
        slices.retain(|s| s.q.start < s.q.end && s.k.start < s.k.end);
        slices.sort_by_key(|s| (s.q.start, s.k.start));
        let mut index = vec![Vec::new(); q_len.div_ceil(BUCKET)];
        for (id, s) in slices.iter().enumerate() {
            for bucket in &mut index[s.q.start / BUCKET..s.q.end.div_ceil(BUCKET)] {
                bucket.push(id as u32);
            }
        }
        Mask { q_len, k_len, slices, index }
    }

    fn check_disjoint(&self) -> Result<()> {
        let mut row: Vec<(usize, usize)> = Vec::new();
        for i in 0..self.q_len {
            row.clear();
            row.extend(self.row_intervals(i));
            row.sort_unstable();
            for w in row.windows(2) {
                if w[0].1 > w[1].0 {
                    return Err(Error::InvalidMask(format!(
                        "slices overlap in query row {i} (keys {:?} and {:?})",
                        w[0].0..w[0].1,
                        w[1].0..w[1].1
                    )));
                }
            }
        }
        Ok(())
    }

    pub fn q_len(&self) -> usize {
        self.q_len
    }

    pub fn k_len(&self) -> usize {
        self.k_len
    }

    pub fn slices(&self) -> &[MaskSlice] {
        &self.slices
    }

    /// Ids of the slices whose query range meets `q`.
    fn slices_meeting(&self, q: &Range<usize>) -> Vec<usize> {
        if q.start >= q.end || q.start >= self.q_len {
            return Vec::new();
        }
        let last = q.end.min(self.q_len).div_ceil(BUCKET);
        let mut ids: Vec<usize> = self.index[q.start / BUCKET..last]
            .iter()
            .flatten()
            .map(|&id| id as usize)
            .filter(|&id| {
                let s = &self.slices[id].q;
                s.start < q.end && q.start < s.end
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The key intervals kept by query row `i`, non-empty ones only.
    pub fn row_intervals(&self, i: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let bucket: &[u32] = self.index.get(i / BUCKET).map(|b| b.as_slice()).unwrap_or(&[]);
        bucket.iter().filter_map(move |&id| {
            let s = &self.slices[id as usize];
            if !s.q.contains(&i) {
                return None;
            }
            let (lo, hi) = s.row(i);
            (lo < hi).then_some((lo, hi))
        })
    }

    /// Per query row, its kept keys as one run `(first key, keys)` (`(0, 0)` for none), when
    /// every row's kept keys are one run (touching slices join); `None` otherwise. One pass over
    /// the slices' rows: meant for masks of few rows (a decode step's block).
    pub fn row_runs(&self) -> Option<Vec<(usize, usize)>> {
        let mut cuts: Vec<(usize, usize, usize)> = Vec::new();
        for s in &self.slices {
            cuts.extend(
                s.q.clone().map(|i| (i, s.row(i))).filter(|(_, (lo, hi))| lo < hi).map(|(i, (lo, hi))| (i, lo, hi)),
            );
        }
        cuts.sort_unstable();
        let mut runs = vec![(0, 0); self.q_len];
        let mut last: Option<(usize, usize)> = None; // (row, end of its run so far)
        for (i, lo, hi) in cuts {
            match last {
                Some((row, end)) if row == i => {
                    if lo != end {
                        return None;
                    }
                    runs[i].1 += hi - lo;
                }
                _ => runs[i] = (lo, hi - lo),
            }
            last = Some((i, hi));
        }
        Some(runs)
    }

    /// Number of kept (query, key) pairs in the whole matrix.
    pub fn area(&self) -> u64 {
        self.tile(0..self.q_len, 0..self.k_len).area
    }

    /// Class and area of the rectangle `q × k` (ranges are clipped to the matrix).
    pub fn tile(&self, q: Range<usize>, k: Range<usize>) -> TileInfo {
        let q = q.start.min(self.q_len)..q.end.min(self.q_len);
        let k = k.start.min(self.k_len)..k.end.min(self.k_len);
        let mut area = 0u64;
        for id in self.slices_meeting(&q) {
            area += self.slices[id].segments(&q, &k).iter().map(Segment::area).sum::<u64>();
        }
        let full = (q.len() * k.len()) as u64;
        let class = if area == 0 {
            TileClass::Empty
        } else if area == full {
            TileClass::Full
        } else {
            TileClass::Partial
        };
        TileInfo { class, area }
    }

    /// For the query rows `q`, every non-empty key tile of width `k_tile` (the last may be
    /// shorter), in key order, with its class and area.
    pub fn key_tiles(&self, q: Range<usize>, k_tile: usize) -> Vec<(Range<usize>, TileInfo)> {
        let k_tile = k_tile.max(1);
        let q = q.start.min(self.q_len)..q.end.min(self.q_len);
        let mut wanted = vec![false; self.k_len.div_ceil(k_tile)];
        for id in self.slices_meeting(&q) {
            for seg in self.slices[id].segments(&q, &(0..self.k_len)) {
                let n = seg.rows.len();
                let lo_min = seg.lo;
                let hi_max = seg.hi + if seg.hi_slope == 1 { n - 1 } else { 0 };
                for w in &mut wanted[lo_min / k_tile..hi_max.div_ceil(k_tile)] {
                    *w = true;
                }
            }
        }
        wanted
            .iter()
            .enumerate()
            .filter(|(_, &w)| w)
            .filter_map(|(t, _)| {
                let k = t * k_tile..((t + 1) * k_tile).min(self.k_len);
                let info = self.tile(q.clone(), k.clone());
                (info.class != TileClass::Empty).then_some((k, info))
            })
            .collect()
    }

    /// Writes the kept pairs of the rectangle `q × k` into `out` (row-major,
    /// `q.len() × k.len()`, `true` = kept). For partial tiles; full tiles need no mask.
    pub fn fill_tile(&self, q: Range<usize>, k: Range<usize>, out: &mut [bool]) {
        let width = k.len();
        out[..q.len() * width].fill(false);
        for id in self.slices_meeting(&q) {
            for seg in self.slices[id].segments(&q, &k) {
                for (t, i) in seg.rows.clone().enumerate() {
                    let lo = (seg.lo as i64 + seg.lo_slope * t as i64) as usize - k.start;
                    let hi = (seg.hi as i64 + seg.hi_slope * t as i64) as usize - k.start;
                    let row = (i - q.start) * width;
                    out[row + lo..row + hi].fill(true);
                }
            }
        }
    }

    /// The sub-mask of the rectangle `q × k`, re-indexed so that `q.start` and `k.start`
    /// become 0. Used to hand a block of a distributed plan to a kernel.
    pub fn restrict(&self, q: Range<usize>, k: Range<usize>) -> Result<Mask> {
        if q.start >= q.end || k.start >= k.end || q.end > self.q_len || k.end > self.k_len {
            return Err(Error::InvalidMask(format!(
                "restriction q={q:?} k={k:?} is empty or outside the {}x{} mask",
                self.q_len, self.k_len
            )));
        }
        let mut slices = Vec::new();
        for id in self.slices_meeting(&q) {
            for seg in self.slices[id].segments(&q, &k) {
                let mut s = seg.to_slice();
                s.q = s.q.start - q.start..s.q.end - q.start;
                s.k = s.k.start - k.start..s.k.end - k.start;
                slices.push(s);
            }
        }
        Ok(Mask::new_unchecked(q.len(), k.len(), merge_adjacent(slices)))
    }

    /// This mask with only the query rows `rows` kept, the others emptied (same shape): the
    /// part of a block that one of two launches over the same buffers computes.
    pub fn keep_rows(&self, rows: Range<usize>) -> Result<Mask> {
        let part = self.restrict(rows.clone(), 0..self.k_len)?;
        let slices = part
            .slices
            .into_iter()
            .map(|s| MaskSlice { q: s.q.start + rows.start..s.q.end + rows.start, ..s })
            .collect();
        Ok(Mask::new_unchecked(self.q_len, self.k_len, slices))
    }

    /// Lengths of the consecutive diagonal blocks that no slice crosses, when the mask is square
    /// and has at least two (packed documents, however they were built); `None` otherwise.
    /// Every kept pair lies inside one block, so a planner may balance each block on its own.
    /// Rows and keys that no slice touches join the block before them (the first block, before
    /// any).
    pub fn diagonal_blocks(&self) -> Option<Vec<usize>> {
        if self.q_len != self.k_len {
            return None;
        }
        let mut spans: Vec<Range<usize>> =
            self.slices.iter().map(|s| s.q.start.min(s.k.start)..s.q.end.max(s.k.end)).collect();
        spans.sort_by_key(|s| s.start);
        let mut starts = vec![0];
        let mut reach = 0;
        for s in spans {
            if s.start >= reach && s.start > 0 {
                starts.push(s.start);
            }
            reach = reach.max(s.end);
        }
        if starts.len() < 2 {
            return None;
        }
        starts.push(self.q_len);
        Some(starts.windows(2).map(|w| w[1] - w[0]).collect())
    }
}

/// Compresses a row-wise description into slices: rows `q`, each keeping keys
/// `f(i) = [lo, hi)` (`lo >= hi` for none). Consecutive rows whose bounds move by 0 or 1 per
/// row become one slice.
pub(crate) fn slices_from_rows(q: Range<usize>, f: impl Fn(usize) -> (usize, usize)) -> Vec<MaskSlice> {
    let mut out = Vec::new();
    let mut run: Option<Segment> = None;
    let close = |run: &mut Option<Segment>, out: &mut Vec<MaskSlice>| {
        if let Some(seg) = run.take() {
            out.push(seg.to_slice());
        }
    };
    for i in q {
        let (lo, hi) = f(i);
        if lo >= hi {
            close(&mut run, &mut out);
            continue;
        }
        if let Some(seg) = run.as_mut() {
            let t = (i - seg.rows.start) as i64;
            let n = seg.rows.len();
            if n == 1 {
                let (dl, dh) = (lo as i64 - seg.lo as i64, hi as i64 - seg.hi as i64);
                if (0..=1).contains(&dl) && (0..=1).contains(&dh) {
                    seg.lo_slope = dl;
                    seg.hi_slope = dh;
                    seg.rows.end = i + 1;
                    continue;
                }
            } else if lo as i64 == seg.lo as i64 + seg.lo_slope * t && hi as i64 == seg.hi as i64 + seg.hi_slope * t {
                seg.rows.end = i + 1;
                continue;
            }
        }
        close(&mut run, &mut out);
        run = Some(Segment { rows: i..i + 1, lo, hi, lo_slope: 0, hi_slope: 0 });
    }
    close(&mut run, &mut out);
    out
}

/// Joins full slices that continue each other down the rows (same key range), which
/// restriction of block masks produces often.
fn merge_adjacent(mut slices: Vec<MaskSlice>) -> Vec<MaskSlice> {
    slices.sort_by_key(|s| (s.k.start, s.k.end, s.q.start));
    let mut out: Vec<MaskSlice> = Vec::with_capacity(slices.len());
    for s in slices {
        if let Some(last) = out.last_mut() {
            if last.kind == SliceKind::Full && s.kind == SliceKind::Full && last.k == s.k && last.q.end == s.q.start {
                last.q.end = s.q.end;
                continue;
            }
        }
        out.push(s);
    }
    out
}

#[cfg(test)]
mod tests;
