//! The portable (non-SIMD) kernels against the reference. One test in its own binary, since
//! it switches the SIMD path off process-wide through `DISTATTN_CPU_NO_SIMD`.

mod common;
use common::*;
use distattn_core::{AttnShape, DType, Mask};

#[test]
fn portable_kernels_against_reference() {
    std::env::set_var("DISTATTN_CPU_NO_SIMD", "1");
    let (mut rng, seed) = rng("portable_kernels_against_reference");
    for (nq, nk, mask) in [
        (33, 70, Mask::causal(33, 70).unwrap()),
        (50, 50, Mask::sliding_window(50, 50, Some(7), Some(2)).unwrap()),
        (20, 45, Mask::full(20, 45).unwrap()),
    ] {
        let shape = AttnShape::new(1, nq, nk, 4, 2, 24).unwrap();
        let x = inputs(&mut rng, &shape);
        for dtype in DType::ALL {
            for tiles in tile_configs(24) {
                check("portable", seed, dtype, &x, &shape, &mask, tiles);
            }
        }
    }
}
