"""run.c's scalar to_float of every weight type vs the `gguf` package's dequantizer (independent reference).

The scalar kernels are the reference the SIMD kernel sets are tested against (tests/test_kernels.c); here the scalar
row decoders themselves meet llama.cpp's own numpy implementation of each block format (gguf.quants.dequantize) on
random blocks, bit for bit, through a small C driver (tests/dequant_driver.c) that includes run.c. The driver also
reports each type's block shape from run.c's table, checked against gguf's GGML_QUANT_SIZES, and quantizes floats with
the KV cache's quantizers (q8_0, q4_0: from_float), checked against gguf.quants.quantize byte for byte.
"""
from __future__ import annotations

import functools
import subprocess
import zlib

import numpy as np

from common import ROOT, SCRATCH, build_driver
from test_dequant import QT, GGML_QUANT_SIZES, _random_blocks, _test_data, gguf_dequantize, gguf_quantize

# every type run.c runs natively, by its gguf name
NATIVE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@functools.cache
def _driver() -> str:
    """Built once per run, without the SIMD kernel sets (the driver calls the scalar definitions only), which
    would be most of this module's time to compile."""
    return str(build_driver("dequant_driver.c", ("-O2", "-DSCALAR_SET_ONLY")))


def _check_type(exe: str, name: str) -> None:
    qt = QT[name]
    rng = np.random.default_rng(zlib.crc32(("run.c " + name).encode()))
    blocks = _random_blocks(name, rng)
    src, dst = SCRATCH / f"dequant_{name}.in", SCRATCH / f"dequant_{name}.out"
    blocks.tofile(src)
    r = subprocess.run([exe, str(int(qt)), str(src), str(dst)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{name}: driver failed: {r.stderr}"
    block, size = GGML_QUANT_SIZES[qt]
    assert r.stdout.split()[1:] == [str(block), str(size)], f"{name}: run.c's table says {r.stdout.strip()}, gguf {block} {size}"
    want = gguf_dequantize(blocks, qt).astype(np.float32).reshape(-1)
    got = np.fromfile(dst, dtype=np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, (f"{name}: {diff.size} of {want.size} values differ from gguf, first at {diff[0]}: "
                            f"run.c {got[diff[0]]!r} gguf {want[diff[0]]!r}")
    assert np.isfinite(want).sum() > want.size // 2, f"{name}: test data degenerate"


def test_run_c_scalar_to_float_matches_gguf() -> None:
    exe = _driver()
    failures = []
    for name in NATIVE:
        try:
            _check_type(exe, name)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)
    print(f"run.c scalar to_float == gguf.quants.dequantize bit for bit: {', '.join(NATIVE)}")


def test_run_c_kv_quantizers_match_gguf() -> None:
    exe = _driver()
    for name in ("Q8_0", "Q4_0"):
        x = _test_data(np.random.default_rng(zlib.crc32(("run.c kv " + name).encode())))
        src, dst = SCRATCH / f"quant_{name}.in", SCRATCH / f"quant_{name}.out"
        x.astype(np.float32).tofile(src)
        r = subprocess.run([exe, str(int(QT[name])), str(src), str(dst), "from"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{name}: driver failed: {r.stderr}"
        want = gguf_quantize(x.astype(np.float32), QT[name]).reshape(-1)
        got = np.fromfile(dst, dtype=np.uint8)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{name}: {bad.size} of {want.size} bytes differ from gguf's quantizer, first at byte {bad[0]}"
