//! All-gather: every rank gathers all of K and V once (zig-zag layout, document-aware as the
//! zig-zag ring's, so causal work is balanced) and computes its queries against every block it
//! needs. Backward gathers K and V again and reduce-scatters the dK/dV partials back to their
//! owners.

use super::builder::{Builder, BwdBufs, FwdBufs, GradBufs, KvBufs, PassBufs};
use crate::Result;

pub(super) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let layout = super::zigzag::layout(b);
    let bufs = b.declare_pass(layout);
    b.label(0, "all-gather K,V + compute");
    // held[r]: (owner, K/V as held on rank r) for every rank's K/V, in owner order.
    let mut held: Vec<Vec<(usize, KvBufs)>> = vec![Vec::with_capacity(p); p];
    for s in 0..p {
        for (r, on_r) in held.iter_mut().enumerate() {
            let kv = if r == s { bufs.kv(s) } else { b.transfer_set(0, 0, s, r, bufs.kv(s)) };
            on_r.push((s, kv));
        }
    }
    compute_held(b, &bufs, &held);
    Ok(())
}

/// At step 0, every rank r computes its queries against each K/V in `held[r]` (owner, K/V as
/// held on r). Backward then returns the dK/dV partials of K/V owned elsewhere to their owners
/// (phase 1, every partial sent, as a reduce-scatter does), who add them.
pub(super) fn compute_held(b: &mut Builder, bufs: &PassBufs, held: &[Vec<(usize, KvBufs)>]) {
    // (computing rank, owner, dK/dV partial)
    let mut partials = Vec::new();
    for (r, on_r) in held.iter().enumerate() {
        for &(owner, kv) in on_r {
            match bufs {
                PassBufs::Forward(own) => b.fwd(r, 0, FwdBufs { kv, ..own[r] }),
                PassBufs::Backward(own) if owner == r => b.bwd(r, 0, BwdBufs { kv, ..own[r] }),
                PassBufs::Backward(own) => {
                    let dkv = b.kv_grad_partials(r, 0, kv);
                    b.bwd(r, 0, BwdBufs { kv, grads: GradBufs { dkv, ..own[r].grads }, ..own[r] });
                    partials.push((r, owner, dkv));
                }
            }
        }
    }
    if let PassBufs::Backward(own) = bufs {
        let returned: Vec<_> =
            partials.into_iter().map(|(r, owner, dkv)| (owner, b.transfer_set(0, 1, r, owner, dkv))).collect();
        for (owner, got) in returned {
            b.add_set(owner, 0, got, own[owner].grads.dkv);
        }
    }
}
