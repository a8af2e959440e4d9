//! Per-step timelines of a rank (compute and transfer intervals, from the backend's events:
//! CUDA events on a GPU, clock readings on the CPU) and the overlap they show.

use serde::{Deserialize, Serialize};

/// An interval in milliseconds from the rank's start event.
pub type Interval = (f64, f64);

/// One step of one rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimes {
    pub step: usize,
    /// From the first to the last compute op of the step (None: no compute).
    pub compute: Option<Interval>,
    /// From the first transfer's start to the last one's end, as the comm stream ran them.
    pub comm: Option<Interval>,
    /// Each transfer (one grouped send/receive) of the step. Empty in files written before
    /// transfers were timed one by one: `comm` then stands for them.
    #[serde(default)]
    pub transfers: Vec<Interval>,
}

impl StepTimes {
    /// A step from its compute span and its transfers (`comm` is their span).
    pub fn new(step: usize, compute: Option<Interval>, transfers: Vec<Interval>) -> StepTimes {
        let comm = transfers.iter().copied().reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)));
        StepTimes { step, compute, comm, transfers }
    }

    /// The step's transfer intervals: each transfer, or the span where none was recorded.
    pub fn transfer_intervals(&self) -> Vec<Interval> {
        if self.transfers.is_empty() {
            self.comm.into_iter().collect()
        } else {
            self.transfers.clone()
        }
    }
}

/// One rank's timeline of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    pub rank: usize,
    /// Start to end of the whole run, ms.
    pub total_ms: f64,
    pub steps: Vec<StepTimes>,
}

/// The timelines of one benchmark run, as a bench's `--timelines` file lists them: each
/// rank's timeline of every phase, the phases of a rank in order (a forward+backward run holds
/// every rank's forward timeline, then its backward one).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimelineRun {
    pub strategy: String,
    /// Total sequence length.
    pub seq: usize,
    /// `fwd`, `bwd` or `fwd+bwd`.
    pub pass: String,
    pub mask: String,
    pub ranks: Vec<Timeline>,
    /// Where a bench records every timed iteration: this run's index among them, and its wall
    /// time (the slowest rank's), to set slow iterations beside fast ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iteration: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_ms: Option<f64>,
}

impl TimelineRun {
    /// The timelines by phase: the k-th timeline of each rank belongs to phase k. Each phase
    /// is one execution, timed from its own start event.
    pub fn phases(&self) -> Vec<Vec<&Timeline>> {
        let mut phases: Vec<Vec<&Timeline>> = Vec::new();
        let mut seen: Vec<usize> = Vec::new();
        for t in &self.ranks {
            let k = seen.iter().filter(|&&r| r == t.rank).count();
            seen.push(t.rank);
            if k == phases.len() {
                phases.push(Vec::new());
            }
            phases[k].push(t);
        }
        phases
    }

    /// The name of phase `k`: forward / backward after the pass.
    pub fn phase_name(&self, k: usize) -> String {
        let names: &[&str] = match self.pass.as_str() {
            "fwd" => &["forward"],
            "bwd" => &["backward"],
            "fwd+bwd" => &["forward", "backward"],
            _ => &[],
        };
        names.get(k).map_or_else(|| format!("phase {k}"), |s| s.to_string())
    }
}

/// Overlap summary of a timeline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Overlap {
    pub compute_ms: f64,
    pub comm_ms: f64,
    /// Transfer time during which compute ran.
    pub hidden_ms: f64,
    /// Transfer time with no compute running.
    pub exposed_ms: f64,
}

impl Overlap {
    /// Fraction of transfer time hidden under compute (1 when there is no transfer).
    pub fn hidden_fraction(&self) -> f64 {
        if self.comm_ms <= 0.0 {
            1.0
        } else {
            self.hidden_ms / self.comm_ms
        }
    }
}

/// Union of intervals, sorted and disjoint.
pub fn union(mut v: Vec<Interval>) -> Vec<Interval> {
    v.retain(|x| x.1 > x.0);
    v.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    let mut out: Vec<Interval> = Vec::new();
    for (a, b) in v {
        match out.last_mut() {
            Some(l) if a <= l.1 => l.1 = l.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn length(v: &[Interval]) -> f64 {
    // Not `sum()`: its empty value is −0.0, which prints as "-0.000".
    v.iter().fold(0.0, |s, x| s + (x.1 - x.0))
}

/// Total length of the intersection of two unions.
pub fn intersection(a: &[Interval], b: &[Interval]) -> f64 {
    let (mut i, mut j, mut s) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            s += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    s
}

impl Timeline {
    pub fn overlap(&self) -> Overlap {
        let c = union(self.steps.iter().filter_map(|s| s.compute).collect());
        let m = union(self.steps.iter().flat_map(|s| s.transfer_intervals()).collect());
        let hidden = intersection(&c, &m);
        let comm = length(&m);
        Overlap { compute_ms: length(&c), comm_ms: comm, hidden_ms: hidden, exposed_ms: comm - hidden }
    }

    /// A text rendering: one line per step with its intervals.
    pub fn render(&self) -> String {
        let mut s = format!("rank {} total {:.3} ms\n", self.rank, self.total_ms);
        for st in &self.steps {
            let f = |x: Option<Interval>| x.map_or("-".to_string(), |(a, b)| format!("{a:8.3}..{b:8.3}"));
            let busy = length(&union(st.transfer_intervals()));
            let n = if st.transfers.is_empty() { String::new() } else { format!("{} transfers, ", st.transfers.len()) };
            s += &format!(
                "  step {:2}  compute {:>20}  comm {:>20} ({n}busy {busy:.3} ms)\n",
                st.step,
                f(st.compute),
                f(st.comm)
            );
        }
        let o = self.overlap();
        s += &format!(
            "  compute {:.3} ms, comm {:.3} ms, hidden {:.3} ms ({:.0}%), exposed {:.3} ms\n",
            o.compute_ms,
            o.comm_ms,
            o.hidden_ms,
            100.0 * o.hidden_fraction(),
            o.exposed_ms
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unions_and_intersections() {
        assert_eq!(union(vec![(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (5.0, 5.0)]), vec![(0.0, 2.0), (3.0, 4.0)]);
        assert_eq!(intersection(&[(0.0, 2.0), (3.0, 4.0)], &[(1.0, 3.5)]), 1.5);
        assert_eq!(intersection(&[], &[(1.0, 3.5)]), 0.0);
    }

    #[test]
    fn overlap_of_a_pipelined_ring() {
        // Step t computes on [t, t+1) and transfers the next block on [t, t+0.6).
        let steps = (0..4)
            .map(|t| {
                StepTimes::new(
                    t,
                    Some((t as f64, t as f64 + 1.0)),
                    if t < 3 { vec![(t as f64 + 0.1, t as f64 + 0.7)] } else { vec![] },
                )
            })
            .collect();
        let tl = Timeline { rank: 0, total_ms: 4.0, steps };
        let o = tl.overlap();
        assert!((o.comm_ms - 1.8).abs() < 1e-9);
        assert!((o.hidden_ms - 1.8).abs() < 1e-9);
        assert!((o.hidden_fraction() - 1.0).abs() < 1e-9);
        assert!(tl.render().contains("hidden"));
        // Serialised transfers: nothing hidden. (A file with spans only, as older runs wrote.)
        let steps = vec![
            StepTimes { step: 0, compute: Some((0.0, 1.0)), comm: Some((1.0, 1.5)), transfers: vec![] },
            StepTimes { step: 1, compute: Some((1.5, 2.5)), comm: None, transfers: vec![] },
        ];
        let o = Timeline { rank: 1, total_ms: 2.5, steps }.overlap();
        assert_eq!(o.hidden_ms, 0.0);
        assert!((o.exposed_ms - 0.5).abs() < 1e-9);
        // Two transfers far apart in one step: the gap between them is no transfer time.
        let step = StepTimes::new(0, Some((0.0, 10.0)), vec![(0.5, 1.0), (9.0, 11.0)]);
        assert_eq!(step.comm, Some((0.5, 11.0)));
        let o = Timeline { rank: 0, total_ms: 11.0, steps: vec![step] }.overlap();
        assert!(
            (o.comm_ms - 2.5).abs() < 1e-9 && (o.hidden_ms - 1.5).abs() < 1e-9 && (o.exposed_ms - 1.0).abs() < 1e-9,
            "{o:?}"
        );
        let j = serde_json::to_string(&Timeline::default()).unwrap();
        assert!(j.contains("steps"));
    }

    #[test]
    fn runs_split_into_phases_per_rank() {
        let tl = |rank, total_ms| Timeline { rank, total_ms, steps: vec![] };
        let run = TimelineRun {
            strategy: "zigzag".into(),
            seq: 64,
            pass: "fwd+bwd".into(),
            mask: "causal".into(),
            ranks: vec![tl(0, 1.0), tl(0, 3.0), tl(1, 1.5), tl(1, 3.5)],
            ..Default::default()
        };
        let phases = run.phases();
        let totals: Vec<Vec<f64>> = phases.iter().map(|p| p.iter().map(|t| t.total_ms).collect()).collect();
        assert_eq!(totals, vec![vec![1.0, 1.5], vec![3.0, 3.5]]);
        assert_eq!(
            (run.phase_name(0), run.phase_name(1), run.phase_name(2)),
            ("forward".into(), "backward".into(), "phase 2".into())
        );
        // The bench's file round-trips, and extra fields of older files are ignored.
        let back: TimelineRun = serde_json::from_str(&serde_json::to_string(&run).unwrap()).unwrap();
        assert_eq!(back, run);
        let old = r#"{"strategy":"ring","seq":8,"pass":"fwd","mask":"full","note":"x","ranks":[{"rank":0,"total_ms":2.0,"steps":[{"step":0,"compute":[0.0,1.0],"comm":null}]}]}"#;
        let r: TimelineRun = serde_json::from_str(old).unwrap();
        assert_eq!(r.ranks[0].steps[0].compute, Some((0.0, 1.0)));
    }
}
