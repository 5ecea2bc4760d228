#!/usr/bin/env python3
"""Produce the checked-in oracle goldens in tests/golden/ from llama.cpp (llama-cpp-python).

Run once by a developer (needs `pip install llama-cpp-python`); CI only reads the output.

Two golden sets, each a JSON file plus an .npy of a few full logit rows:
  smollm2_f32   llama.cpp on an F32 GGUF made from the Q4_1 GGUF by llama.cpp's own quantize
                API (ftype ALL_F32): the same dequantized weights our `--dtype f32` export runs.
  smollm2_q4_1  llama.cpp on the original Q4_1 GGUF (Q8_1/Q8_0 activations inside llama.cpp).
For every prompt: the oracle's tokenization, its greedy continuation (computed one token at a
time, like a chat session), and for the whole teacher-forced sequence (prompt + continuation in
one batch) the top-1 id, top-1/top-2 margin and top-10 ids/logits at every position.

It also scores other valid implementations with the statistics the test uses (meta.
measured_noise): llama.cpp fed one token per decode call, a float64 numpy forward on the same
weights (tests/ref_forward.py), and for the F32 set llama.cpp with an F16 KV cache. The test
tolerances in tests/test_oracle.py are derived from these numbers.

    python3 tests/oracle/make_goldens.py                  # writes tests/golden/*
    python3 tests/oracle/make_goldens.py --no-numpy-ref   # skip the (slow) float64 reference
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from common import sha256_file  # noqa: E402

N_CTX = 512
N_THREADS = 2
N_CONTINUE = 64
TOP_K = 10
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
LLAMA_FTYPE_ALL_F32 = 0

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


PROSE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
         "a goldsmith from Mainz, combined several existing technologies into a single practical system. "
         "Movable metal type, oil-based ink and a screw press adapted from wine making allowed pages to be "
         "reproduced quickly and cheaply. Within fifty years, printing shops had spread to more than two "
         "hundred cities across Europe, and the number of books in circulation grew from thousands to "
         "millions. Historians often argue that")

# (name, text, parse special tokens). Varied on purpose: plain completion, chat template with
# control tokens, code with indentation, a numbered list, a question, digits (SmolLM2 splits every
# digit), non-ASCII bytes, and ~100 tokens of prose for longer-range attention.
PROMPTS: list[tuple[str, str, bool]] = [
    ("france", "The capital of France is", False),
    ("chatml_france", chatml("What is the capital of France?"), True),
    ("chatml_explain", chatml("Explain in a few sentences why the sky is blue."), True),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False),
    ("list", "Here is a list of five fruits:\n1.", False),
    ("question", "Question: How many legs does a spider have?\nAnswer:", False),
    ("numbers", "In 1969, 3 astronauts travelled 384,400 km to the Moon. Apollo 11 launched on July", False),
    ("unicode", "Caf\u00e9 au lait, na\u00efve r\u00e9sum\u00e9, \u6771\u4eac and Z\u00fcrich \u2014", False),
    ("prose", PROSE, False),
]
# The Q4_1 set is smaller: it checks the quantized path, the F32 set checks the model math.
Q4_1_PROMPTS = ("france", "chatml_france", "chatml_explain", "code", "numbers", "prose")


def make_f32_gguf(src: Path, dst: Path) -> None:
    """Dequantize every tensor of `src` to F32 with llama.cpp's own quantize code."""
    requantize_gguf(src, dst, LLAMA_FTYPE_ALL_F32, GGML_TYPE_F32)


def requantize_gguf(src: Path, dst: Path, ftype: int, tensor_type: int) -> None:
    """Write `src` as llama.cpp file type `ftype` with llama.cpp's quantize code; the
    embedding and output tensors get `tensor_type` explicitly, so that no "output tensor"
    rule picks another type for the tied embedding."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = N_THREADS
    params.ftype = ftype
    params.allow_requantize = True  # the inputs may be quantized
    params.token_embedding_type = tensor_type
    params.output_tensor_type = tensor_type
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed with {rc}")


def verify_f32_gguf(src: Path, dst: Path) -> dict:
    """The F32 file must hold exactly the Q4_1/Q8_0 values as decoded by the gguf package."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    a, b = GGUFReader(str(src)), GGUFReader(str(dst))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if set(ta) != set(tb):
        raise SystemExit(f"tensor sets differ: {sorted(set(ta) ^ set(tb))}")
    not_f32 = [n for n, t in tb.items() if t.tensor_type != GGMLQuantizationType.F32]
    if not_f32:
        raise SystemExit(f"not F32 after conversion: {not_f32}")
    max_diff, n_diff, n_total = 0.0, 0, 0
    for name, t in ta.items():
        want = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        got = np.asarray(tb[name].data, dtype=np.float32).reshape(-1)
        diff = np.abs(got - want)
        max_diff = max(max_diff, float(diff.max()))
        n_diff += int(np.count_nonzero(diff))
        n_total += diff.size
    # Exact equality (observed with llama-cpp-python 0.3.36 and gguf 0.19): otherwise the oracle
    # and our export.py (which matches gguf-py bit for bit) would run different weights.
    if n_diff:
        raise SystemExit(f"F32 GGUF differs from gguf-py's dequantization in {n_diff} values (max {max_diff})")
    return {"tensors": len(ta), "types_in_source": sorted({t.tensor_type.name for t in ta.values()}),
            "max_abs_diff_vs_gguf_py_dequantize": max_diff, "n_values_differing": n_diff, "n_values": n_total}


def open_llama(path: Path, ubatch: int = N_CTX, kv_type: int = GGML_TYPE_F32):
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path), n_ctx=N_CTX, n_batch=ubatch, n_ubatch=ubatch, n_threads=N_THREADS,
        n_threads_batch=N_THREADS, logits_all=True, flash_attn=False, type_k=kv_type,
        type_v=kv_type, seed=0, verbose=False, n_gpu_layers=0)


def settings() -> dict:
    import llama_cpp

    return {"n_ctx": N_CTX, "n_batch": N_CTX, "n_ubatch": N_CTX, "n_threads": N_THREADS,
            "flash_attn": False, "type_k": "f32", "type_v": "f32", "logits_all": True, "add_bos": False,
            "greedy": "numpy argmax (lowest id on ties) over the logits of each one-token decode step",
            "teacher_forced": "prompt + continuation evaluated in one llama_decode batch",
            "llama_cpp_python": llama_cpp.__version__,
            "llama_system_info": llama_cpp.llama_print_system_info().decode(),
            "platform": platform.platform(), "python": platform.python_version()}


def piece(llm, token: int) -> bytes:
    """Bytes a token renders to in generated text (control tokens render as nothing)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, len(buf), 0, False)
    if n < 0:
        raise RuntimeError(f"token {token} piece longer than {len(buf)}")
    return buf.raw[:n]


def greedy(llm, prompt_ids: list[int], n: int) -> tuple[list[int], bool]:
    """Greedy continuation, one decode call per generated token (as in a chat session).
    Returns the ids and whether an end-of-generation token was produced (it ends the list)."""
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


def teacher_forced(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def top_summary(logits: np.ndarray) -> dict:
    """Per position: top-1 id, top1-top2 logit margin, top-10 ids and logits (descending)."""
    order = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    vals = np.take_along_axis(logits, order, axis=1)
    return {"top1": order[:, 0].tolist(), "margin": [round(float(m), 6) for m in vals[:, 0] - vals[:, 1]],
            "top10_ids": order.tolist(), "top10_logits": [[float(v) for v in r] for r in vals]}


def comparison_metrics(entries: list[dict], rows: np.ndarray, tfs: list[np.ndarray], others: list[np.ndarray]) -> dict:
    """The statistics tests/test_oracle.py computes for our engine, computed here for another
    valid implementation (`others[i]` = its logits for prompt i), so that the test tolerances
    can be set from what a correct but differently-rounded implementation scores."""
    full = np.concatenate([np.abs(o.astype(np.float64)[[f["pos"] for f in e["full_logits"]]] - rows[[f["row"] for f in e["full_logits"]]])
                           for e, o in zip(entries, others)])
    top = np.concatenate([np.abs(np.take_along_axis(o, np.asarray(e["top10_ids"]), axis=1)
                                 - np.asarray(e["top10_logits"])).reshape(-1) for e, o in zip(entries, others)])
    flipped = [m for e, o in zip(entries, others)
               for m, t, ours in zip(e["margin"], e["top1"], o.argmax(axis=1)) if ours != t]
    every = np.concatenate([np.abs(o - tf).reshape(-1) for o, tf in zip(others, tfs)])
    # How much the oracle's top1-top2 gap moves under the other implementation: top-1 can
    # only disagree where the gap is smaller than this.
    gap_change = np.concatenate([np.abs(np.diff(np.take_along_axis(o, np.asarray(e["top10_ids"])[:, :2], axis=1), axis=1)[:, 0]
                                        + np.asarray(e["margin"])) for e, o in zip(entries, others)])
    return {"margin_change_max": float(gap_change.max()), "margin_change_p99": float(np.quantile(gap_change, 0.99)),
            "full_rows_max": float(full.max()), "full_rows_mean": float(full.mean()),
            "top10_max": float(top.max()), "all_logits_max": float(every.max()),
            "all_logits_p99_9": float(np.quantile(every, 0.999)), "all_logits_mean": float(every.mean()),
            "top1_disagreements": len(flipped), "largest_margin_with_top1_disagreement": max(flipped, default=0.0)}


def full_positions(n_prompt: int, n_total: int, last_too: bool) -> list[int]:
    """Positions whose whole logit row is stored: end of prompt (first generated token) and
    optionally the last position (longest attention span); few rows keep the data < 5 MB."""
    return sorted({n_prompt - 1, n_total - 1} if last_too else {n_prompt - 1})


def run_set(model_path: Path, prompts: list[tuple[str, str, bool]], numpy_ref, label: str,
            row_dtype: type, last_too: bool, f16_kv: bool):
    """Goldens for one model file. numpy_ref(ids) -> float64 logits, or None to skip. Full
    rows are stored as row_dtype (metrics below are computed on the stored values). f16_kv:
    also measure llama.cpp with a half-precision KV cache against the goldens."""
    llm = open_llama(model_path)
    # Second opinion from llama.cpp itself: the same sequences fed one token per decode call
    # (matrix-vector kernels, other summation order), i.e. another valid float32 result.
    llm_one = open_llama(model_path, ubatch=1)
    llm_f16 = open_llama(model_path, kv_type=GGML_TYPE_F16) if f16_kv else None
    entries, rows, tfs, one_by_one, refs, half_kv = [], [], [], [], [], []
    for name, text, special in prompts:
        t0 = time.time()
        prompt_ids = llm.tokenize(text.encode(), add_bos=False, special=special)
        cont, eog = greedy(llm, prompt_ids, N_CONTINUE)
        ids = prompt_ids + cont
        # Every id gets a row, including the last generated one (never fed back in generation).
        tf = teacher_forced(llm, ids)
        tfs.append(tf)
        n_p = len(prompt_ids)
        # The greedy run fed tokens one at a time; where the teacher-forced batch would have
        # picked differently, llama.cpp disagrees with itself (a near-tie, or quantization noise).
        flips = [n_p - 1 + i for i, t in enumerate(cont) if int(np.argmax(tf[n_p - 1 + i])) != t]
        entry = {
            "name": name, "text": text, "special": special, "prompt_ids": prompt_ids,
            "continuation_ids": cont, "stopped_at_eog": eog,
            "continuation_text": b"".join(piece(llm, t) for t in cont).decode("utf-8", "replace"),
            "continuation_pieces_hex": [piece(llm, t).hex() for t in cont],
            "greedy_vs_teacher_forced_top1_mismatch_positions": flips,
            **top_summary(tf),
            "full_logits": [],
        }
        for pos in full_positions(n_p, len(ids), last_too):
            entry["full_logits"].append({"pos": pos, "row": len(rows)})
            rows.append(tf[pos].astype(row_dtype))
        one_by_one.append(teacher_forced(llm_one, ids))
        if llm_f16 is not None:
            half_kv.append(teacher_forced(llm_f16, ids))
        if numpy_ref is not None:
            refs.append(numpy_ref(ids))
        entries.append(entry)
        print(f"[{label}] {name}: {n_p} prompt + {len(cont)} generated (eog={eog}) "
              f"{time.time() - t0:.1f}s :: {entry['continuation_text'][:60]!r}", flush=True)
    rows_arr = np.stack(rows)
    noise = {"llamacpp_one_token_per_decode": comparison_metrics(entries, rows_arr, tfs, one_by_one)}
    if refs:
        noise["float64_numpy_same_weights"] = comparison_metrics(entries, rows_arr, tfs, refs)
    if half_kv:
        noise["llamacpp_f16_kv_cache"] = comparison_metrics(entries, rows_arr, tfs, half_kv)
        llm_f16.close()
    margins = np.concatenate([np.asarray(e["margin"]) for e in entries])
    noise["margin_quantiles"] = {str(q): float(np.quantile(margins, q)) for q in (0.01, 0.05, 0.1, 0.5)}
    noise["positions"] = int(margins.size)
    llm.close()
    llm_one.close()
    return entries, rows_arr, noise


def write_json(path: Path, meta: dict, entries: list[dict]) -> None:
    """Readable meta block, then one compact line per prompt (keeps the file small)."""
    with open(path, "w") as f:
        f.write('{"meta": ' + json.dumps(meta, indent=1, sort_keys=True) + ',\n"prompts": [\n')
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in entries))
        f.write("\n]}\n")


def numpy_reference(gguf_path: Path):
    """ids -> float64 logits of the GGUF's own (decoded) weights, from tests/ref_forward.py."""
    from ref_forward import forward, load_gguf

    cfg, weights = load_gguf(gguf_path)
    return lambda ids: forward(cfg, weights, ids, adjacent_pairs=True)


def main() -> None:
    global N_THREADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/oracle-scratch"),
                    help="where the F32 GGUF is written (not checked in)")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    ap.add_argument("--no-numpy-ref", action="store_true", help="skip the float64 error measurement")
    ap.add_argument("--threads", type=int, default=N_THREADS)
    args = ap.parse_args()
    N_THREADS = args.threads
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(N_THREADS))
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    f32_path = args.scratch / "SmolLM2-135M-Instruct.F32.gguf"
    make_f32_gguf(args.gguf, f32_path)
    conversion = verify_f32_gguf(args.gguf, f32_path)
    print("F32 conversion:", conversion, flush=True)
    ref = None if args.no_numpy_ref else numpy_reference(args.gguf)

    common_meta = {"source_gguf": args.gguf.name, "source_gguf_sha256": sha256_file(args.gguf),
                   "settings": settings(), "n_continue": N_CONTINUE, "top_k": TOP_K,
                   "generated_by": "tests/oracle/make_goldens.py",
                   "date": time.strftime("%Y-%m-%d")}

    entries, rows, noise = run_set(f32_path, PROMPTS, ref, "f32", np.float32, last_too=True, f16_kv=True)
    np.save(args.out / "smollm2_f32_logits.npy", rows)
    write_json(args.out / "smollm2_f32.json",
               {**common_meta, "oracle_model": "F32 GGUF from llama_model_quantize(ftype=ALL_F32, "
                "allow_requantize=True) of the source GGUF", "f32_gguf_sha256": sha256_file(f32_path),
                "f32_conversion": conversion, "measured_noise": noise,
                "full_logits_file": "smollm2_f32_logits.npy"}, entries)

    q_prompts = [p for p in PROMPTS if p[0] in Q4_1_PROMPTS]
    # float16 rows: their rounding (<= 0.008 for |logit| < 32) is far below Q4_1's noise.
    entries, rows, noise = run_set(args.gguf, q_prompts, ref, "q4_1", np.float16, last_too=False, f16_kv=False)
    np.save(args.out / "smollm2_q4_1_logits.npy", rows)
    write_json(args.out / "smollm2_q4_1.json",
               {**common_meta, "oracle_model": "the source Q4_1 GGUF as is", "measured_noise": noise,
                "full_logits_file": "smollm2_q4_1_logits.npy"}, entries)


if __name__ == "__main__":
    main()
