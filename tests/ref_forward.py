#!/usr/bin/env python3
"""Reference forward pass of the llama, qwen2, qwen3 and gemma3 architectures in float64 numpy,
written from the model definitions.

It shares no code with run.c or export.py. Weights are addressed by their Hugging Face
names; the loaders below read them from a Hugging Face directory (config.json +
safetensors) or from a GGUF file. Returns the logits of every position:

    x      = embed[token] * embed_scale             embed_scale: sqrt(dim) for Gemma 3, else 1
    per layer:
      n    = norm(x, attn_norm)
      q, k, v = Wq n + bq, Wk n + bk, Wv n + bv     split into heads of head_dim; biases: Qwen 2 only
      q, k = norm(q, q_norm), norm(k, k_norm)       per head, over head_dim: Qwen 3, Gemma 3
      q, k = rope(q), rope(k)                       half-split pairs (x[i], x[i + hd/2]), angle pos * freq_i
      a    = softmax(q k^T * scale + mask) v        query head h reads kv head h // (n_heads / n_kv_heads)
      o    = Wo a;            Gemma 3: o = norm(o, post_attention_norm)
      x    = x + o
      m    = norm(x, ffn_norm)
      f    = Wdown (act(Wgate m) * Wup m)           act: SiLU, Gemma 3: tanh-approximated GELU
      Gemma 3: f = norm(f, post_ffn_norm)
      x    = x + f
    logits = norm(x, final_norm) . Whead^T          Whead = embed when tied
    norm(v, w) = v / sqrt(mean(v^2) + eps) * w      Gemma 3 (Hugging Face weights): * (1 + w)

    freq_i = theta^(-2i/hd) / divisor_i             divisor: 1, or Llama 3's frequency factors
    scale  = 1/sqrt(head_dim); Gemma 3: query_pre_attn_scalar^-0.5
    mask   = causal; on a sliding-window layer also query_pos - key_pos >= window is hidden
    Gemma 3: a layer is global ("full_attention") when (layer + 1) % pattern == 0, else local
             (sliding); local layers use rope_local_base_freq (10000) without scaling, global
             layers rope_theta with the config's linear scaling (positions / factor).

Sources a reader can open:
  * Hugging Face transformers, src/transformers/models/llama/modeling_llama.py: LlamaRMSNorm,
    rotate_half / apply_rotary_pos_emb (the half-split RoPE), repeat_kv + eager_attention_forward
    (grouped-query attention), LlamaMLP (SwiGLU), and LlamaConfig's defaults (configuration_llama.py).
    modeling_rope_utils.py: _compute_linear_scaling_rope_parameters, _compute_llama3_parameters.
  * models/qwen2/modeling_qwen2.py (q/k/v_proj with bias=True, o_proj without), models/qwen3/
    modeling_qwen3.py (q_norm / k_norm on head_dim before RoPE, head_dim from the config).
  * models/gemma3/modeling_gemma3.py: Gemma3RMSNorm (x_hat * (1 + w)), Gemma3TextScaledWordEmbedding
    (embed * hidden_size**0.5), Gemma3MLP (gelu_pytorch_tanh), Gemma3DecoderLayer (pre and post
    norms around attention and MLP), Gemma3Attention (q_norm/k_norm, scaling = query_pre_attn_scalar**-0.5,
    sliding window), the local rotary embedding (rope_local_base_freq, "default" rope).
  * llama.cpp, convert_hf_to_gguf.py: LlamaModel.permute reorders the Q and K rows of every head
    of llama-architecture GGUFs so that llama.cpp's adjacent-pair RoPE ("NORMAL" mode) gives the same
    result; such Q/K rows are run with adjacent_pairs=True. qwen2, qwen3 and gemma3 use NEOX RoPE
    and are not permuted. Gemma3Model.modify_tensors adds 1 to every norm weight (undone by
    load_gguf below); LlamaModel.generate_extra_tensors writes Llama 3's frequency factors as the
    `rope_freqs` tensor. src/llama-model.cpp (LLM_ARCH_GEMMA3): sliding-window pattern 6, local RoPE
    base 10000 without scaling, attention scale 1/sqrt(head_dim) except 1/sqrt(dim/n_heads) for the
    62-layer 27B. Tensor names: gguf-py/gguf/tensor_mapping.py.
  * export.py's manual, "The model file": the engine stores Q/K rows in Hugging Face order (half-split).

Two uses: the synthetic-model, family and perplexity tests (tests/test_synthetic.py,
tests/test_family_oracles.py, tests/test_quant.py) compare the engine with it, and
tests/oracle/make_goldens.py / make_family_goldens.py use it as a float64 measuring stick for the
test tolerances (how far two float32 implementations may be from exact arithmetic).

    python3 tests/ref_forward.py HF_DIR --ids "1 2 3" [--out logits.f32]
    python3 tests/ref_forward.py models/SmolLM2-135M-Instruct.Q4_1.gguf --ids "504 3575 282 4649 314"
    python3 tests/ref_forward.py models/gemma3-270m-q4_k_m.gguf --ids "2 818 5279 529 7001 563"

Reading a GGUF needs the `gguf` package (quantized blocks are decoded by gguf.quants.dequantize).
The logits are float64; forward(..., dtype=np.float32) computes in float32 (for tests whose tolerance is far
above float32 rounding: about half the time, and half the memory with load_gguf(..., dtype=np.float32)).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import struct
from pathlib import Path

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (PyTorch's gelu(approximate="tanh"), HF "gelu_pytorch_tanh")."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def rope_tables(n_pos: int, head_dim: int, theta: float, divisors: tuple[float, ...] | None = None,
                linear: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of shape [n_pos, head_dim/2]: angle(pos, i) = pos * theta^(-2i/head_dim).

    divisors: pair i's frequency is divided by divisors[i] (Llama 3 frequency factors);
    linear: positions are divided by it (linear RoPE scaling).
    """
    i = np.arange(head_dim // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    if divisors is not None:
        inv_freq = inv_freq / np.asarray(divisors, dtype=np.float64)
    if linear != 1.0:
        inv_freq = inv_freq / linear
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


# ----------------------------------------------------------------------------------------------------------------
# Hyper-parameters from a Hugging Face config (the GGUF loader builds the same dict from GGUF metadata)

def model_family(cfg: dict) -> str:
    """'llama', 'qwen2', 'qwen3' or 'gemma3' from config.json's model_type (absent: llama)."""
    kind = cfg.get("model_type", "llama")
    family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}.get(kind)
    if family is None:
        raise ValueError(f"model_type {kind} not modelled (a multimodal 'gemma3' config: use its text model)")
    return family


def rope_params(cfg: dict) -> dict:
    """{'theta', 'rope_type', and the type's fields} of the global layers, from rope_theta + rope_scaling
    (transformers <= 4.x) or rope_parameters (flat, or per layer type as in newer Gemma 3 configs)."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:
        rp = rp["full_attention"]
    scaling = dict(rp) if isinstance(rp, dict) else dict(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", scaling.get("rope_theta", 10000.0))
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["theta"] = float(theta)
    return scaling


def llama3_divisors(scaling: dict, theta: float, head_dim: int) -> tuple[float, ...]:
    """Per-pair frequency divisors of rope_type "llama3" (transformers' _compute_llama3_parameters;
    the same numbers llama.cpp's converter writes as the rope_freqs tensor): long wavelengths are
    divided by `factor`, short ones kept, the band between interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(head_dim // 2):
        wavelen = 2.0 * math.pi / theta ** (-2.0 * i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return tuple(out)


def sliding_layers(cfg: dict, n_layers: int) -> tuple[bool, ...]:
    """Gemma 3: which layers use the sliding window. config.layer_types when present, else
    sliding_window_pattern (default 6): layer l is global when (l + 1) % pattern == 0."""
    types = cfg.get("layer_types")
    if types:
        if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types {types} not modelled")
        return tuple(t == "sliding_attention" for t in types)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    return tuple(bool(pattern) and (layer + 1) % pattern != 0 for layer in range(n_layers))


def config_values(cfg: dict) -> dict:
    """The hyper-parameters the forward pass needs, with the transformers config defaults of the
    family; refuses what it does not model.

    Keys beyond a Hugging Face config that the GGUF loader may set: "rope_freq_factors" (the
    rope_freqs tensor of a Llama 3 GGUF, per-pair divisors).
    """
    family = model_family(cfg)
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = rope_params(cfg)
    gemma = family == "gemma3"
    act = cfg.get("hidden_activation", cfg.get("hidden_act")) if gemma else cfg.get("hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"hidden_act {act} not modelled for {family}")
    if cfg.get("mlp_bias") or (family != "qwen2" and cfg.get("attention_bias")):
        raise ValueError("biases not modelled")
    if cfg.get("use_sliding_window"):
        raise ValueError("Qwen sliding window not modelled")
    if gemma and (cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping")):
        raise ValueError("logit soft-capping not modelled")

    divisors, linear = None, 1.0
    if cfg.get("rope_freq_factors") is not None:
        divisors = tuple(float(f) for f in cfg["rope_freq_factors"])
    if rope["rope_type"] == "llama3" and family == "llama":
        divisors = divisors or llama3_divisors(rope, rope["theta"], head_dim)
    elif rope["rope_type"] == "linear":
        linear = float(rope["factor"])
    elif rope["rope_type"] != "default":
        raise ValueError(f"rope scaling {rope} not modelled")

    n_layers = cfg["num_hidden_layers"]
    out = {
        "family": family,
        "dim": cfg["hidden_size"],
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
        "head_dim": head_dim,
        "eps": cfg.get("rms_norm_eps", 1e-6),
        "theta": rope["theta"],
        "tied": cfg.get("tie_word_embeddings", gemma),
        "rope_divisors": divisors,      # None: plain RoPE
        "rope_linear": linear,          # global layers' positions are divided by it
        "qkv_bias": family == "qwen2",
        "qk_norm": family in ("qwen3", "gemma3"),
        "post_norms": gemma,
        "norm_plus_one": gemma,         # Hugging Face Gemma norms compute x_hat * (1 + w)
        "gelu": gemma,
        "embed_scale": math.sqrt(cfg["hidden_size"]) if gemma else 1.0,
        # q.k is divided by this (kept as a divisor: llama's scores stay bit-identical to q.k / sqrt(hd))
        "score_divisor": math.sqrt(cfg.get("query_pre_attn_scalar", head_dim)) if gemma else math.sqrt(head_dim),
        "window": 0,
        "sliding": (False,) * n_layers,
        "theta_local": rope["theta"],
    }
    if gemma and cfg.get("sliding_window"):
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        out["window"] = int(cfg["sliding_window"])
        out["sliding"] = sliding_layers(cfg, n_layers)
        out["theta_local"] = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# The forward pass

def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, n_kv_heads: int,
              divisor: float | None = None, window: int = 0) -> np.ndarray:
    """Causal GQA attention. q: [T, n_heads, hd]; k, v: [T, n_kv_heads, hd]; returns [T, n_heads * hd].

    Scores are q.k / divisor (default sqrt(hd)); window > 0 also hides keys with
    query_pos - key_pos >= window (a sliding-window layer).
    """
    n_pos, _, hd = q.shape
    group = n_heads // n_kv_heads
    hidden = np.triu(np.ones((n_pos, n_pos), dtype=bool), k=1)
    if window > 0:
        hidden |= np.tril(np.ones((n_pos, n_pos), dtype=bool), k=-window)
    divisor = math.sqrt(hd) if divisor is None else divisor
    out = np.empty_like(q)
    for h in range(n_heads):
        kv = h // group
        scores = q[:, h, :] @ k[:, kv, :].T / divisor
        scores[hidden] = -np.inf
        scores -= scores.max(axis=1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ v[:, kv, :]
    return out.reshape(n_pos, n_heads * hd)


def forward(cfg: dict, weights: dict[str, np.ndarray], tokens: list[int], adjacent_pairs: bool = False,
            full_attention: bool = False, positions: list[int] | None = None, dtype: type = np.float64) -> np.ndarray:
    """Logits [len(tokens), vocab] (float64) for the token sequence starting at position 0.

    adjacent_pairs: see apply_rope (for llama GGUF-order Q/K weights only).
    full_attention: ignore the sliding window (every layer sees every earlier key) - a wrong
    model, used to show that a test's prompt depends on the window.
    positions: return only these rows (the output head over a large vocabulary is the costly part).
    dtype: the arithmetic; np.float32 (half the work) only where a test's tolerance is far above its rounding.
    """
    c = config_values(cfg)
    w = {name: np.asarray(t, dtype=dtype) for name, t in weights.items()}
    n_pos, hd, nh, nkv, eps = len(tokens), c["head_dim"], c["n_heads"], c["n_kv_heads"], c["eps"]
    if nh % nkv:
        raise ValueError("n_heads must be a multiple of n_kv_heads")

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        return rmsnorm(x, 1.0 + w[name] if c["norm_plus_one"] else w[name], eps)

    def project(x: np.ndarray, name: str, n_out_heads: int) -> np.ndarray:
        y = x @ w[name + ".weight"].T
        if c["qkv_bias"]:
            y = y + w[name + ".bias"]
        return y.reshape(n_pos, n_out_heads, hd)

    rope_global = [t.astype(dtype) for t in rope_tables(n_pos, hd, c["theta"], c["rope_divisors"], c["rope_linear"])]
    # Local (sliding) layers: their own base, no scaling (Gemma 3's rotary_emb_local).
    rope_local = ([t.astype(dtype) for t in rope_tables(n_pos, hd, c["theta_local"], c["rope_divisors"])]
                  if any(c["sliding"]) else None)

    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    if c["embed_scale"] != 1.0:
        x = x * c["embed_scale"]
    for layer in range(c["n_layers"]):
        p = f"model.layers.{layer}."
        local = c["sliding"][layer]
        n = norm(x, p + "input_layernorm.weight")
        q = project(n, p + "self_attn.q_proj", nh)
        k = project(n, p + "self_attn.k_proj", nkv)
        v = project(n, p + "self_attn.v_proj", nkv)
        if c["qk_norm"]:
            q, k = norm(q, p + "self_attn.q_norm.weight"), norm(k, p + "self_attn.k_norm.weight")
        cos, sin = rope_local if local else rope_global
        q, k = apply_rope(q, cos, sin, adjacent_pairs), apply_rope(k, cos, sin, adjacent_pairs)
        window = c["window"] if local and not full_attention else 0
        o = attention(q, k, v, nh, nkv, c["score_divisor"], window) @ w[p + "self_attn.o_proj.weight"].T
        if c["post_norms"]:
            o = norm(o, p + "post_attention_layernorm.weight")
            m = norm(x + o, p + "pre_feedforward_layernorm.weight")
        else:
            m = norm(x + o, p + "post_attention_layernorm.weight")
        x = x + o
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        up = m @ w[p + "mlp.up_proj.weight"].T
        f = ((gelu_tanh(gate) if c["gelu"] else silu(gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        if c["post_norms"]:
            f = norm(f, p + "post_feedforward_layernorm.weight")
        x = x + f
    x = norm(x if positions is None else x[np.asarray(positions)], "model.norm.weight")
    head = w["model.embed_tokens.weight"] if c["tied"] or "lm_head.weight" not in w else w["lm_head.weight"]
    return (x @ head.T).astype(np.float64, copy=False)


# ----------------------------------------------------------------------------------------------------------------
# Loaders. A minimal safetensors reader (its own code, so the reference does not depend on the exporter's)
# and a GGUF reader: tests/common.py's header parser, the `gguf` package's block decoders.

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


# GGUF names of the Hugging Face tensors (llama.cpp gguf-py/gguf/tensor_mapping.py). The one name that
# depends on the family: post_attention_layernorm is the FFN's pre-norm (ffn_norm) in llama/qwen, but
# Gemma's norm after attention (post_attention_norm); Gemma's FFN pre-norm is pre_feedforward_layernorm.
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}
GGUF_LAYER_PARTS = {"input_layernorm.weight": "attn_norm.weight",
                    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                    "self_attn.v_proj.bias": "attn_v.bias",
                    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                    "post_attention_layernorm.weight": "ffn_norm.weight",
                    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                    "mlp.down_proj.weight": "ffn_down.weight"}
GGUF_GEMMA_PARTS = {**GGUF_LAYER_PARTS, "post_attention_layernorm.weight": "post_attention_norm.weight",
                    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                    "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def layer_parts(arch: str) -> dict[str, str]:
    if arch not in FAMILIES:
        raise ValueError(f"architecture {arch} not modelled")
    return GGUF_GEMMA_PARTS if arch == "gemma3" else GGUF_LAYER_PARTS


def hf_to_gguf_name(name: str, arch: str = "llama") -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight' (KeyError for names `arch` has not)."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m:
        raise KeyError(name)
    return f"blk.{m.group(1)}.{layer_parts(arch)[m.group(2)]}"


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """The inverse of hf_to_gguf_name."""
    hf_global = {g: h for h, g in GGUF_GLOBAL_NAMES.items()}
    if name in hf_global:
        return hf_global[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    hf_part = {g: h for h, g in layer_parts(arch).items()}
    if not m or m.group(2) not in hf_part:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{hf_part[m.group(2)]}"


GEMMA3_27B_LAYERS = 62        # llama.cpp's LLM_TYPE_27B for gemma3: the attention-scale exception
GEMMA3_SWA_PATTERN = 6        # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp: rope_freq_base_train_swa for LLM_ARCH_GEMMA3


def gguf_is_permuted(cfg: dict) -> bool:
    """Whether a GGUF's Q/K rows are in llama.cpp's permuted order (llama only): pass as adjacent_pairs."""
    return cfg.get("model_type", "llama") == "llama"


def load_gguf(path: Path, dtype: type = np.float64) -> tuple[dict, dict[str, np.ndarray]]:
    """(HF-style config dict, {HF weight name: array of dtype}) of a llama, qwen2, qwen3 or gemma3 GGUF.

    Quantized tensors are decoded to the values the file stores. llama Q and K rows stay in the
    converter's permuted order: run forward(..., adjacent_pairs=gguf_is_permuted(cfg)). Gemma 3
    norm weights are returned minus 1 (the GGUF stores 1 + w; forward adds the 1 back, exactly
    in float64), so that the weights follow the Hugging Face convention.
    """
    from common import gguf_header
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    fields, tensors = gguf_header(path)   # not gguf.GGUFReader: it decodes every vocabulary string first
    arch = fields["general.architecture"]
    if arch not in FAMILIES:
        raise ValueError(f"{path}: architecture {arch} not modelled")

    def field(key: str, default: float | None = None) -> float:
        f = fields.get(f"{arch}.{key}")
        if f is None and default is None:
            raise ValueError(f"{path}: no {arch}.{key}")
        return default if f is None else f

    data = np.memmap(path, dtype=np.uint8, mode="r")
    weights, factors = {}, None
    for t in tensors:
        rows = data[t.offset:t.offset + t.nbytes].reshape(int(np.prod(t.dims[1:])), -1)   # dims: row length first
        values = dequantize(rows, GGMLQuantizationType(t.type)).reshape(t.dims[::-1])
        if t.name == "rope_freqs.weight":
            factors = [float(f) for f in values.reshape(-1)]
            continue
        name = gguf_to_hf_name(t.name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values.astype(np.float64) - 1.0
        weights[name] = values.astype(dtype)
    dim, n_heads = field("embedding_length"), field("attention.head_count")
    head_dim = field("attention.key_length", dim // n_heads)
    cfg = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "hidden_size": dim,
        "num_hidden_layers": field("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": field("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon"),
        "rope_theta": field("rope.freq_base", 10000.0),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    if factors is not None:
        cfg["rope_freq_factors"] = factors
    # llama.cpp (llama-model.cpp, load_hparams): scaling type "linear" unless the file says otherwise,
    # factor from rope.scaling.factor or the older rope.scale_linear; Gemma 3's local layers ignore it.
    scaling_type = fields.get(f"{arch}.rope.scaling.type", "linear")
    factor = field("rope.scaling.factor", field("rope.scale_linear", 0.0))
    if factor not in (0.0, 1.0) and scaling_type != "none":
        if scaling_type != "linear":
            raise ValueError(f"{path}: rope scaling {scaling_type} not modelled")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    if arch == "gemma3":
        big = cfg["num_hidden_layers"] == GEMMA3_27B_LAYERS
        cfg.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": dim // n_heads if big else head_dim,
            "sliding_window": field("attention.sliding_window", 0),
            "sliding_window_pattern": field("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN),
            "rope_local_base_freq": GEMMA3_LOCAL_THETA,
        })
    return cfg, weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="Hugging Face directory (config.json + safetensors) or a .gguf file")
    ap.add_argument("--ids", required=True, help="space-separated token ids")
    ap.add_argument("--out", type=Path, help="write float32 logits [n_tokens, vocab] here (like run --dump-logits)")
    args = ap.parse_args()
    is_gguf = args.model.is_file()
    cfg, weights = load_gguf(args.model) if is_gguf else load_hf(args.model)
    logits = forward(cfg, weights, [int(t) for t in args.ids.split()], adjacent_pairs=is_gguf and gguf_is_permuted(cfg))
    if args.out:
        logits.astype("<f4").tofile(args.out)
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[:5]
        print(pos, " ".join(f"{t}:{row[t]:.4f}" for t in top))


if __name__ == "__main__":
    main()
