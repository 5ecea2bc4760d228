#!/usr/bin/env python3
"""Convert a GGUF file or a Hugging Face model directory into our model file.

The output format is specified at the end of this text ("The model file": this
docstring is the format's manual; -h prints the part before it). Only the Python standard
library and numpy are used: GGUF and safetensors are parsed here, and every
ggml block type found in real model files is dequantized here.

Output types (--dtype):
  keep    every tensor keeps the source's type and its blocks are copied bit for
          bit (default for a GGUF input). Q2_K and Q3_K, which the engine does
          not run, are refused, naming the tensor; another --dtype converts
          them. Other ggml types (IQ*, TQ*, MXFP4, NVFP4, Q1_0, Q8_1, Q8_K, F64,
          I8..I64) are not supported with any --dtype: export.py cannot decode
          them.
  f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, q6_k, q4_k_m, q5_k_m
          llama.cpp's file types: tensor for tensor the types (and, from the
          same source values, the bytes) that llama-quantize gives for that
          type (src/llama-quant.cpp, llama_tensor_get_type, no importance
          matrix). f32 (default for a Hugging Face directory) and f16: every
          matrix in that type. The others: every matrix in that type, except
          the output head (or the token embedding when it is also the head):
          Q6_K (Q8_0 for q8_0, or when its rows are not whole blocks of the
          type); for q4_k_m (Q4_K) and q5_k_m (Q5_K), attn_v (wv) and ffn_down
          (w2) are Q6_K on the layers where use_more_bits holds (first and last
          eighth, every third between).
  q4_k, q5_k
          every matrix in that type: `llama-quantize --pure` Q4_K_M / Q5_K_M
          (llama-quantize's own name Q4_K means Q4_K_M).
A K type on a row length that is not a multiple of 256 falls back as in
llama.cpp: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; a row length that is not a
multiple of 32 makes a quantized type F16 (with a warning). Norm vectors are
always F32. Our file stores Q|K|V (wqkv) and gate|up (w13) fused, one type per
tensor; when the parts of one of them get different types (a GGUF's own under
keep; attn_v beside attn_q and attn_k under the _M mixes), the file is written
in the split form instead (header flag bit 5: wq, wk, wv and w1, w3 in every
layer), each part with its own type. When the parts also need different
activation formats in the engine (int8 per 32 for Q4_0 .. Q8_0, per 256 for the
K types, floats for F32/F16/BF16), which it cannot feed from one input, the
fused tensor instead takes the part type with the most bits per weight and the
other parts are re-quantized to it (with a warning). When the source tensor
already has the chosen type its blocks are copied bit for bit, never
dequantized and re-quantized. The quantizers are numpy ports of ggml's
reference ones (ggml-quants.c, quantize_row_*_ref).

--tokenizer-only writes a valid file holding the header and the tokenizer
section but no tensors (n_tensors = 0); it works for any architecture in the
family table (llama, qwen2, qwen3, gemma3), e.g. to test Gemma 3's tokenizer.

-v (--verbose) also prints the warnings that only say what llama.cpp's rules
did with a type the user did not ask for: the K-type fallback on rows that are
not a multiple of 256 (a q4_1 export's output head, Q6_K by llama.cpp's rule,
becomes Q8_0) is shown without -v only when --dtype names a K type (q4_k,
q5_k, q6_k, q4_k_m, q5_k_m).


The model file
==============

Version 2. One little-endian file, written by `export.py`, memory-mapped by
`run.c`, which computes from the mapping in place: nothing is copied or
converted at load. Every section starts on a 64-byte boundary, so every
tensor is SIMD-aligned in the mapping, and every weight matrix is stored in
the layout its kernels read ("Packed matrices" below). A version 1 file
(matrices stored as rows) is refused with a line that says to re-export it.

    [ header: 256 bytes ][ tokenizer section ][ tensor table ][ tensor data ... ]

The parts follow each other with nothing between them but zero padding: the
tokenizer section starts right after the header (offset 256), the tensor
table at the first 64-byte boundary after the tokenizer section's last byte,
and the tensors' data, in table order, each at the first 64-byte boundary
after the end of the table or of the previous tensor; the file ends with the
last tensor. The table lists exactly the tensors the header's shape implies
(see "Tensor table"), each once. `run` refuses a file that breaks one of
these rules or has a nonzero reserved or padding byte, so a damaged offset
or count is never read as weights: the header's reserved bytes, the padding
between the sections, between tensors and between the tokenizer's arrays,
the bytes after a tensor name's NUL, a flag bit (header or tokenizer) it
does not know, and a packed matrix's padding rows and the padding after its
last group's records. Every group of a packed matrix ends in padding when
its records do not fill whole cache lines (rows of an odd number of q4_0,
q5_0, q8_0 or q6_k blocks or of f16/bf16 elements); that padding is not
checked in the groups before the last: that would read a cache line in
every group, faulting in every page of the matrix at load, where loading is
otherwise mapping and nothing reads the weights before the first token; and
no kernel reads that padding. SmolLM2's and Gemma 3 270M's files have none;
Qwen2.5-Coder-1.5B's Q6_K `w2` (rows of 35 blocks) has 32 bytes per group.

Header (offset 0, 256 bytes; unused bytes are zero)
---------------------------------------------------

| offset | type | field | SmolLM2-135M |
|---|---|---|---|
| 0 | char[4] | magic `LLMF` | |
| 4 | u32 | version = 2 | |
| 8 | u32 | header size in bytes (256, the only size version 1 has) | |
| 12 | u32 | architecture: 1 llama, 2 qwen2, 3 qwen3, 4 gemma3 — informational (`-v`); behaviour comes from the flags and fields below | 1 |
| 16 | u32 | dim (hidden size) | 576 |
| 20 | u32 | hidden_dim (FFN inner size) | 1536 |
| 24 | u32 | n_layers | 30 |
| 28 | u32 | n_heads | 9 |
| 32 | u32 | n_kv_heads | 3 |
| 36 | u32 | head_dim | 64 |
| 40 | u32 | vocab_size (rows of the embedding) | 49152 |
| 44 | u32 | max_seq_len (training context) | 8192 |
| 48 | f32 | rope_theta | 100000 |
| 52 | f32 | norm_eps (RMSNorm) | 1e-5 |
| 56 | u32 | flags (see below); a bit this build does not know is refused with its name | 1 |
| 60 | u32 | activation of the FFN gate: 0 SiLU (SwiGLU), 1 tanh-approximated GELU (GeGLU) | 0 |
| 64 | u32 | rope_dim (dimensions rotated per head) | 64 |
| 68 | u32 | n_tensors | 182 |
| 72 | u64 | tokenizer section offset (256: right after the header) | |
| 80 | u64 | tokenizer section size (exact, up to the last blob byte) | |
| 88 | u64 | tensor table offset (the first 64-byte boundary after the tokenizer section) | |
| 96 | u64 | file size (the whole file; a truncated file is refused) | |
| 104 | f32 | embedding scale: each embedding row is multiplied by it before layer 0 (0 = 1) | 0 |
| 108 | f32 | attention scale: q·k is multiplied by it (0 = 1/sqrt(head_dim)) | 0 |
| 112 | u32 | sliding window: a query on a local layer sees keys with query_pos − key_pos < window (0 = no local layers) | 0 |
| 116 | u32 | sliding-window pattern: layer l is global when pattern > 0 and (l + 1) % pattern == 0, else local (only when window > 0; 0 = every layer local) | 0 |
| 120 | f32 | rope_theta of local layers (0 = rope_theta) | 0 |
| 124 | f32 | linear RoPE scaling of global layers: positions divided by it (0 = 1) | 0 |
| 128..255 | | reserved, zero | |

Old files (all of 104..127 zero, flags bit 0 only) load with the same meaning.
A tensor that the flags leave out (a `bqkv` without bit 1, a `wqkv` with bit 5)
is refused by name.
rope_theta (offset 48) is the global layers' base. The family fields by model:

| field | Gemma 3 270M | Qwen 2/2.5 | Qwen 3 | Llama 3.x |
|---|---|---|---|---|
| architecture | 4 | 2 | 3 | 1 |
| activation | 1 | 0 | 0 | 0 |
| embedding scale | sqrt(dim) as f32 (llama.cpp) | 0 | 0 | 0 |
| attention scale | 0 (= 1/16); the 27B: 1/sqrt(dim/n_heads) (GGUF, llama.cpp) or query_pre_attn_scalar^-0.5 (HF) | 0 | 0 | 0 |
| sliding window | 512 | 0 | 0 | 0 |
| pattern | 6 | 0 | 0 | 0 |
| local rope_theta | 10000 | 0 | 0 | 0 |
| global linear RoPE scaling | 0 (files with linear scaling: the factor) | 0 | 0 | 0 |
| flags | tied, qk_norm, post_norms (and split: the Q4_K_M GGUF mixes Q5_0 and Q8_0 in Q/K/V) | (tied), qkv_bias | (tied), qk_norm | (tied), rope_freqs when scaled |

Flags (offset 56):

| bit | name | meaning | tensors it adds (all F32) |
|---|---|---|---|
| 0 | tied | output head = token embedding | (no `output`) |
| 1 | qkv_bias | Q, K, V projections add a bias (Qwen 2) | `layers.N.bqkv` |
| 2 | qk_norm | per-head RMSNorm of Q and K (weight length head_dim, eps norm_eps) after the projection, before RoPE (Qwen 3, Gemma 3) | `layers.N.q_norm`, `layers.N.k_norm` |
| 3 | post_norms | RMSNorm of the attention output and of the FFN output before each residual add (Gemma 3 "sandwich") | `layers.N.post_attn_norm`, `layers.N.post_ffn_norm` |
| 4 | rope_freqs | per-pair RoPE frequency factors: pair i's frequency theta^(−2i/rope_dim) is divided by factor i, on every layer (Llama 3.x "llama3" RoPE scaling) | `rope_freqs` |
| 5 | split | every layer stores Q, K, V and gate, up as tensors of their own instead of fused, each in its own type (a GGUF whose `attn_v` type differs from `attn_q`'s, copied as it is). The parts of one projection must read one activation format: int8 per 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), int8 per 256 (Q4_K, Q5_K, Q6_K) or floats (F32, F16, BF16); `run` refuses other mixes, naming the tensors | `layers.N.wq`, `wk`, `wv` in place of `wqkv`, and `layers.N.w1`, `w3` in place of `w13` (any matrix type) |

Norm weights are stored as the multiplier the engine applies: `x_hat * w`.
Gemma's GGUF norms already include the +1; a Gemma Hugging Face checkpoint
stores w and computes `x_hat * (1 + w)`, so `export.py` adds 1 to every Gemma
norm weight (input, post-attention, pre-FFN, post-FFN, q_norm, k_norm, final).
head_dim comes from the file (Gemma 3 270M: 256 while dim / n_heads = 160;
Qwen 3: `key_length` / `head_dim`).

RoPE convention: **half-split** (NEOX / Hugging Face `rotate_half`): pair `i`
of a head is `(x[i], x[i + rope_dim/2])`, angle `pos * theta^(-2i/rope_dim)`.
Q and K rows are stored in Hugging Face order; `export.py` undoes the row
permutation that llama.cpp's converter applies to llama-architecture GGUF
files, so both sources produce the same file. qwen2, qwen3 and gemma3 GGUFs
are not permuted (llama.cpp runs them with NEOX RoPE) and are copied as they are.

Tokenizer section
-----------------

A 64-byte header followed by arrays, in this order, each starting at a
4-byte boundary (padding zero):

| offset | type | field |
|---|---|---|
| 0 | u32 | kind: 1 = byte-level BPE (GPT-2 style), 2 = SentencePiece-style BPE |
| 4 | u32 | pre-tokenizer: 0 = none (SentencePiece), 1 = gpt-2, 2 = smollm, 3 = llama3, 4 = qwen2 |
| 8 | u32 | n_vocab |
| 12 | u32 | n_merges (0 for SentencePiece) |
| 16 | i32 | bos id (-1 = none) |
| 20 | i32 | eos id |
| 24 | i32 | end-of-turn id (`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`; -1 = none) |
| 28 | i32 | unk id |
| 32 | u32 | flags: bit 0 add BOS, bit 1 add EOS, bit 2 add space prefix (SentencePiece); other bits are refused |
| 36 | u32 | chat template: 0 = none, 1 = ChatML (SmolLM2, Qwen 2/2.5, Qwen 3), 2 = Gemma, 3 = Llama 3 (another id: chat mode names it as unknown) |
| 40 | u32 | size in bytes of the default system prompt (0 = none) |
| 44 | u32 | size in bytes of the token text blob |
| 48..63 | | reserved, zero |

Then:

1. `u32 text_offset[n_vocab + 1]`: token `i`'s text is `blob[text_offset[i] .. text_offset[i+1])`.
   The text is the **decoded bytes** the token stands for: byte-level BPE
   text is already mapped back from the GPT-2 byte↔unicode alphabet,
   SentencePiece text has `▁` replaced by a space, and a byte-fallback token
   `<0xAB>` is the single byte 0xAB. Control tokens keep their literal text
   (`<|im_start|>`).
2. `u8 type[n_vocab]`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte (GGUF's numbering).
3. `f32 score[n_vocab]`: SentencePiece merge priority (higher merges first); zeros for byte-level BPE.
4. `i32 merge[n_merges][3]`: byte-level BPE merges in rank order (row 0 merges first):
   `(left id, right id, result id)`.
5. `u8 default_system[...]`: the default system prompt of the chat template (UTF-8).
6. `u8 blob[...]`: token texts.

Tensor table
------------

`n_tensors` entries of 80 bytes:

| offset | type | field |
|---|---|---|
| 0 | char[48] | name (printable ASCII), NUL-padded: every byte after the name is zero |
| 48 | u32 | type: 0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, 30 BF16 (ggml's ids and block layouts) |
| 52 | u32 | rows |
| 56 | u32 | cols (contiguous; a multiple of the type's block size) |
| 60 | u32 | layout: 0 rows (ggml's blocks, row after row), 1 packed (see "Packed matrices") |
| 64 | u64 | offset of the data from the start of the file (64-byte aligned) |
| 72 | u64 | size in bytes: rows × the row's bytes, or for a packed tensor ⌈rows/16⌉ × its group's bytes |

The matrices the forward pass multiplies by (`wqkv`, `wq`, `wk`, `wv`, `wo`,
`w13`, `w1`, `w3`, `w2`, `output`, and `tok_embeddings` when it is also the
output head) are packed; every other tensor (norms, biases, `rope_freqs`, an
untied `tok_embeddings`, which is only ever looked up by row) is stored as
rows. `run` refuses a file where that is not so.

Tensor names and shapes (`q_dim = n_heads*head_dim`, `kv_dim = n_kv_heads*head_dim`):

| name | rows × cols |
|---|---|
| `tok_embeddings` | vocab_size × dim |
| `rope_freqs` | 1 × rope_dim/2 (F32): per-pair frequency divisors (flag bit 4 only) |
| `layers.N.attn_norm` | 1 × dim (F32) |
| `layers.N.wqkv` | (q_dim + 2·kv_dim) × dim: Q rows, then K, then V (absent when flag bit 5 is set) |
| `layers.N.wq`, `layers.N.wk`, `layers.N.wv` | q_dim × dim, kv_dim × dim, kv_dim × dim: the same rows as three tensors (flag bit 5 only) |
| `layers.N.bqkv` | 1 × (q_dim + 2·kv_dim) (F32): Q, K, V biases in wqkv's row order (flag bit 1 only; one tensor in both forms) |
| `layers.N.q_norm`, `layers.N.k_norm` | 1 × head_dim (F32): per-head RMSNorm of Q and of K (flag bit 2 only) |
| `layers.N.wo` | dim × q_dim |
| `layers.N.post_attn_norm` | 1 × dim (F32): norm of the attention output (flag bit 3 only) |
| `layers.N.ffn_norm` | 1 × dim (F32): norm before the FFN |
| `layers.N.w13` | 2·hidden_dim × dim: gate rows, then up rows (absent when flag bit 5 is set) |
| `layers.N.w1`, `layers.N.w3` | hidden_dim × dim each: the gate rows, the up rows (flag bit 5 only) |
| `layers.N.w2` | dim × hidden_dim (down) |
| `layers.N.post_ffn_norm` | 1 × dim (F32): norm of the FFN output (flag bit 3 only) |
| `norm` | 1 × dim (F32) |
| `output` | vocab_size × dim (absent when embeddings are tied) |

Packed matrices
---------------

Decode reads every weight once per token and is bound by how fast those
bytes stream from memory; prefill multiplies each weight by many tokens and
is bound by arithmetic. Both want the bytes in the order the vector
instructions consume them, so the file stores each matrix that way and the
engine maps it as it is. The unit is a **group of 16 rows** (the last group
padded with rows of zero blocks: every byte of ggml's block zero, so q8_0's
integers, stored as q + 128, read 128 there), one row per 32-bit lane of a 512-bit vector: one
`vpdpbusd` multiplies four activation bytes, broadcast, by four integers of
each of the 16 rows, and each lane sums its own row, so no sum crosses lanes
and a block's scale is applied to 16 rows by one instruction. AVX2 reads the
same bytes as two 256-bit halves, NEON as four 128-bit quarters, the scalar
reference element by element (`packed_stretch` and `packed_half` in `run.c`
say where each value lives). A group of rows of `n` elements is `n / block`
**records**, one per block (for F32, F16 and BF16, one per element), and is
padded with zeros to a multiple of 64 bytes. A record holds the block of
each of the 16 rows, every byte of ggml's block kept and only moved, so a
packed matrix is exactly as large as ggml's (a test turns every packed
matrix of an exported GGUF back into the GGUF's blocks):

| part of a record | layout |
|---|---|
| scales | ggml's non-integer fields as planes: the 16 rows' fp16 `d` side by side (32 bytes), then `m` (q4_1, q5_1) or `dmin` (q4_k, q5_k); then for the K types each scale byte as a plane of 16 (q4_k, q5_k: ggml's 12 packed bytes of 6-bit scales and minimums; q6_k: its 16 int8 scales) |
| integers | per run of 32 elements of a row (one run per block; eight per K block), **unsigned**: q4_0, q4_1 and the low 4 bits of everything else as 4 vectors of 64 bytes, byte `64j + 4r + i` holding element `8j + i` of row `r` in its low nibble and element `8j + 4 + i` in its high nibble; the bits above the nibble (q5_0, q5_1, q5_k: 1; q6_k: 2) in planes of 64 bytes placed before the nibbles, field `k = 2j + h` of that element (`h` 0 low, 1 high) at bit `(k mod (8/b))·b` of byte `64⌊k/(8/b)⌋ + 4r + i` for `b` extra bits; q8_0 as 8 vectors of 64 bytes, byte `64g + 4r + i` = element `4g + i` of row `r`, stored as `q + 128` |
| float types | element `e` of the 16 rows side by side (64 or 32 bytes) |

So four elements of one row sit in one 4-byte lane of a 64-byte vector:
a kernel gets 16 rows × 4 integers with a load and an `and` (or a shift),
a 5- or 6-bit integer with a shift, an `and` and an `or` more. The integers
are unsigned because `vpdpbusd` multiplies unsigned by signed bytes; a
type's offset (q4_0's 8, q5_0's 16, q8_0's 128, q6_k's 32) leaves through
the activation block's integer sum. Where a set wants another form, the
conversion is an instruction in its kernel, not a second copy: NEON's
signed `sdot` takes q8_0's bytes back to `q` with an `eor`, AVX2's `maddubs`
(whose int16 pairs would overflow on `q + 128`) takes them back to `q` and
applies the sign trick.

Why in the file and not at load: the previous version packed at load, which
cost a pass over the weights and a private copy of them in every process
(3.6 s and 1.2 GB for Qwen2.5-Coder-1.5B). Now loading is mapping, a second
process on the same file shares its pages, and `--dtype keep` still means
ggml's values bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import re
import signal
import stat
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np

PROG = "export.py"


class ExportError(Exception):
    """A problem with the input or the request: reported as one line on stderr, exit status 1."""


def warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


def show(text: str, limit: int = 80) -> str:
    """A name taken from the input, made safe for a one-line message (escaped, shortened)."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def align_up(x: int, a: int) -> int:
    return x + (-x) % a


# ---------------------------------------------------------------------------------------------
# ggml types: id -> (name, elements per block, bytes per block). The ids are ggml's enum ggml_type
# (ggml/include/ggml.h, also listed in ggml's docs/gguf.md); the block sizes are those of the
# block_* structs in ggml/src/ggml-common.h.

GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
QK = 32        # elements per legacy block
QK_K = 256     # elements per K-quant super-block

# --dtype: "keep" (every tensor keeps the source's type) or a default type that llama.cpp's per-tensor rules
# (llama_cpp_type) adjust. Every name but q4_k / q5_k is a llama.cpp file type (include/llama.h, llama_ftype) and
# gives the types llama-quantize gives for it; q4_k and q5_k are `llama-quantize --pure` Q4_K_M / Q5_K_M: every
# matrix in that type, only the row-length fallback applied (llama-quantize's own "Q4_K" is Q4_K_M).
DTYPE_DEFAULT = {"f32": F32, "f16": F16, "q8_0": Q8_0, "q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q5_1": Q5_1,
                 "q4_k": Q4_K, "q5_k": Q5_K, "q6_k": Q6_K, "q4_k_m": Q4_K, "q5_k_m": Q5_K}
PURE_DTYPES = ("q4_k", "q5_k")          # no per-tensor rules
MORE_BITS_DTYPES = ("q4_k_m", "q5_k_m")  # attn_v and ffn_down Q6_K on use_more_bits layers
DTYPE_CHOICES = ["keep", *DTYPE_DEFAULT]
# The weight types the engine runs as they are (the manual above, "The model file"), and the activations its matrix
# products read for each (run.c's weight-type table, field act): floats, int8 per 32, int8 per 256 with the sums
# of each 16. The parts of one projection in a split file must read the same.
ACTIVATION = {F32: "f32", F16: "f32", BF16: "f32", Q4_0: "q8", Q4_1: "q8", Q5_0: "q8", Q5_1: "q8", Q8_0: "q8",
              Q4_K: "q8_k", Q5_K: "q8_k", Q6_K: "q8_k"}
NATIVE_TYPES = tuple(ACTIVATION)
# llama.cpp's tensor_type_fallback (src/llama-quant.cpp): a K type on a row length that is not a
# multiple of 256 becomes the 32-element type of about the same size.
K_FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}


def type_name(t: int) -> str:
    return GGML_TYPES[t][0] if t in GGML_TYPES else f"unknown type {t}"


def row_bytes(t: int, cols: int) -> int:
    _, block, size = GGML_TYPES[t]
    return cols // block * size


# ---------------------------------------------------------------------------------------------
# Dequantization: blocks (n, bytes per block) uint8 -> (n, elements per block) float32.
# The order of the float operations follows ggml's dequantize_row_* so results are bit-exact.

def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of every block, as f32 column (n, 1)."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy layout: byte j holds element j (low nibble) and element j+16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits32(b: np.ndarray, at: int) -> np.ndarray:
    """The 32 bits of the little-endian u32 at byte `at`, as (n, 32) uint8."""
    qh = np.ascontiguousarray(b[:, at:at + 4]).view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _dec_q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * _half(b, 0)


def _dec_q4_1(b: np.ndarray) -> np.ndarray:
    return _nibbles(b[:, 4:20]).astype(np.float32) * _half(b, 0) + _half(b, 2)


def _dec_q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 6:22]) | (_bits32(b, 2) << 4)).astype(np.int8) - np.int8(16)
    return q.astype(np.float32) * _half(b, 0)


def _dec_q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:24]) | (_bits32(b, 4) << 4)
    return q.astype(np.float32) * _half(b, 0) + _half(b, 2)


def _dec_q8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:34].view(np.int8).astype(np.float32) * _half(b, 0)


def _two_bit_quants(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: element (half, j, l) is bits 2j..2j+1 of qs[32*half + l]; -> (n, 256)."""
    n = qs.shape[0]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)


def _dec_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc = b[:, 0:16]
    q = _two_bit_quants(b[:, 16:80]).astype(np.float32).reshape(n, 16, 16)
    dl = (_half(b, 80) * (sc & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (_half(b, 82) * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    return (dl * q - ml).reshape(n, QK_K)


def _dec_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask, sc = b[:, 0:32], b[:, 96:108]
    q2 = _two_bit_quants(b[:, 32:96]).astype(np.int8)
    hbit = ((hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(n, QK_K)
    q = q2 - np.where(hbit == 1, np.int8(0), np.int8(4))
    low4 = np.concatenate([sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4], axis=1)
    high2 = ((sc[:, 8:12].reshape(n, 1, 4) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)) & 3).reshape(n, 16)
    scales = (low4 | (high2 << 4)).astype(np.int8) - np.int8(32)
    dl = (_half(b, 108) * scales.astype(np.float32)).reshape(n, 16, 1)
    return (dl * q.astype(np.float32).reshape(n, 16, 16)).reshape(n, QK_K)


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 six-bit scales and mins packed in 12 bytes -> two (n, 8) uint8 arrays."""
    s_lo, m_lo, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([s_lo & 63, (hi & 0x0F) | ((s_lo >> 6) << 4)], axis=1)
    mins = np.concatenate([m_lo & 63, (hi >> 4) | ((m_lo >> 6) << 4)], axis=1)
    return scales, mins


def _k4_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: chunk c of 64 elements = low nibbles of qs[32c..32c+31], then their high nibbles; -> (n, 8, 32)."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, 8, 32)


def _dec_k_scaled(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales, mins = _scale_min_k4(b[:, 4:16])
    d = (_half(b, 0) * scales.astype(np.float32)).reshape(n, 8, 1)
    m = (_half(b, 2) * mins.astype(np.float32)).reshape(n, 8, 1)
    return (d * q.astype(np.float32) - m).reshape(n, QK_K)


def _dec_q4_k(b: np.ndarray) -> np.ndarray:
    return _dec_k_scaled(b, _k4_low_nibbles(b[:, 16:144]))


def _dec_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _dec_k_scaled(b, _k4_low_nibbles(b[:, 48:176]) | (high << 4))


def _dec_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)
    low4 = (ql & 0x0F).reshape(n, 2, 4, 32)
    high2 = (b[:, 128:192].reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    q = (low4 | (high2 << 4)).astype(np.int8) - np.int8(32)
    d = (_half(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    return (d * q.astype(np.float32).reshape(n, 16, 16)).reshape(n, QK_K)


def _dec_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f4").astype(np.float32, copy=False)


def _dec_f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _dec_bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16).view(np.float32)


DECODERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    F32: _dec_f32, F16: _dec_f16, BF16: _dec_bf16,
    Q4_0: _dec_q4_0, Q4_1: _dec_q4_1, Q5_0: _dec_q5_0, Q5_1: _dec_q5_1, Q8_0: _dec_q8_0,
    Q2_K: _dec_q2_k, Q3_K: _dec_q3_k, Q4_K: _dec_q4_k, Q5_K: _dec_q5_k, Q6_K: _dec_q6_k,
}


def unsupported_type(t: SourceTensor) -> ExportError:
    """The refusal of a tensor whose type export.py can neither copy (the engine does not run it) nor decode:
    no --dtype helps, so none is suggested."""
    return ExportError(f"tensor '{show(t.name)}' has type {type_name(t.ggml_type)} ({t.ggml_type}), which export.py "
                       f"does not support: the engine does not run it and export.py cannot decode it to convert it "
                       f"(it decodes {', '.join(type_name(d) for d in DECODERS)})")


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Decode a flat uint8 buffer of whole blocks of `ggml_type` into a flat float32 array."""
    if ggml_type not in DECODERS:
        raise ExportError(f"cannot decode ggml type {type_name(ggml_type)}")
    _, block, size = GGML_TYPES[ggml_type]
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size % size:
        raise ExportError(f"{raw.size} bytes is not a whole number of {type_name(ggml_type)} blocks")
    return DECODERS[ggml_type](raw.reshape(-1, size)).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Quantization (ggml's reference quantizers, quantize_row_*_ref). Input: float32 (n, 32) blocks.

def _round_half_away(a: np.ndarray) -> np.ndarray:
    """C roundf: halves go away from zero. floor(|a|) and |a| - floor(|a|) are exact in f32."""
    mag = np.abs(a)
    fl = np.floor(mag)
    return np.copysign(fl + (mag - fl >= np.float32(0.5)), a)


def _inverse_scale(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 values (a multiple of 32) -> Q8_0 blocks (n, 34) uint8.

    d = max|x| / 127; q = roundf(x * (1/d)), the f32 d, as ggml does; d stored as f16."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _round_half_away(blocks * _inverse_scale(d)).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    """float32 values (a multiple of 32) -> Q4_1 blocks (n, 20) uint8.

    d = (max - min) / 15, m = min, q = min(15, (int)((x - min) * (1/d) + 0.5)); d and m stored as f16."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK)
    lo = blocks.min(axis=1, keepdims=True)
    hi = blocks.max(axis=1, keepdims=True)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    q = np.trunc((blocks - lo) * _inverse_scale(d) + np.float32(0.5))
    q = np.minimum(q, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8), packed], axis=1)


def _amax_signed(blocks: np.ndarray) -> np.ndarray:
    """The value of largest magnitude in each row, the first one on ties (ggml's `if (amax < fabsf(v))`); (n, 1)."""
    idx = np.abs(blocks).argmax(axis=1)
    return blocks[np.arange(blocks.shape[0]), idx][:, None]


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit 4 of element j goes to bit j of the u32 qh; (n, 32) -> (n, 4) bytes."""
    qh = (((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return qh.astype("<u4").view(np.uint8).reshape(-1, 4)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Legacy layout: element j in the low nibble of byte j, element j+16 in its high nibble."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float32).astype("<f2").reshape(-1, 1).view(np.uint8)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """float32 values (a multiple of 32) -> Q4_0 blocks (n, 18): d = max / -8 (max: the value of largest
    magnitude), q = min(15, (int8)(x * (1/d) + 8.5))."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK)
    d = (_amax_signed(blocks) / np.float32(-8)).astype(np.float32)
    q = np.minimum(np.trunc(blocks * _inverse_scale(d) + np.float32(8.5)), 15).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """float32 values -> Q5_0 blocks (n, 22): d = max / -16, q = min(31, (int8)(x * (1/d) + 16.5))."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK)
    d = (_amax_signed(blocks) / np.float32(-16)).astype(np.float32)
    q = np.minimum(np.trunc(blocks * _inverse_scale(d) + np.float32(16.5)), 31).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """float32 values -> Q5_1 blocks (n, 24): d = (max - min) / 31, m = min, q = (uint8)((x - min) * (1/d) + 0.5)."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK)
    lo = blocks.min(axis=1, keepdims=True)
    d = ((blocks.max(axis=1, keepdims=True) - lo) / np.float32(31)).astype(np.float32)
    q = np.trunc((blocks - lo) * _inverse_scale(d) + np.float32(0.5)).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q), _pack_nibbles(q)], axis=1)


# K-quants (ggml-quants.c: quantize_row_q4_K_ref, _q5_K_ref, _q6_K_ref, with make_qkx2_quants and
# make_qx_quants). Every sub-block is searched at once, held as a column: arrays are (elements, sub-blocks),
# so the sums over a sub-block run left to right in float32 like the C loops, one vector add per element.
# The float results match a build of ggml that does not contract a*b+c into FMA.

def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0, left to right in float32, as `for (i...) s += a[i]` does."""
    s = a[0].astype(np.float32, copy=True)
    for row in a[1:]:
        s += row
    return s


def _nearest_int(a: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (the 1.5 * 2^23 trick): round half to even, as np.rint."""
    with np.errstate(invalid="ignore"):
        return np.rint(a)


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-blocks as columns x (32, n) with weights w -> (scale (n,), min (n,) >= 0, levels L (32, n) in 0..nmax).

    x ~ scale * L - min. The search tries nstep + 1 inverse scales and keeps the least weighted squared
    error of a least-squares (scale, min) fit; as in ggml, an accepted fit's min is the one the later
    trials quantize against."""
    f = np.float32
    lo = np.minimum(x.min(axis=0), f(0))
    hi = x.max(axis=0)
    flat = hi == lo
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = f(nmax) / (hi - lo)
        scale = f(1) / iscale
        levels = np.clip(_nearest_int(iscale * (x - lo)), 0, nmax).astype(np.float32)
        diff = scale * levels + lo - x
        best = _seq_sum(w * (diff * diff))
        mn = lo
        for step in range(nstep + 1):
            iscale = (f(rmin) + f(rdelta) * f(step) + f(nmax)) / (hi - mn)
            trial = np.clip(_nearest_int(iscale * (x - mn)), 0, nmax).astype(np.float32)
            wl = w * trial
            sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * trial), _seq_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            pos = this_min > 0
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            this_min = np.where(pos, f(0), this_min)
            diff = this_scale * trial + this_min - x
            error = _seq_sum(w * (diff * diff))
            better = (det > 0) & (error < best) & ~flat
            levels = np.where(better, trial, levels)
            best = np.where(better, error, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    levels = np.where(flat, f(0), levels)
    return np.where(flat, f(0), scale).astype(np.float32), (-mn).astype(np.float32), levels


def _quantize_k_scale_min(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Q4_K/Q5_K common part: super-blocks x (n, 256) -> (d f16 (n,), dmin f16 (n,), 12 scale bytes (n, 12),
    levels (n, 256) in 0..nmax)."""
    f = np.float32
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    cols = np.ascontiguousarray(sub.T)
    av_x = np.sqrt(_seq_sum(cols * cols) / f(32))
    w = av_x + np.abs(cols)
    scales, mins, levels = _make_qkx2_quants(cols, w, nmax, rmin, rdelta, nstep)
    levels = levels.T
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), f(0))
    max_min = np.maximum(mins.max(axis=1), f(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f(63) / max_scale, f(0)).astype(np.float32)
        inv_min = np.where(max_min > 0, f(63) / max_min, f(0)).astype(np.float32)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)], axis=1)
    d16 = (max_scale / f(63)).astype(np.float16)
    dmin16 = (max_min / f(63)).astype(np.float16)
    d = d16.astype(np.float32)[:, None] * ls.astype(np.float32)
    dm = dmin16.astype(np.float32)[:, None] * lm.astype(np.float32)
    sub = sub.reshape(n, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int((sub + dm[:, :, None]) / d[:, :, None]), 0, nmax)
    levels = np.where((d != 0)[:, :, None], requant, levels.reshape(n, 8, 32)).astype(np.uint8)
    return d16, dmin16, packed, levels.reshape(n, QK_K)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 values (a multiple of 256) -> Q4_K blocks (n, 144): d, dmin, 12 scale bytes, 128 nibble bytes."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK_K)
    d, dmin, scales, levels = _quantize_k_scale_min(blocks, 15, -1.0, 0.1, 20)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 values (a multiple of 256) -> Q5_K blocks (n, 176): d, dmin, 12 scale bytes, 32 high-bit bytes
    (bit k of qh[j]: element 32k + j), 128 nibble bytes."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK_K)
    d, dmin, scales, levels = _quantize_k_scale_min(blocks, 31, -0.5, 0.1, 15)
    high = ((levels.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    pairs = (levels & 0x0F).reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, high, qs], axis=1)


def _make_qx_quants_q6(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(16, 32, x, L, rmse_type 1, no weights) for sub-blocks x (n, 16) -> (scale (n,), L in 0..63).

    Starts from -32 / max, then tries 18 nearby inverse scales and keeps the best weighted (x^2) fit."""
    f, nmax = np.float32, 32
    mx = _amax_signed(x)[:, 0]
    zero = np.abs(mx) < f(1e-15)
    cols = np.ascontiguousarray(x.T)   # (16, n): one column per sub-block
    w = cols * cols
    wx = w * cols   # `w*x[i]*l` groups as (w * x) * l

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(_nearest_int(iscale * cols), -nmax, nmax - 1).astype(np.float32)
        return lv, _seq_sum(wx * lv), _seq_sum(w * lv * lv)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lv, sumlx, suml2 = fit(f(-nmax) / mx)
        scale = np.where(suml2 != 0, sumlx / suml2, f(0)).astype(np.float32)
        best = scale * sumlx
        levels = lv
        for step in (*range(-9, 0), *range(1, 10)):
            lv, sumlx, suml2 = fit(-(f(nmax) + f(0.1) * f(step)) / mx)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2) & ~zero
            levels = np.where(better, lv, levels)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    levels = np.where(zero, f(-nmax), levels)
    return np.where(zero, f(0), scale).astype(np.float32), (levels.T + nmax).astype(np.uint8)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 values (a multiple of 256) -> Q6_K blocks (n, 210): 128 low-nibble bytes, 64 high-2-bit bytes,
    16 int8 scales, d."""
    f = np.float32
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK_K)
    n = blocks.shape[0]
    sub = blocks.reshape(n * 16, 16)
    scales, levels = _make_qx_quants_q6(sub)
    scales, levels = scales.reshape(n, 16), levels.reshape(n, 16, 16)
    max_scale = _amax_signed(scales)[:, 0]
    empty = np.abs(max_scale) < f(1e-15)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = f(-128) / max_scale
        d16 = np.where(empty, f(0), f(1) / iscale).astype(np.float16)
        sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127)
        sc = np.where(empty[:, None], 0, sc).astype(np.int8)
        d = d16.astype(np.float32)[:, None] * sc.astype(np.float32)
        requant = np.clip(_nearest_int(sub.reshape(n, 16, 16) / d[:, :, None]), -32, 31) + 32
    levels = np.where((d != 0)[:, :, None], requant, levels).astype(np.uint8)
    levels = np.where(empty[:, None, None], 0, levels).reshape(n, 2, 4, 32)
    ql = np.concatenate([levels[:, :, 0] & 0x0F | ((levels[:, :, 2] & 0x0F) << 4),
                         levels[:, :, 1] & 0x0F | ((levels[:, :, 3] & 0x0F) << 4)], axis=2).reshape(n, 128)
    qh = ((levels >> 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d16.astype("<f2").reshape(-1, 1).view(np.uint8)],
                          axis=1)


def encode_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (ggml's GGML_FP32_TO_BF16: round to nearest even, NaN kept quiet)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((u >> 16) | 64).astype(np.uint16), rounded).astype("<u2")


ENCODERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q4_0: quantize_q4_0, Q4_1: quantize_q4_1, Q5_0: quantize_q5_0, Q5_1: quantize_q5_1, Q8_0: quantize_q8_0,
    Q4_K: quantize_q4_k, Q5_K: quantize_q5_k, Q6_K: quantize_q6_k,
}


def encode_rows(x: np.ndarray, out_type: int) -> np.ndarray:
    """float32 rows (rows, cols) -> bytes (rows, row_bytes) of out_type."""
    rows, cols = x.shape
    if out_type == F32:
        return np.ascontiguousarray(x, dtype="<f4").view(np.uint8).reshape(rows, cols * 4)
    if out_type == F16:
        with np.errstate(over="ignore"):
            return x.astype("<f2").view(np.uint8).reshape(rows, cols * 2)
    if out_type == BF16:
        return encode_bf16(x).view(np.uint8).reshape(rows, cols * 2)
    if out_type in ENCODERS:
        with np.errstate(all="ignore"):   # inf/NaN weights give inf/NaN scales, as in ggml: no warning noise
            return ENCODERS[out_type](x).reshape(rows, -1)
    raise ExportError(f"cannot encode ggml type {type_name(out_type)}")


# ---------------------------------------------------------------------------------------------
# The packed layout of the matrices (the manual above, "Packed matrices"): the engine multiplies straight from
# the mapped file, so each weight matrix is stored the way its kernels read it. Rows go in groups of
# PACK_ROWS, one row per 32-bit lane of a 512-bit vector (two 256-bit or four 128-bit ones); a group is
# one record per block (per element for the float types), and a record holds the block of each of the
# group's rows: scales first as [field][row] planes, then the integers, 4 consecutive elements of a row
# per lane. Every byte of ggml's blocks is kept, only moved: a packed matrix unpacks to the GGUF's blocks.

PACK_ROWS = 16      # rows per group: one per int32 lane of a 512-bit vector
PACK_ALIGN = 64     # every group starts on a cache line
PACKED_TYPES = (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)


def _group_rows(rows: np.ndarray, block_bytes: int) -> np.ndarray:
    """(rows, row bytes) uint8 -> (groups, PACK_ROWS, blocks, block bytes), the last group padded with zero rows."""
    n, rb = rows.shape
    padded = np.zeros((align_up(n, PACK_ROWS), rb), dtype=np.uint8)
    padded[:n] = rows
    return padded.reshape(-1, PACK_ROWS, rb // block_bytes, block_bytes)


def _plane(b: np.ndarray, start: int, width: int, unit: int = 1) -> np.ndarray:
    """Bytes [start, start + width) of every row's block as planes of `unit`-byte fields, [field][row][unit]
    (the fp16 scales: unit 2, the rows' scales side by side; the K types' scale bytes: unit 1)
    -> (G, nb, width * 16)."""
    G, R, nb, _ = b.shape
    f = b[..., start:start + width].reshape(G, R, nb, width // unit, unit)
    return f.transpose(0, 2, 3, 1, 4).reshape(G, nb, width * R)


def _lanes(u: np.ndarray) -> np.ndarray:
    """Integers (G, 16, nb, S, 32) of S 32-element stretches per record, 8-bit form: vector g holds elements
    4g..4g+3 of each row, 4 bytes per row -> (G, nb, S * 512)."""
    G, R, nb, S, _ = u.shape
    return u.reshape(G, R, nb, S, 8, 4).transpose(0, 2, 3, 4, 1, 5).reshape(G, nb, S * 512)


def _nibble_lanes(u: np.ndarray) -> np.ndarray:
    """Low 4 bits of integers (G, 16, nb, S, 32), 4-bit form: vector j (of 4) holds elements 8j+i in the low
    nibble and 8j+4+i in the high nibble of byte 4r+i -> (G, nb, S * 256)."""
    G, R, nb, S, _ = u.shape
    v = (u & 0x0F).reshape(G, R, nb, S, 4, 2, 4)
    packed = v[..., 0, :] | (v[..., 1, :] << 4)
    return packed.transpose(0, 2, 3, 4, 1, 5).reshape(G, nb, S * 256)


def _high_planes(u: np.ndarray, extra: int) -> np.ndarray:
    """Bits 4.. of integers (G, 16, nb, S, 32) with `extra` bits above the nibble: element 8j+4h+i = 4k+i of
    row r is bit field k = 2j+h; plane p = k / (8/extra) holds it at bit (k % (8/extra)) * extra of byte 4r+i
    -> (G, nb, S * 64 * extra)."""
    G, R, nb, S, _ = u.shape
    per_byte = 8 // extra
    hi = (u >> 4).reshape(G, R, nb, S, extra, per_byte, 4)            # [.., p, k % per_byte, i]
    planes = hi[..., 0, :].copy()
    for kk in range(1, per_byte):
        planes |= hi[..., kk, :] << (kk * extra)
    return planes.transpose(0, 2, 3, 4, 1, 5).reshape(G, nb, S * 64 * extra)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-element nibble bytes (..., 16) -> (..., 32): element j in the low nibble of byte j, j+16 in the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """q4_k/q5_k's 128 nibble bytes (..., 128) -> (..., 256): chunk c of 64 elements: low nibbles of bytes
    32c..32c+31, then their high nibbles."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=-1).reshape(*qs.shape[:-1], 256)


def _q6_k_ints(b: np.ndarray) -> np.ndarray:
    """q6_k blocks (..., 210) -> the unsigned 6-bit integers (..., 256) in element order (ggml's
    dequantize_row_q6_K)."""
    ql = b[..., :128].reshape(*b.shape[:-1], 2, 64)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    return (low | (high << 4)).reshape(*b.shape[:-1], 256)


def _pack_block32(b: np.ndarray, t: int) -> np.ndarray:
    """Records of the 32-element types from grouped blocks (G, 16, nb, bytes)."""
    heads = 2 if t in (Q4_1, Q5_1) else 1
    head = _plane(b, 0, 2 * heads, 2)
    if t == Q8_0:
        u = (b[..., 2:34] ^ 0x80)[:, :, :, None, :]        # q + 128: the unsigned integers vpdpbusd takes
        return np.concatenate([head, _lanes(u)], axis=2)
    qs = b[..., -16:]
    u = _nibbles32(qs)
    if t in (Q5_0, Q5_1):   # qh: bit j (little-endian) is bit 4 of element j
        bit4 = np.unpackbits(b[..., 2 * heads:2 * heads + 4], axis=-1, bitorder="little")
        u = u | (bit4 << 4)
        u = u[:, :, :, None, :]
        return np.concatenate([head, _high_planes(u, 1), _nibble_lanes(u)], axis=2)
    return np.concatenate([head, _nibble_lanes(u[:, :, :, None, :])], axis=2)


def _pack_k(b: np.ndarray, t: int) -> np.ndarray:
    """Records of the K types: d (and dmin), the 12 (q6_k: 16) scale bytes as planes, then per 32-element
    stretch the high planes (q5_k, q6_k) and the nibbles."""
    if t == Q6_K:
        u = _q6_k_ints(b).reshape(*b.shape[:3], 8, 32)
        head = np.concatenate([_plane(b, 208, 2, 2), _plane(b, 192, 16)], axis=2)
        extra = 2
    else:
        u = _k_low_nibbles(b[..., -128:])
        if t == Q5_K:                                          # bit j of qh[l]: bit 4 of element 32j + l
            bits = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")   # [.., l, j]
            u = u | (np.swapaxes(bits, -1, -2).reshape(*b.shape[:3], 256) << 4)
        u = u.reshape(*b.shape[:3], 8, 32)
        head = np.concatenate([_plane(b, 0, 4, 2), _plane(b, 4, 12)], axis=2)   # d, dmin; scales[12]
        extra = 1 if t == Q5_K else 0
    G, _, nb, _, _ = u.shape
    if not extra:
        return np.concatenate([head, _nibble_lanes(u)], axis=2)
    stretches = np.concatenate([_high_planes(u, extra).reshape(G, nb, 8, -1),
                                _nibble_lanes(u).reshape(G, nb, 8, -1)], axis=3)
    return np.concatenate([head, stretches.reshape(G, nb, -1)], axis=2)


def packed_record_bytes(t: int) -> int:
    """Bytes of one record of PACK_ROWS rows: one block (one element for the float types)."""
    return PACK_ROWS * GGML_TYPES[t][2]


def packed_size(t: int, rows: int, cols: int) -> int:
    """Bytes of a packed matrix: whole groups, each padded to PACK_ALIGN."""
    group = align_up(cols // GGML_TYPES[t][1] * packed_record_bytes(t), PACK_ALIGN)
    return align_up(rows, PACK_ROWS) // PACK_ROWS * group


def pack_rows(rows: np.ndarray, t: int) -> np.ndarray:
    """Rows of ggml blocks (n, row bytes), n any count, -> their packed groups as bytes (the last group padded
    with zero rows, every group with zeros to PACK_ALIGN)."""
    n, rb = rows.shape
    bb = GGML_TYPES[t][2]
    if GGML_TYPES[t][1] == 1:   # float types: element e of the 16 rows side by side
        g = _group_rows(rows, bb)
        rec = g.transpose(0, 2, 1, 3)
    elif t in (Q4_K, Q5_K, Q6_K):
        rec = _pack_k(_group_rows(rows, bb), t)
    else:
        rec = _pack_block32(_group_rows(rows, bb), t)
    rec = rec.reshape(rec.shape[0], -1)
    pad = align_up(rec.shape[1], PACK_ALIGN) - rec.shape[1]
    if pad:
        rec = np.concatenate([rec, np.zeros((rec.shape[0], pad), dtype=np.uint8)], axis=1)
    return rec


# ---------------------------------------------------------------------------------------------
# Source tensors (GGUF and safetensors) share one description: a ggml type and raw row bytes.

@dataclass
class SourceTensor:
    name: str
    ggml_type: int | None        # None: a safetensors dtype we cannot read
    type_label: str
    shape: tuple[int, ...]       # numpy order: the last dimension is contiguous
    buf: Any                     # mmap of the file
    offset: int                  # absolute byte offset in buf
    nbytes: int
    origin: str

    @property
    def rows_cols(self) -> tuple[int, int]:
        if not self.shape:
            return 1, 1
        return math.prod(self.shape[:-1]), self.shape[-1]

    def raw(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype=np.uint8, count=self.nbytes, offset=self.offset)


def map_file(path: Path) -> tuple[mmap.mmap, int]:
    try:
        size = path.stat().st_size
        if size == 0:
            raise ExportError(f"{path} is empty")
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size
    except OSError as e:
        raise ExportError(f"cannot read {path}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------
# GGUF (the specification: ggml's docs/gguf.md)

GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
GGUF_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
GGUF_UINT32, GGUF_STRING, GGUF_ARRAY = 4, 8, 9
GGUF_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
                   8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every overrun is a clear error."""

    def __init__(self, buf: Any, size: int, path: Path):
        self.buf, self.size, self.pos, self.path = buf, size, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ExportError(f"{self.path}: {what} at offset {self.pos} ({n} bytes) runs past the end of the "
                              f"file ({self.size} bytes): truncated or corrupt GGUF")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            raise ExportError(f"{self.path}: {what} at offset {self.pos - 8} has length {n}, past the end of the "
                              f"file ({self.size} bytes): truncated or corrupt GGUF")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        # surrogateescape keeps invalid UTF-8 bytes so they round-trip into the token blob
        return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int, key: str) -> list[str]:
        """`count` strings, as `count` calls of string() but in one loop: a tokenizer holds 10^5 of them."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        length = struct.Struct("<Q").unpack_from
        for i in range(count):
            n = length(buf, pos)[0] if pos + 8 <= size else -1
            if n < 0 or n > size - pos - 8:
                self.pos = pos
                self.string(f"element {i} of '{key}'")   # raises string()'s error for this element
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="surrogateescape"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype in GGUF_SCALARS:
            v = self.unpack(GGUF_SCALARS[vtype], f"value of '{key}'")
            return bool(v) if vtype == 7 else v
        if vtype == GGUF_STRING:
            return self.string(f"value of '{key}'")
        if vtype == GGUF_ARRAY:
            etype = self.u32(f"array type of '{key}'")
            count = self.u64(f"array length of '{key}'")
            if etype in GGUF_NUMPY:
                width = np.dtype(GGUF_NUMPY[etype]).itemsize
                if count > (self.size - self.pos) // width:
                    raise ExportError(f"{self.path}: array '{key}' claims {count} elements, past the end of the "
                                      f"file: truncated or corrupt GGUF")
                arr = np.frombuffer(self.buf, dtype=GGUF_NUMPY[etype], count=count, offset=self.pos).copy()
                self.pos += count * width
                return arr.astype(bool) if etype == 7 else arr
            if etype == GGUF_STRING:
                if count > (self.size - self.pos) // 8:
                    raise ExportError(f"{self.path}: array '{key}' claims {count} strings, past the end of the "
                                      f"file: truncated or corrupt GGUF")
                return self.strings(count, key)
            raise ExportError(f"{self.path}: array '{key}' has unsupported element type {etype}")
        raise ExportError(f"{self.path}: metadata '{key}' has invalid value type {vtype}")


def check_tensor_offset(path: Path, name: str, offset: int, expected: int, alignment: int) -> None:
    """The GGUF layout rule (ggml's gguf.cpp, gguf_init_from_file_impl, which llama.cpp applies to every
    file): tensor data follows the tensor table's order, each tensor starting where the one before ends,
    padded to general.alignment (the first at offset 0 of the data section). A misaligned, overlapping or
    shuffled offset would otherwise read another tensor's bytes as weights."""
    if offset == expected:
        return
    if offset % alignment:
        why = f"not a multiple of general.alignment {alignment}"
    elif offset < expected:
        why = "overlapping the data of the tensors before it in the table"
    else:
        why = "leaving a gap before it"
    raise ExportError(f"{path}: tensor '{name}' has offset {offset}, expected {expected} ({why}; GGUF tensor data "
                      f"follows the table order, each tensor padded to general.alignment): corrupt GGUF")


class GGUFFile:
    """A parsed GGUF v2/v3 file: metadata dict and tensors (data left in the mapping)."""

    def __init__(self, path: Path):
        self.path = path
        buf, size = map_file(path)
        self.buf, self.size = buf, size
        cur = _Cursor(buf, size, path)
        magic = buf[0:4]
        if magic != b"GGUF":
            raise ExportError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            raise ExportError(f"{path}: big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise ExportError(f"{path}: unsupported GGUF version {version} (need 2 or 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        rest = size - cur.pos
        # smallest possible KV: 8-byte key length + 1-byte key + 4-byte type + 1-byte value
        if n_kv > rest // 14:
            raise ExportError(f"{path}: metadata count {n_kv} is impossible for a {size}-byte file: truncated or "
                              f"corrupt GGUF header")
        # smallest possible tensor info: 8 + 1 name bytes + 4 n_dims + 4 type + 8 offset
        if n_tensors > rest // 25:
            raise ExportError(f"{path}: tensor count {n_tensors} is impossible for a {size}-byte file: truncated or "
                              f"corrupt GGUF header")

        self.kv: dict[str, Any] = {}
        self.kv_types: dict[str, int] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if not key:
                raise ExportError(f"{path}: metadata key #{i} is empty: corrupt GGUF")
            if key in self.kv:
                raise ExportError(f"{path}: duplicate metadata key '{show(key)}'")
            vtype = cur.u32(f"value type of '{show(key)}'")
            self.kv[key] = cur.value(vtype, show(key))
            self.kv_types[key] = vtype

        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            shown = show(name)
            if name in names:
                raise ExportError(f"{path}: duplicate tensor name '{shown}'")
            names.add(name)
            n_dims = cur.u32(f"n_dims of tensor '{shown}'")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise ExportError(f"{path}: tensor '{shown}' has {n_dims} dimensions (1..{GGML_MAX_DIMS} allowed): corrupt GGUF")
            ne = [cur.u64(f"dimension {j} of tensor '{shown}'") for j in range(n_dims)]
            ttype = cur.u32(f"type of tensor '{shown}'")
            offset = cur.u64(f"data offset of tensor '{shown}'")
            infos.append((name, ne, ttype, offset))

        alignment = self.kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if "general.alignment" in self.kv and self.kv_types["general.alignment"] != GGUF_UINT32:
            raise ExportError(f"{path}: general.alignment has type "
                              f"{GGUF_TYPE_NAMES.get(self.kv_types['general.alignment'], '?')}, the GGUF format "
                              f"requires uint32")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ExportError(f"{path}: general.alignment = {alignment!r} is not a power of two")
        data_start = align_up(cur.pos, alignment)

        self.tensors: dict[str, SourceTensor] = {}
        expected = 0   # where the next tensor's data must start, relative to the data section
        for name, ne, ttype, offset in infos:
            if ttype not in GGML_TYPES:
                raise ExportError(f"{path}: tensor '{show(name)}' has unknown ggml type {ttype}")
            tname, block, tsize = GGML_TYPES[ttype]
            if ne[0] % block:
                raise ExportError(f"{path}: tensor '{show(name)}' row length {ne[0]} is not a multiple of the {tname} "
                                  f"block size {block}")
            nbytes = math.prod(ne) // block * tsize
            start = data_start + offset
            if start + nbytes > size:
                raise ExportError(f"{path}: data of tensor '{show(name)}' (offset {start}, {nbytes} bytes) runs past the end "
                                  f"of the file ({size} bytes): truncated GGUF")
            check_tensor_offset(path, show(name), offset, expected, alignment)
            expected = offset + align_up(nbytes, alignment)
            self.tensors[name] = SourceTensor(name, ttype, tname, tuple(reversed(ne)), buf, start, nbytes, str(path))

    # Typed metadata access. Integer keys accept any integer type: docs/gguf.md gives e.g.
    # [llm].context_length as uint64, while llama.cpp's converter (gguf-py) writes uint32.
    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        if key not in self.kv:
            if default is ...:
                raise ExportError(f"{self.path}: required metadata key '{key}' is missing")
            return default
        v = self.kv[key]
        vtype = GGUF_TYPE_NAMES.get(self.kv_types[key], "?")
        if isinstance(v, np.ndarray) and kind in (int, float) and v.size > 0:
            # per-layer arrays (e.g. head_count) are fine when all layers agree
            if not np.all(v == v.flat[0]):
                raise ExportError(f"{self.path}: metadata '{key}' differs between layers, which is not supported")
            v = v.flat[0].item()
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ExportError(f"{self.path}: metadata '{key}' has type {vtype}, expected an integer")
            return v
        if kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ExportError(f"{self.path}: metadata '{key}' has type {vtype}, expected a number")
            return float(v)
        if kind is str and not isinstance(v, str):
            raise ExportError(f"{self.path}: metadata '{key}' has type {vtype}, expected a string")
        if kind is bool and not isinstance(v, bool):
            raise ExportError(f"{self.path}: metadata '{key}' has type {vtype}, expected a bool")
        if kind is list and not isinstance(v, (list, np.ndarray)):
            raise ExportError(f"{self.path}: metadata '{key}' has type {vtype}, expected an array")
        return v


# ---------------------------------------------------------------------------------------------
# safetensors (the format: the "Format" section of the huggingface/safetensors README)

SAFETENSORS_DTYPES = {"F32": F32, "F16": F16, "BF16": BF16}
SAFETENSORS_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4,
                     "F32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
                     "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1}
SAFETENSORS_MAX_HEADER = 100_000_000


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise ExportError(f"duplicate key '{show(k)}'")
        d[k] = v
    return d


def read_safetensors(path: Path) -> dict[str, SourceTensor]:
    buf, size = map_file(path)
    if size < 8:
        raise ExportError(f"{path}: too small to be a safetensors file ({size} bytes)")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if hlen > SAFETENSORS_MAX_HEADER or 8 + hlen > size:
        raise ExportError(f"{path}: safetensors header length {hlen} is past the end of the file ({size} bytes): "
                          f"truncated or corrupt")
    try:
        header = json.loads(buf[8:8 + hlen].decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except ExportError as e:
        raise ExportError(f"{path}: bad safetensors header: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nesting too deep
        raise ExportError(f"{path}: bad safetensors JSON header: {e}") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path}: bad safetensors header: not a JSON object")
    base = 8 + hlen
    out: dict[str, SourceTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if not isinstance(dtype, str) or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise TypeError
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ExportError(f"{path}: bad safetensors header entry for '{show(name)}': {json.dumps(info)[:200]}") from None
        if base + end > size:
            raise ExportError(f"{path}: data of tensor '{show(name)}' (bytes {begin}..{end}) runs past the end of the file: "
                              f"truncated safetensors")
        if dtype in SAFETENSORS_SIZES and end - begin != math.prod(shape) * SAFETENSORS_SIZES[dtype]:
            raise ExportError(f"{path}: tensor '{show(name)}' has {end - begin} bytes of data but shape {list(shape)} of "
                              f"{dtype} needs {math.prod(shape) * SAFETENSORS_SIZES[dtype]}")
        out[name] = SourceTensor(name, SAFETENSORS_DTYPES.get(dtype), dtype, shape, buf, base + begin, end - begin, str(path))
    return out


def read_json(path: Path, what: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise ExportError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nesting too deep
        raise ExportError(f"bad JSON in {what} {path}: {e}") from None


class HFCheckpoint:
    """A Hugging Face model directory: config.json plus one or more safetensors files."""

    def __init__(self, path: Path):
        self.path = path
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ExportError(f"{path}: no config.json (not a Hugging Face model directory)")
        self.config = read_json(cfg_path, "config")
        if not isinstance(self.config, dict):
            raise ExportError(f"{cfg_path}: not a JSON object")
        self.files = self._weight_files()
        self.tensors: dict[str, SourceTensor] = {}

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            data = read_json(index, "safetensors index")
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise ExportError(f"{index}: no valid 'weight_map'")
            self._index_map = wm
            files = sorted(set(wm.values()))
            for f in files:
                if "/" in f or "\\" in f or f.startswith("."):
                    raise ExportError(f"{index}: invalid shard file name '{f}'")
            return [self.path / f for f in files]
        self._index_map = None
        single = self.path / "model.safetensors"
        if single.is_file():
            return [single]
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ExportError(f"{self.path}: no model.safetensors (or sharded *.safetensors) found")
        return shards

    def load_tensors(self) -> None:
        for f in self.files:
            if not f.is_file():
                raise ExportError(f"{f}: shard listed in model.safetensors.index.json is missing")
            for name, t in read_safetensors(f).items():
                if name in self.tensors:
                    raise ExportError(f"duplicate tensor '{show(name)}' in {self.tensors[name].origin} and {f}")
                self.tensors[name] = t
        if self._index_map is not None:
            for name, shard in self._index_map.items():
                if name not in self.tensors:
                    raise ExportError(f"tensor '{show(name)}' listed in the index is missing from {shard}")


# ---------------------------------------------------------------------------------------------
# Architecture families: one table of names per family, and the flags (the manual above, "The model file",
# header offset 56) that say which extra tensors every model of the family has.

FLAG_TIED, FLAG_QKV_BIAS, FLAG_QK_NORM, FLAG_POST_NORMS, FLAG_ROPE_FREQS, FLAG_SPLIT = 1, 2, 4, 8, 16, 32
ACT_SILU, ACT_GELU_TANH = 0, 1


@dataclass(frozen=True)
class Family:
    name: str
    arch_id: int
    hf_architectures: tuple[str, ...]
    activation: int                       # 0 SiLU, 1 tanh-GELU
    gguf_qk_interleaved: bool = False     # Q/K rows permuted by LlamaModel.permute (llama.cpp's convert_hf_to_gguf.py)
    gguf_names: dict[str, str] = field(default_factory=dict)
    hf_names: dict[str, str] = field(default_factory=dict)
    hf_ignored: tuple[str, ...] = ()      # regexes of HF tensors that carry nothing we need
    layout: Callable[[Hyper], Iterator[tuple[str, list[tuple[str, int, int]]]]] | None = None   # output tensors
    flags: int = 0                        # FLAG_QKV_BIAS / FLAG_QK_NORM / FLAG_POST_NORMS: tensors every model has
    hf_tied_default: bool = False         # tie_word_embeddings when config.json omits it (the transformers default)
    hf_norm_shift: float = 0.0            # added to every norm weight read from HF (Gemma computes x_hat * (1 + w))
    chat_without_template: int = 0        # chat template kind when the file has no template text (see vocab_*)


LLAMA_GGUF_NAMES = {
    "tok_embeddings": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
    "attn_norm": "blk.{n}.attn_norm.weight", "wq": "blk.{n}.attn_q.weight", "wk": "blk.{n}.attn_k.weight",
    "wv": "blk.{n}.attn_v.weight", "wo": "blk.{n}.attn_output.weight", "ffn_norm": "blk.{n}.ffn_norm.weight",
    "w1": "blk.{n}.ffn_gate.weight", "w3": "blk.{n}.ffn_up.weight", "w2": "blk.{n}.ffn_down.weight",
    "rope_freqs": "rope_freqs.weight",
}
LLAMA_HF_NAMES = {
    "tok_embeddings": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight",
    "attn_norm": "model.layers.{n}.input_layernorm.weight", "wq": "model.layers.{n}.self_attn.q_proj.weight",
    "wk": "model.layers.{n}.self_attn.k_proj.weight", "wv": "model.layers.{n}.self_attn.v_proj.weight",
    "wo": "model.layers.{n}.self_attn.o_proj.weight", "ffn_norm": "model.layers.{n}.post_attention_layernorm.weight",
    "w1": "model.layers.{n}.mlp.gate_proj.weight", "w3": "model.layers.{n}.mlp.up_proj.weight",
    "w2": "model.layers.{n}.mlp.down_proj.weight",
    "rope_freqs": "rope_freqs (computed from config.json rope_scaling)",   # not a file tensor: see export()
}
BIAS_GGUF_NAMES = {"bq": "blk.{n}.attn_q.bias", "bk": "blk.{n}.attn_k.bias", "bv": "blk.{n}.attn_v.bias"}
BIAS_HF_NAMES = {"bq": "model.layers.{n}.self_attn.q_proj.bias", "bk": "model.layers.{n}.self_attn.k_proj.bias",
                 "bv": "model.layers.{n}.self_attn.v_proj.bias"}
QK_NORM_GGUF_NAMES = {"q_norm": "blk.{n}.attn_q_norm.weight", "k_norm": "blk.{n}.attn_k_norm.weight"}
QK_NORM_HF_NAMES = {"q_norm": "model.layers.{n}.self_attn.q_norm.weight",
                    "k_norm": "model.layers.{n}.self_attn.k_norm.weight"}
# Gemma 3's sandwich norms. In its GGUF, ffn_norm is the norm BEFORE the FFN (llama.cpp's gemma3 graph applies
# attn_norm, attention, post_attention_norm, residual, ffn_norm, FFN, post_ffw_norm, residual); in Hugging Face's
# modeling_gemma3 that one is pre_feedforward_layernorm and post_attention_layernorm is the norm AFTER attention.
GEMMA3_GGUF_NAMES = {**LLAMA_GGUF_NAMES, **QK_NORM_GGUF_NAMES, "post_attn_norm": "blk.{n}.post_attention_norm.weight",
                     "post_ffn_norm": "blk.{n}.post_ffw_norm.weight"}
GEMMA3_HF_NAMES = {**LLAMA_HF_NAMES, **QK_NORM_HF_NAMES,
                   "ffn_norm": "model.layers.{n}.pre_feedforward_layernorm.weight",
                   "post_attn_norm": "model.layers.{n}.post_attention_layernorm.weight",
                   "post_ffn_norm": "model.layers.{n}.post_feedforward_layernorm.weight"}


def llama_layout(hp: Hyper) -> Iterator[tuple[str, list[tuple[str, int, int]]]]:
    """(output name, [(part key, rows, cols)]) in file order (the manual's tensor table).

    Every family shares this layout; the flags add their tensors. A vector made of several
    parts (bqkv) concatenates them. A generator, so a corrupt layer count fails at the first
    missing tensor instead of building a huge list."""
    d, hd = hp.dim, hp.head_dim
    q_dim, kv_dim = hp.n_heads * hd, hp.n_kv_heads * hd
    yield "tok_embeddings", [("tok_embeddings", hp.vocab_size, d)]
    if hp.flags & FLAG_ROPE_FREQS:
        yield "rope_freqs", [("rope_freqs", 1, hp.rope_dim // 2)]
    for n in range(hp.n_layers):
        p = f"layers.{n}."
        yield p + "attn_norm", [(f"attn_norm@{n}", 1, d)]
        yield p + "wqkv", [(f"wq@{n}", q_dim, d), (f"wk@{n}", kv_dim, d), (f"wv@{n}", kv_dim, d)]
        if hp.flags & FLAG_QKV_BIAS:
            yield p + "bqkv", [(f"bq@{n}", 1, q_dim), (f"bk@{n}", 1, kv_dim), (f"bv@{n}", 1, kv_dim)]
        if hp.flags & FLAG_QK_NORM:
            yield p + "q_norm", [(f"q_norm@{n}", 1, hd)]
            yield p + "k_norm", [(f"k_norm@{n}", 1, hd)]
        yield p + "wo", [(f"wo@{n}", d, q_dim)]
        if hp.flags & FLAG_POST_NORMS:
            yield p + "post_attn_norm", [(f"post_attn_norm@{n}", 1, d)]
        yield p + "ffn_norm", [(f"ffn_norm@{n}", 1, d)]
        yield p + "w13", [(f"w1@{n}", hp.hidden_dim, d), (f"w3@{n}", hp.hidden_dim, d)]
        yield p + "w2", [(f"w2@{n}", d, hp.hidden_dim)]
        if hp.flags & FLAG_POST_NORMS:
            yield p + "post_ffn_norm", [(f"post_ffn_norm@{n}", 1, d)]
    yield "norm", [("norm", 1, d)]
    if not hp.tied:
        yield "output", [("output", hp.vocab_size, d)]


# Norm vectors (a Gemma HF checkpoint's get +1) and the other vectors; all are written as F32.
NORM_PARTS = {"attn_norm", "ffn_norm", "norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"}
VECTOR_PARTS = NORM_PARTS | {"bq", "bk", "bv", "rope_freqs"}

FAMILIES = {
    "llama": Family("llama", 1, ("LlamaForCausalLM",), ACT_SILU, gguf_qk_interleaved=True,
                    gguf_names=LLAMA_GGUF_NAMES, hf_names=LLAMA_HF_NAMES,
                    hf_ignored=(r".*\.rotary_emb\.inv_freq$",), layout=llama_layout),
    "qwen2": Family("qwen2", 2, ("Qwen2ForCausalLM",), ACT_SILU, gguf_names={**LLAMA_GGUF_NAMES, **BIAS_GGUF_NAMES},
                    hf_names={**LLAMA_HF_NAMES, **BIAS_HF_NAMES}, hf_ignored=(r".*\.rotary_emb\.inv_freq$",),
                    layout=llama_layout, flags=FLAG_QKV_BIAS),
    "qwen3": Family("qwen3", 3, ("Qwen3ForCausalLM",), ACT_SILU, gguf_names={**LLAMA_GGUF_NAMES, **QK_NORM_GGUF_NAMES},
                    hf_names={**LLAMA_HF_NAMES, **QK_NORM_HF_NAMES}, hf_ignored=(r".*\.rotary_emb\.inv_freq$",),
                    layout=llama_layout, flags=FLAG_QK_NORM),
    # Gemma 3 GGUFs often carry no chat template (the 270M one does not); <start_of_turn>/<end_of_turn>
    # exist only for Gemma's own template, so that is used when they are in the vocabulary.
    "gemma3": Family("gemma3", 4, ("Gemma3ForCausalLM",), ACT_GELU_TANH, gguf_names=GEMMA3_GGUF_NAMES,
                     hf_names=GEMMA3_HF_NAMES, layout=llama_layout, flags=FLAG_QK_NORM | FLAG_POST_NORMS,
                     hf_tied_default=True, hf_norm_shift=1.0, chat_without_template=2),
}


def family_for_gguf(arch: str, tokenizer_only: bool) -> Family:
    fam = FAMILIES.get(arch)
    if fam is None or not (fam.layout or tokenizer_only):
        raise ExportError(f"unsupported architecture '{show(arch)}' (supported: {', '.join(FAMILIES)})")
    return fam


def family_for_hf(archs: Any, tokenizer_only: bool) -> Family:
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ExportError(f"config.json 'architectures' is missing or invalid: {archs!r}")
    for fam in FAMILIES.values():
        if archs[0] in fam.hf_architectures and (fam.layout or tokenizer_only):
            return fam
    supported = ", ".join(a for fam in FAMILIES.values() for a in fam.hf_architectures)
    raise ExportError(f"unsupported architecture '{show(archs[0])}' (supported: {supported})")


# ---------------------------------------------------------------------------------------------
# Hyperparameters

# What the engine's loader accepts (run.c, read_config): each size in [1, limit], plus the rules in
# Hyper.check. A file outside them would be written and then refused by ./run, so export refuses it.
ENGINE_LIMITS = dict(dim=1 << 16, hidden_dim=1 << 16, n_layers=1024, n_heads=1024, n_kv_heads=1024, head_dim=1024,
                     vocab_size=1 << 24, max_seq_len=1 << 20)


def as_float32(x: float) -> float:
    """x as the header's f32 field stores it (too large -> inf, too small -> 0)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


@dataclass
class Hyper:
    family: Family
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    rope_dim: int
    tied: bool
    # The model-family fields (the manual above, "The model file"); 0 means "not used" as in the header.
    flags: int = 0                # FLAG_QKV_BIAS | FLAG_QK_NORM | FLAG_POST_NORMS | FLAG_ROPE_FREQS (not FLAG_TIED)
    activation: int = ACT_SILU
    embed_scale: float = 0.0      # each embedding row times this (0: 1)
    attn_scale: float = 0.0       # q.k times this (0: 1/sqrt(head_dim))
    window: int = 0               # sliding window of the local layers (0: no local layers)
    window_pattern: int = 0       # layer l is global when (l + 1) % pattern == 0 (0: every layer local)
    rope_theta_local: float = 0.0  # RoPE base of local layers (0: rope_theta)
    rope_scale_global: float = 0.0  # linear RoPE scaling of global layers (0: 1)
    rope_freqs: np.ndarray | None = None   # per-pair factors computed from an HF config (a GGUF has a tensor)

    def check(self, where: str, keys: dict[str, str]) -> None:
        """Refuse what the engine would refuse in the header; `keys` names each field's source key."""
        def bad(name: str, why: str) -> ExportError:
            return ExportError(f"{where}: {keys.get(name, name)} = {getattr(self, name)!r} {why}")

        for name, limit in ENGINE_LIMITS.items():
            if not 1 <= getattr(self, name) <= limit:
                raise bad(name, f"is outside [1, {limit}], what the engine accepts")
        if self.n_heads % self.n_kv_heads:
            raise bad("n_kv_heads", f"does not divide {keys['n_heads']} = {self.n_heads}")
        if self.head_dim % 2:
            raise bad("head_dim", "is odd (RoPE rotates pairs of dimensions)")
        if self.n_heads * self.head_dim > ENGINE_LIMITS["dim"]:
            raise bad("head_dim", f"times {self.n_heads} heads exceeds {ENGINE_LIMITS['dim']}, what the engine accepts")
        if not 2 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise bad("rope_dim", f"is not an even number in [2, head_dim {self.head_dim}]")
        theta, eps = as_float32(self.rope_theta), as_float32(self.norm_eps)
        if not (math.isfinite(theta) and theta > 1):
            raise bad("rope_theta", "is not a finite number > 1 as float32")
        if not (math.isfinite(eps) and eps > 0):
            raise bad("norm_eps", "is not a finite number > 0 as float32")
        if not 0 <= self.window_pattern < 2**32:
            raise bad("window_pattern", "does not fit the header's u32 field")
        if self.window > self.max_seq_len:
            raise bad("window", f"is larger than the context ({keys['max_seq_len']} = {self.max_seq_len})")
        for name in ("embed_scale", "attn_scale", "rope_scale_global"):
            v = as_float32(getattr(self, name))
            if v != 0 and not (math.isfinite(v) and v > 0):
                raise bad(name, "is not a finite number > 0 as float32")
        local = as_float32(self.rope_theta_local)
        if local != 0 and not (math.isfinite(local) and local > 1):
            raise bad("rope_theta_local", "is not a finite number > 1 as float32")
        if self.rope_freqs is not None:
            check_rope_factors(self.rope_freqs, f"{where}: {keys.get('rope_freqs', 'rope_freqs')}")


def check_rope_factors(factors: np.ndarray, what: str) -> None:
    """RoPE frequency factors divide a frequency: each must be a finite number > 0 (as the engine checks)."""
    bad = np.flatnonzero(~(np.isfinite(factors) & (factors > 0)))
    if bad.size:
        raise ExportError(f"{what}: factor {bad[0]} = {float(factors[bad[0]])!r} is not a finite number > 0")


def swa_pattern(is_local: list[bool], what: str) -> int:
    """The header's pattern p for a list of per-layer "local" flags: layer l is global exactly when
    (l + 1) % p == 0 (p = 0: every layer local). Refuses a list no such p describes."""
    n = len(is_local)
    if all(is_local):
        return 0
    for p in range(1, n + 1):
        if all(is_local[l] == ((l + 1) % p != 0) for l in range(n)):
            return p
    raise ExportError(f"{what}: the local/global layer list {['L' if x else 'G' for x in is_local]} is not "
                      f"'every p-th layer global', the only arrangement the model file can describe")


def check_rope_scaling(kind: Any, factor: Any, where: str) -> None:
    """Only "no scaling" is implemented: type none/linear/default with factor 1 (or absent/0)."""
    kind_ok = kind in (None, "none", "linear", "default")
    factor_ok = factor in (None, 0, 0.0, 1, 1.0)
    if not (kind_ok and factor_ok):
        raise ExportError(f"{where}: rope scaling type '{kind}' with factor {factor} is not supported "
                          f"(only no scaling / linear with factor 1)")


def family_fields(read: Callable[[], None], hp: Hyper, strict: bool) -> None:
    """Fill hp's family fields with `read`. --tokenizer-only (not strict) writes no tensors, so a
    problem with the model's structure is no reason to refuse it: the fields then stay 0."""
    hp.flags, hp.activation = hp.family.flags, hp.family.activation
    try:
        read()
    except ExportError:
        if strict:
            raise
        hp.flags, hp.embed_scale, hp.attn_scale, hp.rope_freqs = 0, 0.0, 0.0, None
        hp.window, hp.window_pattern, hp.rope_theta_local, hp.rope_scale_global = 0, 0, 0.0, 0.0


# The local RoPE base and sliding-window pattern llama.cpp uses for gemma3 when the GGUF does not say
# (llama-model.cpp, LLM_ARCH_GEMMA3: set_swa_pattern(6), rope_freq_base_train_swa = 10000).
GEMMA3_DEFAULT_PATTERN = 6
GEMMA3_DEFAULT_LOCAL_THETA = 10000.0
GEMMA3_27B_LAYERS = 62   # llama.cpp's LLM_TYPE_27B: attention scale 1/sqrt(dim / n_heads) instead of 1/sqrt(head_dim)


def gguf_family_fields(g: GGUFFile, a: str, hp: Hyper, keys: dict[str, str]) -> None:
    """The family fields and flags of a GGUF (llama.cpp's metadata keys and tensor names)."""
    fam, where = hp.family, str(g.path)
    scale_type = g.kv.get(f"{a}.rope.scaling.type")
    factor_key = f"{a}.rope.scaling.factor" if f"{a}.rope.scaling.factor" in g.kv else f"{a}.rope.scale_linear"
    factor = g.kv.get(factor_key)
    linear = scale_type == "linear" or (scale_type is None and factor_key.endswith("scale_linear"))
    if fam.name == "gemma3" and linear and isinstance(factor, (int, float)) and factor not in (0, 1):
        hp.rope_scale_global = float(factor)   # llama.cpp: freq_scale applies to the non-SWA layers only
        keys["rope_scale_global"] = factor_key
    else:
        check_rope_scaling(scale_type, factor, where)
    if "rope_freqs.weight" in g.tensors:
        if fam.name != "llama":
            raise ExportError(f"{where}: rope_freqs.weight in a {fam.name} GGUF is not supported")
        hp.flags |= FLAG_ROPE_FREQS   # the factors are checked when the tensor is read (build_plan)
    check_bias_presence(g.tensors, fam.gguf_names, hp.n_layers, where)
    if fam.name != "gemma3":
        return
    for key in (f"{a}.final_logit_softcapping", f"{a}.attn_logit_softcapping"):
        if key in g.kv:
            raise ExportError(f"{where}: {key} is set: logit soft-capping is not supported")
    # llama.cpp's gemma3 graph scales the embedding by sqrtf(n_embd) in float32
    hp.embed_scale = as_float32(math.sqrt(hp.dim))
    if hp.n_layers == GEMMA3_27B_LAYERS and hp.dim // hp.n_heads != hp.head_dim:
        hp.attn_scale = as_float32(1 / math.sqrt(hp.dim // hp.n_heads))
        keys["attn_scale"] = f"attention scale 1/sqrt({a}.embedding_length / head_count) (27B)"
    hp.window = g.get(f"{a}.attention.sliding_window", int)
    keys["window"] = f"{a}.attention.sliding_window"
    pattern_key = f"{a}.attention.sliding_window_pattern"
    pattern = g.kv.get(pattern_key, GEMMA3_DEFAULT_PATTERN)
    if isinstance(pattern, np.ndarray):   # one bool per layer, true = sliding window
        if pattern.size != hp.n_layers:
            raise ExportError(f"{where}: {pattern_key} has {pattern.size} entries for {hp.n_layers} layers")
        pattern = swa_pattern([bool(x) for x in pattern], f"{where}: {pattern_key}")
    elif isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ExportError(f"{where}: {pattern_key} = {show(repr(pattern))} is not a layer count >= 0")
    hp.window_pattern = pattern
    hp.rope_theta_local = g.get(f"{a}.rope.freq_base_swa", float, GEMMA3_DEFAULT_LOCAL_THETA)
    keys["rope_theta_local"] = f"{a}.rope.freq_base_swa"


def check_bias_presence(tensors: dict[str, SourceTensor], names: dict[str, str], n_layers: int, where: str) -> None:
    """A Q/K/V bias on some projections of a layer but not on the others is refused (never half-applied)."""
    if "bq" not in names:
        return   # the family has no biases: any bias tensor is refused as unexpected by build_plan
    for n in range(n_layers):
        have = [names[k].format(n=n) in tensors for k in ("bq", "bk", "bv")]
        if any(have) and not all(have):
            present = next(names[k].format(n=n) for k, h in zip(("bq", "bk", "bv"), have) if h)
            missing = next(names[k].format(n=n) for k, h in zip(("bq", "bk", "bv"), have) if not h)
            raise ExportError(f"{where}: layer {n} has the bias '{present}' but not '{missing}': a bias on some "
                              f"of the Q, K, V projections only is not supported")


def hparams_from_gguf(g: GGUFFile, fam: Family, strict: bool) -> Hyper:
    a = g.get("general.architecture", str)
    dim = g.get(f"{a}.embedding_length", int)
    n_heads = g.get(f"{a}.attention.head_count", int)
    if n_heads <= 0:
        raise ExportError(f"{g.path}: {a}.attention.head_count = {n_heads} is invalid")
    keys = dict(dim=f"{a}.embedding_length", hidden_dim=f"{a}.feed_forward_length", n_layers=f"{a}.block_count",
                n_heads=f"{a}.attention.head_count", n_kv_heads=f"{a}.attention.head_count_kv",
                head_dim=f"{a}.attention.key_length", vocab_size=f"{a}.vocab_size", max_seq_len=f"{a}.context_length",
                rope_theta=f"{a}.rope.freq_base", norm_eps=f"{a}.attention.layer_norm_rms_epsilon",
                rope_dim=f"{a}.rope.dimension_count")
    if f"{a}.attention.key_length" in g.kv:
        head_dim = g.get(f"{a}.attention.key_length", int)
    elif dim % n_heads:
        raise ExportError(f"{g.path}: embedding_length {dim} is not a multiple of head_count {n_heads}")
    else:
        head_dim = dim // n_heads
        keys["head_dim"] = f"head_dim ({a}.embedding_length / {a}.attention.head_count)"
    value_len = g.get(f"{a}.attention.value_length", int, head_dim)
    if strict and value_len != head_dim:
        raise ExportError(f"{g.path}: value_length {value_len} != key_length {head_dim} is not supported")
    tokens = g.kv.get("tokenizer.ggml.tokens")
    if "token_embd.weight" in g.tensors:
        vocab = g.tensors["token_embd.weight"].rows_cols[0]
        keys["vocab_size"] = "the rows of token_embd.weight"
    else:
        vocab = g.get(f"{a}.vocab_size", int, len(tokens) if isinstance(tokens, list) else 0)
    declared = g.get(f"{a}.vocab_size", int, vocab)
    if strict and declared != vocab:
        raise ExportError(f"{g.path}: token_embd.weight has {vocab} rows but {a}.vocab_size is {declared}")
    n_kv = g.get(f"{a}.attention.head_count_kv", int, n_heads)
    hp = Hyper(fam, dim, g.get(f"{a}.feed_forward_length", int), g.get(f"{a}.block_count", int), n_heads,
               n_kv, head_dim, vocab, g.get(f"{a}.context_length", int),
               g.get(f"{a}.rope.freq_base", float, 10000.0), g.get(f"{a}.attention.layer_norm_rms_epsilon", float),
               g.get(f"{a}.rope.dimension_count", int, head_dim), "output.weight" not in g.tensors)
    family_fields(lambda: gguf_family_fields(g, a, hp, keys), hp, strict)
    hp.check(str(g.path), keys)
    if strict and fam.gguf_qk_interleaved and hp.rope_dim != hp.head_dim:
        raise ExportError(f"{g.path}: rope.dimension_count {hp.rope_dim} != head_dim {hp.head_dim} (llama requires equal)")
    return hp


def hparams_from_hf(ck: HFCheckpoint, fam: Family, strict: bool) -> Hyper:
    c = ck.config
    where = str(ck.path / "config.json")

    def num(key: str, kind: type, default: Any = ..., within: dict = c) -> Any:
        v = within.get(key)
        if v is None:
            if default is ...:
                raise ExportError(f"{where}: required key '{key}' is missing")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise ExportError(f"{where}: '{key}' = {show(repr(v))} is not a valid {kind.__name__}")
        try:
            return kind(v)
        except OverflowError:   # an integer too large for a float
            raise ExportError(f"{where}: '{key}' = {show(repr(v))} is out of range") from None

    dim = num("hidden_size", int)
    n_heads = num("num_attention_heads", int)
    if n_heads <= 0:
        raise ExportError(f"{where}: num_attention_heads = {n_heads} is invalid")
    head_dim = num("head_dim", int, dim // n_heads)
    rope_params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    if c.get("rope_theta") is None and rope_params.get("rope_theta") is not None:   # newer transformers configs
        theta_key, theta = "rope_parameters.rope_theta", num("rope_theta", float, within=rope_params)
    else:
        theta_key, theta = "rope_theta", num("rope_theta", float, 10000.0)
    vocab = num("vocab_size", int)
    # absent: the transformers config class's default (False for Llama/Qwen, True for Gemma 3)
    tied = c.get("tie_word_embeddings", fam.hf_tied_default)
    if not isinstance(tied, bool):
        raise ExportError(f"{where}: tie_word_embeddings = {show(repr(tied))} is not true or false")
    hp = Hyper(fam, dim, num("intermediate_size", int), num("num_hidden_layers", int), n_heads,
               num("num_key_value_heads", int, n_heads), head_dim, vocab, num("max_position_embeddings", int),
               theta, num("rms_norm_eps", float, 1e-6), head_dim, tied)
    head_key = "head_dim" if "head_dim" in c else "head_dim (hidden_size / num_attention_heads)"
    keys = dict(dim="hidden_size", hidden_dim="intermediate_size", n_layers="num_hidden_layers",
                n_heads="num_attention_heads", n_kv_heads="num_key_value_heads", head_dim=head_key,
                vocab_size="vocab_size", max_seq_len="max_position_embeddings", rope_theta=theta_key,
                norm_eps="rms_norm_eps", rope_dim=head_key)
    family_fields(lambda: hf_family_fields(c, hp, keys, where, num), hp, strict)
    hp.check(where, keys)
    return hp


def hf_rope_scaling(c: dict, where: str) -> tuple[str, dict]:
    """(key name, dict) of the config's RoPE scaling: rope_scaling, or the newer rope_parameters."""
    for key in ("rope_scaling", "rope_parameters"):
        v = c.get(key)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise ExportError(f"{where}: {key} = {show(repr(v))} is invalid")
        if v.get("rope_type", v.get("type")) not in (None, "default"):
            return key, v
    return "rope_scaling", {}


def llama3_rope_factors(sc: dict, theta: float, rope_dim: int, key: str, where: str) -> np.ndarray:
    """Per-pair frequency factors of rope_type "llama3" (transformers' _compute_llama3_parameters in
    modeling_rope_utils.py): pair i's inverse frequency theta^(-2i/rope_dim) is kept when its wavelength
    is below original_max_position_embeddings / high_freq_factor, divided by `factor` when above
    original_max_position_embeddings / low_freq_factor, and in between divided by 1/((1-s)/factor + s)
    with s = (original_max_position_embeddings / wavelength - low_freq_factor) / (high - low).
    The header's rope_freqs tensor holds these divisors (llama.cpp's convert_hf_to_gguf.py writes the same)."""
    def need(name: str) -> float:
        v = sc.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ExportError(f"{where}: {key}.{name} = {show(repr(v))} is missing or not a number > 0")
        return float(v)

    factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
    old_ctx = need("original_max_position_embeddings")
    if high <= low:
        raise ExportError(f"{where}: {key}.high_freq_factor = {high} is not larger than low_freq_factor = {low}")
    inv_freq = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, medium))
    return out.astype(np.float32)


def hf_family_fields(c: dict, hp: Hyper, keys: dict[str, str], where: str, num: Callable[..., Any]) -> None:
    """The family fields and flags of a Hugging Face config.json (transformers' config classes)."""
    fam = hp.family
    for key in ("mlp_bias", "use_sliding_window", "use_bidirectional_attention"):
        if c.get(key):
            raise ExportError(f"{where}: {key} = true is not supported")
    if c.get("attention_bias") and fam.name != "qwen2":   # Qwen 2's q/k/v biases are always there
        raise ExportError(f"{where}: attention_bias = true is not supported for {fam.name}")
    if fam.name == "gemma3":
        gemma3_hf_fields(c, hp, keys, where, num)
        return
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ExportError(f"{where}: hidden_act '{show(str(act))}' is not supported (need silu)")
    key, sc = hf_rope_scaling(c, where)
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "llama3" and fam.name == "llama":
        hp.rope_freqs = llama3_rope_factors(sc, hp.rope_theta, hp.rope_dim, key, where)
        hp.flags |= FLAG_ROPE_FREQS
        keys["rope_freqs"] = f"{key} (llama3)"
    else:
        check_rope_scaling(kind, sc.get("factor"), f"{where}: {key}")


def gemma3_hf_fields(c: dict, hp: Hyper, keys: dict[str, str], where: str, num: Callable[..., Any]) -> None:
    """Gemma 3 (transformers' Gemma3TextConfig, modeling_gemma3.py)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise ExportError(f"{where}: {key} = {show(repr(c.get(key)))}: logit soft-capping is not supported")
    act_key = "hidden_activation" if "hidden_activation" in c else "hidden_act"
    act = c.get(act_key, "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ExportError(f"{where}: {act_key} '{show(str(act))}' is not supported (need gelu_pytorch_tanh)")
    # Written as llama.cpp does (sqrtf(n_embd) in float32); modeling_gemma3 rounds it to the weights' dtype.
    hp.embed_scale = as_float32(math.sqrt(hp.dim))
    qpas = num("query_pre_attn_scalar", float, float(hp.head_dim))
    if qpas != hp.head_dim:
        hp.attn_scale = as_float32(qpas ** -0.5)
        keys["attn_scale"] = "query_pre_attn_scalar^-0.5"
    types = c.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != hp.n_layers or \
                not all(t in ("sliding_attention", "full_attention") for t in types):
            raise ExportError(f"{where}: layer_types is not a list of {hp.n_layers} 'sliding_attention' / "
                              f"'full_attention' entries")
        is_local = [t == "sliding_attention" for t in types]
        pattern = swa_pattern(is_local, f"{where}: layer_types")
    else:
        pattern = num("sliding_window_pattern", int, GEMMA3_DEFAULT_PATTERN)
        if pattern < 0:
            raise ExportError(f"{where}: sliding_window_pattern = {pattern} is negative")
        is_local = [pattern == 0 or (l + 1) % pattern != 0 for l in range(hp.n_layers)]
    params = c.get("rope_parameters")
    per_type = params if isinstance(params, dict) and "full_attention" in params else None
    if per_type is not None:   # newer transformers: one RoPE dict per layer type
        full, local = per_type.get("full_attention"), per_type.get("sliding_attention", {})
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ExportError(f"{where}: rope_parameters.full_attention / sliding_attention is not an object")
        hp.rope_theta = num("rope_theta", float, 1e6, within=full)
        keys["rope_theta"] = "rope_parameters.full_attention.rope_theta"
        local_theta = num("rope_theta", float, GEMMA3_DEFAULT_LOCAL_THETA, within=local)
        keys["rope_theta_local"] = "rope_parameters.sliding_attention.rope_theta"
        check_rope_scaling(local.get("rope_type"), local.get("factor"), f"{where}: rope_parameters.sliding_attention")
        scale_key, sc = "rope_parameters.full_attention", full
    else:
        if c.get("rope_theta") is None:
            hp.rope_theta = 1e6   # Gemma3TextConfig's default
        local_theta = num("rope_local_base_freq", float, GEMMA3_DEFAULT_LOCAL_THETA)
        keys["rope_theta_local"] = "rope_local_base_freq"
        scale_key, sc = hf_rope_scaling(c, where)
    kind, factor = sc.get("rope_type", sc.get("type")), sc.get("factor")
    if kind == "linear" and isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor != 1:
        hp.rope_scale_global = float(factor)   # modeling_gemma3: the scaled RoPE is the global layers' only
        keys["rope_scale_global"] = f"{scale_key}.factor"
    else:
        check_rope_scaling(kind, factor, f"{where}: {scale_key}")
    if any(is_local):
        hp.window, hp.window_pattern, hp.rope_theta_local = num("sliding_window", int), pattern, local_theta
        keys["window"] = "sliding_window"


# ---------------------------------------------------------------------------------------------
# Output plan: which source tensors (parts) form each output tensor.

@dataclass
class Part:
    tensor: SourceTensor
    rows: int
    cols: int
    perm_heads: int = 0          # >0: undo llama.cpp's Q/K row interleave with this many heads
    shift: float = 0.0           # added to every value (Gemma HF norms: 1 + w)


@dataclass
class OutTensor:
    name: str
    parts: list[Part]
    rows: int
    cols: int
    out_type: int = F32
    offset: int = 0
    packed: bool = False          # a matrix product's weights: written in the packed layout (pack_rows)

    @property
    def nbytes(self) -> int:
        if self.packed:
            return packed_size(self.out_type, self.rows, self.cols)
        return self.rows * row_bytes(self.out_type, self.cols)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits (llama_tensor_get_type): the first and last eighth of the layers, and every
    third layer in between, get the larger type in the _M mixes."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def bits_per_weight(t: int) -> float:
    _, block, size = GGML_TYPES[t]
    return 8 * size / block


def is_quantized(t: int) -> bool:
    """ggml_is_quantized: a block type (llama.cpp applies its per-tensor rules only for these)."""
    return t not in (F32, F16, BF16)


def row_fallback(want: int, cols: int) -> int:
    """llama.cpp's tensor_type_fallback: a K type on rows that are not whole 256-element blocks becomes the
    32-element type of about its size; a row that is not whole 32-element blocks either becomes F16."""
    if cols % GGML_TYPES[want][1] and want in K_FALLBACK:
        want = K_FALLBACK[want]
    return F16 if cols % GGML_TYPES[want][1] else want


def llama_cpp_rule(role: str, layer: int, cols: int, dtype: str, tied: bool, n_layers: int) -> int:
    """The type llama.cpp's quantizer (src/llama-quant.cpp, llama_tensor_get_type, no importance matrix, no
    experts, not Falcon) picks for one source matrix for the file type `dtype`, before row_fallback. `role` is
    the part's key (tok_embeddings, output, wq, wk, wv, wo, w1, w3, w2). The output head, or the token
    embedding when it is also the head, becomes Q6_K (Q8_0 when it already is, or when its rows are not whole
    blocks of the default type); in the _M mixes attn_v (wv) and ffn_down (w2) become Q6_K on use_more_bits
    layers; the others keep the default. Float file types have no rules and no fallback."""
    want = DTYPE_DEFAULT[dtype]
    if not is_quantized(want) or dtype in PURE_DTYPES:
        return want
    if role == "output" or (tied and role == "tok_embeddings"):
        return Q8_0 if cols % GGML_TYPES[want][1] or want == Q8_0 else Q6_K
    if dtype in MORE_BITS_DTYPES and role in ("wv", "w2") and use_more_bits(layer, n_layers):
        return Q6_K
    return want


@dataclass
class TypeNotes:
    """What choose_out_type did that the user should hear about, one warning line each."""
    unblockable: list[str] = field(default_factory=list)   # row length not a multiple of 32: F16
    fallback: list[str] = field(default_factory=list)      # K type on a row length not a multiple of 256
    promoted: list[str] = field(default_factory=list)      # fused parts that need different activations
    split: dict[str, list[int]] = field(default_factory=dict)   # fused parts of different types: stored split


def keep_types(parts: list[Part]) -> list[int]:
    """--dtype keep: each part's source type, refused when the engine cannot run it (with the --dtype that
    converts it when export.py can decode it)."""
    for p in parts:
        t = p.tensor
        if t.ggml_type not in DECODERS:
            raise unsupported_type(t)
        if t.ggml_type not in NATIVE_TYPES:
            raise ExportError(f"tensor '{show(t.name)}' has type {type_name(t.ggml_type)}, which the engine does not "
                              f"run; --dtype q8_0 (or another --dtype) dequantizes and re-quantizes it")
    return [p.tensor.ggml_type for p in parts]


def settle_parts(out_name: str, types: list[int], notes: TypeNotes) -> int:
    """The type of a fused output tensor whose parts want `types`. Parts of different types are noted for the
    split form (split_plan), where each part keeps its type (a Q4_K_M file's attn_v is often Q6_K or Q8_0 beside
    Q4_K or Q5_0 attn_q), if they read one activation format; if not, the fused tensor takes the part type with
    the most bits per weight, so the other parts are dequantized and rounded onto that finer grid."""
    kinds = sorted(set(types), key=bits_per_weight)
    if len({ACTIVATION[t] for t in kinds}) > 1:
        notes.promoted.append(f"{out_name} ({'+'.join(type_name(t) for t in kinds)} -> {type_name(kinds[-1])})")
    elif len(kinds) > 1:
        notes.split[out_name] = types
    return kinds[-1]


def choose_out_type(out_name: str, parts: list[Part], keys: list[str], is_vector: bool, dtype: str, hp: Hyper,
                    notes: TypeNotes) -> int:
    """The type of one output tensor for --dtype `dtype` (see the module docstring); `keys` are the parts'
    layout keys (wq@3, ...), which say each part's role and layer."""
    if is_vector:
        return F32
    cols = parts[0].cols
    if dtype == "keep":
        return settle_parts(out_name, keep_types(parts), notes)
    types = []
    for key in keys:
        role, _, layer = key.partition("@")
        rule = llama_cpp_rule(role, int(layer or 0), cols, dtype, hp.tied, hp.n_layers)
        want = row_fallback(rule, cols) if is_quantized(rule) else rule
        note = None
        if want == F16 and rule != F16:
            note, kind = f"{out_name} ({cols})", notes.unblockable
        elif want != rule:
            note, kind = f"{out_name} ({cols}: {type_name(rule)} -> {type_name(want)})", notes.fallback
        if note and note not in kind:   # the parts of one fused tensor share one note
            kind.append(note)
        types.append(want)
    return settle_parts(out_name, types, notes)


def warn_list(items: list[str], what: str) -> None:
    if items:
        warn(f"{len(items)} {what}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}")


# The split form's tensors for each fused projection (the manual above, flag bit 5), in the order of the fused rows.
SPLIT_NAMES = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}


def split_plan(plan: list[OutTensor], mixed: dict[str, list[int]]) -> list[OutTensor]:
    """The plan with every fused projection (wqkv, w13) written as its parts: each part takes its own type in
    the projections that `mixed` names (their parts' types, in order), the fused tensor's type in the others."""
    out = []
    for ot in plan:
        prefix, _, base = ot.name.rpartition(".")
        if base not in SPLIT_NAMES:
            out.append(ot)
            continue
        types = mixed.get(ot.name, [ot.out_type] * len(ot.parts))
        for part, name, t in zip(ot.parts, SPLIT_NAMES[base], types):
            out.append(OutTensor(f"{prefix}.{name}", [part], part.rows, part.cols, t))
    return out


def build_plan(hp: Hyper, tensors: dict[str, SourceTensor], names: dict[str, str], from_gguf: bool,
               dtype: str, ignored: tuple[str, ...], verbose: bool = False) -> list[OutTensor]:
    """The output tensors, in file order. When a fused projection's parts get different types (--dtype keep: the
    source's; another --dtype: llama.cpp's rules), every layer's projections are written split and FLAG_SPLIT is
    set in hp.flags. The K-type fallback is warned about when `dtype` is a K type or with `verbose`: otherwise
    the K type came from llama.cpp's rules, not from the user."""
    used: set[str] = set()
    plan = []
    notes = TypeNotes()
    for out_name, parts in hp.family.layout(hp):
        srcs = []
        for key, rows, cols in parts:
            base, _, layer = key.partition("@")
            src_name = names[base].format(n=layer)
            t = tensors.get(src_name)
            if t is None:
                raise ExportError(f"missing tensor '{src_name}'")
            used.add(src_name)
            if t.ggml_type is None:
                raise ExportError(f"tensor '{src_name}' has dtype {t.type_label}, which export.py cannot read "
                                  f"(supported: F32, F16, BF16)")
            r, c = t.rows_cols
            rank = 1 if base in VECTOR_PARTS else 2   # a vector, or a rows x cols matrix: never 3-D
            if (r, c) != (rows, cols) or len(t.shape) != rank:
                want = f"[{cols}]" if base in VECTOR_PARTS else f"{rows}x{cols}"
                raise ExportError(f"tensor '{src_name}' has shape {'x'.join(map(str, t.shape))}, expected {want} "
                                  f"from the model config (rows x cols)")
            perm = 0
            if from_gguf and hp.family.gguf_qk_interleaved and base in ("wq", "wk"):
                perm = hp.n_heads if base == "wq" else hp.n_kv_heads
                if hp.head_dim % 2:
                    raise ExportError(f"head_dim {hp.head_dim} is odd; cannot undo the Q/K row permutation")
            shift = hp.family.hf_norm_shift if not from_gguf and base in NORM_PARTS else 0.0
            srcs.append(Part(t, rows, cols, perm, shift))
        is_vector = parts[0][0].split("@")[0] in VECTOR_PARTS
        rows, cols = (1, sum(p.cols for p in srcs)) if is_vector else (sum(p.rows for p in srcs), srcs[0].cols)
        out_type = choose_out_type(out_name, srcs, [k for k, _, _ in parts], is_vector, dtype, hp, notes)
        for p in srcs:
            if p.tensor.ggml_type != out_type and p.tensor.ggml_type not in DECODERS:
                raise unsupported_type(p.tensor)
        plan.append(OutTensor(out_name, srcs, rows, cols, out_type))
    for name in tensors:
        if name in used or any(re.fullmatch(rx, name) for rx in ignored):
            continue
        if not from_gguf and hp.tied and name == names["output"]:
            continue   # tied checkpoints may still carry a copy of the embedding as lm_head
        raise ExportError(f"unexpected tensor '{show(name)}' ({hp.family.name} models with it are not supported)")
    warn_list(notes.unblockable, "matrices have a row length that is not a multiple of 32 and are written as F16 "
                                 "(llama.cpp's last fallback)")
    if verbose or DTYPE_DEFAULT.get(dtype) in K_FALLBACK:
        warn_list(notes.fallback, "matrices have a row length that is not a multiple of 256 and take llama.cpp's "
                                  "fallback for the K type")
    warn_list(notes.promoted, "fused tensors have parts of different types that the engine cannot run from one "
                              "activation format: parts of the finest type are copied, the others re-quantized to it")
    if notes.split:
        hp.flags |= FLAG_SPLIT
        plan = split_plan(plan, notes.split)
    return plan


def head_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Index array p with hf_rows = gguf_rows[p]: HF row h*hd + s*half + i = GGUF row h*hd + 2i + s.

    This undoes LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py."""
    return np.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


CHUNK_ELEMENTS = 1 << 16   # rows are converted in chunks of about this many values to bound memory


# The tensors the engine multiplies by (the manual above, "Packed matrices"), by the last part of their name; the
# token embedding is one of them when it is also the output head.
MATMUL_NAMES = ("wqkv", "wq", "wk", "wv", "wo", "w13", "w1", "w3", "w2", "output")
PACK_CHUNK_ROWS = 64 * PACK_ROWS   # rows packed at a time: bounds export.py's memory on large matrices


def is_matmul(name: str, tied: bool) -> bool:
    return name.rpartition(".")[2] in MATMUL_NAMES or (tied and name == "tok_embeddings")


class GroupWriter:
    """Receives a packed tensor's rows of ggml blocks in any chunks and writes them as whole packed groups;
    finish() writes the last group, padded with zero rows."""

    def __init__(self, out_type: int, write: Callable[[np.ndarray], None]):
        self.type, self.write, self.held = out_type, write, []

    def add(self, rows: np.ndarray) -> None:
        self.held.append(rows)
        n = sum(len(r) for r in self.held)
        if n >= PACK_CHUNK_ROWS:
            rows = np.concatenate(self.held)
            whole = n // PACK_ROWS * PACK_ROWS
            self.write(pack_rows(rows[:whole], self.type))
            self.held = [rows[whole:]] if whole < n else []

    def finish(self) -> None:
        if self.held:
            self.write(pack_rows(np.concatenate(self.held), self.type))
            self.held = []


def convert_part(part: Part, out_type: int, write: Callable[[np.ndarray], None]) -> None:
    t = part.tensor
    src_type = t.ggml_type
    src = t.raw().reshape(part.rows, row_bytes(src_type, part.cols))
    perm = head_permutation(part.perm_heads, part.rows // part.perm_heads) if part.perm_heads else None
    step = max(1, CHUNK_ELEMENTS // part.cols)
    for r0 in range(0, part.rows, step):
        r1 = min(part.rows, r0 + step)
        chunk = src[perm[r0:r1]] if perm is not None else src[r0:r1]
        if src_type == out_type and not part.shift:
            write(chunk)   # same block type: bit-for-bit copy of whole rows
        else:
            values = DECODERS[src_type](chunk.reshape(-1, GGML_TYPES[src_type][2])).reshape(r1 - r0, part.cols)
            if part.shift:
                values = values + np.float32(part.shift)   # float32, as convert_hf_to_gguf.py's Gemma3Model does
            write(encode_rows(values, out_type))


# ---------------------------------------------------------------------------------------------
# Tokenizer: GGUF's tokenizer.ggml.* keys (docs/gguf.md) or Hugging Face's tokenizer.json, written
# as the manual's "Tokenizer section" above lays it out.

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
KIND_BYTE_BPE, KIND_SPM = 1, 2
PRE_NONE, PRE_GPT2, PRE_SMOLLM, PRE_LLAMA3, PRE_QWEN2 = 0, 1, 2, 3, 4
BPE_DEFAULT_BOS = 11   # llama.cpp's BOS (and EOS) id for a gpt2-model vocabulary without bos_token_id


@dataclass(frozen=True)
class PreTokenizer:
    """What llama.cpp makes of one tokenizer.ggml.pre name: the splitter (regexes) and the defaults it sets
    for a file whose own keys do not say (add_bos_token, bos_token_id, add_sep_token). ignore_merges, the
    other flag that changes ids, is set exactly for the llama3 splitter's names here, as tokenizer.c does."""
    pre: int
    add_bos: bool = False
    bos: int = BPE_DEFAULT_BOS
    add_sep: bool = False


# llama.cpp's tokenizer.ggml.pre names whose regexes and flags tokenizer.c implements (src/llama-vocab.cpp,
# llama_vocab::impl::load and llm_tokenizer_bpe, at ggml-org/llama.cpp@0c1e57098, vendored by llama-cpp-python
# 0.3.36): the pre-types GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING share gpt-2's regex; STARCODER, REFACT,
# COMMAND_R, CODESHELL, EXAONE, MINERVA, MELLUM2 smollm's; CHATGLM4 with ignore_merges (glm4, glm5) llama3's;
# STABLELM2, HUNYUAN, SOLAR_OPEN, GROK_2 qwen2's. clean_spaces, which some set, only changes llama.cpp's
# whole-text detokenizer, not the ids or the pieces streamed per token. Refused: names with other regexes, and
# dbrx, smaug-bpe, chatglm-bpe (llama3's regex without ignore_merges).
GGUF_PRE = {
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"),
                    PreTokenizer(PRE_GPT2)),
    **dict.fromkeys(("jina-v1-en", "jina-v2-code", "roberta-bpe"), PreTokenizer(PRE_GPT2, add_sep=True)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    PreTokenizer(PRE_SMOLLM)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), PreTokenizer(PRE_LLAMA3, add_bos=True)),
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer(PRE_LLAMA3, bos=-1)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
                     "grok-2"), PreTokenizer(PRE_QWEN2)),
}
# llama.cpp names that look like ours but are not: llama3's regex without its ignore_merges
GGUF_PRE_WITHOUT_IGNORE_MERGES = ("dbrx", "smaug-bpe", "chatglm-bpe")
CHAT_NONE, CHAT_CHATML, CHAT_GEMMA, CHAT_LLAMA3 = 0, 1, 2, 3
# the end-of-turn token of each template kind; without a template, the first one in the vocabulary
EOT_TEXTS = {CHAT_CHATML: "<|im_end|>", CHAT_GEMMA: "<end_of_turn>", CHAT_LLAMA3: "<|eot_id|>"}
# the turn tokens each kind's template needs
CHAT_TOKENS = {CHAT_CHATML: ("<|im_start|>", "<|im_end|>"), CHAT_GEMMA: ("<start_of_turn>", "<end_of_turn>"),
               CHAT_LLAMA3: ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}
SPM_SPACE = "\u2581"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of bytes_to_unicode (openai/gpt-2 src/encoder.py; Hugging Face's tokenization_gpt2.py)."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    inv: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            inv[chr(b)] = b
        else:
            inv[chr(0x100 + extra)] = b
            extra += 1
    return inv


@dataclass
class Vocab:
    kind: int
    pre: int
    texts: list[bytes]
    types: list[int]
    scores: np.ndarray
    merges: np.ndarray            # (n, 3) int32
    bos: int
    eos: int
    eot: int
    unk: int
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat: int
    system: bytes

    def serialize(self) -> bytes:
        n = len(self.texts)
        blob = b"".join(self.texts)
        offsets = np.zeros(n + 1, dtype="<u4")
        lengths = np.fromiter((len(t) for t in self.texts), dtype=np.int64, count=n)
        if blob and len(blob) >= 2**32:
            raise ExportError("token text blob exceeds 4 GiB")
        offsets[1:] = np.cumsum(lengths)
        flags = int(self.add_bos) | int(self.add_eos) << 1 | int(self.add_space_prefix) << 2
        hdr = struct.pack("<IIIIiiiiIIII", self.kind, self.pre, n, len(self.merges), self.bos, self.eos, self.eot,
                          self.unk, flags, self.chat, len(self.system), len(blob)).ljust(64, b"\0")
        out = bytearray(hdr)

        def add(data: bytes) -> None:
            out.extend(b"\0" * ((-len(out)) % 4))   # every array starts on a 4-byte boundary
            out.extend(data)

        add(offsets.tobytes())
        add(np.asarray(self.types, dtype=np.uint8).tobytes())
        add(np.asarray(self.scores, dtype="<f4").tobytes())
        add(np.asarray(self.merges, dtype="<i4").reshape(-1, 3).tobytes())
        add(self.system)
        add(blob)
        return bytes(out)


def chat_kind(template: str | None) -> int:
    if not template:
        return CHAT_NONE
    if "<|im_start|>" in template:
        return CHAT_CHATML
    if "<start_of_turn>" in template:
        return CHAT_GEMMA
    if "<|start_header_id|>" in template:
        return CHAT_LLAMA3
    return CHAT_NONE


def choose_chat(template: str | None, fam: Family, ids: dict[str, int]) -> tuple[int, int, str]:
    """(template kind, end-of-turn id or -1, default system prompt) from the file's own template text.

    A file without template text (the Gemma 3 270M GGUF has none) gets its family's own template
    when that template's turn tokens are in the vocabulary (Family.chat_without_template)."""
    chat = chat_kind(template)
    if chat == CHAT_NONE and not template and fam.chat_without_template and \
            all(t in ids for t in CHAT_TOKENS[fam.chat_without_template]):
        chat = fam.chat_without_template
    eot_text = EOT_TEXTS.get(chat) if chat in EOT_TEXTS and EOT_TEXTS[chat] in ids else None
    eot_text = eot_text or next((t for t in EOT_TEXTS.values() if t in ids), None)
    system = chatml_default_system(template) if chat == CHAT_CHATML and template else ""
    return chat, ids[eot_text] if eot_text else -1, system


def chatml_default_system(template: str) -> str:
    """The literal system text the template emits when the conversation has no system message.

    Looks for a Jinja string literal '<|im_start|>system\\n...<|im_end|>' whose body is plain text
    (the branch that uses messages[0]['content'] concatenates, so it is skipped)."""
    for m in re.finditer(r"(['\"])<\|im_start\|>system(?:\n|\\n)", template):
        quote = m.group(1)
        end = template.find("<|im_end|>", m.end())
        if end < 0:
            continue
        body = template[m.end():end]
        unescaped_quote = re.search(r"(?<!\\)" + re.escape(quote), body)
        if unescaped_quote or "{{" in body or "{%" in body:
            continue
        return re.sub(r"\\(.)", lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), body)
    return ""


def _token_id(ids: dict[str, int], text: str | None) -> int:
    return ids.get(text, -1) if text is not None else -1


def resolve_merges(merges: list[Any], ids: dict[str, int], where: str) -> np.ndarray:
    """Merge rules ("A B" or [A, B]) -> (left, right, result) ids; every part must be a token."""
    out = np.empty((len(merges), 3), dtype=np.int32)
    for k, m in enumerate(merges):
        if isinstance(m, str):
            cut = m.find(" ", 1)   # llama.cpp splits at the first space after position 0
            if cut < 0:
                raise ExportError(f"{where}: merge #{k} {m!r} has no space separator")
            left, right = m[:cut], m[cut + 1:]
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            left, right = m
        else:
            raise ExportError(f"{where}: merge #{k} {m!r} is malformed")
        row = (ids.get(left), ids.get(right), ids.get(left + right))
        if None in row:
            missing = [p for p, i in zip((left, right, left + right), row) if i is None]
            raise ExportError(f"{where}: merge #{k} {m!r}: {missing[0]!r} is not in the vocabulary")
        out[k] = row
    return out


def decode_bpe_text(text: str, ttype: int, inv: dict[str, int], bad: list[str]) -> bytes:
    # Control/user-defined tokens are stored literally in GGUF/tokenizer.json (not byte-mapped),
    # and llama.cpp prints them verbatim, so keep their UTF-8 text.
    if ttype in (TOKEN_CONTROL, TOKEN_USER, TOKEN_UNKNOWN):
        return text.encode("utf-8", "surrogateescape")
    try:
        return bytes(inv[c] for c in text)
    except KeyError:
        bad.append(text)
        return text.encode("utf-8", "surrogateescape")


BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def decode_spm_text(text: str, ttype: int, where: str, idx: int) -> bytes:
    if ttype == TOKEN_BYTE:
        m = BYTE_TOKEN.fullmatch(text)
        if not m:
            raise ExportError(f"{where}: byte token {idx} has text {text!r}, expected <0xAB>")
        return bytes([int(m.group(1), 16)])
    if ttype in (TOKEN_NORMAL, TOKEN_UNUSED):
        return text.replace(SPM_SPACE, " ").encode("utf-8", "surrogateescape")
    return text.encode("utf-8", "surrogateescape")   # control, user-defined, unknown: literal


def gguf_pre_tokenizer(g: GGUFFile) -> PreTokenizer:
    """The pre-tokenizer a byte-level BPE GGUF names, refused unless tokenizer.c splits and flags its text as
    llama.cpp does (GGUF_PRE); a file without tokenizer.ggml.pre gets llama.cpp's 'default' splitter, refused."""
    where = str(g.path)
    name = g.get("tokenizer.ggml.pre", str, "default")
    spec = GGUF_PRE.get(name)
    if spec is None:
        why = (" (llama.cpp splits it with llama3's regex but without ignore_merges, which the engine does not "
               "implement)" if name in GGUF_PRE_WITHOUT_IGNORE_MERGES else "")
        raise ExportError(f"{where}: unsupported pre-tokenizer '{show(name)}'{why}; the engine splits text as "
                          f"llama.cpp does for these names: {', '.join(GGUF_PRE)}")
    if g.get("tokenizer.ggml.add_sep_token", bool, spec.add_sep):
        raise ExportError(f"{where}: pre-tokenizer '{show(name)}' with add_sep (a SEP token after the text, as llama.cpp "
                          f"sets for it or tokenizer.ggml.add_sep_token asks), which the engine does not implement")
    return spec


def vocab_from_gguf(g: GGUFFile, fam: Family) -> Vocab:
    where = str(g.path)
    if "tokenizer.ggml.model" not in g.kv:
        raise ExportError(f"{where}: no tokenizer in the GGUF (tokenizer.ggml.model missing)")
    model = g.get("tokenizer.ggml.model", str)
    tokens = g.get("tokenizer.ggml.tokens", list)
    if not isinstance(tokens, list) or not tokens:
        raise ExportError(f"{where}: tokenizer.ggml.tokens is empty or not a string array")
    n = len(tokens)
    types = np.asarray(g.get("tokenizer.ggml.token_type", list, np.ones(n, dtype=np.int32)))
    scores = np.asarray(g.get("tokenizer.ggml.scores", list, np.zeros(n, dtype=np.float32)), dtype=np.float32)
    if len(types) != n or len(scores) != n:
        raise ExportError(f"{where}: tokenizer token_type/scores length ({len(types)}/{len(scores)}) != {n} tokens")
    if types.dtype.kind not in "iu" or types.size and (types.min() < 0 or types.max() > TOKEN_BYTE):
        raise ExportError(f"{where}: tokenizer.ggml.token_type holds invalid values")
    types = np.where(types == 0, TOKEN_NORMAL, types).astype(np.uint8)   # 0 = "undefined"
    ids = {t: i for i, t in enumerate(tokens)}   # later duplicates win, as in llama.cpp's token_to_id

    if model == "gpt2":
        spec = gguf_pre_tokenizer(g)
        kind, pre = KIND_BYTE_BPE, spec.pre
        inv, bad = gpt2_unicode_to_byte(), []
        texts = [decode_bpe_text(t, int(ty), inv, bad) for t, ty in zip(tokens, types)]
        if bad:
            warn(f"{len(bad)} normal tokens are not in the GPT-2 byte alphabet (e.g. {bad[0]!r}); stored as UTF-8")
        merges = resolve_merges(g.get("tokenizer.ggml.merges", list), ids, where)
        defaults = dict(bos=spec.bos, eos=BPE_DEFAULT_BOS, unk=-1, add_bos=spec.add_bos, space=False)
    elif model == "llama":
        kind, pre = KIND_SPM, PRE_NONE
        texts = [decode_spm_text(t, int(ty), where, i) for i, (t, ty) in enumerate(zip(tokens, types))]
        merges = np.zeros((0, 3), dtype=np.int32)
        defaults = dict(bos=1, eos=2, unk=0, add_bos=True, space=True)
    else:
        raise ExportError(f"{where}: unsupported tokenizer model '{model}' (supported: gpt2, llama)")

    def tid(key: str, default: int) -> int:
        v = g.get(key, int, default)
        if not -1 <= v < n and v != 2**32 - 1:
            raise ExportError(f"{where}: {key} = {v} is out of range for {n} tokens")
        return -1 if v == 2**32 - 1 else v

    chat, eot, system = choose_chat(g.get("tokenizer.chat_template", str, None), fam, ids)
    eot = tid("tokenizer.ggml.eot_token_id", eot)
    return Vocab(kind, pre, texts, types.tolist(), scores if kind == KIND_SPM else np.zeros(n, np.float32), merges,
                 tid("tokenizer.ggml.bos_token_id", defaults["bos"]), tid("tokenizer.ggml.eos_token_id", defaults["eos"]),
                 eot, tid("tokenizer.ggml.unknown_token_id", defaults["unk"]),
                 g.get("tokenizer.ggml.add_bos_token", bool, defaults["add_bos"]),
                 g.get("tokenizer.ggml.add_eos_token", bool, False),
                 g.get("tokenizer.ggml.add_space_prefix", bool, defaults["space"]),
                 chat, system.encode("utf-8", "surrogateescape"))


def looks_special(text: str) -> bool:
    """Added tokens that llama.cpp's converter marks CONTROL even when not flagged special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>")) or text.startswith(("<start_of_", "<end_of_")))


def hf_pre_kind(pt: Any, where: str) -> int:
    def is_type(x: Any, name: str) -> bool:
        return isinstance(x, dict) and x.get("type") == name

    def byte_level(x: Any, regex: bool) -> bool:
        return is_type(x, "ByteLevel") and bool(x.get("use_regex", True)) == regex and not x.get("add_prefix_space", False)

    if byte_level(pt, True):
        return PRE_GPT2
    if is_type(pt, "Sequence") and isinstance(pt.get("pretokenizers"), list):
        seq = pt["pretokenizers"]
        if len(seq) == 2 and is_type(seq[0], "Digits") and seq[0].get("individual_digits") and byte_level(seq[1], True):
            return PRE_SMOLLM
        if len(seq) == 2 and is_type(seq[0], "Split") and byte_level(seq[1], False):
            pattern = seq[0].get("pattern") or {}
            regex = pattern.get("Regex") if isinstance(pattern, dict) else None
            if regex == LLAMA3_REGEX:
                return PRE_LLAMA3
            if regex == QWEN2_REGEX:
                return PRE_QWEN2
    raise ExportError(f"{where}: unsupported pre_tokenizer {json.dumps(pt)[:160]}")


def _special_text(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _template_adds(post: Any, which: str) -> bool | None:
    """From a TemplateProcessing post-processor: does the single template start (bos) / end (eos) with a special?"""
    if not isinstance(post, dict):
        return None
    procs = post.get("processors") if post.get("type") == "Sequence" else [post]
    for p in procs or []:
        if isinstance(p, dict) and p.get("type") == "TemplateProcessing" and isinstance(p.get("single"), list) and p["single"]:
            item = p["single"][0] if which == "bos" else p["single"][-1]
            return isinstance(item, dict) and "SpecialToken" in item
    return None


# SentencePiece's tokenizer.model: a ModelProto message (sentencepiece_model.proto) in protobuf's
# wire format (protobuf.dev, "Encoding"). Only these fields are read:
SP_MODEL_PIECES, SP_MODEL_NORMALIZER = 1, 3             # ModelProto: repeated SentencePiece, NormalizerSpec
SP_PIECE_TEXT, SP_PIECE_SCORE, SP_PIECE_TYPE = 1, 2, 3  # SentencePiece: string, float, enum (1 NORMAL .. 6 BYTE)
SP_NORM_ADD_DUMMY_PREFIX = 3                            # NormalizerSpec: bool


def proto_fields(buf: bytes, where: str) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of one protobuf message: a varint as int,
    fixed32 / fixed64 / length-delimited as bytes."""
    pos, end = 0, len(buf)

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise ExportError(f"{where}: truncated or corrupt protobuf (varint at byte {pos})")
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    widths = {1: 8, 5: 4}
    while pos < end:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
            continue
        if wire == 2:
            size = varint()
        elif wire in widths:
            size = widths[wire]
        else:
            raise ExportError(f"{where}: protobuf wire type {wire} at byte {pos} is not supported (corrupt file?)")
        if pos + size > end:
            raise ExportError(f"{where}: protobuf field {number} runs past the end of its message: truncated or corrupt")
        yield number, wire, buf[pos:pos + size]
        pos += size


def read_sentencepiece(path: Path) -> tuple[list[tuple[str, float, int]], bool]:
    """([(piece, score, type)], normalizer add_dummy_prefix) of a tokenizer.model."""
    where = str(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ExportError(f"cannot read {path}: {e.strerror or e}") from None
    pieces, dummy_prefix = [], True
    for number, wire, value in proto_fields(data, where):
        if number == SP_MODEL_PIECES and wire == 2:
            text, score, ptype = "", 0.0, TOKEN_NORMAL
            for n2, w2, v2 in proto_fields(value, where):
                if n2 == SP_PIECE_TEXT and w2 == 2:
                    text = bytes(v2).decode("utf-8", "surrogateescape")
                elif n2 == SP_PIECE_SCORE and w2 == 5:
                    score = struct.unpack("<f", v2)[0]
                elif n2 == SP_PIECE_TYPE and w2 == 0:
                    ptype = v2
            if not TOKEN_NORMAL <= ptype <= TOKEN_BYTE:
                raise ExportError(f"{where}: piece {len(pieces)} has invalid type {ptype}")
            pieces.append((text, score, ptype))
        elif number == SP_MODEL_NORMALIZER and wire == 2:
            for n2, w2, v2 in proto_fields(value, where):
                if n2 == SP_NORM_ADD_DUMMY_PREFIX and w2 == 0:
                    dummy_prefix = bool(v2)
    if not pieces:
        raise ExportError(f"{where}: no vocabulary pieces (not a SentencePiece model?)")
    if len(pieces) > ENGINE_LIMITS["vocab_size"]:
        raise ExportError(f"{where}: {len(pieces)} pieces is more than the engine holds ({ENGINE_LIMITS['vocab_size']})")
    return pieces, dummy_prefix


def vocab_from_sentencepiece(ck: HFCheckpoint, fam: Family, sp_path: Path) -> Vocab:
    """A SentencePiece vocabulary, read as llama.cpp's converter reads it (_create_vocab_sentencepiece in
    convert_hf_to_gguf.py), so that the HF directory and its GGUF export to the same section: unknown,
    control, unused and byte pieces keep their type and every other piece is normal; then each token of
    tokenizer_config.json's added_tokens_decoder becomes control (when special, or when it looks special)
    or user-defined (its U+2581 replaced by spaces), with score -1000."""
    where = str(sp_path)
    pieces, dummy_prefix = read_sentencepiece(sp_path)
    keep = (TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_UNUSED, TOKEN_BYTE)
    tokens = [p[0] for p in pieces]
    scores = [p[1] for p in pieces]
    types = [p[2] if p[2] in keep else TOKEN_NORMAL for p in pieces]
    cfg_path = ck.path / "tokenizer_config.json"
    tc = read_json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}
    if not isinstance(tc, dict):
        raise ExportError(f"{cfg_path}: not a JSON object")
    added = tc.get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise ExportError(f"{cfg_path}: added_tokens_decoder is not an object")
    for key, data in added.items():
        text = data.get("content") if isinstance(data, dict) else None
        if not key.isdigit() or not isinstance(text, str):
            raise ExportError(f"{cfg_path}: added token {show(key)} is malformed")
        i = int(key)
        if i >= len(tokens):
            warn(f"{cfg_path}: added token {i} is beyond the {len(tokens)} pieces: ignored (as llama.cpp's converter does)")
            continue
        special = bool(data.get("special")) or looks_special(text)
        tokens[i] = text if special else text.replace(SPM_SPACE, " ")
        types[i] = TOKEN_CONTROL if special else TOKEN_USER
        scores[i] = -1000.0
    n_config = ck.config.get("vocab_size")
    if isinstance(n_config, int) and len(tokens) < n_config <= ENGINE_LIMITS["vocab_size"]:   # the converter's padding
        pads = range(1, n_config - len(tokens) + 1)
        tokens, scores = tokens + [f"[PAD{k}]" for k in pads], scores + [-1000.0] * len(pads)
        types = types + [TOKEN_UNUSED] * len(pads)
    texts = [decode_spm_text(t, ty, where, i) for i, (t, ty) in enumerate(zip(tokens, types))]
    ids = {t: i for i, t in enumerate(tokens)}

    def special_id(name: str, config_key: str, default: int) -> int:
        tid = _token_id(ids, _special_text(tc.get(name)))
        v = ck.config.get(config_key)
        v = v[0] if isinstance(v, list) and v else v
        if tid < 0 and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(tokens):
            tid = v
        return tid if tid >= 0 else default

    unk = next((i for i, ty in enumerate(types) if ty == TOKEN_UNKNOWN), -1)
    chat, eot, system = choose_chat(hf_chat_template(ck, tc), fam, ids)
    add_bos, add_eos = tc.get("add_bos_token", True), tc.get("add_eos_token", False)
    # llama.cpp's Gemma 3 converter writes add_space_prefix false whatever the normalizer says
    space = False if fam.name == "gemma3" else dummy_prefix
    return Vocab(KIND_SPM, PRE_NONE, texts, types, np.asarray(scores, np.float32), np.zeros((0, 3), np.int32),
                 special_id("bos_token", "bos_token_id", -1), special_id("eos_token", "eos_token_id", -1), eot,
                 special_id("unk_token", "unk_token_id", unk), add_bos if isinstance(add_bos, bool) else True,
                 add_eos if isinstance(add_eos, bool) else False, space, chat, system.encode("utf-8", "surrogateescape"))


def hf_chat_template(ck: HFCheckpoint, tc: dict) -> str | None:
    """The chat template text of a HF directory: tokenizer_config.json's chat_template (a string, or a
    list of named templates: "default"), else chat_template.jinja."""
    template = tc.get("chat_template")
    if isinstance(template, list):   # named templates: take "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(template, str) and (ck.path / "chat_template.jinja").is_file():
        template = (ck.path / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    return template if isinstance(template, str) else None


def vocab_from_hf(ck: HFCheckpoint, fam: Family) -> Vocab:
    tj_path, sp_path = ck.path / "tokenizer.json", ck.path / "tokenizer.model"
    tj = read_json(tj_path, "tokenizer") if tj_path.is_file() else None
    model = tj.get("model") if isinstance(tj, dict) else None
    byte_level = isinstance(model, dict) and model.get("type") == "BPE" and not model.get("byte_fallback")
    if not byte_level and sp_path.is_file():   # a SentencePiece vocabulary (Gemma, Llama 2): its own file
        return vocab_from_sentencepiece(ck, fam, sp_path)
    if tj is None:
        raise ExportError(f"{ck.path}: no tokenizer.json or tokenizer.model (needed for the tokenizer section)")
    where = str(tj_path)
    if not byte_level:
        kind = model.get("type") if isinstance(model, dict) else None
        raise ExportError(f"{where}: unsupported tokenizer model {kind!r} (a HF directory needs a byte-level BPE tokenizer.json or a SentencePiece tokenizer.model)")
    pre = hf_pre_kind(tj.get("pre_tokenizer"), where)
    vocab = model.get("vocab")
    merges = model.get("merges", [])
    added = tj.get("added_tokens") or []
    if not isinstance(vocab, dict) or not isinstance(merges, list) or not isinstance(added, list):
        raise ExportError(f"{where}: malformed model.vocab / model.merges / added_tokens")
    id_text: dict[int, tuple[str, int]] = {}
    for text, i in vocab.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ExportError(f"{where}: token {show(repr(text))} has invalid id {show(repr(i))}")
        if i in id_text:
            raise ExportError(f"{where}: model.vocab gives id {i} to two tokens, {show(repr(id_text[i][0]))} and "
                              f"{show(repr(text))}")
        id_text[i] = (text, TOKEN_NORMAL)
    added_text: dict[int, str] = {}
    for a in added:
        if not isinstance(a, dict) or not isinstance(a.get("id"), int) or not isinstance(a.get("content"), str) or a["id"] < 0:
            raise ExportError(f"{where}: malformed added token {json.dumps(a)[:100]}")
        if added_text.setdefault(a["id"], a["content"]) != a["content"]:
            raise ExportError(f"{where}: added_tokens give id {a['id']} to two tokens, "
                              f"{show(repr(added_text[a['id']]))} and {show(repr(a['content']))}")
        # An added token may restate a model.vocab entry; with other text it overrides it for decoding,
        # as in Hugging Face tokenizers and llama.cpp's converter.
        special = a.get("special") or looks_special(a["content"])
        text = a["content"] if special else a["content"].replace(SPM_SPACE, " ")
        id_text[a["id"]] = (text, TOKEN_CONTROL if special else TOKEN_USER)
    n = max(id_text) + 1
    if n > ENGINE_LIMITS["vocab_size"]:
        raise ExportError(f"{where}: token id {n - 1} is too large (the engine holds at most "
                          f"{ENGINE_LIMITS['vocab_size']} tokens)")
    inv, bad = gpt2_unicode_to_byte(), []
    texts, types = [], []
    for i in range(n):
        text, ttype = id_text.get(i, (f"[PAD{i}]", TOKEN_UNUSED))
        texts.append(decode_bpe_text(text, ttype, inv, bad) if i in id_text else text.encode())
        types.append(ttype)
    if bad:
        warn(f"{len(bad)} normal tokens are not in the GPT-2 byte alphabet (e.g. {bad[0]!r}); stored as UTF-8")
    ids = {text: i for i, (text, _) in sorted(id_text.items())}
    merge_ids = resolve_merges(merges, ids, where)

    cfg_path = ck.path / "tokenizer_config.json"
    tc = read_json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}
    if not isinstance(tc, dict):
        raise ExportError(f"{cfg_path}: not a JSON object")

    def special_id(name: str, config_key: str) -> int:
        tid = _token_id(ids, _special_text(tc.get(name)))
        if tid < 0:
            v = ck.config.get(config_key)
            v = v[0] if isinstance(v, list) and v else v
            tid = v if isinstance(v, int) and 0 <= v < n else -1
        return tid

    unk = _token_id(ids, _special_text(tc.get("unk_token")))
    if unk < 0 and isinstance(model.get("unk_token"), str):
        unk = ids.get(model["unk_token"], -1)
    chat, eot, system = choose_chat(hf_chat_template(ck, tc), fam, ids)
    add_bos = tc.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = bool(_template_adds(tj.get("post_processor"), "bos"))
    add_eos = tc.get("add_eos_token")
    if not isinstance(add_eos, bool):
        add_eos = bool(_template_adds(tj.get("post_processor"), "eos"))
    return Vocab(KIND_BYTE_BPE, pre, texts, types, np.zeros(n, np.float32), merge_ids,
                 special_id("bos_token", "bos_token_id"), special_id("eos_token", "eos_token_id"), eot, unk,
                 add_bos, add_eos, False, chat, system.encode("utf-8", "surrogateescape"))


# ---------------------------------------------------------------------------------------------
# Writing

HEADER_SIZE = 256
SECTION_ALIGN = 64
TABLE_ENTRY = 80
NAME_FIELD = 48
FORMAT_VERSION = 2                 # 2: matrices in the packed layout (version 1 stored every tensor as rows)
LAYOUT_ROWS, LAYOUT_PACKED = 0, 1  # a tensor table entry's layout field


def pack_header(hp: Hyper, n_tensors: int, tok_off: int, tok_size: int, table_off: int, file_size: int) -> bytes:
    u32_fields = dict(dim=hp.dim, hidden_dim=hp.hidden_dim, n_layers=hp.n_layers, n_heads=hp.n_heads,
                      n_kv_heads=hp.n_kv_heads, head_dim=hp.head_dim, vocab_size=hp.vocab_size,
                      max_seq_len=hp.max_seq_len, rope_dim=hp.rope_dim)
    for k, v in u32_fields.items():
        if not 0 <= v < 2**32:
            raise ExportError(f"{k} = {v} does not fit the header's u32 field")
    flags = (FLAG_TIED if hp.tied else 0) | hp.flags
    head = struct.pack("<4sIIIIIIIIIIIffIIIIQQQQ", b"LLMF", FORMAT_VERSION, HEADER_SIZE, hp.family.arch_id,
                       hp.dim, hp.hidden_dim, hp.n_layers, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.vocab_size,
                       hp.max_seq_len, hp.rope_theta, hp.norm_eps, flags,
                       hp.activation, hp.rope_dim, n_tensors, tok_off, tok_size, table_off, file_size)
    # offset 104: the model-family fields (0 = not used)
    family = struct.pack("<ffIIff", hp.embed_scale, hp.attn_scale, hp.window, hp.window_pattern,
                         hp.rope_theta_local, hp.rope_scale_global)
    return (head + family).ljust(HEADER_SIZE, b"\0")


class Progress:
    """Tensor progress on stderr: an overwritten line on a TTY, else a line every ~10%."""

    def __init__(self, total: int):
        self.total, self.done, self.tty = total, 0, sys.stderr.isatty()
        self.next_report = 0.1

    def step(self, name: str) -> None:
        self.done += 1
        if self.tty:
            print(f"\r[{self.done}/{self.total}] {name:<40}", end="", file=sys.stderr, flush=True)
        elif self.done / self.total >= self.next_report or self.done == self.total:
            print(f"[{self.done}/{self.total}] {name}", file=sys.stderr, flush=True)
            while self.next_report <= self.done / self.total:
                self.next_report += 0.1

    def finish(self) -> None:
        if self.tty and self.total:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The output file: only ever a new temp file of our own, renamed over a regular file or nothing.

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) arrived; unwinding removes the temp file."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Held:
    """Stop signals held back by stop_signals_blocked: how deep, and the one that arrived meanwhile.

    Blocking the signals in the main thread is not enough: the kernel then delivers them to another
    thread (numpy's BLAS workers), and Python runs the handler in the main thread all the same. So the
    handler itself defers while a held section runs."""
    depth = 0
    signum: int | None = None


def _on_stop_signal(signum: int, frame: Any) -> None:
    for s in STOP_SIGNALS:   # a second signal must not interrupt the cleanup
        signal.signal(s, signal.SIG_IGN)
    if _Held.depth:
        _Held.signum = signum
        return
    raise Stopped(signum)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold stop signals back for a few statements (they are delivered afterwards)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if not _Held.depth and _Held.signum is not None:
            signum, _Held.signum = _Held.signum, None
            raise Stopped(signum)


def file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for is_kind, name in kinds if is_kind(mode)), "not a regular file")


def check_output(out: Path) -> None:
    """Refuse an output path that exists and is not a regular file.

    The rename at the end would replace whatever is there: a device such as /dev/null would
    become a regular file, a symbolic link would be replaced instead of its target."""
    try:
        mode = os.lstat(out).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return   # nothing there (a missing directory is reported when the temp file is created)
    except OSError as e:
        raise ExportError(f"cannot check output {out}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        hint = " (give the path of the file it points to)" if stat.S_ISLNK(mode) else ""
        raise ExportError(f"output {out} is {file_kind(mode)}, not a regular file: export.py will not replace it{hint}")


def create_temp(path: Path) -> BinaryIO:
    """A new file at `path`, opened for writing. O_EXCL|O_NOFOLLOW: fails if anything is there,
    a symbolic link included, so nothing is ever written through a name we did not create."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "wb")


def write_model(out_path: Path, hp: Hyper, vocab: Vocab, plan: list[OutTensor]) -> int:
    if len(vocab.texts) > hp.vocab_size and plan:
        raise ExportError(f"tokenizer has {len(vocab.texts)} tokens but the embedding has only {hp.vocab_size} rows")
    for ot in plan:
        ot.packed = is_matmul(ot.name, hp.tied)
    tok = vocab.serialize()
    tok_off = HEADER_SIZE
    table_off = align_up(tok_off + len(tok), SECTION_ALIGN)
    pos = table_off + TABLE_ENTRY * len(plan)
    for ot in plan:
        ot.offset = align_up(pos, SECTION_ALIGN)
        pos = ot.offset + ot.nbytes
    file_size = pos

    tmp = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    created = False
    try:
        with stop_signals_blocked():   # so that `created` is true exactly when tmp is ours
            try:
                f = create_temp(tmp)
            except OSError as e:
                raise ExportError(f"cannot create {tmp}: {e.strerror or e}") from None
            created = True
        with f:
            f.write(pack_header(hp, len(plan), tok_off, len(tok), table_off, file_size))
            f.write(tok)
            f.write(b"\0" * (table_off - f.tell()))
            for ot in plan:
                name = ot.name.encode("ascii")
                if len(name) >= NAME_FIELD:
                    raise ExportError(f"tensor name '{ot.name}' is too long")
                f.write(struct.pack("<48sIIIIQQ", name, ot.out_type, ot.rows, ot.cols, LAYOUT_PACKED if ot.packed else LAYOUT_ROWS,
                                    ot.offset, ot.nbytes))
            progress = Progress(len(plan))
            def put(a: np.ndarray) -> None:
                f.write(np.ascontiguousarray(a).data)

            for ot in plan:
                f.write(b"\0" * (ot.offset - f.tell()))
                groups = GroupWriter(ot.out_type, put) if ot.packed else None
                for part in ot.parts:
                    convert_part(part, ot.out_type, groups.add if groups else put)
                if groups:
                    groups.finish()
                if f.tell() != ot.offset + ot.nbytes:
                    raise ExportError(f"internal error: {ot.name} wrote {f.tell() - ot.offset} bytes, expected {ot.nbytes}")
                progress.step(ot.name)
            progress.finish()
            if f.tell() != file_size:
                raise ExportError(f"internal error: wrote {f.tell()} bytes, expected {file_size}")
        check_output(out_path)   # again: something else may have been put there meanwhile
        os.replace(tmp, out_path)
    except BaseException as e:
        if created:
            with stop_signals_blocked():
                _remove(tmp)
        if isinstance(e, OSError):
            raise ExportError(f"writing {out_path}: {e.strerror or e}") from None
        raise
    return file_size


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# Driver

def check_rope_freqs_tensor(plan: list[OutTensor], where: str) -> None:
    """A GGUF's rope_freqs tensor: the engine divides by its values, so each must be finite and > 0."""
    for ot in plan:
        if ot.name == "rope_freqs":
            t = ot.parts[0].tensor
            check_rope_factors(dequantize(t.raw(), t.ggml_type), f"{where}: {t.name}")


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def export(args: argparse.Namespace) -> None:
    t0 = time.time()
    src, out = Path(args.input), Path(args.output)
    if not src.exists():
        raise ExportError(f"input {src} does not exist")
    dtype = args.dtype or ("f32" if src.is_dir() else "keep")

    if src.is_dir():
        ck = HFCheckpoint(src)
        fam = family_for_hf(ck.config.get("architectures"), args.tokenizer_only)
        if any(same_file(out, s) for s in [*ck.files, src / "config.json"]):
            raise ExportError(f"output {out} is the same file as an input file")
        check_output(out)
        hp = hparams_from_hf(ck, fam, strict=not args.tokenizer_only)
        vocab = vocab_from_hf(ck, fam)
        plan: list[OutTensor] = []
        if not args.tokenizer_only:
            ck.load_tensors()
            emb = ck.tensors.get(fam.hf_names["tok_embeddings"])
            if emb is not None and emb.rows_cols[0] != hp.vocab_size:
                raise ExportError(f"tensor '{emb.name}' has {emb.rows_cols[0]} rows but config vocab_size is {hp.vocab_size}")
            if not hp.tied and fam.hf_names["output"] not in ck.tensors:
                said = "is false" if "tie_word_embeddings" in ck.config else f"is absent (false for {fam.name})"
                raise ExportError(f"{src / 'config.json'}: tie_word_embeddings {said} but there is no tensor "
                                  f"'{fam.hf_names['output']}'; set it to true if the token embedding is the output head")
            check_bias_presence(ck.tensors, fam.hf_names, hp.n_layers, str(src))
            tensors = dict(ck.tensors)
            if hp.rope_freqs is not None:   # computed from config.json, read like a file tensor
                name = fam.hf_names["rope_freqs"]
                data = hp.rope_freqs.astype("<f4").tobytes()
                tensors[name] = SourceTensor(name, F32, "F32", hp.rope_freqs.shape, data, 0, len(data), "config.json")
            plan = build_plan(hp, tensors, fam.hf_names, False, dtype, fam.hf_ignored, args.verbose)
    else:
        if same_file(out, src):
            raise ExportError(f"output {out} is the same file as the input")
        check_output(out)
        g = GGUFFile(src)
        fam = family_for_gguf(g.get("general.architecture", str), args.tokenizer_only)
        hp = hparams_from_gguf(g, fam, strict=not args.tokenizer_only)
        vocab = vocab_from_gguf(g, fam)
        plan = [] if args.tokenizer_only else build_plan(hp, g.tensors, fam.gguf_names, True, dtype, (), args.verbose)
        check_rope_freqs_tensor(plan, str(src))

    size = write_model(out, hp, vocab, plan)
    params = sum(ot.rows * ot.cols for ot in plan)
    what = "tokenizer only" if args.tokenizer_only else f"--dtype {dtype}"
    print(f"{PROG}: wrote {out}: {len(plan)} tensors, {params:,} parameters, {size:,} bytes ({what}), "
          f"{len(vocab.texts)} tokens, {len(vocab.merges)} merges in {time.time() - t0:.2f} s", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    manual = __doc__.split("\n\n\nThe model file\n")[0]  # -h: the options; the file format follows them in __doc__
    ap = argparse.ArgumentParser(prog=PROG, description=manual, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="a GGUF file or a Hugging Face model directory (config.json + *.safetensors)")
    ap.add_argument("output", help="the model file to write: a new file or a regular file to replace (never a device, "
                                   "FIFO or symbolic link); written to OUTPUT.tmp-PID, then renamed")
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                    help="type of the weight matrices (default: keep for a GGUF input, f32 for a Hugging Face "
                         "directory); see 'Output types' above")
    ap.add_argument("--tokenizer-only", action="store_true",
                    help="write the header and tokenizer section only (no tensors); any architecture in the table")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="also warn about what llama.cpp's rules did with types not asked for (see -v above)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Stop signals unwind through write_model, which removes the temp file; a signal the caller
    # ignores (nohup, a background job's SIGINT) stays ignored.
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, handler in previous.items():
        if handler != signal.SIG_IGN:
            signal.signal(s, _on_stop_signal)
    try:
        export(args)
    except ExportError as e:
        print(f"{PROG}: error: {show(str(e), 600)}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"{PROG}: interrupted by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except MemoryError:
        print(f"{PROG}: error: out of memory", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{PROG}: error: {show(str(e.filename or ''))}: {show(str(e.strerror or e))}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - damaged inputs must still give one line, never a traceback
        print(f"{PROG}: error: unexpected {type(e).__name__} while exporting (corrupt input?): {show(str(e), 300)}",
              file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
