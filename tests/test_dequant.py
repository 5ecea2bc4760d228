"""export.py's ggml block decoders and quantizers vs the `gguf` package (independent reference).

The `gguf` package (pip, test-only dependency) carries llama.cpp's own numpy implementation of
every block format, so decoding random blocks with both must give bit-identical floats.
"""
from __future__ import annotations

import importlib.util
import sys
import zlib

import numpy as np

from common import ROOT

try:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT
    from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
except ImportError as e:  # a missing prerequisite is a failure, never a skip
    raise AssertionError(f"the gguf package is needed for these tests: pip install gguf ({e})")


def _load_export():
    spec = importlib.util.spec_from_file_location("export", ROOT / "export.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["export"] = mod
    spec.loader.exec_module(mod)
    return mod


export = _load_export()

# Byte offsets of the f16 scale fields in each block (ggml's block_* structs in ggml/src/ggml-common.h):
# random bytes there could be inf/NaN, which makes "equal" meaningless, so they get sane finite values.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
N_BLOCKS = 512


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values of both signs spanning normal and subnormal ranges, plus zeros."""
    mag = np.exp2(rng.uniform(-20, 4, n)).astype(np.float16)
    vals = np.where(rng.random(n) < 0.5, -mag, mag).astype(np.float16)
    vals[:3] = [0.0, -0.0, 6e-8]
    return vals


def _random_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    qt = QT[name]
    block, size = GGML_QUANT_SIZES[qt]
    if name == "F32":
        x = (rng.standard_normal(N_BLOCKS) * np.exp2(rng.uniform(-30, 30, N_BLOCKS))).astype(np.float32)
        x[:4] = [0.0, -0.0, np.inf, 1e-45]
        return x.view(np.uint8).reshape(N_BLOCKS, 4)
    if name == "F16":
        return _finite_f16(rng, N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
    if name == "BF16":
        bits = rng.integers(0, 2**16, N_BLOCKS, dtype=np.uint16)
        bits &= np.uint16(0xBFFF)   # clear the exponent's top bit: always finite
        bits[:3] = [0x0000, 0x8000, 0x0001]   # zeros and a subnormal
        return bits.view(np.uint8).reshape(N_BLOCKS, 2)
    blocks = rng.integers(0, 256, (N_BLOCKS, size), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        blocks[:, at:at + 2] = _finite_f16(rng, N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
    return blocks


def _check_decoder(name: str) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    blocks = _random_blocks(name, rng)
    qt = QT[name]
    want = gguf_dequantize(blocks, qt).astype(np.float32).reshape(-1)
    got = export.dequantize(blocks.reshape(-1), int(qt))
    assert got.dtype == np.float32 and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, (f"{name}: {diff.size} of {want.size} values differ from gguf, first at {diff[0]}: "
                            f"ours {got[diff[0]]!r} gguf {want[diff[0]]!r}")
    assert np.isfinite(want).sum() > want.size // 2, f"{name}: test data degenerate"


def test_dequant_f32() -> None:
    _check_decoder("F32")


def test_dequant_f16() -> None:
    _check_decoder("F16")


def test_dequant_bf16() -> None:
    _check_decoder("BF16")


def test_dequant_q4_0() -> None:
    _check_decoder("Q4_0")


def test_dequant_q4_1() -> None:
    _check_decoder("Q4_1")


def test_dequant_q5_0() -> None:
    _check_decoder("Q5_0")


def test_dequant_q5_1() -> None:
    _check_decoder("Q5_1")


def test_dequant_q8_0() -> None:
    _check_decoder("Q8_0")


def test_dequant_q2_k() -> None:
    _check_decoder("Q2_K")


def test_dequant_q3_k() -> None:
    _check_decoder("Q3_K")


def test_dequant_q4_k() -> None:
    _check_decoder("Q4_K")


def test_dequant_q5_k() -> None:
    _check_decoder("Q5_K")


def test_dequant_q6_k() -> None:
    _check_decoder("Q6_K")


def test_q4_1_worked_example() -> None:
    """A Q4_1 block worked by hand from ggml (block_q4_1 in ggml-common.h: f16 d, f16 m, 16 bytes of nibbles;
    dequantize_row_q4_1 in ggml-quants.c: x = d*q + m, low nibbles are elements 0..15, high nibbles 16..31):
    d = 0.5, m = -1, qs[0] = 0x3A gives element 0 = 10*0.5 - 1 = 4.0 and element 16 = 3*0.5 - 1 = 0.5;
    qs[1] = 0 gives -1 for elements 1 and 17."""
    block = bytes([0x00, 0x38, 0x00, 0xBC, 0x3A]) + bytes(15)
    v = export.dequantize(np.frombuffer(block, np.uint8), 3)
    assert (v[0], v[16], v[1], v[17]) == (4.0, 0.5, -1.0, -1.0), v


def _test_data(rng: np.random.Generator) -> np.ndarray:
    """(rows, 64) float32 rows covering the awkward cases of the reference quantizers."""
    rows = [
        rng.standard_normal(64) * 0.02,                          # typical weights
        rng.uniform(-1000, 1000, 64),                            # large range
        np.zeros(64),                                            # d == 0
        np.full(64, 0.37),                                       # constant block (Q4_1 d == 0)
        np.concatenate([[127.0], np.arange(-15.5, 15.5)]).tolist() + [0.5, -0.5] * 16,   # exact .5 ties with d = 1
        np.where(np.arange(64) % 7 == 0, 50.0, 1e-3),            # outliers
        -np.abs(rng.standard_normal(64)),                        # all negative
        rng.standard_normal(64) * 1e-6,                          # tiny values
    ]
    extra = rng.standard_normal((200, 64)) * np.exp2(rng.uniform(-12, 4, (200, 1)))
    return np.vstack([np.asarray(r, dtype=np.float64) for r in rows] + [extra]).astype(np.float32)


def test_quantize_q8_0_matches_gguf() -> None:
    x = _test_data(np.random.default_rng(1))
    want = gguf_quantize(x, QT.Q8_0).reshape(-1)
    got = export.quantize_q8_0(x).reshape(-1)
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.shape, want.shape)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ from gguf's Q8_0 quantizer, first at byte {bad[0]}"


def test_quantize_q4_1_matches_gguf() -> None:
    x = _test_data(np.random.default_rng(2))
    want = gguf_quantize(x, QT.Q4_1).reshape(-1)
    got = export.quantize_q4_1(x).reshape(-1)
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.shape, want.shape)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ from gguf's Q4_1 quantizer, first at byte {bad[0]}"


def test_q8_0_round_half_away_from_zero() -> None:
    """With d = 1 (max 127), x = 2.5 must give 3 and -2.5 give -3 (roundf), not banker's 2/-2."""
    x = np.zeros(32, np.float32)
    x[:5] = [127.0, 2.5, -2.5, 0.5, -0.5]
    q = export.quantize_q8_0(x)[0, 2:].view(np.int8)
    assert q[:5].tolist() == [127, 3, -3, 1, -1], q[:5]


def _f16_slack(d32: np.ndarray, d16: np.ndarray, qmax: int) -> np.ndarray:
    """Extra error from storing the scale as f16 after the q's were computed with the f32 scale."""
    return qmax * np.abs(d16 - d32)


def test_q8_0_error_bound() -> None:
    x = _test_data(np.random.default_rng(3)).reshape(-1, 32)
    blocks = export.quantize_q8_0(x)
    deq = gguf_dequantize(blocks, QT.Q8_0).reshape(-1, 32)   # decode with the reference decoder
    d32 = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    d16 = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    bound = d32 / 2 + _f16_slack(d32, d16, 127) + 1e-6 * np.abs(x).max(axis=1, keepdims=True) + 1e-30
    err = np.abs(deq - x)
    worst = int(np.argmax((err - bound).max(axis=1)))
    assert np.all(err <= bound), f"block {worst}: err {err[worst].max()} > bound {bound[worst, 0]}"
    # where d is a normal f16 its relative rounding error is <= 2^-11, so the slack is <= 127 * 2^-11 * d
    normal = (d32 >= 2**-14).reshape(-1)
    assert np.all(err[normal] <= (0.5 + 127 / 2048) * d32[normal] * (1 + 1e-6)), "f16 scale slack larger than expected"


def test_q4_1_error_bound() -> None:
    x = _test_data(np.random.default_rng(4)).reshape(-1, 32)
    blocks = export.quantize_q4_1(x)
    deq = gguf_dequantize(blocks, QT.Q4_1).reshape(-1, 32)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d32 = (hi - lo) / np.float32(15)
    d16 = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m16 = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scale = np.maximum(np.abs(lo), np.abs(hi))
    bound = d32 / 2 + _f16_slack(d32, d16, 15) + np.abs(m16 - lo) + 1e-6 * scale + 1e-30
    err = np.abs(deq - x)
    worst = int(np.argmax((err - bound).max(axis=1)))
    assert np.all(err <= bound), f"block {worst}: err {err[worst].max()} > bound {bound[worst, 0]}"


def test_gguf_reference_implements_what_we_compare() -> None:
    """Guard: the comparisons above are only meaningful if gguf has real implementations."""
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    for qt in (QT.Q8_0, QT.Q4_1):
        out = gguf_quantize(x, qt)
        assert out.dtype == np.uint8 and out.size == 2 * GGML_QUANT_SIZES[qt][1], (qt, out.shape)
