"""Replay every input kept in tests/fuzz/regressions/ (crashes the fuzzers found, now fixed).

Each C target's inputs go through its libFuzzer harness, built here with clang and ASan/UBSan
(tests/fuzz/run_fuzz.py), and the loader's also through ./run; export.py's go through
tests/fuzz/fuzz_export.py --replay. The seed corpora are replayed too, so a harness that no longer
builds or no longer accepts valid input fails here, not only under `make fuzz`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common import RUN, TESTS, require, run

from fuzz import run_fuzz

REGRESSIONS = TESTS / "fuzz" / "regressions"
_built: dict[str, Path] = {}


def work() -> Path:
    """Targets built and seeds made once per session (both cached on disk across sessions)."""
    if not _built:
        _built.update(run_fuzz.prepare(run_fuzz.DEFAULT_WORK))
    return run_fuzz.DEFAULT_WORK


def inputs(target: str) -> list[Path]:
    return sorted(p for p in (REGRESSIONS / target).glob("*") if p.is_file() and not p.name.startswith((".", "README")))


def replay_c(target: str, with_seeds: bool = True) -> None:
    w = work()
    with run_fuzz.locked(w, exclusive=False):   # the seeds are not rewritten meanwhile
        files = inputs(target) + (sorted((w / "seeds" / target).iterdir()) if with_seeds else [])
        assert files, f"nothing to replay for {target}"
        r = subprocess.run([str(_built[target]), "-runs=1", *map(str, files)], capture_output=True, text=True,
                           env=run_fuzz.target_env(target, w), timeout=600)
    assert r.returncode == 0, f"fuzz_{target} failed on a kept input:\n{r.stderr[-4000:]}"


def test_loader_regressions_in_harness():
    replay_c("loader")


def test_loader_regressions_in_run():
    """The same files through the real CLI, sampling on: exit 0, or exit 1 with one line."""
    require(RUN, "build the engine with `make`")
    files = inputs("loader")
    assert files, "no loader regression inputs"
    for f in files:
        for temp in ("0", "0.8"):
            r = run([f, "--ids", "0", "-n", "4", "-t", temp, "-p", "0.9", "-s", "3", "--threads", "1"], stdin=b"", timeout=120)
            lines = [ln for ln in r.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
            ok = (r.returncode == 0 and not lines) or (r.returncode == 1 and len(lines) == 1 and lines[0].startswith("run: "))
            assert ok, f"{f.name} -t {temp}: exit {r.returncode}, stderr:\n" + "\n".join(lines[:30])


def test_tokenizer_regressions():
    replay_c("tokenizer")


def test_tok_section_regressions():
    replay_c("tok_section")


def test_json_regressions():
    replay_c("json")


def test_export_regressions():
    w = work()
    for target in ("gguf", "safetensors"):
        with run_fuzz.locked(w, exclusive=False):
            files = inputs(target) + sorted((w / "seeds" / target).iterdir())
            r = subprocess.run([sys.executable, str(TESTS / "fuzz" / "fuzz_export.py"), target, str(w), "--replay",
                                *map(str, files)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"fuzz_export.py {target} failed on a kept input:\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
