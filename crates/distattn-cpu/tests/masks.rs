//! Forward and backward against the f64 reference for every mask constructor of core.

mod common;
use common::*;
use distattn_core::{mask::DocKind, AttnShape, DType, Mask};
use rand::Rng;

fn all_masks(rng: &mut rand::rngs::StdRng) -> Vec<(String, usize, usize, Mask)> {
    let mut m: Vec<(String, usize, usize, Mask)> = Vec::new();
    let n = 150;
    let mut add = |name: &str, q: usize, k: usize, mask: Mask| m.push((name.to_string(), q, k, mask));
    add("full", 70, 150, Mask::full(70, 150).unwrap());
    add("causal square", n, n, Mask::causal(n, n).unwrap());
    add("causal q<k", 45, 150, Mask::causal(45, 150).unwrap());
    add("causal q>k", 150, 45, Mask::causal(150, 45).unwrap());
    add("sliding window", n, n, Mask::sliding_window(n, n, Some(20), Some(7)).unwrap());
    add("sliding window causal q<k", 60, 130, Mask::sliding_window(60, 130, Some(33), Some(0)).unwrap());
    add("window+global", n, n, Mask::window_global(n, Some(9), Some(9), 5).unwrap());
    add("documents full", n, n, Mask::documents(&[40, 1, 66, 43], DocKind::Full).unwrap());
    add("documents causal", n, n, Mask::documents(&[17, 80, 2, 51], DocKind::Causal).unwrap());
    add("documents qk causal", 30, 150, Mask::documents_qk(&[10, 0, 20], &[50, 40, 60], DocKind::Causal).unwrap());
    add("prefix-lm", n, n, Mask::prefix_lm(n, 37).unwrap());
    add("prefix-lm documents", n, n, Mask::prefix_lm_documents(&[(60, 10), (90, 0)]).unwrap());
    add("shared question", n, n, Mask::shared_question(30, &[50, 41, 29]).unwrap());
    add("block causal", n, n, Mask::block_causal(n, 24).unwrap());
    add("block causal documents", n, n, Mask::block_causal_documents(&[70, 80], 16).unwrap());
    let (bq, bk) = (32, 20);
    let keep: Vec<bool> = (0..n.div_ceil(bq) * n.div_ceil(bk)).map(|_| rng.random_bool(0.4)).collect();
    add("block mask", n, n, Mask::block_mask(n, n, bq, bk, &keep).unwrap());
    m
}

#[test]
fn every_mask_f32_against_reference() {
    let (mut rng, seed) = rng("every_mask_f32_against_reference");
    for (name, nq, nk, mask) in all_masks(&mut rng) {
        let shape = AttnShape::new(1, nq, nk, 2, 1, 32).unwrap();
        let x = inputs(&mut rng, &shape);
        for tiles in tile_configs(32) {
            check(&name, seed, DType::F32, &x, &shape, &mask, tiles);
        }
    }
}

#[test]
fn every_mask_half_types_against_reference() {
    let (mut rng, seed) = rng("every_mask_half_types_against_reference");
    for (name, nq, nk, mask) in all_masks(&mut rng) {
        let shape = AttnShape::new(1, nq, nk, 2, 2, 64).unwrap();
        let x = inputs(&mut rng, &shape);
        for dtype in [DType::BF16, DType::F16] {
            check(&name, seed, dtype, &x, &shape, &mask, TileConfig::for_head_dim(64));
        }
    }
}

use distattn_cpu::TileConfig;
