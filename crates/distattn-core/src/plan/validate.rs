//! Structural checks of a plan.

use super::{Op, Plan};
use crate::{Error, Result};

impl Plan {
    /// Checks structural invariants: buffers are defined before use, sends match receives with
    /// equal descriptors, compute blocks are consistent with the shapes.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Error::Comm(format!("invalid plan ({}): {m}", self.strategy));
        let g = self.shape.group();
        for (r, prog) in self.ranks.iter().enumerate() {
            if prog.steps.len() != self.steps() {
                return Err(bad(format!("rank {r} has {} steps, expected {}", prog.steps.len(), self.steps())));
            }
            for op in prog.steps.iter().flatten() {
                for b in op.uses() {
                    if b >= prog.bufs.len() {
                        return Err(bad(format!("rank {r} uses undefined buffer {b}")));
                    }
                }
                match op {
                    Op::Fwd { q, k, v, .. } | Op::Bwd { q, k, v, .. } => {
                        let (q, k, v) = (&prog.bufs[*q], &prog.bufs[*k], &prog.bufs[*v]);
                        if k.tokens != v.tokens
                            || k.heads != v.heads
                            || q.heads.start != k.heads.start * g
                            || q.heads.len() != k.heads.len() * g
                        {
                            return Err(bad(format!("rank {r}: inconsistent block {q:?} × {k:?}")));
                        }
                    }
                    Op::Comm { phase, sends, .. } => {
                        for &(to, buf) in sends {
                            let peer = &self.ranks[to];
                            let ok = peer.steps.iter().flatten().any(|o| match o {
                                Op::Comm { phase: p, recvs, .. } => {
                                    p == phase
                                        && recvs.iter().any(|&(from, rb)| from == r && peer.bufs[rb] == prog.bufs[buf])
                                }
                                _ => false,
                            });
                            if !ok {
                                return Err(bad(format!(
                                    "rank {r} sends buffer {buf} to {to}, which never receives it"
                                )));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}
