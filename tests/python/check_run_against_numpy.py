#!/usr/bin/env python3
"""Checks `distattn run` against a float64 NumPy softmax-attention reference.

Usage: check_run_against_numpy.py PATH_TO_DISTATTN_BINARY

For several masks (full, causal, sliding window, documents), GQA on and off and lengths that
are not multiples of any tile size, it writes random f32 inputs as .npy files, runs the binary,
and compares O, LSE, dQ, dK and dV with the reference (relative error, tolerance 1e-5).
Fresh inputs each run; the seed is printed and can be fixed with DISTATTN_SEED.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

TOL = 1e-5


def keep_matrix(mask, nq, nk):
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    diag = i + (nk - nq)
    if mask == "full":
        return np.ones((nq, nk), bool)
    if mask == "causal":
        return j <= diag
    if mask.startswith("window:"):
        left, right = (int(x) for x in mask.split(":")[1].split(","))
        return (j >= diag - left) & (j <= diag + right)
    if mask.startswith("docs-causal:") or mask.startswith("docs:"):
        lens = [int(x) for x in mask.split(":")[1].split(",")]
        doc = np.repeat(np.arange(len(lens)), lens)
        same = doc[:, None] == doc[None, :]
        return same & (j <= i) if mask.startswith("docs-causal") else same
    raise ValueError(mask)


def reference(q, k, v, do, keep):
    """Float64 attention forward and backward, [b, n, h, d] layout, GQA by head repetition."""
    b, nq, h, d = q.shape
    group = h // k.shape[2]
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    kr = np.repeat(k, group, axis=2)
    vr = np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kr) / np.sqrt(d)
    s = np.where(keep[None, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    p = np.where(z > 0, e / np.where(z > 0, z, 1), 0.0)
    lse = np.where(z[..., 0] > 0, np.log(np.where(z[..., 0] > 0, z[..., 0], 1)) + m[..., 0], -np.inf)
    o = np.einsum("bhij,bjhd->bihd", p, vr)
    dp = np.einsum("bihd,bjhd->bhij", do, vr)
    delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]
    ds = p * (dp - delta) / np.sqrt(d)
    dq = np.einsum("bhij,bjhd->bihd", ds, kr)
    dkr = np.einsum("bhij,bihd->bjhd", ds, q)
    dvr = np.einsum("bhij,bihd->bjhd", p, do)
    shape = k.shape[:2] + (k.shape[2], group, d)
    return o, lse, dq, dkr.reshape(shape).sum(3), dvr.reshape(shape).sum(3)


def rel(x, ref):
    x = np.where(np.isfinite(ref), x, 0.0)
    ref = np.where(np.isfinite(ref), ref, 0.0)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def main():
    binary = sys.argv[1]
    seed = int(os.environ.get("DISTATTN_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"seed {seed} (set DISTATTN_SEED to replay)")
    rng = np.random.default_rng(seed)
    cases = [
        # (batch, nq, nk, heads, kv_heads, d, mask)
        (1, 257, 257, 4, 4, 64, "full"),
        (2, 129, 129, 4, 2, 32, "causal"),
        (1, 77, 200, 8, 2, 64, "causal"),
        (1, 300, 300, 6, 3, 128, "window:40,5"),
        (1, 333, 333, 4, 1, 64, "docs:100,33,200"),
        (1, 333, 333, 4, 4, 96, "docs-causal:17,250,66"),
        (1, 1, 130, 4, 2, 64, "causal"),
    ]
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for b, nq, nk, h, hk, d, mask in cases:
            q = rng.standard_normal((b, nq, h, d)).astype(np.float32)
            k = rng.standard_normal((b, nk, hk, d)).astype(np.float32)
            v = rng.standard_normal((b, nk, hk, d)).astype(np.float32)
            do = rng.standard_normal((b, nq, h, d)).astype(np.float32)
            paths = {n: os.path.join(tmp, n + ".npy") for n in ("q", "k", "v", "do", "o", "lse", "dq", "dk", "dv")}
            for n, x in (("q", q), ("k", k), ("v", v), ("do", do)):
                np.save(paths[n], x)
            cmd = [binary, "run", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--mask", mask,
                   "--out", paths["o"], "--lse", paths["lse"], "--grad-out", paths["do"],
                   "--dq", paths["dq"], "--dk", paths["dk"], "--dv", paths["dv"]]
            subprocess.run(cmd, check=True, capture_output=True)
            want = reference(q, k, v, do, keep_matrix(mask, nq, nk))
            errs = {n: rel(np.load(paths[n]).astype(np.float64), w) for n, w in zip(("o", "lse", "dq", "dk", "dv"), want)}
            worst = max(errs.values())
            ok = worst <= TOL
            passed += ok
            failed += not ok
            detail = " ".join(f"{n}={e:.1e}" for n, e in errs.items())
            print(f"{'ok  ' if ok else 'FAIL'} b={b} nq={nq} nk={nk} h={h}/{hk} d={d} mask={mask}: {detail}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
