#!/usr/bin/env python3
"""PyTorch peers for the distattn CUDA kernels (run on the GPU machine).

  torch_peer.py accuracy DUMP_DIR OUT.json
      For each case dumped by `distattn-cuda-bench dump DUMP_DIR` (same inputs): an f64
      reference on the GPU, PyTorch SDPA flash's error and distattn's error against it.
  torch_peer.py bench OUT.json [--dims 128,64] [--quick] [--seqs 16384,...]
      PyTorch SDPA flash and cuDNN, forward and backward, on the standard grid (CUDA events,
      warm-up, median), FlashAttention FLOP convention.
  torch_peer.py merge OUT.json ROWS.json... [--commit C]
      Joins row files into {device, date, commit, rows}.
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def rel(x, r):
    x = x.double()
    r = r.double()
    return float((x - r).norm() / r.norm().clamp_min(1e-300))


def load(path, dtype, shape):
    raw = np.fromfile(path, dtype=np.uint16 if dtype != torch.float32 else np.float32)
    t = torch.from_numpy(raw.astype(np.int16) if dtype != torch.float32 else raw)
    if dtype != torch.float32:
        t = t.view(dtype)
    return t.reshape(shape).cuda()


def accuracy(dump, out):
    rows = []
    print(f"{'case':<28} {'t':>5} | {'O ours':>9} {'O torch':>9} | {'dQ ours':>9} {'dQ torch':>9} | "
          f"{'dK ours':>9} {'dK torch':>9} | {'dV ours':>9} {'dV torch':>9} | ratio")
    for name in sorted(os.listdir(dump)):
        sub = os.path.join(dump, name)
        mp = os.path.join(sub, "meta.json")
        if not os.path.isfile(mp):
            continue
        m = json.load(open(mp))
        dt = torch.bfloat16 if m["dtype"] == "bf16" else torch.float16
        b, nq, nk, h, kv, d = m["batch"], m["q_len"], m["k_len"], m["heads"], m["kv_heads"], m["head_dim"]
        if kv != h or nq != nk:
            continue
        qs, ks = (b, nq, h, d), (b, nk, kv, d)
        q, k, v, do = (load(os.path.join(sub, f), dt, s) for f, s in
                       [("q.bin", qs), ("k.bin", ks), ("v.bin", ks), ("do.bin", qs)])
        causal = m["causal"]
        # f64 reference through autograd.
        q64, k64, v64 = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH):
            o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        o64.backward(do.double().transpose(1, 2))
        ref = {"o": o64.detach().transpose(1, 2), "dq": q64.grad.transpose(1, 2),
               "dk": k64.grad.transpose(1, 2), "dv": v64.grad.transpose(1, 2)}
        # PyTorch flash on the same inputs.
        qt, kt, vt = (x.transpose(1, 2).detach().clone().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        ot.backward(do.transpose(1, 2))
        torch_out = {"o": ot.detach().transpose(1, 2), "dq": qt.grad.transpose(1, 2),
                     "dk": kt.grad.transpose(1, 2), "dv": vt.grad.transpose(1, 2)}
        ours = {"o": load(os.path.join(sub, "o.bin"), dt, qs)}
        if m["grads"]:
            ours["dq"] = load(os.path.join(sub, "dq.bin"), dt, qs)
            ours["dk"] = load(os.path.join(sub, "dk.bin"), dt, ks)
            ours["dv"] = load(os.path.join(sub, "dv.bin"), dt, ks)
        row = {"case": name, "dtype": m["dtype"], "head_dim": d, "causal": causal}
        ok = True
        worst = 0.0
        for key in ["o", "dq", "dk", "dv"]:
            if key in ours:
                eo, et = rel(ours[key], ref[key]), rel(torch_out[key], ref[key])
                row[f"err_{key}_ours"], row[f"err_{key}_torch"] = eo, et
                ok &= eo <= 1e-2 and eo <= et
                worst = max(worst, eo / et)
        row["ours_le_torch_and_1e-2"] = ok
        row["max_ratio_ours_over_torch"] = worst
        rows.append(row)
        f = lambda kk: f"{row.get(kk, float('nan')):9.2e}"
        print(f"{name:<28} {m['dtype']:>5} | {f('err_o_ours')} {f('err_o_torch')} | {f('err_dq_ours')} {f('err_dq_torch')} | "
              f"{f('err_dk_ours')} {f('err_dk_torch')} | {f('err_dv_ours')} {f('err_dv_torch')} | "
              f"max ours/torch {worst:.3f}{'' if ok else ' (ours > torch somewhere)'}")
    json.dump(rows, open(out, "w"), indent=1)
    n_ok = sum(r["ours_le_torch_and_1e-2"] for r in rows)
    worst = max((r["max_ratio_ours_over_torch"] for r in rows), default=float("nan"))
    n_1e2 = sum(all(r.get(f"err_{k}_ours", 0) <= 1e-2 for k in ["o", "dq", "dk", "dv"]) for r in rows)
    print(f"accuracy vs PyTorch flash on the same inputs: {n_1e2} of {len(rows)} cases <= 1e-2; "
          f"{n_ok} of {len(rows)} with every distattn error <= torch's; worst distattn/torch error ratio {worst:.3f}")


def time_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def bench(out, dims, quick, seqs=None):
    rows = []
    grid = [(16384 // s, s) for s in [512, 1024, 2048, 4096, 8192, 16384]]
    if not quick:
        grid += [(1, 65536), (1, 131072)]
    if seqs:
        grid = [(b, s) for b, s in grid if s in seqs]
    for d in dims:
        heads = 2048 // d
        for batch, seq in grid:
            g = torch.Generator(device="cuda").manual_seed(seq)
            mk = lambda: torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            q, k, v, do = mk(), mk(), mk(), mk()
            for x in (q, k, v):
                x.requires_grad_()
            for causal in [False, True]:
                fwd_flops = 4.0 * batch * heads * seq * seq * d / (2.0 if causal else 1.0)
                reps = 3 if seq >= 65536 else 10
                for name, backend in [("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)]:
                    try:
                        with sdpa_kernel(backend):
                            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            tf = time_ms(f, reps)
                            o = f()
                            bw = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                            tb = time_ms(bw, reps)
                            del o
                    except Exception as e:  # a backend may refuse a size
                        print(f"{name} causal={causal} b={batch} n={seq} d={d}: failed: {str(e)[:200]}")
                        continue
                    for p, t, fl in [("fwd", tf, fwd_flops), ("bwd", tb, 2.5 * fwd_flops)]:
                        tfl = fl / (t * 1e-3) / 1e12
                        print(f"{name} {p} causal={causal} b={batch} n={seq} h={heads} d={d}: {t:.3f} ms {tfl:.1f} TFLOP/s", flush=True)
                        rows.append({"impl": name, "pass": p, "causal": causal, "batch": batch, "seq": seq,
                                     "heads": heads, "head_dim": d, "dtype": "bf16", "tflops": tfl, "ms": t})
            del q, k, v, do
            torch.cuda.empty_cache()
    json.dump(rows, open(out, "w"), indent=1)


def merge(out, files, commit):
    rows = []
    for f in files:
        rows += json.load(open(f))
    doc = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "commit": commit,
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "rows": rows}
    json.dump(doc, open(out, "w"), indent=1)
    # Summary table: distattn vs peers.
    key = lambda r: (r["head_dim"], r["causal"], r["pass"], r["seq"])
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["impl"]] = r["tflops"]
    print(f"{'d':>4} {'causal':>6} {'pass':>4} {'seq':>7} {'distattn':>9} {'flash':>9} {'cudnn':>9} {'x flash':>8} {'x cudnn':>8}")
    for kk in sorted(by):
        v = by[kk]
        da, fl, cu = v.get("distattn"), v.get("torch-flash"), v.get("torch-cudnn")
        fmt = lambda x: f"{x:9.1f}" if x else f"{'-':>9}"
        ratio = lambda a, b: f"{a / b:8.2f}" if a and b else f"{'-':>8}"
        print(f"{kk[0]:>4} {str(kk[1]):>6} {kk[2]:>4} {kk[3]:>7} {fmt(da)} {fmt(fl)} {fmt(cu)} {ratio(da, fl)} {ratio(da, cu)}")


if __name__ == "__main__":
    a = sys.argv[1:]
    opt = lambda flag, default: a[a.index(flag) + 1] if flag in a else default
    if a[0] == "accuracy":
        accuracy(a[1], a[2])
    elif a[0] == "bench":
        seqs = [int(x) for x in opt("--seqs", "").split(",") if x]
        bench(a[1], [int(x) for x in opt("--dims", "128").split(",")], "--quick" in a, seqs)
    elif a[0] == "merge":
        files = [x for x in a[2:] if not x.startswith("--") and x != opt("--commit", None)]
        merge(a[1], files, opt("--commit", "unknown"))
    else:
        print(__doc__)
        sys.exit(2)
