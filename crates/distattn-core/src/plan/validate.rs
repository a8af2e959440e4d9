//! Structural checks of a plan.

use super::{Op, Plan};
use crate::{Error, Result};

impl Plan {
    /// Checks structural invariants: one program per rank, every buffer an op uses is in its
    /// rank's table, sends match receives with equal descriptors, compute blocks are consistent
    /// with the shapes. A plan may come from a file, so a broken one is an
    /// [`Error::InvalidPlan`], never a panic.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Error::InvalidPlan(format!("{}: {m}", self.strategy));
        if self.ranks.len() != self.world {
            return Err(bad(format!("{} rank programs for a world of {}", self.ranks.len(), self.world)));
        }
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
                            let peer = self.ranks.get(to).ok_or_else(|| bad(format!("rank {r} sends to rank {to}")))?;
                            let ok = peer.steps.iter().flatten().any(|o| match o {
                                Op::Comm { phase: p, recvs, .. } => {
                                    p == phase
                                        && recvs
                                            .iter()
                                            .any(|&(from, rb)| from == r && peer.bufs.get(rb) == Some(&prog.bufs[buf]))
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

#[cfg(test)]
mod tests {
    use crate::plan::{BufId, Op, Plan, PlanOptions};
    use crate::planner::build;
    use crate::{AttnShape, DType, Error, Mask, Strategy};

    /// The sends of rank 0's first communication group.
    fn first_sends(plan: &mut Plan) -> &mut Vec<(usize, BufId)> {
        let mut ops = plan.ranks[0].steps.iter_mut().flatten();
        ops.find_map(|op| match op {
            Op::Comm { sends, .. } => Some(sends),
            _ => None,
        })
        .expect("a ring sends K/V at step 0")
    }

    #[test]
    fn broken_plans_are_invalid_plan_errors() {
        let shape = AttnShape::new(1, 32, 32, 2, 2, 16).unwrap();
        let mask = Mask::causal(32, 32).unwrap();
        let plan = build(Strategy::Ring, 2, &shape, &mask, DType::F32, &PlanOptions::forward()).unwrap();
        plan.validate().unwrap();
        let mut to_nobody = plan.clone();
        first_sends(&mut to_nobody)[0].0 = 7;
        let mut unreceived = plan.clone();
        first_sends(&mut unreceived)[0].1 = 0; // Q, where rank 1 receives K
        let mut undefined = plan.clone();
        undefined.ranks[1].steps[0].push(Op::Free { buf: 99 });
        let mut missing_rank = plan.clone();
        missing_rank.ranks.pop();
        for broken in [to_nobody, unreceived, undefined, missing_rank] {
            let e = broken.validate().unwrap_err();
            assert!(matches!(e, Error::InvalidPlan(_)), "{e}");
            assert!(e.to_string().starts_with("invalid plan: ring: "), "{e}");
        }
    }
}
