//! Host-side tile lists handed to the kernels.
//!
//! For a tiling of the score matrix into `bm × bn` tiles, [`TilePlan::by_query`] lists, for each
//! query tile, its non-empty key tiles (from [`Mask::key_tiles`]) with a bitmask offset for
//! partial tiles and `-1` for full ones; [`TilePlan::by_key`] is the same set of tiles listed per
//! key tile (for the dK/dV kernel). Tiles that stick out of the matrix (the last query or key
//! tile of an awkward length) are always partial, so the kernels never test bounds in the
//! softmax: out-of-range rows and columns are masked by their zero bits.

use distattn_core::{Error, Mask, Result, TileClass};

/// Tile lists in CSR form plus the bitmasks of partial tiles.
#[derive(Debug, Clone, PartialEq)]
pub struct TilePlan {
    pub bm: usize,
    pub bn: usize,
    /// Number of tiles along the listed axis (query tiles for `by_query`, key tiles for `by_key`).
    pub n_major: usize,
    /// `ptr[i]..ptr[i+1]` are the entries of major tile `i`.
    pub ptr: Vec<i32>,
    /// Per entry: `[other-axis tile, bitmask offset in u32 words or -1]`.
    pub tiles: Vec<[i32; 2]>,
    /// Bitmasks, `bm` rows (query rows) of [`words_per_row`](Self::words_per_row) words each
    /// (bit = key column).
    pub bits: Vec<u32>,
    /// Number of full and partial tiles.
    pub n_full: usize,
    pub n_partial: usize,
}

impl TilePlan {
    /// Per query tile: the key tiles it meets.
    pub fn by_query(mask: &Mask, bm: usize, bn: usize) -> Result<TilePlan> {
        // (Key tiles of whole 16-key MMA steps.)
        if bm == 0 || bn == 0 || !bn.is_multiple_of(16) {
            return Err(Error::Backend { backend: "cuda", reason: format!("bad tile {bm}x{bn}") });
        }
        let q_len = mask.q_len();
        let n_qt = q_len.div_ceil(bm);
        let words = bn.div_ceil(32);
        let too_many = || Error::Backend {
            backend: "cuda",
            reason: format!(
                "a {} x {} mask makes more than 2^31 tiles of {bm} x {bn} (the kernels index them in 32 bits)",
                mask.q_len(),
                mask.k_len()
            ),
        };
        // The kept pairs fill at least area / (bm bn) tiles: refused before tens of GB of list.
        if mask.area() / (bm * bn) as u64 > i32::MAX as u64 {
            return Err(too_many());
        }
        let mut ptr = Vec::with_capacity(n_qt + 1);
        let mut tiles = Vec::new();
        let mut bits = Vec::new();
        let mut buf = vec![false; bm * bn];
        let (mut n_full, mut n_partial) = (0, 0);
        ptr.push(0i32);
        for qt in 0..n_qt {
            let q = qt * bm..((qt + 1) * bm).min(q_len);
            for (k, info) in mask.key_tiles(q.clone(), bn) {
                let kt = k.start / bn;
                let partial = info.class == TileClass::Partial || q.len() < bm || k.len() < bn;
                if !partial {
                    tiles.push([kt as i32, -1]);
                    n_full += 1;
                    continue;
                }
                n_partial += 1;
                let kw = k.len();
                mask.fill_tile(q.clone(), k.clone(), &mut buf[..q.len() * kw]);
                let off = bits.len();
                bits.resize(off + bm * words, 0u32);
                for r in 0..q.len() {
                    for c in 0..kw {
                        if buf[r * kw + c] {
                            bits[off + r * words + c / 32] |= 1 << (c % 32);
                        }
                    }
                }
                // (The backward kernels index a tile's words from its offset in 32 bits too.)
                let off = i32::try_from(off + bm * words).map(|_| off as i32).map_err(|_| Error::Backend {
                    backend: "cuda",
                    reason: "mask has too many partial tiles for 32-bit offsets".into(),
                })?;
                tiles.push([kt as i32, off]);
            }
            // (The kernels index the list in 32 bits: a full mask of some 3 million tokens in
            // 32 x 128 tiles would wrap.)
            ptr.push(i32::try_from(tiles.len()).map_err(|_| too_many())?);
        }
        Ok(TilePlan { bm, bn, n_major: n_qt, ptr, tiles, bits, n_full, n_partial })
    }

    /// Per key tile: the query tiles it meets (same tiles and bitmasks as `by_query`).
    pub fn by_key(mask: &Mask, bm: usize, bn: usize) -> Result<TilePlan> {
        let q = Self::by_query(mask, bm, bn)?;
        let n_kt = mask.k_len().div_ceil(bn);
        let mut count = vec![0i32; n_kt + 1];
        for e in &q.tiles {
            count[e[0] as usize + 1] += 1;
        }
        for i in 0..n_kt {
            count[i + 1] += count[i];
        }
        let ptr = count.clone();
        let mut fill = count;
        let mut tiles = vec![[0i32; 2]; q.tiles.len()];
        for qt in 0..q.n_major {
            for e in &q.tiles[q.ptr[qt] as usize..q.ptr[qt + 1] as usize] {
                let kt = e[0] as usize;
                tiles[fill[kt] as usize] = [qt as i32, e[1]];
                fill[kt] += 1;
            }
        }
        Ok(TilePlan { bm, bn, n_major: n_kt, ptr, tiles, bits: q.bits, n_full: q.n_full, n_partial: q.n_partial })
    }

    /// Bitmask words per query row of a partial tile: `bn / 32` rounded up (an 80-key tile's
    /// third word holds 16 keys).
    pub fn words_per_row(&self) -> usize {
        self.bn.div_ceil(32)
    }

    /// Whether (row, col) of the `other`-indexed tile of major tile `major` is kept, by the
    /// plan (for tests). `by_query` plans: row = query in tile, col = key in tile.
    pub fn kept(&self, major: usize, other: usize, row: usize, col: usize) -> bool {
        let words = self.words_per_row();
        for e in &self.tiles[self.ptr[major] as usize..self.ptr[major + 1] as usize] {
            if e[0] as usize == other {
                return e[1] < 0 || self.bits[e[1] as usize + row * words + col / 32] >> (col % 32) & 1 == 1;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distattn_core::mask::DocKind;

    #[test]
    fn a_plan_past_32_bit_tile_indices_is_an_error_before_it_is_built() {
        // 2^22 tokens, full: 2^32 tiles of 32 x 128 (a wrapped index in the kernels).
        let t0 = std::time::Instant::now();
        let err = TilePlan::by_query(&Mask::full(1 << 22, 1 << 22).unwrap(), 32, 128).unwrap_err();
        assert!(err.to_string().contains("more than 2^31 tiles"), "{err}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(1), "the list was built first");
    }

    fn check_plan(mask: &Mask, bm: usize, bn: usize) {
        let p = TilePlan::by_query(mask, bm, bn).unwrap();
        let kp = TilePlan::by_key(mask, bm, bn).unwrap();
        assert_eq!(p.tiles.len(), kp.tiles.len());
        for i in 0..mask.q_len() {
            let mut row = vec![false; mask.k_len()];
            for (lo, hi) in mask.row_intervals(i) {
                row[lo..hi].fill(true);
            }
            for (j, &want) in row.iter().enumerate() {
                let got = p.kept(i / bm, j / bn, i % bm, j % bn);
                assert_eq!(got, want, "q={i} k={j}");
                // The key-major plan holds the same tile with the same bits.
                let words = kp.words_per_row();
                let e = kp.tiles[kp.ptr[j / bn] as usize..kp.ptr[j / bn + 1] as usize]
                    .iter()
                    .find(|e| e[0] as usize == i / bm);
                let got_k = e.is_some_and(|e| {
                    e[1] < 0 || kp.bits[e[1] as usize + (i % bm) * words + (j % bn) / 32] >> (j % bn % 32) & 1 == 1
                });
                assert_eq!(got_k, want, "by_key q={i} k={j}");
            }
        }
    }

    #[test]
    fn plans_reproduce_masks() {
        check_plan(&Mask::full(100, 77).unwrap(), 32, 32);
        check_plan(&Mask::causal(130, 130).unwrap(), 64, 64);
        check_plan(&Mask::causal(50, 170).unwrap(), 16, 32);
        check_plan(&Mask::causal(170, 50).unwrap(), 16, 32);
        check_plan(&Mask::sliding_window(200, 200, Some(37), Some(0)).unwrap(), 32, 64);
        check_plan(&Mask::documents(&[30, 70, 5, 95], DocKind::Causal).unwrap(), 64, 32);
        check_plan(&Mask::prefix_lm(150, 40).unwrap(), 64, 64);
        // The Hopper forward's tiles above d 128: 80 keys (a half-used third word), 96 keys.
        check_plan(&Mask::causal(300, 300).unwrap(), 128, 80);
        check_plan(&Mask::documents(&[100, 13, 190], DocKind::Causal).unwrap(), 128, 96);
        check_plan(&Mask::sliding_window(170, 230, Some(50), Some(20)).unwrap(), 192, 80);
    }

    #[test]
    fn full_tiles_have_no_bits() {
        let p = TilePlan::by_query(&Mask::full(256, 256).unwrap(), 128, 64).unwrap();
        assert_eq!(p.n_partial, 0);
        assert!(p.bits.is_empty());
        let c = TilePlan::by_query(&Mask::causal(256, 256).unwrap(), 128, 64).unwrap();
        assert_eq!(c.n_partial, 4);
        assert_eq!(c.n_full, 2);
    }
}
