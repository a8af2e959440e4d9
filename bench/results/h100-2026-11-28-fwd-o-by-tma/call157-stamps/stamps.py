"""Per-block clock stamps of a diagnostic forward build (stamps.diff: each consumer's warp 0 lane
0 writes clock64 at block entry, after its first scores, after its last P V and after its stores,
and %smid, into its rows of the LSE): median block time, fill, store, the gap between
consecutive blocks on one SM. Run as: PYTHONPATH=<diagnostic wheel> python3 stamps.py OUT.json"""
import statistics as st, sys, json, torch, distattn
out = {}
for name, n, h, d, causal in [("d128-16/16-full-4k", 4096, 16, 128, False), ("d128-16/16-full-16k", 16384, 16, 128, False),
                              ("d128-16/16-causal-4k", 4096, 16, 128, True), ("d256-16/16-full-4k", 4096, 16, 256, False),
                              ("d128-32/8-full-4k", 4096, 32, 128, False)]:
    hkv = 8 if h == 32 else h
    q = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        o, lse = distattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); o, lse = distattn.flash_attn_func(q, k, v, causal=causal, return_lse=True); e1.record()
    torch.cuda.synchronize()
    ms = e0.elapsed_time(e1)
    bm = 128
    L = lse[0].contiguous()
    blocks = []
    for hh in range(h):
        for qt in range(n // bm):
            rec = []
            for cw in range(2):
                r = L[hh, qt * bm + 64 * cw: qt * bm + 64 * cw + 10].view(torch.int64).tolist()
                rec.append(r)
            blocks.append(dict(h=hh, qt=qt, sm=rec[0][4], s0=min(rec[0][0], rec[1][0]), f0=rec[0][1], f1=rec[1][1],
                               p0=rec[0][2], p1=rec[1][2], e0=rec[0][3], e1=rec[1][3]))
    by_sm = {}
    for b in blocks:
        by_sm.setdefault(b["sm"], []).append(b)
    gaps, durs, fill0, fill1, tail, stores, pvlag = [], [], [], [], [], [], []
    spans = []
    for sm, bl in by_sm.items():
        bl.sort(key=lambda b: b["s0"])
        spans.append(max(max(b["e0"], b["e1"]) for b in bl) - bl[0]["s0"])
        for i, b in enumerate(bl):
            end = max(b["e0"], b["e1"])
            durs.append(end - b["s0"]); fill0.append(b["f0"] - b["s0"]); fill1.append(b["f1"] - b["s0"])
            tail.append(end - max(b["p0"], b["p1"])); stores.append(((b["e0"] - b["p0"]) + (b["e1"] - b["p1"])) / 2)
            pvlag.append(b["p1"] - b["p0"])
            if i + 1 < len(bl):
                gaps.append(bl[i + 1]["s0"] - end)
    med = lambda x: st.median(x) if x else 0
    res = dict(ms=ms, sms=len(by_sm), blocks_per_sm=len(blocks) / len(by_sm), block=med(durs), fill_c0=med(fill0),
               fill_c1=med(fill1), last_pv_to_end=med(tail), store=med(stores), pv_c1_after_c0=med(pvlag),
               gap_between_blocks=med(gaps), gap_mean=st.mean(gaps) if gaps else 0, sm_span_med=med(spans), sm_span_max=max(spans))
    out[name] = res
    print(name, json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}))
json.dump(out, open(sys.argv[1], "w"), indent=1)
