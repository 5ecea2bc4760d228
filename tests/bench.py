#!/usr/bin/env python3
"""The benchmark behind `make bench` (a measurement, not a test).

For each weight type it exports SmolLM2-135M-Instruct from the GGUF (once,
into models/bench-DTYPE.bin) and runs ./run several times, reporting the
median [min-max] of: load time, TTFT and prefill tok/s for 128- and
512-token prompts, decode tok/s and inter-token latency (p50, p90) over
128 tokens, and peak RSS. The machine's DRAM read bandwidth and f32/int8
peaks come from ./run --probe; each phase is shown as a fraction of its own
roofline (decode: GB/s achieved / bandwidth of the level it streams from, DRAM or the last-level
cache; prefill: GFLOP/s / peak).
With llama-cpp-python installed, llama.cpp runs the same GGUF in the same
session and the ratio is printed.

The main table measures plain decoding (--lookup 0). The lookup section runs
the tasks of tests/data/bench_tasks/ (code edits and prose tasks answered from
their input, and an open-ended one) through -c on Qwen2.5-Coder-1.5B (when its
GGUF is there) and SmolLM2 q4_1 and q8_0, each with and without lookup
decoding (greedy: both texts must be identical, and are compared), alternating
which goes first, and prints decode tok/s, their ratio, drafts kept and tokens
per pass; per model the median ratio and mean tokens per pass of the code and
prose tasks, and the measured cost of a 16-token pass over a 1-token one (from
-v's "lookup cost" line of a --lookup-fixed run); with --llamacpp also
llama.cpp's plain decode speed on the same prompts.

--qwen (--qwen-only) is the 1.5B section: Qwen2.5-Coder-1.5B-Instruct Q4_K_M,
whose 1.1 GB of weights stream from DRAM for every token, run by ./run (its
export) and by llama.cpp on the GGUF, alternating: load time from a warm page
cache, the wall time and time to the first stdout byte of `-n 1 -i hi` as a
shell sees them, prefill 512 and decode 128 tok/s, decode as a share of the
probed DRAM bandwidth, private memory at the end of a request (and of a
second ./run on the same file at the same time) beside the mapped weights,
peak RSS; medians, ratios, the machine line.

--sampling-only measures what the sampling chain costs (issue 27): decode tok/s greedy, with the default
chain and with the full chain (min-p and every penalty on), --lookup 0, alternating, for both vocabularies.

--prompt-cache-only measures the prompt cache (issue 27): the TTFT (process start to the first byte of text) of
a 2,000-token prompt plus a question without a cache and with its first 2,000 tokens cached (read-only, and
read-write, which writes its own prompt after the first token), alternating, on Qwen2.5-Coder-1.5B (when
models/qwen2.5-coder-1.5b.bin is there), SmolLM2 and Gemma 3; and the cache's read-and-check and copy GB/s.

--json-only measures what constrained output costs: decode tok/s with and
without --json-schema and --json (greedy, --lookup 0, a prompt that asks
for a long JSON array; a fixed token count: --ignore-eos without, a schema
of at least 40 objects that cannot be finished within -n with),
alternating, for both vocabularies (SmolLM2: 49152 tokens, Gemma 3:
262144).


The per-type table (--per-type) runs each GGUF type (SmolLM2 written by llama.cpp's own
quantizer from the F32 GGUF, as tests/oracle/make_quant_goldens.py writes it, and Gemma 3 270M
Q4_K_M as shipped) through our engine (export.py's default --dtype keep) and through llama.cpp,
alternating the two run by run, and prints decode and 512-token prefill tok/s with their ratio.

The per-kernel-set table (--sets) runs q4_1 and q8_0 (bench-DTYPE.bin) with every kernel set this CPU runs
(./run --kernels NAME; the scalar set once, it is 3-15x slower) and llama.cpp on the GGUF of the same weights,
alternating, and prints prefill 512 and decode tok/s, their ratios to llama.cpp, prefill as a share of the
set's and of the machine's probed int8 peak, and decode as a share of the bandwidth of the level it streams
from (./run's roofline: the last-level cache when a token's bytes fit in it, else DRAM), in the README's
markdown, under a line naming the machine (CPU, cores, threads, probes, load average).

Every table names the kernel set that ran.

    python3 tests/bench.py [--runs 5] [--dtypes f32,f16,q8_0,q4_1] [--threads N] [--long] [--lookup] [--json-only]
    python3 tests/bench.py --sets-only --runs 5 [--scratch DIR]
    python3 tests/bench.py --sampling-only --runs 5
    python3 tests/bench.py --prompt-cache-only --runs 5
    python3 tests/bench.py --per-type-only --runs 5 --threads 2 [--types q4_k_m,gemma3-q4_k_m]
    python3 tests/bench.py --qwen-only --runs 3
    python3 tests/bench.py --lookup-only --runs 1 --lookup-models qwen --tasks fix_bug,story
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = Path(os.environ.get("RUN_BIN", ROOT / "run"))  # RUN_BIN: another build, e.g. for a before/after table
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PASSAGE = (ROOT / "README.md").read_text()  # prompt text: deterministic, ships with the repo
sys.path.insert(0, str(ROOT / "tests" / "oracle"))  # the llama.cpp helpers, imported where used
sys.path.insert(0, str(ROOT / "tests"))
from common import QWEN_GGUF, RUN_FLAGS, qwen_model  # noqa: E402  (the 1.5B: its GGUF, and its export into the tests' scratch)


def cpu_name() -> str:
    """The CPU model, with its family/model numbers (a VM may show only "AMD EPYC") and SIMD level."""
    info: dict[str, str] = {}
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = info.get("flags", "").split()
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    vnni = ", VNNI" if "avx512_vnni" in flags or "avx_vnni" in flags else ""
    return (f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}, {simd}{vnni})")


def export(dtype: str) -> Path:
    out = ROOT / "models" / f"bench-{dtype}.bin"
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "export.py"), str(GGUF), str(out), "--dtype", dtype],
                       check=True, capture_output=True)
    return out


def prompt_ids(model: Path, n: int) -> str:
    """n token ids of real text (the README, repeated as needed)."""
    out = subprocess.run([str(RUN), str(model), "--tokenize"], input=PASSAGE.encode(), capture_output=True, check=True)
    ids = out.stdout.split()
    while len(ids) < n:
        ids += ids
    return " ".join(i.decode() for i in ids[:n])


def run_once(model: Path, ids: str, n_gen: int, threads: int, extra: list[str] | None = None) -> dict:
    """One ./run -v; returns the parsed numbers and the child's peak RSS."""
    cmd = [str(RUN), str(model), "--ids", ids, "-n", str(n_gen), "-t", "0", "--ignore-eos", "-v",
           "--threads", str(threads), *(extra or []), *RUN_FLAGS]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed: {err.strip()}")
    num = r"([\d.]+)"
    r = {"rss_mb": usage.ru_maxrss / 1024}
    r["load_ms"] = float(re.search(r"loaded in " + num, err).group(1))
    m = re.search(rf"prefill: (\d+) tokens in {num} ms, {num} tok/s, TTFT {num} ms, {num} GFLOP/s", err)
    r.update(ttft_ms=float(m.group(4)), prefill_tps=float(m.group(3)), gflops=float(m.group(5)))
    m = re.search(rf"decode: (\d+) tokens, {num} tok/s, ITL {num} ms, p50 {num} ms, p90 {num} ms, {num} GB/s", err)
    r.update(decode_tps=float(m.group(2)), itl_p50=float(m.group(4)), itl_p90=float(m.group(5)), gbps=float(m.group(6)))
    return r


def probe(model: Path, threads: int, kernels: str | None = None) -> dict:
    """./run --probe -v on `model` with a kernel set (default: the best one): the set that ran, DRAM and
    last-level cache read GB/s, the set's f32 and int8 peaks, and for this model the level its decode
    streams from ("DRAM", or "L3" when a token's bytes fit in the cache) with that level's GB/s, and the
    MB a decoded token reads (weights + KV, as -v counts them)."""
    extra = ["--kernels", kernels] if kernels else []
    out = subprocess.run([str(RUN), str(model), "--probe", "-v", "-n", "1", "-i", "x", "--threads", str(threads),
                          *extra], capture_output=True, text=True, check=True).stderr
    m = re.search(r"DRAM read ([\d.]+) GB/s, f32 FMA ([\d.]+) GFLOP/s, int8 ([\d.]+) GOP/s", out)
    cache = re.search(r"L(\d) cache \(([\d.]+) MiB\) read ([\d.]+) GB/s", out)
    level = re.search(r"decode at \d+% of (\S+) bandwidth \(([\d.]+) MB/token at ([\d.]+) GB/s", out)
    return {"kernels": re.search(r"(\w[\w-]*) kernels", out).group(1), "gbps": float(m.group(1)),
            "f32": float(m.group(2)), "i8": float(m.group(3)),
            "llc": f"L{cache.group(1)} {cache.group(2)} MiB" if cache else "last-level cache unknown",
            "llc_gbps": float(cache.group(3)) if cache else 0.0,
            "level": level.group(1), "level_gbps": float(level.group(3)), "mb_per_token": float(level.group(2))}


PROBES = 3  # a peak is a maximum: the best of a few probes, since other work on the cores only lowers one


def best_probe(model: Path, threads: int, kernels: str | None = None) -> dict:
    """probe() PROBES times; each figure's best."""
    runs = [probe(model, threads, kernels) for _ in range(PROBES)]
    return {k: max(r[k] for r in runs) if isinstance(v, float) else v for k, v in runs[0].items()}


def machine_line(mc: dict, threads: int) -> str:
    """The machine a table was measured on: CPU, cores, threads, caches and probes, load average now."""
    load = os.getloadavg()
    cache = f"{mc['llc']} read {mc['llc_gbps']:.0f} GB/s" if mc["llc_gbps"] else mc["llc"]
    return (f"machine: {cpu_name()}, {os.cpu_count()} cores, {threads} threads; ./run --probe: DRAM read "
            f"{mc['gbps']:.1f} GB/s, {cache}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def decode_share(gbps: list[float], model: Path, threads: int, mc: dict) -> str:
    """Decode GB/s (median) as a share of the bandwidth of the level it streams from, as ./run's roofline
    decides it for this model (the cache when a token's bytes fit in it): "73% of DRAM"."""
    level = probe(model, threads, mc["kernels"])["level"]
    bw = mc["gbps"] if level == "DRAM" else mc["llc_gbps"]
    return f"{statistics.median(gbps) / bw * 100:.0f}% of {level}"


def summary(values: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def bench_dtype(dtype: str, runs: int, threads: int) -> dict:
    model = export(dtype)
    ids128, ids512 = prompt_ids(model, 128), prompt_ids(model, 512)
    plain = ["--lookup", "0"]  # plain decoding: one forward pass per token
    short = [run_once(model, ids128, 129, threads, plain) for _ in range(runs)]  # 128 decoded after the first
    long = [run_once(model, ids512, 1, threads, plain) for _ in range(runs)]
    col = lambda rs, k: [r[k] for r in rs]  # noqa: E731
    return {"dtype": dtype, "file_mb": model.stat().st_size / 1e6,
            "load_ms": col(short, "load_ms"), "ttft128": col(short, "ttft_ms"), "pp128": col(short, "prefill_tps"),
            "ttft512": col(long, "ttft_ms"), "pp512": col(long, "prefill_tps"), "gflops512": col(long, "gflops"),
            "tg128": col(short, "decode_tps"), "p50": col(short, "itl_p50"), "p90": col(short, "itl_p90"),
            "gbps": col(short, "gbps"), "rss": col(short, "rss_mb")}


TASKS = ROOT / "tests" / "data" / "bench_tasks"
LOOKUP_TOKENS = 256  # code edits return the whole function: most answers end within it


def lookup_tasks(only: list[str] | None = None) -> list[tuple[str, str, str]]:
    """The lookup section's tasks, tests/data/bench_tasks/KIND_NAME.txt (KIND: code and prose tasks answer from
    their input, open is open-ended): (name, kind, user message), code first, in name order; `only` keeps the
    tasks whose name contains one of its strings."""
    out = []
    for path in sorted(TASKS.glob("*.txt"), key=lambda p: (("code", "prose", "open").index(p.stem.split("_")[0]), p.stem)):
        kind, _, name = path.stem.partition("_")
        if not only or any(o in path.stem for o in only):
            out.append((name, kind, path.read_text().rstrip("\n")))
    if not out:
        raise SystemExit(f"no lookup task in {TASKS} matches {only}")
    return out


def lookup_models(names: list[str]) -> list[tuple[str, Path, Path | None]]:
    """(label, model file, the GGUF llama.cpp runs for it or None) for each of `names`: qwen (the 1.5B, when its
    GGUF is there), q4_1 and q8_0 (SmolLM2, bench-DTYPE.bin; q4_1 is the shipped GGUF's own type)."""
    out = []
    for name in names:
        if name == "qwen":
            if QWEN_GGUF.exists():
                out.append(("Qwen2.5-Coder-1.5B q4_k_m", qwen_model(), QWEN_GGUF))
            else:
                print(f"{QWEN_GGUF} is missing (make model-qwen): no lookup rows for it", file=sys.stderr)
        else:
            out.append((f"SmolLM2 {name}", export(name), GGUF if name == "q4_1" else None))
    return out


def lookup_cost_ratio(model: Path, text: str, threads: int) -> float | None:
    """The measured cost of a 16-token forward pass over a 1-token one: -v's "lookup cost" line of a run that
    drafts a full pass wherever it has a pointer (--lookup-fixed), so both sizes are timed many times."""
    p = subprocess.run([str(RUN), str(model), "-c", "-t", "0", "-n", str(LOOKUP_TOKENS), "-v", "--lookup-fixed",
                        "--threads", str(threads), "-i", text], capture_output=True, check=True)
    m = re.search(r"lookup cost: a pass of 1 token ([\d.]+) ms, of 16 tokens ([\d.]+) ms", p.stderr.decode(errors="replace"))
    return float(m.group(2)) / float(m.group(1)) if m else None


def lookup_bench(models: list[str], runs: int, threads: int, llamacpp: bool, only: list[str] | None = None) -> None:
    """Decode tok/s of each task with and without lookup decoding, alternating which goes first; greedy, so the
    texts must be identical (checked: a difference is printed in the table, as it is a bug). Per task: drafts
    kept, tokens per forward pass, speed ratio; per model: the median ratio and the mean tokens per pass over the
    code and the prose tasks, and the measured cost of a 16-token pass over a 1-token one (it bounds the speedup:
    at a ratio of R, even drafts that always stand give at most 16 / R)."""
    tasks = lookup_tasks(only)
    print(f"\nLookup decoding ({kernel_set(threads)} kernels, greedy, -c, {LOOKUP_TOKENS} tokens at most; median of "
          f"{runs} runs, --lookup 0 and the default alternating which goes first):\n")
    print("| model | task | kind | tokens | decode tok/s, --lookup 0 | decode tok/s, lookup | ratio | accepted | "
          "tokens per pass | same text | llama.cpp decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, model, gguf in lookup_models(models):
        ref = llamacpp_tasks(gguf, tasks, threads, runs) if llamacpp and gguf else {}
        grounded: dict[str, list[tuple[float, float]]] = {"code": [], "prose": []}
        costs = []
        for name, kind, text in tasks:
            res: dict[str, list[float]] = {"off": [], "on": []}
            texts: dict[str, set[bytes]] = {"off": set(), "on": set()}
            per_pass: list[float] = []
            accepted: list[float] = []
            for i in range(runs):
                for mode, extra in ((("off", ["--lookup", "0"]), ("on", [])) if i % 2 == 0 else
                                    (("on", []), ("off", ["--lookup", "0"]))):
                    p = subprocess.run([str(RUN), str(model), "-c", "-t", "0", "-n", str(LOOKUP_TOKENS), "-v",
                                        "--threads", str(threads), "-i", text, *extra], capture_output=True, check=True)
                    err = p.stderr.decode(errors="replace")
                    m = re.search(r"decode: (\d+) tokens, ([\d.]+) tok/s", err)
                    res[mode].append(float(m.group(2)))
                    texts[mode].add(p.stdout)
                    n_tok = int(m.group(1))
                    lk = re.search(r"lookup: \d+ drafted, \d+ accepted \((\d+)%\), ([\d.]+) tokens per forward pass", err)
                    if mode == "on":
                        accepted.append(float(lk.group(1)) if lk else 0.0)
                        per_pass.append(float(lk.group(2)) if lk else 1.0)
            if kind == "code" and not costs:
                costs = [c for c in (lookup_cost_ratio(model, text, threads) for _ in range(runs)) if c]
            ratio = statistics.median(res["on"]) / statistics.median(res["off"])
            tpp = statistics.median(per_pass)
            if kind in grounded:
                grounded[kind].append((ratio, tpp))
            same = "yes" if len(texts["off"] | texts["on"]) == 1 else "NO: texts differ"
            r = ref.get(name)
            print(f"| {label} | {name} | {kind} | {n_tok} | {summary(res['off'], '{:.1f}')} | "
                  f"{summary(res['on'], '{:.1f}')} | {ratio:.2f}× | {statistics.median(accepted):.0f}% | {tpp:.2f} | "
                  f"{same} | {f'{r:.1f}' if r else '—'} |", flush=True)
        for kind, rows in grounded.items():
            if rows:
                print(f"| {label} | {len(rows)} {kind} tasks: median ratio, mean tokens per pass | | | | | "
                      f"{statistics.median(r for r, _ in rows):.2f}× | | {statistics.mean(t for _, t in rows):.2f} | | |")
        if costs:
            print(f"| {label} | a 16-token pass costs {statistics.median(costs):.2f}× a 1-token pass (measured, "
                  f"--lookup-fixed) | | | | | | | | | |")


JSON_PROMPT = "Write a JSON array of 40 objects, one per country, each with the fields name, capital, population and continent."
JSON_MODELS = [(ROOT / "models" / "smollm2-135m-instruct.bin", 49152), (ROOT / "models" / "gemma3-270m.bin", 262144)]
# 40 objects at least: the value cannot be finished within the measured tokens, so both sides decode as many
JSON_SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "required": ["name", "capital", "population", "continent"], "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "capital": {"type": "string"}, "population": {"type": "integer"},
                   "continent": {"enum": ["Africa", "Americas", "Asia", "Europe", "Oceania"]}}}}


def json_bench(runs: int, threads: int, n_gen: int = 128) -> None:
    """Decode tok/s with and without --json-schema (and --json), alternating; median [min-max] of runs."""
    schema = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-schema-{os.getpid()}.json"
    schema.write_text(json.dumps(JSON_SCHEMA))
    print(f"\nConstrained output ({kernel_set(threads)} kernels, greedy, -c, --lookup 0, {n_gen} tokens; median "
          f"[min–max] of {runs} alternating runs; --json may finish its value sooner):\n")
    print("| model | vocabulary | decode tok/s | with --json-schema | ratio | with --json | ratio | "
          "mask walks (ms each) / cache hits, schema |")
    print("|---|---|---|---|---|---|---|---|")
    for model, vocab in JSON_MODELS:
        res: dict[str, list[float]] = {"off": [], "schema": [], "json": []}
        walks = ""
        for _ in range(runs):
            for mode, extra in (("off", ["--ignore-eos"]), ("schema", ["--json-schema", str(schema)]), ("json", ["--json"])):
                p = subprocess.run([str(RUN), str(model), "-c", "-t", "0", "-n", str(n_gen), "--lookup", "0", "-v",
                                    "--threads", str(threads), "-i", JSON_PROMPT, *extra], capture_output=True, text=True)
                m = re.search(r"decode: (\d+) tokens, ([\d.]+) tok/s", p.stderr)
                if not m or (mode != "json" and int(m.group(1)) != n_gen):
                    raise RuntimeError(f"{model.name} {mode}: not {n_gen} tokens: {p.stderr.strip()[-300:]}")
                res[mode].append(float(m.group(2)))
                w = re.search(r"json: (\d+) allowed sets walked over the vocabulary \(([\d.]+) ms each\), (\d+) taken", p.stderr)
                if w and mode == "schema":
                    walks = f"{w.group(1)} ({w.group(2)}) / {w.group(3)}"
        off = statistics.median(res["off"])
        print(f"| {model.name} | {vocab} | {summary(res['off'], '{:.1f}')} | {summary(res['schema'], '{:.1f}')} | "
              f"{statistics.median(res['schema']) / off:.2f}× | {summary(res['json'], '{:.1f}')} | "
              f"{statistics.median(res['json']) / off:.2f}× | {walks} |", flush=True)
    schema.unlink()


# ---- the sampling chain (issue 27): what each draw costs beside the decode step that gave its logits ----

SAMPLING_MODES = {
    "greedy": ["-t", "0"],
    "default chain": ["-t", "0.8", "-s", "1"],
    "full chain": ["-t", "0.8", "-s", "1", "--min-p", "0.05", "--repeat-penalty", "1.1", "--presence-penalty", "0.3",
                   "--frequency-penalty", "0.3"],
}


def sampling_bench(runs: int, threads: int, n_gen: int = 128) -> None:
    """Decode tok/s greedy, with the default chain (-t 0.8 -k 40 -p 0.95) and with the full chain (min-p and every
    penalty on), --lookup 0, a fixed token count, alternating the three; both vocabularies."""
    print(f"\nSampling chain ({kernel_set(threads)} kernels, {n_gen} tokens after a 64-token prompt, --lookup 0, "
          f"--ignore-eos; median [min–max] of {runs} alternating runs):\n")
    print("| model | vocabulary | greedy tok/s | default chain | ratio | full chain | ratio to greedy | ratio to default |")
    print("|---|---|---|---|---|---|---|---|")
    for model, vocab in JSON_MODELS:
        ids = prompt_ids(model, 64)
        res: dict[str, list[float]] = {mode: [] for mode in SAMPLING_MODES}
        for i in range(runs):
            for mode in (list(SAMPLING_MODES) if i % 2 == 0 else list(SAMPLING_MODES)[::-1]):
                r = run_once(model, ids, n_gen, threads, ["--lookup", "0", *SAMPLING_MODES[mode]])  # its -t overrides
                res[mode].append(r["decode_tps"])
        med = {mode: statistics.median(v) for mode, v in res.items()}
        print(f"| {model.name} | {vocab} | {summary(res['greedy'], '{:.1f}')} | {summary(res['default chain'], '{:.1f}')} | "
              f"{med['default chain'] / med['greedy']:.3f}× | {summary(res['full chain'], '{:.1f}')} | "
              f"{med['full chain'] / med['greedy']:.3f}× | {med['full chain'] / med['default chain']:.3f}× |", flush=True)


# ---- the prompt cache (issue 27): TTFT with a cached prefix, and how fast a cache loads ----

CACHE_MODELS = [ROOT / "models" / "qwen2.5-coder-1.5b.bin", ROOT / "models" / "smollm2-135m-instruct.bin",
                ROOT / "models" / "gemma3-270m.bin"]
CACHE_QUESTION = "\n\nQuestion: what does the engine do with the prompt before it generates?\nAnswer:"


def cache_run(model: Path, ids: str, threads: int, extra: list[str]) -> dict[str, float]:
    """One ./run -v -n 1 --ids ids: TTFT as the process sees it (start to first byte of text, else model load +
    prefill) and the -v prompt-cache lines' read/check and copy times and sizes."""
    cmd = [str(RUN), str(model), "--ids", ids, "-n", "1", "-t", "0", "-v", "--threads", str(threads), *extra]
    err = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=True).stderr
    num = r"([\d.]+)"
    r = {"prefill_ms": float(re.search(rf"TTFT {num} ms", err).group(1)),
         "load_ms": float(re.search(rf"loaded in {num} ms", err).group(1))}
    first = re.search(rf"first byte of text {num} ms after start", err)
    m = re.search(rf"holds \d+ tokens \({num} MB\), read and checked in {num} ms", err)
    c = re.search(rf"tokens loaded \({num} MB of K and V\) in {num} ms", err)
    r["check_mb"], r["check_ms"] = (float(m.group(1)), float(m.group(2))) if m else (0.0, 0.0)
    r["copy_mb"], r["copy_ms"] = (float(c.group(1)), float(c.group(2))) if c else (0.0, 0.0)
    r["ttft_ms"] = float(first.group(1)) if first else r["load_ms"] + r["check_ms"] + r["copy_ms"] + r["prefill_ms"]
    return r


def prompt_cache_bench(runs: int, threads: int, cached: int = 2000) -> None:
    """TTFT of a prompt of `cached` tokens of text and a question: without a cache, and with a cache holding the
    first `cached` tokens (read-only: the question's run does not write; and read-write, which writes its own
    prompt after the first token); alternating, medians. Then the cache's read-and-check and copy speeds."""
    print(f"\nPrompt cache ({kernel_set(threads)} kernels, {threads} threads, KV f16; a prompt of {cached} tokens of the "
          f"README and a question; TTFT = process start to the first byte of text; median [min–max] of {runs} "
          f"alternating runs):\n")
    print("| model | prompt tokens | TTFT uncached ms | TTFT, first " + str(cached) + " cached (-ro) ms | ratio | TTFT, cached, "
          "writing its own ms | cache MB | read + check GB/s | copy into the KV cache GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in CACHE_MODELS:
        if not model.exists():
            print(f"| {model.name} | (not present: export it to measure) | | | | | | | |")
            continue
        prefix = prompt_ids(model, cached)
        question = subprocess.run([str(RUN), str(model), "--tokenize", "-i", CACHE_QUESTION], capture_output=True,
                                  text=True, check=True).stdout.split()
        question = [q for q in question if q not in prefix.split()[:1]]  # no second BOS
        ids = prefix + " " + " ".join(question)
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        pristine, cache = tmp / f"bench-{model.stem}-{os.getpid()}.prefix", tmp / f"bench-{model.stem}-{os.getpid()}.cache"
        subprocess.run([str(RUN), str(model), "--ids", prefix, "-n", "0", "--prompt-cache", str(pristine),
                        "--threads", str(threads)], check=True)
        res: dict[str, list[dict[str, float]]] = {"uncached": [], "ro": [], "rw": []}
        for i in range(runs):
            for mode in (("uncached", "ro", "rw") if i % 2 == 0 else ("rw", "ro", "uncached")):
                shutil.copyfile(pristine, cache)  # the prefix only: a read-write run replaces it with its prompt
                extra = {"uncached": [], "ro": ["--prompt-cache", str(cache), "--prompt-cache-ro"],
                         "rw": ["--prompt-cache", str(cache)]}[mode]
                res[mode].append(cache_run(model, ids, threads, extra))
        pristine.unlink()
        cache.unlink()
        ttft = {k: [r["ttft_ms"] for r in v] for k, v in res.items()}
        med = {k: statistics.median(v) for k, v in ttft.items()}
        ro = res["ro"]
        check = statistics.median(r["check_mb"] / r["check_ms"] for r in ro) if ro[0]["check_ms"] else 0  # MB/ms = GB/s
        copy = statistics.median(r["copy_mb"] / r["copy_ms"] for r in ro) if ro[0]["copy_ms"] else 0
        print(f"| {model.name} | {len(ids.split())} | {summary(ttft['uncached'])} | {summary(ttft['ro'])} | "
              f"{med['ro'] / med['uncached']:.3f} | {summary(ttft['rw'])} | {ro[0]['check_mb']:.1f} | {check:.2f} | "
              f"{copy:.2f} |", flush=True)


def llamacpp_tasks(gguf: Path, tasks: list[tuple[str, str, str]], threads: int, runs: int) -> dict[str, float]:
    """llama.cpp's plain decode tok/s on the same chat prompts (the GGUF, through its own chat template), from its
    counters; {} without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return {}
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, verbose=False)
    out = {}
    for name, _, text in tasks:
        speeds = []
        for _ in range(runs):
            llm.reset()
            llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
            llm.create_chat_completion(messages=[{"role": "user", "content": text}], temperature=0,
                                       max_tokens=LOOKUP_TOKENS)
            d = llama_cpp.llama_perf_context(llm._ctx.ctx)
            if d.n_eval > 1:
                speeds.append(d.n_eval / (d.t_eval_ms / 1e3))
        out[name] = statistics.median(speeds) if speeds else 0.0
    llm.close()
    return out


def llamacpp_bench(dtypes: str, threads: int, runs: int) -> dict | None:
    """llama.cpp (llama-cpp-python) on the same GGUF at the same types, with its CPU defaults
    (F16 KV cache like ours, flash attention on); None if it is not installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp comparison", file=sys.stderr)
        return None
    script = ROOT / "tests" / "oracle" / "bench_llamacpp.py"
    out = subprocess.run([sys.executable, str(script), "--threads", str(threads), "--runs", str(runs),
                          "--dtypes", dtypes, "--config", "llamacpp_default"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout)["results"]
    except (json.JSONDecodeError, KeyError):
        print(f"llama.cpp bench failed: {out.stderr.strip()[-300:]}", file=sys.stderr)
        return None


def print_ratios(ours: dict, ref: dict, kernels: str) -> None:
    print(f"\nllama.cpp on the same machine in this run (same GGUF, same type; its timing counters; ours: {kernels} "
          "kernels):\n")
    print("| dtype | llama.cpp prefill 128 tok/s | llama.cpp prefill 512 tok/s | llama.cpp decode tok/s | "
          "ours ÷ llama.cpp prefill 512 | ours ÷ llama.cpp decode |")
    print("|---|---|---|---|---|---|")
    for dtype, b in ours.items():
        r = ref.get(f"{dtype}/llamacpp_default")
        if not r:
            continue
        pp, tg = r["prefill_512_tok_s"]["median"], r["decode_128_tok_s"]["median"]
        print(f"| {dtype} | {r['prefill_128_tok_s']['median']:.0f} | {pp:.0f} | {tg:.1f} | "
              f"{statistics.median(b['pp512']) / pp:.2f}× | {statistics.median(b['tg128']) / tg:.2f}× |")


# ---- per-type table: our engine and llama.cpp on the same GGUF files (issue 13) ----

ORACLE_SCRATCH = Path("/tmp/oracle-quant-scratch")   # tests/oracle/make_quant_goldens.py's default --scratch
GEMMA_GGUF = ROOT / "models" / "gemma3-270m-q4_k_m.gguf"
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k", "gemma3-q4_k_m")
# llama.cpp's llama_ftype and the ggml type of the embedding for the float files (include/llama.h, ggml.h)
FLOAT_FTYPES = {"f16": (1, 1), "bf16": (32, 30)}


def smollm2_f32(scratch: Path) -> Path:
    """The F32 GGUF holding the shipped Q4_1 GGUF's dequantized weights (llama.cpp's own quantize code)."""
    for path in (ORACLE_SCRATCH / "SmolLM2-135M-Instruct.F32.gguf", scratch / "SmolLM2-135M-Instruct.F32.gguf"):
        if path.exists():
            return path
    from make_goldens import make_f32_gguf

    make_f32_gguf(GGUF, path)
    return path


def type_gguf(label: str, scratch: Path, threads: int) -> Path:
    """The GGUF of one table row, written by llama.cpp's quantizer from the F32 GGUF when it is missing
    (the same call as tests/oracle/make_quant_goldens.py, which leaves its files in ORACLE_SCRATCH)."""
    if label == "gemma3-q4_k_m":
        return GEMMA_GGUF
    if label == "q4_1":
        return GGUF
    if label == "f32":
        return smollm2_f32(scratch)
    for path in (ORACLE_SCRATCH / f"smollm2_{label}.gguf", scratch / f"smollm2_{label}.gguf"):
        if path.exists():
            return path
    import make_goldens
    import make_quant_goldens

    src = smollm2_f32(scratch)
    if label in FLOAT_FTYPES:
        make_goldens.requantize_gguf(src, path, *FLOAT_FTYPES[label])
    else:
        make_quant_goldens.quantize(src, path, make_quant_goldens.FTYPES[label], threads)
    return path


def export_keep(gguf: Path, scratch: Path) -> Path:
    """export.py's default for a GGUF (--dtype keep): every tensor's type and blocks as they are."""
    out = scratch / f"bench-keep-{gguf.stem}.bin"
    if not out.exists() or out.stat().st_mtime < gguf.stat().st_mtime:
        subprocess.run([sys.executable, str(ROOT / "export.py"), str(gguf), str(out)], check=True, capture_output=True)
    return out


def matrix_bits(gguf: Path) -> float | None:
    """Bits per weight of the 2-D tensors (the `gguf` package reads the file; None without it)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    mats = [t for t in GGUFReader(str(gguf)).tensors if len(t.shape) >= 2 and t.shape[1] > 1]
    return 8 * sum(int(t.n_bytes) for t in mats) / sum(int(t.n_elements) for t in mats)


def open_llamacpp(gguf: Path, threads: int):
    """llama.cpp with its CPU defaults (F16 KV cache, flash attention on), room for 512 + 128 tokens."""
    import llama_cpp

    from bench_llamacpp import CONFIGS, N_CTX

    return llama_cpp.Llama(model_path=str(gguf), n_ctx=N_CTX, n_batch=512, n_ubatch=512, n_threads=threads,
                           n_threads_batch=threads, logits_all=False, verbose=False, n_gpu_layers=0,
                           **CONFIGS["llamacpp_default"])


def ours_speed(model: Path, ids128: str, ids512: str, threads: int, extra: list[str] | None = None) -> dict[str, float]:
    """Decode tok/s (and GB/s) over positions 128..255 and prefill tok/s (and GFLOP/s) of one 512-token prompt."""
    plain = ["--lookup", "0", *(extra or [])]
    dec, pre = run_once(model, ids128, 129, threads, plain), run_once(model, ids512, 1, threads, plain)
    return {"decode": dec["decode_tps"], "gbps": dec["gbps"], "prefill": pre["prefill_tps"], "gflops": pre["gflops"]}


def llamacpp_speed(llm, ids512: list[int]) -> dict[str, float]:
    """The same measurement by llama.cpp's own counters (tests/oracle/bench_llamacpp.py's one_run)."""
    from bench_llamacpp import one_run

    r = one_run(llm, ids512)
    return {"decode": r["decode_128_tok_s"], "prefill": r["prefill_512_tok_s"]}


def bench_type(label: str, scratch: Path, runs: int, threads: int) -> dict:
    """Ours and llama.cpp on one GGUF, alternating which goes first each run; medians."""
    gguf = type_gguf(label, scratch, threads)
    model = export_keep(gguf, scratch)
    ids512 = prompt_ids(model, 512)
    ids128 = " ".join(ids512.split()[:128])
    llm = open_llamacpp(gguf, threads)
    ids = [int(i) for i in ids512.split()]
    llamacpp_speed(llm, ids)                          # warm-up: page in, spin up the thread pool
    ours_speed(model, ids128, ids512, threads)
    res: dict[str, list[dict[str, float]]] = {"ours": [], "llamacpp": []}
    for i in range(runs):
        order = ("ours", "llamacpp") if i % 2 == 0 else ("llamacpp", "ours")
        for who in order:
            res[who].append(ours_speed(model, ids128, ids512, threads) if who == "ours" else llamacpp_speed(llm, ids))
    llm.close()
    med = {who: {k: statistics.median(r[k] for r in rs) for k in ("decode", "prefill")} for who, rs in res.items()}
    return {"label": label, "gguf": gguf.name, "gguf_mb": gguf.stat().st_size / 1e6, "bits": matrix_bits(gguf),
            "runs": res, "median": med}


def kernel_set(threads: int) -> str:
    """The kernel set ./run picks on this CPU (its -v model line)."""
    err = subprocess.run([str(RUN), str(ROOT / "models" / "smollm2-135m-instruct.bin"), "-v", "-n", "1", "-i", "x",
                          "--threads", str(threads)], capture_output=True, text=True).stderr
    m = re.search(r"(\w[\w-]*) kernels", err)
    return m.group(1) if m else "unknown"


def omp_wait_policy(choice: str, threads: int) -> str:
    """Set OMP_WAIT_POLICY for llama.cpp (in this process: before llama_cpp is first imported) and for ./run (its
    children). llama.cpp's OpenMP threads spin at each of the hundreds of graph barriers per token; with other work
    on the cores a preempted thread stalls the spinning one, and its decode falls from ~60 to ~0.5 tok/s (measured
    here at load average 9, where PASSIVE gave 27-73). "auto": PASSIVE when the load average is at least the thread
    count, else the library's default."""
    if choice == "auto":
        choice = "passive" if os.getloadavg()[0] >= threads else "default"
    if choice == "default":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = choice.upper()
    return choice


def type_table(labels: list[str], scratch: Path, runs: int, threads: int, wait: str = "auto") -> None:
    """`make bench`'s per-type table: each type's GGUF run by our engine and by llama.cpp, in one run."""
    load0 = os.getloadavg()
    wait = omp_wait_policy(wait, threads) if "llama_cpp" not in sys.modules else "as already loaded"
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: no per-type table", file=sys.stderr)
        return
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"\nPer type, same GGUF file, our engine (export.py --dtype keep, {kernel_set(threads)} kernels, KV f16) "
          f"and llama.cpp (llama-cpp-python {llama_cpp.__version__}, KV f16, flash attention on), {threads} threads; "
          f"median of {runs} runs, alternating which goes first; decode = 128 tokens after a 128-token prompt, "
          f"prefill = one 512-token prompt. SmolLM2-135M except the Gemma 3 270M row.")
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; load average at start "
          f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; OpenMP wait policy (both engines): {wait}\n")
    print("| type | GGUF | bits per weight (matrices) | GGUF MB | decode tok/s ours | llama.cpp | ratio | "
          "prefill 512 tok/s ours | llama.cpp | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label in labels:
        r = bench_type(label, scratch, runs, threads)
        o, l = r["median"]["ours"], r["median"]["llamacpp"]
        bits = f"{r['bits']:.3f}" if r["bits"] else "—"
        print(f"| {label} | {r['gguf']} | {bits} | {r['gguf_mb']:.1f} | {o['decode']:.1f} | {l['decode']:.1f} | "
              f"{o['decode'] / l['decode']:.2f}× | {o['prefill']:.0f} | {l['prefill']:.0f} | "
              f"{o['prefill'] / l['prefill']:.2f}× |", flush=True)
    load1 = os.getloadavg()
    print(f"\nload average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (above {threads}: other work shared "
          "the cores, and the absolute numbers are low; the ratios are of runs interleaved in time)")


# ---- per kernel set: every set this CPU runs, beside llama.cpp (issue 15) ----

SET_DTYPES = ("q4_1", "q8_0")
SCALAR_RUNS = 1  # the scalar set (the reference kernels) is 3-15x slower: one run of it, not a target


def kernel_sets(model: Path) -> list[str]:
    """The kernel sets this build runs on this CPU, as ./run lists them when --kernels names none of them."""
    err = subprocess.run([str(RUN), str(model), "--kernels", "?", "-n", "1", "-i", "x"], capture_output=True,
                         text=True).stderr
    m = re.search(r"\(available: ([^)]*)\)", err)
    if not m:
        raise RuntimeError(f"./run --kernels ? did not list the kernel sets: {err.strip()[-300:]}")
    return [s.strip() for s in m.group(1).split(",")]


def set_rows(dtype: str, sets: list[str], peaks: dict[str, float], mc: dict, llm, runs: int, threads: int) -> list[str]:
    """One model (bench-DTYPE.bin; llm: llama.cpp on the GGUF of the same weights, or None) run with every
    kernel set and llama.cpp, the order reversed every other run; the table rows of the medians. peaks: each
    set's int8 GOP/s; mc: the probe on this model (the level its decode streams from, and that level's GB/s)."""
    model = export(dtype)
    ids512 = prompt_ids(model, 512)
    ids128 = " ".join(ids512.split()[:128])
    ids = [int(i) for i in ids512.split()]
    who_all = [*sets, "llama.cpp"] if llm else sets
    ours_speed(model, ids128, ids512, threads)        # warm-up: page the weights in
    if llm:
        llamacpp_speed(llm, ids)                      # ... and spin up llama.cpp's thread pool
    res: dict[str, list[dict[str, float]]] = {who: [] for who in who_all}
    for i in range(runs):
        for who in (who_all if i % 2 == 0 else who_all[::-1]):
            if who == "scalar" and i >= SCALAR_RUNS:
                continue
            res[who].append(llamacpp_speed(llm, ids) if who == "llama.cpp" else
                            ours_speed(model, ids128, ids512, threads, ["--kernels", who]))
    med = {who: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for who, rs in res.items()}
    ref = med.get("llama.cpp")
    rows = []
    for s in sets:
        o = med[s]
        ratio = (f"{ref['prefill']:.0f} | {ref['decode']:.1f} | {o['prefill'] / ref['prefill']:.2f}× | "
                 f"{o['decode'] / ref['decode']:.2f}×") if ref else "— | — | — | —"
        rows.append(f"| {dtype} | {s} | {len(res[s])} | {o['prefill']:.0f} | {o['gflops'] / peaks[s] * 100:.0f}% | "
                    f"{o['gflops'] / max(peaks.values()) * 100:.0f}% | {o['decode']:.1f} | "
                    f"{o['gbps'] / mc['level_gbps'] * 100:.0f}% of {mc['level']} | {ratio} |")
    return rows


def set_table(runs: int, threads: int, scratch: Path, wait: str = "auto") -> None:
    """The per-kernel-set table (README "Performance"), printed in the README's markdown: prefill 512 and decode
    tok/s of each set this CPU runs on q4_1 and q8_0, llama.cpp on the same weights when it is installed."""
    wait = omp_wait_policy(wait, threads) if "llama_cpp" not in sys.modules else "as already loaded"
    try:
        import llama_cpp
        version = f"llama-cpp-python {llama_cpp.__version__}, KV f16, flash attention on"
    except ImportError:
        llama_cpp, version = None, "not installed: no llama.cpp columns"
    sets = kernel_sets(export("q4_1"))
    peaks = {s: best_probe(export("q4_1"), threads, s)["i8"] for s in sets}
    mcs = {d: best_probe(export(d), threads) for d in SET_DTYPES}
    print(f"\nPer kernel set, SmolLM2-135M-Instruct, {threads} threads, median of {runs} runs (scalar: "
          f"{SCALAR_RUNS}), alternating the sets and llama.cpp; prefill = one 512-token prompt, decode = 128 tokens "
          f"after a 128-token prompt, KV f16. llama.cpp: {version}, on the GGUF of the same weights; "
          f"OpenMP wait policy: {wait}.\n")
    print(machine_line(mcs[SET_DTYPES[0]], threads) + "\n")
    print(f"int8 peaks (./run --probe --kernels SET, best of {PROBES}): " +
          ", ".join(f"{s} {peaks[s]:.0f} GOP/s" for s in sets) +
          "; decode streams from: " + ", ".join(f"{d} {mcs[d]['level']}" for d in SET_DTYPES) + "\n")
    print("| model | kernel set | runs | prefill 512 tok/s | % of the set's int8 peak | % of the machine's int8 peak | "
          "decode tok/s | decode, % of the bandwidth it streams from | llama.cpp prefill 512 tok/s | "
          "llama.cpp decode tok/s | ours ÷ llama.cpp, prefill | ours ÷ llama.cpp, decode |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in SET_DTYPES:
        llm = open_llamacpp(type_gguf(dtype, scratch, threads), threads) if llama_cpp else None
        for row in set_rows(dtype, sets, peaks, mcs[dtype], llm, runs, threads):
            print(row, flush=True)
        if llm:
            llm.close()
    load = os.getloadavg()
    print(f"\nload average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


# ---- the 1.5B model: Qwen2.5-Coder-1.5B-Instruct Q4_K_M as shipped (1.1 GB: decode waits on DRAM) ----

MEMORY_TOKENS = 128     # the measured request: a one-line message of ~MEMORY_PROMPT tokens, then this many
MEMORY_PROMPT = 512
HI = ["-n", "1", "-i", "hi", "-t", "0"]   # the shortest request: what a shell user waits for


def shell_view(cmd: list[str]) -> dict:
    """cmd started as a shell starts it: ms until the first byte on its stdout (the TTFT a pipe sees: process
    start, load, prefill, first token) and until it exits (wall), and its stderr."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(1)
    t_first = time.perf_counter()
    _, err = p.communicate()
    wall = time.perf_counter() - t0
    if p.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({p.returncode}) or printed nothing: {err.decode()[-300:]}")
    return {"ttft_ms": (t_first - t0) * 1e3, "wall_ms": wall * 1e3, "stderr": err.decode(errors="replace")}


def memory_mb(pid: int) -> dict[str, float]:
    """bench_llamacpp.memory_kb of a live process (private, anonymous, resident, peak resident), in MB."""
    from bench_llamacpp import memory_kb

    return {k.replace("_kb", "_mb"): v / 1024 for k, v in memory_kb(pid).items()}


def held_chat(model: Path, message: str, threads: int) -> subprocess.Popen:
    """./run -m chat having answered `message` (greedy, MEMORY_TOKENS tokens, --ignore-eos) and waiting for the
    next one: the state at the end of a request, still alive to be measured. release() ends it."""
    p = subprocess.Popen([str(RUN), str(model), "-m", "chat", "-t", "0", "-n", str(MEMORY_TOKENS), "--ignore-eos",
                          "-v", "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    p.stdin.write(message.encode() + b"\n")
    p.stdin.flush()
    for line in p.stderr:
        if line.startswith(b"decode:"):   # -v's last line of a turn
            return p
    p.wait()
    raise RuntimeError(f"./run -m chat ended ({p.returncode}) before answering")


def release(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.stderr.read()
    if p.wait() != 0:
        raise RuntimeError(f"./run -m chat exited with {p.returncode}")


def one_line_message(model: Path, n_tokens: int) -> str:
    """The longest start of the README, on one line (a chat message), of at most n_tokens tokens."""
    words = PASSAGE.split()

    def count(k: int) -> int:
        return len(subprocess.run([str(RUN), str(model), "--tokenize", "-i", " ".join(words[:k])], capture_output=True,
                                  check=True).stdout.split())

    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= n_tokens else (lo, mid - 1)
    return " ".join(words[:lo])


def ours_qwen(model: Path, ids128: str, ids512: str, message: str, threads: int) -> dict[str, float]:
    """One measurement of ./run: the shortest request as a shell sees it, prefill 512 and decode 128 (-v), and
    the memory of a request held open, then of a second process on the same file while the first is alive."""
    hi = shell_view([str(RUN), str(model), *HI, "-v", "--threads", str(threads)])
    r = {"ttft_ms": hi["ttft_ms"], "wall_ms": hi["wall_ms"],
         "load_ms": float(re.search(r"loaded in ([\d.]+) ms", hi["stderr"]).group(1))}
    r.update(ours_speed(model, ids128, ids512, threads))
    first = held_chat(model, message, threads)
    try:
        mem = memory_mb(first.pid)
        second = held_chat(model, message, threads)
        try:
            r["second_private_mb"] = memory_mb(second.pid)["private_mb"]
        finally:
            release(second)
        mem["peak_rss_mb"] = memory_mb(first.pid)["peak_rss_mb"]
    finally:
        release(first)
    r.update(private_mb=mem["private_mb"], anon_mb=mem["anon_mb"], peak_rss_mb=mem["peak_rss_mb"])
    return r


def llamacpp_qwen(llm, ids512: list[int], message: str, threads: int) -> dict[str, float]:
    """The same for llama.cpp: the shortest request and the memory through bench_llamacpp.py --shell (a Python
    process, as a shell user of llama-cpp-python runs it; its memory before loading the model is subtracted),
    prefill and decode in this process from llama.cpp's own counters."""
    script = [sys.executable, str(ROOT / "tests" / "oracle" / "bench_llamacpp.py"), "--shell", str(QWEN_GGUF),
              "--threads", str(threads)]
    hi = shell_view([*script, "--prompt", "hi", "-n", "1"])
    info = json.loads(hi["stderr"].strip().splitlines()[-1])
    r = {"ttft_ms": hi["ttft_ms"], "wall_ms": hi["wall_ms"], "load_ms": info["load_ms"], "import_ms": info["import_ms"]}
    r.update(llamacpp_speed(llm, ids512))
    mem = json.loads(shell_view([*script, "--prompt", message, "-n", str(MEMORY_TOKENS)])["stderr"].strip().splitlines()[-1])
    r.update(private_mb=(mem["after"]["private_kb"] - mem["before_load"]["private_kb"]) / 1024,
             anon_mb=(mem["after"]["anon_kb"] - mem["before_load"]["anon_kb"]) / 1024,
             peak_rss_mb=(mem["after"]["peak_rss_kb"] - mem["before_load"]["rss_kb"]) / 1024,
             python_rss_mb=mem["before_load"]["rss_kb"] / 1024, n_ctx=mem["n_ctx"])
    return r


def qwen_section(runs: int, threads: int, wait: str = "auto") -> None:
    """`make bench`'s 1.5B table: ./run and llama.cpp on Qwen2.5-Coder-1.5B-Instruct Q4_K_M, alternating which goes
    first each run; medians. Skipped, saying so, when the GGUF is not there."""
    if not QWEN_GGUF.exists():
        print(f"\n{QWEN_GGUF} is missing (make model-qwen): no 1.5B section", file=sys.stderr)
        return
    wait = omp_wait_policy(wait, threads) if "llama_cpp" not in sys.modules else "as already loaded"
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    model = qwen_model()
    ids512 = prompt_ids(model, 512)
    ids128 = " ".join(ids512.split()[:128])
    message = one_line_message(model, MEMORY_PROMPT)
    mc = best_probe(model, threads)
    llm = open_llamacpp(QWEN_GGUF, threads) if llama_cpp else None
    ids = [int(i) for i in ids512.split()]
    ours_speed(model, ids128, ids512, threads)             # warm-up: the page cache holds the file from here on
    if llm:
        llamacpp_speed(llm, ids)
    res: dict[str, list[dict[str, float]]] = {"ours": [], "llamacpp": []}
    for i in range(runs):
        for who in (("ours", "llamacpp") if i % 2 == 0 else ("llamacpp", "ours")):
            if who == "ours":
                res[who].append(ours_qwen(model, ids128, ids512, message, threads))
            elif llm:
                res[who].append(llamacpp_qwen(llm, ids, message, threads))
            print(f"run {i + 1}/{runs} {who}: {res[who][-1] if res[who] else 'not installed'}", file=sys.stderr, flush=True)
    if llm:
        llm.close()
    med = {who: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for who, rs in res.items() if rs}
    o, ref = med["ours"], med.get("llamacpp")
    mb_per_token = mc["mb_per_token"]     # a token of the probe's one-token request: the weights, KV is ~0
    for r in filter(None, (o, ref)):
        r["dram_pct"] = mb_per_token * r["decode"] / 1e3 / mc["gbps"] * 100
    version = f"llama-cpp-python {llama_cpp.__version__}" if llama_cpp else "llama-cpp-python not installed"
    file_mb = model.stat().st_size / 1e6
    their_ctx = f", n_ctx {ref['n_ctx']:.0f}" if ref else ""
    print(f"\nQwen2.5-Coder-1.5B-Instruct Q4_K_M ({QWEN_GGUF.name}, {QWEN_GGUF.stat().st_size / 1e6:.0f} MB), "
          f"{threads} threads, median of {runs} runs alternating which goes first. ./run: its export (--dtype keep, "
          f"{file_mb:.0f} MB), {mc['kernels']} kernels, its defaults (KV f16, the model's context); llama.cpp: "
          f"{version} on the GGUF with its CPU defaults (KV f16, flash attention on; the shortest request and the "
          f"memory at the model's context{their_ctx}; "
          f"prefill and decode at n_ctx 1024), OpenMP wait policy {wait}.")
    print(machine_line(mc, threads) + f"; kernel set: {mc['kernels']}\n")
    rows = [
        ("load from a warm page cache, ms (llama.cpp: Llama())", "load_ms", "{:.0f}"),
        ("`-n 1 -i hi -t 0`: wall time as a shell sees it, ms", "wall_ms", "{:.0f}"),
        ("the same: time to the first byte on stdout, ms", "ttft_ms", "{:.0f}"),
        ("prefill 512 tokens, tok/s", "prefill", "{:.1f}"),
        ("decode 128 tokens (positions 128-255), tok/s", "decode", "{:.2f}"),
        (f"decode, % of DRAM read ({mc['gbps']:.1f} GB/s) at {mb_per_token:.0f} MB per token (--probe's count for "
         "one token: the weights; the KV cache read at positions 128-255 adds < 1 %)",
         "dram_pct", "{:.0f}%"),
        (f"private memory after a {MEMORY_PROMPT} + {MEMORY_TOKENS} token request, MB (the weights: {file_mb:.0f} MB "
         "mapped)", "private_mb", "{:.0f}"),
        ("of it anonymous (heap: KV cache, buffers, anything copied at load), MB", "anon_mb", "{:.0f}"),
        ("private memory of a second ./run on the same file while the first runs, MB", "second_private_mb", "{:.0f}"),
        ("peak RSS of that request, MB", "peak_rss_mb", "{:.0f}"),
    ]
    print("| measure | ./run | llama.cpp | ./run ÷ llama.cpp |")
    print("|---|---:|---:|---:|")
    for label, key, fmt in rows:
        theirs = ref.get(key) if ref else None
        ratio = f"{o[key] / theirs:.2f}×" if theirs else "—"
        print(f"| {label} | {fmt.format(o[key])} | {fmt.format(theirs) if theirs is not None else '—'} | {ratio} |")
    if ref:
        print(f"\nllama.cpp's shortest request runs in a fresh Python process: its start and `import llama_cpp` take "
              f"{ref['import_ms']:.0f} ms of the wall time and the TTFT; its memory is counted above the "
              f"{ref['python_rss_mb']:.0f} MB the process held before loading the model.")
    load = os.getloadavg()
    print(f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


# ---- the throughput table (issue 34): every phase against this machine's own limits, in one run ----

THROUGHPUT_MODELS = [("Qwen2.5-Coder-1.5B q4_k_m", ROOT / "models" / "qwen2.5-coder-1.5b.bin"),
                     ("SmolLM2-135M q4_1", ROOT / "models" / "smollm2-135m-instruct.bin")]
BATCH_TOKENS = 64          # tokens per chat answer in the batch rows (-t 0 --ignore-eos)
BATCH_PARALLEL = (1, 4, 16)
BATCH_SINGLE_EVERY = 4     # --parallel 1 runs every 4th prompt: a sequence's speed alone does not depend on the others
FULL = re.compile(r"batch steps with all \d+ slots decoding and no prompt rows: \d+, [\d.]+ ms each, ([\d.]+) tok/s")


def batch_row(model: Path, prompts: Path, n_prompts: int, parallel: int) -> dict:
    """One ./run --batch -v of the chat prompts (bench_batch.run_batch): aggregate and decode tok/s, per-token p50,
    the texts; and from -v's line on the steps in which every slot decoded and no prompt rode along, their tok/s:
    the batch's speed with that many in flight, apart from the prompts coming in at the start and the slots
    emptying one by one at the end of the input (the decode figure counts both)."""
    from bench_batch import run_batch

    r = run_batch(model, prompts, n_prompts, parallel, BATCH_TOKENS)
    m = FULL.search(r["stderr"])
    r["full_tps"] = float(m.group(1)) if m else 0.0
    return r


def throughput_model(label: str, model: Path, runs: int, threads: int, prompts: list[str]) -> list[str]:
    """The table's rows for one model: prefill 512, decode 128 and the batch at 1/4/16 in flight, measured in
    turn `runs` times (the order reversed every other run), medians; ratios taken within this run."""
    from bench_batch import write_prompts

    mc = best_probe(model, threads)
    ids512 = prompt_ids(model, 512)
    ids128 = " ".join(ids512.split()[:128])
    every = write_prompts("throughput-all.jsonl", [json.dumps({"prompt": p, "chat": True}) for p in prompts])
    some = prompts[::BATCH_SINGLE_EVERY]
    single = write_prompts("throughput-single.jsonl", [json.dumps({"prompt": p, "chat": True}) for p in some])
    files = {b: (single, len(some)) if b == 1 else (every, len(prompts)) for b in BATCH_PARALLEL}
    res: dict[str, list[dict]] = {k: [] for k in ("prefill", "decode", *map(str, BATCH_PARALLEL))}
    for i in range(runs):
        jobs = ["prefill", "decode", *BATCH_PARALLEL]
        for job in jobs if i % 2 == 0 else jobs[::-1]:
            if job == "prefill":
                res[job].append(run_once(model, ids512, 1, threads, ["--lookup", "0"]))
            elif job == "decode":
                res[job].append(run_once(model, ids128, 129, threads, ["--lookup", "0"]))
                # this host's bandwidth moves by a third from minute to minute: each decode is set against a
                # probe taken right after it, not against the session's best probe
                after = probe(model, threads, mc["kernels"])
                res[job][-1].update(beside=after["level_gbps"], level=after["level"])
            else:
                res[str(job)].append(batch_row(model, *files[job], job))
            print(f"run {i + 1}/{runs} {label} {job}: done, load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    med = lambda key, field: statistics.median(r[field] for r in res[key])  # noqa: E731
    pp, tg, itl = med("prefill", "prefill_tps"), med("decode", "decode_tps"), med("decode", "itl_p50")
    level = res["decode"][-1]["level"]
    bw = med("decode", "beside")
    share = statistics.median(r["gbps"] / r["beside"] for r in res["decode"])
    rows = [f"| {label} | prefill 512 tokens | {pp:.1f} tok/s | {med('prefill', 'gflops') / mc['i8'] * 100:.0f}% of the "
            f"int8 peak ({mc['i8']:.0f} GOP/s) | ≥ 65% |",
            f"| {label} | decode 128 tokens, one stream | {tg:.2f} tok/s, ITL p50 {itl:.1f} ms | "
            f"{share * 100:.0f}% of {level} read ({bw:.1f} GB/s, probed after each run) | |"]
    one = med("1", "decode_tps")
    singles = res["1"][0]["texts"]
    for b in BATCH_PARALLEL:
        rs = res[str(b)]
        agg, dec, full, p50 = med(str(b), "agg_tps"), med(str(b), "decode_tps"), med(str(b), "full_tps"), med(str(b), "p50")
        same = all(r["texts"][::BATCH_SINGLE_EVERY] == singles for r in rs) if b > 1 else True
        speedup = "" if b == 1 else f"; {dec / one:.2f}× one at a time"
        # the issue's measure: a step of 16 decoding rows against prefill rows, so the target reads the full steps
        target = {4: "≥ 2.5× one at a time (1.5B)", 16: "all 16 decoding ≥ 80% of prefill; p50 ≤ 3× ITL"}.get(b, "")
        rows.append(f"| {label} | batch, {b} in flight ({len(rs[0]['texts'])} chat prompts × {BATCH_TOKENS}) | "
                    f"{agg:.1f} tok/s aggregate, {dec:.1f} decode, all {b} decoding {full:.1f}, p50 {p50:.0f} ms | "
                    f"decode {dec / pp * 100:.0f}% of prefill, all {b} decoding {full / pp * 100:.0f}%{speedup}; "
                    f"p50 {p50 / itl:.1f}× the single ITL; texts {'as alone' if same else 'DIFFER from --parallel 1'} | {target} |")
    return rows


def throughput_bench(runs: int, threads: int, lookup) -> None:
    """`make bench`'s first table: per model, prefill against the int8 peak, one stream's decode against the
    bandwidth it streams from, the batch at 1/4/16 in flight against prefill and against one at a time; then the
    lookup rows (the lookup section's table, as it prints it)."""
    from bench_batch import CHAT_PROMPTS

    prompts = CHAT_PROMPTS.read_text().splitlines()
    mc = best_probe(THROUGHPUT_MODELS[-1][1], threads)
    print(machine_line(mc, threads))
    print(f"kernel set: {mc['kernels']}; int8 peak {mc['i8']:.0f} GOP/s (best of {PROBES} probes); medians of {runs} "
          f"runs, alternating; batch: {CHAT_PROMPTS.name} through --batch -c -t 0 --ignore-eos --lookup 0, "
          f"--parallel 1 over every {BATCH_SINGLE_EVERY}th prompt; decode tok/s = tokens after each first / (wall - "
          f"prefill passes){'; every ./run with ' + ' '.join(RUN_FLAGS) + ' (RUN_FLAGS)' if RUN_FLAGS else ''}\n")
    print("| model | measure | speed | against this machine | target |")
    print("|---|---|---|---|---|")
    for label, model in THROUGHPUT_MODELS:
        if not model.exists():
            print(f"| {label} | {model.name} is missing | | | |")
            continue
        for row in throughput_model(label, model, runs, threads, prompts):
            print(row, flush=True)
    load = os.getloadavg()
    print(f"\nload average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if lookup:
        lookup()  # the lookup rows: the lookup section's own table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtypes", default="f32,f16,q8_0,q4_1")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--long", action="store_true", help="also decode at 4k context (q4_1, slow)")
    ap.add_argument("--llamacpp", action="store_true", help="also run llama.cpp (llama-cpp-python) for a ratio")
    ap.add_argument("--lookup", action="store_true", help="also the lookup decoding section")
    ap.add_argument("--lookup-only", action="store_true", help="only the lookup decoding section")
    ap.add_argument("--lookup-models", default="qwen,q4_1,q8_0",
                    help="models of the lookup section: qwen (the 1.5B, when its GGUF is there), q4_1, q8_0 (SmolLM2)")
    ap.add_argument("--tasks", default="", help="lookup tasks whose file name contains one of these (comma-separated)")
    ap.add_argument("--qwen", action="store_true",
                    help="also the 1.5B section (Qwen2.5-Coder-1.5B Q4_K_M beside llama.cpp; when its GGUF is there)")
    ap.add_argument("--qwen-only", action="store_true", help="only the 1.5B section")
    ap.add_argument("--throughput", action="store_true",
                    help="only the throughput table (issue 34): prefill, decode and the batch at 1/4/16 in flight against "
                         "this machine's int8 peak and bandwidth, for the 1.5B and SmolLM2; with --lookup also the lookup rows")
    ap.add_argument("--json-only", action="store_true", help="only --json's cost, both vocabularies")
    ap.add_argument("--prompt-cache-only", action="store_true",
                    help="only the prompt cache: TTFT with a 2,000-token cached prefix (the 1.5B model when present), "
                         "and how fast a cache loads")
    ap.add_argument("--sampling-only", action="store_true",
                    help="only the sampling chain's cost: decode tok/s greedy, default chain, full chain, both vocabularies")
    ap.add_argument("--per-type", action="store_true",
                    help="also the per-type table: each GGUF type run by our engine and by llama.cpp")
    ap.add_argument("--per-type-only", action="store_true", help="only the per-type table")
    ap.add_argument("--types", default=",".join(TYPES), help="rows of the per-type table (comma-separated)")
    ap.add_argument("--sets", action="store_true",
                    help="also the per-kernel-set table: q4_1 and q8_0 with every set this CPU runs, and llama.cpp")
    ap.add_argument("--sets-only", action="store_true", help="only the per-kernel-set table")
    ap.add_argument("--omp-wait", choices=("auto", "default", "passive", "active"), default="auto",
                    help="OMP_WAIT_POLICY for the per-type and per-set tables (auto: passive when the machine is busy)")
    ap.add_argument("--scratch", type=Path, default=ROOT / "models",
                    help="where the per-type table's GGUFs (made by llama.cpp's quantizer) and exports go")
    args = ap.parse_args()
    if args.json_only:
        json_bench(args.runs, args.threads)
        return 0
    if args.sampling_only:
        sampling_bench(args.runs, args.threads)
        return 0
    if args.prompt_cache_only:
        prompt_cache_bench(args.runs, args.threads)
        return 0
    if not RUN.exists() or not GGUF.exists():
        print("build ./run and fetch the model first (make run model)", file=sys.stderr)
        return 1
    if args.per_type_only:
        type_table(args.types.split(","), args.scratch, args.runs, args.threads, args.omp_wait)
        return 0
    if args.sets_only:
        set_table(args.runs, args.threads, args.scratch, args.omp_wait)
        return 0
    lookup = lambda: lookup_bench(args.lookup_models.split(","), args.runs, args.threads, args.llamacpp,  # noqa: E731
                                  [t for t in args.tasks.split(",") if t])
    if args.lookup_only:
        lookup()
        return 0
    if args.throughput:
        throughput_bench(args.runs, args.threads, lookup if args.lookup else None)
        return 0
    if args.qwen_only:
        qwen_section(args.runs, args.threads, args.omp_wait)
        return 0
    mc = best_probe(export("q4_1"), args.threads)
    print(machine_line(mc, args.threads))
    print(f"kernel set: {mc['kernels']} (./run's choice here); its peaks: f32 {mc['f32']:.0f} GFLOP/s, "
          f"int8 {mc['i8']:.0f} GOP/s; median [min–max] of {args.runs} runs\n")
    print("| dtype | file MB | load ms | TTFT 128 ms | prefill 128 tok/s | TTFT 512 ms | prefill 512 tok/s | "
          "prefill % of peak | decode tok/s | ITL p50 ms | ITL p90 ms | decode % of the bandwidth it streams from | "
          "peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ours = {}
    for dtype in args.dtypes.split(","):
        b = ours[dtype] = bench_dtype(dtype, args.runs, args.threads)
        peak = mc["i8"] if dtype in ("q8_0", "q4_1") else mc["f32"]
        pct_pp = statistics.median(b["gflops512"]) / peak * 100
        print(f"| {dtype} | {b['file_mb']:.0f} | {summary(b['load_ms'], '{:.1f}')} | {summary(b['ttft128'])} | "
              f"{summary(b['pp128'])} | {summary(b['ttft512'])} | {summary(b['pp512'])} | {pct_pp:.0f}% | "
              f"{summary(b['tg128'], '{:.1f}')} | {summary(b['p50'], '{:.2f}')} | {summary(b['p90'], '{:.2f}')} | "
              f"{decode_share(b['gbps'], export(dtype), args.threads, mc)} | {summary(b['rss'])} |", flush=True)
    if args.long:
        model = export("q4_1")
        ids = prompt_ids(model, 4000)
        rs = [run_once(model, ids, 129, args.threads) for _ in range(max(1, args.runs // 2))]
        print(f"\nq4_1 decode at ~4k context ({mc['kernels']} kernels): "
              f"{summary([r['decode_tps'] for r in rs], '{:.1f}')} tok/s, "
              f"{summary([r['gbps'] for r in rs], '{:.1f}')} GB/s (KV f16)")
    if args.llamacpp:
        ref = llamacpp_bench(args.dtypes, args.threads, args.runs)
        if ref:
            print_ratios(ours, ref, mc["kernels"])
    if args.per_type:
        type_table(args.types.split(","), args.scratch, args.runs, args.threads, args.omp_wait)
    if args.sets:
        set_table(args.runs, args.threads, args.scratch, args.omp_wait)
    if args.qwen:
        qwen_section(args.runs, args.threads, args.omp_wait)
    if args.lookup:
        lookup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
