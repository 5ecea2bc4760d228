#!/usr/bin/env python3
"""Issue 4's measurements: one markdown table row per weight type, and the KV-cache variants.

For SmolLM2-135M-Instruct (the Q4_1 GGUF in models/) exported with each dtype:
file size, perplexity over tests/data/kjv-genesis.txt (windows of --ctx 512,
second half scored), prefill tok/s of a 512-token prompt, decode tok/s of 128
greedy tokens, and peak RSS (GNU /usr/bin/time -v). Speeds are the median of
--runs runs after --warmup unmeasured runs; peak RSS is the largest seen.

Rows:
  f32, f16, q8_0   export.py from the GGUF. The GGUF holds Q4_1 layer matrices
                   and a Q8_0 embedding, so f32/f16 are its dequantized values and
                   q8_0 requantizes the layers (Q4_1 -> float -> Q8_0) while its
                   embedding is a Q8_0 block copy.
  q4_1             export.py from the GGUF: a bit-for-bit copy of its blocks.
  ... from F32     export.py from an F32 GGUF holding the GGUF's dequantized
                   weights (written here with the `gguf` package): nothing can be
                   block-copied, so every matrix goes through export.py's quantizer.
  plain q4_1       the q4_1 file with the embedding (= tied output head) also
                   Q4_1, re-encoded here (an experiment: what export.py's Q8_0
                   embedding in --dtype q4_1 buys).
Top-1 agreement and KL divergence against f32 are measured on the scored
positions of the first --top1-windows perplexity windows.
The targets are relative to the f32 row (same weights, same text). KV rows run
the f32 and q4_1 files with --kv f32 / f16 / q8.

Perplexities are deterministic, so they are cached in SCRATCH/quality/ppl.json
by (engine binary, model file, text, ctx, KV type, threads); --fresh ignores it.

    python3 tests/quality.py [--runs 5] [--threads 2] [--rows f32,q8_0,...] [--no-kv] [--json OUT]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import os
import platform
import re
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_GGUF, ROOT, RUN, SCRATCH, TESTS, sha256_file  # noqa: E402

EXPORT = ROOT / "export.py"
TEXT = TESTS / "data" / "kjv-genesis.txt"
WORK = SCRATCH / "quality"
TIME = Path("/usr/bin/time")
F32_GGUF_MAKER_VERSION = "1"   # bump when make_f32_gguf changes what it writes
MB = 1e6


# ---------------------------------------------------------------------------------------------
# Model files (cached in WORK, keyed by content so a changed exporter or source is re-exported)

def _replace_stale(out: Path, prefix: str) -> None:
    """Delete older cache files of the same kind (other keys) so SCRATCH does not grow without bound."""
    for old in out.parent.glob(prefix + "*"):
        if old != out:
            old.unlink(missing_ok=True)


def _file_version(path: Path) -> tuple[str, int, int]:
    """A cache key for a file's content as it is now: its path, modification time and size."""
    st = path.stat()
    return str(path), st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=None)
def _reader(version: tuple[str, int, int]):
    from gguf import GGUFReader
    return GGUFReader(version[0])


def gguf_reader(path: Path):
    """The `gguf` package's GGUFReader of path, one per process and file version: it decodes SmolLM2's 49k
    token strings, 8 s of CPU, and the F32 source and test_oracle_quant's replicas read the same file."""
    return _reader(_file_version(Path(path)))


@functools.lru_cache(maxsize=None)
def _decoded(version: tuple[str, int, int]) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize
    values = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in _reader(version).tensors}
    for v in values.values():
        v.setflags(write=False)   # shared by every caller
    return values


def decoded(path: Path) -> dict[str, np.ndarray]:
    """path's tensors decoded to float32 by the `gguf` package (read-only arrays), once per process and file
    version (SmolLM2: 540 MB, 4 s of decoding)."""
    return _decoded(_file_version(Path(path)))


def make_f32_gguf(src: Path, dst: Path, overrides: dict[str, bool] | None = None) -> None:
    """Write `dst`: the GGUF `src` with every tensor dequantized to F32 by the `gguf` package.

    Metadata is copied unchanged except general.file_type (0 = all F32) and the
    boolean keys in `overrides`. The `gguf` package's dequantizers are
    independent of export.py's; tests/oracle/make_goldens.py checked that
    llama.cpp's own quantize API (ftype ALL_F32) gives the same values.
    """
    from gguf import GGUFValueType, GGUFWriter

    overrides = dict(overrides or {})
    reader, values = gguf_reader(src), decoded(src)
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue   # written by GGUFWriter itself
        if f.name == "general.file_type":
            writer.add_file_type(0)
        elif f.name in overrides:
            writer.add_bool(f.name, overrides.pop(f.name))
        else:
            vtype = f.types[0]
            writer.add_key_value(f.name, f.contents(), vtype,
                                 sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for key, value in overrides.items():
        writer.add_bool(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, values[t.name].reshape(tuple(int(n) for n in reversed(t.shape))))   # ggml ne order
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(frozen=True)
class Source:
    path: Path
    key: str     # identifies the content, for cache names


def gguf_source(path: Path = DEFAULT_GGUF) -> Source:
    if not path.exists():
        raise FileNotFoundError(f"missing {path}: the default model (`make model` downloads it)")
    return Source(path, sha256_file(path)[:16])


def f32_gguf_source(src: Source) -> Source:
    """The F32 GGUF of `src` (made once, cached)."""
    WORK.mkdir(parents=True, exist_ok=True)
    key = f"f32of-{src.key}-v{F32_GGUF_MAKER_VERSION}"
    out = WORK / f"f32gguf-{key}.gguf"
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        make_f32_gguf(src.path, tmp)
        tmp.replace(out)
        _replace_stale(out, "f32gguf-")
    return Source(out, key)


def export(src: Source, dtype: str, tag: str, export_main: Callable[[list[str]], int] | None = None) -> Path:
    """export.py SRC --dtype DTYPE into WORK (cached by export.py's content and the source's key); through
    export_main (export.py's main, already imported by the caller) in this process when given."""
    WORK.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(EXPORT.read_bytes()).hexdigest()[:12]
    prefix = f"{tag}-{dtype}-"
    out = WORK / f"{prefix}{src.key}-{key}.bin"
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        args = [str(src.path), str(tmp), "--dtype", dtype]
        if export_main is None:
            p = subprocess.run([sys.executable, str(EXPORT), *args], capture_output=True, text=True, timeout=1200)
            rc, err = p.returncode, p.stderr
        else:
            with contextlib.redirect_stderr(io.StringIO()) as captured:
                rc = export_main(args)
            err = captured.getvalue()
        if rc != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"export.py {src.path} --dtype {dtype} failed ({rc}): {err[-2000:]}")
        tmp.replace(out)
        _replace_stale(out, prefix)
    return out


HEADER_SIZE = 256
TABLE_ENTRY = struct.Struct("<48s4I2Q")   # name, type, rows, cols, reserved, offset, size (export.py's manual)
GGML_Q8_0, GGML_Q4_1 = 8, 3


def embedding_to_q4_1(src: Path, dst: Path) -> None:
    """Copy our model file `src` with tok_embeddings re-encoded as Q4_1 (the 'plain 4-bit' experiment).

    export.py --dtype q4_1 keeps the embedding (= the tied output head) at Q8_0;
    this shows what that mixture buys. The Q8_0 rows are decoded and quantized
    to Q4_1 by the `gguf` package; the other tensors are copied and the table's
    offsets rebuilt (64-byte aligned, export.py's manual ("The model file")).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    data = src.read_bytes()
    n_tensors, table_off = struct.unpack_from("<I", data, 68)[0], struct.unpack_from("<Q", data, 88)[0]
    entries = [list(TABLE_ENTRY.unpack_from(data, table_off + i * TABLE_ENTRY.size)) for i in range(n_tensors)]
    first_data = min(e[5] for e in entries)
    out = bytearray(data[:first_data])
    for e in entries:
        name, ttype, rows, cols, off, size = e[0].rstrip(b"\0").decode(), e[1], e[2], e[3], e[5], e[6]
        blob = data[off:off + size]
        if name == "tok_embeddings":
            if ttype != GGML_Q8_0:
                raise ValueError(f"{src}: tok_embeddings has type {ttype}, expected Q8_0")
            raw = np.frombuffer(blob, dtype=np.uint8).reshape(rows, -1)
            values = dequantize(raw, GGMLQuantizationType.Q8_0).reshape(rows, cols)
            blob = quantize(values.astype(np.float32), GGMLQuantizationType.Q4_1).tobytes()
            e[1] = GGML_Q4_1
        out += bytes(-len(out) % 64)
        e[5], e[6] = len(out), len(blob)
        out += blob
    for i, e in enumerate(entries):
        TABLE_ENTRY.pack_into(out, table_off + i * TABLE_ENTRY.size, *e)
    struct.pack_into("<Q", out, 96, len(out))
    dst.write_bytes(bytes(out))


def plain_q4_1(q4_1_model: Path) -> Path:
    """embedding_to_q4_1 of an exported q4_1 file, cached beside it."""
    out = q4_1_model.with_name(q4_1_model.name.replace("-q4_1-", "-plainq4_1-"))
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        embedding_to_q4_1(q4_1_model, tmp)
        tmp.replace(out)
        _replace_stale(out, out.name.split("-plainq4_1-")[0] + "-plainq4_1-")
    return out


def tokenizer_bos(model: Path) -> int | None:
    """The BOS id when the model's tokenizer adds BOS (then --ppl substitutes it at each window start), else None."""
    with open(model, "rb") as f:
        head = f.read(HEADER_SIZE)
        f.seek(struct.unpack_from("<Q", head, 72)[0])
        tok = f.read(64)
    bos, flags = struct.unpack_from("<i", tok, 16)[0], struct.unpack_from("<I", tok, 32)[0]
    return bos if flags & 1 and bos >= 0 else None


# ---------------------------------------------------------------------------------------------
# Running the engine

def engine() -> Path:
    if not RUN.exists():
        raise FileNotFoundError(f"missing {RUN}: build it with `make`")
    return RUN


def run_engine(args: list, timeout: float = 7200, stdin: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([str(engine()), *map(str, args)], capture_output=True, text=True, timeout=timeout, input=stdin)
    if p.returncode != 0:
        raise RuntimeError(f"./run {' '.join(map(str, args))[:300]} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p


PPL_LINE = re.compile(r"perplexity: ([0-9.]+) over (\d+) tokens \((\d+) windows of (\d+)")


@dataclass
class PplResult:
    ppl: float
    scored: int
    windows: int


def parse_ppl(stdout: str) -> PplResult:
    m = PPL_LINE.search(stdout)
    if not m:
        raise RuntimeError(f"no perplexity line in ./run output: {stdout[-500:]!r}")
    return PplResult(float(m.group(1)), int(m.group(2)), int(m.group(3)))


def run_ppl(model: Path, text: Path, ctx: int, kv: str, threads: int) -> PplResult:
    p = run_engine([model, "--ppl", text, "--ctx", ctx, "--kv", kv, "--threads", threads])
    return parse_ppl(p.stdout)


class PplCache:
    """Perplexity is a deterministic function of (engine, model file, text, ctx, KV type, threads): computed once."""

    def __init__(self, path: Path, fresh: bool):
        self.path = path
        self.data = {} if fresh or not path.exists() else json.loads(path.read_text())
        self._hashes: dict[Path, str] = {}

    def _hash(self, path: Path) -> str:
        if path not in self._hashes:
            self._hashes[path] = sha256_file(path)[:16]
        return self._hashes[path]

    def get(self, model: Path, text: Path, ctx: int, kv: str, threads: int) -> PplResult:
        # threads too: the split of the work can change float summation order, hence the last digits
        key = "|".join([self._hash(engine()), self._hash(model), self._hash(text), str(ctx), kv, f"t{threads}"])
        if key not in self.data:
            result = asdict(run_ppl(model, text, ctx, kv, threads))
            # Re-read before writing so that several runs at once (different rows) keep each other's results.
            if self.path.exists():
                self.data.update(json.loads(self.path.read_text()))
            self.data[key] = result
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(self.path)
        return PplResult(**self.data[key])


def text_ids(model: Path, text: Path) -> list[int]:
    """The text's token ids as --ppl sees them (stdin drops one trailing newline: at most the last id differs)."""
    return [int(x) for x in run_engine([model, "--tokenize"], stdin=text.read_text(encoding="utf-8")).stdout.split()]


def dump_logits(model: Path, ids: list[int], kv: str, threads: int) -> np.ndarray:
    """./run --ids ... --dump-logits: float32 [len(ids), vocab] from the batched prefill."""
    WORK.mkdir(parents=True, exist_ok=True)
    out = WORK / f"dump.{os.getpid()}.logits"
    try:
        run_engine([model, "--ids", " ".join(map(str, ids)), "--dump-logits", out, "--kv", kv, "--threads", threads,
                    "--ctx", max(len(ids), 2)])
        logits = np.fromfile(out, dtype="<f4")
    finally:
        out.unlink(missing_ok=True)
    if logits.size % len(ids):
        raise RuntimeError(f"--dump-logits wrote {logits.size} floats for {len(ids)} positions")
    return logits.reshape(len(ids), -1)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


MARGIN = 1.0   # logits; below it the reference itself is near a tie and a flipped argmax means little


@dataclass
class Agreement:
    """How a model's next-token distributions track the reference's at the same positions."""
    positions: int
    top1: float               # fraction of positions with the same argmax
    kl: float                 # mean KL(reference || model), nats
    top1_confident: float     # the same, over positions where the reference's top-1 leads by >= MARGIN logits
    worst_flip_margin: float  # largest reference top1-top2 margin at a position whose argmax differs


def position_stats(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per position: [argmax agrees, reference top1-top2 margin, KL(ref || got)]."""
    lr, lg = log_softmax(ref), log_softmax(got)
    top2 = np.sort(ref, axis=1)[:, -2:]
    return np.stack([ref.argmax(axis=1) == got.argmax(axis=1), top2[:, 1] - top2[:, 0],
                     (np.exp(lr) * (lr - lg)).sum(axis=1)], axis=1)


def summarize(stats: np.ndarray) -> Agreement:
    same, margin, kl = stats[:, 0] > 0, stats[:, 1], stats[:, 2]
    confident = margin >= MARGIN
    return Agreement(len(stats), float(same.mean()), float(kl.mean()),
                     float(same[confident].mean()) if confident.any() else float("nan"),
                     float(margin[~same].max()) if (~same).any() else 0.0)


PREFILL_LINE = re.compile(r"prefill: (\d+) tokens in [0-9.]+ ms, ([0-9.]+) tok/s")
DECODE_LINE = re.compile(r"decode: (\d+) tokens, ([0-9.]+) tok/s")
RSS_LINE = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


@dataclass
class SpeedRun:
    prefill_tok_s: float
    decode_tok_s: float
    decoded: int
    peak_rss_kb: int


def speed_run(model: Path, ids: list[int], n_decode: int, ctx: int, kv: str, threads: int) -> SpeedRun:
    """One greedy generation under /usr/bin/time -v: prefill of `ids`, then n_decode tokens."""
    if not TIME.exists():
        raise FileNotFoundError(f"missing {TIME}: apt-get install time")
    cmd = [str(TIME), "-v", str(engine()), str(model), "--ids", " ".join(map(str, ids)), "-n", str(n_decode),
           "-t", "0", "-v", "--ctx", str(ctx), "--kv", kv, "--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({p.returncode}): {p.stderr[-2000:]}")
    pre, dec, rss = PREFILL_LINE.search(p.stderr), DECODE_LINE.search(p.stderr), RSS_LINE.search(p.stderr)
    if not (pre and dec and rss):
        raise RuntimeError(f"cannot find the -v speed lines / RSS in stderr: {p.stderr[-1500:]}")
    if int(pre.group(1)) != len(ids):
        raise RuntimeError(f"prefill reported {pre.group(1)} tokens, expected {len(ids)}")
    return SpeedRun(float(pre.group(2)), float(dec.group(2)), int(dec.group(1)), int(rss.group(1)))


# ---------------------------------------------------------------------------------------------
# Model facts needed for the RSS budget (export.py's manual ("The model file") header)

def kv_cache_bytes(model: Path, ctx: int, kv: str) -> int:
    """Bytes of K plus V cache for ctx positions: 2 * layers * kv_heads * ctx * row(head_dim)."""
    with open(model, "rb") as f:
        h = f.read(64)
    n_layers, n_heads, n_kv_heads, head_dim = struct.unpack_from("<4I", h, 24)
    del n_heads
    row = {"f32": 4 * head_dim, "f16": 2 * head_dim, "q8": head_dim // 32 * 34}[kv]
    return 2 * n_layers * n_kv_heads * ctx * row


# ---------------------------------------------------------------------------------------------
# The table

@dataclass(frozen=True)
class Variant:
    name: str
    source: str    # "gguf", "f32gguf" (export.py from that source) or "plain" (q4_1 file, embedding made Q4_1)
    dtype: str
    how: str


VARIANTS = [
    Variant("f32", "gguf", "f32", "GGUF dequantized"),
    Variant("f16", "gguf", "f16", "GGUF dequantized, rounded to f16"),
    Variant("q8_0", "gguf", "q8_0", "layers Q4_1 -> float -> Q8_0; embedding Q8_0 block copy"),
    Variant("q4_1", "gguf", "q4_1", "bit copy of the GGUF: layers Q4_1, embedding Q8_0"),
    Variant("q8_0 from F32", "f32gguf", "q8_0", "F32 GGUF -> Q8_0: every matrix quantized"),
    Variant("q4_1 from F32", "f32gguf", "q4_1", "F32 GGUF -> layers Q4_1 + embedding Q8_0: every matrix quantized"),
    Variant("plain q4_1", "plain", "q4_1", "q4_1 with the embedding/tied head also Q4_1 (experiment, not export.py)"),
]
KV_MODELS = ("f32", "q4_1")
KV_TYPES = ("f32", "f16", "q8")


@dataclass
class Row:
    name: str
    how: str
    kv: str
    file_bytes: int
    kv_bytes: int
    ppl: PplResult
    agreement: Agreement | None = None
    prefill_tok_s: float = float("nan")
    decode_tok_s: float = float("nan")
    decoded: int = 0
    peak_rss_kb: int = 0
    file_sha: str = ""

    @property
    def rss_budget_bytes(self) -> int:
        return self.file_bytes + self.kv_bytes + 64 * 1024 * 1024


def build_models(args: argparse.Namespace) -> dict[str, Path]:
    src = gguf_source(args.gguf)
    sources = {"gguf": src}
    models: dict[str, Path] = {}
    need = set(args.rows) | ({"f32"} if args.top1_windows else set()) | (set(KV_MODELS) if not args.no_kv else set())
    if "plain q4_1" in need:
        need.add("q4_1")
    for v in VARIANTS:   # in order, so q4_1 exists before plain q4_1
        if v.name not in need:
            continue
        log(f"preparing {v.name} ...")
        if v.source == "plain":
            models[v.name] = plain_q4_1(models["q4_1"])
            continue
        if v.source not in sources:
            sources[v.source] = f32_gguf_source(src)
        models[v.name] = export(sources[v.source], v.dtype, v.source)
    return models


class Top1:
    """Argmax agreement and KL against the f32 model over the first windows of the perplexity text.

    The windows and scored positions are the ones --ppl uses (second half of
    each window), so this is the same data the perplexity is computed on.
    """

    def __init__(self, ref_model: Path, ids: list[int], args: argparse.Namespace):
        self.args = args
        bos = tokenizer_bos(ref_model)
        self.windows = []
        for w in range(min(args.top1_windows, len(ids) // args.ctx)):
            win = ids[w * args.ctx:(w + 1) * args.ctx]
            if bos is not None:
                win = [bos] + win[1:]
            self.windows.append(win)
        self.first, self.last = args.ctx // 2, args.ctx - 1   # scored rows: first .. last-1
        self.ref = [self._rows(ref_model, win) for win in self.windows]

    def _rows(self, model: Path, win: list[int]) -> np.ndarray:
        return dump_logits(model, win, self.args.kv, self.args.threads)[self.first:self.last]

    def measure(self, model: Path) -> Agreement:
        stats = [position_stats(ref, self._rows(model, win)) for ref, win in zip(self.ref, self.windows)]
        return summarize(np.concatenate(stats))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(name: str, how: str, model: Path, kv: str, args: argparse.Namespace, cache: PplCache,
            prompt: list[int], top1: Top1 | None, speed: bool) -> Row:
    ppl = cache.get(model, args.text, args.ctx, kv, args.threads)
    row = Row(name, how, kv, model.stat().st_size, kv_cache_bytes(model, args.speed_ctx, kv), ppl)
    if top1 is not None:
        row.agreement = top1.measure(model)
    if speed and args.runs > 0:
        for _ in range(args.warmup):
            speed_run(model, prompt, args.decode, args.speed_ctx, kv, args.threads)
        runs = [speed_run(model, prompt, args.decode, args.speed_ctx, kv, args.threads) for _ in range(args.runs)]
        row.prefill_tok_s = statistics.median(r.prefill_tok_s for r in runs)
        row.decode_tok_s = statistics.median(r.decode_tok_s for r in runs)
        row.decoded = min(r.decoded for r in runs)
        row.peak_rss_kb = max(r.peak_rss_kb for r in runs)
    ag = f"  top-1 {row.agreement.top1:.4f} KL {row.agreement.kl:.5f}" if row.agreement else ""
    log(f"  {name:14s} kv {kv:3s}  ppl {ppl.ppl:.4f}{ag}  prefill {row.prefill_tok_s:.0f}  decode "
        f"{row.decode_tok_s:.1f} ({row.decoded} tok)  rss {row.peak_rss_kb / 1024:.0f} MiB")
    return row


def machine_info(threads: int) -> list[str]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    simd = [f for f in ("avx2", "fma", "avx512f") if re.search(rf"\b{f}\b", cpuinfo)]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    version = subprocess.run([str(engine()), "--version"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return [f"CPU: {m.group(1).strip() if m else 'unknown'}, {os.cpu_count()} logical cores "
            f"({', '.join(simd) or 'no AVX2'}), {mem:.0f} GiB RAM; {platform.system()} {platform.release()}",
            f"engine: {version or '?'}, commit {commit or '?'} (plus any uncommitted changes), {threads} threads",
            f"load average (1 min) at the start: {os.getloadavg()[0]:.2f}"]


def fmt(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def pct(a: float, ref: float) -> str:
    return f"{(a / ref - 1) * 100:+.2f} %"


def mb(n_bytes: float) -> str:
    return f"{n_bytes / MB:.1f}" if n_bytes else "n/a"


def table(rows: list[Row], ref: Row) -> list[str]:
    out = ["| dtype | how | file MB | perplexity | vs f32 | top-1 vs f32 | KL vs f32 | prefill tok/s | "
           "decode tok/s | peak RSS MB | RSS budget MB |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ag = r.agreement
        top1 = f"{ag.top1 * 100:.2f} %" if ag else "n/a"
        kl = f"{ag.kl:.5f}" if ag else "n/a"
        out.append(f"| {r.name} | {r.how} | {r.file_bytes / MB:.1f} | {r.ppl.ppl:.4f} | {pct(r.ppl.ppl, ref.ppl.ppl)} | "
                   f"{top1} | {kl} | {fmt(r.prefill_tok_s)} | {fmt(r.decode_tok_s, 1)} | {mb(r.peak_rss_kb * 1024)} | "
                   f"{r.rss_budget_bytes / MB:.1f} |")
    return out


def kv_table(rows: list[Row]) -> list[str]:
    out = ["| weights | KV cache | KV MB | perplexity | vs KV f32 | decode tok/s | peak RSS MB |",
           "|---|---|---:|---:|---:|---:|---:|"]
    base = {r.name: r for r in rows if r.kv == "f32"}
    for r in rows:
        out.append(f"| {r.name} | {r.kv} | {r.kv_bytes / MB:.1f} | {r.ppl.ppl:.4f} | "
                   f"{pct(r.ppl.ppl, base[r.name].ppl.ppl)} | {fmt(r.decode_tok_s, 1)} | {mb(r.peak_rss_kb * 1024)} |")
    return out


def targets(rows: dict[str, Row], kv_rows: list[Row], speed: bool) -> list[str]:
    """Each target of issue 4 that the measured rows allow checking, with PASS / FAIL."""
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"- {'PASS' if ok else 'FAIL'}: {text}")

    f32 = rows.get("f32")
    if f32:
        for name, limit in (("q8_0", 0.5), ("q8_0 from F32", 0.5), ("q4_1", 5.0), ("q4_1 from F32", 5.0),
                            ("plain q4_1", 5.0)):
            if name in rows:
                d = abs(rows[name].ppl.ppl / f32.ppl.ppl - 1) * 100
                check(d <= limit, f"{name} perplexity within {limit} % of f32: {d:.3f} %")
        for name in ("q8_0", "q8_0 from F32"):
            ag = rows[name].agreement if name in rows else None
            if ag:
                check(ag.top1 >= 0.98, f"{name} top-1 agreement with f32 >= 98 %: {ag.top1 * 100:.2f} % over "
                      f"{ag.positions} positions ({ag.top1_confident * 100:.2f} % where f32's margin >= {MARGIN})")
    if speed:
        if f32:
            for name in ("q8_0", "q8_0 from F32"):
                if name in rows:
                    ratio = rows[name].decode_tok_s / f32.decode_tok_s
                    check(ratio >= 3, f"{name} decode >= 3x f32 decode: {ratio:.2f}x")
        for q4, q8 in (("q4_1", "q8_0"), ("q4_1 from F32", "q8_0 from F32")):
            if q4 in rows and q8 in rows:
                ratio = rows[q4].decode_tok_s / rows[q8].decode_tok_s
                check(ratio > 1, f"{q4} decode faster than {q8}: {ratio:.2f}x")
        for r in list(rows.values()) + kv_rows:
            rss = r.peak_rss_kb * 1024
            check(rss <= r.rss_budget_bytes, f"{r.name} (KV {r.kv}) peak RSS {rss / MB:.1f} MB <= file + KV + 64 MiB "
                                             f"= {r.rss_budget_bytes / MB:.1f} MB")
    base = {r.name: r for r in kv_rows if r.kv == "f32"}
    for r in kv_rows:
        if r.kv != "f32":
            d = abs(r.ppl.ppl / base[r.name].ppl.ppl - 1) * 100
            check(d < 0.5, f"{r.name} weights, KV {r.kv} vs KV f32: perplexity changes by {d:.3f} % (< 0.5 %)")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="source GGUF (default: the default model)")
    ap.add_argument("--text", type=Path, default=TEXT, help="perplexity text (default: tests/data/kjv-genesis.txt)")
    ap.add_argument("--ctx", type=int, default=512, help="perplexity window (default 512)")
    ap.add_argument("--kv", default="f16", choices=KV_TYPES,
                    help="KV cache type of the weights table (default f16, the engine's default)")
    ap.add_argument("--runs", type=int, default=5, help="speed runs per row, median reported (0: no speed runs)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured speed runs before those (default 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens (default 512)")
    ap.add_argument("--decode", type=int, default=128, help="decoded tokens (default 128)")
    ap.add_argument("--speed-ctx", type=int, default=1024,
                    help="--ctx of the speed runs; sets the KV cache size in the RSS budget (default 1024)")
    ap.add_argument("--top1-windows", type=int, default=8,
                    help="perplexity windows over which top-1 agreement / KL vs f32 are measured (default 8; 0: off)")
    ap.add_argument("--rows", default=",".join(v.name for v in VARIANTS),
                    help="comma-separated subset of: " + ", ".join(v.name for v in VARIANTS))
    ap.add_argument("--no-kv", action="store_true", help="skip the KV-cache table")
    ap.add_argument("--fresh", action="store_true", help="recompute cached perplexities")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = set(args.rows) - {v.name for v in VARIANTS}
    if unknown:
        ap.error(f"unknown rows: {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    lines = machine_info(args.threads)
    models = build_models(args)
    any_model = next(iter(models.values()))
    ids = text_ids(any_model, args.text)
    if len(ids) < args.prompt:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than the {args.prompt}-token prompt")
    prompt = ids[:args.prompt]
    cache = PplCache(WORK / "ppl.json", args.fresh)
    top1 = Top1(models["f32"], ids, args) if args.top1_windows else None

    rows: dict[str, Row] = {}
    for v in VARIANTS:
        if v.name in args.rows:
            rows[v.name] = measure(v.name, v.how, models[v.name], args.kv, args, cache, prompt,
                                   top1 if v.name != "f32" else None, speed=True)
            rows[v.name].file_sha = sha256_file(models[v.name])[:16]
    kv_rows: list[Row] = []
    if not args.no_kv:
        for name in KV_MODELS:
            for kv in KV_TYPES:
                if kv == args.kv and name in rows:
                    kv_rows.append(rows[name])   # measured above with this KV type
                else:
                    kv_rows.append(measure(name, "", models[name], kv, args, cache, prompt, None, speed=True))

    first = next(iter(rows.values()), None) or (kv_rows[0] if kv_rows else None)
    text = args.text.relative_to(ROOT) if args.text.is_relative_to(ROOT) else args.text
    lines += [f"text: {text}, {len(ids)} tokens; perplexity in windows of {args.ctx}"
              + (f" ({first.ppl.windows} windows, {first.ppl.scored} scored tokens)" if first else ""),
              f"top-1 / KL vs f32: the scored positions of the first {len(top1.windows) if top1 else 0} windows "
              f"({len(top1.windows) * (top1.last - top1.first) if top1 else 0} positions), KV {args.kv}",
              f"speed: {args.prompt}-token prompt via --ids, {args.decode} greedy tokens, --ctx {args.speed_ctx}, "
              f"median of {args.runs} runs after {args.warmup} warm-up; peak RSS = max over runs (GNU time -v)",
              f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}; took {time.time() - t0:.0f} s", ""]
    if rows:
        ref = rows.get("f32") or next(iter(rows.values()))
        lines += [f"Weights (KV cache {args.kv}):", ""] + table(list(rows.values()), ref) + [""]
        by_sha: dict[str, list[str]] = {}
        for r in rows.values():
            by_sha.setdefault(r.file_sha, []).append(r.name)
        same = [names for names in by_sha.values() if len(names) > 1]
        if same:
            lines += ["Byte-identical files: " + "; ".join(" = ".join(n) for n in same), ""]
        flips = [f"{r.name} {r.agreement.top1_confident * 100:.2f} % (largest f32 margin at a flip "
                 f"{r.agreement.worst_flip_margin:.2f})" for r in rows.values() if r.agreement]
        if flips:
            lines += [f"Top-1 agreement where f32's top-1 leads by >= {MARGIN} logit: " + "; ".join(flips), ""]
    if kv_rows:
        lines += ["KV cache:", ""] + kv_table(kv_rows) + [""]
    short = sorted({r.name for r in list(rows.values()) + kv_rows if args.runs and r.decoded < args.decode})
    if short:
        lines += [f"Note: generation stopped early (end of turn) for {short}: decode tok/s is over fewer tokens.", ""]
    lines += ["Targets (issue 4):"] + targets(rows, kv_rows, args.runs > 0)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"machine": lines[:3], "rows": [asdict(r) for r in rows.values()],
                                         "kv_rows": [asdict(r) for r in kv_rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
