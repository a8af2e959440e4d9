//! Plan inspection: work, bytes and memory per step and rank, and the totals.
//!
//! Work is counted from the mask area as the long-context attention benchmark does: forward
//! `4 · area · head_dim` FLOPs per head (and batch entry), backward 2.5× that. Load imbalance
//! is Σ_steps max_rank work / Σ_steps mean_rank work (1.0 = perfect). Bytes are what each rank
//! sends. Peak memory replays allocations and frees (inputs stay resident; kernel outputs count
//! while they are merged).

use super::{BufDesc, Op, Pass, Plan, RankProgram};
use crate::AttnShape;
use std::fmt;

/// Work and traffic of one rank in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepCost {
    pub flops: f64,
    pub bytes_sent: u64,
    pub blocks: usize,
}

/// Totals of a plan (the JSON of `distattn plan`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PlanSummary {
    pub strategy: String,
    pub pass: Pass,
    pub world: usize,
    pub steps: usize,
    pub layout: String,
    /// Σ over steps of the slowest rank's work / Σ over steps of the mean rank's work.
    pub imbalance: f64,
    /// Total bytes sent by all ranks.
    pub bytes_moved: u64,
    /// Total FLOPs over all ranks.
    pub flops: f64,
    /// FLOPs of the slowest rank per step, summed (the critical path of compute).
    pub critical_flops: f64,
    /// Peak live bytes of the most loaded rank (the memory a device must have).
    pub peak_bytes_per_rank: u64,
    /// Peak live bytes on each rank.
    pub peak_bytes_by_rank: Vec<u64>,
    /// Bytes each rank sends over the whole plan.
    pub bytes_per_rank: Vec<u64>,
    /// FLOPs each rank computes over the whole plan.
    pub flops_per_rank: Vec<f64>,
    /// `[step][rank]` work and traffic.
    pub per_step: Vec<Vec<StepCost>>,
}

/// FLOPs of one op (blocks only) by the benchmark convention.
pub(super) fn op_flops(op: &Op, prog: &RankProgram, shape: &AttnShape) -> f64 {
    match op {
        Op::Fwd { q, area, .. } => {
            4.0 * *area as f64 * shape.head_dim as f64 * (prog.bufs[*q].heads.len() * shape.batch) as f64
        }
        Op::Bwd { q, area, .. } => {
            2.5 * 4.0 * *area as f64 * shape.head_dim as f64 * (prog.bufs[*q].heads.len() * shape.batch) as f64
        }
        _ => 0.0,
    }
}

impl Plan {
    /// Cost of every rank in every step: `[step][rank]`.
    pub fn step_costs(&self) -> Vec<Vec<StepCost>> {
        (0..self.steps())
            .map(|t| {
                self.ranks
                    .iter()
                    .map(|p| {
                        let mut c = StepCost::default();
                        for op in &p.steps[t] {
                            c.flops += op_flops(op, p, &self.shape);
                            if let Op::Fwd { .. } | Op::Bwd { .. } = op {
                                c.blocks += 1;
                            }
                            if let Op::Comm { sends, .. } = op {
                                c.bytes_sent +=
                                    sends.iter().map(|&(_, b)| p.bufs[b].bytes(&self.shape, self.dtype)).sum::<u64>();
                            }
                        }
                        c
                    })
                    .collect()
            })
            .collect()
    }

    /// Peak live bytes of each rank.
    pub fn peak_bytes(&self) -> Vec<u64> {
        // A buffer stored inside another takes no memory of its own.
        let size = |d: &BufDesc| if d.within.is_some() { 0 } else { d.bytes(&self.shape, self.dtype) };
        self.ranks
            .iter()
            .map(|p| {
                let mut live: u64 = p.inputs.iter().map(|&(_, b)| size(&p.bufs[b])).sum();
                let mut peak = live;
                for op in p.steps.iter().flatten() {
                    match op {
                        Op::Alloc { buf, .. } => live += size(&p.bufs[*buf]),
                        Op::Comm { recvs, .. } => live += recvs.iter().map(|&(_, b)| size(&p.bufs[b])).sum::<u64>(),
                        Op::Free { buf } => live = live.saturating_sub(size(&p.bufs[*buf])),
                        Op::Fwd { q, .. } => {
                            // The kernel's partial O and LSE, merged then dropped.
                            let d = &p.bufs[*q];
                            let rows = (self.shape.batch * d.tokens.len() * d.heads.len()) as u64;
                            peak = peak.max(live + rows * (self.shape.head_dim as u64 + 1) * 4);
                        }
                        Op::Bwd { q, k, dq, dk, dv, .. } => {
                            // A fresh f32 partial for each gradient whose accumulator is not
                            // exactly the block's rows or keys (the others are added in place).
                            let (qd, kd) = (&p.bufs[*q], &p.bufs[*k]);
                            let partial = |acc: usize, d: &BufDesc| {
                                if p.bufs[acc].same_region(d) {
                                    0
                                } else {
                                    d.elems(&self.shape)
                                }
                            };
                            let e = partial(*dq, qd) + partial(*dk, kd) + partial(*dv, kd);
                            peak = peak.max(live + e as u64 * 4);
                        }
                        _ => {}
                    }
                    peak = peak.max(live);
                }
                peak
            })
            .collect()
    }

    /// Totals: imbalance, bytes, FLOPs, peak memory, and the per-step costs.
    pub fn summary(&self) -> PlanSummary {
        let per_step = self.step_costs();
        let p = self.world as f64;
        let (mut max_sum, mut mean_sum, mut total) = (0.0, 0.0, 0.0);
        for step in &per_step {
            let s: f64 = step.iter().map(|c| c.flops).sum();
            max_sum += step.iter().map(|c| c.flops).fold(0.0, f64::max);
            mean_sum += s / p;
            total += s;
        }
        let peak = self.peak_bytes();
        PlanSummary {
            strategy: self.strategy.to_string(),
            pass: self.pass,
            world: self.world,
            steps: self.steps(),
            layout: self.layout.kind.name().to_string(),
            imbalance: if mean_sum > 0.0 { max_sum / mean_sum } else { 1.0 },
            bytes_moved: per_step.iter().flatten().map(|c| c.bytes_sent).sum(),
            flops: total,
            critical_flops: max_sum,
            peak_bytes_per_rank: peak.iter().copied().max().unwrap_or(0),
            peak_bytes_by_rank: peak,
            bytes_per_rank: (0..self.world).map(|r| per_step.iter().map(|s| s[r].bytes_sent).sum()).collect(),
            flops_per_rank: (0..self.world).map(|r| per_step.iter().map(|s| s[r].flops).sum()).collect(),
            per_step,
        }
    }
}

/// Human units: 1.5 G, 12.0 M.
pub fn human(x: f64) -> String {
    let (v, u) = if x >= 1e15 {
        (x / 1e15, "P")
    } else if x >= 1e12 {
        (x / 1e12, "T")
    } else if x >= 1e9 {
        (x / 1e9, "G")
    } else if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e3 {
        (x / 1e3, "k")
    } else {
        (x, "")
    };
    format!("{v:.1}{u}")
}

impl fmt::Display for Plan {
    /// One line per step: what it does, the range of the ranks' work, how uneven it is and the
    /// bytes all ranks send; then the totals. The per-rank breakdown is in the JSON summary.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.summary();
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        writeln!(
            f,
            "plan {} ({:?}{}), {}, {}, layout {}\n  {} {}",
            self.strategy,
            self.pass,
            if self.pass == Pass::Backward && self.strategy.is_ring() {
                format!(", {:?}", self.ring_backward)
            } else {
                String::new()
            },
            plural(self.world, "rank"),
            plural(self.steps(), "step"),
            s.layout,
            self.shape,
            self.dtype
        )?;
        writeln!(
            f,
            "{:>4}  {:<30} {:>25} {:>13} {:>14}",
            "step", "what", "FLOPs per rank, min-max", "slowest/mean", "bytes sent"
        )?;
        for (t, step) in s.per_step.iter().enumerate() {
            let label: String = self.step_labels[t].chars().take(30).collect();
            let work = step.iter().map(|c| c.flops);
            let (min, max) = (work.clone().fold(f64::INFINITY, f64::min), work.clone().fold(0.0, f64::max));
            let mean = work.sum::<f64>() / self.world as f64;
            let spread = if max > 0.0 { format!("{:.3}", max / mean) } else { "-".into() };
            let sent: u64 = step.iter().map(|c| c.bytes_sent).sum();
            writeln!(
                f,
                "{t:>4}  {label:<30} {:>25} {spread:>13} {:>13}B",
                format!("{} - {}", human(min), human(max)),
                human(sent as f64)
            )?;
        }
        writeln!(
            f,
            "imbalance {:.3}, critical path {} of {} FLOPs\n\
             bytes moved {}B, peak memory per rank {}B (per rank and step: --json)",
            s.imbalance,
            human(s.critical_flops),
            human(s.flops),
            human(s.bytes_moved as f64),
            human(s.peak_bytes_per_rank as f64)
        )
    }
}
