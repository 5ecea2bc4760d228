"""Threading must not change results: every output element is computed by one
thread with the same kernel whatever the split, so 1 thread, 2 threads and
the build without OpenMP (run-portable, also without -march=native: the kernel
sets are chosen at run time, not by the compiler) give bit-identical logits and
the same greedy text."""
from __future__ import annotations

import os
import subprocess

import numpy as np

from common import DEFAULT_MODEL, ROOT, RUN, SCRATCH, exported, require, run

PROMPT = "The quick brown fox jumps over the lazy dog. In 1905, Einstein published"
NOOMP = ROOT / "run-portable"


def noomp() -> object:
    """The engine built without OpenMP (make portable), rebuilt if the sources changed."""
    build = subprocess.run(["make", "-C", str(ROOT), "portable"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return NOOMP


def logits(args: list[str], binary=None) -> np.ndarray:
    out = SCRATCH / "threads.logits"
    r = run([DEFAULT_MODEL, "-i", PROMPT, "--dump-logits", out, *args], binary=binary)
    assert r.returncode == 0, r.stderr.decode()
    return np.fromfile(out, dtype=np.float32)


def kernel_sets() -> list[str]:
    """The kernel sets this build runs on this CPU, as its usage error lists them."""
    r = run([DEFAULT_MODEL, "--kernels", "none"])
    assert r.returncode == 2 and b"available: " in r.stderr, r.stderr.decode()
    return r.stderr.decode().split("available: ")[1].split(")")[0].split(", ")


def test_logits_identical_across_thread_counts_and_builds():
    """For every kernel set: each one is identical to itself, whatever the split."""
    require(DEFAULT_MODEL, "run `make model`")
    sets = kernel_sets()
    assert "scalar" in sets, sets
    for k in sets:
        one, two = logits(["--threads", "1", "--kernels", k]), logits(["--threads", "2", "--kernels", k])
        plain = logits(["--kernels", k], binary=noomp())
        assert one.size > 0 and np.isfinite(one).all()
        assert np.array_equal(one, two), f"{k}: 1 vs 2 threads: max diff {np.abs(one - two).max()}"
        assert np.array_equal(one, plain), f"{k}: OpenMP vs no-OpenMP build: max diff {np.abs(one - plain).max()}"
    print("kernel sets checked:", ", ".join(sets))


def test_greedy_text_identical_across_thread_counts_and_builds():
    require(DEFAULT_MODEL, "run `make model`")
    args = [DEFAULT_MODEL, "-t", "0", "-n", "40", "-i", PROMPT]
    texts = [run([*args, "--threads", "1"]), run([*args, "--threads", "2"]), run(args, binary=noomp())]
    for r in texts:
        assert r.returncode == 0, r.stderr.decode()
    assert len(texts[0].stdout) > 20
    assert texts[0].stdout == texts[1].stdout == texts[2].stdout, [t.stdout for t in texts]


def test_long_prompt_decode_path_matches_prefill_and_thread_counts():
    """Past ATT_CHUNK (256) cached positions decode splits attention across
    threads in chunks and merges them; prefill does whole jobs. Both must
    agree, and the decode split must not depend on the thread count. Float
    (f16) weights: with int8 activations a last-bit difference between the two
    paths flips roundings and the logits differ by the quantization noise
    (~3 % here), which would hide a real bug."""
    model = exported("f16")
    ids = " ".join(str(100 + (i * 37) % 4000) for i in range(270))
    out = SCRATCH / "long.logits"

    def dump(*args: str) -> np.ndarray:
        r = run([model, "--ids", ids, "--dump-logits", out, "--kv", "f32", *args])
        assert r.returncode == 0, r.stderr.decode()
        return np.fromfile(out, dtype=np.float32).reshape(270, -1)

    batched, step1, step2 = dump(), dump("--no-batch", "--threads", "1"), dump("--no-batch", "--threads", "2")
    assert np.array_equal(step1, step2), f"decode differs between 1 and 2 threads: {np.abs(step1 - step2).max()}"
    rel = np.abs(batched - step1).max(axis=1) / np.abs(batched).max(axis=1)
    assert rel.max() < 1e-4, f"prefill vs decode: worst relative difference {rel.max():.2e} at position {rel.argmax()}"
    assert (batched.argmax(axis=1) == step1.argmax(axis=1)).mean() > 0.99


def test_default_threads_follow_the_affinity_mask():
    """The default team was the online CPU count even under `taskset -c 0`, where two threads
    decoded 8x slower than one (issue 11). It is the CPUs the process may run on."""
    require(DEFAULT_MODEL, "run `make model`")
    cmd = [str(RUN), str(DEFAULT_MODEL), "-i", "hi", "-n", "2", "-t", "0", "-v"]
    for cpus in ({0}, set(sorted(os.sched_getaffinity(0))[:2])):
        r = subprocess.run(cmd, capture_output=True, timeout=120, preexec_fn=lambda c=cpus: os.sched_setaffinity(0, c))
        assert r.returncode == 0, r.stderr.decode()
        model_line = next(ln for ln in r.stderr.decode().splitlines() if ln.startswith("model:"))
        assert f", {len(cpus)} threads," in model_line, f"affinity {sorted(cpus)}: {model_line}"
