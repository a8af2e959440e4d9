//! Mask tests: every constructor against an independent dense definition, and every query
//! (area, class, fill, restriction, key tiles) against counting on that dense matrix.

use super::*;
use proptest::prelude::*;

/// Dense keep-matrix of a mask, from its row intervals (test-only).
fn dense(m: &Mask) -> Vec<bool> {
    let mut d = vec![false; m.q_len() * m.k_len()];
    for i in 0..m.q_len() {
        for (lo, hi) in m.row_intervals(i) {
            for j in lo..hi {
                assert!(!d[i * m.k_len() + j], "pair ({i},{j}) kept twice");
                d[i * m.k_len() + j] = true;
            }
        }
    }
    d
}

fn from_fn(q: usize, k: usize, f: impl Fn(usize, usize) -> bool) -> Vec<bool> {
    (0..q * k).map(|x| f(x / k, x % k)).collect()
}

/// Checks area, class, fill and restriction of many rectangles against the dense matrix.
fn check_queries(m: &Mask, d: &[bool], seed: u64) {
    let (q, k) = (m.q_len(), m.k_len());
    let count = |qa: usize, qb: usize, ka: usize, kb: usize| -> u64 {
        (qa..qb).map(|i| (ka..kb).filter(|&j| d[i * k + j]).count() as u64).sum()
    };
    assert_eq!(m.area(), count(0, q, 0, k));
    let mut s = seed | 1;
    let mut next = |n: usize| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % n as u64) as usize
    };
    for _ in 0..40 {
        let (a, b) = (next(q), next(q) + 1);
        let (qa, qb) = (a.min(b), a.max(b).min(q).max(a.min(b) + 1));
        let (c, e) = (next(k), next(k) + 1);
        let (ka, kb) = (c.min(e), c.max(e).min(k).max(c.min(e) + 1));
        let t = m.tile(qa..qb, ka..kb);
        let want = count(qa, qb, ka, kb);
        assert_eq!(t.area, want, "area of {qa}..{qb} x {ka}..{kb}");
        let cls = if want == 0 {
            TileClass::Empty
        } else if want == ((qb - qa) * (kb - ka)) as u64 {
            TileClass::Full
        } else {
            TileClass::Partial
        };
        assert_eq!(t.class, cls);
        let mut buf = vec![true; (qb - qa) * (kb - ka)];
        m.fill_tile(qa..qb, ka..kb, &mut buf);
        for i in qa..qb {
            for j in ka..kb {
                assert_eq!(buf[(i - qa) * (kb - ka) + j - ka], d[i * k + j], "fill ({i},{j})");
            }
        }
        let r = m.restrict(qa..qb, ka..kb).unwrap();
        let rd = dense(&r);
        for i in qa..qb {
            for j in ka..kb {
                assert_eq!(rd[(i - qa) * (kb - ka) + j - ka], d[i * k + j], "restrict ({i},{j})");
            }
        }
    }
    for tile in [1, 7, 16, 64] {
        let qa = next(q);
        let qb = (qa + tile).min(q);
        let tiles = m.key_tiles(qa..qb, tile);
        let covered: u64 = tiles.iter().map(|(_, t)| t.area).sum();
        assert_eq!(covered, count(qa, qb, 0, k), "key tiles cover the rows' area");
        assert!(tiles.iter().all(|(_, t)| t.class != TileClass::Empty));
    }
}

fn check(m: &Mask, want: Vec<bool>) {
    assert_eq!(dense(m), want);
    check_queries(m, &want, (m.q_len() * 31 + m.k_len()) as u64);
}

#[test]
fn full_and_causal() {
    for (q, k) in [(1, 1), (5, 5), (17, 9), (9, 17), (130, 130)] {
        check(&Mask::full(q, k).unwrap(), from_fn(q, k, |_, _| true));
        let off = k as i64 - q as i64;
        check(&Mask::causal(q, k).unwrap(), from_fn(q, k, |i, j| j as i64 <= i as i64 + off));
    }
}

#[test]
fn sliding_window() {
    for (q, k, l, r) in [
        (40, 40, Some(5), Some(0)),
        (40, 40, Some(3), Some(7)),
        (20, 33, Some(4), Some(2)),
        (33, 20, None, Some(1)),
        (9, 9, Some(100), None),
        // Widths past i64: no bound on that side (they once wrapped to -1: an empty mask).
        (9, 9, Some(usize::MAX), Some(0)),
        (9, 12, Some(0), Some(usize::MAX)),
        (7, 5, Some(1 << 63), Some(1 << 62)),
    ] {
        let off = k as i128 - q as i128;
        let want = from_fn(q, k, |i, j| {
            let p = i as i128 + off;
            let j = j as i128;
            l.is_none_or(|l| j >= p - l as i128) && r.is_none_or(|r| j <= p + r as i128)
        });
        check(&Mask::sliding_window(q, k, l, r).unwrap(), want);
    }
}

#[test]
fn window_global() {
    let (n, l, r, g) = (50, 4, 2, 3);
    let want = from_fn(n, n, |i, j| i < g || j < g || (j + l >= i && j <= i + r));
    check(&Mask::window_global(n, Some(l), Some(r), g).unwrap(), want);
}

#[test]
fn documents_and_prefix() {
    let lens = [5, 1, 12, 0, 30];
    let doc = |i: usize| {
        let mut a = 0;
        for (d, &l) in lens.iter().enumerate() {
            if i < a + l {
                return (d, a);
            }
            a += l;
        }
        unreachable!()
    };
    let n: usize = lens.iter().sum();
    check(&Mask::documents(&lens, DocKind::Full).unwrap(), from_fn(n, n, |i, j| doc(i).0 == doc(j).0));
    check(&Mask::documents(&lens, DocKind::Causal).unwrap(), from_fn(n, n, |i, j| doc(i).0 == doc(j).0 && j <= i));
    let cu = [0, 5, 6, 18, 18, 48];
    assert_eq!(Mask::from_cu_seqlens(&cu, DocKind::Causal).unwrap(), Mask::documents(&lens, DocKind::Causal).unwrap());
    check(&Mask::prefix_lm(20, 6).unwrap(), from_fn(20, 20, |i, j| j <= i || (i < 6 && j < 6)));
    let docs = [(10, 3), (15, 0), (7, 7)];
    let m = Mask::prefix_lm_documents(&docs).unwrap();
    let starts = [0, 10, 25];
    let which = |i: usize| starts.iter().rposition(|&s| s <= i).unwrap();
    check(
        &m,
        from_fn(32, 32, |i, j| {
            let d = which(i);
            let p = starts[d] + docs[d].1;
            which(j) == d && (j <= i || (i < p && j < p))
        }),
    );
}

/// Every kept pair of `m` lies inside one of `blocks` (consecutive, covering the matrix).
fn inside_blocks(m: &Mask, blocks: &[usize]) -> bool {
    let n = m.q_len();
    let mut block_of = Vec::with_capacity(n);
    for (b, &len) in blocks.iter().enumerate() {
        block_of.extend(std::iter::repeat_n(b, len));
    }
    let d = dense(m);
    block_of.len() == n && (0..n).all(|i| (0..n).all(|j| !d[i * n + j] || block_of[i] == block_of[j]))
}

#[test]
fn diagonal_blocks_are_the_documents() {
    let lens = [5, 1, 12, 0, 30];
    for kind in [DocKind::Full, DocKind::Causal] {
        assert_eq!(Mask::documents(&lens, kind).unwrap().diagonal_blocks(), Some(vec![5, 1, 12, 30]));
    }
    let m = Mask::prefix_lm_documents(&[(10, 3), (15, 0), (7, 7)]).unwrap();
    assert_eq!(m.diagonal_blocks(), Some(vec![10, 15, 7]));
    let spec: MaskSpec = "docs-random-causal:1".parse().unwrap();
    let m = spec.build(4096, 4096).unwrap();
    assert_eq!(m.diagonal_blocks(), spec.doc_lens(4096));
    assert!(inside_blocks(&m, &m.diagonal_blocks().unwrap()));
    // Rows 3 and 4 keep nothing: they join the block before them.
    let gap = Mask::from_slices(
        8,
        8,
        vec![MaskSlice::new(0..3, 0..3, SliceKind::Full), MaskSlice::new(5..8, 5..8, SliceKind::Causal)],
    )
    .unwrap();
    assert_eq!(gap.diagonal_blocks(), Some(vec![5, 3]));
    // One block, or not square: none.
    for m in [
        Mask::causal(40, 40).unwrap(),
        Mask::full(40, 40).unwrap(),
        Mask::documents(&[0, 40, 0], DocKind::Causal).unwrap(),
        Mask::sliding_window(40, 40, Some(3), Some(0)).unwrap(),
        Mask::documents_qk(&[4, 6], &[8, 2], DocKind::Full).unwrap(),
    ] {
        assert_eq!(m.diagonal_blocks(), None, "{m:?}");
    }
}

#[test]
fn per_document_windows_with_ragged_lengths() {
    // Varlen cross-attention: query and key lengths differ per document (one has no keys, one
    // no queries), each under a window around its own bottom-right-aligned diagonal.
    let (q_lens, k_lens) = ([4usize, 1, 6, 0, 9], [7usize, 3, 0, 5, 9]);
    let (left, right) = (2i64, 1i64);
    let m = Mask::per_document(&q_lens, &k_lens, |q, k| Mask::sliding_window(q, k, Some(2), Some(1))).unwrap();
    let start = |lens: &[usize], d: usize| lens[..d].iter().sum::<usize>();
    let doc_of = |lens: &[usize], i: usize| (0..lens.len()).find(|&d| i < start(lens, d) + lens[d]).unwrap();
    let (nq, nk) = (q_lens.iter().sum(), k_lens.iter().sum());
    check(
        &m,
        from_fn(nq, nk, |i, j| {
            let d = doc_of(&q_lens, i);
            if k_lens[d] == 0 || doc_of(&k_lens, j) != d {
                return false;
            }
            let (ti, tj) = ((i - start(&q_lens, d)) as i64, (j - start(&k_lens, d)) as i64);
            let diag = ti + k_lens[d] as i64 - q_lens[d] as i64;
            tj >= diag - left && tj <= diag + right
        }),
    );
    let causal = Mask::per_document(&q_lens, &k_lens, Mask::causal).unwrap();
    assert_eq!(causal, Mask::documents_qk(&q_lens, &k_lens, DocKind::Causal).unwrap());
    assert!(Mask::per_document(&[1, 2], &[3], Mask::full).is_err());
    assert!(Mask::per_document(&[2], &[2], |_, _| Mask::full(1, 1)).is_err());
}

#[test]
fn shared_question_block_causal_blocks() {
    let (q, answers) = (6, [4, 9, 3]);
    let mut starts = vec![q];
    for a in answers {
        starts.push(starts.last().unwrap() + a);
    }
    let n = *starts.last().unwrap();
    let answer = |i: usize| starts.windows(2).position(|w| i >= w[0] && i < w[1]);
    let want = from_fn(n, n, |i, j| match (answer(i), answer(j)) {
        (None, None) => j <= i,
        (Some(_), None) => true,
        (Some(a), Some(b)) => a == b && j <= i,
        (None, Some(_)) => false,
    });
    check(&Mask::shared_question(q, &answers).unwrap(), want);
    check(&Mask::block_causal(30, 8).unwrap(), from_fn(30, 30, |i, j| j < (i / 8 + 1) * 8));
    let m = Mask::block_causal_documents(&[10, 13], 4).unwrap();
    check(
        &m,
        from_fn(23, 23, |i, j| {
            let (a, b) = if i < 10 { (0, 10) } else { (10, 23) };
            j >= a && j < b && j < a + ((i - a) / 4 + 1) * 4
        }),
    );
    let keep = [true, false, true, true, true, false, false, true, true];
    check(&Mask::block_mask(7, 10, 3, 4, &keep).unwrap(), from_fn(7, 10, |i, j| keep[(i / 3) * 3 + j / 4]));
}

#[test]
fn bad_masks_are_errors() {
    let invalid = |r: Result<Mask>| matches!(r, Err(Error::InvalidMask(_)));
    assert!(invalid(Mask::from_slices(4, 4, vec![MaskSlice::new(0..5, 0..4, SliceKind::Full)])));
    let overlap = vec![MaskSlice::new(0..4, 0..4, SliceKind::Causal), MaskSlice::new(2..3, 1..2, SliceKind::Full)];
    assert!(matches!(Mask::from_slices(4, 4, overlap), Err(Error::InvalidMask(_))));
    assert!(invalid(Mask::block_mask(4, 4, 2, 2, &[true])));
    assert!(invalid(Mask::prefix_lm(4, 5)));
    assert!(invalid(Mask::block_causal(4, 0)));
    assert!(invalid(Mask::full(0, 3)));
    assert!(invalid(Mask::causal(4, 4).unwrap().restrict(2..6, 0..4)));
}

#[test]
fn crafted_sizes_are_quick_errors() {
    let t0 = std::time::Instant::now();
    let max = usize::MAX;
    for spec in [
        format!("docs:{max},17"),
        format!("docs-causal:{max},{max},2"),
        format!("prefix-docs:{max}/0,17/0"),
        format!("shared-question:{max},17"),
        format!("block-causal-docs:4:{max},17"),
    ] {
        let parsed: MaskSpec = spec.parse().unwrap();
        let err = parsed.build(16, 16).unwrap_err();
        assert!(matches!(err, Error::InvalidMask(_)), "{spec}: {err}");
    }
    let huge = 1usize << 40;
    assert!(Mask::documents(&[max, 17], DocKind::Full).is_err());
    assert!(Mask::prefix_lm_documents(&[(max, 0), (17, 0)]).is_err());
    assert!(Mask::shared_question(max, &[17]).is_err());
    assert!(Mask::block_causal_documents(&[max, 17], 4).is_err());
    assert!(Mask::causal(huge, huge).is_err());
    assert!(Mask::full(1, huge).is_err());
    assert!(Mask::sliding_window(huge, 4, Some(1), Some(0)).is_err());
    assert!(Mask::window_global(huge, None, None, 1).is_err());
    assert!(Mask::block_mask(huge, huge, 1, 1, &[true]).is_err());
    assert!(t0.elapsed() < std::time::Duration::from_secs(1), "took {:?}", t0.elapsed());
    // Huge but meaningful arguments saturate instead of wrapping.
    let full = |q, k| dense(&Mask::full(q, k).unwrap());
    assert_eq!(dense(&Mask::window_global(64, Some(max), Some(max), 1).unwrap()), full(64, 64));
    assert_eq!(dense(&Mask::block_causal(64, max).unwrap()), full(64, 64));
    assert_eq!(dense(&Mask::block_mask(5, 7, max, max, &[true]).unwrap()), full(5, 7));
}

/// Mask specs made of a known name and arguments that are small, huge or malformed.
fn spec_strings() -> impl Strategy<Value = String> {
    let names = prop::sample::select(vec![
        "full",
        "causal",
        "window",
        "window-global",
        "docs",
        "docs-causal",
        "docs-random",
        "prefix",
        "prefix-docs",
        "shared-question",
        "block-causal",
        "block-causal-docs",
        "blocks",
        "bogus",
    ]);
    let number = prop_oneof![
        (0usize..80).prop_map(|n| n.to_string()),
        Just(usize::MAX.to_string()),
        Just((1u64 << 40).to_string()),
        Just("-".to_string()),
        Just("x".to_string()),
        Just(String::new()),
    ];
    let sep = prop::sample::select(vec![",", "/", ":", ",", ","]);
    let args = prop::collection::vec((number, sep), 0..6)
        .prop_map(|v| v.into_iter().map(|(n, s)| format!("{n}{s}")).collect::<String>());
    let bits = "[01]{0,20}";
    prop_oneof![(names, args, bits).prop_map(|(n, a, b)| format!("{n}:{a}{b}")), ".{0,40}",]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    /// Any string: parsing and building never panic, finish at once, and a built mask has the
    /// asked size.
    #[test]
    fn any_spec_string_parses_or_fails_cleanly(spec in spec_strings(), q in 1usize..200, k in 1usize..200) {
        if let Ok(parsed) = spec.parse::<MaskSpec>() {
            if let Ok(m) = parsed.build(q, k) {
                prop_assert_eq!((m.q_len(), m.k_len()), (q, k));
            }
        }
    }
}

#[test]
fn random_documents_spec() {
    let spec: MaskSpec = "docs-random-causal:3".parse().unwrap();
    assert_eq!(spec.to_string(), "docs-random-causal:3");
    let m = spec.build(100, 100).unwrap();
    let lens = long_tailed_doc_lens(100, 3);
    assert_eq!(m, Mask::documents(&lens, DocKind::Causal).unwrap());
    assert_eq!(spec.doc_lens(100), Some(lens));
    assert!("docs-random:x".parse::<MaskSpec>().is_err());
}

#[test]
fn specs_parse_build_and_print() {
    for s in [
        "full",
        "causal",
        "window:8,0",
        "window:-,3",
        "window-global:4,4,2",
        "docs:10,20,34",
        "docs-causal:64",
        "prefix:10",
        "prefix-docs:32/4,32/0",
        "shared-question:16,24,24",
        "block-causal:16",
        "block-causal-docs:8:30,34",
        "blocks:32,32:1011",
    ] {
        let spec: MaskSpec = s.parse().unwrap();
        assert_eq!(spec.to_string(), s);
        let m = spec.build(64, 64).unwrap();
        assert!(m.area() > 0, "{s}");
    }
    for s in ["", "causa", "window:1", "window:a,b", "docs", "docs:1,x", "blocks:2:11", "full:3", "blocks:32,32:12"] {
        assert!(matches!(s.parse::<MaskSpec>(), Err(Error::MaskSpec { .. })), "{s}");
    }
    assert!("docs:10,20".parse::<MaskSpec>().unwrap().build(64, 64).is_err());
    assert!("prefix:3".parse::<MaskSpec>().unwrap().build(8, 9).is_err());
}

fn arb_slice(q: usize, k: usize) -> impl Strategy<Value = MaskSlice> {
    (0..q, 0..q, 0..k, 0..k, 0..4u8).prop_map(move |(a, b, c, d, kind)| {
        let kind = [SliceKind::Full, SliceKind::Causal, SliceKind::InverseCausal, SliceKind::BiCausal][kind as usize];
        MaskSlice::new(a.min(b)..a.max(b) + 1, c.min(d)..c.max(d) + 1, kind)
    })
}

/// `row_runs` against the dense matrix: Some exactly when every row keeps one contiguous run
/// (or nothing), and then that run.
fn check_row_runs(m: &Mask) -> Option<Vec<(usize, usize)>> {
    let d = dense(m);
    let runs = m.row_runs();
    let mut one_run = true;
    for i in 0..m.q_len() {
        let row = &d[i * m.k_len()..(i + 1) * m.k_len()];
        let kept: Vec<usize> = (0..m.k_len()).filter(|&j| row[j]).collect();
        let contiguous = kept.windows(2).all(|w| w[1] == w[0] + 1);
        one_run &= contiguous;
        if let Some(r) = &runs {
            let want = kept.first().map_or((0, 0), |&lo| (lo, kept.len()));
            assert_eq!(r[i], want, "row {i}");
        }
    }
    assert_eq!(runs.is_some(), one_run);
    runs
}

#[test]
fn row_runs_are_each_rows_one_run_of_keys() {
    // A decode step: one new token per request; restricted to a rank's keys; every other page.
    let step = Mask::per_document(&[1, 1, 1], &[40, 7, 90], Mask::causal).unwrap();
    assert_eq!(check_row_runs(&step), Some(vec![(0, 40), (40, 7), (47, 90)]));
    let part = step.restrict(0..3, 45..137).unwrap();
    assert_eq!(check_row_runs(&part), Some(vec![(0, 0), (0, 2), (2, 90)]));
    let pages = crate::plan::TokenSet::from_runs((0..137).step_by(32).map(|a| a..(a + 16).min(137)).collect());
    let paged = crate::plan::sub_mask(&step, &crate::plan::TokenSet::range(0..3), &pages).unwrap();
    assert!(paged.slices().len() > 3, "one slice per page");
    assert!(check_row_runs(&paged).is_some());
    assert!(check_row_runs(&Mask::causal(9, 12).unwrap()).is_some());
    // A sliding window with a global prefix keeps two runs in later rows.
    assert_eq!(check_row_runs(&Mask::window_global(20, Some(2), Some(0), 3).unwrap()), None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A single slice of any kind: row semantics equal the table in [`SliceKind`], and every
    /// query agrees with the dense matrix.
    #[test]
    fn any_slice(q in 1usize..48, k in 1usize..48, seed in any::<u64>(), pick in any::<prop::sample::Index>()) {
        let slices: Vec<MaskSlice> = (0..4).map(|x| {
            let mut s = seed.wrapping_add(x * 0x9e37_79b9);
            let mut r = |n: usize| { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s % n as u64) as usize };
            let (a, b, c, d) = (r(q), r(q), r(k), r(k));
            MaskSlice::new(a.min(b)..a.max(b) + 1, c.min(d)..c.max(d) + 1, [SliceKind::Full, SliceKind::Causal, SliceKind::InverseCausal, SliceKind::BiCausal][r(4)])
        }).collect();
        let s = pick.get(&slices).clone();
        let (qs, ks) = (s.q.start as i64, s.k.start as i64);
        let off = s.k.len() as i64 - s.q.len() as i64;
        let want = from_fn(q, k, |i, j| {
            if !s.q.contains(&i) || !s.k.contains(&j) { return false; }
            let (t, u) = (i as i64 - qs, j as i64 - ks);
            match s.kind {
                SliceKind::Full => true,
                SliceKind::Causal => u <= t + off,
                SliceKind::InverseCausal => u >= t,
                SliceKind::BiCausal => u >= t && u <= t + off,
            }
        });
        let m = Mask::from_slices(q, k, vec![s]).unwrap();
        prop_assert_eq!(dense(&m), want.clone());
        check_queries(&m, &want, seed);
    }

    /// Row-wise compression reproduces any monotone-ish band exactly.
    #[test]
    fn rows_compress_exactly(n in 1usize..80, k in 1usize..80, w in 0usize..20, step in 1usize..4) {
        let f = |i: usize| ((i / step).min(k), (i / step + w).min(k));
        let m = Mask::new_unchecked(n, k, slices_from_rows(0..n, f));
        let want = from_fn(n, k, |i, j| { let (lo, hi) = f(i); j >= lo && j < hi });
        prop_assert_eq!(dense(&m), want);
    }

    #[test]
    fn diagonal_blocks_of_windowed_documents(lens in prop::collection::vec(0usize..12, 1..7), w in 0usize..5) {
        prop_assume!(lens.iter().sum::<usize>() > 0);
        let m = Mask::per_document(&lens, &lens, |q, k| Mask::sliding_window(q, k, Some(w), Some(0))).unwrap();
        let docs: Vec<usize> = lens.iter().copied().filter(|&l| l > 0).collect();
        let want = if docs.len() >= 2 { Some(docs) } else { None };
        let got = m.diagonal_blocks();
        prop_assert_eq!(&got, &want);
        if let Some(b) = got {
            prop_assert!(inside_blocks(&m, &b));
        }
    }

    #[test]
    fn overlapping_slices_rejected(s in arb_slice(20, 20)) {
        let dup = vec![s.clone(), s.clone()];
        let nonempty = (s.q.clone()).any(|i| { let (lo, hi) = s.row(i); lo < hi });
        prop_assert_eq!(Mask::from_slices(20, 20, dup).is_err(), nonempty);
    }
}

#[test]
fn keep_rows_keeps_exactly_those_rows() {
    let masks = [
        Mask::causal(130, 130).unwrap(),
        Mask::sliding_window(97, 140, Some(20), Some(3)).unwrap(),
        Mask::documents(&[40, 7, 60], DocKind::Causal).unwrap(),
    ];
    for m in &masks {
        let d = dense(m);
        let n = m.q_len();
        for rows in [0..1, 3..50, 50..n, 0..n, n - 1..n] {
            let part = m.keep_rows(rows.clone()).unwrap();
            assert_eq!((part.q_len(), part.k_len()), (n, m.k_len()));
            let k = m.k_len();
            let want = from_fn(n, k, |i, j| rows.contains(&i) && d[i * k + j]);
            check(&part, want);
        }
        // Two complementary parts keep every pair once.
        let (a, b) = (m.keep_rows(0..n / 3).unwrap(), m.keep_rows(n / 3..n).unwrap());
        assert_eq!(a.area() + b.area(), m.area());
    }
    assert!(masks[0].keep_rows(5..5).is_err());
    assert!(masks[0].keep_rows(100..131).is_err());
}
