#!/usr/bin/env python3
"""Build the fuzz targets, make their seeds, run each for a bounded time, report executions and crashes.

    python3 tests/fuzz/run_fuzz.py [--seconds 60] [--jobs 2] [--work DIR] [--targets loader,tokenizer,...]
    python3 tests/fuzz/run_fuzz.py --fixed [--jobs 3]      # make test: the same executions every time
    python3 tests/fuzz/run_fuzz.py --build-only

Targets (C ones built with clang -fsanitize=fuzzer,address,undefined; Python ones with atheris):
  loader       tests/fuzz/fuzz_loader.c       run.c's build_model + a short generation
  tokenizer    tests/fuzz/fuzz_tokenizer.c    tok_encode/tok_decode on the real vocabularies
  tok_section  tests/fuzz/fuzz_tok_section.c  tok_create on damaged tokenizer sections
  json         tests/fuzz/fuzz_json.c         run.c's JSON reader and string writer on any bytes
  gguf         tests/fuzz/fuzz_export.py      export.py on damaged GGUF files
  safetensors  tests/fuzz/fuzz_export.py      export.py on damaged safetensors files

Each target runs --seconds (libFuzzer's -max_total_time), --jobs at a time. The corpus is kept
in WORK/corpus/TARGET between runs; a crash is written to WORK/crashes/TARGET/ and fails the
run. With --fixed, each target instead runs FIXED_RUNS executions from its own fixed -seed, starting
afresh from its seeds and its kept regression inputs (WORK/fixed-corpus/TARGET is emptied first), so
that a run finds the same things every time for the same sources: `make test` uses it, so that
a test run does not pass one day and fail the next on a new random finding; `make fuzz` explores. To keep a crash as a regression case, fix the bug, then copy the input into
tests/fuzz/regressions/TARGET/ (tests/test_fuzz_regressions.py replays them all).
Exit status: 0 when every target ran its time without a failure, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))
from common import SCRATCH  # noqa: E402

# The loader and json targets share one binary (fuzz_engine.c includes both harnesses and run.c once, which is
# what takes clang long: see OPT); bin/fuzz_loader and bin/fuzz_json are links to it, and its name picks the target.
C_TARGETS = {"loader": "fuzz_engine.c", "tokenizer": "fuzz_tokenizer.c", "tok_section": "fuzz_tok_section.c",
             "json": "fuzz_engine.c"}
# sources a harness includes besides run.c (a change rebuilds it)
C_PARTS = {"fuzz_engine.c": ("fuzz_loader.c", "fuzz_json.c")}
PY_TARGETS = ("gguf", "safetensors")
ALL_TARGETS = tuple(C_TARGETS) + PY_TARGETS
CLANG = os.environ.get("FUZZ_CC", "clang")
# NATIVE_SETS_ONLY: only the kernel sets this CPU runs (run.c), as in the other sanitizer builds
CFLAGS = ["-std=c11", "-g", "-march=native", "-DNATIVE_SETS_ONLY", "-fno-omit-frame-pointer", "-Wall", "-Wextra",
          "-Wno-unknown-pragmas", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all",
          f"-fsanitize-coverage-ignorelist={HERE / 'coverage_ignore.txt'}", f"-I{ROOT}"]
# -O1 (AddressSanitizer's advice), except fuzz_engine.c (all of run.c): there clang spends ~2 min of CPU at -O1, most
# of it optimizing UBSan's pointer-overflow checks in the inlined AVX2 kernels, and 25 s at -O0, whose code runs the
# json target at half the speed (the fixed runs take ~15 s longer). FUZZ_ENGINE_OPT=-O1 for long `make fuzz` sessions.
OPT = {"fuzz_engine.c": os.environ.get("FUZZ_ENGINE_OPT", "-O0")}
# Leaks are checked; the quarantine is kept small so that fresh pages are not faulted in on every run.
ASAN_OPTIONS = "detect_leaks=1:quarantine_size_mb=64:allocator_may_return_null=1"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"
# the sources fuzzed: the repository's, or a patched copy (FUZZ_SRC=dir or --src dir)
DEFAULT_SRC = Path(os.environ.get("FUZZ_SRC", ROOT))
# shared with the tests (tests/common.py's SCRATCH, in memory or in the temp directory), so that `make test` and
# `make fuzz` reuse one build
DEFAULT_WORK = SCRATCH / "fuzz"
REGRESSIONS = HERE / "regressions"
# --fixed: executions per target (about 80 s of CPU for all six), and each target's libFuzzer -seed. Sized on the
# coverage curve of a run twice as long (edges reached / edges at the doubled count, fuzz_engine.c at -O0, this
# machine, 2026-12-02): tokenizer 436/436 (its last new edge at 10,617), safetensors 524/524 (at 945), json
# 320/321; tok_section (603/606), gguf (542/554, its last new edge at 9,671) and the loader (1726/1740, cheap: ~6 s)
# were still finding edges at their doubled counts and keep them. `make fuzz` is the long exploration.
FIXED_RUNS = {"loader": 1000, "tokenizer": 15000, "tok_section": 30000, "json": 50000, "gguf": 10000,
              "safetensors": 1750}
FIXED_SEEDS = {target: 1 + i for i, target in enumerate(ALL_TARGETS)}
FIXED_TIMEOUT = 1800   # seconds for one target's fixed run: only a hang takes this long


def sanitizer_env(extra: dict | None = None) -> dict:
    return dict(os.environ, ASAN_OPTIONS=ASAN_OPTIONS, UBSAN_OPTIONS=UBSAN_OPTIONS, **(extra or {}))


def check_clang() -> None:
    if not shutil.which(CLANG):
        raise SystemExit(f"run_fuzz: {CLANG} not found: the fuzz targets need clang and its sanitizer runtime "
                         f"(Debian: apt-get install clang libclang-rt-dev)")


def build(work: Path, src_dir: Path = DEFAULT_SRC) -> dict[str, Path]:
    """Compile the C targets into WORK/bin (again only when a source is newer). Returns {target: exe}.
    src_dir holds the run.c, tokenizer.c and tokenizer.h to fuzz (a patched copy, say)."""
    check_clang()
    out = work / "bin"
    out.mkdir(parents=True, exist_ok=True)
    exes = {}
    stamp = out / "src_dir"
    built_as = f"{src_dir} {OPT}"
    rebuild_all = not stamp.exists() or stamp.read_text() != built_as
    for src in dict.fromkeys(C_TARGETS.values()):
        exe = out / Path(src).stem
        sources = [HERE / src, src_dir / "tokenizer.c"]
        deps = sources + [HERE / part for part in C_PARTS.get(src, ())] + [
            src_dir / "tokenizer.h", src_dir / "run.c", HERE / "coverage_ignore.txt", Path(__file__), HERE.parent / "json_canon.h"]
        if rebuild_all or not exe.exists() or any(d.stat().st_mtime > exe.stat().st_mtime for d in deps):
            cmd = [CLANG, f"-I{src_dir}", *CFLAGS, OPT.get(src, "-O1"), f'-DRUN_C="{src_dir / "run.c"}"', *map(str, sources), "-lm", "-o", str(exe)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"run_fuzz: building {exe.name} failed:\n{' '.join(cmd)}\n{r.stderr}")
            if r.stderr.strip():
                print(f"run_fuzz: warnings building {exe.name}:\n{r.stderr}", file=sys.stderr)
    for target, src in C_TARGETS.items():
        exe = out / f"fuzz_{target}"
        if exe.name != Path(src).stem and not (exe.is_symlink() and os.readlink(exe) == Path(src).stem):
            exe.unlink(missing_ok=True)   # a separate binary of an older layout
            exe.symlink_to(Path(src).stem)
        exes[target] = exe
    stamp.write_text(built_as)
    return exes


def make_seeds(work: Path) -> None:
    r = subprocess.run([sys.executable, str(HERE / "make_seeds.py"), str(work)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"run_fuzz: make_seeds.py failed:\n{r.stdout}{r.stderr}")


@contextlib.contextmanager
def locked(work: Path, exclusive: bool):
    """WORK's lock: `make test` runs test_fuzz_regressions and the fixed fuzz runs side by side on one WORK, and
    make_seeds() rewrites the seeds that both read. Writers (prepare) hold it exclusively, readers (a run, a
    replay) shared, so that no one reads a half-written seed or runs a binary clang is still writing."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


def prepare(work: Path, src_dir: Path = DEFAULT_SRC) -> dict[str, Path]:
    """build() and make_seeds() under WORK's lock; a second caller waits, then finds the binaries fresh."""
    with locked(work, exclusive=True):
        exes = build(work, src_dir)
        make_seeds(work)
    return exes


def target_env(target: str, work: Path) -> dict:
    """Python's hash seed fixed too, so that a Python target's coverage (set and dict order) repeats."""
    extra = {"FUZZ_VOCABS": str(work / "vocab.list")} if target == "tokenizer" else {"PYTHONHASHSEED": "0"}
    return sanitizer_env(extra)


def run_target(target: str, work: Path, exes: dict[str, Path], seconds: int, fixed: bool = False) -> dict:
    """One target for `seconds` on the kept corpus, or (fixed) its FIXED_RUNS from FIXED_SEEDS on a fresh one."""
    corpus, crashes, seeds = (work / d / target for d in ("fixed-corpus" if fixed else "corpus", "crashes", "seeds"))
    if fixed:
        shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    for old in crashes.iterdir():
        old.unlink()
    log = work / "logs" / f"{target}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    kept = [REGRESSIONS / target] if fixed and (REGRESSIONS / target).is_dir() else []
    # -reload=0: libFuzzer otherwise rereads the corpus directory every second, which makes the order of the
    # inputs (and so the run) depend on the machine's speed
    budget = ([f"-runs={FIXED_RUNS[target]}", f"-seed={FIXED_SEEDS[target]}", "-reload=0"] if fixed
              else [f"-max_total_time={seconds}"])
    if target in C_TARGETS:
        max_len = max(p.stat().st_size for p in seeds.iterdir())
        cmd = [str(exes[target]), *budget, "-timeout=20", "-rss_limit_mb=2048",
               f"-max_len={max_len}", "-print_final_stats=1", f"-artifact_prefix={crashes}/",
               *([f"-dict={HERE / (target + '.dict')}"] if (HERE / (target + ".dict")).exists() else []),
               str(corpus), str(seeds), *map(str, kept)]
    else:
        cmd = [sys.executable, str(HERE / "fuzz_export.py"), target, str(work), "--corpus", str(corpus)]
        cmd += (["--runs", str(FIXED_RUNS[target]), "--seed", str(FIXED_SEEDS[target]), "--inputs", *map(str, kept)]
                if fixed else ["--seconds", str(seconds)])
    t0 = time.time()
    # the Python target's scratch files, here because atheris ends its process without cleaning up
    with open(log, "wb") as f, tempfile.TemporaryDirectory(prefix=f"fuzz_export_{target}_", dir=SCRATCH) as tmp:
        if target not in C_TARGETS:
            cmd += ["--scratch", tmp]
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=target_env(target, work),
                            timeout=FIXED_TIMEOUT if fixed else seconds + 600).returncode
    text = log.read_text(errors="replace")
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", text)
    found = sorted(crashes.iterdir())
    return {"target": target, "rc": rc, "seconds": time.time() - t0, "runs": int(runs[-1]) if runs else 0,
            "corpus": len(list(corpus.iterdir())), "crashes": found, "log": log}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="targets run at once (default: cores)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"build, seed and corpus directory ({DEFAULT_WORK})")
    ap.add_argument("--targets", default=",".join(ALL_TARGETS), help="comma-separated subset")
    ap.add_argument("--build-only", action="store_true", help="build the C targets and the seeds, run nothing")
    ap.add_argument("--fixed", action="store_true", help="each target's FIXED_RUNS executions from its fixed seed, "
                    "on a fresh corpus from its seeds and kept regression inputs (the same run every time)")
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="directory with the run.c/tokenizer.c/tokenizer.h "
                    "to fuzz (default: $FUZZ_SRC, else the repository's)")
    args = ap.parse_args()
    work = args.work.resolve()
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(ALL_TARGETS)
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)} (known: {', '.join(ALL_TARGETS)})")

    exes = prepare(work, args.src.resolve())
    if args.build_only:
        return 0
    budget = "a fixed number of runs" if args.fixed else f"{args.seconds} s"
    print(f"run_fuzz: {len(targets)} targets x {budget}, {args.jobs} at a time, in {work}", flush=True)
    with locked(work, exclusive=False), ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda t: run_target(t, work, exes, args.seconds, args.fixed), targets))

    failed = 0
    print(f"{'target':12s} {'seconds':>8s} {'executions':>11s} {'exec/s':>7s} {'corpus':>7s}  result")
    for r in results:
        ok = r["rc"] == 0 and not r["crashes"] and r["runs"] > 0
        failed += not ok
        result = "clean" if ok else f"FAILED (exit {r['rc']}; {len(r['crashes'])} crash inputs; log {r['log']})"
        print(f"{r['target']:12s} {r['seconds']:8.0f} {r['runs']:11d} {r['runs'] / max(r['seconds'], 1):7.0f} "
              f"{r['corpus']:7d}  {result}")
        for c in r["crashes"]:
            print(f"    crash input: {c}")
        if not ok:
            tail = r["log"].read_text(errors="replace").splitlines()[-40:]
            print("    " + "\n    ".join(tail))
    (work / "summary.txt").write_text("\n".join(f"{r['target']} {r['runs']} {len(r['crashes'])}" for r in results) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
