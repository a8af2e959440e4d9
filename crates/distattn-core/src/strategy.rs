//! The context-parallel strategies a plan can be built with, and their names.

use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// A context-parallel strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Ring over a contiguous layout: K/V circulate, blocks with no kept pair are skipped.
    Ring,
    /// Ring over the zig-zag layout (2P chunks): equal causal work on every rank and step.
    Zigzag,
    /// Ring over the striped layout (token i on rank i mod P).
    Striped,
    /// DistFlashAttn: idle ranks help busy ones with query blocks; last step split by tokens.
    Balanced,
    /// All-to-all from sequence- to head-sharding, local attention, all-to-all back.
    Ulysses,
    /// USP: Ulysses in groups of `ulysses_degree` adjacent ranks, ring across the groups.
    /// `0` picks a degree.
    Hybrid { ulysses_degree: usize },
    /// Double ring (LoongTrain): inner rings of `inner` adjacent ranks (a node), an outer ring
    /// across them that moves each block once per inner ring. `0` picks the size (the ranks
    /// per node when known).
    DoubleRing { inner: usize },
    /// All-gather K and V once, from the ranks whose keys a rank's queries see, into one
    /// buffer: two blocks a rank (its own K/V while the rest arrives, then all of it);
    /// backward reduce-scatters dK and dV.
    Allgather,
    /// Mask-aware dispatch: query chunks balanced by kept area, K/V chunks sent only where
    /// needed.
    Dispatch,
    /// Pass-Q (Infinite-LLM's DistAttention; the pass-Q ring of context-parallel inference):
    /// K/V stay where they are placed (contiguous by default, or a KV cache's placement given
    /// in the plan options); each rank's queries go to every rank holding keys they attend,
    /// and the partial O and LSE come back to be merged by LSE. Cheaper than moving K/V when
    /// few queries meet many cached keys (decode, prefill onto a long cache).
    PassQ,
}

impl Strategy {
    /// Every strategy (hybrid with an automatic degree).
    pub const ALL: [Strategy; 10] = [
        Strategy::Ring,
        Strategy::Zigzag,
        Strategy::Striped,
        Strategy::Balanced,
        Strategy::Ulysses,
        Strategy::Hybrid { ulysses_degree: 0 },
        Strategy::DoubleRing { inner: 0 },
        Strategy::Allgather,
        Strategy::Dispatch,
        Strategy::PassQ,
    ];

    /// Sets the Ulysses degree of a hybrid strategy (no effect on others).
    pub fn with_ulysses_degree(self, u: usize) -> Strategy {
        match self {
            Strategy::Hybrid { .. } => Strategy::Hybrid { ulysses_degree: u },
            s => s,
        }
    }

    /// Whether the strategy circulates K/V on a ring (and so has two backward variants).
    pub fn is_ring(self) -> bool {
        matches!(
            self,
            Strategy::Ring
                | Strategy::Zigzag
                | Strategy::Striped
                | Strategy::Hybrid { .. }
                | Strategy::DoubleRing { .. }
        )
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Ring => write!(f, "ring"),
            Strategy::Zigzag => write!(f, "zigzag"),
            Strategy::Striped => write!(f, "striped"),
            Strategy::Balanced => write!(f, "balanced"),
            Strategy::Ulysses => write!(f, "ulysses"),
            Strategy::Hybrid { ulysses_degree: 0 } => write!(f, "hybrid"),
            Strategy::Hybrid { ulysses_degree } => write!(f, "hybrid:{ulysses_degree}"),
            Strategy::DoubleRing { inner: 0 } => write!(f, "double-ring"),
            Strategy::DoubleRing { inner } => write!(f, "double-ring:{inner}"),
            Strategy::Allgather => write!(f, "allgather"),
            Strategy::Dispatch => write!(f, "dispatch"),
            Strategy::PassQ => write!(f, "pass-q"),
        }
    }
}

impl FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Strategy> {
        let bad = |reason: &str| Error::invalid(format!("strategy '{s}'"), reason);
        let (name, arg) = s.split_once(':').unwrap_or((s, ""));
        let st = match name.trim().to_ascii_lowercase().as_str() {
            "ring" => Strategy::Ring,
            "zigzag" | "zig-zag" => Strategy::Zigzag,
            "striped" => Strategy::Striped,
            "balanced" | "distflashattn" => Strategy::Balanced,
            "ulysses" => Strategy::Ulysses,
            "hybrid" | "usp" => {
                let u = if arg.is_empty() {
                    0
                } else {
                    arg.parse().map_err(|_| bad("expected hybrid:U with U the Ulysses degree"))?
                };
                return Ok(Strategy::Hybrid { ulysses_degree: u });
            }
            "double-ring" | "doublering" | "loongtrain" => {
                let inner = if arg.is_empty() {
                    0
                } else {
                    arg.parse().map_err(|_| bad("expected double-ring:I with I the ranks of an inner ring"))?
                };
                return Ok(Strategy::DoubleRing { inner });
            }
            "allgather" | "all-gather" => Strategy::Allgather,
            "dispatch" | "magi" => Strategy::Dispatch,
            "pass-q" | "passq" | "distattention" => Strategy::PassQ,
            _ => {
                return Err(bad(
                    "unknown strategy; expected ring, zigzag, striped, balanced, ulysses, hybrid[:U], double-ring[:I], allgather, dispatch or pass-q",
                ))
            }
        };
        if !arg.is_empty() {
            return Err(bad("only hybrid and double-ring take an argument"));
        }
        Ok(st)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_names_round_trip() {
        let mut all = Strategy::ALL.to_vec();
        all.push(Strategy::Hybrid { ulysses_degree: 2 });
        all.push(Strategy::DoubleRing { inner: 4 });
        for s in all {
            assert_eq!(s.to_string().parse::<Strategy>().unwrap(), s);
        }
        assert_eq!("hybrid:4".parse::<Strategy>().unwrap(), Strategy::Hybrid { ulysses_degree: 4 });
        assert_eq!(
            "hybrid".parse::<Strategy>().unwrap().with_ulysses_degree(2),
            Strategy::Hybrid { ulysses_degree: 2 }
        );
        let e = "spiral".parse::<Strategy>().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().starts_with("invalid strategy 'spiral': unknown strategy"), "{e}");
        assert!("ring:2".parse::<Strategy>().is_err());
        assert_eq!("loongtrain:2".parse::<Strategy>().unwrap(), Strategy::DoubleRing { inner: 2 });
        assert!("double-ring:x".parse::<Strategy>().is_err());
    }
}
