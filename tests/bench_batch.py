#!/usr/bin/env python3
"""The batch section of `make bench` (a measurement, not a test): ./run MODEL --batch FILE.

64 prompts of mixed length (5 to 400 words of plain text, drawn log-uniformly from a fixed seed
and a fixed word list, so the file is the same on every machine and every commit), 128 tokens
each (-t 0 --ignore-eos -n 128, so every sequence generates exactly 128), SmolLM2-135M q4_1 and
q8_0. For each model and each --parallel B it reports, as the median of --runs runs with the
configurations alternated between runs:

  aggregate tok/s   generated tokens / wall time of the whole batch (prefill included), from -v
  decode tok/s      the same tokens, less each sequence's first (it comes from prefill), over the
                    wall time less the time spent in prefill passes (the batch loop runs prefill
                    chunks and decode steps one after another, so the rest is decode)
  x B=1             decode tok/s / the single-sequence decode tok/s of the same run
  tok/CPU-s         generated tokens per CPU second of the child (user + sys): on a machine
                    shared with other work this moves much less than wall-clock speed
  p50 / p90         per-token latency of the sequences, from -v
  peak RSS          the child's ru_maxrss (os.wait4), against the bound file size + KV pages in
                    use (U pages of X MB, from -v) + 64 MB

The single-sequence baseline is --parallel 1 over every 4th prompt (16 of 64, the same spread
of lengths): decode speed per sequence does not depend on how many prompts follow, and the
whole file at B = 1 would take longer than everything else together.

Lookup decoding is off (--lookup 0) unless --lookup: the rows then measure batching alone. The
last line runs Gemma 3 270M (make model-gemma) on 8 prompts of 1,100 words (~1,100 tokens) in a
64 MB pool: how many run at once when the sliding-window layers give back the pages every query
has moved past, against what the pool would hold if they kept them.

For reference, llama.cpp (llama-cpp-python's low-level batched API) decodes the same prompts on
the shipped Q4_1 GGUF with the same number of sequences in flight, continuous refill, greedy
argmax and 128 tokens each; the q8_0 rows have no llama.cpp number (no Q8_0 GGUF ships).
Its threads spin at barriers: on a machine busy with other work, --threads 2 can run 10x slower
than --threads 1, so it stops after --llamacpp-cap seconds and says so ("cut short").

The last lines set decode against this machine's DRAM bandwidth and int8 peak from ./run --probe:
the weight traffic is a lower bound (a pass of B tokens reads the file once), the int8 work ~2 ops
per parameter per token. The probe takes a fraction of a second, so on a busy machine it reads
low, like everything else here.

    python3 tests/bench_batch.py [--runs 3] [--curve] [--quick] [--no-llamacpp]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_GGUF, DEFAULT_MODEL, QWEN_GGUF, RUN, RUN_FLAGS, SCRATCH, exported, qwen_model  # noqa: E402

WORK = SCRATCH / "bench-batch"
SEED = 17
LOG_SINK = None  # llama.cpp's log callback, once set
RSS_SLACK_MB = 64  # the bound: file + KV pages in use + 64 MB
WORDS = ("the of and to a in is it you that he was for on are with as his they be at one have this from or had "
         "by word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him two "
         "has look more day could go come did number sound no most people my over know water than call first who "
         "may down side been now find river town market bread winter garden letter window morning").split()


# ----- inputs -------------------------------------------------------------------

def make_prompts(n: int, lo: int, hi: int, seed: int = SEED) -> list[str]:
    """n one-line prompts of lo..hi words, lengths log-uniform (many short, some long)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        k = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        prompts.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return prompts


def write_prompts(name: str, prompts: list[str]) -> Path:
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / name
    path.write_text("".join(p + "\n" for p in prompts))
    return path


# ----- the machine --------------------------------------------------------------

def lscpu_field(name: str) -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    m = re.search(rf"^{re.escape(name)}:\s*(.+)$", out, re.M)
    return m.group(1).strip() if m else "?"


def engine_summary(model: Path) -> dict:
    """From ./run --probe -v: the kernel set it picks here, its threads, the model's parameters
    and this machine's DRAM read bandwidth and int8 peak (each measured in a fraction of a second)."""
    err = subprocess.run([str(RUN), str(model), "--probe", "-v", "-n", "0", "-i", "x"], capture_output=True,
                         text=True).stderr
    kernels = re.search(r"(\d+) threads, (\w[\w-]*) kernels", err)
    params = re.search(r"([\d.]+)M params", err)
    probe = re.search(r"DRAM read ([\d.]+) GB/s, f32 FMA [\d.]+ GFLOP/s, int8 ([\d.]+) GOP/s", err)
    if not (kernels and params and probe):
        raise RuntimeError(f"no model summary or probe in ./run --probe -v: {err.strip()[-300:]}")
    return {"kernels": kernels.group(2), "threads": int(kernels.group(1)), "params": float(params.group(1)) * 1e6,
            "gbps": float(probe.group(1)), "i8_gops": float(probe.group(2))}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----- ./run --batch ------------------------------------------------------------

SUMMARY = re.compile(r"batch: (\d+) records, (\d+) tokens in ([\d.]+) s: ([\d.]+) tok/s aggregate; prefill (\d+) tokens, "
                     r"([\d.]+) tok/s; per-token latency p50 ([\d.]+) ms, p90 ([\d.]+) ms; KV pages: (\d+) of (\d+) used "
                     r"at most \(([\d.]+) MB each\)")


def parse_summary(err: str) -> dict:
    m = SUMMARY.search(err)
    if not m:
        raise RuntimeError(f"no batch summary in -v output: {err.strip()[-300:]}")
    records, tokens, sec, agg, pre_tok, pre_tps, p50, p90, used, pages, page_mb = m.groups()
    prefill_s = int(pre_tok) / float(pre_tps) if float(pre_tps) > 0 else 0.0
    return {"records": int(records), "tokens": int(tokens), "sec": float(sec), "agg_tps": float(agg),
            "prefill_tokens": int(pre_tok), "prefill_tps": float(pre_tps), "prefill_s": prefill_s,
            "decode_tps": (int(tokens) - int(records)) / (float(sec) - prefill_s),
            "p50": float(p50), "p90": float(p90), "kv_mb": int(used) * float(page_mb)}


def check_records(out: Path, n_records: int, n_gen: int) -> list[dict]:
    """Every record whole, without error, with n_gen tokens; returns them."""
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == n_records, f"{len(recs)} records for {n_records} prompts"
    for r in recs:
        assert "error" not in r and r["tokens"] == n_gen and r["finish"] == "length", r
    return recs


def run_batch(model: Path, prompts: Path, n_prompts: int, parallel: int, n_gen: int, lookup: bool = False) -> dict:
    """One ./run --batch -v; the -v summary, the child's peak RSS and CPU time."""
    out = WORK / f"out-{os.getpid()}.jsonl"
    cmd = [str(RUN), str(model), "--batch", str(prompts), "--parallel", str(parallel), "-t", "0", "--ignore-eos",
           "-n", str(n_gen), "-v", *([] if lookup else ["--lookup", "0"]), *RUN_FLAGS]
    with open(out, "wb") as stdout:
        p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
        err = p.stderr.read().decode(errors="replace")
        _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[-300:]}")
    r = parse_summary(err)
    r["stderr"] = err
    recs = check_records(out, n_prompts, n_gen)
    r["prompt_tokens"], r["texts"] = sum(q["prompt_tokens"] for q in recs), [q["text"] for q in recs]
    r["rss_mb"] = usage.ru_maxrss / 1024
    r["bound_mb"] = model.stat().st_size / 2**20 + r["kv_mb"] * 1e6 / 2**20 + RSS_SLACK_MB
    r["tok_per_cpu_s"] = r["tokens"] / (usage.ru_utime + usage.ru_stime)
    return r


# ----- llama.cpp ----------------------------------------------------------------

def silence_llamacpp(llama_cpp) -> None:
    """Drop llama.cpp's log (its debug level prints every graph it builds). The callback object
    is kept for the life of the process: llama.cpp calls it until then."""
    global LOG_SINK
    LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user: None)
    llama_cpp.llama_log_set(LOG_SINK, ctypes.c_void_p())


def llama_tokens(llama_cpp, vocab, text: str) -> list[int]:
    raw = text.encode()
    buf = (llama_cpp.llama_token * (len(raw) + 8))()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} tokens")
    return list(buf[:n])


class LlamaBatch:
    """llama_batch of single-sequence tokens, filled one token at a time."""

    def __init__(self, llama_cpp, capacity: int):
        self.lib, self.capacity = llama_cpp, capacity
        self.batch = llama_cpp.llama_batch_init(capacity, 0, 1)

    def clear(self) -> None:
        self.batch.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        i = self.batch.n_tokens
        b = self.batch
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq
        b.n_tokens = i + 1
        return i

    def free(self) -> None:
        self.lib.llama_batch_free(self.batch)


def llamacpp_batch(gguf: Path, prompts: list[str], parallel: int, n_gen: int, threads: int, cap_s: float,
                   n_batch: int = 512) -> dict:
    """The prompts through llama.cpp with `parallel` sequences in flight: each llama_decode carries
    one token of every decoding sequence plus prompt tokens of newly admitted ones (up to n_batch);
    a finished sequence's cache is removed and the next prompt takes its slot. Greedy, n_gen each.
    Stops after cap_s seconds (its threads spin at barriers, so on a busy machine it can be 10-100x
    slower than on an idle one); "complete" says whether every prompt ran."""
    import numpy as np
    import llama_cpp as L

    silence_llamacpp(L)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(gguf).encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    ids = [llama_tokens(L, vocab, p) for p in prompts]
    cp = L.llama_context_default_params()
    cp.n_ctx = parallel * (max(map(len, ids)) + n_gen + 1)
    cp.n_batch = cp.n_ubatch = n_batch
    cp.n_seq_max = parallel
    cp.kv_unified = True  # one cache for all sequences, as the paged pool is
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = LlamaBatch(L, n_batch)
    slots: list[dict | None] = [None] * parallel
    queue = list(reversed(ids))
    generated = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    while True:
        for s in range(parallel):
            if slots[s] is None and queue:
                slots[s] = {"ids": queue.pop(), "pos": 0, "gen": 0, "last": -1}
        if not any(slots) or time.perf_counter() - t0 > cap_s:
            break
        batch.clear()
        wants: list[tuple[int, int]] = []  # (slot, batch row whose logits it samples)
        for s, q in enumerate(slots):
            if q and q["pos"] >= len(q["ids"]):  # prompt done: feed the token sampled last
                wants.append((s, batch.add(q["last"], q["pos"], s, True)))
                q["pos"] += 1
        for s, q in enumerate(slots):
            while q and q["pos"] < len(q["ids"]) and batch.batch.n_tokens < n_batch:
                last = q["pos"] == len(q["ids"]) - 1
                row = batch.add(q["ids"][q["pos"]], q["pos"], s, last)
                q["pos"] += 1
                if last:
                    wants.append((s, row))
        if L.llama_decode(ctx, batch.batch) != 0:
            raise RuntimeError("llama_decode failed")
        for s, row in wants:
            q = slots[s]
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
            q["last"], q["gen"] = int(np.argmax(logits)), q["gen"] + 1
            generated += 1
            if q["gen"] == n_gen:
                L.llama_memory_seq_rm(mem, s, -1, -1)
                slots[s] = None
    sec, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    batch.free()
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"tokens": generated, "sec": sec, "agg_tps": generated / sec, "tok_per_cpu_s": generated / cpu,
            "prompt_tokens": sum(map(len, ids)), "complete": generated == n_gen * len(ids)}


# ----- the measurement and the table ----------------------------------------------

def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def measure(models: dict[str, Path], files: dict[int, tuple[Path, int]], parallels: list[int], runs: int,
            n_gen: int, lookup: bool = False) -> dict[tuple[str, int], list[dict]]:
    """Every (model, B) `runs` times; the order of B is reversed on every other run so that a slow
    stretch of the shared machine does not land on one configuration only."""
    results: dict[tuple[str, int], list[dict]] = {(m, b): [] for m in models for b in parallels}
    for i in range(runs):
        order = parallels if i % 2 == 0 else parallels[::-1]
        for name, path in models.items():
            for b in order:
                prompts, n_prompts = files[b]
                r = run_batch(path, prompts, n_prompts, b, n_gen, lookup)
                results[(name, b)].append(r)
                print(f"run {i + 1}/{runs} {name} B={b}: {r['agg_tps']:.1f} tok/s aggregate, {r['decode_tps']:.1f} "
                      f"decode, prefill {r['prefill_tps']:.0f} tok/s, {r['tok_per_cpu_s']:.1f} tok/CPU-s, "
                      f"{r['sec']:.1f} s, load {load_average()}", file=sys.stderr, flush=True)
    return results


def llama_cell(ref: dict | None, name: str) -> str:
    if name != "q4_1":
        return "no GGUF"
    if not ref:
        return "not run"
    return f"{ref['agg_tps']:.1f}" + ("" if ref["complete"] else " (cut short)")


def table(results: dict[tuple[str, int], list[dict]], ref: dict | None, ref_parallel: int) -> str:
    head = ("| model | B | aggregate tok/s | decode tok/s | decode × B=1 | tok/CPU-s | prefill tok/s | p50 / p90 ms | "
            "peak RSS / bound MiB | llama.cpp tok/s |\n|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for (name, b), rs in results.items():
        base = results[(name, 1)]
        ratio = statistics.median(r["decode_tps"] / s["decode_tps"] for r, s in zip(rs, base))
        rss, bound = max(r["rss_mb"] for r in rs), min(r["bound_mb"] for r in rs)
        llama = llama_cell(ref, name) if b == ref_parallel else "—"
        rows.append(f"| {name} | {b} | {median(rs, 'agg_tps'):.1f} | {median(rs, 'decode_tps'):.1f} | {ratio:.2f}× | "
                    f"{median(rs, 'tok_per_cpu_s'):.1f} | {median(rs, 'prefill_tps'):.0f} | "
                    f"{median(rs, 'p50'):.0f} / {median(rs, 'p90'):.0f} | {rss:.0f} / {bound:.0f} "
                    f"{'ok' if rss <= bound else 'EXCEEDED'} | {llama} |")
    return head + "\n".join(rows)


def rooflines(name: str, model: Path, results: dict[tuple[str, int], list[dict]], eng: dict, parallel: int) -> str:
    """What decode asks of memory and of the int8 units at B = 1 and B = parallel: every decode
    pass reads the whole file (a pass of B tokens reads it once) and each token costs ~2 ops per
    parameter. Whichever fraction is near 1 is the bound; if neither is, the time goes elsewhere."""
    size_gb = model.stat().st_size / 1e9
    parts = []
    for b in (1, parallel):
        tps = median(results[(name, b)], "decode_tps")
        gbps = size_gb * tps / b  # at most b tokens per pass: at least this many passes
        gops = 2 * eng["params"] * tps / 1e9
        parts.append(f"B={b}: weights >= {gbps:.2f} GB/s ({gbps / eng['gbps']:.0%} of DRAM), "
                     f"~{gops:.0f} GOP/s ({gops / eng['i8_gops']:.0%} of int8 peak)")
    return f"{name} decode: " + "; ".join(parts)


GEMMA = DEFAULT_MODEL.parent / "gemma3-270m.bin"
PAGE_TOKENS = 72  # positions per KV page (run.c)
IN_FLIGHT = re.compile(r"batch: \d+(?:/\d+)? done, (\d+) in flight")


def gemma_reclaim(n_prompts: int, words: int, kv_mb: int, n_gen: int) -> str:
    """Gemma 3 270M's sliding-window layers (15 of 18, a 512-position window) give their pages back once every
    query is past them: how many long sequences a fixed --kv-mem runs at once, and the pages in use against
    what they would have kept, from one -v run (the progress lines every 2 s give the sequences in flight)."""
    prompts = write_prompts("gemma.txt", make_prompts(n_prompts, words, words, seed=SEED + 1))
    cmd = [str(RUN), str(GEMMA), "--batch", str(prompts), "--kv-mem", str(kv_mb), "--parallel", str(n_prompts),
           "-t", "0", "--ignore-eos", "-n", str(n_gen), "-v", "--lookup", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    recs = [json.loads(line) for line in p.stdout.splitlines()]
    pool = re.search(r"KV pool of (\d+) pages of \d+ positions \(([\d.]+) MB\)", p.stderr)
    used = re.search(r"pages in use at most (\d+), (\d+) had they kept them", p.stderr)
    flights = [int(x) for x in IN_FLIGHT.findall(p.stderr)]
    positions = max(r["prompt_tokens"] for r in recs) + n_gen - 1
    full = -(-positions // PAGE_TOKENS)
    return (f"Gemma 3 270M, {n_prompts} prompts of {min(r['prompt_tokens'] for r in recs)}-{max(r['prompt_tokens'] for r in recs)} "
            f"tokens, {n_gen} tokens each, --kv-mem {kv_mb} ({pool.group(1)} pages of every layer, {pool.group(2)} MB): "
            f"at most {max(flights, default=0)} sequences in flight (progress lines every 2 s) where keeping every page "
            f"({full} per sequence) would fit {int(pool.group(1)) // full}; pages in use at most {used.group(1)}, "
            f"{used.group(2)} had the window's old pages been kept; {sum(r['tokens'] for r in recs)} tokens in all")


# ----- chat prompts: what a script sends an instruct model ---------------------------

CHAT_PROMPTS = Path(__file__).resolve().parent / "data" / "bench_chat_prompts.txt"


def single_texts(model: Path, prompts: list[str], n_gen: int) -> list[str]:
    """Each prompt's greedy answer from `./run -c -i PROMPT` alone, as a batch record writes text (U+FFFD for
    bytes that are not UTF-8)."""
    out = []
    for prompt in prompts:
        p = subprocess.run([str(RUN), str(model), "-c", "-i", prompt, "-t", "0", "--ignore-eos", "-n", str(n_gen)],
                           capture_output=True, check=True)
        out.append(p.stdout.decode("utf-8", "replace"))
    return out


def chat_models(names: list[str]) -> dict[str, Path]:
    """The chat section's models by name: qwen (the 1.5B exported as shipped, when its GGUF is there), q4_1."""
    models = {}
    for name in names:
        if name == "q4_1":
            models["SmolLM2 q4_1"] = DEFAULT_MODEL
        elif name == "qwen" and QWEN_GGUF.exists():
            models["Qwen2.5-Coder-1.5B q4_k_m"] = qwen_model()
        elif name == "qwen":
            print(f"{QWEN_GGUF} is missing (make model-qwen): no chat rows for it", file=sys.stderr)
        else:
            raise SystemExit(f"--chat-models: unknown model {name!r} (known: qwen, q4_1)")
    return models


def chat_section(models: dict[str, Path], runs: int, parallel: int, n_gen: int, lookup: bool = False) -> None:
    """The chat prompts of tests/data/bench_chat_prompts.txt (each a one-turn chat, n_gen tokens, -t 0
    --ignore-eos) through --batch at --parallel 1 and `parallel`, alternating; aggregate and decode tok/s,
    per-token latency, and whether every record's text is the answer of the same prompt run alone."""
    prompts = CHAT_PROMPTS.read_text().splitlines()
    path = write_prompts("chat.jsonl", [json.dumps({"prompt": p, "chat": True}) for p in prompts])
    print(f"\n{len(prompts)} chat prompts ({CHAT_PROMPTS.name}), {n_gen} tokens each (-t 0 --ignore-eos), --batch at "
          f"--parallel 1 and {parallel}, medians of {runs} runs alternating; 'same text' compares every record of "
          "every run with `./run -c -i PROMPT` alone", flush=True)
    singles = {name: single_texts(model, prompts, n_gen) for name, model in models.items()}
    parallels = [1, parallel]
    results = measure(models, {b: (path, len(prompts)) for b in parallels}, parallels, runs, n_gen, lookup)
    print("\n| model | B | aggregate tok/s | decode tok/s | decode × B=1 | p50 / p90 per-token ms | same text as alone |")
    print("|---|---|---|---|---|---|---|")
    for (name, b), rs in results.items():
        base = results[(name, 1)]
        ratio = statistics.median(r["decode_tps"] / s["decode_tps"] for r, s in zip(rs, base))
        same = sum(t == want for r in rs for t, want in zip(r["texts"], singles[name]))
        total = len(rs) * len(prompts)
        print(f"| {name} | {b} | {median(rs, 'agg_tps'):.1f} | {median(rs, 'decode_tps'):.1f} | {ratio:.2f}× | "
              f"{median(rs, 'p50'):.0f} / {median(rs, 'p90'):.0f} | "
              f"{'all ' if same == total else 'NO: '}{same} of {total} |", flush=True)


def llamacpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp reference", file=sys.stderr)
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs of every configuration (median)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts in the batch")
    ap.add_argument("--single", type=int, default=16, help="prompts of the B=1 baseline (every k-th of --prompts)")
    ap.add_argument("-n", "--tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--parallel", type=int, default=16, help="B of the batch runs (and of llama.cpp)")
    ap.add_argument("--curve", action="store_true", help="also B = 4 and 8")
    ap.add_argument("--quick", action="store_true", help="16 prompts (4 at B=1), one run: a smoke run")
    ap.add_argument("--dtypes", default="q4_1,q8_0", help="comma-separated: q4_1 and/or q8_0")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (./run takes its default)")
    ap.add_argument("--llamacpp-cap", type=float, default=180, help="seconds llama.cpp may run at most")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp reference")
    ap.add_argument("--lookup", action="store_true", help="lookup decoding on (default: --lookup 0, batching alone)")
    ap.add_argument("--no-gemma", action="store_true", help="leave out the Gemma 3 sliding-window reclaim line")
    ap.add_argument("--chat", action="store_true", help="also the chat section: 16 chat prompts x --chat-tokens on "
                    "Qwen2.5-Coder-1.5B (when its GGUF is there) and SmolLM2 q4_1, --parallel 1 and --parallel")
    ap.add_argument("--chat-only", action="store_true", help="only the chat section")
    ap.add_argument("--chat-tokens", type=int, default=64, help="tokens per chat answer")
    ap.add_argument("--chat-models", default="qwen,q4_1",
                    help="models of the chat section: qwen (the 1.5B, when its GGUF is there), q4_1 (SmolLM2)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.single, args.runs = 16, 4, 1
    t_start = time.perf_counter()
    eng = engine_summary(DEFAULT_MODEL)
    print(f"CPU: {lscpu_field('Model name')}, {lscpu_field('CPU(s)')} CPUs; ./run: {eng['kernels']} kernels, "
          f"{eng['threads']} threads; --probe: DRAM read {eng['gbps']:.1f} GB/s, int8 {eng['i8_gops']:.0f} GOP/s")
    print(f"load average before: {load_average()}")
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print("warning: more runnable threads than CPUs: the machine is busy, the speeds are lower bounds")
    if not args.chat_only:
        mixed_section(args, eng)
    if args.chat or args.chat_only:
        chat_section(chat_models(args.chat_models.split(",")), args.runs, args.parallel, args.chat_tokens, args.lookup)
    print(f"load average after: {load_average()}; {time.perf_counter() - t_start:.0f} s in all")


def mixed_section(args: argparse.Namespace, eng: dict) -> None:
    """The 64 plain-text prompts of mixed length at --parallel 1 and B, SmolLM2 q4_1 / q8_0, llama.cpp beside."""
    prompts = make_prompts(args.prompts, 5, 400)
    step = max(1, args.prompts // args.single)
    files = {args.parallel: (write_prompts("batch.txt", prompts), len(prompts)),
             1: (write_prompts("single.txt", prompts[::step]), len(prompts[::step]))}
    parallels = sorted({1, args.parallel, *((4, 8) if args.curve else ())})
    for b in parallels:
        files.setdefault(b, files[args.parallel])
    models = {d: DEFAULT_MODEL if d == "q4_1" else exported(d) for d in args.dtypes.split(",")}
    print(f"{len(prompts)} prompts of 5-400 words (seed {SEED}), {args.tokens} tokens each (-t 0 --ignore-eos); "
          f"B=1 baseline: --parallel 1 over {len(prompts[::step])} of them (every {step}th); "
          f"medians of {args.runs} runs", flush=True)
    results = measure(models, files, parallels, args.runs, args.tokens, args.lookup)
    ref = None
    if not args.no_llamacpp and "q4_1" in models and llamacpp_installed():
        ref = llamacpp_batch(DEFAULT_GGUF, prompts, args.parallel, args.tokens, args.threads, args.llamacpp_cap)
        print(f"llama.cpp {DEFAULT_GGUF.name}, {args.parallel} in flight, {args.threads} threads: "
              f"{ref['agg_tps']:.1f} tok/s aggregate, {ref['tok_per_cpu_s']:.1f} tok/CPU-s, {ref['tokens']} tokens "
              f"in {ref['sec']:.1f} s{'' if ref['complete'] else ' (stopped at --llamacpp-cap)'}, "
              f"{ref['prompt_tokens']} prompt tokens (./run: {results[('q4_1', args.parallel)][0]['prompt_tokens']})",
              file=sys.stderr, flush=True)
    print()
    print(table(results, ref, args.parallel))
    print()
    for name, path in models.items():
        print(rooflines(name, path, results, eng, args.parallel))
    if GEMMA.exists() and not args.no_gemma:
        print(gemma_reclaim(8, 1100, 64, 32))


if __name__ == "__main__":
    main()
