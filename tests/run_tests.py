#!/usr/bin/env python3
"""Run every test in tests/test_*.py and end with the line `N passed, N failed`.

A test is a module-level function named `test_*` taking no arguments; it
passes when it returns and fails when it raises. Nothing is skipped: a test
whose prerequisite is missing fails, saying what is missing.

    python3 tests/run_tests.py              # all tests
    python3 tests/run_tests.py tokenizer    # only modules whose name contains 'tokenizer'
    python3 tests/run_tests.py -k prefill   # only tests whose name contains 'prefill'
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent


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
    args = ap.parse_args()

    passed = failed = 0
    for path in sorted(TESTS.glob("test_*.py")):
        if args.modules and not any(m in path.stem for m in args.modules):
            continue
        try:
            module = load_module(path)
        except Exception:
            print(f"FAIL {path.name}: import error\n{traceback.format_exc()}", flush=True)
            failed += 1
            continue
        for name in sorted(n for n in dir(module) if n.startswith("test_")):
            fn = getattr(module, name)
            if not callable(fn) or args.k not in name:
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
