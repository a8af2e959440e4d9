//! Decode attention: a few query rows per request against that request's KV cache, in a paged
//! or contiguous cache, split over the workers (GPU blocks, CPU threads) of one device.
//!
//! * [`PagedLayout`]: K and V caches, each `[pages, page_size, kv_heads, head_dim]`; request
//!   `b`'s token `t` is in page `page_table[b][t / page_size]`, slot `t % page_size`. A
//!   contiguous cache `[batch, capacity, kv_heads, head_dim]` is the case `page_size =
//!   capacity` with request `b` in page `b` ([`PagedLayout::contiguous`]).
//! * [`DecodeShape`]: the step's queries `[batch, q_rows, heads, head_dim]` (1–16 rows per
//!   request: plain decode, speculative and chunked steps), output O of the same layout and LSE
//!   `[batch, heads, q_rows]` in f32, **natural log**.
//! * [`DecodeSplit`]: the stream-K schedule (Lean Attention). A *segment* is the work of one
//!   (request, KV head, block of [`DECODE_BLOCK_ROWS`] query rows): the query heads that share a
//!   KV head are packed into one block, so each K/V tile is read once for all of them. The
//!   segments' tiles of [`DECODE_TILE`] keys are laid end to end and cut into equal shares, one
//!   per worker; a segment cut between workers yields partial (O, LSE) pieces merged exactly by
//!   LSE. It depends only on the lengths, so one step computes it once for every layer.
//!
//! With `causal`, query row `i` of `s` sits at position `len - s + i` of its request (the new
//! tokens are the last ones of the cache) and sees keys `0..=len - s + i`; rows that see no key
//! have O = 0 and LSE = −inf.

use crate::{AttnOptions, Error, Result};
use std::fmt;

/// Keys per tile of the CPU's split. (The GPU kernel splits the same way in tiles of its own K/V
/// tile size, 64 or 128 keys by head dim, planned on the device.)
pub const DECODE_TILE: usize = 64;
/// Query rows per block: the query heads of one KV head times the rows of one request, in
/// blocks of this many (one MMA tile).
pub const DECODE_BLOCK_ROWS: usize = 16;
/// The most query rows per request a decode step takes.
pub const MAX_DECODE_ROWS: usize = 16;

/// Layout of a paged KV cache: K and V each `[pages, page_size, kv_heads, head_dim]`, rows of
/// `head_dim` contiguous elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PagedLayout {
    pub pages: usize,
    pub page_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PagedLayout {
    /// A layout, checked: every dimension positive.
    pub fn new(pages: usize, page_size: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        for (v, what) in [(pages, "pages"), (page_size, "page size"), (kv_heads, "KV heads"), (head_dim, "head dim")] {
            if v == 0 {
                return Err(Error::ZeroDim { what });
            }
        }
        Ok(PagedLayout { pages, page_size, kv_heads, head_dim })
    }

    /// A contiguous cache `[batch, capacity, kv_heads, head_dim]`: one page per request, its
    /// page table `[[0], [1], ...]` ([`contiguous_page_table`]).
    pub fn contiguous(batch: usize, capacity: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        Self::new(batch, capacity, kv_heads, head_dim)
    }

    /// Elements of one of the K and V caches.
    pub fn elems(&self) -> usize {
        self.pages * self.page_size * self.kv_heads * self.head_dim
    }

    /// Element offset of (page, slot, KV head).
    pub fn offset(&self, page: usize, slot: usize, kv_head: usize) -> usize {
        ((page * self.page_size + slot) * self.kv_heads + kv_head) * self.head_dim
    }
}

/// The page table of a contiguous cache of `batch` requests: request `b` is page `b`.
pub fn contiguous_page_table(batch: usize) -> Vec<i32> {
    (0..batch as i32).collect()
}

/// The queries of one decode step: `[batch, q_rows, heads, head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeShape {
    pub batch: usize,
    pub q_rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl DecodeShape {
    /// A shape, checked: dimensions positive, heads a multiple of KV heads, at most
    /// [`MAX_DECODE_ROWS`] query rows (longer prompts are a prefill: `Attention`).
    pub fn new(batch: usize, q_rows: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        for (v, what) in
            [(batch, "batch"), (q_rows, "query rows"), (heads, "heads"), (kv_heads, "KV heads"), (head_dim, "head dim")]
        {
            if v == 0 {
                return Err(Error::ZeroDim { what });
            }
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(Error::HeadsNotDivisible { heads, kv_heads });
        }
        if q_rows > MAX_DECODE_ROWS {
            return Err(Error::invalid(
                "query rows",
                format!("{q_rows} per request; decode takes 1 to {MAX_DECODE_ROWS} (run longer chunks as a prefill)"),
            ));
        }
        Ok(DecodeShape { batch, q_rows, heads, kv_heads, head_dim })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    /// Query (and output) elements.
    pub fn q_elems(&self) -> usize {
        self.batch * self.q_rows * self.heads * self.head_dim
    }
    /// LSE elements, `[batch, heads, q_rows]`.
    pub fn lse_elems(&self) -> usize {
        self.batch * self.heads * self.q_rows
    }
    /// Row blocks per (request, KV head): `group × q_rows` rows in blocks of
    /// [`DECODE_BLOCK_ROWS`]. Row `r` of a KV head's rows is query row `r / group` of query head
    /// `kv_head × group + r % group`.
    pub fn row_blocks(&self) -> usize {
        (self.group() * self.q_rows).div_ceil(DECODE_BLOCK_ROWS)
    }
    /// Segments per request (KV heads × row blocks).
    pub fn segments_per_request(&self) -> usize {
        self.kv_heads * self.row_blocks()
    }

    /// Checks that queries (or outputs) of `len` elements fit this shape.
    pub fn check_q(&self, name: &str, len: usize) -> Result<()> {
        if len != self.q_elems() {
            return Err(Error::ShapeMismatch {
                tensor: name.into(),
                expected: format!(
                    "{} elements ([{}, {}, {}, {}])",
                    self.q_elems(),
                    self.batch,
                    self.q_rows,
                    self.heads,
                    self.head_dim
                ),
                got: len.to_string(),
            });
        }
        Ok(())
    }

    /// Checks that a cache layout, page table `[batch, max_pages]` (row-major, `max_pages` =
    /// `table.len() / batch`) and key lengths per request (new tokens included) belong together:
    /// head counts and dims agree, every length fits its table row, every page a length reaches
    /// exists.
    pub fn check_cache(&self, layout: &PagedLayout, table: &[i32], lengths: &[usize]) -> Result<()> {
        if layout.kv_heads != self.kv_heads || layout.head_dim != self.head_dim {
            return Err(Error::ShapeMismatch {
                tensor: "KV cache".into(),
                expected: format!("{} KV heads of dim {}", self.kv_heads, self.head_dim),
                got: format!("{} KV heads of dim {}", layout.kv_heads, layout.head_dim),
            });
        }
        if lengths.len() != self.batch {
            return Err(Error::ShapeMismatch {
                tensor: "cache lengths".into(),
                expected: format!("{} (one per request)", self.batch),
                got: lengths.len().to_string(),
            });
        }
        if table.is_empty() || !table.len().is_multiple_of(self.batch) {
            return Err(Error::ShapeMismatch {
                tensor: "page table".into(),
                expected: format!("[{}, max_pages] with max_pages ≥ 1", self.batch),
                got: format!("{} entries", table.len()),
            });
        }
        let max_pages = table.len() / self.batch;
        for (b, &len) in lengths.iter().enumerate() {
            let used = len.div_ceil(layout.page_size);
            if used > max_pages {
                return Err(Error::invalid(
                    "cache lengths",
                    format!(
                        "request {b} has {len} tokens, more than its {max_pages} pages of {} hold",
                        layout.page_size
                    ),
                ));
            }
            for (i, &p) in table[b * max_pages..b * max_pages + used].iter().enumerate() {
                if p < 0 || p as usize >= layout.pages {
                    return Err(Error::invalid(
                        "page table",
                        format!("request {b}'s page {i} is {p}; the cache has pages 0..{}", layout.pages),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A paged KV cache as a decode step reads it: K and V `[pages, page_size, kv_heads, head_dim]`,
/// the page table `[batch, max_pages]` (row-major) and each request's key count.
#[derive(Debug, Clone, Copy)]
pub struct PagedCache<'a, T> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub layout: PagedLayout,
    pub page_table: &'a [i32],
    pub lengths: &'a [usize],
}

impl<T> PagedCache<'_, T> {
    /// Checks the cache against a step of `shape`: the caches' sizes, then
    /// [`DecodeShape::check_cache`].
    pub fn check(&self, shape: &DecodeShape) -> Result<()> {
        let l = &self.layout;
        for (name, got, want) in [("k cache", self.k.len(), l.elems()), ("v cache", self.v.len(), l.elems())] {
            if got != want {
                return Err(Error::ShapeMismatch {
                    tensor: name.into(),
                    expected: format!("{want} elements"),
                    got: got.to_string(),
                });
            }
        }
        shape.check_cache(l, self.page_table, self.lengths)
    }

    /// Page-table entries per request.
    pub fn max_pages(&self) -> usize {
        self.page_table.len() / self.lengths.len().max(1)
    }

    /// Request `b`'s token `t`, KV head `h`, in `cache` (`self.k` or `self.v`).
    pub fn row<'c>(&self, cache: &'c [T], b: usize, t: usize, h: usize) -> &'c [T] {
        let page = self.page_table[b * self.max_pages() + t / self.layout.page_size] as usize;
        let off = self.layout.offset(page, t % self.layout.page_size, h);
        &cache[off..off + self.layout.head_dim]
    }
}

/// Options of a decode step: the softmax scale (`None`: `1/sqrt(head_dim)`) and whether query
/// rows see only keys up to their own position (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeOptions {
    pub attn: AttnOptions,
    pub causal: bool,
}

/// The stream-K split of one decode step (see the module docs). Segment `s` is (request
/// `s / S`, KV head and row block `s % S`), `S` = [`DecodeShape::segments_per_request`]; a
/// request of `len` keys has `max(1, ceil(len / tile))` tiles in each of its segments (a request
/// without keys still gets its rows written).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeSplit {
    /// Prefix sums of tiles per request (`batch + 1` entries).
    cu_tiles: Vec<u64>,
    segments_per_request: usize,
    workers: usize,
    tile: usize,
}

/// One worker's share of one segment: global tiles `tiles`, and where its partial goes when
/// the segment has other pieces (`slot`: `2 × worker`, plus one unless this is the worker's
/// first segment; `None` when the piece is the whole segment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub segment: usize,
    pub tiles: std::ops::Range<u64>,
    pub slot: Option<usize>,
}

impl DecodeSplit {
    /// The split of requests of `lengths` keys over `workers` workers.
    pub fn new(lengths: &[usize], shape: &DecodeShape, workers: usize) -> Result<Self> {
        if workers == 0 {
            return Err(Error::ZeroDim { what: "workers" });
        }
        if lengths.len() != shape.batch {
            return Err(Error::ShapeMismatch {
                tensor: "cache lengths".into(),
                expected: format!("{} (one per request)", shape.batch),
                got: lengths.len().to_string(),
            });
        }
        let mut cu_tiles = Vec::with_capacity(lengths.len() + 1);
        cu_tiles.push(0u64);
        for &len in lengths {
            let last = cu_tiles[cu_tiles.len() - 1];
            cu_tiles.push(last + len.div_ceil(DECODE_TILE).max(1) as u64);
        }
        // Fewer tiles than workers: one tile each for the first ones (no share is empty). Equal
        // segments no more than the workers: the same whole number of workers each, so that no
        // worker straddles two segments (on a GPU its pipeline would restart mid-share).
        let spr = shape.segments_per_request() as u64;
        let (total, segments) = (cu_tiles[lengths.len()] * spr, (lengths.len() as u64) * spr);
        let equal = cu_tiles.windows(2).all(|w| w[1] - w[0] == cu_tiles[1]);
        let workers = if total <= workers as u64 {
            total as usize
        } else if equal && segments <= workers as u64 {
            (workers as u64 / segments * segments) as usize
        } else {
            workers
        };
        Ok(DecodeSplit { cu_tiles, segments_per_request: shape.segments_per_request(), workers, tile: DECODE_TILE })
    }

    /// Workers with a share: the number asked for; the number of tiles if that is fewer; for
    /// segments of equal length no more than the workers, the most that give each segment the
    /// same whole number of workers.
    pub fn workers(&self) -> usize {
        self.workers
    }
    pub fn segments(&self) -> usize {
        (self.cu_tiles.len() - 1) * self.segments_per_request
    }
    /// Tiles of all segments.
    pub fn total_tiles(&self) -> u64 {
        self.cu_tiles.last().copied().unwrap_or(0) * self.segments_per_request as u64
    }
    /// Partial slots a step needs (two per worker).
    pub fn slots(&self) -> usize {
        2 * self.workers
    }

    /// Global tiles `[start, end)` of segment `s`.
    pub fn segment_tiles(&self, s: usize) -> std::ops::Range<u64> {
        let (b, j) = (s / self.segments_per_request, (s % self.segments_per_request) as u64);
        let n = self.cu_tiles[b + 1] - self.cu_tiles[b];
        let start = self.cu_tiles[b] * self.segments_per_request as u64 + j * n;
        start..start + n
    }

    /// The segment of global tile `t` (`t < total_tiles()`).
    pub fn segment_of(&self, t: u64) -> usize {
        let spr = self.segments_per_request as u64;
        // The request: the last b with cu_tiles[b] * spr <= t.
        let b = self.cu_tiles.partition_point(|&c| c * spr <= t) - 1;
        let n = self.cu_tiles[b + 1] - self.cu_tiles[b];
        b * self.segments_per_request + ((t - self.cu_tiles[b] * spr) / n) as usize
    }

    /// Global tiles `[start, end)` of worker `c`: the `c`-th of equal shares.
    pub fn worker_tiles(&self, c: usize) -> std::ops::Range<u64> {
        let w = self.total_tiles() as u128;
        let share = |c: usize| (c as u128 * w / self.workers as u128) as u64;
        share(c)..share(c + 1)
    }

    /// The worker whose share holds global tile `t`.
    pub fn worker_of(&self, t: u64) -> usize {
        ((((t as u128) + 1) * self.workers as u128 - 1) / self.total_tiles() as u128) as usize
    }

    /// Worker `c`'s pieces, in order.
    pub fn pieces(&self, c: usize) -> Vec<Piece> {
        let range = self.worker_tiles(c);
        let mut out = Vec::new();
        let mut t = range.start;
        while t < range.end {
            let segment = self.segment_of(t);
            let seg = self.segment_tiles(segment);
            let end = seg.end.min(range.end);
            let whole = seg.start >= range.start && seg.end <= range.end;
            let slot = (!whole).then_some(2 * c + usize::from(!out.is_empty()));
            out.push(Piece { segment, tiles: t..end, slot });
            t = end;
        }
        out
    }

    /// The slots of segment `s`'s pieces, in key order (empty when one worker does it all).
    pub fn segment_slots(&self, s: usize) -> Vec<usize> {
        let seg = self.segment_tiles(s);
        let (c0, c1) = (self.worker_of(seg.start), self.worker_of(seg.end - 1));
        if c0 == c1 {
            return Vec::new();
        }
        (c0..=c1)
            .map(|c| {
                let first = self.segment_of(self.worker_tiles(c).start);
                2 * c + usize::from(first != s)
            })
            .collect()
    }

    /// Prefix sums of tiles per request, as the GPU kernels take them.
    pub fn cu_tiles(&self) -> &[u64] {
        &self.cu_tiles
    }
}

impl fmt::Display for DecodeSplit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let segments = self.segments();
        let split = (0..segments).filter(|&s| !self.segment_slots(s).is_empty()).count();
        let most = (0..segments).map(|s| self.segment_slots(s).len().max(1)).max().unwrap_or(0);
        write!(
            f,
            "decode split: {} tiles of {} keys in {} segments over {} workers ({} to {} tiles each); \
             {} segments split, at most {} pieces",
            self.total_tiles(),
            self.tile,
            segments,
            self.workers,
            self.total_tiles() / self.workers as u64,
            self.total_tiles().div_ceil(self.workers as u64),
            split,
            most
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covers_exactly(split: &DecodeSplit) {
        // Every tile in exactly one piece; pieces of a segment are contiguous and agree with
        // segment_slots; at most two partial slots per worker.
        let mut seen = vec![0u8; split.total_tiles() as usize];
        let mut slots_of: Vec<Vec<usize>> = vec![Vec::new(); split.segments()];
        for c in 0..split.workers() {
            let ps = split.pieces(c);
            assert!(ps.iter().filter(|p| p.slot.is_some()).count() <= 2);
            for p in ps {
                let seg = split.segment_tiles(p.segment);
                assert!(seg.start <= p.tiles.start && p.tiles.end <= seg.end);
                for t in p.tiles.clone() {
                    seen[t as usize] += 1;
                    assert_eq!(split.segment_of(t), p.segment);
                    assert_eq!(split.worker_of(t), c);
                }
                if let Some(s) = p.slot {
                    assert!(s < split.slots());
                    slots_of[p.segment].push(s);
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
        for (s, slots) in slots_of.iter().enumerate() {
            assert_eq!(&split.segment_slots(s), slots, "segment {s}");
            assert_ne!(slots.len(), 1);
        }
    }

    #[test]
    fn split_covers_every_tile_once() {
        let shape = DecodeShape::new(5, 3, 32, 8, 128).unwrap();
        assert_eq!(shape.row_blocks(), 1);
        for workers in [1, 2, 7, 132, 1000] {
            let split = DecodeSplit::new(&[0, 1, 64, 65, 200_000], &shape, workers).unwrap();
            assert_eq!(split.total_tiles(), (1 + 1 + 1 + 2 + 3125) * 8);
            covers_exactly(&split);
        }
        let eight_rows = DecodeShape::new(2, 16, 8, 1, 64).unwrap();
        assert_eq!(eight_rows.row_blocks(), 8);
        covers_exactly(&DecodeSplit::new(&[3000, 17], &eight_rows, 13).unwrap());
    }

    #[test]
    fn shares_are_equal() {
        let shape = DecodeShape::new(1, 1, 32, 8, 128).unwrap();
        let split = DecodeSplit::new(&[1 << 20], &shape, 132).unwrap();
        // 8 equal segments: 128 of 132 workers, 16 whole ones per segment.
        assert_eq!(split.workers(), 128);
        let sizes: Vec<u64> = (0..128).map(|c| split.worker_tiles(c).end - split.worker_tiles(c).start).collect();
        assert!(sizes.iter().all(|&n| n == 1024));
        assert!((0..128).all(|c| split.pieces(c).len() == 1));
        assert_eq!(
            split.to_string(),
            "decode split: 131072 tiles of 64 keys in 8 segments over 128 workers (1024 to 1024 tiles each); \
             8 segments split, at most 16 pieces"
        );
        // Ragged: every worker, shares within a tile of each other.
        let ragged = DecodeSplit::new(&[5000, 70_000], &DecodeShape::new(2, 1, 32, 8, 128).unwrap(), 132).unwrap();
        assert_eq!(ragged.workers(), 132);
        let sizes: Vec<u64> = (0..132).map(|c| ragged.worker_tiles(c).end - ragged.worker_tiles(c).start).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        // Ragged whose first request times the batch is the total (2 + 1 + 3 tiles = 3 x 2): every
        // worker asked for, not a multiple of the 3 segments.
        let three = DecodeShape::new(3, 1, 8, 1, 128).unwrap();
        for workers in [4, 5] {
            let split = DecodeSplit::new(&[128, 64, 192], &three, workers).unwrap();
            assert_eq!(split.workers(), workers);
            covers_exactly(&split);
        }
    }

    #[test]
    fn checks_say_what_is_wrong() {
        assert_eq!(DecodeShape::new(1, 1, 6, 4, 64), Err(Error::HeadsNotDivisible { heads: 6, kv_heads: 4 }));
        assert!(matches!(DecodeShape::new(1, 17, 4, 4, 64), Err(Error::InvalidArgument { .. })));
        assert_eq!(PagedLayout::new(4, 0, 1, 64), Err(Error::ZeroDim { what: "page size" }));
        let shape = DecodeShape::new(2, 1, 4, 2, 64).unwrap();
        let layout = PagedLayout::new(4, 16, 2, 64).unwrap();
        let table = [0, 1, 2, 3];
        assert!(shape.check_cache(&layout, &table, &[32, 17]).is_ok());
        let err = shape.check_cache(&layout, &table, &[33, 1]).unwrap_err();
        assert_eq!(err.to_string(), "invalid cache lengths: request 0 has 33 tokens, more than its 2 pages of 16 hold");
        let err = shape.check_cache(&layout, &[0, 9, 2, 3], &[20, 1]).unwrap_err();
        assert_eq!(err.to_string(), "invalid page table: request 0's page 1 is 9; the cache has pages 0..4");
        assert!(shape.check_cache(&layout, &[0, 9, 2, 3], &[16, 1]).is_ok()); // page 1 unused
        assert!(matches!(shape.check_cache(&layout, &table[..3], &[1, 1]), Err(Error::ShapeMismatch { .. })));
        let other = PagedLayout::new(4, 16, 1, 64).unwrap();
        assert!(matches!(shape.check_cache(&other, &table, &[1, 1]), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(DecodeSplit::new(&[1], &shape, 0), Err(Error::ZeroDim { .. })));
    }
}
