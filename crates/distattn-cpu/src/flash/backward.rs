//! Flash attention backward with a given LSE and D = rowsum(dO ∘ O): one task per
//! (batch, kv head, key tile). A task keeps dK and dV of its key tile in registers-sized
//! buffers across every query head of its GQA group and every query tile that reaches it, so
//! dK/dV are written once with no reduction. dQ is accumulated into one head-major buffer per
//! worker thread (linear memory) and the buffers are summed at the end. The score matrix is
//! never stored: P is recomputed per tile from the saved LSE.

use super::gemm::{gemm, simd_available, AOp, BOp, COp, Dims};
use super::vmath;
use super::{pack_transposed, round16, rows_f32, SendPtr, TileConfig, LOG2E};
use distattn_core::Grads;
use distattn_core::{AttnShape, Element, Mask, TileClass};
use rayon::prelude::*;
use std::sync::Mutex;

/// What a backward reads: Q, K, V and dO in the storage type, the LSE and D = rowsum(dO ∘ O)
/// in f32 (layouts as in the crate docs).
pub(crate) struct Tensors<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub d_o: &'a [T],
    pub lse: &'a [f32],
    pub delta: &'a [f32],
}

/// Backward pass with explicit tiles. Inputs must already be validated.
pub(crate) fn run<T: Element>(
    x: Tensors<'_, T>,
    shape: &AttnShape,
    mask: &Mask,
    scale: f32,
    tiles: TileConfig,
) -> Grads {
    let Tensors { q, k, v, d_o, lse, delta } = x;
    let simd = simd_available();
    let AttnShape { batch, q_len: nq, k_len: nk, heads, kv_heads, head_dim: d } = *shape;
    let group = shape.group();
    let dp = round16(d);
    let (br, bc) = (tiles.bwd_q, tiles.bwd_k);
    let nqt = nq.div_ceil(br);
    let nkt = nk.div_ceil(bc);

    // For every key tile, the query tiles that reach it, with their class.
    let mut per_k: Vec<Vec<(usize, TileClass)>> = vec![Vec::new(); nkt];
    let mut work = vec![0u64; nkt];
    for t in 0..nqt {
        for (kr, info) in mask.key_tiles(t * br..((t + 1) * br).min(nq), bc) {
            per_k[kr.start / bc].push((t, info.class));
            work[kr.start / bc] += info.area;
        }
    }

    let qf = rows_f32(q, batch, nq, heads, d, dp);
    let dof = rows_f32(d_o, batch, nq, heads, d, dp);
    let kf = rows_f32(k, batch, nk, kv_heads, d, dp);
    let kt = pack_transposed(&kf, batch * kv_heads, nk, d, dp, bc);
    let vt = {
        let vf = rows_f32(v, batch, nk, kv_heads, d, dp);
        pack_transposed(&vf, batch * kv_heads, nk, d, dp, bc)
    };
    let lse2: Vec<f32> = lse.iter().map(|&x| x * LOG2E).collect();

    let mut dk = vec![0f32; shape.kv_elems()];
    let mut dv = vec![0f32; shape.kv_elems()];
    let dk_ptr = SendPtr(dk.as_mut_ptr());
    let dv_ptr = SendPtr(dv.as_mut_ptr());
    let q_rows = batch * heads * nq * dp;
    let pool: Vec<Mutex<Vec<f32>>> = (0..rayon::current_num_threads().max(1)).map(|_| Mutex::new(Vec::new())).collect();

    let mut order: Vec<(u64, usize)> = (0..nkt).filter(|&t| work[t] > 0).map(|t| (work[t], t)).collect();
    order.sort_by_key(|&(area, _)| std::cmp::Reverse(area));
    let items: Vec<(usize, usize)> =
        order.iter().flat_map(|&(_, t)| (0..batch * kv_heads).map(move |g| (g, t))).collect();
    let c = scale * LOG2E;

    items.par_iter().for_each_init(
        || Scratch::new(br, bc, dp),
        |sc, &(kg, t)| {
            let b = kg / kv_heads;
            let kh = kg % kv_heads;
            let k0 = t * bc;
            let nkv = (nk - k0).min(bc);
            let ncol = round16(nkv);
            sc.dk[..nkv * dp].fill(0.0);
            sc.dv[..nkv * dp].fill(0.0);
            let kt_tile = kt[(kg * nkt + t) * d * bc..][..d * bc].as_ptr();
            let vt_tile = vt[(kg * nkt + t) * d * bc..][..d * bc].as_ptr();
            let krows = kf[(kg * nk + k0) * dp..][..nkv * dp].as_ptr();
            let mut dq_guard = take_buffer(&pool, q_rows);
            for gi in 0..group {
                let h = kh * group + gi;
                let g = b * heads + h;
                for &(qt, class) in &per_k[t] {
                    let q0 = qt * br;
                    let q1 = (q0 + br).min(nq);
                    let mq = q1 - q0;
                    let qrow = qf[(g * nq + q0) * dp..].as_ptr();
                    let dorow = dof[(g * nq + q0) * dp..].as_ptr();
                    let (tile, rows) = (Dims { m: mq, n: ncol, k: d }, Dims { m: nkv, n: dp, k: mq });
                    let s_out = COp { ptr: sc.s.as_mut_ptr(), ld: bc };
                    let dp_out = COp { ptr: sc.dp.as_mut_ptr(), ld: bc };
                    // SAFETY: A reads rows q0..q1 of group g of `qf` / `dof` (batch·heads·nq rows of
                    // dp ≥ d floats), d columns each. B reads the first ncol ≤ bc columns of the d
                    // rows, bc apart, of this tile's transposed K / V (`kt_tile`, `vt_tile`: d·bc
                    // floats each, sliced above). C writes mq ≤ br rows of ncol floats, bc apart,
                    // of `sc.s` / `sc.dp` (br·bc floats each). ncol is a multiple of 16; both
                    // outputs are this worker's own scratch.
                    unsafe {
                        // S = Q Kᵀ, dP = dO Vᵀ
                        gemm(simd, tile, AOp { ptr: qrow, rs: dp, cs: 1 }, BOp::rows(kt_tile, bc), s_out, false);
                        gemm(simd, tile, AOp { ptr: dorow, rs: dp, cs: 1 }, BOp::rows(vt_tile, bc), dp_out, false);
                    }
                    if class == TileClass::Partial {
                        mask.fill_tile(q0..q1, k0..k0 + nkv, &mut sc.keep);
                        for i in 0..mq {
                            let row = &mut sc.s[i * bc..i * bc + nkv];
                            for (x, &kp) in row.iter_mut().zip(&sc.keep[i * nkv..(i + 1) * nkv]) {
                                if !kp {
                                    *x = f32::NEG_INFINITY;
                                }
                            }
                        }
                    }
                    let lrow = (b * heads + h) * nq + q0;
                    for i in 0..mq {
                        let (sr, dr) = (&mut sc.s[i * bc..i * bc + ncol], &mut sc.dp[i * bc..i * bc + ncol]);
                        vmath::bwd_row(simd, sr, dr, c, lse2[lrow + i], delta[lrow + i]);
                    }
                    // P and dS through pointers taken after the row pass: its `&mut` slices retire
                    // the pointers taken before it.
                    let (s, ds) = (sc.s.as_ptr(), sc.dp.as_ptr());
                    let dv_out = COp { ptr: sc.dv.as_mut_ptr(), ld: dp };
                    let dk_out = COp { ptr: sc.dk.as_mut_ptr(), ld: dp };
                    let dq_out = COp { ptr: dq_guard[(g * nq + q0) * dp..].as_mut_ptr(), ld: dp };
                    // SAFETY: dV += Pᵀ dO: A reads Pᵀ, element (j, i) at i·bc + j of `sc.s` for
                    // j < nkv ≤ bc, i < mq ≤ br (br·bc floats); B reads mq rows of dp floats of
                    // `dof` from row q0 of group g; C is nkv rows of dp of `sc.dv` (bc·dp). dK += dSᵀ
                    // Q: the same with `sc.dp`, `qf` and `sc.dk`. dQ += dS K: A reads mq × nkv of
                    // `sc.dp`, B the nkv rows of dp of `krows` (sliced above), C mq rows of dp of
                    // this worker's dQ buffer from row q0 of group g (batch·heads·nq rows of dp,
                    // locked by this task). dp is a multiple of 16; no output overlaps an input.
                    unsafe {
                        // dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K
                        gemm(simd, rows, AOp { ptr: s, rs: 1, cs: bc }, BOp::rows(dorow, dp), dv_out, true);
                        gemm(simd, rows, AOp { ptr: ds, rs: 1, cs: bc }, BOp::rows(qrow, dp), dk_out, true);
                        let dq = Dims { m: mq, n: dp, k: nkv };
                        gemm(simd, dq, AOp { ptr: ds, rs: bc, cs: 1 }, BOp::rows(krows, dp), dq_out, true);
                    }
                }
            }
            drop(dq_guard);
            for j in 0..nkv {
                let row = ((b * nk + k0 + j) * kv_heads + kh) * d;
                // SAFETY: b < batch, k0 + j < nk and kh < kv_heads, so the d floats at `row` lie in
                // `dk` and `dv` (kv_elems() each). A task is one (b·kv_heads + kh, key tile) pair,
                // each listed once, so no other task writes these rows, and neither vector is used
                // until all tasks end.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(dk_ptr.get().add(row), d);
                    for (x, &y) in dst.iter_mut().zip(&sc.dk[j * dp..j * dp + d]) {
                        *x = y * scale;
                    }
                    let dst = std::slice::from_raw_parts_mut(dv_ptr.get().add(row), d);
                    dst.copy_from_slice(&sc.dv[j * dp..j * dp + d]);
                }
            }
        },
    );

    // dQ = scale · Σ_workers acc, back to [batch, q_len, heads, d].
    let accs: Vec<Vec<f32>> =
        pool.into_iter().map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner())).filter(|v| !v.is_empty()).collect();
    let mut dq = vec![0f32; shape.q_elems()];
    dq.par_chunks_mut(heads * d).enumerate().for_each(|(bi, dst)| {
        let (b, i) = (bi / nq, bi % nq);
        for h in 0..heads {
            let src_off = ((b * heads + h) * nq + i) * dp;
            let out = &mut dst[h * d..(h + 1) * d];
            out.fill(0.0);
            for acc in &accs {
                for (x, &y) in out.iter_mut().zip(&acc[src_off..src_off + d]) {
                    *x += y;
                }
            }
            out.iter_mut().for_each(|x| *x *= scale);
        }
    });
    Grads { dq, dk, dv }
}

/// Locks a free per-worker dQ buffer (allocated zeroed on first use). At most as many tasks
/// run at once as there are threads, so one is always free; `lock` is the fallback.
fn take_buffer(pool: &[Mutex<Vec<f32>>], len: usize) -> std::sync::MutexGuard<'_, Vec<f32>> {
    let start = rayon::current_thread_index().unwrap_or(0) % pool.len();
    let mut guard = None;
    for i in 0..pool.len() {
        if let Ok(g) = pool[(start + i) % pool.len()].try_lock() {
            guard = Some(g);
            break;
        }
    }
    let mut g = guard.unwrap_or_else(|| pool[start].lock().unwrap_or_else(|e| e.into_inner()));
    if g.len() != len {
        *g = vec![0f32; len];
    }
    g
}

struct Scratch {
    s: Vec<f32>,
    dp: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    keep: Vec<bool>,
}

impl Scratch {
    fn new(br: usize, bc: usize, dp: usize) -> Scratch {
        Scratch {
            s: vec![0.0; br * bc],
            dp: vec![0.0; br * bc],
            dk: vec![0.0; bc * dp],
            dv: vec![0.0; bc * dp],
            keep: vec![false; br * bc],
        }
    }
}
