#!/usr/bin/env python3
"""Perplexity of the engine and of llama.cpp (llama-cpp-python) on the same GGUF files, same text,
same windows (issue 13: "Q4_K_M perplexity within 0.1 % of llama.cpp's own on the same file").

Text: the first --bytes of tests/data/kjv-genesis.txt, cut at the last line break (60000 -> the
59,939 bytes of the README's per-type table). Windows: tests/ppl_ref.py, llama.cpp's scheme as
`./run --ppl` implements it (consecutive windows of --ctx tokens, the tail dropped, BOS in place
of each window's first token for add-BOS models, the second half scored).

  ours       export.py GGUF OUT.bin (default --dtype keep: the GGUF's blocks as they are), then
             ./run OUT.bin --ppl TEXT --ctx N --threads T --kv KV (f16 by default)
  llama.cpp  the GGUF itself: llama.cpp tokenizes the text (BOS as the file asks), each window is
             one llama_decode batch with logits for every position (logits_all; KV cache f16 and
             flash attention on, llama.cpp's CPU defaults, or with --kv f32 the oracle's F32 KV cache
             and flash attention off), the NLL is computed in float64 numpy by tests/ppl_ref.py

The two tokenizations must be identical over the windows (checked: ./run --tokenize against llama.cpp's ids),
so both score the same tokens. Files: the SmolLM2 GGUFs written by llama.cpp's own quantizer
(tests/oracle/make_quant_goldens.py leaves them in its --scratch; their tensors are checked against
the digests recorded in tests/golden/quant/), the F32 GGUF they were made from, the shipped Q4_1
GGUF, and Gemma 3 270M Q4_K_M as shipped.

    python3 tests/oracle/ppl_llamacpp.py                         # every file found, markdown table
    python3 tests/oracle/ppl_llamacpp.py --only smollm2_q4_k_m gemma3_q4_k_m
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import ppl_ref  # noqa: E402

TEXT = ROOT / "tests" / "data" / "kjv-genesis.txt"
ORACLE_SCRATCH = Path("/tmp/oracle-quant-scratch")   # make_quant_goldens.py's default --scratch
GOLDEN = ROOT / "tests" / "golden" / "quant"
SMOL_TYPES = ("q4_0", "q5_0", "q5_1", "q8_0", "q4_k_m", "q5_k_m", "q6_k")
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1


def files(oracle_scratch: Path) -> dict[str, Path]:
    """label -> GGUF, in table order."""
    out = {"smollm2_f32": oracle_scratch / "SmolLM2-135M-Instruct.F32.gguf",
           "smollm2_q4_1": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"}
    out.update({f"smollm2_{t}": oracle_scratch / f"smollm2_{t}.gguf" for t in SMOL_TYPES})
    out["gemma3_q4_k_m"] = ROOT / "models" / "gemma3-270m-q4_k_m.gguf"
    return out


def check_digest(label: str, path: Path) -> str:
    """For llama.cpp's quantizer output: its tensors must be the ones the golden recorded."""
    golden = GOLDEN / f"{label}.json"
    if not golden.exists():
        return "no golden"
    from test_oracle_quant import tensors_digest

    want = json.loads(golden.read_text())["meta"]["llamacpp_tensors_sha256"]
    if tensors_digest(path) != want:
        raise SystemExit(f"{path}: tensors differ from {golden.name}'s llamacpp_tensors_sha256 (rebuild it with "
                         "tests/oracle/make_quant_goldens.py)")
    return "tensors match the golden's digest"


def cut_text(path: Path, n_bytes: int, out: Path) -> bytes:
    """The first n_bytes of the text, cut back to the last line break, written to out."""
    data = path.read_bytes()[:n_bytes]
    data = data[:data.rfind(b"\n") + 1] if b"\n" in data else data
    out.write_bytes(data)
    return data


def export(gguf: Path, out: Path) -> Path:
    if not out.exists() or out.stat().st_mtime < gguf.stat().st_mtime:
        subprocess.run([sys.executable, str(ROOT / "export.py"), str(gguf), str(out)], check=True, capture_output=True)
    return out


def ours_tokens(model: Path, text: bytes) -> list[int]:
    """./run --tokenize (from stdin, which drops one trailing newline; the windows never reach it)."""
    p = subprocess.run([str(ROOT / "run"), str(model), "--tokenize"], input=text, capture_output=True, check=True)
    return [int(x) for x in p.stdout.split()]


def ours_ppl(model: Path, text_file: Path, ctx: int, threads: int, kv: str) -> tuple[float, int]:
    p = subprocess.run([str(ROOT / "run"), str(model), "--ppl", str(text_file), "--ctx", str(ctx),
                        "--threads", str(threads), "--kv", kv], capture_output=True, text=True, check=True)
    m = re.search(r"perplexity: ([\d.]+) over (\d+) tokens", p.stdout)
    return float(m.group(1)), int(m.group(2))


def open_llama(gguf: Path, ctx: int, threads: int, kv: str):
    """kv "f16": llama.cpp's CPU defaults (F16 KV cache, flash attention); "f32": the oracle's settings
    (tests/oracle/make_goldens.py: F32 KV cache, flash attention off)."""
    import llama_cpp

    kv_type = GGML_TYPE_F16 if kv == "f16" else GGML_TYPE_F32
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=threads,
                           n_threads_batch=threads, logits_all=True, flash_attn=kv == "f16", type_k=kv_type,
                           type_v=kv_type, seed=0, verbose=False, n_gpu_layers=0)


def llama_tokens(llm, text: bytes) -> list[int]:
    import llama_cpp

    return llm.tokenize(text, add_bos=bool(llama_cpp.llama_vocab_get_add_bos(llm._model.vocab)), special=False)


def llama_ppl(llm, tokens: list[int], ctx: int) -> tuple[float, int]:
    """llama.cpp's logits for every window position; the NLL in float64 (ppl_ref)."""
    import llama_cpp

    bos = llama_cpp.llama_vocab_bos(llm._model.vocab) if llama_cpp.llama_vocab_get_add_bos(llm._model.vocab) else None

    def logits_of(window: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(window)
        return llm.scores[:len(window)]

    return ppl_ref.perplexity(tokens, ctx, logits_of, bos)


def measure(label: str, gguf: Path, text: bytes, text_file: Path, scratch: Path, ctx: int, threads: int,
            kv: str) -> dict:
    digest = check_digest(label, gguf)
    model = export(gguf, scratch / f"ppl-{label}.bin")
    llm = open_llama(gguf, ctx, threads, kv)
    ids_llama, ids_ours = llama_tokens(llm, text), ours_tokens(model, text)
    used = len(ids_llama) // ctx * ctx   # the tokens the windows hold (the tail is dropped)
    if ids_llama[:used] != ids_ours[:used]:
        n = next((i for i, (a, b) in enumerate(zip(ids_llama, ids_ours)) if a != b), min(len(ids_llama), len(ids_ours)))
        raise SystemExit(f"{label}: tokenizations differ at token {n} ({len(ids_llama)} vs {len(ids_ours)} tokens)")
    t0 = time.time()
    ppl_l, n_l = llama_ppl(llm, ids_llama, ctx)
    llm.close()
    t1 = time.time()
    ppl_o, n_o = ours_ppl(model, text_file, ctx, threads, kv)
    t2 = time.time()
    if n_l != n_o:
        raise SystemExit(f"{label}: llama.cpp scored {n_l} tokens, ours {n_o}")
    return {"label": label, "gguf": str(gguf), "kv": kv, "check": digest, "tokens": len(ids_llama), "scored": n_o,
            "ours": ppl_o, "llamacpp": ppl_l, "rel_diff": ppl_o / ppl_l - 1,
            "seconds": {"llamacpp": round(t1 - t0), "ours": round(t2 - t1)}}


def print_table(rows: list[dict], ctx: int, n_bytes: int, kv: str) -> None:
    print(f"\nperplexity, first {n_bytes} bytes of {TEXT.name}, windows of {ctx}, second half scored, KV {kv}\n")
    print("| file | tokens | scored | ours | llama.cpp | ours vs llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['label']} | {r['tokens']} | {r['scored']} | {r['ours']:.4f} | {r['llamacpp']:.4f} | "
              f"{100 * r['rel_diff']:+.3f} % |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oracle-scratch", type=Path, default=ORACLE_SCRATCH,
                    help="where make_quant_goldens.py left llama.cpp's SmolLM2 GGUFs")
    ap.add_argument("--scratch", type=Path, default=Path(os.environ.get("TEST_SCRATCH", "/tmp/ppl-llamacpp")),
                    help="where our exports and the cut text go")
    ap.add_argument("--only", nargs="*", help="labels to measure (default: every file found)")
    ap.add_argument("--bytes", type=int, default=60000)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", choices=("f16", "f32"), default="f16",
                    help="KV cache of both (f16: llama.cpp's defaults, flash attention on; f32: the oracle's, off)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    text_file = args.scratch / f"genesis-{args.bytes}.txt"
    text = cut_text(TEXT, args.bytes, text_file)
    rows = []
    for label, gguf in files(args.oracle_scratch).items():
        if args.only and label not in args.only:
            continue
        if not gguf.exists():
            print(f"{label}: {gguf} missing, skipped (make_quant_goldens.py writes it)", file=sys.stderr)
            continue
        rows.append(measure(label, gguf, text, text_file, args.scratch, args.ctx, args.threads, args.kv))
        r = rows[-1]
        print(f"{label}: ours {r['ours']:.4f}, llama.cpp {r['llamacpp']:.4f} ({100 * r['rel_diff']:+.3f} %), "
              f"{r['seconds']}", file=sys.stderr, flush=True)
    print_table(rows, args.ctx, len(text), args.kv)
    if args.json:
        args.json.write_text(json.dumps({"load_average": os.getloadavg(), "rows": rows}, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
