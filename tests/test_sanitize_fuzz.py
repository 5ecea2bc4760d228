"""The end-to-end suite again under AddressSanitizer + UndefinedBehaviorSanitizer,
and every fuzz target for a bounded time. `make test` starts this module first: it is the longest.

Each is one test here so that `make test` ends with a single count; the child
runs print their own per-test lines. SAN_TESTS, SAN_JOBS and FUZZ_SECONDS/FUZZ_JOBS
(environment) change what runs; `make sanitize` and `make fuzz` run them alone.
"""
from __future__ import annotations

import os
import subprocess
import sys

from common import ROOT

# As the Makefile's SAN_TESTS (which `make sanitize` passes): of test_fuzz_regressions only the test that runs the
# engine, its others replaying the libFuzzer harnesses (sanitizer builds already) and export.py alike with any RUN_BIN.
SAN_TESTS = os.environ.get("SAN_TESTS", "bad_inputs fuzz_regressions.in_run cli chat synthetic").split()
# Tests left out of that run (run_tests.py --leave-out): the roofline probe spends its ~20 s under ASan in its
# instrumented read loops over buffers twice the last-level cache; the normal suite runs it.
SAN_LEAVE_OUT = os.environ.get("SAN_LEAVE_OUT", "test_cli.test_probe").split()
# The instrumented modules two at a time (run_tests.py -j): each engine run is mostly single-threaded
# start-up and checking, so two modules keep both cores busy.
SAN_JOBS = os.environ.get("SAN_JOBS", "2")
SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


def test_suite_under_asan_ubsan():
    build = subprocess.run(["make", "-C", str(ROOT), "run-asan"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    env = {**os.environ, **SAN_ENV, "RUN_BIN": str(ROOT / "run-asan")}
    leave = [a for x in SAN_LEAVE_OUT for a in ("--leave-out", x)]
    r = subprocess.run([sys.executable, str(ROOT / "tests/run_tests.py"), "-j", SAN_JOBS, *SAN_TESTS, *leave], env=env,
                       capture_output=True, text=True, timeout=3600)
    print("\n".join("    asan: " + line for line in r.stdout.splitlines()[-3:]))
    assert r.returncode == 0 and " 0 failed" in r.stdout, "sanitizer run failed:\n" + r.stdout[-6000:] + r.stderr[-2000:]


def test_fuzz_targets_run_clean():
    """Each target's fixed runs from its fixed seed (run_fuzz.py --fixed), so that the same sources pass or fail
    the same way every time; with FUZZ_SECONDS set (make fuzz), that long on the kept corpus, random seeds."""
    seconds, jobs = os.environ.get("FUZZ_SECONDS"), os.environ.get("FUZZ_JOBS", "3")
    budget = ["--seconds", seconds] if seconds else ["--fixed"]
    r = subprocess.run([sys.executable, str(ROOT / "tests/fuzz/run_fuzz.py"), *budget, "--jobs", jobs],
                       capture_output=True, text=True, timeout=3600)
    print("\n".join("    fuzz: " + line for line in r.stdout.splitlines()[-8:]))
    assert r.returncode == 0, "a fuzz target failed:\n" + r.stdout[-6000:] + r.stderr[-3000:]
