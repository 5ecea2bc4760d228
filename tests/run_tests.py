#!/usr/bin/env python3
"""Run every test in tests/test_*.py and end with the line `N passed, N failed`.

A test is a module-level function named `test_*` taking no arguments; it
passes when it returns and fails when it raises. Nothing is skipped: a test
whose prerequisite is missing fails, saying what is missing.

    python3 tests/run_tests.py              # all tests
    python3 tests/run_tests.py tokenizer    # only modules whose name contains 'tokenizer'
    python3 tests/run_tests.py -k prefill   # only tests whose name contains 'prefill'
    python3 tests/run_tests.py --check      # the fast subset (make check): see CHECK below
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
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


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(TESTS))
    sys.modules[path.stem] = module  # dataclasses and pickling look modules up here
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", help="substrings of module names to run")
    ap.add_argument("-k", default="", help="substring of test names to run")
    ap.add_argument("--check", action="store_true", help="only the fast subset listed in CHECK (make check)")
    args = ap.parse_args()
    check = {m for m, _ in CHECK}

    passed = failed = 0
    for path in sorted(TESTS.glob("test_*.py")):
        if args.modules and not any(m in path.stem for m in args.modules):
            continue
        if args.check and path.stem not in check:
            continue
        try:
            module = load_module(path)
        except Exception:
            print(f"FAIL {path.name}: import error\n{traceback.format_exc()}", flush=True)
            failed += 1
            continue
        for name in sorted(n for n in dir(module) if n.startswith("test_")):
            fn = getattr(module, name)
            if not callable(fn) or args.k not in name or (args.check and (path.stem, name) not in CHECK):
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
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
