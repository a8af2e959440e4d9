//! Decode attention over a paged KV cache on the CPU, following the same stream-K split as the
//! GPU kernel ([`DecodeSplit`]): each worker computes its pieces in parallel, pieces of a
//! segment cut between workers are merged by LSE. It is the reference the GPU kernel is tested
//! against, and the embedded backend's decode.

use crate::flash::vmath;
use crate::merge::merge_row;
use distattn_core::decode::{
    DecodeOptions, DecodeShape, DecodeSplit, PagedCache, PagedLayout, Piece, DECODE_BLOCK_ROWS, DECODE_TILE,
};
use distattn_core::{Element, Error, Forward, Result};
use rayon::prelude::*;

/// Decode attention: queries `q` `[batch, q_rows, heads, head_dim]` against each request's
/// keys in `cache`, split over `workers` shares as the GPU splits it. Returns O (f32, like `q`)
/// and LSE `[batch, heads, q_rows]` (natural log; −inf with O = 0 for rows that see no key).
pub fn decode<T: Element>(
    q: &[T],
    cache: &PagedCache<'_, T>,
    shape: &DecodeShape,
    opts: &DecodeOptions,
    workers: usize,
) -> Result<Forward> {
    shape.check_q("q", q.len())?;
    cache.check(shape)?;
    let scale = opts.attn.scale_for(shape.head_dim)?;
    let split = DecodeSplit::new(cache.lengths, shape, workers)?;

    // Every worker's pieces, computed in parallel: (piece, O rows, LSE rows) of its segment's
    // block rows over the piece's keys.
    let pieces: Vec<(Piece, Vec<f32>, Vec<f32>)> = (0..split.workers())
        .into_par_iter()
        .flat_map_iter(|c| split.pieces(c))
        .map(|p| {
            let (o, lse) = piece(q, cache, shape, opts.causal, scale, &split, &p);
            (p, o, lse)
        })
        .collect();

    let d = shape.head_dim;
    let mut out = Forward { o: vec![0.0; shape.q_elems()], lse: vec![f32::NEG_INFINITY; shape.lse_elems()] };
    for (p, po, plse) in &pieces {
        for (r, (q_row, head)) in block_rows(shape, p.segment).enumerate() {
            let b = p.segment / shape.segments_per_request();
            let off = ((b * shape.q_rows + q_row) * shape.heads + head) * d;
            let li = (b * shape.heads + head) * shape.q_rows + q_row;
            merge_row(&mut out.o[off..off + d], &mut out.lse[li], &po[r * d..(r + 1) * d], plse[r]);
        }
    }
    Ok(out)
}

/// (query row, query head) of each row of segment `s`'s block, in block order: row `r` of a
/// KV head's `group × q_rows` rows is query row `r / group` of head `kv_head × group + r % group`.
fn block_rows(shape: &DecodeShape, s: usize) -> impl Iterator<Item = (usize, usize)> {
    let (g, rb) = (shape.group(), shape.row_blocks());
    let j = s % shape.segments_per_request();
    let (kvh, block) = (j / rb, j % rb);
    let rows = g * shape.q_rows;
    (block * DECODE_BLOCK_ROWS..((block + 1) * DECODE_BLOCK_ROWS).min(rows)).map(move |r| (r / g, kvh * g + r % g))
}

/// One piece: normalised O and LSE of each of its segment's block rows over the piece's keys.
/// Keys are the outer loop (each K and V row converted once for every row of the block), scores
/// kept per row, softmax in two passes.
fn piece<T: Element>(
    q: &[T],
    cache: &PagedCache<'_, T>,
    shape: &DecodeShape,
    causal: bool,
    scale: f32,
    split: &DecodeSplit,
    p: &Piece,
) -> (Vec<f32>, Vec<f32>) {
    let d = shape.head_dim;
    let spr = shape.segments_per_request();
    let (b, kvh) = (p.segment / spr, (p.segment % spr) / shape.row_blocks());
    let len = cache.lengths[b];
    let first = split.segment_tiles(p.segment).start;
    let keys = ((p.tiles.start - first) as usize * DECODE_TILE).min(len)
        ..((p.tiles.end - first) as usize * DECODE_TILE).min(len);
    let rows: Vec<(usize, usize)> = block_rows(shape, p.segment).collect();
    let nr = rows.len();
    // Causal: row (query row i) is at position len - q_rows + i and sees keys up to it.
    let limit: Vec<usize> =
        rows.iter().map(|&(i, _)| if causal { (len + i + 1).saturating_sub(shape.q_rows) } else { len }).collect();
    let end = keys.end.min(limit.iter().copied().max().unwrap_or(0));
    let nk = end.saturating_sub(keys.start);
    let mut o = vec![0.0f32; nr * d];
    let mut lse = vec![f32::NEG_INFINITY; nr];
    if nk == 0 {
        return (o, lse);
    }
    let simd = crate::flash::gemm::simd_available();
    let mut qf = vec![0.0f32; nr * d];
    for (r, &(q_row, head)) in rows.iter().enumerate() {
        let off = ((b * shape.q_rows + q_row) * shape.heads + head) * d;
        T::convert_to_f32(&q[off..off + d], &mut qf[r * d..(r + 1) * d]);
        qf[r * d..(r + 1) * d].iter_mut().for_each(|x| *x *= scale);
    }
    let mut row = vec![0.0f32; d];
    let mut s = vec![f32::NEG_INFINITY; nr * nk];
    for (j, t) in (keys.start..end).enumerate() {
        T::convert_to_f32(cache.row(cache.k, b, t, kvh), &mut row);
        for r in (0..nr).filter(|&r| t < limit[r]) {
            s[r * nk + j] = vmath::dot(simd, &qf[r * d..(r + 1) * d], &row);
        }
    }
    // Per row: the max (NaN if a score is: max would drop it), weights exp(s - m), their sum.
    let mut sums = vec![0.0f32; nr];
    for r in 0..nr {
        let sr = &mut s[r * nk..(r + 1) * nk];
        let m = sr.iter().fold(f32::NEG_INFINITY, |m, &x| if x.is_nan() || m.is_nan() { f32::NAN } else { m.max(x) });
        if m == f32::NEG_INFINITY {
            sr.fill(0.0);
            continue;
        }
        sr.iter_mut().for_each(|x| *x = (*x - m).exp());
        sums[r] = sr.iter().sum();
        lse[r] = m + sums[r].ln();
    }
    for (j, t) in (keys.start..end).enumerate() {
        T::convert_to_f32(cache.row(cache.v, b, t, kvh), &mut row);
        for r in 0..nr {
            let w = s[r * nk + j];
            if w != 0.0 {
                o[r * d..(r + 1) * d].iter_mut().zip(&row).for_each(|(x, &y)| *x += w * y);
            }
        }
    }
    for r in (0..nr).filter(|&r| sums[r] != 0.0) {
        let inv = 1.0 / sums[r];
        o[r * d..(r + 1) * d].iter_mut().for_each(|x| *x *= inv);
    }
    (o, lse)
}

/// Appends `new_tokens` tokens per request to the paged caches: token `j` of request `b`
/// (`k_new`, `v_new` `[batch, new_tokens, kv_heads, head_dim]`) goes to position
/// `lengths[b] + j`. `lengths` are the lengths before the append; the caller keeps them (add
/// `new_tokens` after).
#[allow(clippy::too_many_arguments)]
pub fn append_kv<T: Element>(
    k_cache: &mut [T],
    v_cache: &mut [T],
    layout: &PagedLayout,
    page_table: &[i32],
    lengths: &[usize],
    k_new: &[T],
    v_new: &[T],
    new_tokens: usize,
) -> Result<()> {
    let batch = lengths.len();
    let row = layout.kv_heads * layout.head_dim;
    for (name, x) in [("k", k_new.len()), ("v", v_new.len())] {
        if x != batch * new_tokens * row {
            return Err(Error::ShapeMismatch {
                tensor: format!("new {name}"),
                expected: format!("[{batch}, {new_tokens}, {}, {}]", layout.kv_heads, layout.head_dim),
                got: format!("{x} elements"),
            });
        }
    }
    let shape = DecodeShape::new(batch, 1, layout.kv_heads, layout.kv_heads, layout.head_dim)?;
    let after: Vec<usize> = lengths.iter().map(|&l| l + new_tokens).collect();
    PagedCache { k: &*k_cache, v: &*v_cache, layout: *layout, page_table, lengths: &after }.check(&shape)?;
    let max_pages = page_table.len() / batch;
    for (b, &len) in lengths.iter().enumerate() {
        for j in 0..new_tokens {
            let t = len + j;
            let page = page_table[b * max_pages + t / layout.page_size] as usize;
            let dst = layout.offset(page, t % layout.page_size, 0);
            let src = (b * new_tokens + j) * row;
            k_cache[dst..dst + row].copy_from_slice(&k_new[src..src + row]);
            v_cache[dst..dst + row].copy_from_slice(&v_new[src..src + row]);
        }
    }
    Ok(())
}
