"""Issue 4: `./run --ppl` and the quality of the quantized types.

* --ppl against an independent computation: a tiny random model
  (tests/make_synthetic.py) and its float64 numpy reference
  (tests/ref_forward.py); the perplexity is computed from the reference's
  logits with llama.cpp's windowing rule (tests/ppl_ref.py).
* SmolLM2-135M: logits of the quantized exports against the F32 export on the
  first perplexity window of tests/data/kjv-genesis.txt. The quantized files are
  exported from an F32 GGUF (the Q4_1 GGUF's weights dequantized by the `gguf`
  package, tests/quality.py:make_f32_gguf), so nothing is block-copied and every
  matrix goes through export.py's quantizer.
* The KV cache types (f16, int8) against the f32 KV cache by perplexity.
* The scalar (--scalar) and SIMD paths of the quantized types agree end to end.

Per-block quantize -> dequantize error bounds are in tests/test_dequant.py and
kernel-level scalar/SIMD agreement in tests/test_kernels.py.

Measured (AVX2, 1 or 2 threads; the bounds below leave headroom):
  q8_0 vs f32, 512 positions: top-1 95.7 .. 96.1 %, mean KL 0.0086 .. 0.0088; every
      argmax flip is at a position where f32's top-1 leads its runner-up by < 0.5 logit.
  q4_1 vs f32: top-1 96.7 .. 97.1 %, mean KL 0.0056 .. 0.0058, flips at margins < 0.56.
  llama.cpp itself (llama-cpp-python 0.3.36) on the same weights and tokens:
      Q8_0 vs F32 top-1 96.3 %, KL 0.0090; Q4_1 vs F32 96.3 %, KL 0.0053.
  Issue 4 asks for >= 98 % top-1 for Q8_0; neither engine reaches it here: the
  int8 activation blocks (as in llama.cpp) and the Q8_0 rounding of the weights
  each cost ~2-3 % of argmaxes at near-ties on this small model (numpy
  simulation: Q8_0 weights with float activations 97.3 %, float weights with
  int8 activations 97.5 %). The tests bound what is meaningful instead: KL, and
  agreement wherever f32 is not near a tie.
"""
from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_synthetic as ms  # noqa: E402
import ppl_ref  # noqa: E402
import quality  # noqa: E402
import ref_forward as rf  # noqa: E402
from common import DEFAULT_GGUF, ROOT, RUN, SCRATCH, exported, python, require, run  # noqa: E402

THREADS = 2
TEXT = require(quality.TEXT, "the perplexity text (see tests/data/SOURCE.md)")
WORK = SCRATCH / "quant"
EXPORT = ROOT / "export.py"

# --ppl of an F32 file vs the float64 reference. The engine's f32 logits are within ~1e-6
# (relative) of the reference, which moves the perplexity by ~1e-7 (measured 2e-8 .. 7e-8,
# printed to 4 decimals on ~1000). Any windowing mistake changes it by > 1e-3 (see
# test_ppl_rule_variants_are_distinguishable); an f16 KV cache alone moves it by 4e-5 .. 2e-4.
PPL_REL_TOL = 1e-5
SYNTH_TEXT_CHARS = 520     # ~320 tokens of the synthetic tokenizer

# Real model, first window (512 positions), KV f32 so only the weights differ.
TOP1_POSITIONS = 512
# dtype: (min top-1, max mean KL). Measured 95.7 .. 96.1 % / 0.0080 .. 0.0088 (q8_0) and 96.3 .. 97.1 % /
# 0.0050 .. 0.0064 (q4_1) over KV types and text lengths: int8 activation rounding makes every valid change
# of arithmetic order a new noise realization, so the bounds leave room for that.
QUANT_BOUNDS = {
    "q8_0": (0.94, 0.013),
    "q4_1": (0.95, 0.009),
}
CONFIDENT_MARGIN = 1.0     # where f32's top-1 leads by this many logits, the argmax must not flip (worst seen: 0.56)

# KV cache: perplexity over 8 windows of 256 (1,016 scored tokens) on the F32 model, relative to --kv f32
# (measured: f16 +0.01 %, q8 -0.02 %; over 2 windows, 254 scored tokens, the noise alone moved q8 by 0.5 %). Not on a q4_1 model: its int8 activation blocks turn any small change, f16 KV rounding
# included, into a fresh rounding-noise realization, measured to move a ~1,000-token perplexity by up to
# 0.9 % either way (tests/quality.py measures the KV types on both models over the whole text).
KV_CTX = 256
KV_WINDOWS = 8
KV_TEXT_CHARS = 9000       # 2,183 SmolLM2 tokens: eight windows of 256
KV_PPL_TOL = 0.005         # issue 4: the int8 KV cache changes perplexity by less than 0.5 %

# --scalar vs SIMD on the same quantized file. Both quantize activations to the same int8 blocks, but float
# summation order differs, and every tiny difference flips some later activation roundings: the outputs are
# two realizations of the rounding noise, not equal. Measured on the synthetic model: relative RMS 0.012
# (q8_0) / 0.008 (q4_1) (the quantization error itself is 0.07 / 0.5); on SmolLM2 with the int8 KV cache,
# 64 positions: mean KL 0.009, no flip where the top-1 leads by >= 0.03. A wrong SIMD kernel gives O(1).
# (Kernel-level agreement, which can be tight, is tests/test_kernels.py's.)
SCALAR_SYNTH_RMS = 0.05
SCALAR_REAL_KL = 0.03


# ---------------------------------------------------------------------------------------------
# Helpers

def engine() -> Path:
    return require(RUN, "the engine binary; build it with `make`")


def run_ok(args: list, what: str, timeout: float = 600) -> str:
    p = run(args, timeout=timeout, binary=engine())
    assert p.returncode == 0, f"{what}: ./run exit {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}"
    return p.stdout.decode()


def export(src: Path, out: Path, dtype: str) -> Path:
    p = python([require(EXPORT, "export.py"), src, out, "--dtype", dtype], timeout=600)
    assert p.returncode == 0, f"export.py {src.name} --dtype {dtype}: {p.stderr.decode(errors='replace')[-2000:]}"
    return out


def ppl_of(model: Path, text: Path, ctx: int, kv: str = "f32", extra: tuple = ()) -> quality.PplResult:
    out = run_ok([model, "--ppl", text, "--ctx", ctx, "--kv", kv, "--threads", THREADS, *extra], f"--ppl {text.name}")
    return quality.parse_ppl(out)


def dump(model: Path, ids: list[int], kv: str = "f32", extra: tuple = ()) -> np.ndarray:
    out = WORK / f"{model.stem}.{len(ids)}.{kv}{'.'.join(extra)}.logits"
    run_ok([model, "--ids", " ".join(map(str, ids)), "--dump-logits", out, "--kv", kv, "--threads", THREADS, *extra],
           f"--dump-logits {model.name}")
    logits = np.fromfile(out, dtype="<f4")
    out.unlink()
    assert logits.size % len(ids) == 0, f"--dump-logits wrote {logits.size} floats for {len(ids)} positions"
    logits = logits.reshape(len(ids), -1)
    assert np.isfinite(logits).all(), f"non-finite logits from {model.name}"
    return logits


# ---------------------------------------------------------------------------------------------
# --ppl against the numpy reference (synthetic model)

@functools.cache
def synthetic(add_bos: bool) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """(F32 model file, HF config, float32 weights) of the tied synthetic model; add_bos sets the GGUF's
    tokenizer.ggml.add_bos_token (the --ppl BOS substitution only happens for such models)."""
    WORK.mkdir(parents=True, exist_ok=True)
    cfg = ms.SynthConfig()
    weights = ms.make_weights(cfg)
    gguf = ms.write_gguf(WORK / "synth.f32.gguf", cfg, weights, ms.make_tokenizer(cfg.vocab_size), "f32")
    if add_bos:
        bos_gguf = WORK / "synth-bos.f32.gguf"
        quality.make_f32_gguf(gguf, bos_gguf, {"tokenizer.ggml.add_bos_token": True})
        gguf = bos_gguf
    model = export(gguf, WORK / f"synth{'-bos' if add_bos else ''}.f32.bin", "f32")
    return model, ms.hf_config(cfg), weights


@functools.cache
def synthetic_text() -> tuple[Path, str]:
    text = TEXT.read_text(encoding="utf-8")[:SYNTH_TEXT_CHARS].rstrip("\n")
    path = WORK / "synth-text.txt"
    WORK.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path, text


def text_ids(model: Path, text: str) -> list[int]:
    # -i takes the text as is (stdin would drop a trailing newline; the text has none).
    return [int(x) for x in run_ok([model, "--tokenize", "-i", text], "--tokenize").split()]


def check_ppl(ctx: int, add_bos: bool) -> None:
    model, hf_cfg, weights = synthetic(add_bos)
    path, text = synthetic_text()
    # llama.cpp tokenizes the text as a prompt (BOS first when the model adds BOS), then also puts BOS at the
    # start of every window. The ids come from the model without add_bos, so BOS is added here explicitly.
    ids = text_ids(synthetic(False)[0], text)
    bos = ms.BOS_ID if add_bos else None
    if add_bos:
        ids = [ms.BOS_ID] + ids
    assert len(ids) >= 2 * ctx and len(ids) % ctx, f"want >= 2 windows and a dropped tail; got {len(ids)} tokens"
    want, n_scored = ppl_ref.perplexity(ids, ctx, lambda win: rf.forward(hf_cfg, weights, win), bos)
    got = ppl_of(model, path, ctx)
    assert got.windows == len(ids) // ctx, f"--ppl used {got.windows} windows, expected {len(ids) // ctx}"
    assert got.scored == n_scored, f"--ppl scored {got.scored} tokens, expected {n_scored}"
    rel = abs(got.ppl / want - 1)
    assert rel <= PPL_REL_TOL, (f"--ppl (ctx {ctx}, add_bos {add_bos}) printed {got.ppl:.4f}, reference {want:.6f}: "
                                f"relative difference {rel:.2e} > {PPL_REL_TOL:g}")


def test_ppl_matches_reference_ctx128():
    """Two windows of 128 (each prefilled in a 72- and a 56-token chunk), 63 tokens of tail dropped."""
    check_ppl(128, add_bos=False)


def test_ppl_matches_reference_odd_ctx():
    """ctx 90: odd half (45) and a window that is not a multiple of the prefill chunk."""
    check_ppl(90, add_bos=False)


def test_ppl_matches_reference_add_bos():
    """A model whose tokenizer adds BOS: llama.cpp's perplexity tokenizes the text with BOS in front, then
    replaces each window's first token by BOS (llama-perplexity: tokens = common_tokenize(text, add_bos);
    tokens[batch_start] = bos)."""
    check_ppl(128, add_bos=True)


def test_ppl_rule_variants_are_distinguishable():
    """The tolerance above is far below what a wrong windowing rule changes, so those tests can fail."""
    model, hf_cfg, weights = synthetic(False)
    _, text = synthetic_text()
    ids = text_ids(model, text)
    ctx = 128
    full = [rf.forward(hf_cfg, weights, w.tokens) for w in ppl_ref.windows(ids, ctx)]

    def ppl(first: int, last: int, shift: int = 1) -> float:
        """Score positions first .. last-1 against the token at p + shift (the right rule: ctx/2, ctx-1, 1)."""
        nll = []
        for w, logits in zip(ppl_ref.windows(ids, ctx), full):
            for p in range(first, last):
                row = logits[p]
                nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[w.tokens[p + shift]])
        return math.exp(float(np.mean(nll)))

    right = ppl(ctx // 2, ctx - 1)
    want, _ = ppl_ref.perplexity(ids, ctx, lambda win: rf.forward(hf_cfg, weights, win))
    assert abs(right / want - 1) < 1e-12, "the variant helper disagrees with ppl_ref"
    variants = {"from ctx/2 - 1": ppl(ctx // 2 - 1, ctx - 1), "up to ctx/2 + 1": ppl(ctx // 2 + 1, ctx - 1),
                "whole window": ppl(0, ctx - 1), "target = current token": ppl(ctx // 2, ctx - 1, shift=0)}
    for name, value in variants.items():
        assert abs(value / right - 1) > 100 * PPL_REL_TOL, f"rule '{name}' gives {value:.6f} ~ {right:.6f}"


# ---------------------------------------------------------------------------------------------
# SmolLM2: quantized logits against F32

@functools.cache
def smollm2(which: str) -> Path:
    """'q8_0', 'q4_1' exported from the F32 GGUF; 'q4_1 copy' exported from the Q4_1 GGUF itself, and 'f32' too
    (the other modules' shared common.exported files: --dtype f32 of the Q4_1 GGUF writes the same bytes as of
    the F32 GGUF, its values decoded exactly either way)."""
    if which in ("f32", "q4_1 copy"):
        return exported(which.split()[0])
    try:
        src = quality.gguf_source(DEFAULT_GGUF)
    except FileNotFoundError as e:
        raise AssertionError(str(e))
    return quality.export(quality.f32_gguf_source(src), which, "f32gguf")


@functools.cache
def first_window_ids() -> tuple[int, ...]:
    text = TEXT.read_text(encoding="utf-8")[:8 * TOP1_POSITIONS]
    ids = text_ids(smollm2("q4_1 copy"), text)
    assert len(ids) >= TOP1_POSITIONS, f"only {len(ids)} tokens"
    return tuple(ids[:TOP1_POSITIONS])


@functools.cache
def f32_logits() -> np.ndarray:
    return dump(smollm2("f32"), list(first_window_ids()))


def check_tracks_f32(dtype: str) -> None:
    min_top1, max_kl = QUANT_BOUNDS[dtype]
    got = dump(smollm2(dtype), list(first_window_ids()))
    ref = f32_logits()
    assert got.shape == ref.shape, f"{dtype} logits {got.shape} vs f32 {ref.shape}"
    stats = quality.position_stats(ref, got)
    a = quality.summarize(stats)
    confident = stats[:, 1] >= CONFIDENT_MARGIN
    flips = np.flatnonzero(confident & (stats[:, 0] == 0))
    summary = (f"{dtype} vs f32 over {a.positions} positions: top-1 {a.top1:.4f}, mean KL {a.kl:.5f}, "
               f"largest f32 margin at a flip {a.worst_flip_margin:.3f}")
    assert a.top1 >= min_top1, f"{summary}: top-1 < {min_top1}"
    assert a.kl <= max_kl, f"{summary}: KL > {max_kl}"
    assert flips.size == 0, (f"{summary}: argmax flipped at positions {flips[:10].tolist()} where f32 leads by "
                             f">= {CONFIDENT_MARGIN} logit")


def test_q8_0_from_float_tracks_f32():
    check_tracks_f32("q8_0")


def test_q4_1_from_float_tracks_f32():
    check_tracks_f32("q4_1")


def tensor_table(path: Path) -> dict[str, tuple[int, int, int]]:
    """name -> (type, offset, size) from our file's tensor table (export.py's manual ("The model file"))."""
    with open(path, "rb") as f:
        head = f.read(quality.HEADER_SIZE)
        n, table = int.from_bytes(head[68:72], "little"), int.from_bytes(head[88:96], "little")
        f.seek(table)
        raw = f.read(n * quality.TABLE_ENTRY.size)
    out = {}
    for i in range(n):
        name, ttype, _, _, _, off, size = quality.TABLE_ENTRY.unpack_from(raw, i * quality.TABLE_ENTRY.size)
        out[name.rstrip(b"\0").decode()] = (ttype, off, size)
    return out


def test_q4_1_from_float_reproduces_the_gguf_blocks():
    """The F32 GGUF holds the Q4_1 GGUF's values, which lie exactly on each block's Q4_1 grid (min at 0, max at 15).
    Quantizing them again must give the same values (measured: the same bytes as the bit copy). Blocks whose
    bytes differ are decoded with the gguf package and must hold the same values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    fresh, copy = smollm2("q4_1"), smollm2("q4_1 copy")
    ta, tb = tensor_table(fresh), tensor_table(copy)
    assert ta.keys() == tb.keys(), f"tensor names differ: {sorted(ta.keys() ^ tb.keys())[:5]}"
    a, b = np.memmap(fresh, dtype=np.uint8, mode="r"), np.memmap(copy, dtype=np.uint8, mode="r")
    block = {quality.GGML_Q4_1: 20, quality.GGML_Q8_0: 34}
    for name, (ttype, off, size) in ta.items():
        assert tb[name][0] == ttype, f"{name}: type {ttype} vs bit copy {tb[name][0]}"
        x, y = a[off:off + size], b[tb[name][1]:tb[name][1] + tb[name][2]]
        assert x.size == y.size, f"{name}: {x.size} bytes vs {y.size}"
        if ttype not in block or np.array_equal(x, y):
            continue
        bs = block[ttype]
        bad = np.flatnonzero((x.reshape(-1, bs) != y.reshape(-1, bs)).any(axis=1))
        gt = GGMLQuantizationType(ttype)
        va = dequantize(x.reshape(-1, bs)[bad], gt).astype(np.float64)
        vb = dequantize(y.reshape(-1, bs)[bad], gt).astype(np.float64)
        err = np.abs(va - vb).max()
        assert err <= 1e-6 * max(np.abs(vb).max(), 1e-30), (f"{name}: {bad.size} of {x.size // bs} blocks hold other "
                                                            f"values than the GGUF's (max diff {err:.3g})")


def test_q8_0_from_float_quantizes_every_matrix():
    """No block copy is possible from an F32 source: every matrix is Q8_0, every vector F32."""
    table = tensor_table(smollm2("q8_0"))
    types = {name: t for name, (t, _, _) in table.items()}
    vectors = {n for n in types if n.endswith("norm")}
    assert all(types[n] == 0 for n in vectors), f"norm vectors not F32: {[n for n in vectors if types[n]]}"
    others = {n: t for n, t in types.items() if n not in vectors}
    assert all(t == quality.GGML_Q8_0 for t in others.values()), f"not Q8_0: {[n for n, t in others.items() if t != 8]}"


# ---------------------------------------------------------------------------------------------
# KV cache precision

@functools.cache
def kv_text() -> Path:
    text = TEXT.read_text(encoding="utf-8")
    path = WORK / "kv-text.txt"
    WORK.mkdir(parents=True, exist_ok=True)
    path.write_text(text[:KV_TEXT_CHARS], encoding="utf-8")
    return path


@functools.cache
def kv_ppl(kv: str) -> quality.PplResult:
    res = ppl_of(smollm2("f32"), kv_text(), KV_CTX, kv)
    assert res.windows == KV_WINDOWS, f"expected {KV_WINDOWS} windows of {KV_CTX}, got {res.windows}"
    return res


def check_kv(kv: str) -> None:
    base, got = kv_ppl("f32"), kv_ppl(kv)
    rel = abs(got.ppl / base.ppl - 1)
    assert rel < KV_PPL_TOL, f"--kv {kv}: perplexity {got.ppl:.4f} vs {base.ppl:.4f} with --kv f32 ({rel:.2%})"


def test_kv_int8_perplexity():
    check_kv("q8")


def test_kv_f16_perplexity():
    check_kv("f16")


def test_kv_q8_takes_effect():
    """--kv q8 changes the numbers (else the test above proves nothing; f16 vs f32 can agree to 4 decimals)."""
    values = {kv: kv_ppl(kv).ppl for kv in ("f32", "q8")}
    assert values["f32"] != values["q8"], f"perplexities per KV type: {values}"


# ---------------------------------------------------------------------------------------------
# Scalar vs SIMD, end to end on quantized files

def scalar_and_simd(model: Path, ids: list[int], kv: str) -> tuple[np.ndarray, np.ndarray]:
    return dump(model, ids, kv, ("--scalar",)), dump(model, ids, kv)


@functools.cache
def synthetic_quant(dtype: str) -> Path:
    cfg = ms.SynthConfig()
    weights = ms.make_weights(cfg)
    gguf = ms.write_gguf(WORK / f"synth.{dtype}.gguf", cfg, weights, ms.make_tokenizer(cfg.vocab_size), dtype)
    return export(gguf, WORK / f"synth.{dtype}.bin", dtype)


def test_scalar_matches_simd_synthetic_quantized():
    ids = np.random.default_rng(5).integers(0, ms.SynthConfig().vocab_size, 130).tolist()
    for dtype in ("q8_0", "q4_1"):
        scalar, simd = scalar_and_simd(synthetic_quant(dtype), ids, "f16")
        rms = float(np.sqrt(((simd - scalar) ** 2).sum() / (scalar ** 2).sum()))
        assert rms <= SCALAR_SYNTH_RMS, f"{dtype}: SIMD vs --scalar relative RMS {rms:.3g} > {SCALAR_SYNTH_RMS}"


def test_scalar_matches_simd_real_model_int8_kv():
    """SmolLM2 (head_dim 64) is the model on which the int8 KV cache's attention kernels run."""
    scalar, simd = scalar_and_simd(smollm2("q4_1 copy"), list(first_window_ids()[:64]), "q8")
    stats = quality.position_stats(scalar, simd)
    a = quality.summarize(stats)
    flips = np.flatnonzero((stats[:, 1] >= CONFIDENT_MARGIN) & (stats[:, 0] == 0))
    assert a.kl <= SCALAR_REAL_KL, f"SIMD vs --scalar: mean KL {a.kl:.4f} > {SCALAR_REAL_KL} ({a})"
    assert flips.size == 0, f"SIMD vs --scalar: argmax differs at confident positions {flips.tolist()} ({a})"
