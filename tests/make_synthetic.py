#!/usr/bin/env python3
"""Make a tiny random model, written both as GGUF and as a Hugging Face directory.

The llama models (tied and untied) are the main ones; family_config() gives one model of each other
family of export.py's manual, "The model file" (qwen2, qwen3, gemma3, llama3 = llama with
rope_scaling "llama3"), written the way llama.cpp's convert_hf_to_gguf.py writes that family
(--family NAME). Their tokenizer is the same byte-level BPE with the family's own control and turn
tokens, except Gemma 3's: a SentencePiece vocabulary, a tokenizer.model in the HF directory and
what llama.cpp's converter makes of it in the GGUF.

Both forms carry the same weights (Hugging Face row order in memory). The GGUF
follows llama.cpp's converter: Q and K rows are permuted per head so that
adjacent-pair RoPE reproduces HF's half-split RoPE (LlamaModel.permute in llama.cpp's
convert_hf_to_gguf.py; rotate_half in Hugging Face's modeling_llama.py). The
tokenizer is a small byte-level BPE (GPT-2 byte alphabet, "smollm"
pre-tokenizer) trained here on a fixed paragraph, with ChatML control tokens.

    python3 tests/make_synthetic.py OUTDIR [--seed S] [--tied | --untied | --family qwen2|qwen3|gemma3|llama3]

writes into OUTDIR:
    model.f32.gguf  model.f16.gguf  model.q8_0.gguf  model.q4_1.gguf
    hf/          config.json, model.safetensors (F32), tokenizer.json, tokenizer_config.json
    hf-sharded/  the same weights split over 3 safetensors files + model.safetensors.index.json
    hf-bf16/     BF16 safetensors (weights rounded to bf16; use bf16_round() for the reference)

Test-only dependencies: numpy and the `gguf` package (GGUFWriter, quantizers).
"""
from __future__ import annotations

import argparse
import json
import re
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ref_forward import hf_to_gguf_name


@dataclass(frozen=True)
class SynthConfig:
    """Shapes chosen to be small but awkward: GQA 6:2, odd layer count, FFN size not a power of two, odd vocabulary.

    Every matrix's row length (dim, q_dim, hidden_dim) is a multiple of 32 so the
    32-element quant blocks (Q8_0, Q4_1) fit.
    """
    dim: int = 96
    hidden_dim: int = 160
    n_layers: int = 3
    n_heads: int = 6
    n_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 397      # odd, so row loops over the vocabulary have a tail
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = True
    seed: int = 1234
    # Model family (FORMAT-FAMILIES.md): "llama", "llama3" (llama + rope_scaling of type llama3), "qwen2",
    # "qwen3", "gemma3". The fields below are used by the families that have them.
    family: str = "llama"
    window: int = 0                       # gemma3: sliding window
    pattern: int = 6                      # gemma3: every pattern-th layer is global
    rope_local: float = 10000.0           # gemma3: RoPE base of the local layers
    rope_linear: float = 1.0              # gemma3: linear RoPE scaling factor of the global layers
    llama3_scaling: tuple[float, float, float, int] = (8.0, 1.0, 4.0, 8192)   # factor, low, high, original context


def untied_config(seed: int = 4321) -> SynthConfig:
    """The second test model: separate output matrix, other shapes (3 query heads sharing one KV head,
    head_dim 32 so a per-head q8 KV cache applies, 2 layers, FFN 224 = 7 blocks) and a non-default RoPE
    base (catches a hard-coded theta)."""
    return SynthConfig(tied=False, n_layers=2, n_heads=3, n_kv_heads=1, head_dim=32, hidden_dim=224,
                       rope_theta=100000.0, seed=seed)


def family_config(family: str) -> SynthConfig:
    """The test model of each family: several layers, GQA, every family path exercised.

    qwen2: q/k/v biases; qwen3: head_dim 32 while dim / n_heads = 24 (q_dim 128 != dim); gemma3: head_dim 64
    while dim / n_heads = 32, 7 layers so the default pattern 6 makes layer 5 global, a window of 24 (prompts
    longer than it test the masking), linear RoPE scaling 2 on global layers; llama3: rope_scaling llama3 with
    original_max_position_embeddings 128 and high_freq_factor 8 so the 16 pairs fall in all three regions."""
    base = SynthConfig(family=family)
    if family == "qwen2":
        return replace(base, rope_theta=1e6, norm_eps=1e-6, seed=2002)
    if family == "qwen3":
        return replace(base, n_heads=4, n_kv_heads=2, head_dim=32, tied=False, rope_theta=1e6, norm_eps=1e-6, seed=3003)
    if family == "gemma3":
        return replace(base, n_layers=7, n_heads=3, n_kv_heads=1, head_dim=64, rope_theta=1e6, norm_eps=1e-6,
                       window=24, rope_linear=2.0, seed=4004)
    if family == "llama3":
        return replace(base, n_layers=2, n_heads=3, n_kv_heads=1, head_dim=32, rope_theta=10000.0,
                       llama3_scaling=(8.0, 1.0, 8.0, 128), seed=5005)
    if family == "llama":
        return base
    raise ValueError(family)


FAMILIES = ("qwen2", "qwen3", "gemma3", "llama3")


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 1, 2, 0, 2
# Other families' control tokens take the same three ids (bos 1, eos 2); their turn tokens follow.
FAMILY_SPECIALS = {
    "gemma3": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],   # Gemma's own ids 0..3
    "llama3": ["<|reserved_special_token_0|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"],
}
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny synthetic test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's and Llama 3's templates, shortened (system handling as in the real ones is not needed here).
GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + "
                  "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def specials(family: str) -> list[str]:
    return FAMILY_SPECIALS.get(family, SPECIAL_TOKENS)


def special_ids(family: str) -> tuple[int, int, int, int]:
    """(bos, eos, unk, pad) ids: Gemma's (2, 1, 3, 0), else SmolLM2-like."""
    return (2, 1, 3, 0) if family == "gemma3" else (BOS_ID, EOS_ID, UNK_ID, PAD_ID)


# ----------------------------------------------------------------------------------------------------------------
# Gemma's SentencePiece vocabulary: a tokenizer.model (HF) and what llama.cpp's converter makes of it (GGUF)

SP_NORMAL, SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED, SP_UNUSED, SP_BYTE = 1, 2, 3, 4, 5, 6   # sentencepiece_model.proto


def spm_pieces(vocab_size: int) -> list[tuple[str, float, int]]:
    """(piece, score, sentencepiece type) like Gemma's tokenizer.model: control/unknown pieces, turn tokens and
    "\n" as user-defined pieces, a user-defined piece that tokenizer_config.json does not list ("▁▁"), the 256
    byte pieces, then normal pieces (words of CORPUS with "▁", and their pieces) scored by decreasing frequency."""
    head = [("<pad>", 0.0, SP_CONTROL), ("<eos>", 0.0, SP_CONTROL), ("<bos>", 0.0, SP_CONTROL),
            ("<unk>", 0.0, SP_UNKNOWN), ("<start_of_turn>", 0.0, SP_USER_DEFINED),
            ("<end_of_turn>", 0.0, SP_USER_DEFINED), ("\n", 0.0, SP_USER_DEFINED), ("▁▁", 0.0, SP_USER_DEFINED)]
    pieces = head + [(f"<0x{b:02X}>", 0.0, SP_BYTE) for b in range(256)]
    counts: Counter = Counter()
    for word in CORPUS.split():
        w = "▁" + word
        for i in range(len(w)):
            for j in range(i + 2, min(len(w), i + 6) + 1):
                counts[w[i:j]] += 1
    known = {p[0] for p in pieces}
    ranked = [t for t in sorted(counts, key=lambda t: (-counts[t], t)) if t not in known]
    n_new = vocab_size - len(pieces)
    return pieces + [(t, -float(k), SP_NORMAL) for k, t in enumerate(ranked[:n_new])]


# tokenizer_config.json's added_tokens_decoder of the Gemma model: id -> special
GEMMA_ADDED = {0: True, 1: True, 2: True, 3: True, 4: True, 5: True, 6: False}


def spm_gguf_vocab(pieces: list[tuple[str, float, int]]) -> tuple[list[str], list[float], list[int]]:
    """The tokens, scores and GGUF types llama.cpp's converter writes for these pieces
    (_create_vocab_sentencepiece in convert_hf_to_gguf.py): unknown/control/unused/byte pieces keep their
    type, others are normal; each added_tokens_decoder token becomes control (special) or user-defined,
    score -1000."""
    tokens = [p[0] for p in pieces]
    scores = [p[1] for p in pieces]
    types = [t if t in (SP_UNKNOWN, SP_CONTROL, SP_UNUSED, SP_BYTE) else SP_NORMAL for _, _, t in pieces]
    for i, special in GEMMA_ADDED.items():
        types[i] = SP_CONTROL if special else SP_USER_DEFINED
        scores[i] = -1000.0
    return tokens, scores, types


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _proto(number: int, wire: int, payload: bytes) -> bytes:
    """One protobuf field (protobuf.dev "Encoding"); a length-delimited payload gets its length prefix."""
    return _varint(number << 3 | wire) + (_varint(len(payload)) if wire == 2 else b"") + payload


def spm_model_bytes(pieces: list[tuple[str, float, int]]) -> bytes:
    """A tokenizer.model: ModelProto {pieces = 1 {piece = 1, score = 2, type = 3 (omitted when NORMAL, the
    default)}, trainer_spec = 2 {model_type = 3: BPE, byte_fallback = 35: true}, normalizer_spec = 3 {add_dummy_prefix = 3: false}}."""
    out = b""
    for text, score, ptype in pieces:
        msg = _proto(1, 2, text.encode()) + _proto(2, 5, struct.pack("<f", score))
        if ptype != SP_NORMAL:
            msg += _proto(3, 0, _varint(ptype))
        out += _proto(1, 2, msg)
    trainer = _proto(3, 0, _varint(2)) + _proto(35, 0, _varint(1))
    return out + _proto(2, 2, trainer) + _proto(3, 2, _proto(3, 0, _varint(0)))


def chat_template(family: str) -> str:
    return {"gemma3": GEMMA_TEMPLATE, "llama3": LLAMA3_TEMPLATE}.get(family, CHAT_TEMPLATE)


# Training text for the merges (written for this file; any English prose would do).
CORPUS = """\
The small model reads the text one token at a time, and each token is a piece of a word.
When the engine starts, it maps the weights from the file and checks that the header is sane.
A test should be able to fail: it compares the output of the engine with a reference that was
written separately, from the mathematics of the model and not from the code under test.
The attention layer looks back at every earlier position, and the rotary embedding tells it
how far away each position is. The feed forward layer then mixes the features of the token.
If the rows of the query and key matrices are in the wrong order, the answer is still a list
of numbers that looks plausible, which is why the test compares them with a second route.
Hello world! Hello there, the weather is fine and the tea is hot. She said: "It's the end."
We're testing tokenizers; they'll split words like these, and they've got to handle punctuation.
"""


def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (bytes_to_unicode in openai/gpt-2 src/encoder.py)."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(0x100 + extra)
            extra += 1
    return mapping


def pretokenize(text: str) -> list[str]:
    """A simplified GPT-2 split (contractions, optional-space words, single digits, punctuation runs, spaces).

    Only used to train the merges, so it need not match the real pre-tokenizer
    exactly: any merge list whose results are vocabulary tokens is valid.
    """
    pattern = r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"
    return re.findall(pattern, text)


def train_merges(text: str, n_new_tokens: int, known: set[str]) -> list[tuple[str, str]]:
    """Greedy BPE training over mapped-byte symbols until `n_new_tokens` new token texts exist.

    Ties are broken by the pair's text, so the result is deterministic. As in
    real vocabularies, two merges may produce the same text (ab+c and a+bc);
    the token then exists once.
    """
    b2u = gpt2_byte_to_unicode()
    words = Counter(tuple(b2u[b] for b in piece.encode("utf-8")) for piece in pretokenize(text))
    merges: list[tuple[str, str]] = []
    seen = set(known)
    added = 0
    while added < n_new_tokens:
        pairs: Counter = Counter()
        for word, freq in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += freq
        if not pairs:
            raise ValueError(f"corpus too small for {n_new_tokens} tokens (got {added})")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        if best[0] + best[1] not in seen:
            seen.add(best[0] + best[1])
            added += 1
        merged: Counter = Counter()
        for word, freq in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        words = merged
    return merges


@dataclass
class Tokenizer:
    tokens: list[str]            # GPT-2 mapped form (what GGUF and tokenizer.json store); specials literal
    types: list[int]             # GGUF token types
    merges: list[tuple[str, str]]

    @property
    def vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}


def make_tokenizer(vocab_size: int, family: str = "llama") -> Tokenizer:
    """ids 0..2 control tokens (as in SmolLM2; the family's own, see FAMILY_SPECIALS), then the 256 byte
    tokens in byte order, then merge results."""
    b2u = gpt2_byte_to_unicode()
    special = specials(family)
    tokens = list(special) + [b2u[b] for b in range(256)]
    n_new = vocab_size - len(tokens)
    if n_new < 0:
        raise ValueError(f"vocab_size {vocab_size} < {len(tokens)}")
    merges = train_merges(CORPUS, n_new, set(tokens))
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    if len(set(tokens)) != len(tokens):
        raise AssertionError("duplicate token text")
    types = [TOKEN_TYPE_CONTROL] * len(special) + [TOKEN_TYPE_NORMAL] * (len(tokens) - len(special))
    return Tokenizer(tokens, types, merges)


# ----------------------------------------------------------------------------------------------------------------
# Weights (Hugging Face names and row order)

def hf_weight_names(cfg: SynthConfig) -> list[str]:
    """The checkpoint's tensor names (modeling_llama / modeling_qwen2 / modeling_qwen3 / modeling_gemma3)."""
    names = ["model.embed_tokens.weight"]
    for layer in range(cfg.n_layers):
        p = f"model.layers.{layer}."
        names += [p + "input_layernorm.weight", p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                  p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight",
                  p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
        if cfg.family == "qwen2":
            names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
        if cfg.family in ("qwen3", "gemma3"):
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.family == "gemma3":
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    names.append("model.norm.weight")
    if not cfg.tied:
        names.append("lm_head.weight")
    return names


def make_weights(cfg: SynthConfig) -> dict[str, np.ndarray]:
    """Random float32 weights, scaled so activations stay O(1) and attention is neither uniform nor one-hot.

    The embedding is small (std 0.05, like trained models) so the first RMSNorm's
    eps is a visible fraction of mean(x^2): a wrong eps changes the logits by
    more than the test tolerance. Norm weights are far from 1 so a missing norm
    weight is caught too.
    """
    rng = np.random.default_rng(cfg.seed)
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    # Gemma's checkpoints store w of the multiplier 1 + w: centre its norms on 0 instead of 1.
    shift = -1.0 if cfg.family == "gemma3" else 0.0

    def norm_weight(center: float, n: int = cfg.dim) -> np.ndarray:
        return (center + shift + 0.25 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((cfg.vocab_size, cfg.dim), 0.05)}
    for layer in range(cfg.n_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm_weight(1.0)
        # q/k a bit larger than 1/sqrt(fan_in) so scores spread over a few units and RoPE matters.
        w[p + "self_attn.q_proj.weight"] = normal((q_dim, cfg.dim), 1.5 / np.sqrt(cfg.dim))
        w[p + "self_attn.k_proj.weight"] = normal((kv_dim, cfg.dim), 1.5 / np.sqrt(cfg.dim))
        w[p + "self_attn.v_proj.weight"] = normal((kv_dim, cfg.dim), 1.0 / np.sqrt(cfg.dim))
        w[p + "self_attn.o_proj.weight"] = normal((cfg.dim, q_dim), 1.0 / np.sqrt(q_dim))
        w[p + "post_attention_layernorm.weight"] = norm_weight(1.0)
        w[p + "mlp.gate_proj.weight"] = normal((cfg.hidden_dim, cfg.dim), 1.0 / np.sqrt(cfg.dim))
        w[p + "mlp.up_proj.weight"] = normal((cfg.hidden_dim, cfg.dim), 1.0 / np.sqrt(cfg.dim))
        w[p + "mlp.down_proj.weight"] = normal((cfg.dim, cfg.hidden_dim), 1.0 / np.sqrt(cfg.hidden_dim))
        if cfg.family == "qwen2":   # biases large enough to move the scores
            w[p + "self_attn.q_proj.bias"] = normal((q_dim,), 0.5)
            w[p + "self_attn.k_proj.bias"] = normal((kv_dim,), 0.5)
            w[p + "self_attn.v_proj.bias"] = normal((kv_dim,), 0.5)
        if cfg.family in ("qwen3", "gemma3"):
            w[p + "self_attn.q_norm.weight"] = norm_weight(1.0, cfg.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm_weight(1.0, cfg.head_dim)
        if cfg.family == "gemma3":
            w[p + "pre_feedforward_layernorm.weight"] = norm_weight(1.0)
            w[p + "post_feedforward_layernorm.weight"] = norm_weight(1.0)
    # Tied: logits = normed(x) . embedding rows (std 0.05), so a large final norm gives logits a useful spread.
    w["model.norm.weight"] = norm_weight(3.0 if cfg.tied else 1.0)
    if not cfg.tied:
        w["lm_head.weight"] = normal((cfg.vocab_size, cfg.dim), 1.0 / np.sqrt(cfg.dim))
    assert sorted(w) == sorted(hf_weight_names(cfg))
    return w


def weight_order(cfg: SynthConfig, weights: dict[str, np.ndarray]) -> list[str]:
    """The names of `weights` in checkpoint order; a test may have removed or added some."""
    names = hf_weight_names(cfg)
    return [n for n in names if n in weights] + sorted(set(weights) - set(names))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even, as ggml_compute_fp32_to_bf16 in ggml/src/ggml-impl.h
    does (no NaNs occur here)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """The float32 values a bf16 file carries for `x`."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def rounded_weights(weights: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The weights as stored in a `dtype` file ("f32", "f16", "bf16"), back in float32: the reference's input."""
    if dtype == "f32":
        return dict(weights)
    if dtype == "f16":
        return {k: v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v for k, v in weights.items()}
    if dtype == "bf16":
        return {k: bf16_round(v) for k, v in weights.items()}
    raise ValueError(dtype)


# ----------------------------------------------------------------------------------------------------------------
# GGUF (llama.cpp convention)

def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation: GGUF row (h*hd + 2i + s) = HF row (h*hd + s*hd/2 + i)
    (LlamaModel.permute in convert_hf_to_gguf.py)."""
    rows = w.shape[0]
    hd = rows // n_heads
    half = hd // 2
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(half):
            for s in range(2):
                out[h * hd + 2 * i + s] = w[h * hd + s * half + i]
    return out


# GGUF names of the tensors llama has not (llama.cpp gguf-py/gguf/tensor_mapping.py). In Gemma 3 GGUFs
# ffn_norm is the pre-FFN norm and post_attention_norm the norm after attention (llama.cpp's gemma3 graph).
GGUF_FAMILY_PARTS = {
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}
GGUF_GEMMA3_PARTS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(cfg: SynthConfig, name: str) -> str:
    """The GGUF name llama.cpp's converter gives the HF tensor `name` in a model of cfg's family."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and cfg.family == "gemma3" and m.group(2) in GGUF_GEMMA3_PARTS:
        return f"blk.{m.group(1)}.{GGUF_GEMMA3_PARTS[m.group(2)]}"
    if m and m.group(2) in GGUF_FAMILY_PARTS:
        return f"blk.{m.group(1)}.{GGUF_FAMILY_PARTS[m.group(2)]}"
    return hf_to_gguf_name(name)


def gguf_arch(cfg: SynthConfig) -> str:
    return "llama" if cfg.family == "llama3" else cfg.family


def llama3_rope_factors(cfg: SynthConfig) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for rope_scaling type llama3
    (LlamaModel.generate_extra_tensors in convert_hf_to_gguf.py): per pair, 1 for short wavelengths,
    `factor` for long ones, 1 / ((1 - smooth) / factor + smooth) in between."""
    factor, low, high, old_ctx = cfg.llama3_scaling
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, cfg.head_dim, 2):
        freq = 1.0 / cfg.rope_theta ** (i / cfg.head_dim)
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_variant_types(qtype: str) -> tuple[str, str]:
    """(type of the embedding/output matrices, type of the layer matrices) for a GGUF variant.

    The q4_1 variant mirrors the real SmolLM2 Q4_1 file: embedding in Q8_0, layer matrices Q4_1.
    """
    return {"f32": ("F32", "F32"), "f16": ("F16", "F16"), "q8_0": ("Q8_0", "Q8_0"), "q4_1": ("Q8_0", "Q4_1")}[qtype]


def gguf_tensor_type(name: str, qtype: str, ndim: int) -> str:
    if ndim == 1:
        return "F32"
    big, layer = gguf_variant_types(qtype)
    return big if name in ("model.embed_tokens.weight", "lm_head.weight") else layer


def dequantized_weights(weights: dict[str, np.ndarray], qtype: str) -> dict[str, np.ndarray]:
    """The float32 values a GGUF variant stores for each HF weight (round trip through gguf's quantizers)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    out = {}
    for name, w in weights.items():
        t = gguf_tensor_type(name, qtype, w.ndim)
        if t == "F32":
            out[name] = w
        elif t == "F16":
            out[name] = w.astype(np.float16).astype(np.float32)
        else:
            gt = GGMLQuantizationType[t]
            out[name] = dequantize(quantize(w, gt), gt).astype(np.float32).reshape(w.shape)
    return out


def write_gguf(path: Path, cfg: SynthConfig, weights: dict[str, np.ndarray], tok: Tokenizer,
               qtype: str = "f32", override: Callable[[str, np.ndarray], tuple[np.ndarray, str] | None] | None = None
               ) -> Path:
    """Write a llama.cpp-style GGUF; qtype in f32, f16, q8_0, q4_1 (norms always F32).

    override(gguf_name, weight in GGUF row order) may return (raw block bytes, ggml type name) to store a
    tensor in any other type (e.g. K-quant blocks made by the caller)."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
    from gguf.quants import quantize

    file_type = {"f32": 0, "f16": 1, "q8_0": 7, "q4_1": 3}[qtype]
    w = GGUFWriter(str(path), gguf_arch(cfg))
    w.add_name(f"synthetic-{cfg.family}-{'tied' if cfg.tied else 'untied'}-{cfg.seed}")
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_file_type(file_type)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.n_heads != cfg.dim:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.family == "gemma3":   # like the real Gemma 3 GGUFs: no pattern or local base key (llama.cpp's defaults)
        w.add_sliding_window(cfg.window)
        if cfg.pattern != 6:
            w.add_sliding_window_pattern(cfg.pattern)
        if cfg.rope_local != 10000.0:
            w.add_rope_freq_base_swa(cfg.rope_local)
        if cfg.rope_linear != 1.0:
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(cfg.rope_linear)
    if qtype in ("q8_0", "q4_1"):
        w.add_quantization_version(2)
    bos, eos, unk, pad = special_ids(cfg.family)
    if cfg.family == "gemma3":   # SentencePiece, as in the real Gemma 3 GGUFs
        tokens, scores, types = spm_gguf_vocab(spm_pieces(cfg.vocab_size))
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types([TokenType(t) for t in types])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tok.tokens)
        w.add_token_types([TokenType(t) for t in tok.types])
        w.add_token_merges([f"{a} {b}" for a, b in tok.merges])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    w.add_pad_token_id(pad)
    w.add_add_bos_token(cfg.family == "gemma3")
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if cfg.family != "gemma3":   # the real Gemma 3 270M GGUF has no template either
        w.add_chat_template(chat_template(cfg.family))

    if cfg.family == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    permuted = cfg.family in ("llama", "llama3")   # qwen2/qwen3/gemma3 use NEOX RoPE: rows stay in HF order
    for name in weight_order(cfg, weights):
        arr = weights[name]
        if permuted and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.n_heads)
        elif permuted and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.n_kv_heads)
        if cfg.family == "gemma3" and name.endswith("norm.weight"):
            arr = arr + np.float32(1)   # convert_hf_to_gguf.py's Gemma3Model stores 1 + w
        t = gguf_tensor_type(name, qtype, arr.ndim)
        gname = gguf_name(cfg, name)
        custom = override(gname, arr) if override else None
        if custom is not None:
            w.add_tensor(gname, custom[0], raw_dtype=GGMLQuantizationType[custom[1]])
        elif t == "F32":
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
        elif t == "F16":
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            gt = GGMLQuantizationType[t]
            w.add_tensor(gname, quantize(arr, gt), raw_dtype=gt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face directory

def hf_config(cfg: SynthConfig, torch_dtype: str = "float32") -> dict:
    c = llama_hf_config(cfg, torch_dtype)
    if cfg.family == "llama3":
        factor, low, high, old_ctx = cfg.llama3_scaling
        c["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                             "high_freq_factor": high, "original_max_position_embeddings": old_ctx}
    elif cfg.family in ("qwen2", "qwen3"):
        for key in ("mlp_bias", "pretraining_tp", "rope_interleaved") + (("attention_bias",) if cfg.family == "qwen2" else ()):
            del c[key]
        name = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.family]
        c.update(architectures=[name], model_type=cfg.family, use_sliding_window=False, sliding_window=None,
                 max_window_layers=cfg.n_layers)
    elif cfg.family == "gemma3":   # transformers' Gemma3TextConfig
        for key in ("mlp_bias", "pretraining_tp", "rope_interleaved", "hidden_act"):
            del c[key]
        c.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                 query_pre_attn_scalar=cfg.head_dim, sliding_window=cfg.window, rope_local_base_freq=cfg.rope_local,
                 layer_types=["full_attention" if (l + 1) % cfg.pattern == 0 else "sliding_attention"
                              for l in range(cfg.n_layers)],
                 rope_scaling={"rope_type": "linear", "factor": cfg.rope_linear} if cfg.rope_linear != 1 else None,
                 final_logit_softcapping=None, attn_logit_softcapping=None,
                 eos_token_id=[1, 5], pad_token_id=0)   # Gemma 3 lists <eos> and <end_of_turn>
    return c


def llama_hf_config(cfg: SynthConfig, torch_dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids(cfg.family)[0],
        "eos_token_id": special_ids(cfg.family)[1],
        "pad_token_id": PAD_ID,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.dim,
        "initializer_range": 0.02,
        "intermediate_size": cfg.hidden_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "mlp_bias": False,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": cfg.norm_eps,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tied,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.46.0",
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> int:
    """Write one safetensors file by hand (the "Format" section of the safetensors README);
    dtype "F32" or "BF16". Returns the data size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    # Data in reverse name order, so that a reader relying on header order or on sorted data is caught out.
    for name in sorted(tensors, reverse=True):
        arr = tensors[name]
        raw = (bf16_bits(arr) if dtype == "BF16" else np.ascontiguousarray(arr, dtype="<f4")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-(8 + len(text))) % 8)   # pad so the data starts 8-aligned, as the Rust writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    return offset


def tokenizer_json(tok: Tokenizer, merges_as_lists: bool = False) -> dict:
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(tok.tokens, tok.types))
             if ty == TOKEN_TYPE_CONTROL]
    merges = [[a, b] for a, b in tok.merges] if merges_as_lists else [f"{a} {b}" for a, b in tok.merges]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": tok.vocab, "merges": merges},
    }


def tokenizer_config_json(cfg: SynthConfig) -> dict:
    special = specials(cfg.family)
    if cfg.family == "gemma3":
        pieces = spm_pieces(cfg.vocab_size)
        return {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
                "unk_token": "<unk>", "pad_token": "<pad>", "chat_template": GEMMA_TEMPLATE,
                "tokenizer_class": "GemmaTokenizer", "model_max_length": cfg.max_seq_len,
                "added_tokens_decoder": {str(i): {"content": pieces[i][0], "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": sp}
                                         for i, sp in GEMMA_ADDED.items()}}
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for i, t in enumerate(special)},
        "additional_special_tokens": special[3:] if cfg.family in FAMILY_SPECIALS else ["<|im_start|>", "<|im_end|>"],
        "bos_token": special[BOS_ID],
        "chat_template": chat_template(cfg.family),
        "clean_up_tokenization_spaces": False,
        "eos_token": special[EOS_ID],
        "model_max_length": cfg.max_seq_len,
        "pad_token": special[PAD_ID],
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": special[UNK_ID],
        "vocab_size": cfg.vocab_size,
    }


def write_hf(outdir: Path, cfg: SynthConfig, weights: dict[str, np.ndarray], tok: Tokenizer,
             dtype: str = "F32", shards: int = 1, merges_as_lists: bool = False) -> Path:
    """Write config.json, safetensors (one file, or `shards` files + index), tokenizer.json, tokenizer_config.json."""
    outdir.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"F32": "float32", "BF16": "bfloat16"}[dtype]
    (outdir / "config.json").write_text(json.dumps(hf_config(cfg, torch_dtype), indent=2) + "\n")
    if cfg.family == "gemma3":   # Gemma's SentencePiece tokenizer.model (no byte-level tokenizer.json)
        (outdir / "tokenizer.model").write_bytes(spm_model_bytes(spm_pieces(cfg.vocab_size)))
    else:
        (outdir / "tokenizer.json").write_text(json.dumps(tokenizer_json(tok, merges_as_lists), ensure_ascii=False))
    (outdir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_json(cfg), indent=2) + "\n")
    names = weight_order(cfg, weights)
    if shards == 1:
        write_safetensors(outdir / "model.safetensors", {n: weights[n] for n in names}, dtype)
        return outdir
    weight_map, total = {}, 0
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]     # interleaved, so every shard holds pieces of several layers
        total += write_safetensors(outdir / fname, {n: weights[n] for n in part}, dtype)
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (outdir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return outdir


# ----------------------------------------------------------------------------------------------------------------

def make_all(outdir: Path, cfg: SynthConfig, gguf_types: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_1"),
             hf: bool = True) -> dict[str, Path]:
    """Write every variant of the model described by `cfg` into `outdir`; returns {variant: path}."""
    outdir.mkdir(parents=True, exist_ok=True)
    weights = make_weights(cfg)
    tok = make_tokenizer(cfg.vocab_size, cfg.family)
    paths = {}
    for qt in gguf_types:
        paths[f"gguf-{qt}"] = write_gguf(outdir / f"model.{qt}.gguf", cfg, weights, tok, qt)
    if hf:
        paths["hf"] = write_hf(outdir / "hf", cfg, weights, tok)
        paths["hf-sharded"] = write_hf(outdir / "hf-sharded", cfg, weights, tok, shards=3, merges_as_lists=True)
        paths["hf-bf16"] = write_hf(outdir / "hf-bf16", cfg, weights, tok, dtype="BF16")
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--seed", type=int, default=None, help="weight seed (default 1234 tied, 4321 untied)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tied", dest="tied", action="store_true", default=True, help="tied embeddings (default)")
    g.add_argument("--untied", dest="tied", action="store_false", help="separate output matrix; MQA, head_dim 32, 2 layers, rope_theta 1e5")
    ap.add_argument("--family", choices=FAMILIES, help="one of the other families' test models (family_config) "
                                                        "instead of the llama ones")
    args = ap.parse_args()
    cfg = SynthConfig() if args.tied else untied_config()
    if args.family:
        cfg = family_config(args.family)
    if args.seed is not None:
        cfg = replace(cfg, seed=args.seed)
    for variant, path in make_all(args.outdir, cfg).items():
        print(f"{variant:12s} {path}")


if __name__ == "__main__":
    main()
