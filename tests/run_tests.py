#!/usr/bin/env python3
"""Run every test in tests/test_*.py and end with the line `N passed, N failed`.

A test is a module-level function named `test_*` taking no arguments; it
passes when it returns and fails when it raises. Nothing is skipped: a test
whose prerequisite is missing fails, saying what is missing.

    python3 tests/run_tests.py              # all tests
    python3 tests/run_tests.py tokenizer    # only modules whose name contains 'tokenizer'
    python3 tests/run_tests.py cli.pipe     # in those modules, only tests whose name contains 'pipe'
    python3 tests/run_tests.py -k prefill   # only tests whose name contains 'prefill'
    python3 tests/run_tests.py --check      # the fast subset (make check): see CHECK below
    python3 tests/run_tests.py -j 2         # two modules at a time, the longest first (make test)

A whole run (no module or -k filter) that ends with no failure removes its scratch directory (common.SCRATCH,
about 8 GB of exports, logits and builds by the end) unless --keep-scratch is given; after a failure it stays,
for a look at what the failing test left.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# make check: what a reader who just edited the forward pass wants to know within two minutes. Every kernel
# set this CPU runs against the scalar definitions; the tiny models against the float64 reference (exported
# from GGUF and from a Hugging Face directory, quantized, one token at a time against batched); the
# tokenizer against llama.cpp's goldens; the command line's basics. (module, test) pairs.
CHECK = [
    ("test_kernels", "test_simd_kernels_match_scalar"),
    ("test_synthetic", "test_gguf_f32_matches_reference"),
    ("test_synthetic", "test_hf_f32_matches_reference"),
    ("test_synthetic", "test_prefill_equals_decode"),
    ("test_synthetic", "test_export_q4_1"),
    ("test_synthetic", "test_untied_quantized"),
    ("test_synthetic", "test_kv_cache_precision"),
    ("test_synthetic", "test_scalar_kernels"),
    ("test_tokenizer", "test_goldens_smollm2"),
    ("test_tokenizer", "test_goldens_gemma3"),
    ("test_tokenizer", "test_roundtrip_corpus"),
    ("test_cli", "test_bad_flag_values_exit_2_naming_the_flag"),
    ("test_cli", "test_other_usage_errors_exit_2"),
    ("test_cli", "test_runtime_errors_exit_1"),
    ("test_cli", "test_verbose_only_on_stderr"),
    ("test_cli", "test_empty_prompt_is_an_error"),
]


# With -j N the longest modules start first, so that the last one to finish is a short one (seconds measured on a
# 2-core machine; a module not listed counts as short). test_sanitize_fuzz (the ASan/UBSan build and suite, the
# fixed fuzz runs: ~300 CPU-s, some of it on both cores) goes first, test_kernels (~380 s, 220 of them in Bochs)
# second.
# test_fuzz_regressions is short once test_sanitize_fuzz has built the fuzz targets (it waits for that build).
LONG_FIRST = ("test_sanitize_fuzz", "test_kernels", "test_oracle_quant", "test_batch", "test_prompt_cache",
              "test_json_output", "test_lookup", "test_quant", "test_family_oracles", "test_qwen", "test_export_types",
              "test_tokenizer", "test_export_errors", "test_stop", "test_sampling", "test_threads", "test_oracle",
              "test_logprobs")
SUMMARY = re.compile(rb"(\d+) passed, (\d+) failed")


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(TESTS))
    sys.modules[path.stem] = module  # dataclasses and pickling look modules up here
    spec.loader.exec_module(module)
    return module


def run_module(path: Path, ks: tuple[str, ...], check: bool, leave: tuple[str, ...] = ()) -> tuple[int, int]:
    """Runs the module's tests whose names contain every one of ks, and whose MODULE.NAME none of leave, in this
    process, printing one line per test; returns (passed, failed)."""
    passed = failed = 0
    try:
        module = load_module(path)
    except Exception:
        print(f"FAIL {path.name}: import error\n{traceback.format_exc()}", flush=True)
        return 0, 1
    for name in sorted(n for n in dir(module) if n.startswith("test_")):
        fn = getattr(module, name)
        chosen = all(k in name for k in ks) and not any(x in f"{path.stem}.{name}" for x in leave)
        if not callable(fn) or not chosen or (check and (path.stem, name) not in CHECK):
            continue
        t0 = time.time()
        try:
            fn()
        except Exception as e:
            failed += 1
            detail = traceback.format_exc() if not isinstance(e, AssertionError) else f"{e}\n{traceback.format_exc(limit=-2)}"
            print(f"FAIL {path.stem}.{name} ({time.time() - t0:.1f}s): {detail}", flush=True)
        else:
            passed += 1
            print(f"ok   {path.stem}.{name} ({time.time() - t0:.1f}s)", flush=True)
    return passed, failed


def run_module_child(path: Path, ks: tuple[str, ...], check: bool, leave: tuple[str, ...]) -> tuple[int, int, bytes]:
    """The module in a child run_tests.py of its own (a fresh interpreter, as when run alone); returns
    (passed, failed, its whole output). A child that dies without its count line is one failure."""
    cmd = [sys.executable, __file__, "--module", path.stem, *(a for k in ks for a in ("-k", k)), *(["--check"] if check else []),
           *(a for x in leave for a in ("--leave-out", x))]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    body, _, last = r.stdout.rstrip(b"\n").rpartition(b"\n")
    counts = SUMMARY.fullmatch(last)
    if not counts:
        return 0, 1, r.stdout + f"FAIL {path.stem}: its run ended (exit {r.returncode}) without a count\n".encode()
    out = body + b"\n" if body else b""
    p, f = map(int, counts.groups())
    if r.returncode != (1 if f else 0):
        return p, f + 1, out + f"FAIL {path.stem}: exit {r.returncode} after {p} passed, {f} failed\n".encode()
    return p, f, out


def run_parallel(paths: dict[Path, tuple[str, ...]], jobs: int, check: bool, leave: tuple[str, ...]) -> tuple[int, int]:
    """The modules `jobs` at a time, each in a child process; each module's output is printed whole as soon as
    it ends."""
    order = {name: i for i, name in enumerate(LONG_FIRST)}
    pooled = sorted(paths, key=lambda p: order.get(p.stem, len(order)))
    passed = failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_module_child, p, paths[p], check, leave) for p in pooled]
        for fut in as_completed(futures):
            p, f, out = fut.result()
            sys.stdout.buffer.write(out)
            sys.stdout.flush()
            passed, failed = passed + p, failed + f
    return passed, failed


def select(modules: list[str], k: list[str]) -> dict[Path, tuple[str, ...]]:
    """The modules named (all when none are), each with the substrings its tests' names must contain: every -k, and
    TEST from the first MODULE.TEST that names it."""
    chosen = {}
    for p in sorted(TESTS.glob("test_*.py")):
        specs = [m.partition(".") for m in modules if m.partition(".")[0] in p.stem]
        if modules and not specs:
            continue
        chosen[p] = tuple(k) + ((specs[0][2],) if specs and specs[0][2] else ())
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", help="substrings of module names to run; MODULE.TEST: of that module, "
                    "only the tests whose names contain TEST")
    ap.add_argument("-k", action="append", default=[], help="substring of test names to run (repeated: all of them)")
    ap.add_argument("--leave-out", action="append", default=[], metavar="MODULE.TEST",
                    help="do not run the tests whose test_MODULE.test_NAME contains this (repeatable)")
    ap.add_argument("--check", action="store_true", help="only the fast subset listed in CHECK (make check)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="modules run at once, each in a child process "
                    "(default 1: all in this process)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the scratch directory after a whole run")
    ap.add_argument("--module", help=argparse.SUPPRESS)   # exactly this module (the children of -j)
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"-j {args.jobs}: at least 1")
    check = {m for m, _ in CHECK}
    from common import KERNELS_ENV, SCRATCH   # the scratch folder chosen here, once: the children find it in TEST_SCRATCH
    if args.module is None and os.environ.get(KERNELS_ENV):
        print(f"every ./run of this run uses the {os.environ[KERNELS_ENV]} kernel set ({KERNELS_ENV})", flush=True)

    paths = {p: ks for p, ks in select(args.modules, args.k).items()
             if (not args.check or p.stem in check) and (args.module is None or p.stem == args.module)}
    if args.jobs > 1 and len(paths) > 1:
        passed, failed = run_parallel(paths, args.jobs, args.check, tuple(args.leave_out))
    else:
        passed = failed = 0
        for path, ks in paths.items():
            p, f = run_module(path, ks, args.check, tuple(args.leave_out))
            passed, failed = passed + p, failed + f
    if not (failed or args.modules or args.k or args.leave_out or args.module or args.keep_scratch):
        shutil.rmtree(SCRATCH, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
