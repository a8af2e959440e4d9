//! Flash attention forward: one task per (batch, head, query tile), online softmax over the
//! non-empty key tiles of the mask.

use super::gemm::{gemm, simd_available, AOp, BOp, COp, Dims};
use super::vmath;
use super::{pack_k_panels, pack_v_panels, round16, rows_f32, SendPtr, TileConfig, LOG2E};
use distattn_core::Forward;
use distattn_core::{AttnShape, Element, Mask, TileClass};
use rayon::prelude::*;

/// Forward pass with explicit tiles. Inputs must already be validated.
pub(crate) fn run<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &Mask,
    scale: f32,
    tiles: TileConfig,
) -> Forward {
    let simd = simd_available();
    let AttnShape { batch, q_len: nq, k_len: nk, heads, kv_heads, head_dim: d } = *shape;
    let group = shape.group();
    let dp = round16(d);
    let (br, bc) = (tiles.fwd_q, tiles.fwd_k);
    let nqt = nq.div_ceil(br);
    let nkt = nk.div_ceil(bc);

    let qf = rows_f32(q, batch, nq, heads, d, dp);
    let kf = rows_f32(k, batch, nk, kv_heads, d, dp);
    let kt = pack_k_panels(&kf, batch * kv_heads, nk, d, dp, bc);
    drop(kf);
    let vf = rows_f32(v, batch, nk, kv_heads, d, dp);
    let vp = pack_v_panels(&vf, batch * kv_heads, nk, dp, bc);
    drop(vf);

    let mut o = vec![0f32; shape.q_elems()];
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_elems()];
    let o_ptr = SendPtr(o.as_mut_ptr());
    let lse_ptr = SendPtr(lse.as_mut_ptr());

    // Largest query tiles first: better tail balance under causal-like masks.
    let mut order: Vec<(u64, usize)> =
        (0..nqt).map(|t| (mask.tile(t * br..((t + 1) * br).min(nq), 0..nk).area, t)).filter(|&(a, _)| a > 0).collect();
    order.sort_by_key(|&(area, _)| std::cmp::Reverse(area));
    let items: Vec<(usize, usize)> = order.iter().flat_map(|&(_, t)| (0..batch * heads).map(move |g| (g, t))).collect();
    let c = scale * LOG2E;

    items.par_iter().for_each_init(
        || Scratch::new(br, bc, dp),
        |sc, &(g, t)| {
            let (b, h) = (g / heads, g % heads);
            let kg = b * kv_heads + h / group;
            let q0 = t * br;
            let q1 = (q0 + br).min(nq);
            let mq = q1 - q0;
            sc.reset(mq, dp);
            let qa = AOp { ptr: qf[(g * nq + q0) * dp..].as_ptr(), rs: dp, cs: 1 };
            for (kr, class, col) in steps(mask, q0..q1, bc) {
                let tile = kr.start / bc;
                let nkv = kr.len();
                let ncol = round16(nkv);
                // Columns [col, col + ncol) of the packed tile; past nkv they are padding or
                // the next sub-tile's keys, masked to −inf below.
                // Panels of 16 keys, each [d, 16]: column `col` starts panel col / 16.
                let kt_tile = &kt[(kg * nkt + tile) * d * bc + col * d..];
                // S = Q · Kᵀ (raw scores)
                let kb = BOp { ptr: kt_tile.as_ptr(), ld: 16, ps: 16 * d };
                let sc_s = COp { ptr: sc.s.as_mut_ptr(), ld: bc };
                // SAFETY: A reads rows q0..q1 of group g of `qf` (batch·heads·nq rows of dp ≥ d
                // floats), d columns each. B reads keys col..col + ncol of this tile's panels, each
                // [d, 16]: col and bc are multiples of 16 and col + nkv ≤ bc, so col + ncol ≤ bc
                // and every read lies in the tile's d·bc floats of `kt`, where `kt_tile` starts
                // col·d in. C writes mq ≤ br rows of ncol ≤ bc floats, bc apart, of `sc.s` (br·bc
                // floats). ncol is a multiple of 16; `sc.s` is this worker's own scratch.
                unsafe { gemm(simd, Dims { m: mq, n: ncol, k: d }, qa, kb, sc_s, false) };
                if class == TileClass::Partial {
                    mask.fill_tile(q0..q1, kr.clone(), &mut sc.keep);
                    for i in 0..mq {
                        let row = &mut sc.s[i * bc..i * bc + nkv];
                        for (x, &kp) in row.iter_mut().zip(&sc.keep[i * nkv..(i + 1) * nkv]) {
                            if !kp {
                                *x = f32::NEG_INFINITY;
                            }
                        }
                    }
                }
                for i in 0..mq {
                    let row = &mut sc.s[i * bc..i * bc + ncol];
                    row[nkv..].fill(f32::NEG_INFINITY);
                    let (m_new, alpha, sum) = vmath::fwd_row(simd, row, c, sc.m[i]);
                    if alpha != 1.0 {
                        vmath::scale(simd, &mut sc.o[i * dp..(i + 1) * dp], alpha);
                    }
                    sc.l[i] = sc.l[i] * alpha + sum;
                    sc.m[i] = m_new;
                }
                // O += P · V
                // Panels of 16 dims, each [bc, 16]; this step's keys start at row col.
                let v_tile = &vp[(kg * nkt + tile) * dp * bc + col * 16..];
                let pa = AOp { ptr: sc.s.as_ptr(), rs: bc, cs: 1 };
                let vb = BOp { ptr: v_tile.as_ptr(), ld: 16, ps: 16 * bc };
                let sc_o = COp { ptr: sc.o.as_mut_ptr(), ld: dp };
                // SAFETY: A reads mq rows of nkv ≤ bc scores, bc apart, of `sc.s` (br·bc floats),
                // through a pointer taken after the row pass wrote them. B reads rows
                // col..col + nkv (≤ bc) of the dp / 16 panels, each [bc, 16], of this tile's dp·bc
                // floats of `vp`, where `v_tile` starts col·16 in. C accumulates mq rows of dp
                // floats of `sc.o` (br·dp). dp is a multiple of 16; `sc.o` is this worker's own
                // scratch, apart from `sc.s` and `vp`.
                unsafe { gemm(simd, Dims { m: mq, n: dp, k: nkv }, pa, vb, sc_o, true) };
            }
            for i in 0..mq {
                let (l, m) = (sc.l[i], sc.m[i]);
                let row = (b * nq + q0 + i) * heads + h;
                // SAFETY: b < batch, h < heads and q0 + i < nq, so the d floats at row·d lie in
                // `o` (q_elems()) and the LSE index in `lse` (lse_elems()). A task is one
                // (b·heads + h, query tile) pair, each listed once, so no other task writes this
                // row of `o` or this LSE entry, and neither vector is used until all tasks end.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(o_ptr.get().add(row * d), d);
                    // m = −inf: the row saw no key (O = 0, LSE = −inf). A NaN m or l comes
                    // from a non-finite input and is passed on.
                    if m != f32::NEG_INFINITY {
                        let inv = 1.0 / l;
                        for (x, &y) in dst.iter_mut().zip(&sc.o[i * dp..i * dp + d]) {
                            *x = y * inv;
                        }
                        *lse_ptr.get().add((b * heads + h) * nq + q0 + i) = (m + l.log2()) / LOG2E;
                    }
                }
            }
        },
    );
    Forward { o, lse }
}

/// Keys per sub-tile when a partial key tile is split.
const SUB: usize = 64;

/// The key ranges a query tile visits, with their class and column offset inside their packed
/// tile of width `bc`: whole tiles where full, and partial tiles split into sub-tiles of
/// [`SUB`] keys so that the empty parts (e.g. above a causal diagonal) are skipped.
fn steps(mask: &Mask, q: std::ops::Range<usize>, bc: usize) -> Vec<(std::ops::Range<usize>, TileClass, usize)> {
    let mut out = Vec::new();
    for (kr, info) in mask.key_tiles(q.clone(), bc) {
        if info.class == TileClass::Partial && kr.len() > SUB {
            for s0 in kr.clone().step_by(SUB) {
                let sub = s0..(s0 + SUB).min(kr.end);
                let class = mask.tile(q.clone(), sub.clone()).class;
                if class != TileClass::Empty {
                    out.push((sub, class, s0 - kr.start));
                }
            }
        } else {
            out.push((kr, info.class, 0));
        }
    }
    out
}

struct Scratch {
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    keep: Vec<bool>,
}

impl Scratch {
    fn new(br: usize, bc: usize, dp: usize) -> Scratch {
        Scratch {
            s: vec![0.0; br * bc],
            o: vec![0.0; br * dp],
            m: vec![f32::NEG_INFINITY; br],
            l: vec![0.0; br],
            keep: vec![false; br * bc],
        }
    }

    fn reset(&mut self, mq: usize, dp: usize) {
        self.o[..mq * dp].fill(0.0);
        self.m.fill(f32::NEG_INFINITY);
        self.l.fill(0.0);
    }
}
