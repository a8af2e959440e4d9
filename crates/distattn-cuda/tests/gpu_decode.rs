//! The decode kernel against the f64 reference on a GPU (`cargo test --release -p distattn-cuda
//! --test gpu_decode -- --ignored`; without a GPU these tests fail, saying so): ragged batches in
//! shuffled pages of 1, 16 and 64 tokens, lengths 1 to 200k, GQA 32/8, 8/1 and 32/32, 1 and 4
//! query rows, causal or not, bf16 and f16, every head dim; and an append of new tokens that
//! crosses pages, planned and attended in one step as `flash_attn_with_kvcache` does.

use distattn_core::decode::{DecodeOptions, DecodeShape};
use distattn_core::Element;
use distattn_cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use distattn_cuda::decode::{DecodePtrs, DecodeStep, DecodeWorkspacePtrs};
use distattn_cuda::{CudaBackend, CudaElement};
use distattn_testkit::decode::{reference, DecodeCase};
use distattn_testkit::{cast, lse_err, randn, rel_err, seeded_rng};
use half::{bf16, f16};
use rand::Rng;

const TOL: f64 = 1e-2;
const LSE_TOL: f64 = 1e-3;

fn addr<T>(s: &CudaSlice<T>, st: &CudaStream) -> u64 {
    s.device_ptr(st).0
}

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"))
}

fn check<T: CudaElement + Element>(gpu: &CudaBackend, case: &DecodeCase, opts: &DecodeOptions, seed: u64) {
    let (q, k, v) = (cast::<T>(&case.q), cast::<T>(&case.k_cache), cast::<T>(&case.v_cache));
    let out =
        gpu.decode_host(&q, &case.cache(&k, &v), &case.shape, opts).unwrap_or_else(|e| panic!("{:?}: {e}", case.shape));
    let (ro, rl) = reference(case, &q, &k, &v, opts);
    let (eo, el) = (rel_err(&out.o, &ro), lse_err(&out.lse, &rl));
    let lens =
        if case.lengths.len() > 6 { format!("{} requests", case.lengths.len()) } else { format!("{:?}", case.lengths) };
    assert!(
        eo < TOL && el < LSE_TOL,
        "{} {:?} page {} lengths {lens} causal {}: O err {eo:.2e}, LSE err {el:.2e} (seed {seed})",
        T::DTYPE,
        case.shape,
        case.layout.page_size,
        opts.causal
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_matches_f64_on_ragged_paged_batches() {
    let gpu = gpu();
    let (mut rng, seed) = seeded_rng("decode_matches_f64_on_ragged_paged_batches");
    for (heads, kv_heads) in [(32, 8), (8, 1), (32, 32)] {
        for q_rows in [1, 4] {
            for page_size in [1, 16, 64] {
                let batch = rng.random_range(1..6);
                let lengths: Vec<usize> = (0..batch).map(|_| rng.random_range(1..3000)).collect();
                let shape = DecodeShape::new(batch, q_rows, heads, kv_heads, 128).unwrap();
                let case = DecodeCase::random(&mut rng, shape, page_size, &lengths);
                for causal in [false, true] {
                    check::<bf16>(&gpu, &case, &DecodeOptions { causal, ..Default::default() }, seed);
                }
            }
        }
    }
    // Every head dim, f16, 16 rows (8/1: 128 rows per KV head, 8 blocks), a request without keys.
    for d in [64, 96, 128, 192, 256] {
        let shape = DecodeShape::new(3, 16, 8, 1, d).unwrap();
        let case = DecodeCase::random(&mut rng, shape, 16, &[0, 5, 700]);
        check::<f16>(&gpu, &case, &DecodeOptions { causal: true, ..Default::default() }, seed);
        check::<bf16>(&gpu, &case, &DecodeOptions::default(), seed);
    }
    // Long requests: one of 200k keys (cut over every block) beside short ones, and a batch
    // of 64 short ones (more segments than blocks).
    let shape = DecodeShape::new(3, 1, 8, 1, 128).unwrap();
    let case = DecodeCase::random(&mut rng, shape, 64, &[200_000, 3, 4097]);
    check::<bf16>(&gpu, &case, &DecodeOptions::default(), seed);
    let shape = DecodeShape::new(64, 1, 32, 8, 128).unwrap();
    let lengths: Vec<usize> = (0..64).map(|_| rng.random_range(1..600)).collect();
    let case = DecodeCase::random(&mut rng, shape, 16, &lengths);
    check::<bf16>(&gpu, &case, &DecodeOptions { causal: true, ..Default::default() }, seed);
}

/// New tokens appended across page boundaries and attended in one step (plan with the lengths
/// before the append plus the new tokens), twice in a row (the merge counters reset themselves).
#[test]
#[ignore = "needs a CUDA GPU"]
fn append_then_decode_in_one_step() {
    let gpu = gpu();
    let (mut rng, seed) = seeded_rng("append_then_decode_in_one_step");
    let shape = DecodeShape::new(3, 4, 32, 8, 128).unwrap();
    let before = [14usize, 0, 2999];
    let after: Vec<usize> = before.iter().map(|&l| l + shape.q_rows).collect();
    let mut case = DecodeCase::random(&mut rng, shape, 16, &after);
    let row = shape.kv_heads * shape.head_dim;
    let k_new = randn(&mut rng, shape.batch * shape.q_rows * row, 1.0);
    let v_new = randn(&mut rng, shape.batch * shape.q_rows * row, 1.0);
    let opts = DecodeOptions { causal: true, ..Default::default() };

    let st = gpu.stream();
    let up = |x: &[bf16]| st.clone_htod(x).unwrap();
    let (kc, vc) = (up(&cast(&case.k_cache)), up(&cast(&case.v_cache)));
    let (kn, vn, q) = (up(&cast(&k_new)), up(&cast(&v_new)), up(&cast(&case.q)));
    let table = st.clone_htod(&case.page_table).unwrap();
    let lens: Vec<i32> = before.iter().map(|&l| l as i32).collect();
    let seqlens = st.clone_htod(&lens).unwrap();
    let o = st.alloc_zeros::<bf16>(shape.q_elems()).unwrap();
    let lse = st.alloc_zeros::<f32>(shape.lse_elems()).unwrap();
    let w = gpu.decode_workspace(distattn_core::DType::BF16, &shape).unwrap();
    let cu = st.alloc_zeros::<i64>(w.cu_tiles).unwrap();
    let part_o = st.alloc_zeros::<f32>(w.part_o).unwrap();
    let part_lse = st.alloc_zeros::<f32>(w.part_lse).unwrap();
    let counters = st.alloc_zeros::<i32>(w.counters).unwrap();
    let ptrs = DecodePtrs {
        q: addr(&q, st),
        k_cache: addr(&kc, st),
        v_cache: addr(&vc, st),
        o: addr(&o, st),
        lse: addr(&lse, st),
        page_table: addr(&table, st),
        seqlens: addr(&seqlens, st),
    };
    let ws = DecodeWorkspacePtrs {
        cu_tiles: addr(&cu, st),
        part_o: addr(&part_o, st),
        part_lse: addr(&part_lse, st),
        counters: addr(&counters, st),
    };
    let max_pages = case.page_table.len() / shape.batch;
    let step = DecodeStep::paged(shape, case.layout, max_pages, shape.q_rows, opts);
    for _ in 0..2 {
        // SAFETY: every buffer above was allocated on this stream with the sizes the step needs;
        // the page table covers every length after the append.
        unsafe {
            gpu.append_kv_raw(
                st,
                distattn_core::DType::BF16,
                &ptrs,
                addr(&kn, st),
                addr(&vn, st),
                shape.batch,
                shape.q_rows,
                &case.layout,
                max_pages,
            )
            .unwrap();
            gpu.decode_plan_raw(
                st,
                distattn_core::DType::BF16,
                &shape,
                ptrs.seqlens,
                shape.q_rows,
                max_pages * 16,
                &ws,
            )
            .unwrap();
            gpu.decode_raw(st, distattn_core::DType::BF16, &ptrs, &ws, &step).unwrap();
        }
    }
    let got_o: Vec<bf16> = st.clone_dtoh(&o).unwrap();
    let got_lse: Vec<f32> = st.clone_dtoh(&lse).unwrap();
    let got_k: Vec<bf16> = st.clone_dtoh(&kc).unwrap();
    gpu.synchronize().unwrap();
    assert_eq!(st.clone_dtoh(&counters).unwrap(), vec![0; w.counters], "counters back at zero");

    // The same append on the host, then the reference over the caches after it.
    let (mut hk, mut hv) = (cast::<bf16>(&case.k_cache), cast::<bf16>(&case.v_cache));
    distattn_cpu::decode::append_kv(
        &mut hk,
        &mut hv,
        &case.layout,
        &case.page_table,
        &before,
        &cast(&k_new),
        &cast(&v_new),
        shape.q_rows,
    )
    .unwrap();
    assert_eq!(got_k, hk, "appended K (seed {seed})");
    case.k_cache = hk.iter().map(|x| x.to_f32()).collect();
    case.v_cache = hv.iter().map(|x| x.to_f32()).collect();
    let (q, k, v) = (cast::<bf16>(&case.q), cast::<bf16>(&case.k_cache), cast::<bf16>(&case.v_cache));
    let (ro, rl) = reference(&case, &q, &k, &v, &opts);
    let (eo, el) = (rel_err(&got_o, &ro), lse_err(&got_lse, &rl));
    assert!(eo < TOL && el < LSE_TOL, "O err {eo:.2e}, LSE err {el:.2e} (seed {seed})");
}

/// Blocks of a decode step over a spread cache (a few query rows, each keeping one run of the
/// block's keys, or none) go through the decode kernel reading K and V in place: against f64,
/// with GQA, batch 2, a row without keys, rows whose runs start mid-buffer, a rank's part of
/// interleaved 16-token pages, and a block of 65 rows (past the route's limit: the flash
/// kernels) for the same answer; O rounded to bf16 beside it, as a plan's last block writes a
/// final output, is the f32 O rounded.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_shaped_blocks_match_f64() {
    use distattn_core::plan::{sub_mask, TokenSet};
    use distattn_core::{AttnOptions, AttnShape, DType, Mask};
    use distattn_cuda::GpuBuf;
    use distattn_exec::{Backend, Block, FwdInputs};
    use distattn_testkit::reference;

    let gpu = gpu();
    let (mut rng, seed) = seeded_rng("decode_shaped_blocks_match_f64");
    for (requests, heads, kv_heads, d, pages) in [
        (5, 32, 8, 128, false),
        (16, 8, 1, 64, false),
        (7, 32, 8, 128, true),
        (1, 32, 8, 128, true),
        (65, 4, 2, 128, false),
    ] {
        // One new token per request against its cached keys; the block keeps the keys from 300
        // on of the packed matrix (a rank's part), so the first request's row keeps none, or
        // every other page of 16 keys. One request: the block's LSE is the kernel's layout.
        let k_lens: Vec<usize> = (0..requests).map(|i| if i == 0 { 200 } else { rng.random_range(1..5000) }).collect();
        let full = Mask::per_document(&vec![1; requests], &k_lens, Mask::causal).unwrap();
        let mask = if pages {
            let keys =
                TokenSet::from_runs((0..full.k_len()).step_by(32).map(|a| a..(a + 16).min(full.k_len())).collect());
            sub_mask(&full, &TokenSet::range(0..requests), &keys).unwrap()
        } else {
            full.restrict(0..requests, 300..full.k_len()).unwrap()
        };
        let shape = AttnShape::new(2, requests, mask.k_len(), heads, kv_heads, d).unwrap();
        let (q, k, v) = (
            randn(&mut rng, shape.q_elems(), 1.0),
            randn(&mut rng, shape.kv_elems(), 1.0),
            randn(&mut rng, shape.kv_elems(), 1.0),
        );
        let (qb, kb, vb) = (cast::<bf16>(&q), cast::<bf16>(&k), cast::<bf16>(&v));
        let s = gpu.stream();
        let up = |x: &[bf16]| GpuBuf::upload(s, x).unwrap();
        let (qg, kg, vg) = (up(&qb), up(&kb), up(&vb));
        let mut o = GpuBuf::filled(s, DType::F32, shape.q_elems(), f32::NAN).unwrap();
        let mut lse = GpuBuf::filled(s, DType::F32, shape.lse_elems(), f32::NAN).unwrap();
        let block = Block::new(shape, mask.clone());
        assert_eq!(block.row_runs.is_some(), requests <= Block::RUN_ROWS, "{requests} rows");
        let opts = AttnOptions::default();
        // Also O rounded to bf16, as a plan's last block writes its final output.
        let mut rounded = GpuBuf::filled(s, DType::BF16, shape.q_elems(), f32::NAN).unwrap();
        let inputs = FwdInputs { q: &qg, k: &kg, v: &vg };
        Backend::forward(&gpu, &block, inputs, &opts, &mut o, &mut lse, Some(&mut rounded)).unwrap();
        let (o, lse) = (o.download_f32(s).unwrap(), lse.download_f32(s).unwrap());
        let rounded = rounded.download_f32(s).unwrap();
        assert!(o.iter().zip(&rounded).all(|(x, r)| bf16::from_f32(*x).to_f32() == *r), "{requests} rows: rounded O");
        let want = reference::forward(&qb, &kb, &vb, &shape, &mask, &opts).unwrap();
        let (eo, el) = (rel_err(&o, &want.o), lse_err(&lse, &want.lse));
        assert!(
            eo < TOL && el < LSE_TOL,
            "{requests} rows {heads}/{kv_heads} d {d}: O err {eo:.2e}, LSE err {el:.2e} (seed {seed})"
        );
    }
}
