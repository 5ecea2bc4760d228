"""Scalar reference kernels vs their SIMD versions (tests/test_kernels.c)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from common import DEFAULT_MODEL, KERNELS_ENV, ROOT, SANITIZE, SCRATCH, require, run


def build(name: str, flags: list[str], compiler: str = "cc") -> Path:
    """tests/test_kernels.c (which includes run.c) built into SCRATCH/name; a warning fails."""
    exe = SCRATCH / name
    cc = subprocess.run([compiler, "-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", *flags, f"-I{ROOT}",
                         str(ROOT / "tests/test_kernels.c"), str(ROOT / "tokenizer.c"), "-o", str(exe), "-lm"],
                        capture_output=True, text=True)
    assert cc.returncode == 0 and not cc.stderr, f"compile failed:\n{cc.stderr}"
    return exe


def run_checks(exe: Path, runner: tuple[str, ...] = (), *args: str) -> str:
    out = subprocess.run([*runner, str(exe), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"kernel checks failed:\n{out.stdout}{out.stderr}"
    return out.stdout


def build_and_run(name: str, flags: list[str]) -> str:
    return run_checks(build(name, flags))


def cpu_sets() -> list[str]:
    """The x86 kernel sets this CPU can run, from the kernel's own report (/proc/cpuinfo), in run.c's
    order of sets (the order test_kernels.c tests them)."""
    flags = set(open("/proc/cpuinfo").read().split())
    sets = ["scalar"]
    if {"avx2", "fma", "f16c"} <= flags:
        sets.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags:
            sets.append("avx512")
        if "avx_vnni" in flags:
            sets.append("avxvnni")
    return sets


def best_set() -> str:
    """The set the engine picks by itself: AVX-512 over AVX-VNNI over AVX2 (run.c, KSET_RANK)."""
    return next(s for s in ("avx512", "avxvnni", "avx2", "scalar") if s in cpu_sets())


def check_sets(out: str) -> None:
    """Every set the CPU runs was tested, and the others were reported as skipped."""
    tested = [line.split()[1] for line in out.splitlines() if line.startswith("kernels:")]
    assert tested == cpu_sets(), f"sets tested {tested}, this CPU runs {cpu_sets()}:\n{out}"
    assert f"{len(tested)} kernel sets tested" in out, out
    print("".join(line + "\n" for line in out.splitlines() if line.startswith(("kernels:", "skip"))), end="")


def test_simd_kernels_match_scalar():
    # NATIVE_SETS_ONLY: the sets -march=native says this CPU lacks, which it would skip, are not compiled (the
    # sanitizer build below compiles every set); check_sets still wants every set the CPU reports tested
    check_sets(build_and_run("test_kernels_native", ["-march=native", "-DNATIVE_SETS_ONLY"]))
    check_avxvnni_twin()


def test_portable_engine_uses_the_best_set():
    """`make portable` (no -march): the engine still picks the best set this CPU runs (RUN_KERNELS unset, as a
    forced suite run sets it), and runs every one of them when asked, by --kernels or by RUN_KERNELS (--kernels
    wins); an unavailable or unknown set is a usage error listing the available ones, naming where it came from."""
    require(DEFAULT_MODEL, "run `make model`")
    build = subprocess.run(["make", "-C", str(ROOT), "portable"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    exe = ROOT / "run-portable"
    gen = [DEFAULT_MODEL, "-v", "-n", "4", "-t", "0", "-i", "The capital of France is"]
    r = run(gen, binary=exe, env={KERNELS_ENV: None})
    assert r.returncode == 0 and f"{best_set()} kernels" in r.stderr.decode(), r.stderr.decode()
    other = cpu_sets()[0] if best_set() != cpu_sets()[0] else cpu_sets()[-1]
    for k in cpu_sets():
        for how, env in ((["--kernels", k], {KERNELS_ENV: other}), ([], {KERNELS_ENV: k})):
            forced = run(gen + how, binary=exe, env=env)
            assert forced.returncode == 0 and f"{k} kernels" in forced.stderr.decode(), (how, env, forced.stderr.decode())
            assert forced.stdout.strip(), f"{k}: no text"
    for how, env, named in ((["--kernels", "sse9"], {KERNELS_ENV: None}, "--kernels 'sse9'"), ([], {KERNELS_ENV: "sse9"}, f"{KERNELS_ENV} 'sse9'")):
        bad = run([DEFAULT_MODEL, "-i", "x", *how], binary=exe, env=env)
        err = bad.stderr.decode()
        assert bad.returncode == 2 and f"run: {named} is not a kernel set" in err, err
        assert f"available: {', '.join(cpu_sets())})" in err and len(err.splitlines()) == 1, err


def check_avxvnni_twin() -> None:
    """The AVX-VNNI set built with AVXVNNI_TWIN: its kernels' 256-bit vpdpbusd in the AVX512-VL encoding
    (the same operation), so a CPU with AVX-512 VNNI but not AVX-VNNI still checks the set's code. Where
    the CPU has AVX-VNNI the set itself ran; where it has neither, this says so."""
    flags = set(open("/proc/cpuinfo").read().split())
    if "avx_vnni" in flags:
        return
    need = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    if not need <= flags:
        print(f"skip avxvnni: this CPU has neither AVX-VNNI nor {sorted(need - flags)} for its EVEX twin")
        return
    out = build_and_run("test_kernels_avxvnni_twin", ["-DAVXVNNI_TWIN"])
    assert "kernels: avxvnni" in out.splitlines(), out
    packed = [line for line in out.splitlines() if line.startswith("ok") and "avxvnni" in line and "packed" in line]
    assert len(packed) >= 20, out  # 5 types x 2 lengths x (bit for bit, vs the scalar dot)
    print(f"avxvnni through its EVEX twin (this CPU lacks AVX-VNNI): {len(packed)} packed-product checks passed")


# The kernel checks under ASan/UBSan, built portably (no -march: every x86 set is compiled through its target
# attributes, those this CPU lacks too, unlike the other sanitizer builds' NATIVE_SETS_ONLY) at -O0, which compiles
# in the time -O1 takes for the CPU's own sets (about 55 s of one core). Portable: the sets still run without
# -march. Every set compiled: a set's CPU check must not run that set's instructions. gcc compiled
# cpu_has_avx512_vnni, when it stood inside AVX-512's target region, with an AVX-512 store in its stack set-up
# at -O0 under ASan: this build died of SIGILL on an AVX2-only CPU.
KERNELS_SANITIZE = ["-O0", *(f for f in SANITIZE if f not in ("-O1", "-DNATIVE_SETS_ONLY"))]


def test_portable_build_under_sanitizers_tests_every_set():
    out = build_and_run("test_kernels_asan", KERNELS_SANITIZE)
    check_sets(out)
    assert "all kernel checks passed" in out, out


def test_avx512_sets_under_bochs():
    """The AVX-512 VNNI set and AVX-VNNI's EVEX twin under Bochs's tigerlake CPU, booted with their static
    checks (tests/bochs_avx512.py): correctness only, on any x86 machine (a CPU that runs them was checked above
    too). Every check passes but the f16 writer's, which Bochs's own rounding (shown in the guest) leaves unchecked.
    `make test` installs Bochs (emu-deps)."""
    from bochs_avx512 import run_under_bochs

    lines, passed, failed = run_under_bochs()
    report = "\n".join(lines)
    assert failed == 0, report
    assert passed >= 200, f"only {passed} checks ran:\n{report}"  # 113 and 112 in this build
    print("".join(f"{line}\n" for line in lines if line.startswith(("kernels:", "not checked"))), end="")
    print(f"{passed} checks passed under Bochs")


def test_neon_kernels_under_qemu():
    """The NEON sets, cross-compiled for aarch64 (Debian's gcc-aarch64-linux-gnu, static) and run under
    qemu-aarch64 (qemu-user): correctness only. `make test` installs both (cross-deps)."""
    missing = [t for t in ("aarch64-linux-gnu-gcc", "qemu-aarch64") if not shutil.which(t)]
    assert not missing, f"{missing} not installed: run `make cross-deps`"
    # qemu's default CPU ("max") has the dot-product extension and runs every check; a Cortex-A53 (ARMv8.0-A)
    # has not, so there the sdot set must be found missing in the hwcaps and skipped (--list: the CPU check
    # alone, the kernels being the ones "max" just tested)
    exe = build("test_kernels_aarch64", ["-static"], "aarch64-linux-gnu-gcc")
    for cpu, sets, done in (((), ["scalar", "neon", "neon-dot"], "kernel sets tested"),
                            (("-cpu", "cortex-a53"), ["scalar", "neon"], "kernel sets found")):
        out = run_checks(exe, ("qemu-aarch64", *cpu), *(["--list"] if cpu else []))
        tested = [line.split()[1] for line in out.splitlines() if line.startswith("kernels:")]
        assert tested == sets and f"{len(sets)} {done}" in out, out
        print(" ".join(cpu) or "max", "".join(line + "\n" for line in out.splitlines() if line.startswith(("kernels:", "skip"))), end="")
