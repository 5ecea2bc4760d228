#!/usr/bin/env python3
"""Side-by-side speed of tokenizer.c and llama.cpp on the same 1 MB inputs (not a test).

Both sides are timed in CPU seconds of their own process (so other load on the machine
counts less): ours with tests/tok_driver.c --bench (built -O2 here), llama.cpp through
its C API from llama-cpp-python (one llama_tokenize / llama_detokenize call per run,
buffers sized up front, so no Python per-token work is timed). The ids of both are
compared too. Needs llama-cpp-python and the model files export.py writes.

    python3 tests/tokenizer/bench_vs_llamacpp.py [--seconds 2]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MB = 1 << 20
MODELS = {"smollm2": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
          "gemma3": ROOT / "models" / "gemma3-270m-q4_k_m.gguf"}
INPUTS = ("english", "code", "cjk")


def repeated(path: Path) -> bytes:
    one = path.read_bytes()
    return one * -(-MB // len(one))          # as tok_driver --min-bytes does


def timed(fn, seconds: float) -> tuple[float, object]:
    runs, spent, result = 0, 0.0, None
    while spent < seconds or runs == 0:
        t0 = time.process_time()
        result = fn()
        spent += time.process_time() - t0
        runs += 1
    return spent / runs, result


def llama_side(gguf: Path, data: bytes, seconds: float) -> tuple[float, float, list[int]]:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    cap = len(data) + 8
    tokens = (llama_cpp.llama_token * cap)()

    def encode() -> int:
        return llama_cpp.llama_tokenize(vocab, data, len(data), tokens, cap, False, False)

    enc, n = timed(encode, seconds)
    assert n >= 0, "llama_tokenize failed"
    out = ctypes.create_string_buffer(4 * len(data) + 64)

    def decode() -> int:
        return llama_cpp.llama_detokenize(vocab, tokens, n, out, len(out), False, False)

    dec, _ = timed(decode, seconds)
    return enc, dec, list(tokens[:n])


def our_side(driver: Path, model: Path, path: Path, seconds: float) -> tuple[float, float, str]:
    r = subprocess.run([str(driver), str(model), "--bench", str(path), "--min-bytes", str(MB), "--seconds", str(seconds)],
                       capture_output=True, text=True, check=True)
    per_run = [w for w in r.stdout.split() if w.startswith("(")]   # "(0.0608 s/run, ...)" for encode, decode
    enc = float(per_run[0].strip("("))
    dec = float(per_run[1].strip("("))
    return enc, dec, r.stdout.strip()


def our_ids(driver: Path, model: Path, data: bytes, tmp: Path) -> list[int]:
    hexfile = tmp / "one.hex"
    hexfile.write_text(data.hex() + "\n")
    r = subprocess.run([str(driver), str(model), "--encode", str(hexfile)], capture_output=True, text=True, check=True)
    return [int(x) for x in r.stdout.split()]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0, help="time each measurement at least this long")
    args = ap.parse_args()
    import llama_cpp
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; llama-cpp-python {llama_cpp.__version__}")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        driver = tmp / "tok_driver"
        subprocess.run(["cc", "-O2", "-std=c11", "-I", str(ROOT), str(ROOT / "tests" / "tok_driver.c"),
                        str(ROOT / "tokenizer.c"), "-o", str(driver)], check=True)
        print(f"{'model':8} {'input':8} {'MB':>5} | {'encode MB/s':>22} | {'decode MB/s':>22} | ids")
        print(f"{'':8} {'':8} {'':>5} | {'ours':>10} {'llama.cpp':>11} | {'ours':>10} {'llama.cpp':>11} |")
        for name, gguf in MODELS.items():
            model = tmp / f"{name}.bin"
            subprocess.run(["python3", str(ROOT / "export.py"), str(gguf), str(model), "--tokenizer-only"],
                           check=True, capture_output=True)
            for text in INPUTS:
                path = HERE / "bench" / f"{text}.txt"
                data = repeated(path)
                mb = len(data) / 1e6
                o_enc, o_dec, _ = our_side(driver, model, path, args.seconds)
                l_enc, l_dec, l_ids = llama_side(gguf, data, args.seconds)
                same = our_ids(driver, model, data, tmp) == l_ids
                print(f"{name:8} {text:8} {mb:5.2f} | {mb / o_enc:10.1f} {mb / l_enc:11.1f} | {mb / o_dec:10.1f} "
                      f"{mb / l_dec:11.1f} | {'identical' if same else 'DIFFERENT'} ({len(l_ids)} tokens)")


if __name__ == "__main__":
    main()
