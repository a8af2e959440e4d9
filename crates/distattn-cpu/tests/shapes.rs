//! Dtypes, GQA ratios, awkward lengths and head dims against the f64 reference, plus
//! proptest over random shapes and masks.

mod common;
use common::*;
use distattn_core::{AttnShape, DType, Mask};
use distattn_cpu::TileConfig;
use proptest::prelude::*;

#[test]
fn dtypes_and_gqa_ratios() {
    let (mut rng, seed) = rng("dtypes_and_gqa_ratios");
    // (heads, kv_heads): MHA, GQA 2, GQA 4, MQA
    for (h, kvh) in [(2, 2), (4, 2), (4, 1), (3, 1), (8, 2)] {
        let shape = AttnShape::new(2, 37, 53, h, kvh, 32).unwrap();
        let x = inputs(&mut rng, &shape);
        for mask in [Mask::causal(37, 53).unwrap(), Mask::full(37, 53).unwrap()] {
            for dtype in DType::ALL {
                for tiles in tile_configs(32) {
                    check(&format!("gqa {h}/{kvh}"), seed, dtype, &x, &shape, &mask, tiles);
                }
            }
        }
    }
}

#[test]
fn awkward_lengths() {
    // k_len = 1 makes dS = dP − D exactly zero in exact arithmetic, so dK is pure f32
    // rounding noise (common::errors measures it against dV's scale).
    let (mut rng, seed) = rng("awkward_lengths");
    for (nq, nk) in [
        (1, 1),
        (1, 17),
        (17, 17),
        (1, 129),
        (129, 129),
        (129, 17),
        (17, 129),
        (100, 37),
        (2, 200),
        (200, 3),
        (3, 1),
        (40, 1),
    ] {
        let shape = AttnShape::new(1, nq, nk, 2, 1, 64).unwrap();
        let x = inputs(&mut rng, &shape);
        for mask in [
            Mask::causal(nq, nk).unwrap(),
            Mask::full(nq, nk).unwrap(),
            Mask::sliding_window(nq, nk, Some(9), Some(0)).unwrap(),
        ] {
            for tiles in tile_configs(64) {
                check(&format!("lengths {nq}x{nk}"), seed, DType::F32, &x, &shape, &mask, tiles);
            }
        }
    }
}

#[test]
fn head_dims() {
    let (mut rng, seed) = rng("head_dims");
    for d in [1, 8, 32, 40, 64, 96, 128, 256] {
        let shape = AttnShape::new(1, 70, 90, 2, 1, d).unwrap();
        let x = inputs(&mut rng, &shape);
        let mask = Mask::causal(70, 90).unwrap();
        for dtype in DType::ALL {
            check(&format!("head dim {d}"), seed, dtype, &x, &shape, &mask, TileConfig::for_head_dim(d));
        }
        check(&format!("head dim {d}, small tiles"), seed, DType::F32, &x, &shape, &mask, tile_configs(d)[0]);
    }
}

#[test]
fn large_scores_do_not_overflow() {
    // Scores of several hundred: exp must be shifted by the running max, never raw.
    let (mut rng, seed) = rng("large_scores_do_not_overflow");
    let shape = AttnShape::new(1, 40, 70, 1, 1, 16).unwrap();
    let mut x = inputs(&mut rng, &shape);
    x.q.iter_mut().for_each(|v| *v *= 30.0);
    x.k.iter_mut().for_each(|v| *v *= 3.0);
    let mask = Mask::causal(40, 70).unwrap();
    for tiles in tile_configs(16) {
        // Sharp softmax: P is nearly one-hot, gradients are ill-conditioned; 1e-4 suffices.
        let e = errors_dtype(DType::F32, &x, &shape, &mask, tiles);
        assert!(e.max() < 1e-4, "{e:?} (DISTATTN_SEED={seed})");
    }
}

fn arb_mask(nq: usize, nk: usize, pick: u8, a: usize, b: usize) -> Mask {
    match pick % 5 {
        0 => Mask::full(nq, nk).unwrap(),
        1 => Mask::causal(nq, nk).unwrap(),
        2 => Mask::sliding_window(nq, nk, Some(a % 40), Some(b % 8)).unwrap(),
        3 => {
            let keep: Vec<bool> =
                (0..nq.div_ceil(8) * nk.div_ceil(12)).map(|i| !(i * 7 + a).is_multiple_of(3)).collect();
            Mask::block_mask(nq, nk, 8, 12, &keep).unwrap()
        }
        _ => Mask::sliding_window(nq, nk, None, Some(b % 3)).unwrap(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, .. ProptestConfig::default() })]
    #[test]
    fn random_shapes(
        batch in 1usize..3, nq in 1usize..90, nk in 1usize..90, kvh in 1usize..3, group in 1usize..4,
        d in 1usize..70, pick in any::<u8>(), a in 0usize..100, b in 0usize..100,
        fq in 1usize..40, fk in 1usize..70, bq in 1usize..40, bk in 1usize..70, dtype_pick in 0usize..3, seed in any::<u64>(),
    ) {
        use rand::SeedableRng;
        let dtype = DType::ALL[dtype_pick];
        // With one key, dS = P·(dP − D) is zero in exact arithmetic, so dK is f32 rounding noise
        // summed over every query row of a KV head: keep those rows few (as awkward_lengths).
        let nq = if nk == 1 { nq.min(8 / group) } else { nq };
        let shape = AttnShape::new(batch, nq, nk, kvh * group, kvh, d).unwrap();
        let mask = arb_mask(nq, nk, pick, a, b);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let x = inputs(&mut rng, &shape);
        let tiles = TileConfig { fwd_q: fq, fwd_k: fk, bwd_q: bq, bwd_k: bk };
        let e = errors_dtype(dtype, &x, &shape, &mask, tiles);
        prop_assert!(e.max() <= TOLERANCE, "{dtype} {shape} {tiles:?}: {e:?}");
    }
}
