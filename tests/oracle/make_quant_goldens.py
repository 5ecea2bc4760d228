#!/usr/bin/env python3
"""Produce the goldens in tests/golden/quant/ for tests/test_oracle_quant.py from llama.cpp
(llama-cpp-python, by hand; CI only reads the output).

For SmolLM2 (the F32 GGUF made from the shipped Q4_1 GGUF as in make_goldens.py) and for the
synthetic model of test_oracle_quant.SYNTH_CONFIG (every row length a multiple of 256), each of
Q4_0, Q5_0, Q5_1, Q8_0, Q4_K_M, Q5_K_M, Q6_K is written by llama.cpp's own quantizer
(llama_model_quantize, default per-tensor rules, allow_requantize) and then:
  * the per-tensor types llama.cpp chose and a digest of its tensors are recorded;
  * the file is rebuilt the way the test rebuilds it (test_oracle_quant.write_replica: export.py's
    quantizers on the same source values) and compared block by block (meta.replica);
  * llama.cpp's greedy continuation and teacher-forced top-10 at every position are recorded
    (make_goldens.run_set), with a few full logit rows;
  * the noise of other correct implementations is scored with make_goldens.comparison_metrics:
    llama.cpp one token per decode call, the float64 reference on the file's decoded weights
    (tests/ref_forward.py), and llama.cpp on the rebuilt file when its bytes differ.

    python3 tests/oracle/make_quant_goldens.py                      # everything
    python3 tests/oracle/make_quant_goldens.py --only synth --types q4_0 q6_k

--mixes writes only tests/golden/quant/llama_quantize_types.json: for both models and every export.py
--dtype named after a llama.cpp file type (MIX_FTYPES; q4_k and q5_k as `--pure` Q4_K_M / Q5_K_M), the
type and a digest of the bytes of every tensor llama_model_quantize writes from the same F32 source
(test_oracle_quant.test_dtypes_give_llama_quantize_types_and_bytes).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
import make_goldens as mg  # noqa: E402
import make_synthetic as ms  # noqa: E402
import test_oracle_quant as tq  # noqa: E402
from common import sha256_file  # noqa: E402

# llama.cpp's llama_ftype values (include/llama.h)
FTYPES = {"q4_0": 2, "q5_0": 8, "q5_1": 9, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
# export.py --dtype -> (llama_ftype, pure): every --dtype named after a llama.cpp file type; q4_k / q5_k are
# llama-quantize --pure Q4_K_M / Q5_K_M (only the row-length fallback, no per-tensor rules)
MIX_FTYPES = {"f32": (0, False), "f16": (1, False), "q4_0": (2, False), "q4_1": (3, False), "q5_0": (8, False),
              "q5_1": (9, False), "q8_0": (7, False), "q6_k": (18, False), "q4_k_m": (15, False),
              "q5_k_m": (17, False), "q4_k": (15, True), "q5_k": (17, True)}
SMOL_PROMPTS = ("france", "chatml_explain", "code", "prose")
SMOL_ROW_PROMPT = "prose"     # the one prompt whose full row (first generated token) is stored, as float16
SMOL_CONTINUE = 48
SYNTH_CONTINUE = 40
SYNTH_PROMPTS: list[tuple[str, str, bool]] = [
    ("plain", "The quick brown fox jumps over the lazy dog while the farmer sleeps", False),
    ("chatml", "<|im_start|>user\nTell me a story about a small robot.<|im_end|>\n<|im_start|>assistant\n", True),
    ("long", " ".join(["In the beginning the model saw many words and learned a few of them."] * 6), False),
]


def quantize(src: Path, dst: Path, ftype: int, threads: int, pure: bool = False) -> None:
    """llama.cpp's quantizer with its default per-tensor rules for `ftype` (none with `pure`)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = ftype
    params.allow_requantize = True
    params.pure = pure
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src.name}, ftype {ftype}) failed with {rc}")


def compare_tensors(a: Path, b: Path) -> dict:
    """Block-by-block comparison of two GGUFs with the same tensors and types."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    ta = {t.name: t for t in GGUFReader(str(a)).tensors}
    tb = {t.name: t for t in GGUFReader(str(b)).tensors}
    blocks = differing = 0
    per_tensor, max_diff, rms_rel = {}, 0.0, []
    for name, x in ta.items():
        y = tb[name]
        assert x.tensor_type == y.tensor_type, name
        block, size = GGML_QUANT_SIZES[x.tensor_type]
        bx = np.ascontiguousarray(x.data).view(np.uint8).reshape(-1, size)
        by = np.ascontiguousarray(y.data).view(np.uint8).reshape(-1, size)
        diff = np.any(bx != by, axis=1)
        blocks += diff.size
        differing += int(diff.sum())
        if diff.any():
            va = dequantize(x.data, x.tensor_type).astype(np.float64)
            vb = dequantize(y.data, y.tensor_type).astype(np.float64)
            d = np.abs(va - vb)
            max_diff = max(max_diff, float(d.max()))
            rel = float(np.sqrt(np.mean(d ** 2) / np.mean(va ** 2)))
            rms_rel.append(rel)
            per_tensor[name] = {"type": x.tensor_type.name, "blocks_differing": int(diff.sum()), "blocks": int(diff.size),
                                "rms_diff_over_rms": rel}
    return {"identical": differing == 0, "blocks": blocks, "blocks_differing": differing,
            "max_abs_value_diff": max_diff, "tensors_differing": per_tensor}


def file_stats(path: Path) -> dict:
    """Size, tensor-type census and bits per weight of the 2-D tensors (the matrices)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    counts: dict[str, int] = {}
    bits = n = 0
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        if len(t.shape) >= 2 and t.shape[1] > 1:
            bits += 8 * int(t.n_bytes)
            n += int(t.n_elements)
    return {"file_bytes": path.stat().st_size, "type_counts": counts, "matrix_bits_per_weight": bits / n}


def golden_set(label: str, llama_file: Path, src: Path, prompts, ref, keep_row, row_dtype, scratch: Path,
               threads: int) -> tuple[dict, list[dict], np.ndarray]:
    """(meta, entries, stored rows) for one llama.cpp file."""
    t0 = time.time()
    types = tq.tensor_types(llama_file)
    replica = scratch / f"{label}.replica.gguf"
    tq.write_replica(src, types, replica)
    rep = compare_tensors(llama_file, replica)
    rep["tensors_sha256"] = tq.tensors_digest(replica)
    print(f"[{label}] replica: {rep['blocks_differing']}/{rep['blocks']} blocks differ ({time.time() - t0:.0f}s)", flush=True)
    entries, rows, noise = mg.run_set(llama_file, prompts, ref, label, row_dtype, last_too=True, f16_kv=False)
    if not rep["identical"]:
        llm, llm_rep = mg.open_llama(llama_file), mg.open_llama(replica)
        seqs = [e["prompt_ids"] + e["continuation_ids"] for e in entries]
        tfs = [mg.teacher_forced(llm, s) for s in seqs]
        others = [mg.teacher_forced(llm_rep, s) for s in seqs]
        noise["llamacpp_on_replica"] = mg.comparison_metrics(entries, rows, tfs, others)
        llm.close()
        llm_rep.close()
    kept = []
    for e in entries:
        if not keep_row(e):
            e["full_logits"] = []
        for f in e["full_logits"]:
            kept.append(rows[f["row"]])
            f["row"] = len(kept) - 1
    meta = {"llamacpp_ftype": FTYPES[label.split("_", 1)[1]], "tensor_types": types,
            "llamacpp_tensors_sha256": tq.tensors_digest(llama_file), "llamacpp_file": file_stats(llama_file),
            "replica": rep, "measured_noise": noise, "source_sha256": sha256_file(src),
            "settings": mg.settings(), "generated_by": "tests/oracle/make_quant_goldens.py",
            "date": time.strftime("%Y-%m-%d"), "full_logits_file": f"{label}_logits.npy"}
    return meta, entries, np.stack(kept)


def f32_source(model: str, args: argparse.Namespace) -> Path:
    """The F32 GGUF llama.cpp quantizes: SmolLM2's shipped Q4_1 values (llama.cpp's own ALL_F32 copy, checked
    against the gguf package's decoding) or the synthetic model's."""
    if model == "synth":
        return ms.make_all(args.scratch / "synth", tq.SYNTH_CONFIG, gguf_types=("f32",), hf=False)["gguf-f32"]
    src = args.scratch / "SmolLM2-135M-Instruct.F32.gguf"
    if not src.exists():
        mg.make_f32_gguf(args.gguf, src)
        mg.verify_f32_gguf(args.gguf, src)
    return src


def tensor_records(path: Path) -> tuple[dict[str, list], dict[str, list]]:
    """(name -> [ggml type name, digest of the data bytes], name -> shape: rows, cols (GGUF's ne reversed))."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    return ({t.name: [t.tensor_type.name, tq.bytes_digest(np.ascontiguousarray(t.data).tobytes())] for t in tensors},
            {t.name: [int(n) for n in reversed(t.shape)] for t in tensors})


def mix_goldens(args: argparse.Namespace) -> None:
    """tests/golden/quant/llama_quantize_types.json (see --mixes in the module docstring)."""
    import llama_cpp

    models = {}
    for model in args.only:
        src = f32_source(model, args)
        dtypes = {}
        for dtype, (ftype, pure) in MIX_FTYPES.items():
            dst = args.scratch / f"{model}_mix_{dtype}.gguf"
            quantize(src, dst, ftype, args.threads, pure)
            records, shapes = tensor_records(dst)
            dtypes[dtype] = {"llamacpp_ftype": ftype, "pure": pure, "tensors": records}
            dst.unlink()
            print(f"[{model} {dtype}] {len(records)} tensors", flush=True)
        models[model] = {"source": src.name, "source_tensors_sha256": tq.tensors_digest(src), "shapes": shapes,
                         "dtypes": dtypes}
    meta = {"generated_by": "tests/oracle/make_quant_goldens.py --mixes", "date": time.strftime("%Y-%m-%d"),
            "llama_cpp_python": llama_cpp.__version__, "digest": tq.DIGEST_NOTE}
    out = args.out / tq.MIX_GOLDEN.name
    blocks = []   # one line per dtype: readable diffs, a small file
    for m, v in models.items():
        lines = ",\n".join(f'{json.dumps(d)}: {json.dumps(r, separators=(",", ":"), sort_keys=True)}'
                           for d, r in v["dtypes"].items())
        blocks.append(f'{json.dumps(m)}: {{"source": {json.dumps(v["source"])}, "source_tensors_sha256": '
                      f'{json.dumps(v["source_tensors_sha256"])},\n"shapes": '
                      f'{json.dumps(v["shapes"], separators=(",", ":"), sort_keys=True)},\n"dtypes": {{\n{lines}}}}}')
    out.write_text('{"meta": ' + json.dumps(meta, indent=1, sort_keys=True) + ',\n"models": {\n'
                   + ",\n".join(blocks) + "\n}}\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/oracle-quant-scratch"),
                    help="where llama.cpp's quantized GGUFs are written (not checked in)")
    ap.add_argument("--out", type=Path, default=tq.GOLDEN)
    ap.add_argument("--only", choices=tq.MODELS, nargs="*", default=list(tq.MODELS))
    ap.add_argument("--types", choices=tq.TYPES, nargs="*", default=list(tq.TYPES))
    ap.add_argument("--no-numpy-ref", action="store_true", help="skip the float64 reference for SmolLM2 (slow)")
    ap.add_argument("--threads", type=int, default=mg.N_THREADS)
    ap.add_argument("--mixes", action="store_true", help="write only the per-tensor types of every --dtype")
    args = ap.parse_args()
    mg.N_THREADS = args.threads
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mixes:
        mix_goldens(args)
        return

    for model in args.only:
        src = f32_source(model, args)
        if model == "smollm2":
            replica_src, prompts = args.gguf, [p for p in mg.PROMPTS if p[0] in SMOL_PROMPTS]
            mg.N_CONTINUE = SMOL_CONTINUE
            row_dtype, keep_row = np.float16, (lambda e: e["name"] == SMOL_ROW_PROMPT)
        else:
            replica_src, prompts = src, SYNTH_PROMPTS
            mg.N_CONTINUE = SYNTH_CONTINUE
            row_dtype, keep_row = np.float32, (lambda e: True)
        for qtype in args.types:
            label = f"{model}_{qtype}"
            dst = args.scratch / f"{label}.gguf"
            quantize(src, dst, FTYPES[qtype], args.threads)
            ref = None
            if model == "synth" or not args.no_numpy_ref:
                ref = mg.numpy_reference(dst)
            meta, entries, rows = golden_set(label, dst, replica_src, prompts, ref, keep_row, row_dtype, args.scratch,
                                             args.threads)
            meta["source"] = replica_src.name
            np.save(args.out / f"{label}_logits.npy", rows)
            mg.write_json(args.out / f"{label}.json", meta, entries)
            print(f"[{label}] done: {meta['llamacpp_file']}", flush=True)


if __name__ == "__main__":
    main()
