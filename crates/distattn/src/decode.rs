//! Decode attention over a KV cache, paged or contiguous: a few query rows per request (plain
//! decode, speculative and chunked steps) against each request's cached keys, the requests' work
//! split evenly over the device's workers (stream-K, as Lean Attention) and partials merged by
//! LSE (natural log). The types and the split are those of `distattn_core::decode`; [`decode`] and
//! [`append_kv`] run on the CPU, and the CUDA backend runs the same step on a GPU
//! (`distattn_cuda::decode`; from Python, `distattn.flash_attn_with_kvcache`).
//!
//! ```
//! use distattn::decode::{append_kv, decode, DecodeOptions, DecodeShape, PagedCache, PagedLayout};
//!
//! // Two requests, 8 query heads sharing 2 KV heads, head dim 64, pages of 16 tokens.
//! let layout = PagedLayout::new(8, 16, 2, 64)?;
//! let (mut k_cache, mut v_cache) = (vec![0.5f32; layout.elems()], vec![0.25f32; layout.elems()]);
//! let page_table = [0, 1, 2, 3, 4, 5, 6, 7]; // [batch, max_pages]: request 0 pages 0-3, 1 pages 4-7
//! let mut lengths = vec![20, 3];
//!
//! // One step: append each request's new token, then attend with its query.
//! let shape = DecodeShape::new(2, 1, 8, 2, 64)?;
//! let (k_new, v_new) = (vec![0.1f32; 2 * 2 * 64], vec![1.0f32; 2 * 2 * 64]);
//! append_kv(&mut k_cache, &mut v_cache, &layout, &page_table, &lengths, &k_new, &v_new, 1)?;
//! lengths.iter_mut().for_each(|l| *l += 1);
//! let q = vec![0.2f32; shape.q_elems()];
//! let opts = DecodeOptions { causal: true, ..Default::default() };
//! let cache = PagedCache { k: &k_cache, v: &v_cache, layout, page_table: &page_table, lengths: &lengths };
//! let out = decode(&q, &cache, &shape, &opts, 4)?;
//! assert_eq!(out.lse.len(), shape.lse_elems()); // [batch, heads, q_rows], natural log
//! # Ok::<(), distattn::Error>(())
//! ```
//!
//! A cache spread over several ranks (DistAttention): a step of requests `(home, cached, new)`
//! is one packed problem placed where the cache lives ([`crate::kv_placement`]), planned with
//! pass-q (the queries travel) and run on the ranks through the one interpreter:
//!
//! ```
//! use distattn::kv_placement::{KvPlacement, Queries, ServingStep, StepRequest};
//! use distattn::{Attention, Execution, PlanOptions, Ranks, Strategy};
//!
//! let placement = KvPlacement::interleaved(16, 4)?; // pages of 16 tokens over 4 ranks
//! let requests = [StepRequest { home: 0, cached: 500, new: 1 }, StepRequest { home: 3, cached: 90, new: 1 }];
//! let step = ServingStep::new(&placement, &requests, Queries::AtHome, 8, 2, 64)?;
//! let mut ranks = Ranks::new(4, Strategy::PassQ);
//! ranks.plan = PlanOptions { layout: Some(step.layout.clone()), ..Default::default() };
//! let attn = Attention::new(step.shape, step.mask)?.on(Execution::CpuRanks(ranks));
//! let (q, kv) = (vec![0.1f32; step.shape.q_elems()], vec![0.2f32; step.shape.kv_elems()]);
//! let out = attn.forward(&q, &kv, &kv)?; // O of both new tokens, [1, 2, 8, 64]
//! assert_eq!(out.o.len(), 2 * 8 * 64);
//! # Ok::<(), distattn::Error>(())
//! ```

pub use distattn_core::decode::*;
pub use distattn_cpu::decode::{append_kv, decode};
