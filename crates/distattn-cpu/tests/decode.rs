//! Decode attention over paged caches against the f64 reference: ragged batches, page sizes
//! 1, 16 and 64, GQA 32/8, 8/1 and 32/32, 1 and 4 query rows, causal or not, split over few and
//! many workers (segments cut into pieces merged by LSE), and appends that cross pages.

mod common;
use common::*;
use distattn_core::decode::{DecodeOptions, DecodeShape};
use distattn_core::{Element, Error};
use distattn_cpu::decode::{append_kv, decode};
use distattn_testkit::decode::{reference, DecodeCase};
use half::bf16;
use rand::Rng;

fn check<T: Element>(case: &DecodeCase, opts: &DecodeOptions, workers: usize, seed: u64) {
    let (q, k, v) = (cast::<T>(&case.q), cast::<T>(&case.k_cache), cast::<T>(&case.v_cache));
    let out = decode(&q, &case.cache(&k, &v), &case.shape, opts, workers).unwrap();
    let (ro, rl) = reference(case, &q, &k, &v, opts);
    let (eo, el) = (rel_err(&out.o, &ro), lse_err(&out.lse, &rl));
    assert!(
        eo < TOLERANCE && el < TOLERANCE,
        "{:?} page {} lengths {:?} {opts:?} workers {workers}: O err {eo:.2e}, LSE err {el:.2e} (seed {seed})",
        case.shape,
        case.layout.page_size,
        case.lengths
    );
}

#[test]
fn ragged_paged_batches_match_f64() {
    let (mut rng, seed) = rng("ragged_paged_batches_match_f64");
    for (heads, kv_heads) in [(32, 8), (8, 1), (32, 32)] {
        for q_rows in [1, 4] {
            for page_size in [1, 16, 64] {
                let batch = rng.random_range(1..5);
                let lengths: Vec<usize> = (0..batch).map(|_| rng.random_range(1..700)).collect();
                let shape = DecodeShape::new(batch, q_rows, heads, kv_heads, 32).unwrap();
                let case = DecodeCase::random(&mut rng, shape, page_size, &lengths);
                let causal = rng.random_bool(0.5);
                let opts = DecodeOptions { causal, ..Default::default() };
                for workers in [1, 3, 64] {
                    check::<f32>(&case, &opts, workers, seed);
                }
                check::<bf16>(&case, &opts, 7, seed);
            }
        }
    }
}

#[test]
fn long_requests_and_rows_without_keys() {
    let (mut rng, seed) = rng("long_requests_and_rows_without_keys");
    // One long request beside short ones (a request of 0 keys: its rows have O = 0, LSE = -inf;
    // causal with 4 rows over 2 keys: the first two rows see no key).
    let shape = DecodeShape::new(4, 4, 8, 2, 64).unwrap();
    let case = DecodeCase::random(&mut rng, shape, 16, &[200_000 / 16, 0, 2, 65]);
    for causal in [false, true] {
        check::<f32>(&case, &DecodeOptions { causal, ..Default::default() }, 132, seed);
    }
    let (q, k, v) = (case.q.clone(), case.k_cache.clone(), case.v_cache.clone());
    let out = decode(&q, &case.cache(&k, &v), &shape, &Default::default(), 5).unwrap();
    let lse1 = &out.lse[shape.heads * shape.q_rows..2 * shape.heads * shape.q_rows];
    assert!(lse1.iter().all(|&l| l == f32::NEG_INFINITY));
}

#[test]
fn appends_cross_pages() {
    let (mut rng, seed) = rng("appends_cross_pages");
    let shape = DecodeShape::new(3, 3, 4, 2, 16).unwrap();
    let before = [14, 0, 31];
    let after: Vec<usize> = before.iter().map(|&l| l + shape.q_rows).collect();
    let mut case = DecodeCase::random(&mut rng, shape, 16, &after);
    let row = shape.kv_heads * shape.head_dim;
    let k_new = randn(&mut rng, shape.batch * shape.q_rows * row, 1.0);
    let v_new = randn(&mut rng, shape.batch * shape.q_rows * row, 1.0);
    let (mut kc, mut vc) = (case.k_cache.clone(), case.v_cache.clone());
    append_kv(&mut kc, &mut vc, &case.layout, &case.page_table, &before, &k_new, &v_new, shape.q_rows).unwrap();
    // Token j of request b landed at position before[b] + j, in K and V; nothing else moved.
    let (mut expect_k, mut expect_v) = (case.k_cache.clone(), case.v_cache.clone());
    for (b, &len) in before.iter().enumerate() {
        for j in 0..shape.q_rows {
            let dst = case.kv_offset(b, len + j, 0);
            let src = (b * shape.q_rows + j) * row;
            expect_k[dst..dst + row].copy_from_slice(&k_new[src..src + row]);
            expect_v[dst..dst + row].copy_from_slice(&v_new[src..src + row]);
        }
    }
    assert_eq!(kc, expect_k, "seed {seed}");
    assert_eq!(vc, expect_v, "seed {seed}");
    (case.k_cache, case.v_cache) = (kc, vc);
    check::<f32>(&case, &DecodeOptions { causal: true, ..Default::default() }, 4, seed);

    // An append past the table's pages is refused, and leaves the caches alone.
    let full = [46, 0, 0]; // 49 tokens in 3 pages of 16
    let (k_before, v_before) = (case.k_cache.clone(), case.v_cache.clone());
    let err = append_kv(&mut case.k_cache, &mut case.v_cache, &case.layout, &case.page_table, &full, &k_new, &v_new, 3)
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { what, .. } if what == "cache lengths")
            && err.to_string().contains("more than its"),
        "{err} (seed {seed})"
    );
    assert!(case.k_cache == k_before && case.v_cache == v_before, "a refused append wrote (seed {seed})");
}
