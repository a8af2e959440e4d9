//! A plan's run time estimated without hardware: every rank's program replayed on its two lanes
//! (compute, comm) as [`crate::schedule`] issues it, each op starting when its lane is free and
//! the buffers it reads are written. A block costs its FLOPs at the pass's compute rate plus a
//! fixed cost per tile of 128 rows and head it launches work for (query rows in the forward, key
//! rows in the backward: loading the tile, filling the pipeline, writing its outputs), or the
//! bytes of its buffers at the memory rate, whichever is more (a decode block reads its keys);
//! a transfer group starts when this rank and every peer in it have reached it and lasts a
//! fixed latency plus the larger of the bytes it sends and receives at the link rate (NVLink to
//! peers on its node and the network to the others, both at once); copies, adds and merges cost
//! their bytes at the memory rate. Steps are not barriers: a rank that received its block
//! computes while another still works on its own, which is what separates pass-q from pass-KV
//! when the new tokens sit on one rank.
//!
//! The per-tile cost is what separates strategies of equal FLOPs: a ring's P blocks a rank, each
//! over a P-th of the keys, launch P times the tiles of one block over all keys.

use super::cost::op_flops;
use super::{Op, Plan};
use crate::schedule::{reads_writes, schedule, Lane};
use std::collections::BTreeMap;

/// The rates an estimate assumes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rates {
    /// Forward attention FLOP/s of one device.
    pub flops_per_s: f64,
    /// Backward attention FLOP/s of one device, counting 2.5 times the forward's FLOPs.
    pub backward_flops_per_s: f64,
    /// Seconds of one device per forward tile (128 query rows of one head) a block launches,
    /// beyond its FLOPs.
    pub tile_s: f64,
    /// Seconds of one device per backward tile (128 key rows of one query head).
    pub backward_tile_s: f64,
    /// Bytes per second one device sends (and, at once, receives) to its peers on its node.
    pub link_bytes_per_s: f64,
    /// Bytes per second one device sends (and, at once, receives) to ranks on other nodes
    /// ([`Plan::ranks_per_node`]), beside its node's traffic.
    pub network_bytes_per_s: f64,
    /// Seconds a transfer group takes beyond its bytes.
    pub group_latency_s: f64,
    /// Bytes per second one device's memory moves (copies, adds, merges: read and write).
    pub memory_bytes_per_s: f64,
}

impl Rates {
    /// Rates of a device that computes at `flops_per_s` in both passes, with the given link and
    /// memory rates and no fixed costs.
    pub fn flat(flops_per_s: f64, link_bytes_per_s: f64, memory_bytes_per_s: f64) -> Self {
        Rates {
            flops_per_s,
            backward_flops_per_s: flops_per_s,
            tile_s: 0.0,
            backward_tile_s: 0.0,
            link_bytes_per_s,
            network_bytes_per_s: link_bytes_per_s,
            group_latency_s: 0.0,
            memory_bytes_per_s,
        }
    }
}

impl Default for Rates {
    /// One H100/H200 on NVLink. The kernels' rates and tile costs fit distattn's one-GPU
    /// kernels on an H200 at 32k and 128k tokens (causal, 32/8 heads, d 128, 2026-11-27): the
    /// per-FLOP time at 32k is about 3% above 128k's in both passes, which a fixed cost per tile
    /// explains (9 µs of one SM a forward tile, 22 µs a backward one, over 132 SMs). Transfers:
    /// Ulysses' all-to-alls at about 250 GB/s each way; a group of NCCL sends on distattn's
    /// non-blocking communicators takes about 0.1 ms more than its bytes. Between nodes, one
    /// 400 Gb/s network port a GPU (as in an H100 HGX/DGX cluster): 50 GB/s, assumed, not
    /// measured here.
    fn default() -> Self {
        Rates {
            flops_per_s: 667e12,
            backward_flops_per_s: 556e12,
            tile_s: 0.07e-6,
            backward_tile_s: 0.17e-6,
            link_bytes_per_s: 250e9,
            network_bytes_per_s: 50e9,
            group_latency_s: 0.1e-3,
            memory_bytes_per_s: 3e12,
        }
    }
}

/// Rows of one kernel tile (query rows in the forward, key rows in the backward).
const TILE_ROWS: usize = 128;

/// A plan's estimated time.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Estimate {
    /// When the last rank ends, milliseconds.
    pub ms: f64,
    /// When each rank ends.
    pub per_rank_ms: Vec<f64>,
}

/// One rank's replay: its ops in program order with their lanes, and where it stands.
struct Replay<'a> {
    ops: Vec<(&'a Op, Lane)>,
    next: usize,
    lane_free: [f64; 2],
    ready: Vec<f64>,
}

impl Plan {
    /// The plan's estimated time at `rates` (see the module).
    pub fn estimate(&self, rates: &Rates) -> Estimate {
        let mut ranks: Vec<Replay> = self
            .ranks
            .iter()
            .map(|p| {
                let sched = schedule(p);
                let flat: Vec<&Op> = p.steps.iter().flatten().collect();
                Replay {
                    ops: sched.ops.iter().map(|s| (flat[s.id], s.lane)).collect(),
                    next: 0,
                    lane_free: [0.0; 2],
                    ready: vec![0.0; p.bufs.len()],
                }
            })
            .collect();
        // Transfer groups in the global order every rank posts them: (group id) → ranks.
        let mut groups: BTreeMap<(usize, usize), Vec<(usize, usize)>> = BTreeMap::new();
        for (r, rep) in ranks.iter().enumerate() {
            let mut step_of = Vec::with_capacity(rep.ops.len());
            for (t, ops) in self.ranks[r].steps.iter().enumerate() {
                step_of.extend(std::iter::repeat_n(t, ops.len()));
            }
            for (i, (op, _)) in rep.ops.iter().enumerate() {
                if let Op::Comm { phase, .. } = op {
                    groups.entry((step_of[i], *phase)).or_default().push((r, i));
                }
            }
        }
        for members in groups.values() {
            // Every member runs up to the group, then the group's start on each rank.
            let starts: Vec<f64> = members
                .iter()
                .map(|&(r, i)| {
                    self.replay_until(&mut ranks[r], r, i, rates);
                    let (op, lane) = ranks[r].ops[i];
                    let (reads, _) = reads_writes(op, &self.ranks[r].bufs);
                    reads.iter().map(|&b| ranks[r].ready[b]).fold(ranks[r].lane_free[lane.index()], f64::max)
                })
                .collect();
            let start_of = |rank: usize| members.iter().zip(&starts).find(|((r, _), _)| *r == rank).map(|(_, &s)| s);
            for (&(r, i), &own) in members.iter().zip(&starts) {
                let Op::Comm { sends, recvs, .. } = ranks[r].ops[i].0 else { continue };
                let prog = &self.ranks[r];
                // Bytes to or from peers on this rank's node (`true`) or on others.
                let bytes = |list: &[(usize, usize)], here: bool| -> u64 {
                    list.iter()
                        .filter(|&&(peer, _)| self.same_node(r, peer) == here)
                        .map(|&(_, b)| prog.bufs[b].bytes(&self.shape, self.dtype))
                        .sum()
                };
                let begin = sends.iter().chain(recvs).filter_map(|&(peer, _)| start_of(peer)).fold(own, f64::max);
                let node = bytes(sends, true).max(bytes(recvs, true)) as f64 / rates.link_bytes_per_s;
                let network = bytes(sends, false).max(bytes(recvs, false)) as f64 / rates.network_bytes_per_s;
                let end = begin + rates.group_latency_s + node.max(network);
                let rep = &mut ranks[r];
                rep.lane_free[Lane::Comm.index()] = end;
                for &(_, b) in recvs {
                    rep.ready[b] = end;
                }
                rep.next = i + 1;
            }
        }
        let per_rank_ms: Vec<f64> = (0..ranks.len())
            .map(|r| {
                let n = ranks[r].ops.len();
                self.replay_until(&mut ranks[r], r, n, rates);
                ranks[r].lane_free.iter().fold(0.0, |a: f64, &b| a.max(b)) * 1e3
            })
            .collect();
        Estimate { ms: per_rank_ms.iter().fold(0.0, |a: f64, &b| a.max(b)), per_rank_ms }
    }

    /// Whether ranks `a` and `b` share a node.
    fn same_node(&self, a: usize, b: usize) -> bool {
        self.ranks_per_node.is_none_or(|n| a / n == b / n)
    }

    /// Replays rank `r`'s ops before op `end` (a transfer group, or the end), none of which is
    /// a transfer group.
    fn replay_until(&self, rep: &mut Replay, r: usize, end: usize, rates: &Rates) {
        let prog = &self.ranks[r];
        let mem_bytes = |b: usize| prog.bufs[b].bytes(&self.shape, self.dtype) as f64;
        while rep.next < end {
            let (op, lane) = rep.ops[rep.next];
            rep.next += 1;
            let (reads, writes) = reads_writes(op, &prog.bufs);
            let cost = match op {
                Op::Fwd { q, .. } | Op::Bwd { q, .. } => {
                    let bytes: f64 = reads.iter().map(|&b| mem_bytes(b)).sum();
                    // Tiles of 128 rows a query head: query rows forward, key rows backward.
                    let (flops_per_s, tile_s, rows) = match op {
                        Op::Bwd { k, .. } => {
                            (rates.backward_flops_per_s, rates.backward_tile_s, prog.bufs[*k].tokens.len())
                        }
                        _ => (rates.flops_per_s, rates.tile_s, prog.bufs[*q].tokens.len()),
                    };
                    let tiles = (rows.div_ceil(TILE_ROWS) * prog.bufs[*q].heads.len() * self.shape.batch) as f64;
                    (op_flops(op, prog, &self.shape) / flops_per_s + tiles * tile_s)
                        .max(bytes / rates.memory_bytes_per_s)
                }
                Op::Copy { src, dst } | Op::Add { src, dst } => {
                    2.0 * mem_bytes(*src).min(mem_bytes(*dst)) / rates.memory_bytes_per_s
                }
                Op::Merge { o, o_acc, .. } => (2.0 * mem_bytes(*o_acc) + mem_bytes(*o)) / rates.memory_bytes_per_s,
                Op::Alloc { .. } | Op::Free { .. } | Op::Comm { .. } => 0.0,
            };
            let start = reads.iter().map(|&b| rep.ready[b]).fold(rep.lane_free[lane.index()], f64::max);
            let finish = start + cost;
            rep.lane_free[lane.index()] = finish;
            for b in writes {
                rep.ready[b] = finish;
            }
        }
    }
}
