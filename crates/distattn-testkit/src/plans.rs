//! Every strategy's plans run on some ranks, against the f64 reference: the matrix the GPU
//! tests share, whatever moves the data between their ranks (device copies of one process,
//! NCCL). The caller supplies the runner: it opens `world` ranks once and runs every prepared
//! plan on them in turn, returning each rank's output shards per plan.

use crate::compare::{lse_err, rel_err};
use crate::random::{cast, randn, seeded_rng};
use crate::reference;
use distattn_core::mask::{long_tailed_doc_lens, DocKind};
use distattn_core::plan::{Pass, RingBackward};
use distattn_core::planner::build;
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask, PlanOptions, Result, Strategy};
use distattn_exec::{gather_forward, gather_grads, prepare_all, BackwardTensors, HostTensors, PreparedRank, Shard};
use half::bf16;

/// Relative error bound of the bf16 kernels against f64 on the stored inputs.
pub const TOL: f64 = 1e-2;
/// The LSE is f32 throughout.
pub const LSE_TOL: f64 = 1e-3;

/// One plan of the matrix: every rank's prepared program, and what it is.
pub struct PlanRun {
    pub label: String,
    pub ranks: Vec<PreparedRank>,
}

/// Runs `runs` on `world` ranks with these host tensors; returns, per rank in rank order, the
/// output shards of every run in order.
pub type Runner<'a> = dyn Fn(usize, &[PlanRun], &HostTensors<'_, bf16>) -> Result<Vec<Vec<Vec<Shard>>>> + 'a;

/// The masks of the matrix over `n` tokens (with the document lengths of the one with
/// documents, for the document-aware layout).
fn masks(n: usize) -> Vec<(&'static str, Mask, Option<Vec<usize>>)> {
    let docs = long_tailed_doc_lens(n, 5);
    vec![
        ("causal", Mask::causal(n, n).unwrap_or_else(|e| panic!("{e}")), None),
        ("full", Mask::full(n, n).unwrap_or_else(|e| panic!("{e}")), None),
        ("window", Mask::sliding_window(n, n, Some(200), Some(0)).unwrap_or_else(|e| panic!("{e}")), None),
        ("docs", Mask::documents(&docs, DocKind::Causal).unwrap_or_else(|e| panic!("{e}")), Some(docs)),
    ]
}

/// Every strategy × mask × pass (and both ring backwards), also with outputs narrowed to bf16
/// (Ulysses and hybrid also with kept head-sharded inputs), at head dims 64 and 128 on each of
/// `worlds`, bf16, 1000 tokens (not divisible by 2P), 8 query and 4 KV heads, against the f64
/// reference. Panics with every failing case, naming the seed.
pub fn check_every_strategy(test: &str, worlds: &[usize], runner: &Runner<'_>) {
    let (mut rng, seed) = seeded_rng(test);
    let n = 1000;
    let masks = masks(n);
    let opts = AttnOptions::default();
    let mut failures = Vec::new();
    let mut count = 0;
    // Cases a strategy refuses (Ulysses where the KV heads do not divide by the world), listed;
    // every strategy must run somewhere.
    let mut refused = Vec::new();
    let mut ran = std::collections::HashSet::new();
    for d in [64, 128] {
        let shape = AttnShape::new(1, n, n, 8, 4, d).unwrap_or_else(|e| panic!("{e}"));
        let q: Vec<bf16> = cast(&randn(&mut rng, shape.q_elems(), 1.0));
        let k: Vec<bf16> = cast(&randn(&mut rng, shape.kv_elems(), 1.0));
        let v: Vec<bf16> = cast(&randn(&mut rng, shape.kv_elems(), 1.0));
        let d_o: Vec<bf16> = cast(&randn(&mut rng, shape.q_elems(), 1.0));
        let refs: Vec<_> = masks
            .iter()
            .map(|(_, m, _)| {
                let f = reference::forward(&q, &k, &v, &shape, m, &opts).unwrap_or_else(|e| panic!("{e}"));
                let g = reference::backward(&q, &k, &v, &d_o, &shape, m, &opts).unwrap_or_else(|e| panic!("{e}"));
                // The backward's O and LSE, as a forward would hand them on.
                let to32 = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<_>>();
                (to32(&f.o), to32(&f.lse), f, g)
            })
            .collect();
        for &world in worlds {
            for (mi, (mname, mask, docs)) in masks.iter().enumerate() {
                let mut runs = Vec::new();
                for strategy in Strategy::ALL {
                    let mut passes =
                        vec![(Pass::Forward, RingBackward::KvCirculate), (Pass::Backward, RingBackward::KvCirculate)];
                    if strategy.is_ring() {
                        passes.push((Pass::Backward, RingBackward::QCirculate));
                    }
                    // Every strategy also with its outputs handed back in bf16; Ulysses and hybrid
                    // also with the backward given Q, K, V, LSE head-sharded as a forward keeps them.
                    let grouped = matches!(strategy, Strategy::Ulysses | Strategy::Hybrid { .. });
                    let variants: &[(bool, bool)] = if grouped {
                        &[(false, false), (true, false), (false, true)]
                    } else {
                        &[(false, false), (true, false)]
                    };
                    let passes = passes.into_iter().flat_map(|p| variants.iter().map(move |&v| (p, v)));
                    for ((pass, rb), (narrow_outputs, keep_head_sharded)) in passes {
                        let popts = PlanOptions {
                            pass: Some(pass),
                            ring_backward: rb,
                            documents: docs.clone(),
                            narrow_outputs,
                            keep_head_sharded,
                            ..Default::default()
                        };
                        let plan = match build(strategy, world, &shape, mask, DType::BF16, &popts) {
                            Ok(p) => p,
                            Err(e @ Error::Unsupported { .. }) => {
                                refused.push(format!("d{d} P={world} {mname} {strategy} {pass:?}: {e}"));
                                continue;
                            }
                            Err(e) => panic!("{strategy} {mname}: {e}"),
                        };
                        let ranks = prepare_all(&plan, mask).unwrap_or_else(|e| panic!("{e}"));
                        ran.insert(strategy.to_string());
                        let variant = match (narrow_outputs, keep_head_sharded) {
                            (true, _) => " narrowed",
                            (_, true) => " kept head-sharded",
                            _ => "",
                        };
                        let label = format!("d{d} P={world} {mname:<7} {strategy:<10} {pass:?} {rb:?}{variant}");
                        runs.push(PlanRun { label, ranks });
                    }
                }
                let (o, lse, rf, rg) = &refs[mi];
                let full = HostTensors { q: &q, k: &k, v: &v, backward: Some(BackwardTensors { o, lse, d_o: &d_o }) };
                let per_rank = runner(world, &runs, &full)
                    .unwrap_or_else(|e| panic!("d{d} P={world} {mname}: {e} (DISTATTN_SEED={seed})"));
                for (i, run) in runs.iter().enumerate() {
                    let shards = per_rank.iter().flat_map(|r| r[i].clone());
                    let errs = if run.ranks[0].pass == Pass::Forward {
                        let f = gather_forward(&shape, shards);
                        vec![("O", rel_err(&f.o, &rf.o), TOL), ("LSE", lse_err(&f.lse, &rf.lse), LSE_TOL)]
                    } else {
                        let g = gather_grads(&shape, shards);
                        vec![
                            ("dQ", rel_err(&g.dq, &rg.dq), TOL),
                            ("dK", rel_err(&g.dk, &rg.dk), TOL),
                            ("dV", rel_err(&g.dv, &rg.dv), TOL),
                        ]
                    };
                    let line = errs.iter().map(|(w, e, _)| format!("{w} {e:.2e}")).collect::<Vec<_>>().join(", ");
                    let ok = errs.iter().all(|(_, e, tol)| e <= tol);
                    println!("{}  {line}  {}", run.label, if ok { "ok" } else { "FAIL" });
                    count += 1;
                    if !ok {
                        failures.push(format!("{}: {line}", run.label));
                    }
                }
            }
        }
    }
    if !refused.is_empty() {
        println!("{} cases refused:\n{}", refused.len(), refused.join("\n"));
    }
    let never: Vec<String> = Strategy::ALL.iter().map(|s| s.to_string()).filter(|s| !ran.contains(s)).collect();
    assert!(never.is_empty(), "strategies that ran in no case: {never:?}");
    assert!(
        failures.is_empty(),
        "{} of {count} plans fail (DISTATTN_SEED={seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!("{count} plans within {TOL:.0e} of the f64 reference");
}
