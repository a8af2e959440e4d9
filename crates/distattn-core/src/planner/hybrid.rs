//! USP / 2D attention: P = U × R. Ranks form R groups of U adjacent ranks. Inside a group an
//! all-to-all turns sequence sharding into head sharding (rank u of the group gets the group's
//! tokens for heads slice u); across groups, the ranks with the same head slice run a ring
//! over the groups' token sets; a final all-to-all inside the group returns outputs to
//! sequence sharding. The layout is zig-zag over the R groups (balanced causal rings), each
//! group's two chunks split evenly among its U ranks. U = P is Ulysses; U = 1 is zig-zag ring.

use super::builder::{accumulator_fill, Builder, PassBufs};
use super::ring;
use crate::plan::{even_part, BufDesc, Fill, Layout, Op, Pass, PlanOptions, Tensor, TokenSet};
use crate::{AttnShape, Result};
use std::ops::Range;

/// The Ulysses degree U picked when none is given: the largest proper divisor of `world` that
/// divides both head counts (1 if none), the ring part then spanning P / U groups. Where the
/// ranks span several nodes (`opts.ranks_per_node`), U also divides the ranks per node, so every
/// all-to-all stays inside a node (fast links) and only the ring crosses nodes.
pub fn default_ulysses_degree(world: usize, shape: &AttnShape, opts: &PlanOptions) -> usize {
    let within = opts.ranks_per_node_of(world).filter(|&n| world.is_multiple_of(n));
    (1..world)
        .rev()
        .find(|&u| {
            world.is_multiple_of(u)
                && shape.heads.is_multiple_of(u)
                && shape.kv_heads.is_multiple_of(u)
                && within.is_none_or(|n| n.is_multiple_of(u))
        })
        .unwrap_or(1)
}

pub(super) fn plan(b: &mut Builder, degree: usize) -> Result<()> {
    let p = b.world;
    let u_deg = if degree == 0 { default_ulysses_degree(p, &b.shape, b.opts) } else { degree };
    if !p.is_multiple_of(u_deg) {
        return Err(b.unsupported(format!("Ulysses degree {u_deg} does not divide the world size {p}")));
    }
    // Across groups a ring: zig-zag over the groups, inside every packed document if any.
    let layout = if u_deg == p {
        Layout::contiguous(b.shape.q_len, b.shape.k_len, p)
    } else if let Some(lens) = super::zigzag::documents(b) {
        Layout::grouped_doc_zigzag(&lens, p / u_deg, u_deg)
    } else {
        Layout::grouped_zigzag(b.shape.q_len, b.shape.k_len, p / u_deg, u_deg)
    };
    grouped(b, u_deg, layout)
}

/// Ulysses inside groups of `u_deg` ranks and a ring across the groups, on `layout`.
///
/// Without a ring (one group), the heads may go in chunks of whole KV heads
/// ([`PlanOptions::head_chunks`](crate::PlanOptions)): chunk c's all-to-all runs at step c, its
/// attention at step c + 1 and its way back at step c + 2, so each all-to-all can overlap the
/// previous chunk's attention.
pub(super) fn grouped(b: &mut Builder, u_deg: usize, layout: Layout) -> Result<()> {
    let p = b.world;
    let (h, kvh) = (b.shape.heads, b.shape.kv_heads);
    if !h.is_multiple_of(u_deg) || !kvh.is_multiple_of(u_deg) {
        return Err(b.unsupported(format!(
            "heads ({h}) and kv heads ({kvh}) must both be divisible by the Ulysses degree {u_deg}"
        )));
    }
    let r_deg = p / u_deg;
    let ring_of = |u: usize| -> Vec<usize> { (0..r_deg).map(|g| g * u_deg + u).collect() };
    if u_deg == 1 {
        let bufs = b.declare_pass(layout);
        rings(b, 0, &bufs, &ring_of, 1);
        return Ok(());
    }
    let per_rank = kvh / u_deg;
    let chunks = match b.opts.head_chunks {
        Some(c) if c != 1 && r_deg > 1 => {
            return Err(b.unsupported(format!("{c} head chunks: chunks are for Ulysses without a ring")))
        }
        Some(c) if c == 0 || c > per_rank => {
            return Err(b.unsupported(format!("{c} head chunks: expected 1 to the {per_rank} KV heads of a rank")))
        }
        Some(c) => c,
        None => 1,
    };
    let keep = b.opts.keep_head_sharded;
    if keep && chunks > 1 {
        return Err(b.unsupported(format!("{chunks} head chunks: keeping the head-sharded inputs needs one chunk")));
    }
    let kept_inputs = keep && b.pass() == Pass::Backward;
    let g = Groups { u_deg, chunks, h, kvh, layout: layout.clone(), kept_inputs };
    let bufs = b.declare_pass_with(layout, &|r, t| g.kept(r, t));
    // Only the all-to-all back's copies write the pass's outputs, so they are held in the input
    // dtype; with one chunk those copies write them whole in one step, so they are allocated
    // then rather than zero-filled at step 0 and held through the attention.
    for r in 0..p {
        for (_, out) in bufs.outputs(r) {
            b.hold_narrowed(r, out);
            if chunks == 1 {
                b.allocate_at(r, out, r_deg + 1, Fill::Overwritten);
            }
        }
    }
    let mut sliced = Vec::with_capacity(chunks);
    for step in 0..chunks + r_deg + 1 {
        if step < chunks {
            sliced.push(g.scatter(b, step, &bufs, step));
        }
        if let Some(c) = (step > r_deg).then(|| step - r_deg - 1).filter(|&c| c < chunks) {
            g.gather_back(b, step, &bufs, &sliced[c]);
        }
        if let Some(c) = step.checked_sub(1).filter(|&c| c < chunks) {
            rings(b, step, &sliced[c], &ring_of, u_deg);
        }
        // Ring steps carry the ring's labels; the all-to-alls say what they are.
        let label = match step {
            _ if chunks > 1 => Some(chunk_label(step, chunks)),
            0 => Some(format!("all-to-all in groups of {u_deg}")),
            s if s == r_deg + 1 => Some("all-to-all back".to_string()),
            _ => None,
        };
        if let Some(label) = label {
            b.label(step, label);
        }
    }
    if let (true, PassBufs::Forward(ranks)) = (keep, &sliced[0]) {
        for (r, x) in ranks.iter().enumerate() {
            for (t, buf) in [(Tensor::Q, x.q), (Tensor::K, x.kv.k), (Tensor::V, x.kv.v), (Tensor::Lse, x.out.lse)] {
                b.save(r, t, buf);
            }
        }
    }
    Ok(())
}

/// What step `step` of a chunked Ulysses pass does.
fn chunk_label(step: usize, chunks: usize) -> String {
    let at = |c: Option<usize>, what: &str| c.filter(|&c| c < chunks).map(|c| format!("{what} of head chunk {c}"));
    [at(Some(step), "all-to-all"), at(step.checked_sub(1), "attention"), at(step.checked_sub(2), "all-to-all back")]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("; ")
}

/// One ring per head slice `u` (members `ring_of(u)`) over `sliced`, from `step0`.
fn rings(b: &mut Builder, step0: usize, sliced: &PassBufs, ring_of: &dyn Fn(usize) -> Vec<usize>, slices: usize) {
    for u in 0..slices {
        let members = ring_of(u);
        let name = if members.len() == 1 { "local".to_string() } else { format!("ring/{u}") };
        match sliced {
            PassBufs::Forward(own) => ring::forward(b, step0, &members, own, &name),
            PassBufs::Backward(own) => ring::backward(b, step0, &[ring::BwdRing::own(&members)], own, own, &name),
        }
    }
}

/// The groups of a hybrid pass and its head chunks.
struct Groups {
    u_deg: usize,
    chunks: usize,
    h: usize,
    kvh: usize,
    layout: Layout,
    /// A backward after a forward that kept them: Q, K, V and LSE come head-sharded already.
    kept_inputs: bool,
}

impl Groups {
    /// Rank r's group and head slice.
    fn group(&self, r: usize) -> (usize, usize) {
        (r / self.u_deg, r % self.u_deg)
    }

    fn members(&self, g: usize) -> Range<usize> {
        g * self.u_deg..(g + 1) * self.u_deg
    }

    /// Heads of `t` in chunk `c` of head slice `u`: whole KV heads, and their query heads.
    fn heads(&self, t: Tensor, u: usize, c: usize) -> Range<usize> {
        let kv = even_part(self.kvh, self.u_deg, u);
        let part = even_part(kv.len(), self.chunks, c);
        let (a, z) = (kv.start + part.start, kv.start + part.end);
        if t.is_kv() {
            a..z
        } else {
            let per = self.h / self.kvh;
            a * per..z * per
        }
    }

    fn group_tokens(&self, g: usize, t: Tensor) -> TokenSet {
        TokenSet::union(self.members(g).map(|r| self.layout.tokens(t, r)))
    }

    /// What rank `r` holds of `t` after the all-to-all of chunk `c`: its group's tokens of its
    /// slice's chunk.
    fn slice_desc(&self, r: usize, t: Tensor, c: usize) -> BufDesc {
        let (g, u) = self.group(r);
        BufDesc::new(t, self.group_tokens(g, t), self.heads(t, u, c))
    }

    /// Whether inputs of `t` come head-sharded already (kept by the forward; one chunk).
    fn is_kept(&self, t: Tensor) -> bool {
        self.kept_inputs && t.is_kept_head_sharded()
    }

    /// Rank `r`'s input of `t` where it comes head-sharded already.
    fn kept(&self, r: usize, t: Tensor) -> Option<BufDesc> {
        self.is_kept(t).then(|| self.slice_desc(r, t, 0))
    }

    /// All-to-all inside each group (sequence → heads) of head chunk `c` at `step`: every rank
    /// ends with its group's tokens of its slice's chunk, and accumulators of that shape. Inputs
    /// kept head-sharded by the forward stay where they are. The gathered buffers are allocated
    /// first, so pieces that are contiguous in them (Q, K, V, dO of one batch entry: a run of
    /// tokens with all the slice's heads) are received in place instead of copied.
    fn scatter(&self, b: &mut Builder, step: usize, bufs: &PassBufs, c: usize) -> PassBufs {
        let p = b.world;
        let mut sends = Vec::new();
        for a in 0..p {
            let (g, _) = self.group(a);
            for dst in self.members(g).filter(|&dst| dst != a) {
                let (_, ub) = self.group(dst);
                for (t, src) in bufs.inputs(a) {
                    if !self.is_kept(t) {
                        let tokens = b.desc(a, src).tokens.clone();
                        let x = b.extract(a, step, src, tokens, self.heads(t, ub, c));
                        sends.push((a, dst, t, x));
                    }
                }
            }
        }
        // Each rank's own part goes in first; the pieces cover the group's tokens of the slice.
        let gathered = bufs.map_inputs(|r, t, src| {
            if self.is_kept(t) {
                return src;
            }
            let dst = b.alloc(r, step, self.slice_desc(r, t, c), Fill::Overwritten);
            b.push(r, step, Op::Copy { src, dst });
            dst
        });
        for (a, dst, t, x) in sends {
            for (_, into) in gathered.inputs(dst).into_iter().filter(|&(u, _)| u == t) {
                b.transfer_gathered(step, 0, a, dst, x, into);
            }
        }
        // Without a ring, one block writes each O accumulator (forward) and each gradient
        // (backward) whole: they may be held in the input dtype, so the kernel writes what the
        // all-to-all back sends. Gradients held so are written, not added into: allocated
        // unfilled at the attention's step.
        let one_block = p == self.u_deg;
        gathered.map_outputs(|r, t, _| {
            let (g, u) = self.group(r);
            let desc = BufDesc::new(t, self.group_tokens(g, t), self.heads(t, u, c));
            let acc = if one_block && t.is_grad() && b.narrows(t) {
                b.alloc(r, step + 1, desc, Fill::Overwritten)
            } else {
                b.alloc(r, step, desc, accumulator_fill(t))
            };
            if one_block && (t == Tensor::O || t.is_grad()) {
                b.hold_narrowed(r, acc);
            }
            acc
        })
    }

    /// All-to-all back inside each group (heads → sequence) of one chunk's accumulators
    /// `sliced` at `step`, into the pass's outputs; every extract of the step comes before its
    /// transfers. The accumulators are final here, so they may travel narrowed.
    fn gather_back(&self, b: &mut Builder, step: usize, bufs: &PassBufs, sliced: &PassBufs) {
        let p = b.world;
        // (source rank, destination rank, part of an accumulator on the source, output on the
        // destination).
        let mut back = Vec::new();
        for src_rank in 0..p {
            let (g, _) = self.group(src_rank);
            for dst in self.members(g) {
                for ((t, acc), (_, out)) in sliced.outputs(src_rank).into_iter().zip(bufs.outputs(dst)) {
                    let tokens = self.layout.tokens(t, dst).clone();
                    let part = if dst == src_rank {
                        acc
                    } else if b.desc(src_rank, acc).narrow == b.narrows(t) {
                        // (Ulysses' O, written in the input dtype: sent from inside it)
                        b.part_to_send(src_rank, step, acc, tokens)
                    } else {
                        let heads = b.desc(src_rank, acc).heads.clone();
                        let desc = BufDesc::new(t, tokens, heads);
                        b.extract_as(src_rank, step, acc, if b.narrows(t) { desc.narrowed() } else { desc })
                    };
                    back.push((src_rank, dst, part, out));
                }
            }
        }
        let mut copies = Vec::new();
        for (src_rank, dst, part, out) in back {
            let got = if dst == src_rank { part } else { b.transfer(step, 1, src_rank, dst, part) };
            copies.push((dst, got, out));
        }
        for (r, src, dst) in copies {
            b.push(r, step, Op::Copy { src, dst });
        }
    }
}
