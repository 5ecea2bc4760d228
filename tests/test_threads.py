"""Threading must not change results: every output element is computed by one
thread with the same kernel whatever the split, so 1 thread, 2 threads and
the build without OpenMP give bit-identical logits and the same greedy text."""
from __future__ import annotations

import subprocess

import numpy as np

from common import DEFAULT_MODEL, ROOT, SCRATCH, require, run

PROMPT = "The quick brown fox jumps over the lazy dog. In 1905, Einstein published"
NOOMP = ROOT / "run-noomp"


def noomp() -> object:
    """The engine built without OpenMP, rebuilt if the sources changed."""
    build = subprocess.run(["make", "-C", str(ROOT), "run-noomp"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return NOOMP


def logits(args: list[str], binary=None) -> np.ndarray:
    out = SCRATCH / "threads.logits"
    r = run([DEFAULT_MODEL, "-i", PROMPT, "--dump-logits", out, *args], binary=binary)
    assert r.returncode == 0, r.stderr.decode()
    return np.fromfile(out, dtype=np.float32)


def test_logits_identical_across_thread_counts_and_builds():
    require(DEFAULT_MODEL, "run `make model`")
    one, two = logits(["--threads", "1"]), logits(["--threads", "2"])
    plain = logits([], binary=noomp())
    assert one.size > 0 and np.isfinite(one).all()
    assert np.array_equal(one, two), f"1 vs 2 threads: max diff {np.abs(one - two).max()}"
    assert np.array_equal(one, plain), f"OpenMP vs no-OpenMP build: max diff {np.abs(one - plain).max()}"


def test_greedy_text_identical_across_thread_counts_and_builds():
    require(DEFAULT_MODEL, "run `make model`")
    args = [DEFAULT_MODEL, "-t", "0", "-n", "40", "-i", PROMPT]
    texts = [run([*args, "--threads", "1"]), run([*args, "--threads", "2"]), run(args, binary=noomp())]
    for r in texts:
        assert r.returncode == 0, r.stderr.decode()
    assert len(texts[0].stdout) > 20
    assert texts[0].stdout == texts[1].stdout == texts[2].stdout, [t.stdout for t in texts]
