#!/usr/bin/env python3
"""Reference forward pass of the llama architecture in float64 numpy, written from the model definition.

It shares no code with run.c or export.py. Weights are addressed by their Hugging Face
names; the loaders below read them from a Hugging Face directory (config.json +
safetensors) or from a llama-architecture GGUF file. Returns the logits of every position:

    x      = embed[token]
    per layer:
      n    = rmsnorm(x) * attn_norm
      q, k, v = Wq n, Wk n, Wv n            split into heads of head_dim
      q, k = rope(q), rope(k)               half-split pairs (x[i], x[i + hd/2]), angle pos * theta^(-2i/hd)
      a    = softmax(q k^T / sqrt(hd) + causal mask) v     query head h reads kv head h // (n_heads / n_kv_heads)
      x    = x + Wo a
      m    = rmsnorm(x) * ffn_norm
      x    = x + Wdown (silu(Wgate m) * Wup m)
    logits = (rmsnorm(x) * final_norm) . Whead^T    Whead = embed when tied
    rmsnorm(v) = v / sqrt(mean(v^2) + eps)

Sources a reader can open:
  * Hugging Face transformers, src/transformers/models/llama/modeling_llama.py: LlamaRMSNorm,
    rotate_half / apply_rotary_pos_emb (the half-split RoPE), repeat_kv + eager_attention_forward
    (grouped-query attention), LlamaMLP (SwiGLU), and LlamaConfig's defaults (configuration_llama.py).
  * llama.cpp, convert_hf_to_gguf.py: LlamaModel.permute reorders the Q and K rows of every head
    so that llama.cpp's adjacent-pair RoPE ("NORMAL" mode) gives the same result; GGUF Q/K rows
    are therefore run with adjacent_pairs=True. Tensor names: gguf-py/gguf/tensor_mapping.py.
  * README.md, "The model file": the engine stores Q/K rows in Hugging Face order (half-split).

Two uses: the synthetic-model and perplexity tests (tests/test_synthetic.py, tests/test_quant.py)
compare the engine with it, and tests/oracle/make_goldens.py uses it as a float64 measuring
stick for the test tolerances (how far two float32 implementations may be from exact arithmetic).

    python3 tests/ref_forward.py HF_DIR --ids "1 2 3" [--out logits.f32]
    python3 tests/ref_forward.py models/SmolLM2-135M-Instruct.Q4_1.gguf --ids "504 3575 282 4649 314"

Reading a GGUF needs the `gguf` package (quantized blocks are decoded by gguf.quants.dequantize).
"""
from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path

import numpy as np


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope_tables(n_pos: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of shape [n_pos, head_dim/2]: angle(pos, i) = pos * theta^(-2i/head_dim)."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    angles = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, adjacent_pairs: bool = False) -> np.ndarray:
    """x: [n_pos, n_heads, head_dim]; rotates the pairs (x[i], x[i + hd/2]) of every head (HF rotate_half).

    adjacent_pairs rotates (x[2i], x[2i+1]) instead: llama.cpp's NORMAL mode, only
    used to check that GGUF-permuted Q/K weights + NORMAL RoPE equal HF weights + half-split.
    """
    c, s = cos[:, None, :], sin[:, None, :]
    if adjacent_pairs:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x1 * s + x2 * c
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def config_values(cfg: dict) -> dict:
    """The hyper-parameters the forward pass needs, with LlamaConfig's defaults; refuses what it does not model."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']} not modelled")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("biases not modelled")
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling {rope_scaling} not modelled")
    theta = cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    n_heads = cfg["num_attention_heads"]
    return {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        "eps": cfg.get("rms_norm_eps", 1e-6),
        "theta": float(theta),
        "tied": cfg.get("tie_word_embeddings", False),
    }


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
    """Causal GQA attention. q: [T, n_heads, hd]; k, v: [T, n_kv_heads, hd]; returns [T, n_heads * hd]."""
    n_pos, _, hd = q.shape
    group = n_heads // n_kv_heads
    future = np.triu(np.ones((n_pos, n_pos), dtype=bool), k=1)
    out = np.empty_like(q)
    for h in range(n_heads):
        kv = h // group
        scores = q[:, h, :] @ k[:, kv, :].T / np.sqrt(hd)
        scores[future] = -np.inf
        scores -= scores.max(axis=1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ v[:, kv, :]
    return out.reshape(n_pos, n_heads * hd)


def forward(cfg: dict, weights: dict[str, np.ndarray], tokens: list[int], adjacent_pairs: bool = False) -> np.ndarray:
    """Logits [len(tokens), vocab] (float64) for the token sequence starting at position 0.

    adjacent_pairs: see apply_rope (for GGUF-order Q/K weights only).
    """
    c = config_values(cfg)
    w = {name: np.asarray(t, dtype=np.float64) for name, t in weights.items()}
    n_pos, hd, nh, nkv = len(tokens), c["head_dim"], c["n_heads"], c["n_kv_heads"]
    if nh % nkv:
        raise ValueError("n_heads must be a multiple of n_kv_heads")
    cos, sin = rope_tables(n_pos, hd, c["theta"])

    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    for layer in range(c["n_layers"]):
        p = f"model.layers.{layer}."
        n = rmsnorm(x, w[p + "input_layernorm.weight"], c["eps"])
        q = (n @ w[p + "self_attn.q_proj.weight"].T).reshape(n_pos, nh, hd)
        k = (n @ w[p + "self_attn.k_proj.weight"].T).reshape(n_pos, nkv, hd)
        v = (n @ w[p + "self_attn.v_proj.weight"].T).reshape(n_pos, nkv, hd)
        q, k = apply_rope(q, cos, sin, adjacent_pairs), apply_rope(k, cos, sin, adjacent_pairs)
        x = x + attention(q, k, v, nh, nkv) @ w[p + "self_attn.o_proj.weight"].T
        m = rmsnorm(x, w[p + "post_attention_layernorm.weight"], c["eps"])
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        up = m @ w[p + "mlp.up_proj.weight"].T
        x = x + (silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, w["model.norm.weight"], c["eps"])
    head = w["model.embed_tokens.weight"] if c["tied"] or "lm_head.weight" not in w else w["lm_head.weight"]
    return x @ head.T


# ----------------------------------------------------------------------------------------------------------------
# Loaders. A minimal safetensors reader (its own code, so the reference does not depend on the exporter's)
# and a GGUF reader on top of the `gguf` package.

def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float32 arrays (F32, F16, BF16 supported)."""
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[base + begin:base + end]
        if info["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif info["dtype"] == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{name}: dtype {info['dtype']} not supported")
        out[name] = arr.reshape(info["shape"]).astype(np.float32)
    return out


def load_hf(model_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, {weight name: float32 array}) of a HF directory, single file or sharded."""
    cfg = json.loads((model_dir / "config.json").read_text())
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    weights: dict[str, np.ndarray] = {}
    for f in files:
        weights.update(read_safetensors(model_dir / f))
    return cfg, weights


# GGUF names of the Hugging Face llama tensors (llama.cpp gguf-py/gguf/tensor_mapping.py).
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}
GGUF_LAYER_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def hf_to_gguf_name(name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight' (KeyError for names llama has not)."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if not m:
        raise KeyError(name)
    return f"blk.{m.group(1)}.{GGUF_LAYER_PARTS[m.group(2)]}.weight"


def gguf_to_hf_name(name: str) -> str:
    """The inverse of hf_to_gguf_name."""
    hf_global = {g: h for h, g in GGUF_GLOBAL_NAMES.items()}
    if name in hf_global:
        return hf_global[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)\.weight", name)
    hf_part = {g: h for h, g in GGUF_LAYER_PARTS.items()}
    if not m or m.group(2) not in hf_part:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{hf_part[m.group(2)]}.weight"


def load_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(HF-style config dict, {HF weight name: float64 array}) of a llama-architecture GGUF.

    Quantized tensors are decoded to the values the file stores. Q and K rows stay in the
    converter's permuted order: run forward(..., adjacent_pairs=True) on these weights.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch} not modelled")

    def field(key: str, default: float | None = None) -> float:
        f = reader.fields.get(f"{arch}.{key}")
        if f is None and default is None:
            raise ValueError(f"{path}: no {arch}.{key}")
        return default if f is None else f.contents()

    weights = {gguf_to_hf_name(t.name): dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
    cfg = {
        "hidden_size": field("embedding_length"),
        "num_hidden_layers": field("block_count"),
        "num_attention_heads": field("attention.head_count"),
        "num_key_value_heads": field("attention.head_count_kv"),
        "head_dim": field("attention.key_length", field("embedding_length") // field("attention.head_count")),
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon"),
        "rope_theta": field("rope.freq_base", 10000.0),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    return cfg, weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="Hugging Face directory (config.json + safetensors) or a .gguf file")
    ap.add_argument("--ids", required=True, help="space-separated token ids")
    ap.add_argument("--out", type=Path, help="write float32 logits [n_tokens, vocab] here (like run --dump-logits)")
    args = ap.parse_args()
    is_gguf = args.model.is_file()
    cfg, weights = load_gguf(args.model) if is_gguf else load_hf(args.model)
    logits = forward(cfg, weights, [int(t) for t in args.ids.split()], adjacent_pairs=is_gguf)
    if args.out:
        logits.astype("<f4").tofile(args.out)
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[:5]
        print(pos, " ".join(f"{t}:{row[t]:.4f}" for t in top))


if __name__ == "__main__":
    main()
