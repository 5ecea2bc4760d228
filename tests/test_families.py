"""Model families (export.py's manual, "The model file": header fields at 104..127, flags, bqkv / q_norm / k_norm /
post_attn_norm / post_ffn_norm / rope_freqs): export.py on each family's tiny random model
(tests/make_synthetic.py family_config: qwen2, qwen3, gemma3, llama3) and on the real Gemma 3 270M GGUF.
Gemma's vocabulary is SentencePiece: a tokenizer.model in the HF directory (the sentencepiece library
reads it as intended; checked by hand, it is not a test dependency) and what llama.cpp's converter
makes of it in the GGUF, so the byte-identical exports check export.py's reading of tokenizer.model.

The expected values come from the format spec and from the models' own configs and weights, never from
export.py: the header fields are derived here from the SynthConfig, the tensors are rebuilt here from the
Hugging Face weights (Gemma's norms + 1 as modeling_gemma3 multiplies by 1 + w; the Llama 3 frequency
factors from the formula of transformers' _compute_llama3_parameters, written here in its frequency form).
The GGUF (written like llama.cpp's converter) and the HF directory of one model must export to the same bytes.
"""
from __future__ import annotations

import functools
import math
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
from common import MODELS, ROOT, SCRATCH, gguf_metadata, python, require  # noqa: E402
import make_synthetic as ms  # noqa: E402
import modelfile as mf  # noqa: E402

WORK = SCRATCH / "families"
EXPORT = ROOT / "export.py"
ARCH = {"llama3": 1, "qwen2": 2, "qwen3": 3, "gemma3": 4}
TIED, QKV_BIAS, QK_NORM, POST_NORMS, ROPE_FREQS = 1, 2, 4, 8, 16
CHAT = {"qwen2": (1, "<|im_end|>"), "qwen3": (1, "<|im_end|>"), "gemma3": (2, "<end_of_turn>"),
        "llama3": (3, "<|eot_id|>")}


@functools.cache
def model_dir(family: str) -> Path:
    out = WORK / family
    ms.make_all(out, ms.family_config(family), gguf_types=("f32", "q8_0"))
    return out


@functools.cache
def exported(family: str, variant: str, dtype: str = "f32") -> bytes:
    """export.py run as a black box on one input: 'gguf-f32', 'gguf-q8_0', 'hf', 'hf-sharded', 'hf-bf16'."""
    d = model_dir(family)
    src = d / f"model.{variant[5:]}.gguf" if variant.startswith("gguf-") else d / variant
    out = d / f"{variant}.{dtype}.llm"
    p = python([EXPORT, src, out, "--dtype", dtype], timeout=120)
    assert p.returncode == 0, f"export.py {src} failed:\n{p.stderr.decode(errors='replace')[-2000:]}"
    return out.read_bytes()


def f32(x: float) -> float:
    return float(np.float32(x))


def expected_header(family: str) -> dict:
    """The header fields export.py's manual gives for this model."""
    c = ms.family_config(family)
    flags = (TIED if c.tied else 0) | {"qwen2": QKV_BIAS, "qwen3": QK_NORM, "gemma3": QK_NORM | POST_NORMS,
                                       "llama3": ROPE_FREQS}[family]
    h = dict(arch=ARCH[family], dim=c.dim, hidden_dim=c.hidden_dim, n_layers=c.n_layers, n_heads=c.n_heads,
             n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, rope_dim=c.head_dim, vocab_size=c.vocab_size,
             max_seq_len=c.max_seq_len, rope_theta=f32(c.rope_theta), norm_eps=f32(c.norm_eps), flags=flags,
             activation=0, embed_scale=0.0, attn_scale=0.0, window=0, window_pattern=0, rope_theta_local=0.0,
             rope_scale_global=0.0)
    if family == "gemma3":
        # sqrt(dim) as float32 (llama.cpp's sqrtf); 1/sqrt(head_dim) is the default scale (0); llama.cpp's
        # default pattern 6 and local base 10000 (the GGUF has neither key, like the real one)
        h.update(activation=1, embed_scale=f32(math.sqrt(c.dim)), window=c.window, window_pattern=6,
                 rope_theta_local=10000.0, rope_scale_global=c.rope_linear)
    return h


def expected_tensors(family: str) -> dict[str, np.ndarray]:
    """{file tensor name: float32 values} rebuilt from the HF weights by the tensor table of export.py's manual."""
    c, w = ms.family_config(family), ms.make_weights(ms.family_config(family))
    one = np.float32(1) if family == "gemma3" else np.float32(0)   # Gemma: x_hat * (1 + w)
    out = {"tok_embeddings": w["model.embed_tokens.weight"], "norm": w["model.norm.weight"] + one}
    if not c.tied:
        out["output"] = w["lm_head.weight"]
    if family == "llama3":
        out["rope_freqs"] = transformers_llama3_factors(c)
    for n in range(c.n_layers):
        p, o = f"model.layers.{n}.", f"layers.{n}."
        out[o + "attn_norm"] = w[p + "input_layernorm.weight"] + one
        out[o + "wqkv"] = np.concatenate([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[o + "wo"] = w[p + "self_attn.o_proj.weight"]
        out[o + "w13"] = np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        out[o + "w2"] = w[p + "mlp.down_proj.weight"]
        if family == "gemma3":
            out[o + "post_attn_norm"] = w[p + "post_attention_layernorm.weight"] + one
            out[o + "ffn_norm"] = w[p + "pre_feedforward_layernorm.weight"] + one
            out[o + "post_ffn_norm"] = w[p + "post_feedforward_layernorm.weight"] + one
        else:
            out[o + "ffn_norm"] = w[p + "post_attention_layernorm.weight"]
        if family == "qwen2":
            out[o + "bqkv"] = np.concatenate([w[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        if family in ("qwen3", "gemma3"):
            out[o + "q_norm"] = w[p + "self_attn.q_norm.weight"] + one
            out[o + "k_norm"] = w[p + "self_attn.k_norm.weight"] + one
    return {k: np.atleast_2d(v).astype(np.float32) for k, v in out.items()}


def transformers_llama3_factors(c: ms.SynthConfig) -> np.ndarray:
    """inv_freq / inv_freq_llama, with inv_freq_llama as transformers' _compute_llama3_parameters computes it."""
    factor, low, high, old_ctx = c.llama3_scaling
    inv_freq = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)
    wavelen = 2 * math.pi / inv_freq
    llama = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    llama = np.where(medium, smoothed, llama)
    assert medium.any() and (llama == inv_freq).any() and (llama < inv_freq / factor * 1.0001).any(), \
        "the test model must have pairs in all three regions"
    return inv_freq / llama


def f32_tensor(buf: bytes, name: str) -> np.ndarray:
    t = mf.tensor(buf, name)
    assert t.type == mf.TYPE_F32, f"{name} has type {t.type}, expected F32"
    return np.frombuffer(mf.rows_of(buf, t), "<f4").reshape(t.rows, t.cols)   # packed matrices unpacked


def check_header(buf: bytes, family: str, what: str) -> None:
    want = expected_header(family)
    got = {k: mf.get(buf, k) for k in want}
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not diff, f"{what}: header (got, want): {diff}"
    bos, eos, unk, _ = ms.special_ids(family)
    tok = {k: mf.tok_get(buf, k) for k in ("kind", "bos", "eos", "unk", "flags")}
    # Gemma: SentencePiece (kind 2) with BOS added; the others byte-level BPE (kind 1) without
    want_tok = dict(kind=2, bos=bos, eos=eos, unk=unk, flags=1) if family == "gemma3" else \
        dict(kind=1, bos=bos, eos=eos, unk=unk, flags=0)
    assert tok == want_tok, f"{what}: tokenizer section {tok}, want {want_tok}"
    kind, eot_text = CHAT[family]
    eot = ms.specials(family).index(eot_text)
    assert (mf.tok_get(buf, "chat_template"), mf.tok_get(buf, "eot")) == (kind, eot), \
        f"{what}: chat template {mf.tok_get(buf, 'chat_template')} eot {mf.tok_get(buf, 'eot')}, want {kind} {eot}"


def test_family_headers() -> None:
    for family in ms.FAMILIES:
        for variant in ("gguf-f32", "hf"):
            check_header(exported(family, variant), family, f"{family} from {variant}")


def test_family_tensors() -> None:
    """Names, shapes and values of every tensor, from the GGUF (Q/K not permuted except llama's)."""
    for family in ms.FAMILIES:
        buf, want = exported(family, "gguf-f32"), expected_tensors(family)
        names = [t.name for t in mf.tensors(buf)]
        assert sorted(names) == sorted(want), (f"{family}: missing {sorted(set(want) - set(names))}, "
                                               f"unexpected {sorted(set(names) - set(want))}")
        for name, v in want.items():
            got = f32_tensor(buf, name)
            assert got.shape == v.shape, f"{family} {name}: shape {got.shape}, want {v.shape}"
            tol = 1e-6 if name == "rope_freqs" else 0.0   # float32 rounding of a float64 formula
            assert np.allclose(got, v, rtol=tol, atol=0), \
                f"{family} {name}: max diff {np.max(np.abs(got - v)):.3g} (first values {got.ravel()[:4]} vs {v.ravel()[:4]})"


def test_gguf_and_hf_export_identical() -> None:
    """The same model from GGUF and from HF (single file and sharded): the same file, byte for byte."""
    for family in ms.FAMILIES:
        a = exported(family, "gguf-f32")
        for variant in ("hf", "hf-sharded"):
            b = exported(family, variant)
            if a != b:
                at = next(i for i in range(min(len(a), len(b))) if a[i] != b[i]) if len(a) == len(b) else "length"
                raise AssertionError(f"{family}: GGUF and {variant} exports differ (first at byte {at})")


def test_bf16_hf_and_q8_0_gguf() -> None:
    """Other source types: BF16 safetensors (Gemma's norms get 1 added after decoding) and Q8_0 GGUF blocks
    copied as they are with --dtype q8_0; the vectors stay F32 and exact."""
    for family in ms.FAMILIES:
        want = expected_tensors(family)
        bf = exported(family, "hf-bf16")
        check_header(bf, family, f"{family} from hf-bf16")
        vec = [n for n, v in want.items() if v.shape[0] == 1]
        w16 = ms.rounded_weights(ms.make_weights(ms.family_config(family)), "bf16")
        if family == "gemma3":
            got = f32_tensor(bf, "layers.0.post_ffn_norm")
            ref = w16["model.layers.0.post_feedforward_layernorm.weight"] + np.float32(1)
            assert np.array_equal(got[0], ref), f"{family}: bf16 norm + 1 differs"
        q8 = exported(family, "gguf-q8_0", "q8_0")
        check_header(q8, family, f"{family} from gguf-q8_0")
        for name in vec:
            if name != "rope_freqs":
                assert np.array_equal(f32_tensor(q8, name), want[name]), f"{family} q8_0: vector {name} differs"


def test_real_gemma3_header() -> None:
    """The real Gemma 3 270M GGUF: the header fields from its own metadata (read here with a separate reader)."""
    src = require(MODELS / "gemma3-270m-q4_k_m.gguf", "run `make test` once (it fetches the Gemma 3 vocabulary)")
    out = WORK / "gemma3-270m.tok.llm"
    WORK.mkdir(parents=True, exist_ok=True)
    p = python([EXPORT, src, out, "--tokenizer-only"], timeout=300)
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-2000:]
    buf = out.read_bytes()
    dim = gguf_metadata(src, "gemma3.embedding_length")
    want = dict(arch=4, flags=TIED | QK_NORM | POST_NORMS, activation=1, head_dim=gguf_metadata(src, "gemma3.attention.key_length"),
                embed_scale=f32(math.sqrt(dim)), attn_scale=0.0, window=gguf_metadata(src, "gemma3.attention.sliding_window"),
                window_pattern=6, rope_theta_local=10000.0, rope_scale_global=0.0,
                rope_theta=f32(gguf_metadata(src, "gemma3.rope.freq_base")))
    got = {k: mf.get(buf, k) for k in want}
    assert got == want, f"got {got}, want {want}"
    assert (want["head_dim"], want["window"], want["rope_theta"]) == (256, 512, 1e6), want   # the numbers
    # no template text in this GGUF: Gemma's own (its turn tokens are in the vocabulary); end of turn <end_of_turn>
    eot = gguf_token_id(src, "<end_of_turn>")
    assert mf.tok_get(buf, "chat_template") == 2 and mf.tok_get(buf, "eot") == eot, \
        (mf.tok_get(buf, "chat_template"), mf.tok_get(buf, "eot"), eot)


def gguf_token_id(path: Path, text: str) -> int:
    """The id of a token in a GGUF's tokenizer.ggml.tokens (a string array, docs/gguf.md): a short scan
    from the start of the array, since the gguf package parses all 262k tokens slowly."""
    with open(path, "rb") as f:
        head = f.read(16 << 20)
    key = b"tokenizer.ggml.tokens"
    at = head.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    vtype, etype, count = struct.unpack_from("<IIQ", head, at)
    assert (vtype, etype) == (9, 8), (vtype, etype)   # array of strings
    at += 16
    for i in range(count):
        n = struct.unpack_from("<Q", head, at)[0]
        if head[at + 8:at + 8 + n] == text.encode():
            return i
        at += 8 + n
    raise AssertionError(f"{text} not in {path}")
