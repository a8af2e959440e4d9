//! Tiled flash attention on the CPU.
//!
//! Inputs are first converted once to f32 in a head-major, zero-padded layout
//! (`[batch, heads, len, dp]` with `dp = head_dim` rounded up to 16), and K and V are also
//! packed per key tile (backward: transposed, `[batch, kv_heads, tile, head_dim, bk]`; forward:
//! in panels of 16 columns for the micro-kernel, see [`pack_k_panels`]) so the GEMMs
//! stream contiguous vectors. All of this is linear in the sequence length; the score matrix
//! only ever exists as one `bq × bk` tile per worker.

pub mod backward;
pub mod forward;
pub mod gemm;
pub mod vmath;

use distattn_core::Element;
use rayon::prelude::*;

/// Tile sizes of the kernels (rows of queries × keys per tile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileConfig {
    /// Query rows per forward tile.
    pub fwd_q: usize,
    /// Keys per forward tile (rounded up to a multiple of 16).
    pub fwd_k: usize,
    /// Query rows per backward tile.
    pub bwd_q: usize,
    /// Keys per backward tile (rounded up to a multiple of 16).
    pub bwd_k: usize,
}

impl TileConfig {
    /// Tiles chosen for a head dimension (tuned on a 2-core AVX2 machine).
    pub fn for_head_dim(d: usize) -> TileConfig {
        // d ≥ 128: 96 query rows reuse each 8 KiB K/V panel over twice as many rows.
        let fwd_q = if d >= 128 { 96 } else { 48 };
        TileConfig { fwd_q, fwd_k: 256, bwd_q: 64, bwd_k: 64 }
    }

    pub(crate) fn sanitized(self) -> TileConfig {
        TileConfig {
            fwd_q: self.fwd_q.max(1),
            fwd_k: round16(self.fwd_k.max(1)),
            bwd_q: self.bwd_q.max(1),
            bwd_k: round16(self.bwd_k.max(1)),
        }
    }
}

pub(crate) fn round16(x: usize) -> usize {
    x.div_ceil(16) * 16
}

/// log2(e): scores are scaled by `scale · LOG2E` so exponentials are base 2.
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;

/// A raw pointer shared by workers that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: the wrapper only carries an address to the rayon workers of `forward::run` and
// `backward::run`; each dereference there is an unsafe block in which a task writes rows of the
// output that no other task touches, while the owning vector is not used until every task is
// done. Values of `T` may be written from another thread because `T: Send`.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as for `Send`: sharing the wrapper gives each worker the address, nothing more, and
// the writes through it are disjoint.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole wrapper).
    #[inline(always)]
    pub(crate) fn get(&self) -> *mut T {
        self.0
    }
}

/// `x` (`[batch, len, heads, d]`) as f32 rows `[batch, heads, len, dp]`, zero-padded to `dp`.
pub(crate) fn rows_f32<T: Element>(x: &[T], batch: usize, len: usize, heads: usize, d: usize, dp: usize) -> Vec<f32> {
    let mut out = vec![0f32; batch * heads * len * dp];
    out.par_chunks_mut(len * dp).enumerate().for_each(|(g, dst)| {
        let (b, h) = (g / heads, g % heads);
        for i in 0..len {
            let src = &x[((b * len + i) * heads + h) * d..][..d];
            T::convert_to_f32(src, &mut dst[i * dp..i * dp + d]);
        }
    });
    out
}

/// Rows `[groups, len, dp]` packed transposed per tile of `bk` rows: `[groups, tiles, d, bk]`,
/// zero beyond `len`.
pub(crate) fn pack_transposed(rows: &[f32], groups: usize, len: usize, d: usize, dp: usize, bk: usize) -> Vec<f32> {
    let tiles = len.div_ceil(bk);
    let mut out = vec![0f32; groups * tiles * d * bk];
    out.par_chunks_mut(d * bk).enumerate().for_each(|(gt, dst)| {
        let (g, t) = (gt / tiles, gt % tiles);
        let j0 = t * bk;
        let n = (len - j0).min(bk);
        let src = &rows[(g * len + j0) * dp..];
        // Blocks of 8 keys keep both sides in cache lines.
        for jb in (0..n).step_by(8) {
            let je = (jb + 8).min(n);
            for c in 0..d {
                let row = &mut dst[c * bk..];
                for j in jb..je {
                    row[j] = src[j * dp + c];
                }
            }
        }
    });
    out
}

/// Rows `[groups, len, dp]` packed per tile of `bk` rows into column panels of 16 rows, each
/// transposed: `[groups, tiles, bk / 16, d, 16]`, zero beyond `len`. Row `j` of a tile, column
/// `c` is at `(j / 16)·16·d + c·16 + j % 16`: B of `S = Q·Kᵀ` for
/// [`gemm::gemm`] as a [`gemm::BOp`] with `ld = 16`, `ps = 16·d`.
pub(crate) fn pack_k_panels(rows: &[f32], groups: usize, len: usize, d: usize, dp: usize, bk: usize) -> Vec<f32> {
    let tiles = len.div_ceil(bk);
    let mut out = vec![0f32; groups * tiles * d * bk];
    out.par_chunks_mut(d * 16).enumerate().for_each(|(gp, dst)| {
        let per_group = tiles * (bk / 16);
        let (g, p) = (gp / per_group, gp % per_group);
        let j0 = p * 16; // row within the group (tiles are contiguous multiples of 16)
        if j0 >= len {
            return;
        }
        let n = (len - j0).min(16);
        let src = &rows[(g * len + j0) * dp..];
        for j in 0..n {
            for c in 0..d {
                dst[c * 16 + j] = src[j * dp + c];
            }
        }
    });
    out
}

/// Rows `[groups, len, dp]` packed per tile of `bk` rows into column panels of 16 columns:
/// `[groups, tiles, dp / 16, bk, 16]`, zero beyond `len`. Row `j` of a tile, column `c` is at
/// `(c / 16)·16·bk + j·16 + c % 16`: B of `O += P·V` for [`gemm::gemm`] as a [`gemm::BOp`]
/// with `ld = 16`, `ps = 16·bk`.
pub(crate) fn pack_v_panels(rows: &[f32], groups: usize, len: usize, dp: usize, bk: usize) -> Vec<f32> {
    let tiles = len.div_ceil(bk);
    let mut out = vec![0f32; groups * tiles * dp * bk];
    out.par_chunks_mut(dp * bk).enumerate().for_each(|(gt, dst)| {
        let (g, t) = (gt / tiles, gt % tiles);
        let j0 = t * bk;
        let n = (len - j0).min(bk);
        let src = &rows[(g * len + j0) * dp..];
        for pc in 0..dp / 16 {
            let panel = &mut dst[pc * 16 * bk..];
            for j in 0..n {
                panel[j * 16..j * 16 + 16].copy_from_slice(&src[j * dp + pc * 16..][..16]);
            }
        }
    });
    out
}
