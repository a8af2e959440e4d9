//! Planner tests: structure and the N = 128k, P = 8 cost tables.

use super::*;
use crate::mask::{long_tailed_doc_lens, DocKind};
use crate::plan::{area, BufId, Fill, Op, Pass, PlanSummary, RankProgram, RingBackward, Tensor, TokenSet};
use std::ops::Range;
use std::time::Instant;

fn shape_128k() -> AttnShape {
    AttnShape::new(1, 131072, 131072, 32, 8, 128).unwrap()
}

fn strategies() -> Vec<Strategy> {
    let mut v = Strategy::ALL.to_vec();
    v.push(Strategy::Hybrid { ulysses_degree: 2 });
    v
}

/// Builds every strategy forward and both backward variants, returns rows of the table.
fn table(mask: &Mask, title: &str, docs: Option<Vec<usize>>) -> Vec<(String, PlanSummary)> {
    let shape = shape_128k();
    let mut rows = Vec::new();
    println!("\n{title}: N=131072, P=8, 32 heads / 8 kv heads, d=128, bf16");
    println!(
        "{:<28} {:>9} {:>12} {:>11} {:>14} {:>9}",
        "strategy (pass)", "imbalance", "bytes moved", "TFLOP", "peak/rank", "build ms"
    );
    let mut list: Vec<(Strategy, &str, Option<Vec<usize>>)> = strategies().into_iter().map(|s| (s, "", None)).collect();
    if docs.is_some() {
        list.push((Strategy::Zigzag, " doc-layout", docs));
    }
    for (s, tag, documents) in list {
        let mut passes = vec![("fwd", PlanOptions::forward())];
        passes.push(("bwd", PlanOptions::backward(RingBackward::KvCirculate)));
        if s.is_ring() {
            passes.push(("bwd-burst", PlanOptions::backward(RingBackward::QCirculate)));
        }
        for (name, mut opts) in passes {
            opts.documents = documents.clone();
            let name = format!("{tag}{}{name}", if tag.is_empty() { "" } else { " " });
            let t = Instant::now();
            let plan = build(s, 8, &shape, mask, DType::BF16, &opts).unwrap();
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let sum = plan.summary();
            println!(
                "{:<28} {:>9.3} {:>10.2}GB {:>11.2} {:>12.2}GB {:>9.1}",
                format!("{s} ({})", name.trim()),
                sum.imbalance,
                sum.bytes_moved as f64 / 1e9,
                sum.flops / 1e12,
                sum.peak_bytes_per_rank as f64 / 1e9,
                ms
            );
            assert!(ms < 1000.0, "{s} {name}: building took {ms} ms");
            rows.push((format!("{s}{tag} {}", name.trim_start_matches(tag).trim()), sum));
        }
    }
    rows
}

fn get<'a>(rows: &'a [(String, PlanSummary)], name: &str) -> &'a PlanSummary {
    &rows.iter().find(|r| r.0 == name).unwrap().1
}

#[test]
fn causal_128k_p8_table() {
    let mask = Mask::causal(131072, 131072).unwrap();
    let rows = table(&mask, "causal", None);
    for pass in ["fwd", "bwd"] {
        assert!(get(&rows, &format!("balanced {pass}")).imbalance <= 1.05);
        assert!(get(&rows, &format!("zigzag {pass}")).imbalance <= 1.05);
        let ring = get(&rows, &format!("ring {pass}")).imbalance;
        assert!((1.8..2.0).contains(&ring), "ring imbalance {ring}");
    }
    // The published schedule (last step unsplit) leaves half the ranks idle: 1.125 at P=8.
    let opts = PlanOptions { balanced_no_split: true, ..PlanOptions::forward() };
    let published = build(Strategy::Balanced, 8, &shape_128k(), &mask, DType::BF16, &opts).unwrap().summary().imbalance;
    println!("balanced, published last step (no token split): imbalance {published:.3}");
    assert!((published - 1.125).abs() < 1e-3, "{published}");
    // FLOPs are the mask's: forward 4·area·d·heads.
    let fl = get(&rows, "ring fwd").flops;
    assert!((fl / (4.0 * mask.area() as f64 * 128.0 * 32.0) - 1.0).abs() < 1e-9);
    for (_, s) in &rows {
        assert!((s.flops / if s.pass == Pass::Forward { fl } else { 2.5 * fl } - 1.0).abs() < 1e-9);
    }
    // GQA 32/8: circulating Q, dO, LSE, D moves more than K/V and dK/dV.
    assert!(get(&rows, "ring bwd-burst").bytes_moved > get(&rows, "ring bwd").bytes_moved);
}

#[test]
fn documents_128k_p8_table() {
    let lens = long_tailed_doc_lens(131072, 1);
    let mask = Mask::documents(&lens, DocKind::Causal).unwrap();
    println!("{} documents, longest {}", lens.len(), lens.iter().max().unwrap());
    let rows = table(&mask, "causal documents (docs-random-causal:1)", Some(lens.clone()));
    for pass in ["fwd", "bwd"] {
        let d = get(&rows, &format!("dispatch {pass}"));
        assert!(d.imbalance <= 1.10, "dispatch imbalance {}", d.imbalance);
        for ring in ["ring", "zigzag", "striped", "balanced", "hybrid", "hybrid:2", "allgather", "zigzag doc-layout"] {
            assert!(d.bytes_moved < get(&rows, &format!("{ring} {pass}")).bytes_moved, "{ring} {pass}");
        }
        // Zig-zag, all-gather and hybrid find the documents in the mask (2.7, 2.4, 1.3 and, for
        // hybrid:2, 2.1 with the sequence-wide cuts): the same plan as with the lengths given.
        for s in ["zigzag", "allgather", "hybrid", "hybrid:2"] {
            let z = get(&rows, &format!("{s} {pass}"));
            assert!(z.imbalance <= 1.05, "{s} {pass} imbalance {}", z.imbalance);
        }
        let (z, given) = (get(&rows, &format!("zigzag {pass}")), get(&rows, &format!("zigzag doc-layout {pass}")));
        assert_eq!((z.imbalance, z.bytes_moved), (given.imbalance, given.bytes_moved));
    }
}

#[test]
fn ulysses_needs_divisible_heads() {
    let shape = AttnShape::new(1, 40, 40, 6, 2, 16).unwrap();
    let mask = Mask::causal(40, 40).unwrap();
    let e = build(Strategy::Ulysses, 4, &shape, &mask, DType::F32, &PlanOptions::forward()).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("divisible"));
    let e = build(Strategy::Hybrid { ulysses_degree: 4 }, 8, &shape, &mask, DType::F32, &PlanOptions::forward())
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }));
    let e = build(Strategy::Hybrid { ulysses_degree: 3 }, 8, &shape, &mask, DType::F32, &PlanOptions::forward())
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }));
}

#[test]
fn plans_validate_and_render() {
    let shape = AttnShape::new(1, 53, 53, 4, 2, 16).unwrap();
    let masks = [
        Mask::causal(53, 53).unwrap(),
        Mask::full(53, 53).unwrap(),
        Mask::prefix_lm(53, 11).unwrap(),
        Mask::sliding_window(53, 53, Some(6), Some(0)).unwrap(),
        Mask::documents(&long_tailed_doc_lens(53, 2), DocKind::Causal).unwrap(),
        Mask::window_global(53, Some(4), Some(4), 3).unwrap(),
    ];
    for mask in masks {
        for s in strategies() {
            for p in [1, 2, 3, 4, 8] {
                for opts in [
                    PlanOptions::forward(),
                    PlanOptions::backward(RingBackward::KvCirculate),
                    PlanOptions::backward(RingBackward::QCirculate),
                ] {
                    let plan = match build(s, p, &shape, &mask, DType::BF16, &opts) {
                        Ok(p) => p,
                        Err(Error::Unsupported { .. }) => continue,
                        Err(e) => panic!("{s} P={p}: {e}"),
                    };
                    plan.validate().unwrap();
                    let sum = plan.summary();
                    let fl =
                        4.0 * mask.area() as f64 * 16.0 * 4.0 * if opts.pass() == Pass::Backward { 2.5 } else { 1.0 };
                    assert!((sum.flops / fl - 1.0).abs() < 1e-9, "{s} P={p}: every kept pair exactly once");
                    let text = plan.to_string();
                    assert!(text.contains("imbalance"));
                    let back: Plan = serde_json::from_str(&serde_json::to_string(&plan).unwrap()).unwrap();
                    assert_eq!(back, plan);
                    let json = serde_json::to_value(&sum).unwrap();
                    for key in ["imbalance", "bytes_moved", "flops", "peak_bytes_per_rank"] {
                        assert!(json.get(key).is_some());
                    }
                }
            }
        }
    }
}

#[test]
fn ring_backward_variants_bytes() {
    // K/V + dK/dV circulating vs BurstAttention's Q, dO, LSE, D + dQ circulating, causal 128k, P=8.
    let mask = Mask::causal(131072, 131072).unwrap();
    println!("\nring backward, causal N=131072, P=8, d=128, bf16: bytes moved");
    println!("{:<22} {:>14} {:>14}", "heads / kv heads", "kv-circulate", "q-circulate");
    for (h, kv) in [(32, 8), (32, 32), (64, 8)] {
        let shape = AttnShape::new(1, 131072, 131072, h, kv, 128).unwrap();
        let bytes = |rb| {
            build(Strategy::Ring, 8, &shape, &mask, DType::BF16, &PlanOptions::backward(rb))
                .unwrap()
                .summary()
                .bytes_moved
        };
        let (a, b) = (bytes(RingBackward::KvCirculate), bytes(RingBackward::QCirculate));
        println!("{:<22} {:>12.2}GB {:>12.2}GB", format!("{h} / {kv}"), a as f64 / 1e9, b as f64 / 1e9);
        // Per token and hop: KV side 2·kv·d·2 B (+ dK,dV 2·kv·d·4 B), Q side 2·h·d·2 + 2·h·4 B (+ dQ h·d·4 B).
        let n = 131072u64 * 7 / 8; // 7 input hops of N/8 tokens on each of 8 ranks = 7N/8 per rank
                                   // Partial gradients go back to the owner from each non-empty remote visit: under the
                                   // causal mask, 0 + 1 + ... + 7 = 28 blocks of N/8 tokens.
        let parts = 28 * 131072 / 8;
        let (hh, kk, d) = (h as u64, kv as u64, 128u64);
        assert_eq!(a, n * 8 * (2 * kk * d * 2) + parts * (2 * kk * d * 4));
        assert_eq!(b, n * 8 * (2 * hh * d * 2 + 2 * hh * 4) + parts * (hh * d * 4));
        if h == kv {
            assert!(b < a, "without GQA, circulating the query side moves less");
        } else {
            assert!(b > a, "with GQA, circulating K/V moves less");
        }
    }
}

#[test]
fn display_example() {
    let shape = AttnShape::new(1, 131072, 131072, 32, 8, 128).unwrap();
    let mask = Mask::causal(131072, 131072).unwrap();
    for s in [Strategy::Balanced, Strategy::Ring] {
        let plan = build(s, 8, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
        let text = plan.to_string();
        println!("{text}");
        // Title and shape, column heads, a line per step, two lines of totals.
        assert_eq!(text.lines().count(), plan.steps() + 5);
    }
}

#[test]
fn world_sizes_beyond_the_tokens_or_the_limit_are_refused() {
    let shape = AttnShape::new(1, 64, 64, 4, 4, 64).unwrap();
    let mask = Mask::causal(64, 64).unwrap();
    let opts = PlanOptions::default();
    for world in [65, MAX_WORLD + 1] {
        let t0 = Instant::now();
        let err = build(Strategy::Zigzag, world, &shape, &mask, DType::BF16, &opts).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{world}: {err}");
        assert!(t0.elapsed().as_secs_f64() < 0.1, "{world}: {:?}", t0.elapsed());
    }
    // Decode: one query token, keys spread over more ranks than queries.
    let decode = AttnShape::new(1, 1, 64, 4, 4, 64).unwrap();
    let mask = Mask::full(1, 64).unwrap();
    assert!(build(Strategy::Allgather, 4, &decode, &mask, DType::BF16, &opts).is_ok());
}

#[test]
fn hybrid_keeps_all_to_alls_inside_nodes() {
    use crate::plan::Op;
    // 32/8 heads. 16 ranks in nodes of 4: U = 4, where without the node structure it is 8 and
    // each all-to-all would span two nodes.
    let shape = AttnShape::new(1, 4096, 4096, 32, 8, 64).unwrap();
    let mask = Mask::causal(4096, 4096).unwrap();
    for (world, per_node, want) in [(16, 4, 4), (16, 8, 8), (8, 2, 2)] {
        let opts = PlanOptions { ranks_per_node: Some(per_node), ..PlanOptions::forward() };
        assert_eq!(super::default_ulysses_degree(world, &shape, &opts), want);
        let plan = build(Strategy::Hybrid { ulysses_degree: 0 }, world, &shape, &mask, DType::BF16, &opts).unwrap();
        plan.validate().unwrap();
        // Step 0 is the all-to-all inside each Ulysses group: no transfer crosses a node.
        for (r, prog) in plan.ranks.iter().enumerate() {
            for op in &prog.steps[0] {
                if let Op::Comm { sends, .. } = op {
                    for &(to, _) in sends {
                        assert_eq!(r / per_node, to / per_node, "world {world}: rank {r} sends to {to} at step 0");
                    }
                }
            }
        }
    }
    // Without the node structure, 16 ranks pick U = 8.
    assert_eq!(super::default_ulysses_degree(16, &shape, &PlanOptions::forward()), 8);
}

#[test]
fn double_ring_crosses_nodes_once_per_outer_step() {
    // P = 8 as 2 nodes of 4: a ring crosses a node at every step; the double ring's forward
    // only at the start of its first outer step, its backward also to return partials.
    let shape = AttnShape::new(1, 4096, 4096, 8, 8, 64).unwrap();
    let mask = Mask::causal(4096, 4096).unwrap();
    let node = |r: usize| r / 4;
    let crossing_steps = |s: Strategy, opts: &PlanOptions| {
        let plan = build(s, 8, &shape, &mask, DType::BF16, opts).unwrap();
        plan.validate().unwrap();
        let mut steps = std::collections::BTreeSet::new();
        for (r, prog) in plan.ranks.iter().enumerate() {
            for (step, ops) in prog.steps.iter().enumerate() {
                for op in ops {
                    if let crate::plan::Op::Comm { sends, .. } = op {
                        if sends.iter().any(|&(to, _)| node(to) != node(r)) {
                            steps.insert(step);
                        }
                    }
                }
            }
        }
        steps.len()
    };
    let fwd = PlanOptions::forward();
    assert_eq!(crossing_steps(Strategy::Zigzag, &fwd), 7);
    assert_eq!(crossing_steps(Strategy::DoubleRing { inner: 4 }, &fwd), 1);
    let per_node = PlanOptions { ranks_per_node: Some(4), ..PlanOptions::forward() };
    assert_eq!(crossing_steps(Strategy::DoubleRing { inner: 0 }, &per_node), 1, "the node size is the default");
    assert_eq!(super::default_inner_ring(8, None), 4);
    assert_eq!(super::default_inner_ring(7, None), 7);
    assert_eq!(super::default_inner_ring(16, Some(8)), 8);
    let e = build(Strategy::DoubleRing { inner: 3 }, 8, &shape, &mask, DType::BF16, &fwd).unwrap_err();
    assert!(e.to_string().contains("does not divide"), "{e}");
}

#[test]
fn chunked_ulysses_overlaps_each_all_to_all_with_the_previous_chunks_attention() {
    use crate::plan::Op;
    // 2 ranks, 8 KV heads: 4 per rank, in 4 chunks. Step s sends chunk s and attends chunk
    // s − 1; steps 2.. also return chunk s − 2. By default, one chunk: three steps.
    let shape = AttnShape::new(1, 4096, 4096, 32, 8, 64).unwrap();
    let mask = Mask::causal(4096, 4096).unwrap();
    let default = build(Strategy::Ulysses, 2, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
    assert_eq!(default.ranks[0].steps.len(), 3);
    assert_eq!(
        (default.step_labels[0].as_str(), default.step_labels[2].as_str()),
        ("all-to-all in groups of 2", "all-to-all back")
    );
    for pass in [PlanOptions::forward(), PlanOptions::backward(RingBackward::KvCirculate)] {
        let opts = PlanOptions { head_chunks: Some(4), ..pass };
        let plan = build(Strategy::Ulysses, 2, &shape, &mask, DType::BF16, &opts).unwrap();
        plan.validate().unwrap();
        let steps = &plan.ranks[0].steps;
        assert_eq!(steps.len(), 6, "4 chunks: all-to-alls at 0..4, attention at 1..5, back at 2..6");
        for (s, ops) in steps.iter().enumerate() {
            let comms = ops.iter().filter(|op| matches!(op, Op::Comm { .. })).count();
            let blocks = ops.iter().filter(|op| matches!(op, Op::Fwd { .. } | Op::Bwd { .. })).count();
            let sends = usize::from(s < 4) + usize::from((2..6).contains(&s));
            assert_eq!(
                (comms, blocks),
                (sends, usize::from((1..5).contains(&s))),
                "step {s}: {:?}",
                plan.step_labels[s]
            );
        }
    }
}

#[test]
fn estimates_replay_work_and_transfers_on_two_lanes() {
    use crate::plan::Rates;
    let rates = Rates::flat(1e12, 1e9, f64::INFINITY);
    let shape = AttnShape::new(1, 1024, 1024, 8, 8, 64).unwrap();
    let mask = Mask::full(1024, 1024).unwrap();
    let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-9, "{got} ms against {want} ms");
    // One rank: the block's FLOPs at the compute rate.
    let one = build(Strategy::Ring, 1, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
    close(one.estimate(&rates).ms, 4.0 * 1024.0 * 1024.0 * 64.0 * 8.0 / 1e12 * 1e3);
    // Two ranks on a ring: each computes its own 512 × 512 block while its K and V (1 MiB)
    // cross, then the received block: the transfer, not the first block, sets the start.
    let two = build(Strategy::Ring, 2, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
    let block = 4.0 * 512.0 * 512.0 * 64.0 * 8.0 / 1e12 * 1e3;
    let e = two.estimate(&rates);
    for &ms in &e.per_rank_ms {
        close(ms, 1_048_576.0 / 1e9 * 1e3 + block);
    }
    close(e.ms, e.per_rank_ms[0]);
    // A decode row against 64k keys: bound by reading them (K and V, bf16), not by its FLOPs.
    let decode = AttnShape::new(1, 1, 65536, 8, 8, 64).unwrap();
    let rates = Rates::flat(1e12, 1e9, 1e12);
    let plan = build(Strategy::Ring, 1, &decode, &Mask::full(1, 65536).unwrap(), DType::BF16, &PlanOptions::forward())
        .unwrap();
    let kv_bytes = 2.0 * 65536.0 * 8.0 * 64.0 * 2.0;
    let ms = plan.estimate(&rates).ms;
    assert!(ms >= kv_bytes / 1e12 * 1e3 && ms < 1.01 * kv_bytes / 1e12 * 1e3, "{ms} ms");
}

#[test]
fn estimates_charge_each_tile_and_each_transfer_group_a_fixed_cost() {
    use crate::plan::Rates;
    let flat = Rates::flat(1e12, 1e9, f64::INFINITY);
    let rates = Rates { tile_s: 1e-6, backward_tile_s: 3e-6, group_latency_s: 1e-3, ..flat };
    // 1000 queries against 300 keys, 8 heads: 8 query tiles a head forward, 3 key tiles a head
    // backward.
    let shape = AttnShape::new(1, 1000, 300, 8, 8, 64).unwrap();
    let mask = Mask::full(1000, 300).unwrap();
    let ms = |rates: &Rates, pass| {
        build(Strategy::Ring, 1, &shape, &mask, DType::BF16, &PlanOptions::default().with_pass(pass))
            .unwrap()
            .estimate(rates)
            .ms
    };
    let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-9, "{got} ms against {want} ms");
    close(ms(&rates, Pass::Forward), ms(&flat, Pass::Forward) + 8.0 * 8.0 * 1e-3);
    close(ms(&rates, Pass::Backward), ms(&flat, Pass::Backward) + 3.0 * 8.0 * 3e-3);
    // Two ranks of a full-mask ring forward: each computes its own block while its K and V
    // cross, then the received one; the group's latency comes before the received block.
    let shape = AttnShape::new(1, 1024, 1024, 8, 8, 64).unwrap();
    let mask = Mask::full(1024, 1024).unwrap();
    let two = build(Strategy::Ring, 2, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
    let latency_only = Rates { group_latency_s: 1e-3, ..flat };
    close(two.estimate(&latency_only).ms, two.estimate(&flat).ms + 1.0);
}

#[test]
fn estimates_send_between_nodes_at_the_network_rate() {
    use crate::plan::Rates;
    let rates = Rates { network_bytes_per_s: 1e8, ..Rates::flat(1e12, 1e9, f64::INFINITY) };
    // Two ranks of a full-mask ring forward: each computes its own block while its K and V
    // (1 MiB) cross, then the received block; on two nodes the transfer is ten times longer.
    let shape = AttnShape::new(1, 1024, 1024, 8, 8, 64).unwrap();
    let mask = Mask::full(1024, 1024).unwrap();
    let ms = |per_node: Option<usize>| {
        let opts = PlanOptions { ranks_per_node: per_node, ..PlanOptions::forward() };
        let plan = build(Strategy::Ring, 2, &shape, &mask, DType::BF16, &opts).unwrap();
        assert_eq!(plan.ranks_per_node, per_node.filter(|&n| n < 2));
        plan.estimate(&rates).ms
    };
    let block = 4.0 * 512.0 * 512.0 * 64.0 * 8.0 / 1e12 * 1e3;
    let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-9, "{got} ms against {want} ms");
    close(ms(None), 1_048_576.0 / 1e9 * 1e3 + block);
    close(ms(Some(2)), 1_048_576.0 / 1e9 * 1e3 + block);
    close(ms(Some(1)), 1_048_576.0 / 1e8 * 1e3 + block);
    // With a slow network between nodes, auto keeps Ulysses' all-to-alls off it where it can:
    // on one node of 8 ranks it takes Ulysses, on 2 nodes of 4 hybrid (all-to-alls inside
    // nodes, a ring across). (On 8 nodes of one rank Ulysses still moves the fewest bytes.)
    let shape = AttnShape::new(1, 32768, 32768, 32, 8, 128).unwrap();
    let causal = Mask::causal(32768, 32768).unwrap();
    let slow = Rates { network_bytes_per_s: 5e9, ..Rates::default() };
    let opts = PlanOptions { narrow_outputs: true, keep_head_sharded: true, ..PlanOptions::default() };
    let pick = |per_node| {
        let opts = PlanOptions { ranks_per_node: per_node, ..opts.clone() };
        fastest_training(&TRAINING_CANDIDATES, 8, &shape, &causal, DType::BF16, &opts, &slow).unwrap()
    };
    assert_eq!(pick(None), Strategy::Ulysses);
    assert_eq!(pick(Some(4)), Strategy::Hybrid { ulysses_degree: 0 });
}

#[test]
fn pass_q_sends_queries_at_once_and_returns_small_partials_together() {
    use crate::plan::Op;
    // 4 ranks, causal, contiguous: rank r's queries attend ranks 0..=r, so every step from 1
    // computes some owner's queries elsewhere. Returns the (step, phase) of every group that
    // sends something.
    let groups = |n: usize| {
        let shape = AttnShape::new(1, n, n, 32, 8, 128).unwrap();
        let plan =
            build(Strategy::PassQ, 4, &shape, &Mask::causal(n, n).unwrap(), DType::BF16, &PlanOptions::forward())
                .unwrap();
        plan.validate().unwrap();
        let mut groups = std::collections::BTreeSet::new();
        for prog in &plan.ranks {
            for (step, ops) in prog.steps.iter().enumerate() {
                for op in ops {
                    if let Op::Comm { phase, sends, .. } = op {
                        if !sends.is_empty() {
                            groups.insert((step, phase % 16));
                        }
                    }
                }
            }
        }
        groups.into_iter().collect::<Vec<_>>()
    };
    // 1024 queries a rank: an owner's f32 O is 16 MB, small enough to go back at the end.
    assert_eq!(groups(4096), [(1, 0), (3, 1)]);
    // 1025: each partial goes back in the step that computed it.
    assert_eq!(groups(4100), [(1, 0), (1, 1), (2, 1), (3, 1)]);
}

#[test]
fn narrowed_outputs_halve_the_all_to_all_back() {
    let (n, h, kv, d) = (4096u64, 32u64, 8u64, 128u64);
    let shape = AttnShape::new(1, n as usize, n as usize, h as usize, kv as usize, d as usize).unwrap();
    let mask = Mask::causal(n as usize, n as usize).unwrap();
    let bytes = |s, dtype, opts: &PlanOptions| {
        let plan = build(s, 4, &shape, &mask, dtype, opts).unwrap();
        plan.validate().unwrap();
        plan.summary().bytes_moved
    };
    for (pass, out_heads) in [(Pass::Forward, h), (Pass::Backward, h + 2 * kv)] {
        let wide = PlanOptions { pass: Some(pass), ..Default::default() };
        let narrow = PlanOptions { narrow_outputs: true, ..wide.clone() };
        // Ulysses on 4 ranks: each rank returns 3/4 of its outputs (all N tokens of a quarter of
        // the heads), f32 values now sent as bf16.
        let saved = 4 * (n * 3 / 4) * (out_heads / 4) * d * 2;
        assert_eq!(
            bytes(Strategy::Ulysses, DType::BF16, &wide) - bytes(Strategy::Ulysses, DType::BF16, &narrow),
            saved
        );
        let hybrid = Strategy::Hybrid { ulysses_degree: 2 };
        assert!(bytes(hybrid, DType::BF16, &narrow) < bytes(hybrid, DType::BF16, &wide), "{pass:?}");
        // f32 inputs: nothing to narrow to.
        assert_eq!(bytes(Strategy::Ulysses, DType::F32, &narrow), bytes(Strategy::Ulysses, DType::F32, &wide));
    }
}

/// How many times each (token, head) cell of buffer `b` is written by `prog`'s ops: copies and
/// adds into it (the part shared with the source), receives into it or into a piece stored
/// inside it, and blocks that write or round their results into it.
fn writes_per_cell(prog: &RankProgram, b: BufId) -> std::collections::HashMap<(usize, usize), usize> {
    let desc = &prog.bufs[b];
    let cells = |tokens: &TokenSet, heads: &Range<usize>| -> Vec<(usize, usize)> {
        let heads = heads.start.max(desc.heads.start)..heads.end.min(desc.heads.end);
        let tokens = tokens.intersect(&desc.tokens);
        tokens.to_runs().into_iter().flatten().flat_map(|t| heads.clone().map(move |h| (t, h))).collect()
    };
    let whole = || cells(&desc.tokens, &desc.heads);
    let mut counts = std::collections::HashMap::new();
    for op in prog.steps.iter().flatten() {
        let written = match op {
            Op::Copy { src, dst } | Op::Add { src, dst } if *dst == b => {
                cells(&prog.bufs[*src].tokens, &prog.bufs[*src].heads)
            }
            Op::Comm { recvs, .. } => recvs
                .iter()
                .filter(|&&(_, r)| r == b || prog.bufs[r].within == Some(b))
                .flat_map(|&(_, r)| cells(&prog.bufs[r].tokens, &prog.bufs[r].heads))
                .collect(),
            Op::Fwd { o, rounded, .. } if *o == b || *rounded == Some(b) => whole(),
            Op::Merge { o_acc, .. } if *o_acc == b => whole(),
            Op::Bwd { q, dq, dk, dv, rows, .. } if [*dq, *dk, *dv].contains(&b) => match rows {
                Some(rows) if *dq == b => {
                    let runs = prog.bufs[*q].tokens.to_runs().into_iter().flatten().collect::<Vec<_>>();
                    cells(&TokenSet::from_runs(runs[rows.clone()].iter().map(|&t| t..t + 1).collect()), &desc.heads)
                }
                _ => whole(),
            },
            _ => Vec::new(),
        };
        for cell in written {
            *counts.entry(cell).or_insert(0) += 1;
        }
    }
    counts
}

/// With `narrow_outputs` every strategy hands back O, dQ, dK and dV in the input dtype (LSE in
/// f32), each written once; Ulysses holds no f32 O or gradient at all (its kernels write the
/// head-sharded O and gradients in bf16, which the all-to-all back sends), and f32 inputs
/// narrow nothing.
#[test]
fn narrowed_outputs_are_handed_back_in_the_input_dtype() {
    let shape = AttnShape::new(1, 1000, 1000, 8, 4, 64).unwrap();
    let mask = Mask::causal(1000, 1000).unwrap();
    for s in strategies() {
        for pass in [Pass::Forward, Pass::Backward] {
            let opts = PlanOptions { pass: Some(pass), narrow_outputs: true, ..Default::default() };
            for (dtype, narrowed) in [(DType::BF16, true), (DType::F32, false)] {
                let plan = build(s, 4, &shape, &mask, dtype, &opts).unwrap();
                plan.validate().unwrap();
                for prog in &plan.ranks {
                    for &(t, b) in &prog.outputs {
                        assert_eq!(prog.bufs[b].narrow, narrowed && !t.is_stats(), "{s} {pass:?} {dtype:?} {t:?}");
                        if prog.bufs[b].narrow {
                            let counts = writes_per_cell(prog, b);
                            let cells = prog.bufs[b].tokens.len() * prog.bufs[b].heads.len();
                            assert!(
                                counts.len() == cells && counts.values().all(|&n| n == 1),
                                "{s} {pass:?}: {t:?} has {} of {cells} cells written, some {:?} times",
                                counts.len(),
                                counts.values().max()
                            );
                        }
                    }
                }
            }
        }
    }
    let opts = PlanOptions { pass: Some(Pass::Forward), narrow_outputs: true, ..Default::default() };
    let plan = build(Strategy::Ulysses, 4, &shape, &mask, DType::BF16, &opts).unwrap();
    for prog in &plan.ranks {
        assert!(prog.bufs.iter().filter(|d| d.tensor == Tensor::O).all(|d| d.narrow), "{:?}", prog.bufs);
        // Its output is allocated when the all-to-all back writes it, not held through the kernel.
        let out = prog.outputs.iter().find(|(t, _)| *t == Tensor::O).unwrap().1;
        let last = prog.steps.last().unwrap();
        assert!(last.iter().any(|op| matches!(op, Op::Alloc { buf, fill: Fill::Overwritten } if *buf == out)));
    }
    // Its backward writes the gradients in bf16 (no f32 gradient, no zero fill) in the step of
    // the kernel, and sends them from those buffers: no copy reads them before the transfers.
    let bwd = PlanOptions { pass: Some(Pass::Backward), ..opts.clone() };
    let plan = build(Strategy::Ulysses, 4, &shape, &mask, DType::BF16, &bwd).unwrap();
    for prog in &plan.ranks {
        let grads: Vec<BufId> = (0..prog.bufs.len()).filter(|&b| prog.bufs[b].tensor.is_grad()).collect();
        assert!(grads.iter().all(|&b| prog.bufs[b].narrow), "{:?}", prog.bufs);
        let bwd_step = prog.steps.iter().position(|ops| ops.iter().any(|op| matches!(op, Op::Bwd { .. }))).unwrap();
        for ops in &prog.steps[bwd_step..] {
            for op in ops {
                match op {
                    Op::Bwd { dq, dk, dv, .. } => {
                        for g in [dq, dk, dv] {
                            let alloc = Op::Alloc { buf: *g, fill: Fill::Overwritten };
                            assert!(prog.steps[bwd_step].contains(&alloc), "{:?}", prog.steps[bwd_step]);
                        }
                    }
                    Op::Comm { .. } => break,
                    Op::Copy { src, .. } => assert!(!grads.contains(src), "{op:?} before the all-to-all back"),
                    _ => {}
                }
            }
        }
    }
    // A zig-zag rank's last block rounds its O itself: no copy writes the output.
    let mut plan = build(Strategy::Zigzag, 4, &shape, &mask, DType::BF16, &opts).unwrap();
    for prog in &plan.ranks {
        let out = prog.outputs.iter().find(|(t, _)| *t == Tensor::O).unwrap().1;
        let ops: Vec<&Op> = prog.steps.iter().flatten().collect();
        assert!(ops.iter().any(|op| matches!(op, Op::Fwd { rounded: Some(y), .. } if *y == out)));
        assert!(!ops.iter().any(|op| matches!(op, Op::Copy { dst, .. } if *dst == out)));
    }
    // Rounding into a buffer that is not the block's O held narrowed is an invalid plan.
    let prog = &mut plan.ranks[0];
    let lse = prog.outputs.iter().find(|(t, _)| *t == Tensor::Lse).unwrap().1;
    for op in prog.steps.iter_mut().flatten() {
        if let Op::Fwd { rounded: Some(y), .. } = op {
            *y = lse;
        }
    }
    assert!(matches!(plan.validate(), Err(crate::Error::InvalidPlan(_))));
}

#[test]
fn kept_head_sharded_inputs_leave_the_backward_only_do_and_d_to_send() {
    let (n, h, kv, d) = (4096u64, 32u64, 8u64, 128u64);
    let shape = AttnShape::new(1, n as usize, n as usize, h as usize, kv as usize, d as usize).unwrap();
    let mask = Mask::causal(n as usize, n as usize).unwrap();
    let plan = |s, pass, keep| {
        let opts = PlanOptions { pass: Some(pass), keep_head_sharded: keep, ..Default::default() };
        let plan = build(s, 4, &shape, &mask, DType::BF16, &opts).unwrap();
        plan.validate().unwrap();
        plan
    };
    for s in [Strategy::Ulysses, Strategy::Hybrid { ulysses_degree: 2 }] {
        // The forward moves what it moved, and hands back Q, K, V and LSE as the backward takes them.
        let (fwd, kept) = (plan(s, Pass::Forward, false), plan(s, Pass::Forward, true));
        assert_eq!(kept.summary().bytes_moved, fwd.summary().bytes_moved, "{s}");
        let bwd = plan(s, Pass::Backward, true);
        for (fr, br) in kept.ranks.iter().zip(&bwd.ranks) {
            let saved: Vec<_> = fr.saved.iter().map(|&(t, b)| (t, fr.bufs[b].clone())).collect();
            let wanted: Vec<_> = br
                .inputs
                .iter()
                .filter(|(t, _)| matches!(t, Tensor::Q | Tensor::K | Tensor::V | Tensor::Lse))
                .map(|&(t, b)| (t, br.bufs[b].clone()))
                .collect();
            assert_eq!(saved, wanted, "{s}");
        }
        assert!(fwd.ranks.iter().all(|r| r.saved.is_empty()));
    }
    // Ulysses' backward then sends only dO (bf16) and D (f32) to head sharding: 3/4 of each
    // rank's, and its gradients back as before.
    let (all, kept) = (plan(Strategy::Ulysses, Pass::Backward, false), plan(Strategy::Ulysses, Pass::Backward, true));
    let per_rank_tokens = n / 4;
    let q_kv_lse = 4 * 3 * per_rank_tokens / 4 * ((h + 2 * kv) * d * 2 + h * 4);
    assert_eq!(all.summary().bytes_moved - kept.summary().bytes_moved, q_kv_lse);
}

#[test]
fn fastest_training_takes_dispatch_for_documents_and_passes_over_what_cannot_plan() {
    let n = 32768;
    let shape = AttnShape::new(1, n, n, 32, 8, 128).unwrap();
    let pick = |shape: &AttnShape, mask: &Mask, candidates: &[Strategy]| {
        fastest_training(candidates, 4, shape, mask, DType::BF16, &PlanOptions::default(), &Rates::default())
    };
    let docs = Mask::documents(&long_tailed_doc_lens(n, 1), DocKind::Causal).unwrap();
    assert_eq!(pick(&shape, &docs, &TRAINING_CANDIDATES).unwrap(), Strategy::Dispatch);
    // Causal: all-gather's two blocks a rank launch half the tiles of zigzag's four, and without
    // kept inputs Ulysses' backward sends Q, K and V again (4 × H200 measured all-gather fastest
    // here, 15.03 ms against zigzag's 15.72 and Ulysses' 15.49).
    let causal = Mask::causal(n, n).unwrap();
    assert_eq!(pick(&shape, &causal, &TRAINING_CANDIDATES).unwrap(), Strategy::Allgather);
    // 2 KV heads do not split over 4 ranks: Ulysses is passed over, alone it is the error.
    let few = AttnShape::new(1, n, n, 8, 2, 128).unwrap();
    assert!(pick(&few, &causal, &TRAINING_CANDIDATES).is_ok());
    let e = pick(&few, &causal, &[Strategy::Ulysses]).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    let e = pick(&shape, &causal, &[]).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument { what, .. } if what == "candidates"), "{e}");
}

#[test]
fn ring_backward_cuts_each_own_block_between_the_first_and_last_steps() {
    let shape = AttnShape::new(1, 32768, 32768, 32, 8, 128).unwrap();
    let mask = Mask::causal(32768, 32768).unwrap();
    for (strategy, rb) in [
        (Strategy::Zigzag, RingBackward::KvCirculate),
        (Strategy::Zigzag, RingBackward::QCirculate),
        (Strategy::Ring, RingBackward::KvCirculate),
    ] {
        let plan = build(strategy, 4, &shape, &mask, DType::BF16, &PlanOptions::backward(rb)).unwrap();
        plan.validate().unwrap();
        let last = plan.steps() - 1;
        for (r, prog) in plan.ranks.iter().enumerate() {
            let parts = |t: usize| -> Vec<(usize, std::ops::Range<usize>, u64)> {
                prog.steps[t]
                    .iter()
                    .enumerate()
                    .filter_map(|(i, op)| match op {
                        Op::Bwd { rows: Some(rows), area, .. } => Some((i, rows.clone(), *area)),
                        _ => None,
                    })
                    .collect()
            };
            let (first, rest) = (parts(0), parts(last));
            assert_eq!((first.len(), rest.len()), (1, 1), "{strategy} {rb:?} rank {r}");
            let (a, b) = (&first[0], &rest[0]);
            let n = plan.layout.tokens(Tensor::Q, r).len();
            assert_eq!((a.1.start, a.1.end, b.1.start, b.1.end), (0, b.1.start, a.1.end, n));
            assert_eq!(a.1.end % builder::Builder::SPLIT_ROWS, 0);
            // Halves of the own block's work, to the cut's granularity.
            let own = area(&mask, plan.layout.tokens(Tensor::Q, r), plan.layout.tokens(Tensor::K, r));
            assert_eq!(a.2 + b.2, own);
            assert!(a.2.abs_diff(b.2) as f64 <= 0.05 * own as f64, "{strategy} rank {r}: {} vs {}", a.2, b.2);
            // At the last step the visiting block runs first, so its partial travels beside
            // the own block's second half.
            let visiting = prog.steps[last].iter().position(|op| matches!(op, Op::Bwd { rows: None, .. }));
            if let Some(v) = visiting {
                assert!(v < b.0, "{strategy} rank {r}");
            }
        }
    }
    // One rank: nothing to overlap, no cut.
    let one = build(Strategy::Zigzag, 1, &shape, &mask, DType::BF16, &PlanOptions::backward(RingBackward::KvCirculate))
        .unwrap();
    assert!(one.ranks[0].steps.iter().flatten().all(|op| !matches!(op, Op::Bwd { rows: Some(_), .. })));
}

#[test]
fn validation_refuses_block_rows_outside_the_block() {
    let shape = AttnShape::new(1, 4096, 4096, 8, 8, 64).unwrap();
    let mask = Mask::causal(4096, 4096).unwrap();
    let mut plan =
        build(Strategy::Zigzag, 2, &shape, &mask, DType::BF16, &PlanOptions::backward(RingBackward::KvCirculate))
            .unwrap();
    let op = plan.ranks[0].steps[0].iter_mut().find(|op| matches!(op, Op::Bwd { .. })).unwrap();
    if let Op::Bwd { rows, .. } = op {
        *rows = Some(0..4096);
    }
    let err = plan.validate().unwrap_err().to_string();
    assert!(err.contains("query rows 0..4096 of a block of 2048 rows"), "{err}");
}

#[test]
fn ulysses_receives_contiguous_pieces_straight_into_the_gathered_buffers() {
    let mask = Mask::causal(4096, 4096).unwrap();
    for batch in [1, 2] {
        let shape = AttnShape::new(batch, 4096, 4096, 8, 4, 64).unwrap();
        for (opts, tensors) in [
            (PlanOptions::forward(), vec![Tensor::Q, Tensor::K, Tensor::V]),
            (PlanOptions::backward(RingBackward::KvCirculate), vec![Tensor::Q, Tensor::K, Tensor::V, Tensor::DO]),
        ] {
            let plan = build(Strategy::Ulysses, 4, &shape, &mask, DType::BF16, &opts).unwrap();
            plan.validate().unwrap();
            for prog in &plan.ranks {
                let ops: Vec<&Op> = prog.steps.iter().flatten().collect();
                let in_place: Vec<Tensor> = ops
                    .iter()
                    .flat_map(|op| match op {
                        Op::Comm { recvs, .. } => recvs.clone(),
                        _ => Vec::new(),
                    })
                    .filter(|&(_, b)| prog.bufs[b].within.is_some())
                    .map(|(_, b)| prog.bufs[b].tensor)
                    .collect();
                if batch == 1 {
                    // From each of the 3 peers, every tensor whose piece is a run of the gathered
                    // rows; LSE and D (rows per head) are still copied.
                    let mut want: Vec<Tensor> = tensors.iter().flat_map(|&t| [t; 3]).collect();
                    let mut got = in_place.clone();
                    want.sort_by_key(|t| *t as usize);
                    got.sort_by_key(|t| *t as usize);
                    assert_eq!(got, want);
                    // Nothing copies out of a piece received in place.
                    assert!(ops
                        .iter()
                        .all(|op| !matches!(op, Op::Copy { src, .. } if prog.bufs[*src].within.is_some())));
                } else {
                    // Two batch entries: a run of tokens is two runs of memory, so it is copied.
                    assert!(in_place.is_empty());
                }
            }
        }
    }
}

#[test]
fn validation_refuses_a_buffer_inside_another_that_is_not_a_contiguous_part() {
    let shape = AttnShape::new(1, 4096, 4096, 8, 4, 64).unwrap();
    let mask = Mask::causal(4096, 4096).unwrap();
    let plan = build(Strategy::Ulysses, 2, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
    let view = plan.ranks[0].bufs.iter().position(|d| d.within.is_some()).unwrap();
    // Heads the parent does not have.
    let mut bad = plan.clone();
    bad.ranks[0].bufs[view].heads = 0..1;
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("is not a contiguous part of buffer"), "{err}");
    // Read by something other than a transfer.
    let mut bad = plan.clone();
    let parent = bad.ranks[0].bufs[view].within.unwrap();
    bad.ranks[0].steps[0].push(Op::Copy { src: view, dst: parent });
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("is used other than by a transfer"), "{err}");
}

#[test]
fn allgather_runs_one_gathered_block_a_rank_without_copies_and_gathers_only_what_queries_see() {
    let shape = AttnShape::new(1, 1000, 1000, 8, 4, 64).unwrap();
    let causal = Mask::causal(1000, 1000).unwrap();
    for (pass, world) in [(PlanOptions::forward(), 4), (PlanOptions::backward(RingBackward::KvCirculate), 3)] {
        let plan = build(Strategy::Allgather, world, &shape, &causal, DType::BF16, &pass).unwrap();
        plan.validate().unwrap();
        assert_eq!(plan.steps(), 1);
        for (r, prog) in plan.ranks.iter().enumerate() {
            let ops = &prog.steps[0];
            let blocks = ops.iter().filter(|op| matches!(op, Op::Fwd { .. } | Op::Bwd { .. })).count();
            // Backward cuts the own block in two around the gathered one.
            let want = if plan.pass == Pass::Forward { 2 } else { 3 };
            assert_eq!(blocks, want, "rank {r}: its own block and the gathered one");
            // Forward: one gather; backward: the gather and the partials' return.
            let comms = ops.iter().filter(|op| matches!(op, Op::Comm { .. })).count();
            assert_eq!(comms, if plan.pass == Pass::Forward { 1 } else { 2 }, "rank {r}");
            // Every piece is sent from inside the buffer that holds it and received into the one
            // that gathers it (a returned partial is added where it lands).
            assert!(!ops.iter().any(|op| matches!(op, Op::Copy { .. })), "rank {r}: {ops:?}");
        }
    }
    // A window of 20 tokens on 4 ranks of 2 chunks of 125 (rank r: chunks r and 7 - r): each
    // rank needs the K/V of the ranks holding the chunks just before its own, 6 of the 12
    // (owner, needer) pairs a causal mask needs.
    let window = Mask::sliding_window(1000, 1000, Some(20), Some(0)).unwrap();
    let bytes = |m: &Mask| {
        build(Strategy::Allgather, 4, &shape, m, DType::BF16, &PlanOptions::forward()).unwrap().summary().bytes_moved
    };
    assert_eq!(2 * bytes(&window), bytes(&causal), "window {} causal {}", bytes(&window), bytes(&causal));
}

#[test]
fn validation_refuses_a_send_from_inside_a_freed_buffer() {
    let shape = AttnShape::new(1, 1000, 1000, 8, 4, 64).unwrap();
    let mask = Mask::causal(1000, 1000).unwrap();
    let opts = PlanOptions::backward(RingBackward::KvCirculate);
    let plan = build(Strategy::Allgather, 3, &shape, &mask, DType::BF16, &opts).unwrap();
    plan.validate().unwrap();
    // Rank 0 sends runs of its K from inside it (and returns partials from inside its partial
    // buffer): free the buffer of the first such send just before its group.
    let prog = &plan.ranks[0];
    let (at, parent) = prog.steps[0]
        .iter()
        .enumerate()
        .find_map(|(i, op)| match op {
            Op::Comm { sends, .. } => sends.iter().find_map(|&(_, b)| prog.bufs[b].within).map(|p| (i, p)),
            _ => None,
        })
        .expect("a send from inside a buffer");
    let mut bad = plan.clone();
    bad.ranks[0].steps[0].insert(at, Op::Free { buf: parent });
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("after it is freed"), "{err}");
}

#[test]
fn a_gather_sends_few_pieces_a_peer_pair_over_many_documents() {
    // 70 packed documents: a zig-zag rank holds 70-140 runs of tokens; sent run by run, each
    // peer pair exchanged about 280 pieces in one NCCL group, which never completed on GPUs.
    let n = 32768;
    let lens = long_tailed_doc_lens(n, 1);
    let mask = Mask::documents(&lens, DocKind::Causal).unwrap();
    let shape = AttnShape::new(1, n, n, 32, 8, 128).unwrap();
    for s in [Strategy::Allgather, Strategy::Dispatch] {
        for opts in [PlanOptions::forward(), PlanOptions::backward(RingBackward::KvCirculate)] {
            let plan = build(s, 4, &shape, &mask, DType::BF16, &opts).unwrap();
            plan.validate().unwrap_or_else(|e| panic!("{s}: {e}"));
        }
    }
    // Validation refuses a group that sends one peer more than the limit.
    let mut bad = build(Strategy::Allgather, 4, &shape, &mask, DType::BF16, &PlanOptions::forward()).unwrap();
    let Some(Op::Comm { sends, .. }) = bad.ranks[0].steps[0].iter_mut().find(|op| matches!(op, Op::Comm { .. })) else {
        panic!("rank 0 has no transfer group");
    };
    let first = sends[0];
    sends.extend(std::iter::repeat_n(first, crate::plan::MAX_SENDS_TO_A_PEER));
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("buffers to rank"), "{err}");
}

#[test]
fn a_plan_with_an_unmatched_receive_or_a_broken_shape_is_invalid_not_a_hang_or_panic() {
    let shape = AttnShape::new(1, 64, 64, 4, 2, 16).unwrap();
    let mask = Mask::causal(64, 64).unwrap();
    let plan = build(Strategy::Ring, 2, &shape, &mask, DType::F32, &PlanOptions::default()).unwrap();
    plan.validate().unwrap();
    // Rank 0 stops sending: rank 1's receives would wait forever.
    let mut unsent = plan.clone();
    for op in unsent.ranks[0].steps.iter_mut().flatten() {
        if let Op::Comm { sends, .. } = op {
            sends.clear();
        }
    }
    let err = unsent.validate().unwrap_err();
    assert!(err.to_string().contains("never sends it"), "{err}");
    // A plan read from a file with no KV heads: an error, not a division by zero.
    let mut headless = plan;
    headless.shape.kv_heads = 0;
    assert!(matches!(headless.validate(), Err(crate::Error::InvalidPlan(_))));
}

#[test]
fn dispatch_chunks_that_leave_a_rank_empty_are_an_error() {
    let shape = AttnShape::new(1, 64, 64, 4, 2, 16).unwrap();
    let mask = Mask::causal(64, 64).unwrap();
    let with_chunk = |c| PlanOptions { chunk_tokens: Some(c), ..PlanOptions::default() };
    let err = build(Strategy::Dispatch, 4, &shape, &mask, DType::F32, &with_chunk(64)).unwrap_err();
    assert!(matches!(&err, Error::InvalidArgument { what, .. } if what == "chunk_tokens"), "{err}");
    build(Strategy::Dispatch, 4, &shape, &mask, DType::F32, &with_chunk(16)).unwrap().validate().unwrap();
    // Fewer queries than ranks (cross attention): dispatch cannot run it, whatever the chunks.
    let few = AttnShape::new(1, 3, 116, 4, 2, 16).unwrap();
    let err = build(Strategy::Dispatch, 4, &few, &Mask::causal(3, 116).unwrap(), DType::F32, &PlanOptions::default())
        .unwrap_err();
    assert!(matches!(&err, Error::Unsupported { strategy, .. } if strategy == "dispatch"), "{err}");
}
