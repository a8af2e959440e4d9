//! Per-step timelines of a rank (compute and transfer intervals, from CUDA events) and the
//! overlap they show.

use serde::Serialize;

/// An interval in milliseconds from the rank's start event.
pub type Interval = (f64, f64);

/// One step of one rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepTimes {
    pub step: usize,
    /// From the first to the last compute op of the step (None: no compute).
    pub compute: Option<Interval>,
    /// From the first to the last transfer of the step, as the comm stream ran them.
    pub comm: Option<Interval>,
}

/// One rank's timeline of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Timeline {
    pub rank: usize,
    /// Start to end of the whole run, ms.
    pub total_ms: f64,
    pub steps: Vec<StepTimes>,
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
    v.iter().map(|x| x.1 - x.0).sum()
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
        let m = union(self.steps.iter().filter_map(|s| s.comm).collect());
        let hidden = intersection(&c, &m);
        let comm = length(&m);
        Overlap { compute_ms: length(&c), comm_ms: comm, hidden_ms: hidden, exposed_ms: comm - hidden }
    }

    /// A text rendering: one line per step with its intervals.
    pub fn render(&self) -> String {
        let mut s = format!("rank {} total {:.3} ms\n", self.rank, self.total_ms);
        for st in &self.steps {
            let f = |x: Option<Interval>| x.map_or("-".to_string(), |(a, b)| format!("{a:8.3}..{b:8.3}"));
            s += &format!("  step {:2}  compute {:>20}  comm {:>20}\n", st.step, f(st.compute), f(st.comm));
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
            .map(|t| StepTimes {
                step: t,
                compute: Some((t as f64, t as f64 + 1.0)),
                comm: if t < 3 { Some((t as f64 + 0.1, t as f64 + 0.7)) } else { None },
            })
            .collect();
        let tl = Timeline { rank: 0, total_ms: 4.0, steps };
        let o = tl.overlap();
        assert!((o.comm_ms - 1.8).abs() < 1e-9);
        assert!((o.hidden_ms - 1.8).abs() < 1e-9);
        assert!((o.hidden_fraction() - 1.0).abs() < 1e-9);
        assert!(tl.render().contains("hidden"));
        // Serialised transfers: nothing hidden.
        let steps = vec![
            StepTimes { step: 0, compute: Some((0.0, 1.0)), comm: Some((1.0, 1.5)) },
            StepTimes { step: 1, compute: Some((1.5, 2.5)), comm: None },
        ];
        let o = Timeline { rank: 1, total_ms: 2.5, steps }.overlap();
        assert_eq!(o.hidden_ms, 0.0);
        assert!((o.exposed_ms - 0.5).abs() < 1e-9);
        let j = serde_json::to_string(&Timeline::default()).unwrap();
        assert!(j.contains("steps"));
    }
}
