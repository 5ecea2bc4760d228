#!/usr/bin/env python3
"""llama.cpp's speed on this machine, for comparison with ./run -v (prints JSON).

Model files: the Q4_1 GGUF as shipped, and F32, F16 and Q8_0 GGUFs made from it with
llama.cpp's own quantize code (kept next to --f32). Timings come from llama.cpp's own counters (llama_perf_context: prompt-eval time/tokens for
batched decodes, eval time/tokens for one-token decodes), median over --runs after one
warm-up. Measured per model file:
  prefill_128 / prefill_512   one llama_decode batch of 128 / 512 prompt tokens, tok/s
  decode_128                  128 one-token decodes after a 128-token prompt
                              (positions 128..255), tok/s
Two configurations: "matched" uses the oracle settings of make_goldens.py (F32 KV cache,
flash attention off, like our engine); "llamacpp_default" uses what llama.cpp picks by
default on CPU (F16 KV cache, flash attention on).

    python3 tests/oracle/bench_llamacpp.py                # needs llama-cpp-python

--shell GGUF answers one request as a shell user of llama-cpp-python would run it, for tests/bench.py's
1.5B section: load the model (llama.cpp's CPU defaults), stream the greedy completion of --prompt to stdout
piece by piece (flushed), then print one JSON line on stderr: the import and load times, and the process's
private memory (Private_Clean + Private_Dirty of /proc/self/smaps_rollup, and of it Anonymous) and resident
size before the model was loaded and after the request, with its peak (VmHWM).

    python3 tests/oracle/bench_llamacpp.py --shell MODEL.gguf --prompt hi -n 1 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 = 0, 1, 8
LLAMA_FTYPE_MOSTLY_F16, LLAMA_FTYPE_MOSTLY_Q8_0 = 1, 7
DERIVED = {"f16": (LLAMA_FTYPE_MOSTLY_F16, GGML_TYPE_F16), "q8_0": (LLAMA_FTYPE_MOSTLY_Q8_0, GGML_TYPE_Q8_0)}
CONFIGS = {
    "matched": {"flash_attn": False, "type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32},
    "llamacpp_default": {"flash_attn": True, "type_k": GGML_TYPE_F16, "type_v": GGML_TYPE_F16},
}
N_CTX = 1024  # room for 512 prompt tokens, and for 128 + 128


def prompt_ids(llm, n: int) -> list[int]:
    """n real-text token ids (content does not affect speed, but keeps attention realistic)."""
    from make_goldens import PROSE

    ids: list[int] = []
    while len(ids) < n:
        ids += llm.tokenize(PROSE.encode(), add_bos=False, special=False)
    return ids[:n]


def perf(llm) -> tuple[float, int, float, int]:
    import llama_cpp

    d = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return d.t_p_eval_ms, d.n_p_eval, d.t_eval_ms, d.n_eval


def decode(llm, ids: list[int]) -> None:
    """One llama_decode call, waited for: llama.cpp books its timing counters at the
    synchronization that reading logits implies, and a sampler always reads them."""
    import llama_cpp

    llm.eval(ids)
    llama_cpp.llama_synchronize(llm._ctx.ctx)


def one_run(llm, ids512: list[int]) -> dict[str, float]:
    import llama_cpp

    out = {}
    for n in (128, 512):
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        decode(llm, ids512[:n])
        t_ms, n_tok, _, _ = perf(llm)
        assert n_tok == n, f"llama.cpp counted {n_tok} prompt tokens, expected {n}"
        out[f"prefill_{n}_tok_s"] = n / (t_ms / 1e3)
    llm.reset()
    decode(llm, ids512[:128])
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    for tok in ids512[128:256]:
        decode(llm, [tok])
    _, _, t_ms, n_tok = perf(llm)
    assert n_tok == 128, f"llama.cpp counted {n_tok} decode tokens, expected 128"
    out["decode_128_tok_s"] = 128 / (t_ms / 1e3)
    return out


def bench(path: Path, config: dict, threads: int, runs: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, logits_all=False, verbose=False, n_gpu_layers=0, **config)
    ids = prompt_ids(llm, 512)
    one_run(llm, ids)  # warm-up: page in the weights, spin up the thread pool
    results = []
    for i in range(runs):
        results.append(one_run(llm, ids))
        print(f"{path.name} run {i + 1}/{runs}: {results[-1]}", file=sys.stderr, flush=True)
    llm.close()
    return {key: {"median": round(statistics.median(r[key] for r in results), 1),
                  "runs": [round(r[key], 1) for r in results]} for key in results[0]}


def memory_kb(pid: int | str = "self") -> dict[str, int]:
    """A process's private memory (Private_Clean + Private_Dirty of smaps_rollup: the pages no other process maps,
    so a model file's pages too while it is the only one mapping them), of it the anonymous memory (heap), its
    resident size now and its peak resident size (VmHWM), in kB."""
    rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    kb = lambda v: int(v.split()[0])  # noqa: E731
    return {"private_kb": kb(rollup["Private_Clean"]) + kb(rollup["Private_Dirty"]), "anon_kb": kb(rollup["Anonymous"]),
            "rss_kb": kb(rollup["Rss"]), "peak_rss_kb": kb(status["VmHWM"])}


def shell_request(gguf: Path, prompt: str, n: int, threads: int, n_ctx: int) -> None:
    """--shell: one greedy request, streamed to stdout; timings and memory as one JSON line on stderr."""
    import time

    t0 = time.perf_counter()
    import llama_cpp

    t_import = time.perf_counter()
    before = memory_kb()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          verbose=False, n_gpu_layers=0)
    t_load = time.perf_counter()
    out = sys.stdout.buffer
    for chunk in llm.create_completion(prompt, max_tokens=n, temperature=0, stream=True):
        out.write(chunk["choices"][0]["text"].encode())
        out.flush()
    after = memory_kb()
    print(json.dumps({"import_ms": (t_import - t0) * 1e3, "load_ms": (t_load - t_import) * 1e3,
                      "n_ctx": llm.n_ctx(), "before_load": before, "after": after}), file=sys.stderr, flush=True)
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shell", type=Path, help="answer one request from this GGUF (see above) and exit")
    ap.add_argument("--prompt", default="hi", help="--shell: the prompt (plain text)")
    ap.add_argument("-n", type=int, default=1, help="--shell: tokens to generate")
    ap.add_argument("--ctx", type=int, default=0, help="--shell: n_ctx (0: the model's)")
    ap.add_argument("--q4-1", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--f32", type=Path, default=Path("/tmp/oracle-scratch/SmolLM2-135M-Instruct.F32.gguf"),
                    help="made from --q4-1 with llama.cpp's quantize API if missing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--config", choices=[*CONFIGS, "both"], default="both")
    ap.add_argument("--dtypes", default="f32,f16,q8_0,q4_1", help="comma-separated subset")
    args = ap.parse_args()
    if args.shell:
        shell_request(args.shell, args.prompt, args.n, args.threads, args.ctx)
        return

    import llama_cpp
    from make_goldens import make_f32_gguf, requantize_gguf

    if not args.f32.exists():
        args.f32.parent.mkdir(parents=True, exist_ok=True)
        make_f32_gguf(args.q4_1, args.f32)
    models = {"q4_1": args.q4_1, "f32": args.f32}
    for name, (ftype, ttype) in DERIVED.items():
        models[name] = args.f32.with_name(args.f32.name.replace(".F32.", f".{name.upper()}."))
        if name in args.dtypes.split(",") and not models[name].exists():
            requantize_gguf(args.f32, models[name], ftype, ttype)
    configs = CONFIGS if args.config == "both" else {args.config: CONFIGS[args.config]}
    if os.getloadavg()[0] > 0.5:
        # llama.cpp's threads spin at barriers: with other work on the cores, one preempted
        # thread stalls the other, and decode speed collapses by 10-100x.
        print(f"warning: load average {os.getloadavg()[0]:.1f}; the machine is busy and the "
              "numbers will be far too low", file=sys.stderr)
    report = {"llama_cpp_python": llama_cpp.__version__, "load_average_at_start": os.getloadavg(),
              "system_info": llama_cpp.llama_print_system_info().decode().strip(),
              "threads": args.threads, "runs": args.runs, "n_ctx": N_CTX, "n_batch": 512,
              "timing": "llama_perf_context counters, median of runs after one warm-up",
              "results": {}}
    for cname, config in configs.items():
        for mname in args.dtypes.split(","):
            path = models[mname]
            report["results"][f"{mname}/{cname}"] = {"model": path.name, "settings": {
                "flash_attn": config["flash_attn"], "kv_cache": "f32" if config["type_k"] == GGML_TYPE_F32 else "f16"},
                **bench(path, config, args.threads, args.runs)}
    report["load_average_at_end"] = os.getloadavg()  # > threads means the numbers are not clean
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
