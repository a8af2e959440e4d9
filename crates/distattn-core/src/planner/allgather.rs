//! All-gather: every rank gathers all of K and V once (zig-zag layout, so causal work is
//! balanced) and computes its queries against every block it needs. Backward gathers K and V
//! again and reduce-scatters the dK/dV partials back to their owners.

use super::builder::Builder;
use crate::plan::{BufDesc, Fill, Layout, Op, Pass, Tensor};
use crate::Result;

pub(crate) fn plan(b: &mut Builder) -> Result<()> {
    let p = b.world;
    let layout = Layout::zigzag(b.shape.q_len, b.shape.k_len, p);
    let inputs = b.pass_inputs(layout);
    let outputs = b.pass_outputs();
    let fwd = b.pass() == Pass::Forward;
    b.label(0, "all-gather K,V + compute");
    // kv[r][s] = (k, v) of rank s as held on rank r.
    let mut kv = vec![vec![(0, 0); p]; p];
    for (r, row) in kv.iter_mut().enumerate() {
        row[r] = (inputs[r][1], inputs[r][2]);
    }
    for s in 0..p {
        for r in 0..p {
            if r != s {
                let k = b.transfer(0, 0, s, r, inputs[s][1]);
                let v = b.transfer(0, 0, s, r, inputs[s][2]);
                kv[r][s] = (k, v);
            }
        }
    }
    let mut partial = vec![Vec::new(); p];
    for r in 0..p {
        let i = &inputs[r];
        for s in 0..p {
            let (k, v) = kv[r][s];
            if fwd {
                b.fwd(r, 0, i[0], k, v, outputs[r][0], outputs[r][1]);
            } else if s == r {
                b.bwd(r, 0, [i[0], k, v, i[3], i[4], i[5]], outputs[r][0], outputs[r][1], outputs[r][2]);
            } else {
                let d = b.desc(r, k).clone();
                let dk = b.alloc(r, 0, BufDesc::new(Tensor::DK, d.tokens.clone(), d.heads.clone()), Fill::Zero);
                let dv = b.alloc(r, 0, BufDesc::new(Tensor::DV, d.tokens, d.heads), Fill::Zero);
                b.bwd(r, 0, [i[0], k, v, i[3], i[4], i[5]], outputs[r][0], dk, dv);
                partial[r].push((s, dk, dv));
            }
        }
    }
    if !fwd {
        // Reduce-scatter of dK, dV (every partial is sent, as the collective does).
        let mut adds = Vec::new();
        for (r, parts) in partial.iter().enumerate() {
            for &(s, dk, dv) in parts {
                let gk = b.transfer(0, 1, r, s, dk);
                let gv = b.transfer(0, 1, r, s, dv);
                adds.push((s, gk, outputs[s][1]));
                adds.push((s, gv, outputs[s][2]));
            }
        }
        for (s, src, dst) in adds {
            b.push(s, 0, Op::Add { src, dst });
        }
    }
    Ok(())
}
