"""Tiny random llama models (tests/make_synthetic.py) through export.py and ./run, checked against tests/ref_forward.py.

The reference is a float64 numpy forward pass from the HF-order weights; it
shares no code with export.py or run.c. Error measure, per prompt position p:

    rel(p) = max_v |engine[p, v] - ref[p, v]| / max_v |ref[p, v]|

and a test bounds max_p rel(p). Quantized files are compared with the
reference run on the weights the file actually stores (decoded here from the
file per export.py's manual ("The model file"), after checking they are a faithful rounding of the
source weights), so the logits tolerance covers only the engine's arithmetic.

Tolerances (justified by simulating the engine's likely arithmetic on these
two models in numpy, 20 prompts of 130 tokens each):
  * F32 files, run with --kv f32: 1e-4. float32 arithmetic gives ~1e-6; every plausible bug
    gives 1.5e-2 .. 2 (eps 1e-6 instead of 1e-5: 1.5e-2 .. 2.5e-2; RoPE on adjacent pairs,
    wrong theta, GQA head h % n_kv instead of h // group, missing norm weights,
    1/sqrt(dim) scale: 1 .. 2).
  * F16 files: rel <= 1.5e-2, relative RMS <= 5e-3, top-1 >= 95%. Converting
    activations to f16 (as ggml does for F16 weights) gives at most 5.8e-3,
    1.9e-3, 97.7%. (Rounding of the weights themselves is excluded: the
    reference uses the stored f16 values, which must be the f32 weights rounded
    to nearest even.)
  * Q8_0 / Q4_1 files: rel <= 0.4, relative RMS <= 0.1, top-1 >= 75%. ggml-style
    int8 activation blocks (d = max|x|/127) give at most 0.16, 0.056, and at
    least 87% on these random (hence error-amplifying) models; a wrong nibble
    order or a missing Q4_1 min gives RMS ~1.4 and top-1 ~0%. Against the
    original float weights, random Gaussian weights lose a lot to 4-bit
    quantization (RMS ~0.5), so that number is reported, not bounded.
  * KV cache precision (F32 weights): f16 (the engine's default) like F16
    weights above (simulated: 4.7e-3, 1.4e-3, 99.2%); q8 (blocks of 32 within
    a head): rel <= 0.25, relative RMS <= 0.06, top-1 >= 85% (simulated: 0.074,
    0.021, 94.6%).
"""
from __future__ import annotations

import functools
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
import modelfile  # noqa: E402
from common import RUN, ROOT, SCRATCH, python, require, run  # noqa: E402
import make_synthetic as ms  # noqa: E402
import ref_forward as rf  # noqa: E402

WORK = SCRATCH / "synthetic"
EXPORT = ROOT / "export.py"

F32_TOL = 1e-4
PREFILL_DECODE_TOL = 1e-5
PREFILL_LENGTHS = (1, 2, 7, 31, 32, 33, 63, 64, 65, 100, 130)
# (max rel per position, relative RMS, minimum top-1 agreement) for the engine vs the reference on the stored weights.
ENGINE_TOL = {"F32": (F32_TOL, F32_TOL, 1.0), "F16": (1.5e-2, 5e-3, 0.95), "BF16": (0.1, 0.03, 0.9),
              "QUANT": (0.4, 0.1, 0.75)}
KV_TOL = {"f16": ENGINE_TOL["F16"], "q8": (0.25, 0.06, 0.85)}

TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}


# ----------------------------------------------------------------------------------------------------------------
# Fixtures (built once per process)

@functools.cache
def model_dir(kind: str) -> Path:
    """Write the tied or untied synthetic model (all variants) under the scratch dir."""
    cfg = ms.SynthConfig() if kind == "tied" else ms.untied_config()
    out = WORK / kind
    ms.make_all(out, cfg)
    return out


def config(kind: str) -> ms.SynthConfig:
    return ms.SynthConfig() if kind == "tied" else ms.untied_config()


@functools.cache
def weights(kind: str) -> dict[str, np.ndarray]:
    return ms.make_weights(config(kind))


def source(kind: str, variant: str) -> Path:
    """Path of a synthetic input: 'hf', 'hf-sharded', 'hf-bf16' or a GGUF type ('f32', 'f16', 'q8_0', 'q4_1')."""
    d = model_dir(kind)
    return d / variant if variant.startswith("hf") else d / f"model.{variant}.gguf"


def source_values(kind: str, variant: str) -> dict[str, np.ndarray]:
    """The float32 weight values the input file holds (HF names and order)."""
    w = weights(kind)
    if variant == "hf-bf16":
        return ms.rounded_weights(w, "bf16")
    if variant.startswith("hf"):
        return dict(w)
    return ms.dequantized_weights(w, variant)


@functools.cache
def exported(kind: str, variant: str, dtype: str) -> Path:
    """export.py run as a black box on one synthetic input."""
    require(EXPORT, "export.py is not written yet")
    src = source(kind, variant)
    out = WORK / kind / f"{variant}.{dtype}.llm"
    p = python([EXPORT, src, out, "--dtype", dtype], timeout=120)
    assert p.returncode == 0, (f"export.py {src} --dtype {dtype} failed (exit {p.returncode}):\n"
                               f"{p.stderr.decode(errors='replace')[-3000:]}")
    assert out.exists(), f"export.py exited 0 but wrote no {out}"
    return out


@functools.cache
def engine() -> Path:
    """./run, built with `make` when missing (only for the default binary; RUN_BIN builds are made by the caller)."""
    if not RUN.exists() and RUN == ROOT / "run":
        p = subprocess.run(["make"], cwd=ROOT, capture_output=True, timeout=600)
        assert p.returncode == 0, f"make failed:\n{p.stderr.decode(errors='replace')[-3000:]}"
    return require(RUN, "build the engine with `make`")


def token_ids(kind: str, n: int, seed: int = 11) -> list[int]:
    """A fixed pseudo-random prompt over the whole vocabulary (control tokens included)."""
    return np.random.default_rng(seed).integers(0, config(kind).vocab_size, n).tolist()


def engine_logits(model: Path, ids: list[int], no_batch: bool = False, kv: str | None = "f32",
                  extra: tuple[str, ...] = ()) -> np.ndarray:
    """./run MODEL --ids ... --dump-logits F [--no-batch] [--kv KV] -> float32 [len(ids), vocab].

    kv=None keeps the engine's default KV cache precision.
    """
    vocab = read_model(model).header["vocab_size"]
    out = model.with_suffix(f".{len(ids)}{'.nb' if no_batch else ''}.{kv}{''.join(extra)}.logits")
    args = [model, "--ids", " ".join(map(str, ids)), "--dump-logits", out] + (["--no-batch"] if no_batch else [])
    args += (["--kv", kv] if kv else []) + list(extra)
    p = run(args, binary=engine(), timeout=120)
    assert p.returncode == 0, (f"./run {' '.join(map(str, args[:1] + args[3:]))} (ids: {len(ids)} tokens) exit "
                               f"{p.returncode}:\n{p.stderr.decode(errors='replace')[-2000:]}")
    data = np.fromfile(out, dtype="<f4")
    assert data.size == len(ids) * vocab, f"--dump-logits wrote {data.size} floats, expected {len(ids)} x {vocab}"
    assert np.all(np.isfinite(data)), "non-finite logits"
    return data.reshape(len(ids), vocab).astype(np.float64)


# ----------------------------------------------------------------------------------------------------------------
# Error measures

def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """max over positions of max|a - ref| / max|ref| (per position)."""
    return float(np.max(np.abs(a - ref).max(axis=1) / np.abs(ref).max(axis=1)))


def rms_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.sum((a - ref) ** 2) / np.sum(ref ** 2)))


def top1(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean(a.argmax(axis=1) == ref.argmax(axis=1)))


def assert_close(got: np.ndarray, ref: np.ndarray, tol: float, what: str) -> None:
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)
    worst = int(err.argmax())
    assert err[worst] <= tol, (f"{what}: max rel error {err[worst]:.3g} > {tol:g} at position {worst} "
                               f"(positions over tolerance: {np.flatnonzero(err > tol).tolist()[:20]}; "
                               f"position 0 error {err[0]:.3g}; top-1 agreement {top1(got, ref):.3f})")


# ----------------------------------------------------------------------------------------------------------------
# Reading our model file (export.py's manual ("The model file")), to learn what the exporter stored

HEADER = struct.Struct("<4s11I2f4I4Q")
HEADER_KEYS = ("magic", "version", "header_size", "arch", "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
               "head_dim", "vocab_size", "max_seq_len", "rope_theta", "norm_eps", "flags", "activation", "rope_dim",
               "n_tensors", "tok_offset", "tok_size", "table_offset", "file_size")
ENTRY = struct.Struct("<48s4I2Q")


class StoredTensor(NamedTuple):
    type: int
    rows: int
    cols: int
    raw: bytes


class ModelFile(NamedTuple):
    header: dict
    tensors: dict[str, StoredTensor]


@functools.cache
def read_model(path: Path) -> ModelFile:
    data = path.read_bytes()
    header = dict(zip(HEADER_KEYS, HEADER.unpack_from(data, 0)))
    assert header["magic"] == b"LLMF", f"{path}: bad magic {header['magic']!r}"
    assert header["file_size"] == len(data), f"{path}: header says {header['file_size']} bytes, file has {len(data)}"
    tensors = {}
    for i in range(header["n_tensors"]):
        name, ttype, rows, cols, layout, off, size = ENTRY.unpack_from(data, header["table_offset"] + i * ENTRY.size)
        assert off % 64 == 0, f"tensor {name!r} at unaligned offset {off}"
        raw = data[off:off + size]
        if layout == modelfile.LAYOUT_PACKED:   # a matrix in the packed layout: back to rows (tests/fuzz/modelfile.py)
            raw = modelfile.unpack(ttype, rows, cols, raw)
        tensors[name.rstrip(b"\0").decode()] = StoredTensor(ttype, rows, cols, raw)
    return ModelFile(header, tensors)


def decode(t: StoredTensor) -> np.ndarray:
    """A stored tensor's values as float32 [rows, cols] (ggml block layouts decoded by the gguf package)."""
    if t.type == 0:
        arr = np.frombuffer(t.raw, dtype="<f4")
    elif t.type == 1:
        arr = np.frombuffer(t.raw, dtype="<f2").astype(np.float32)
    elif t.type == 30:
        arr = (np.frombuffer(t.raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif t.type in (2, 3, 8):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        arr = dequantize(np.frombuffer(t.raw, dtype=np.uint8).reshape(t.rows, -1), GGMLQuantizationType(t.type))
    else:
        raise AssertionError(f"unexpected tensor type {t.type}")
    assert arr.size == t.rows * t.cols, f"tensor data holds {arr.size} values, table says {t.rows} x {t.cols}"
    return np.asarray(arr, dtype=np.float32).reshape(t.rows, t.cols)


def quant_tolerance(t: StoredTensor) -> np.ndarray:
    """Largest |stored - source| a faithful ggml-style rounding may give, per element, from each block's own scale.

    Round-to-nearest gives d/2; computing q with the f32 scale but storing the f16
    scale adds |q| * |d - d16| (<= qmax * d * 2^-11), and the f16 min adds |m| * 2^-11.
    Q4_0's clamp of q to 15 can cost a whole step at the block's far end.
    """
    blocks = np.frombuffer(t.raw, dtype=np.uint8).reshape(-1, {2: 18, 3: 20, 8: 34}[t.type])
    d = np.abs(blocks[:, 0:2].copy().view("<f2").astype(np.float64)[:, 0])
    half_ulp = 2.0 ** -11
    if t.type == 8:
        tol = d * (0.5 + 127 * half_ulp)
    elif t.type == 3:
        m = np.abs(blocks[:, 2:4].copy().view("<f2").astype(np.float64)[:, 0])
        tol = d * (0.5 + 15 * half_ulp) + m * half_ulp
    else:
        tol = d * (1.0 + 8 * half_ulp)
    tol = tol * 1.001 + d * 1e-4 + 1e-30
    return np.repeat(tol, 32).reshape(t.rows, t.cols)


def stored_weights(model: Path, kind: str) -> tuple[dict[str, np.ndarray], dict[str, StoredTensor]]:
    """The file's tensors split back into HF names: ({hf name: float32 values}, {hf name: tensor slice})."""
    cfg = config(kind)
    mf = read_model(model)
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    split = {"tok_embeddings": [("model.embed_tokens.weight", cfg.vocab_size)], "norm": [("model.norm.weight", 1)]}
    if not cfg.tied:
        split["output"] = [("lm_head.weight", cfg.vocab_size)]
    for n in range(cfg.n_layers):
        p = f"model.layers.{n}."
        split[f"layers.{n}.attn_norm"] = [(p + "input_layernorm.weight", 1)]
        split[f"layers.{n}.wqkv"] = [(p + "self_attn.q_proj.weight", q_dim), (p + "self_attn.k_proj.weight", kv_dim),
                                     (p + "self_attn.v_proj.weight", kv_dim)]
        split[f"layers.{n}.wo"] = [(p + "self_attn.o_proj.weight", cfg.dim)]
        split[f"layers.{n}.ffn_norm"] = [(p + "post_attention_layernorm.weight", 1)]
        split[f"layers.{n}.w13"] = [(p + "mlp.gate_proj.weight", cfg.hidden_dim), (p + "mlp.up_proj.weight", cfg.hidden_dim)]
        split[f"layers.{n}.w2"] = [(p + "mlp.down_proj.weight", cfg.dim)]
    assert set(mf.tensors) == set(split), (f"{model.name}: tensor names differ from export.py's tensor table: missing "
                                           f"{sorted(set(split) - set(mf.tensors))}, unexpected {sorted(set(mf.tensors) - set(split))}")
    values, parts = {}, {}
    for name, pieces in split.items():
        t = mf.tensors[name]
        full = decode(t)
        row_bytes = len(t.raw) // t.rows
        r0 = 0
        for hf_name, rows in pieces:
            shape = weights(kind)[hf_name].shape
            v = full[r0:r0 + rows]
            values[hf_name] = v.reshape(shape)
            parts[hf_name] = StoredTensor(t.type, rows, t.cols, t.raw[r0 * row_bytes:(r0 + rows) * row_bytes])
            r0 += rows
        assert r0 == t.rows, f"{name}: {t.rows} rows, expected {r0}"
    return values, parts


def check_file(model: Path, kind: str, src: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], set[str]]:
    """Check the header and that every stored weight is a faithful rounding of the source value.

    Returns (stored values by HF name, set of matrix type names in the file).
    """
    cfg = config(kind)
    h = read_model(model).header
    expect = {"version": 2, "header_size": 256, "arch": 1, "dim": cfg.dim, "hidden_dim": cfg.hidden_dim,
              "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
              "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len, "flags": int(cfg.tied), "activation": 0,
              "rope_dim": cfg.head_dim}
    bad = {k: (h[k], v) for k, v in expect.items() if h[k] != v}
    assert not bad, f"{model.name}: header (got, expected): {bad}"
    assert h["rope_theta"] == np.float32(cfg.rope_theta), f"rope_theta {h['rope_theta']} != {cfg.rope_theta}"
    assert h["norm_eps"] == np.float32(cfg.norm_eps), f"norm_eps {h['norm_eps']} != {cfg.norm_eps}"

    values, parts = stored_weights(model, kind)
    types = set()
    for name, v in values.items():
        t, s = parts[name], src[name].astype(np.float32)
        tname = TYPE_NAMES.get(t.type, str(t.type))
        if s.ndim == 1:
            assert t.type == 0, f"{name}: norm weights must be F32, file has {tname}"
        else:
            types.add(tname)
        s2 = s.reshape(v.shape)
        if t.type == 0:
            expected, ok = s2, v == s2
        elif t.type == 1:
            expected = s2.astype(np.float16).astype(np.float32)
            ok = v == expected
        elif t.type == 30:
            expected = ms.bf16_round(s2)
            ok = v == expected
        else:
            ok = np.abs(v.astype(np.float64) - s2) <= quant_tolerance(t).reshape(v.shape)
            expected = s2
        if not np.all(ok):
            i = np.unravel_index(int(np.argmin(ok)), ok.shape)
            hint = " (Q/K row order?)" if re.search(r"[qk]_proj", name) else ""
            raise AssertionError(f"{model.name}: {name} ({tname}) holds {float(v[i])!r} at {tuple(map(int, i))}, "
                                 f"source {float(s2[i])!r}, expected {float(expected[i])!r}; "
                                 f"{int(np.size(ok) - np.sum(ok))} of {ok.size} values off{hint}")
    return values, types


def engine_tolerance(types: set[str]) -> tuple[float, float, float]:
    if types <= {"F32"}:
        return ENGINE_TOL["F32"]
    if types <= {"F32", "F16"}:
        return ENGINE_TOL["F16"]
    if types <= {"F32", "F16", "BF16"}:
        return ENGINE_TOL["BF16"]
    return ENGINE_TOL["QUANT"]


def check_against_reference(kind: str, variant: str, dtype: str, n_tokens: int = 130,
                            extra: tuple[str, ...] = ()) -> None:
    """Export, check the stored weights, then compare the engine with the reference on those weights."""
    model = exported(kind, variant, dtype)
    stored, types = check_file(model, kind, source_values(kind, variant))
    ids = token_ids(kind, n_tokens)
    hf_cfg = ms.hf_config(config(kind))
    ref = rf.forward(hf_cfg, stored, ids)
    got = engine_logits(model, ids, extra=extra)
    max_rel, max_rms, min_top1 = engine_tolerance(types)
    e, r, t = rel_err(got, ref), rms_err(got, ref), top1(got, ref)
    exact = rf.forward(hf_cfg, weights(kind), ids)
    info = (f"{kind} {variant} --dtype {dtype} {' '.join(extra)} (matrix types {sorted(types)}): vs reference on stored weights "
            f"rel {e:.3g} (<= {max_rel:g}), rms {r:.3g} (<= {max_rms:g}), top-1 {t:.3f} (>= {min_top1:g}); "
            f"vs float reference on the original weights rel {rel_err(got, exact):.3g}, rms {rms_err(got, exact):.3g}, "
            f"top-1 {top1(got, exact):.3f}")
    assert e <= max_rel and r <= max_rms and t >= min_top1, info


# ----------------------------------------------------------------------------------------------------------------
# Tests that need only the generator and the reference

def test_reference_is_causal_and_matches_gguf_convention():
    """Prefix logits do not depend on later tokens; GGUF-permuted Q/K + adjacent-pair RoPE == HF + half-split."""
    cfg = ms.SynthConfig()
    w, hf_cfg = weights("tied"), ms.hf_config(cfg)
    ids = token_ids("tied", 40)
    full = rf.forward(hf_cfg, w, ids)
    assert np.abs(rf.forward(hf_cfg, w, ids[:17]) - full[:17]).max() < 1e-12
    permuted = {k: ms.llama_cpp_permute(v, cfg.n_heads) if k.endswith("q_proj.weight")
                else ms.llama_cpp_permute(v, cfg.n_kv_heads) if k.endswith("k_proj.weight") else v
                for k, v in w.items()}
    assert rel_err(rf.forward(hf_cfg, permuted, ids, adjacent_pairs=True), full) < 1e-12
    # And the permutation is not a no-op: HF order with adjacent pairs is far off.
    assert rel_err(rf.forward(hf_cfg, w, ids, adjacent_pairs=True), full) > 0.1


def test_reference_reads_gguf_like_hf():
    """The reference's GGUF loader (used by tests/oracle/make_goldens.py on the real model) gives the
    hyper-parameters and logits of the HF route on the same values: names, tying, RoPE base, GQA and
    the permuted Q/K order (adjacent_pairs) all have to be right."""
    for kind in ("tied", "untied"):
        hf_cfg = ms.hf_config(config(kind))
        ids = token_ids(kind, 40)
        for variant in ("f32", "q4_1"):
            cfg, w = rf.load_gguf(source(kind, variant))
            got_hp, want_hp = rf.config_values(cfg), rf.config_values(hf_cfg)
            assert np.isclose(got_hp.pop("eps"), want_hp.pop("eps"), rtol=1e-6), f"{kind} {variant}: eps"
            assert got_hp == want_hp, f"{kind} {variant}: {got_hp} != {want_hp}"
            got = rf.forward(cfg, w, ids, adjacent_pairs=True)
            want = rf.forward(hf_cfg, source_values(kind, variant), ids)
            assert rel_err(got, want) < 1e-9, f"{kind} {variant}: GGUF vs HF reference rel {rel_err(got, want):.3g}"


def llama_cpp_agrees_with_reference():
    """llama.cpp on our GGUF == the numpy reference: proves the GGUF writer's permutation and the reference together.

    Not part of the suite (a fresh machine has no llama-cpp-python, whose build
    takes ~10 minutes); run it by hand: python3 tests/test_synthetic.py --llama-cpp.
    Last run (llama-cpp-python 0.3.36, F32 KV): max relative difference 2.4e-6 (tied), 3.2e-6 (untied)."""
    try:
        import llama_cpp
    except ImportError as e:
        raise AssertionError(f"llama-cpp-python is needed for this cross-check (pip install llama-cpp-python): {e}")
    for kind in ("tied", "untied"):
        cfg = config(kind)
        ids = token_ids(kind, 100)
        llm = llama_cpp.Llama(model_path=str(source(kind, "f32")), n_ctx=cfg.max_seq_len, n_batch=cfg.max_seq_len,
                              logits_all=True, verbose=False, n_threads=2,
                              type_k=0, type_v=0)   # F32 KV cache, so only float32 rounding remains
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)], dtype=np.float64)
        ref = rf.forward(ms.hf_config(cfg), weights(kind), ids)
        assert_close(got, ref, F32_TOL, f"llama.cpp vs reference ({kind})")


# ----------------------------------------------------------------------------------------------------------------
# Engine tests

def _f32_route(kind: str, variant: str) -> None:
    model = exported(kind, variant, "f32")
    check_file(model, kind, source_values(kind, variant))
    ids = token_ids(kind, 130)
    ref = rf.forward(ms.hf_config(config(kind)), source_values(kind, variant), ids)
    assert_close(engine_logits(model, ids), ref, F32_TOL, f"{kind} {variant} --dtype f32")


def test_gguf_f32_matches_reference():
    _f32_route("tied", "f32")


def test_hf_f32_matches_reference():
    _f32_route("tied", "hf")


def test_hf_sharded_matches_reference():
    _f32_route("tied", "hf-sharded")


def test_hf_bf16_matches_reference():
    """BF16 safetensors -> --dtype f32 keeps the bf16 values exactly; reference on the bf16-rounded weights."""
    _f32_route("tied", "hf-bf16")


def test_gguf_and_hf_routes_agree():
    """Same weights from GGUF (Q/K permuted) and from HF: same stored tensors and the same logits."""
    for kind in ("tied", "untied"):
        a, b = exported(kind, "f32", "f32"), exported(kind, "hf", "f32")
        wa, _ = stored_weights(a, kind)
        wb, _ = stored_weights(b, kind)
        diff = [n for n in wa if not np.array_equal(wa[n], wb[n])]
        assert not diff, f"{kind}: GGUF and HF routes store different values for {diff[:6]}"
        ids = token_ids(kind, 65, seed=3)
        la, lb = engine_logits(a, ids), engine_logits(b, ids)
        assert rel_err(la, lb) <= 1e-6, f"{kind}: GGUF vs HF route logits differ: rel {rel_err(la, lb):.3g}"


def test_prefill_equals_decode():
    """Batched prefill == token-at-a-time decode for lengths around block boundaries; both == reference."""
    model = exported("tied", "f32", "f32")
    ids = token_ids("tied", max(PREFILL_LENGTHS), seed=5)
    ref = rf.forward(ms.hf_config(config("tied")), weights("tied"), ids)   # causal: prefixes are prefixes
    for n in PREFILL_LENGTHS:
        batched = engine_logits(model, ids[:n])
        assert_close(batched, ref[:n], F32_TOL, f"prefill vs reference, {n} tokens")
        single = engine_logits(model, ids[:n], no_batch=True)
        assert_close(single, batched, PREFILL_DECODE_TOL, f"--no-batch vs prefill, {n} tokens")


def test_prompt_at_context_limit():
    """A prompt of exactly max_seq_len tokens works, batched and one at a time."""
    kind = "untied"
    model = exported(kind, "f32", "f32")
    n = config(kind).max_seq_len
    ids = token_ids(kind, n, seed=9)
    ref = rf.forward(ms.hf_config(config(kind)), weights(kind), ids)
    batched = engine_logits(model, ids)
    assert_close(batched, ref, F32_TOL, f"{n}-token prompt vs reference")
    assert_close(engine_logits(model, ids, no_batch=True), batched, PREFILL_DECODE_TOL, f"{n}-token --no-batch")


def test_prompt_longer_than_context_fails():
    """max_seq_len + 1 tokens: exit 1 and a message naming both counts."""
    model = exported("tied", "f32", "f32")
    limit = config("tied").max_seq_len
    ids = token_ids("tied", limit + 1)
    out = model.with_suffix(".toolong.logits")
    p = run([model, "--ids", " ".join(map(str, ids)), "--dump-logits", out], binary=engine(), timeout=60)
    msg = (p.stdout + p.stderr).decode(errors="replace")
    assert p.returncode == 1, f"exit {p.returncode} for a {limit + 1}-token prompt (limit {limit}); output: {msg[-500:]}"
    assert re.search(rf"\b{limit + 1}\b", msg) and re.search(rf"\b{limit}\b", msg), \
        f"the message should name {limit + 1} and {limit}: {msg[-500:]!r}"


def test_untied_model():
    """Separate output matrix, rope_theta 1e5: both routes match the reference; prefill == decode."""
    _f32_route("untied", "f32")
    _f32_route("untied", "hf")
    model = exported("untied", "hf", "f32")
    ids = token_ids("untied", 65, seed=6)
    for n in (1, 33, 65):
        assert_close(engine_logits(model, ids[:n], no_batch=True), engine_logits(model, ids[:n]),
                     PREFILL_DECODE_TOL, f"untied --no-batch vs prefill, {n} tokens")


def test_gguf_quantized_to_f32_is_exact():
    """F16 / Q8_0 / Q4_1 GGUF -> --dtype f32 stores exactly the dequantized values; logits match to 1e-4."""
    for variant in ("f16", "q8_0", "q4_1"):
        _f32_route("tied", variant)


def test_export_f16():
    check_against_reference("tied", "hf", "f16")


def test_export_q8_0():
    check_against_reference("tied", "hf", "q8_0")


def test_export_q4_1():
    check_against_reference("tied", "hf", "q4_1")


def test_gguf_f16_native():
    check_against_reference("tied", "f16", "f16")


def test_gguf_q8_0_native():
    check_against_reference("tied", "q8_0", "q8_0")


def test_gguf_q4_1_native():
    """Like the default model: Q8_0 embedding, Q4_1 layers."""
    check_against_reference("tied", "q4_1", "q4_1")


def test_untied_quantized():
    check_against_reference("untied", "hf", "q8_0")
    check_against_reference("untied", "q4_1", "q4_1")


def test_kv_cache_precision():
    """The default (f16) and q8 KV caches stay within their rounding error of the reference; f32 weights."""
    for kind, kv in (("tied", None), ("untied", None), ("untied", "f16"), ("untied", "q8")):
        model = exported(kind, "hf", "f32")
        ids = token_ids(kind, 130, seed=12)
        ref = rf.forward(ms.hf_config(config(kind)), weights(kind), ids)
        got = engine_logits(model, ids, kv=kv)
        max_rel, max_rms, min_top1 = KV_TOL[kv or "f16"]
        e, r, t = rel_err(got, ref), rms_err(got, ref), top1(got, ref)
        assert e <= max_rel and r <= max_rms and t >= min_top1, \
            (f"{kind} --kv {kv or '(default)'}: rel {e:.3g} (<= {max_rel:g}), rms {r:.3g} (<= {max_rms:g}), "
             f"top-1 {t:.3f} (>= {min_top1:g})")


def test_scalar_kernels():
    """--scalar (the plain reference kernels) agrees with the numpy reference too, F32 and quantized."""
    model = exported("tied", "f32", "f32")
    ids = token_ids("tied", 70, seed=13)
    ref = rf.forward(ms.hf_config(config("tied")), weights("tied"), ids)
    assert_close(engine_logits(model, ids, extra=("--scalar",)), ref, F32_TOL, "--scalar, F32")
    check_against_reference("tied", "q4_1", "q4_1", n_tokens=70, extra=("--scalar",))
    check_against_reference("untied", "q8_0", "q8_0", n_tokens=70, extra=("--scalar",))


if __name__ == "__main__":
    if "--llama-cpp" in sys.argv:
        llama_cpp_agrees_with_reference()
        print("llama.cpp agrees with the numpy reference on both synthetic models")
