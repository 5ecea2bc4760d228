"""Scalar reference kernels vs their SIMD versions (tests/test_kernels.c)."""
from __future__ import annotations

import subprocess

from common import ROOT, SCRATCH


def build_and_run(name: str, flags: list[str]) -> str:
    exe = SCRATCH / name
    cc = subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", *flags, f"-I{ROOT}",
                         str(ROOT / "tests/test_kernels.c"), str(ROOT / "tokenizer.c"), "-o", str(exe), "-lm"],
                        capture_output=True, text=True)
    assert cc.returncode == 0 and not cc.stderr, f"compile failed:\n{cc.stderr}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kernel checks failed:\n{out.stdout}{out.stderr}"
    return out.stdout


def cpu_has_avx2() -> bool:
    flags = open("/proc/cpuinfo").read()
    return all(f in flags.split() for f in ("avx2", "fma", "f16c"))


def test_simd_kernels_match_scalar():
    out = build_and_run("test_kernels_native", ["-march=native"])
    if cpu_has_avx2():
        assert "kernels: avx2" in out, "this CPU has AVX2 but the native build tested no AVX2 kernel set:\n" + out
    print("".join(line + "\n" for line in out.splitlines() if line.startswith(("kernels:", "skip"))), end="")


def test_scalar_build_kernels():
    out = build_and_run("test_kernels_portable", [])
    assert "kernels: scalar" in out and "1 kernel sets tested" in out, out


def test_kernels_under_sanitizers():
    build_and_run("test_kernels_asan", ["-march=native", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g"])
