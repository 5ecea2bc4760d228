#!/usr/bin/env python3
"""Goldens for the model families of issue 14 (Gemma 3, Qwen 2, Qwen 3, Llama 3) from llama.cpp.

Run once by a developer (needs `pip install llama-cpp-python` and the `gguf` package); the output
in tests/golden/ is checked in and tests/test_family_oracles.py only reads it.

Two kinds of golden:

  gemma3_270m_f32.json   The real Gemma 3 270M (models/gemma3-270m-q4_k_m.gguf), run by llama.cpp
        on an F32 GGUF holding the Q4_K_M file's dequantized weights (llama.cpp's own quantize API,
        ftype ALL_F32, checked equal to gguf-py's dequantization) - the numbers the engine runs after
        `export.py --dtype f32` of the same GGUF. Per prompt: llama.cpp's tokenization (BOS added,
        as the file asks), its greedy continuation (64 tokens, one decode call per token), and for
        prompt + continuation teacher-forced in one batch the top-1 id, top1-top2 margin and the
        top-10 ids/logits at every position. Prompts shorter and longer than the 512-token sliding
        window; for the long one, the logits of a float64 forward pass WITHOUT the window at the same
        ids (so a test can show that the window changes the answer). Tokenization-only texts too.

  tiny_<family>.json + tiny_<family>_logits.npy   Small random-weight models written here as GGUF
        and as a Hugging Face directory (tiny_model() below; deterministic, the GGUF's sha256 is
        recorded): llama.cpp's logits for two fixed random token sequences (48 and 80 ids): top-1
        and top1-top2 margin at every position, the whole row (vocabulary ~300) at every fourth.

Both record meta.measured_noise: the statistics the test computes, for other valid
implementations - llama.cpp fed one token per decode call, and the float64 reference
(tests/ref_forward.py) on the same weights. The test tolerances come from these numbers.

    python3 tests/oracle/make_family_goldens.py                # everything (about 15 minutes on 2 cores)
    python3 tests/oracle/make_family_goldens.py --only tiny    # or --only gemma

The tiny-model writer (tiny_model and below) needs only numpy and `gguf`; tests/test_family_oracles.py
imports it to recreate the same files, and checks their sha256 against the goldens.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
import make_synthetic as ms  # noqa: E402
import ref_forward as rf  # noqa: E402
from common import sha256_file  # noqa: E402

TOP_K = 10
N_THREADS = 2


# ================================================================================================================
# Tiny random-weight models of each family

@dataclass(frozen=True)
class TinySpec:
    """One tiny model. Row lengths (dim, q_dim, hidden) are multiples of 32 so block types fit;
    head_dim differs from dim / n_heads for qwen3 and gemma3 (the file's value must be used)."""
    family: str                 # llama, qwen2, qwen3, gemma3
    dim: int = 64
    hidden_dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 300
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    tied: bool = True
    seed: int = 1
    rope_scaling: dict | None = None
    window: int = 0             # gemma3 sliding window
    query_pre_attn_scalar: int = 0
    specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (pad/bos, eos)
    extra_specials: tuple[str, ...] = ()   # appended after the merges (control tokens)
    add_bos: bool = False
    chat_template: str = ms.CHAT_TEMPLATE
    bos_id: int = 1
    eos_id: int = 2
    gguf_ok: bool = True        # False: a Hugging Face-only variant (llama.cpp cannot express it)
    extra: dict = field(default_factory=dict)


GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
                  "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
                  "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

TINY: dict[str, TinySpec] = {
    # Qwen 2: Q/K/V biases, untied head, GQA 4:2.
    "qwen2": TinySpec("qwen2", hidden_dim=96, tied=False, seed=21),
    # Qwen 3: per-head Q/K RMSNorm, head_dim 32 while dim / n_heads = 16.
    "qwen3": TinySpec("qwen3", head_dim=32, vocab_size=301, seed=31),
    # Llama 3: "llama3" RoPE scaling; with theta 5e5, head_dim 16 and original context 256 the 8 pairs
    # fall in all three bands (kept, interpolated, divided by 8). MQA 4:1, 2 layers.
    "llama3": TinySpec("llama", hidden_dim=160, n_layers=2, n_kv_heads=1, vocab_size=304, rope_theta=5e5,
                       norm_eps=1e-5, seed=41, add_bos=True, chat_template=LLAMA3_TEMPLATE, bos_id=0, eos_id=2,
                       specials=("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
                       extra_specials=("<|start_header_id|>", "<|end_header_id|>"),
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    # Gemma 3: 8 layers so llama.cpp's fixed pattern 6 gives local 0-4, global 5, local 6-7; window 16
    # (the sequences are 48 and 80 long); MQA 4:1; head_dim 32 while dim / n_heads = 16.
    "gemma3": TinySpec("gemma3", n_layers=8, n_kv_heads=1, head_dim=32, vocab_size=305, window=16,
                       query_pre_attn_scalar=32, seed=51, add_bos=True, chat_template=GEMMA_TEMPLATE,
                       specials=("<pad>", "<bos>", "<eos>"), extra_specials=("<start_of_turn>", "<end_of_turn>")),
}
# Gemma 3 as the 27B files have it (Hugging Face only: llama.cpp derives both from the layer count):
# attention scale query_pre_attn_scalar^-0.5 = 1/sqrt(dim / n_heads) instead of 1/sqrt(head_dim), and
# linear RoPE scaling (factor 8) on the global layers.
TINY_HF_ONLY = {
    "gemma3_scaled": replace(TINY["gemma3"], query_pre_attn_scalar=16, seed=52, gguf_ok=False,
                             rope_scaling={"rope_type": "linear", "factor": 8.0}),
}
TINY_SEQUENCES = ((48, 7), (80, 8))    # (length, seed) of the teacher-forced random id sequences


def tiny_ids(spec: TinySpec, n: int, seed: int) -> list[int]:
    """A fixed pseudo-random sequence over the whole vocabulary, starting with BOS when the model adds one."""
    ids = np.random.default_rng(seed).integers(0, spec.vocab_size, n).tolist()
    if spec.add_bos:
        ids[0] = spec.bos_id
    return ids


def tiny_tokenizer(spec: TinySpec) -> ms.Tokenizer:
    """make_synthetic's byte-level BPE with this family's control tokens (ids 0-2 and after the merges)."""
    base = ms.make_tokenizer(spec.vocab_size - len(spec.extra_specials))
    tokens = list(spec.specials) + base.tokens[len(spec.specials):] + list(spec.extra_specials)
    types = base.types + [ms.TOKEN_TYPE_CONTROL] * len(spec.extra_specials)
    return ms.Tokenizer(tokens, types, base.merges)


def control_ids(spec: TinySpec) -> list[int]:
    return list(range(len(spec.specials))) + list(range(spec.vocab_size - len(spec.extra_specials), spec.vocab_size))


def hf_weight_names(spec: TinySpec) -> list[str]:
    gemma = spec.family == "gemma3"
    names = ["model.embed_tokens.weight"]
    for layer in range(spec.n_layers):
        p = f"model.layers.{layer}."
        names += [p + "input_layernorm.weight", p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                  p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight"]
        if spec.family == "qwen2":
            names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
        if spec.family in ("qwen3", "gemma3"):
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names.append(p + "post_attention_layernorm.weight")
        if gemma:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    names.append("model.norm.weight")
    if not spec.tied:
        names.append("lm_head.weight")
    return names


def tiny_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Random float32 weights in Hugging Face convention. Gemma norm weights w are stored so that
    1 + w is exact in float32 (the GGUF stores 1 + w, as llama.cpp's converter does): both files
    then hold the same numbers. Biases and norms far from neutral, so a missing one shows."""
    rng = np.random.default_rng(spec.seed)
    q_dim, kv_dim = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    gemma = spec.family == "gemma3"

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int, center: float) -> np.ndarray:
        """Effective multiplier around `center`; Gemma stores it minus 1."""
        eff = np.clip(center + 0.25 * rng.standard_normal(n), 0.55, 1.95).astype(np.float32)
        return (eff - np.float32(1.0)).astype(np.float32) if gemma else eff

    w: dict[str, np.ndarray] = {}
    for name in hf_weight_names(spec):
        part = name.split(".")[-2]
        if name == "model.embed_tokens.weight":
            w[name] = normal((spec.vocab_size, spec.dim), 0.08)
        elif name == "lm_head.weight":
            w[name] = normal((spec.vocab_size, spec.dim), 1.0 / math.sqrt(spec.dim))
        elif name == "model.norm.weight":
            w[name] = norm(spec.dim, 1.9 if spec.tied else 1.0)
        elif part in ("q_norm", "k_norm"):
            w[name] = norm(spec.head_dim, 1.4)
        elif part.endswith("layernorm"):
            w[name] = norm(spec.dim, 1.0)
        elif name.endswith(".bias"):
            w[name] = normal((q_dim if part == "q_proj" else kv_dim,), 0.3)
        elif part in ("q_proj", "k_proj"):
            w[name] = normal((q_dim if part == "q_proj" else kv_dim, spec.dim), 1.5 / math.sqrt(spec.dim))
        elif part == "v_proj":
            w[name] = normal((kv_dim, spec.dim), 1.0 / math.sqrt(spec.dim))
        elif part == "o_proj":
            w[name] = normal((spec.dim, q_dim), 1.0 / math.sqrt(q_dim))
        elif part in ("gate_proj", "up_proj"):
            w[name] = normal((spec.hidden_dim, spec.dim), 1.0 / math.sqrt(spec.dim))
        elif part == "down_proj":
            w[name] = normal((spec.dim, spec.hidden_dim), 1.0 / math.sqrt(spec.hidden_dim))
        else:
            raise AssertionError(name)
    return w


def tiny_hf_config(spec: TinySpec) -> dict:
    """config.json as transformers writes it for the family (only the keys the models read)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma3": "Gemma3ForCausalLM"}[spec.family]
    cfg = {"architectures": [arch], "model_type": "gemma3_text" if spec.family == "gemma3" else spec.family,
           "hidden_size": spec.dim, "intermediate_size": spec.hidden_dim, "num_hidden_layers": spec.n_layers,
           "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.n_kv_heads,
           "max_position_embeddings": 512, "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta,
           "rope_scaling": spec.rope_scaling, "tie_word_embeddings": spec.tied, "vocab_size": spec.vocab_size,
           "bos_token_id": spec.bos_id, "eos_token_id": spec.eos_id, "torch_dtype": "float32",
           "attention_dropout": 0.0, "transformers_version": "4.55.0"}
    if spec.family != "qwen2":
        cfg["head_dim"] = spec.head_dim
    if spec.family == "gemma3":
        cfg.update({"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": spec.query_pre_attn_scalar,
                    "sliding_window": spec.window, "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                    for i in range(spec.n_layers)],
                    "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
                    "pad_token_id": 0})
    else:
        cfg["hidden_act"] = "silu"
        cfg["attention_bias"] = spec.family == "qwen2"
    if spec.family in ("qwen2", "qwen3"):
        cfg.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": spec.n_layers})
    if spec.family == "llama":
        cfg["mlp_bias"] = False
    return cfg


def write_tiny_gguf(path: Path, spec: TinySpec, weights: dict[str, np.ndarray], tok: ms.Tokenizer) -> Path:
    """An F32 GGUF as llama.cpp's convert_hf_to_gguf.py would write it for the family: llama Q/K
    rows permuted, Gemma norms + 1, Llama 3's rope_freqs tensor (per-pair frequency divisors)."""
    from gguf import GGUFWriter, TokenType

    arch = spec.family
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{spec.seed}")
    w.add_context_length(512)
    w.add_embedding_length(spec.dim)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.hidden_dim)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_file_type(0)
    w.add_vocab_size(spec.vocab_size)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    if arch == "gemma3":
        w.add_sliding_window(spec.window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok.tokens)
    w.add_token_types([TokenType(t) for t in tok.types])
    w.add_token_merges([f"{a} {b}" for a, b in tok.merges])
    w.add_bos_token_id(spec.bos_id)
    w.add_eos_token_id(spec.eos_id)
    w.add_pad_token_id(0)
    w.add_add_bos_token(spec.add_bos)
    w.add_add_space_prefix(False)
    w.add_chat_template(spec.chat_template)

    if spec.rope_scaling and spec.rope_scaling.get("rope_type") == "llama3":
        factors = rf.llama3_divisors(spec.rope_scaling, spec.rope_theta, spec.head_dim)
        w.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
    for name in hf_weight_names(spec):
        arr = weights[name]
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = ms.llama_cpp_permute(arr, spec.n_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = ms.llama_cpp_permute(arr, spec.n_kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            arr = (arr + np.float32(1.0)).astype(np.float32)    # exact by construction (tiny_weights)
        w.add_tensor(rf.hf_to_gguf_name(name, arch), np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_hf(outdir: Path, spec: TinySpec, weights: dict[str, np.ndarray], tok: ms.Tokenizer) -> Path:
    """config.json, model.safetensors (F32), tokenizer.json, tokenizer_config.json."""
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "config.json").write_text(json.dumps(tiny_hf_config(spec), indent=2) + "\n")
    tj = ms.tokenizer_json(tok)
    added = {i: tok.tokens[i] for i in control_ids(spec)}
    tj["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True} for i, t in added.items()]
    (outdir / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    tc = {"add_bos_token": spec.add_bos, "add_eos_token": False, "bos_token": tok.tokens[spec.bos_id],
          "eos_token": tok.tokens[spec.eos_id], "pad_token": tok.tokens[0], "chat_template": spec.chat_template,
          "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                            "single_word": False, "special": True} for i, t in added.items()},
          "clean_up_tokenization_spaces": False, "model_max_length": 512, "tokenizer_class": "PreTrainedTokenizerFast"}
    (outdir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    ms.write_safetensors(outdir / "model.safetensors", {n: weights[n] for n in hf_weight_names(spec)}, "F32")
    return outdir


def tiny_model(name: str, outdir: Path) -> dict[str, Path]:
    """Write tiny model `name` (a key of TINY or TINY_HF_ONLY) into outdir: {'gguf': ..., 'hf': ...}
    ('gguf' only when llama.cpp can express the model)."""
    spec = {**TINY, **TINY_HF_ONLY}[name]
    weights, tok = tiny_weights(spec), tiny_tokenizer(spec)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = {"hf": write_tiny_hf(outdir / f"{name}-hf", spec, weights, tok)}
    if spec.gguf_ok:
        paths["gguf"] = write_tiny_gguf(outdir / f"{name}.f32.gguf", spec, weights, tok)
    return paths


# ================================================================================================================
# llama.cpp

def open_llama(path: Path, n_ctx: int, ubatch: int):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=ubatch, n_ubatch=ubatch, n_threads=N_THREADS,
                           n_threads_batch=N_THREADS, logits_all=True, flash_attn=False, type_k=0, type_v=0,
                           seed=0, verbose=False, n_gpu_layers=0)


def settings(n_ctx: int) -> dict:
    import platform

    import llama_cpp

    return {"n_ctx": n_ctx, "n_batch": n_ctx, "n_ubatch": n_ctx, "n_threads": N_THREADS, "flash_attn": False,
            "type_k": "f32", "type_v": "f32", "logits_all": True,
            "greedy": "numpy argmax (lowest id on ties) over the logits of each one-token decode step",
            "teacher_forced": "the whole sequence evaluated in one llama_decode batch",
            "llama_cpp_python": llama_cpp.__version__, "platform": platform.platform(),
            "python": platform.python_version()}


def teacher_forced(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def greedy(llm, prompt_ids: list[int], n: int) -> tuple[list[int], bool]:
    """Greedy continuation, one decode call per generated token; stops after an end-of-generation token."""
    import llama_cpp

    llm.reset()
    llm.eval(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            return out, True
        llm.eval([tok])
    return out, False


def piece(llm, token: int) -> bytes:
    import ctypes

    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, len(buf), 0, False)
    if n < 0:
        raise RuntimeError(f"token {token} piece longer than {len(buf)}")
    return buf.raw[:n]


def top_summary(logits: np.ndarray) -> dict:
    """Per position: top-1 id, top1-top2 margin (5 decimals), top-10 ids and logits (descending, 4 decimals:
    the rounding, <= 5e-5, is far below the tolerances and keeps tests/golden small)."""
    order = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    vals = np.take_along_axis(logits, order, axis=1).astype(np.float64)
    return {"top1": order[:, 0].tolist(), "margin": [round(float(m), 5) for m in vals[:, 0] - vals[:, 1]],
            "top10_ids": order.tolist(), "top10_logits": [[round(float(v), 4) for v in r] for r in vals]}


def at_golden_ids(entry: dict, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Another implementation's logits reduced to what noise_stats needs (keeps memory small with a
    262,144-entry vocabulary): its values at the golden's top-10 ids, and its own top-1."""
    return np.take_along_axis(logits.astype(np.float64), np.asarray(entry["top10_ids"]), axis=1), logits.argmax(axis=1)


def noise_stats(golden: list[dict], others: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """What tests/test_family_oracles.py measures, for another valid implementation (at_golden_ids of its
    logits): |diff| at the golden's top-10 ids, how much the top1-top2 gap moves, top-1 disagreements
    (with the golden's margin there)."""
    at_top, gap_moves, flips = [], [], []
    for g, (theirs, their_top1) in zip(golden, others):
        at_top.append(np.abs(theirs - np.asarray(g["top10_logits"])).reshape(-1))
        gap_moves.append(np.abs((theirs[:, 0] - theirs[:, 1]) - np.asarray(g["margin"])))
        flips += [m for m, t, a in zip(g["margin"], g["top1"], their_top1) if a != t]
    at_top, gap_moves = np.concatenate(at_top), np.concatenate(gap_moves)
    return {"top10_max": float(at_top.max()), "top10_mean": float(at_top.mean()),
            "top10_p99_9": float(np.quantile(at_top, 0.999)),
            "margin_change_max": float(gap_moves.max()), "top1_disagreements": len(flips),
            "largest_margin_with_top1_disagreement": max(flips, default=0.0)}


def write_json(path: Path, meta: dict, entries: list[dict]) -> None:
    """Readable meta block, then one compact line per entry."""
    with open(path, "w") as f:
        f.write('{"meta": ' + json.dumps(meta, indent=1, sort_keys=True) + ',\n"entries": [\n')
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in entries))
        f.write("\n]}\n")


# ================================================================================================================
# Tiny-model goldens

def stored_positions(n: int) -> list[int]:
    """Positions of a tiny sequence whose whole logit row is stored: every fourth and the last
    (all would take ~190 KB per model; tests/golden stays small)."""
    return sorted(set(range(0, n, 4)) | {n - 1})


def row_stats(entries: list[dict], rows: np.ndarray, others: list[np.ndarray]) -> dict:
    """|diff| between another implementation's logits and the stored llama.cpp rows, and top-1 flips."""
    d = np.concatenate([np.abs(o[e["stored_positions"]].astype(np.float64) - rows[e["row_offset"]:e["row_offset"] + len(e["stored_positions"])]).reshape(-1)
                        for e, o in zip(entries, others)])
    flips = [m for e, o in zip(entries, others) for m, t, a in zip(e["margin"], e["top1"], o.argmax(axis=1)) if a != t]
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "top1_disagreements": len(flips),
            "largest_margin_with_top1_disagreement": max(flips, default=0.0)}


def tiny_goldens(name: str, scratch: Path, out: Path) -> None:
    """llama.cpp's logits for TINY_SEQUENCES on the tiny GGUF: top-1 and margin at every position,
    whole rows at stored_positions()."""
    spec = TINY[name]
    paths = tiny_model(name, scratch / "tiny")
    gguf, n_ctx = paths["gguf"], 128
    llm, llm_one = open_llama(gguf, n_ctx, n_ctx), open_llama(gguf, n_ctx, 1)
    cfg_g, w_g = rf.load_gguf(gguf)
    cfg_h, w_h = rf.load_hf(paths["hf"])
    entries, rows, others = [], [], {"one": [], "ref_gguf": [], "ref_hf": [], "no_window": []}
    for n, seed in TINY_SEQUENCES:
        ids = tiny_ids(spec, n, seed)
        tf = teacher_forced(llm, ids)
        keep = stored_positions(n)
        order = np.argsort(-tf, axis=1, kind="stable")
        top2 = np.take_along_axis(tf, order[:, :2], axis=1).astype(np.float64)
        entries.append({"name": f"random{n}", "ids": ids, "top1": order[:, 0].tolist(),
                        "margin": [round(float(m), 6) for m in top2[:, 0] - top2[:, 1]],
                        "stored_positions": keep, "row_offset": sum(len(e["stored_positions"]) for e in entries)})
        rows.append(tf[keep])
        others["one"].append(teacher_forced(llm_one, ids))
        others["ref_gguf"].append(rf.forward(cfg_g, w_g, ids, adjacent_pairs=rf.gguf_is_permuted(cfg_g)))
        others["ref_hf"].append(rf.forward(cfg_h, w_h, ids))
        if spec.window:
            others["no_window"].append(rf.forward(cfg_h, w_h, ids, full_attention=True))
    llm.close()
    llm_one.close()
    rows_arr = np.concatenate(rows).astype(np.float32)
    rows64 = rows_arr.astype(np.float64)
    noise = {"llamacpp_one_token_per_decode": row_stats(entries, rows64, others["one"]),
             "float64_reference_gguf_weights": row_stats(entries, rows64, others["ref_gguf"]),
             "float64_reference_hf_weights": row_stats(entries, rows64, others["ref_hf"]),
             "reference_gguf_vs_hf_max": float(max(np.abs(a - b).max() for a, b in zip(others["ref_gguf"], others["ref_hf"])))}
    np.save(out / f"tiny_{name}_logits.npy", rows_arr)
    meta = {"model": name, "spec": {k: v for k, v in spec.__dict__.items() if k != "chat_template"},
            "gguf_sha256": sha256_file(gguf), "gguf_file": gguf.name, "settings": settings(n_ctx),
            "measured_noise": noise, "logits_file": f"tiny_{name}_logits.npy",
            "generated_by": "tests/oracle/make_family_goldens.py", "date": time.strftime("%Y-%m-%d")}
    if spec.window:
        meta["float64_reference_without_sliding_window"] = row_stats(entries, rows64, others["no_window"])
    write_json(out / f"tiny_{name}.json", meta, entries)
    print(f"[tiny {name}] noise {json.dumps(noise)}", flush=True)
    if spec.window:
        print(f"[tiny {name}] without the window: {json.dumps(meta['float64_reference_without_sliding_window'])}", flush=True)


# ================================================================================================================
# Gemma 3 270M

GEMMA_GGUF = ROOT / "models" / "gemma3-270m-q4_k_m.gguf"
GEMMA_CTX = 1024
GEMMA_WINDOW = 512
GEMMA_CONTINUE = 64


def gemma_chat(user: str) -> str:
    """Gemma's chat template for one user turn (the BOS is added by the tokenizer, as the file asks)."""
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


SHORT_PROSE = (
    "Lighthouses were once kept by families who lived at the foot of the tower. Every evening the keeper "
    "climbed the spiral stairs, trimmed the wick and polished the great lens, and every few hours through "
    "the night he wound the clockwork that turned the light. In fog he rang a bell or fired a small cannon. "
    "The work was lonely and the pay was poor, but the keepers kept careful logbooks, and those books now tell")

# ~700 tokens: longer than the 512-token window, so the local layers' mask decides the later positions.
LONG_PROSE = (
    "The river rises in a bog high in the hills, where the ground is so wet that a walker sinks to the ankle "
    "at every step. For the first few miles it is hardly more than a ditch, brown with peat, and sheep drink "
    "from it without looking up. Then it gathers the water of a dozen small streams, each with a name that "
    "only the farmers remember, and by the time it reaches the first village it is wide enough to need a bridge. "
    "The bridge there is old: three arches of grey stone, built, the villagers say, by monks who wanted to reach "
    "the market on the other side without wetting their habits. Below the village the valley opens out. The river "
    "slows, loops back on itself, and leaves crescent-shaped lakes where it has changed its mind about its course. "
    "Herons stand in the shallows, and in summer the meadows are full of yellow flowers and the sound of bees. "
    "A mill once stood at the bend below the church. Its wheel turned two pairs of stones, and the miller took one "
    "sack in every ten as his fee. The mill closed when the railway came and flour arrived from the cities in "
    "paper bags, but the weir that fed it is still there, and children swim in the deep pool beneath it on hot "
    "afternoons. Further down, the river meets the canal. For a century the two ran side by side, the canal "
    "carrying coal and timber on slow boats pulled by horses, the river carrying nothing but its own water and the "
    "occasional fisherman in a flat-bottomed punt. The towpath is now a cycle route, and the lock keepers' cottages "
    "have become tea rooms that sell cake to walkers. At the market town the river is crossed by five bridges, one "
    "for each century since the town was founded. The oldest is narrow and steep, made for carts; the newest is a "
    "flat ribbon of concrete that carries the bypass. Between them the water is lined with warehouses that were "
    "built to store wool, then grain, then furniture, and are now flats with balconies overlooking the water. "
    "Below the town the river becomes tidal. Twice a day the sea pushes up the channel and the current runs "
    "backwards, carrying mud and the smell of salt far inland. The banks are soft and grey, and wading birds walk "
    "across them at low tide, probing for worms with long curved bills. Sailing boats lean on their keels in the "
    "mud, waiting for the water to return and lift them. Here the river is wide and slow and brown, and it is hard "
    "to believe that it began as a trickle in a bog. The estuary is a place of mist and distance. On a clear day "
    "you can see the lighthouse on the point and the low line of the far shore; on a grey one the water and the "
    "sky are the same colour, and the only way to tell where one ends is to watch for the dark shapes of the "
    "channel markers. Ships come in on the tide, guided by pilots who know every sandbank, and leave again on the "
    "ebb. The pilots say the river has a temper: it is gentle for months and then, after a week of rain in the "
    "hills, it comes down brown and fast and carries whole trees out to sea. The people who live along it have "
    "learned to read its moods, to move their boats before a flood and to keep their doors shut when the wind "
    "is from the east. They tell their children stories about the river, and the children grow up to tell the "
    "same stories to their own children, so that the river is both a place and a memory. When asked what the "
    "river means to them, the older people in the villages usually say")

# (name, text, parse control tokens, generate+teacher-force). Tokenization-only entries have False.
CHAT_USER = {"chat_sky": "Explain in two sentences why the sky is blue.",
             "chat_list": "List three facts about octopuses."}
GEMMA_PROMPTS: list[tuple[str, str, bool, bool]] = [
    ("france", "The capital of France is", False, True),
    ("chat_sky", gemma_chat(CHAT_USER["chat_sky"]), True, True),
    ("chat_list", gemma_chat(CHAT_USER["chat_list"]), True, True),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False, True),
    ("short_prose", SHORT_PROSE, False, True),
    ("long_prose", LONG_PROSE, False, True),
    ("tok_unicode", "Caf\u00e9 au lait, na\u00efve r\u00e9sum\u00e9, \u6771\u4eac, \u00fcber \u2014 \U0001F600!", False, False),
    ("tok_numbers", "In 1969, 3 astronauts travelled 384,400 km; pi = 3.14159.", False, False),
    ("tok_spaces", "  two  spaces,\ttab\nnew line\n\n\nand   three", False, False),
    ("tok_control_as_text", "<start_of_turn>user\nhello<end_of_turn>", False, False),
    ("tok_chat_system", "<start_of_turn>user\nYou are terse.\n\nHi there!<end_of_turn>\n<start_of_turn>model\n",
     True, False),
]


def make_f32_gguf(src: Path, dst: Path) -> None:
    """src dequantized to F32 by llama.cpp's own quantize code (every tensor, the embedding included)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = N_THREADS
    params.ftype = 0            # LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.token_embedding_type = 0
    params.output_tensor_type = 0
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise SystemExit("llama_model_quantize failed")


def verify_f32_gguf(src: Path, dst: Path) -> dict:
    """The F32 file holds exactly gguf-py's dequantization of the source (what export.py decodes)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    a, b = GGUFReader(str(src)), GGUFReader(str(dst))
    tb = {t.name: t for t in b.tensors}
    n_diff, n_total, max_diff = 0, 0, 0.0
    for t in a.tensors:
        want = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        got = np.asarray(tb[t.name].data, dtype=np.float32).reshape(-1)
        d = np.abs(got - want)
        n_diff, n_total, max_diff = n_diff + int(np.count_nonzero(d)), n_total + d.size, max(max_diff, float(d.max()))
    if n_diff:
        raise SystemExit(f"F32 GGUF differs from gguf-py's dequantization in {n_diff} values (max {max_diff})")
    return {"tensors": len(a.tensors), "types_in_source": sorted({t.tensor_type.name for t in a.tensors}),
            "n_values": n_total, "n_values_differing": n_diff}


def gemma_goldens(scratch: Path, out: Path) -> None:
    f32 = scratch / "gemma3-270m.F32.gguf"
    if not f32.exists():
        make_f32_gguf(GEMMA_GGUF, f32)
    conversion = verify_f32_gguf(GEMMA_GGUF, f32)
    print("F32 conversion:", conversion, flush=True)
    llm, llm_one = open_llama(f32, GEMMA_CTX, GEMMA_CTX), open_llama(f32, GEMMA_CTX, 1)
    cfg, weights = rf.load_gguf(GEMMA_GGUF)
    entries, one, ref = [], [], []
    window_effect = None
    for name, text, special, run_it in GEMMA_PROMPTS:
        t0 = time.time()
        ids = llm.tokenize(text.encode(), add_bos=True, special=special)
        entry = {"name": name, "text": text, "special": special, "prompt_ids": ids}
        if name in CHAT_USER:
            entry["chat_user"] = CHAT_USER[name]     # the same prompt as `./run -c -i USER` builds it
        if not run_it:
            entries.append(entry)
            continue
        cont, eog = greedy(llm, ids, GEMMA_CONTINUE)
        seq = ids + cont
        tf = teacher_forced(llm, seq)
        n_p = len(ids)
        entry.update({
            "continuation_ids": cont, "stopped_at_eog": eog,
            "continuation_text": b"".join(piece(llm, t) for t in cont).decode("utf-8", "replace"),
            "continuation_pieces_hex": [piece(llm, t).hex() for t in cont],
            "greedy_vs_teacher_forced_top1_mismatch_positions":
                [n_p - 1 + i for i, t in enumerate(cont) if int(np.argmax(tf[n_p - 1 + i])) != t],
            **top_summary(tf)})
        one.append(at_golden_ids(entry, teacher_forced(llm_one, seq)))
        r = rf.forward(cfg, weights, seq)
        ref.append(at_golden_ids(entry, r))
        if len(seq) > GEMMA_WINDOW:
            # The same sequence without the sliding window: at the golden's top-10 ids, positions >= window.
            nw = rf.forward(cfg, weights, seq, full_attention=True)
            tail = slice(GEMMA_WINDOW, len(seq))
            ids10 = np.asarray(entry["top10_ids"])[tail]
            entry["no_window_from"] = GEMMA_WINDOW
            entry["no_window_top10_logits"] = [[round(float(v), 4) for v in row]
                                               for row in np.take_along_axis(nw[tail], ids10, axis=1)]
            entry["no_window_top1"] = nw[tail].argmax(axis=1).tolist()
            d = np.abs(nw[tail] - r[tail])
            window_effect = {"positions": f"{GEMMA_WINDOW}..{len(seq) - 1}", "max_abs_logit_change": float(d.max()),
                             "mean_abs_logit_change": float(d.mean()),
                             "top1_changes": int(np.count_nonzero(nw[tail].argmax(axis=1) != r[tail].argmax(axis=1)))}
            del nw
        del r
        entries.append(entry)
        print(f"[gemma] {name}: {n_p} prompt + {len(cont)} generated (eog={eog}) {time.time() - t0:.0f}s :: "
              f"{entry['continuation_text'][:70]!r}", flush=True)
    run_entries = [e for e in entries if "top1" in e]
    noise = {"llamacpp_one_token_per_decode": noise_stats(run_entries, one),
             "float64_reference_same_weights": noise_stats(run_entries, ref)}
    margins = np.concatenate([np.asarray(e["margin"]) for e in run_entries])
    noise["margin_quantiles"] = {str(q): float(np.quantile(margins, q)) for q in (0.01, 0.05, 0.1, 0.5)}
    noise["positions"] = int(margins.size)
    llm.close()
    llm_one.close()
    meta = {"source_gguf": GEMMA_GGUF.name, "source_gguf_sha256": sha256_file(GEMMA_GGUF),
            "oracle_model": "F32 GGUF from llama_model_quantize(ftype=ALL_F32, allow_requantize=True) of the source",
            "f32_conversion": conversion, "settings": settings(GEMMA_CTX), "add_bos": True,
            "n_continue": GEMMA_CONTINUE, "top_k": TOP_K, "window": GEMMA_WINDOW, "measured_noise": noise,
            "float64_reference_without_sliding_window": window_effect,
            "generated_by": "tests/oracle/make_family_goldens.py", "date": time.strftime("%Y-%m-%d")}
    write_json(out / "gemma3_270m_f32.json", meta, entries)
    print("[gemma] noise", json.dumps(noise), "\n[gemma] without the window", json.dumps(window_effect), flush=True)


def main() -> None:
    global N_THREADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/oracle-family-scratch"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    ap.add_argument("--only", choices=("tiny", "gemma"))
    ap.add_argument("--threads", type=int, default=N_THREADS)
    args = ap.parse_args()
    N_THREADS = args.threads
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(N_THREADS))
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "tiny"):
        for name in TINY:
            tiny_goldens(name, args.scratch, args.out)
    if args.only in (None, "gemma"):
        gemma_goldens(args.scratch, args.out)


if __name__ == "__main__":
    main()
