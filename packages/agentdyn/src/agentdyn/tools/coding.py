"""Coding tools: a small generated repository with a bug, file reading, patching, and its pytest suite.

``repo_init`` writes the repository (a ``mathlib`` package whose ``is_prime`` has an off-by-one
bug, a test suite that checks it against a sieve over ``range(work)``, and a numpy two-layer
perceptron whose tests check gradients by finite differences and train it for ``work // 80``
steps: CPU-bound, scaled by ``work``; numpy's BLAS runs with its default thread count, i.e. one
thread per core the process may run on, as numerical test suites do). ``apply_patch`` applies exact-text replacements (fails when the old text is absent).
``run_tests`` runs ``python -m pytest`` on the repository as a child process (same process group,
so a hung test run is killed with the tool) and reports passed/failed counts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

__all__ = ["repo_init", "read_file", "apply_patch", "run_tests", "BUGGY_LINE", "FIXED_LINE"]

REPO = "repo"
BUGGY_LINE = "    for d in range(3, int(n**0.5), 2):"
FIXED_LINE = "    for d in range(3, int(n**0.5) + 1, 2):"

_PRIMES = '''"""Prime numbers."""


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
{loop}
        if n % d == 0:
            return False
    return True


def primes_below(n: int) -> list[int]:
    return [k for k in range(n) if is_prime(k)]
'''

_SEQ = '''"""Integer sequences."""


def collatz_len(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def longest_collatz(limit: int) -> int:
    return max(range(1, limit), key=collatz_len)
'''

_TEST_PRIMES = """import pytest

from mathlib.primes import is_prime, primes_below

WORK = {work}


def sieve(n):
    flags = bytearray([1]) * n
    flags[0:2] = b"\\x00\\x00"
    for i in range(2, int(n**0.5) + 1):
        if flags[i]:
            flags[i * i :: i] = bytearray(len(flags[i * i :: i]))
    return [i for i in range(n) if flags[i]]


@pytest.mark.parametrize("part", range(4))
def test_matches_sieve(part):
    lo, hi = part * WORK // 4, (part + 1) * WORK // 4
    expect = set(sieve(hi))
    for k in range(lo, hi):
        assert is_prime(k) == (k in expect), k


def test_small():
    assert primes_below(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]


def test_squares_are_composite():
    for p in (3, 5, 7, 11, 13):
        assert not is_prime(p * p)
"""

_TEST_SEQ = """from mathlib.seq import collatz_len, longest_collatz

WORK = {work}


def test_collatz_small():
    assert collatz_len(1) == 0
    assert collatz_len(6) == 8


def test_longest():
    n = longest_collatz(WORK // 4)
    assert all(collatz_len(k) <= collatz_len(n) for k in range(1, WORK // 4))
"""


_NN = '''"""A two-layer perceptron in numpy: forward, backward, SGD."""

import numpy as np


def init(n_in: int, n_hidden: int, n_out: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((n_in, n_hidden)) / np.sqrt(n_in),
        "b1": np.zeros(n_hidden),
        "w2": rng.standard_normal((n_hidden, n_out)) / np.sqrt(n_hidden),
        "b2": np.zeros(n_out),
    }


def forward(p: dict, x):
    h = np.tanh(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"], h


def loss_and_grad(p: dict, x, y):
    out, h = forward(p, x)
    d = (out - y) / len(x)
    loss = 0.5 * float(np.sum((out - y) ** 2)) / len(x)
    dh = (d @ p["w2"].T) * (1 - h**2)
    return loss, {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ d, "b2": d.sum(0)}


def train(p: dict, x, y, steps: int, lr: float = 0.2) -> list:
    losses = []
    for _ in range(steps):
        loss, g = loss_and_grad(p, x, y)
        for k in p:
            p[k] -= lr * g[k]
        losses.append(loss)
    return losses
'''

_TEST_NN = """import numpy as np
import pytest

from mathlib.nn import init, loss_and_grad, train

STEPS = {steps}
WIDTH = 256


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, WIDTH))
    teacher = rng.standard_normal((WIDTH, 8)) / np.sqrt(WIDTH)
    return x, np.tanh(x @ teacher)


def test_gradients_match_finite_differences():
    x, y = data(1)
    p = init(WIDTH, WIDTH, 8, seed=2)
    _, g = loss_and_grad(p, x, y)
    rng = np.random.default_rng(3)
    eps = 1e-6
    for k in ("w1", "w2", "b1"):
        for _ in range(max(2, STEPS // 25)):
            i = tuple(int(rng.integers(0, s)) for s in p[k].shape)
            old = p[k][i]
            p[k][i] = old + eps
            lp, _ = loss_and_grad(p, x, y)
            p[k][i] = old - eps
            lm, _ = loss_and_grad(p, x, y)
            p[k][i] = old
            assert abs((lp - lm) / (2 * eps) - g[k][i]) < 1e-6 + 1e-3 * abs(g[k][i])


@pytest.mark.parametrize("seed", range(2))
def test_training_reduces_loss(seed):
    x, y = data(seed)
    p = init(WIDTH, WIDTH, 8, seed=seed)
    losses = train(p, x, y, STEPS)
    assert losses[-1] < 0.9 * losses[0]
"""


def _repo(workdir: str) -> str:
    return os.path.join(workdir, REPO)


def _safe(workdir: str, rel: str) -> str:
    root = os.path.realpath(_repo(workdir))
    path = os.path.realpath(os.path.join(root, rel))
    if not path.startswith(root + os.sep):
        raise ValueError(f"path {rel!r} leaves the repository")
    return path


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def repo_init(args: dict, workdir: str) -> dict:
    """Generate the repository; ``work`` scales the CPU the test suite needs (default 40000)."""
    work = int(args.get("work", 40_000))
    if work < 100:
        raise ValueError(f"args.work must be >= 100, not {work}")
    root = _repo(workdir)
    files = {
        "mathlib/__init__.py": '"""A tiny math library."""\n',
        "mathlib/primes.py": _PRIMES.format(loop=BUGGY_LINE),
        "mathlib/seq.py": _SEQ,
        "tests/test_primes.py": _TEST_PRIMES.format(work=work),
        "tests/test_seq.py": _TEST_SEQ.format(work=work),
        "mathlib/nn.py": _NN,
        "tests/test_nn.py": _TEST_NN.format(steps=max(10, work // 80)),
        "pyproject.toml": '[project]\nname = "mathlib"\nversion = "0.0.1"\n[tool.pytest.ini_options]\npythonpath = ["."]\n',
    }
    for rel, text in files.items():
        _write(os.path.join(root, rel), text)
    return {"repo": REPO, "files": sorted(files), "work": work}


def read_file(args: dict, workdir: str) -> dict:
    rel = str(args.get("path", ""))
    with open(_safe(workdir, rel)) as f:
        text = f.read()
    return {"path": rel, "text": text}


def apply_patch(args: dict, workdir: str) -> dict:
    """Apply ``edits`` = [{"path", "old", "new"}, ...]; each ``old`` must occur exactly once."""
    edits = args.get("edits")
    if not isinstance(edits, list) or not edits:
        raise ValueError("args.edits: required, a non-empty list of {path, old, new}")
    changed = []
    for i, e in enumerate(edits):
        path = _safe(workdir, str(e.get("path", "")))
        with open(path) as f:
            text = f.read()
        old, new = str(e.get("old", "")), str(e.get("new", ""))
        count = text.count(old) if old else 0
        if count != 1:
            raise ValueError(f"args.edits[{i}].old occurs {count} times in {e.get('path')}; it must occur exactly once")
        _write(path, text.replace(old, new))
        changed.append(e.get("path"))
    return {"changed": changed}


def run_tests(args: dict, workdir: str) -> dict:
    """Run the repository's pytest suite; returns exit code, passed/failed counts and the output tail."""
    root = _repo(workdir)
    if not os.path.isdir(root):
        raise FileNotFoundError("no repository here; call repo_init first")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    if args.get("k"):
        cmd += ["-k", str(args["k"])]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors)", out)}
    return {
        "exit_code": p.returncode,
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
        "tail": out.strip().splitlines()[-5:],
    }
