//! The README's library example (`cargo run --release -p distattn --example quickstart`);
//! `tests/readme.rs` checks that the README shows this file's code.

use distattn::{Attention, AttnShape, Execution, Mask, Ranks, Strategy};

fn main() -> Result<(), distattn::Error> {
    // batch, q_len, k_len, heads, kv_heads (GQA: 4 query heads per KV head), head_dim
    let shape = AttnShape::new(1, 2048, 2048, 8, 2, 64)?;
    let mask = Mask::documents(&[500, 1548], distattn::mask::DocKind::Causal)?; // two packed documents
    let values =
        |n: usize, seed: usize| (0..n).map(|i| ((i * 7919 + seed) % 1000) as f32 / 500.0 - 1.0).collect::<Vec<f32>>();
    let q = values(shape.q_elems(), 1); // [batch, q_len, heads, head_dim]
    let k = values(shape.kv_elems(), 2); // [batch, k_len, kv_heads, head_dim], like v
    let v = values(shape.kv_elems(), 3);
    let d_o = values(shape.q_elems(), 4); // the gradient of a loss with respect to O

    // On the CPU (the default); the same call takes bf16 or f16 slices.
    let attn = Attention::new(shape, mask)?;
    let fwd = attn.forward(&q, &k, &v)?; // O [b, n, h, d] and LSE [b, h, n] (natural log)
    let grads = attn.backward(&q, &k, &v, &fwd, &d_o)?; // dQ, dK, dV

    // The same attention split across 4 in-process ranks by DistFlashAttn's balanced schedule;
    // Execution::cuda(0) and Execution::GpuRanks (features cuda, nccl) run it on GPUs.
    let ranks = attn.clone().on(Execution::CpuRanks(Ranks::new(4, Strategy::Balanced)));
    let same = ranks.forward(&q, &k, &v)?;
    let diff = same.o.iter().zip(&fwd.o).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("O[..3] = {:?}, dK[..3] = {:?}", &fwd.o[..3], &grads.dk[..3]);
    println!("4 ranks differ from one call by at most {diff:.1e}");
    Ok(())
}
