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
