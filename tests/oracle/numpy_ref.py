#!/usr/bin/env python3
"""Float64 numpy forward pass of a llama-architecture GGUF (SmolLM2), used only to
measure how far two float32 implementations (llama.cpp and our engine) can be from
exact arithmetic. It is a measuring stick for choosing test tolerances, not an oracle:
the checked-in goldens come from llama.cpp.

Weights are the GGUF's own values decoded with the `gguf` package (Q4_1/Q8_0 blocks ->
float), widened to float64. Q/K rows are in llama.cpp's converter order, so RoPE here
rotates adjacent pairs (FACTS.md 4.1 NORMAL, 4.3).

    python3 tests/oracle/numpy_ref.py models/SmolLM2-135M-Instruct.Q4_1.gguf --ids "504 3575 282 4649 314"
"""
from __future__ import annotations

import argparse

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def load_weights(path: str) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every tensor as float64 with numpy shape (rows, cols), plus the hyperparameters used."""
    reader = GGUFReader(path)
    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    hp = {
        "n_layers": reader.fields[f"{arch}.block_count"].contents(),
        "n_heads": reader.fields[f"{arch}.attention.head_count"].contents(),
        "n_kv_heads": reader.fields[f"{arch}.attention.head_count_kv"].contents(),
        "rope_theta": reader.fields[f"{arch}.rope.freq_base"].contents(),
        "eps": reader.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents(),
    }
    return weights, hp


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_adjacent(x: np.ndarray, theta: float) -> np.ndarray:
    """x: (n_tokens, n_heads, head_dim); rotate pairs (2i, 2i+1) by pos * theta^(-2i/head_dim)."""
    n, _, hd = x.shape
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def forward(weights: dict[str, np.ndarray], hp: dict[str, float], ids: list[int]) -> np.ndarray:
    """Causal forward over the whole sequence; returns logits (n_tokens, vocab) in float64."""
    n_heads, n_kv = int(hp["n_heads"]), int(hp["n_kv_heads"])
    eps, theta = float(hp["eps"]), float(hp["rope_theta"])
    emb = weights["token_embd.weight"]
    x = emb[np.asarray(ids)]
    n, dim = x.shape
    hd = dim // n_heads
    group = n_heads // n_kv
    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for layer in range(int(hp["n_layers"])):
        w = lambda name: weights[f"blk.{layer}.{name}.weight"]  # noqa: E731
        h = rms_norm(x, w("attn_norm"), eps)
        q = rope_adjacent((h @ w("attn_q").T).reshape(n, n_heads, hd), theta)
        k = rope_adjacent((h @ w("attn_k").T).reshape(n, n_kv, hd), theta)
        v = (h @ w("attn_v").T).reshape(n, n_kv, hd)
        att = np.empty((n, n_heads, hd))
        for head in range(n_heads):
            kv = head // group
            s = q[:, head, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            att[:, head, :] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, kv, :]
        x = x + att.reshape(n, dim) @ w("attn_output").T
        m = rms_norm(x, w("ffn_norm"), eps)
        gate, up = m @ w("ffn_gate").T, m @ w("ffn_up").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w("ffn_down").T
    out = weights.get("output.weight", emb)
    return rms_norm(x, weights["output_norm.weight"], eps) @ out.T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--ids", required=True, help="space-separated token ids")
    args = ap.parse_args()
    weights, hp = load_weights(args.gguf)
    logits = forward(weights, hp, [int(t) for t in args.ids.split()])
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[:5]
        print(pos, " ".join(f"{t}:{row[t]:.4f}" for t in top))


if __name__ == "__main__":
    main()
