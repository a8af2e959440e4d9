"""The examples run and say OK."""

import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_tiny_decoder_trains_like_sdpa():
    r = subprocess.run([sys.executable, str(EXAMPLES / "train_tiny_decoder.py")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout.splitlines()[-1]


def test_docstring_examples():
    # The package's docstrings hold runnable examples (the README's example is one of them).
    import doctest

    import distattn.interface

    failed, tried = doctest.testmod(distattn.interface)
    assert tried >= 3 and failed == 0
    import distattn.checkpoint

    failed, tried = doctest.testmod(distattn.checkpoint)
    assert tried >= 3 and failed == 0


def test_readme_python_example():
    readme = (EXAMPLES.parent.parent / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    assert blocks, "the README has a Python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def _train_llama(tmp_path, name, *args, procs=1):
    out, grads = tmp_path / f"{name}.json", tmp_path / f"{name}.pt"
    script = str(EXAMPLES / "train_llama.py")
    common = ["--tiny", "--device", "cpu", "--dtype", "f32", "--steps", "3", "--json", str(out), "--grads", str(grads)]
    if procs > 1:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port", str(port), script]
    else:
        cmd = [sys.executable, script]
    r = subprocess.run(cmd + common + list(args), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    import torch

    g = torch.load(grads)
    return json.loads(out.read_text()), torch.cat([g[k].flatten() for k in sorted(g)])


def test_train_llama_policies_and_context_parallel_match_sdpa(tmp_path):
    """The Llama example: checkpoint policies and 2 context-parallel processes give one
    process's SDPA losses and first-step gradients; remat halves the attention forwards."""
    ref, ref_g = _train_llama(tmp_path, "sdpa", "--attn", "sdpa", "--sdpa-backend", "math", "--policy", "none")
    runs = {p: _train_llama(tmp_path, p, "--policy", p) for p in ("none", "layer", "remat")}
    runs["cp"] = _train_llama(tmp_path, "cp", "--policy", "remat", "--strategy", "zigzag", procs=2)
    for name, (res, g) in runs.items():
        for a, b in zip(res["steps"], ref["steps"]):
            assert abs(a["loss"] - b["loss"]) < 1e-4 * abs(b["loss"]), (name, a, b)
        assert ((g - ref_g).norm() / ref_g.norm()).item() < 1e-4, name
    layers = ref["layers"]
    assert runs["none"][0]["attention_forwards_per_step"] == layers
    assert runs["layer"][0]["attention_forwards_per_step"] == 2 * layers
    assert runs["remat"][0]["attention_forwards_per_step"] == layers
    assert runs["cp"][0]["world"] == 2 and runs["cp"][0]["attention_forwards_per_step"] == layers


def test_serving_over_a_spread_cache_generates_what_one_process_does():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = str(EXAMPLES / "serve_spread_cache.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), script]
    r = subprocess.run(cmd + ["--placement", "zigzag:256"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].endswith("OK"), r.stdout
