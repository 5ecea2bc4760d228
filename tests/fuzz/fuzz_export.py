#!/usr/bin/env python3
"""Fuzz export.py's GGUF and safetensors readers, in process, with atheris (libFuzzer for Python).

    python3 tests/fuzz/fuzz_export.py gguf WORKDIR [--seconds 60] [--engine auto|atheris|mutate]
    python3 tests/fuzz/fuzz_export.py gguf WORKDIR --runs 10000 --seed 5 --corpus DIR [--inputs DIR...]
    python3 tests/fuzz/fuzz_export.py safetensors WORKDIR ...
    python3 tests/fuzz/fuzz_export.py gguf WORKDIR --replay FILE...     # regression inputs

WORKDIR is what tests/fuzz/make_seeds.py built: seeds/TARGET, hf_template/. The corpus grows in
WORKDIR/corpus/TARGET (or --corpus DIR) and a failing input is written to WORKDIR/crashes/TARGET/.
With --runs N (and --seed S) the run is N executions instead of --seconds, the same ones every
time from the same corpus, seeds and --inputs directories (run_fuzz.py --fixed).

An input is a whole GGUF file (gguf), or the model.safetensors of a Hugging Face directory
whose config.json and tokenizer files are fixed (safetensors). export.export() runs on it
with an output dtype (and, for GGUF, --tokenizer-only now and then) chosen from the input's
length, so that a saved input replays the same way. What counts as a failure:
  - any exception other than ExportError (export.py's "clear one-line error"), including
    MemoryError and RecursionError: a crafted header made it allocate or recurse unboundedly
  - an ExportError with an empty or multi-line message
  - a failed export that leaves the output file, or a *.tmp-* file, behind
  - an export that changed its input file
  - a successful export whose output breaks export.py's manual ("The model file")'s layout rules (modelfile.problems)
  - a successful GGUF export of an input whose tensor data breaks GGUF's layout (gguf_layout_problem:
    every tensor where the one before it in the table ends, padded to general.alignment), which
    llama.cpp refuses: export.py would have read some tensor from another one's bytes
  - more than --timeout seconds for one input (a hang), more than 2 GB of memory

The engine is atheris when it can be imported (coverage-guided; `pip install atheris`), else
a plain mutation loop over the seeds (--engine mutate), so the target runs everywhere.
Both end with libFuzzer's `stat::number_of_executed_units: N` line.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import math
import random
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import modelfile  # noqa: E402

DTYPES = ("f32", "f16", "q8_0", "q4_1", "keep", "q5_0", "q4_k_m", "q6_k")
MEMORY_LIMIT_MB = 2048


def load_export(instrument: bool):
    """Import ROOT/export.py, with atheris's coverage instrumentation when fuzzing with it."""
    sys.path.insert(0, str(ROOT))
    if instrument:
        import atheris
        with atheris.instrument_imports(include=["export"]):
            import export
    else:
        import export
    return export


class Harness:
    """Runs export on one input in a private scratch directory and judges the outcome."""

    def __init__(self, target: str, workdir: Path, export_module, scratch: Path | None = None):
        self.target, self.ex = target, export_module
        # atheris.Fuzz() ends the process from C (libFuzzer's exit), so close() never runs after it: a run
        # under run_fuzz.py gets its --scratch directory from there, which removes it afterwards
        self.own_tmp = scratch is None
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self.tmp = Path(tempfile.mkdtemp(prefix=f"fuzz_export_{target}_", dir=base)) if scratch is None else scratch
        self.template = workdir / "hf_template"
        if target == "safetensors" and not (self.template / "config.json").exists():
            raise SystemExit(f"fuzz_export: {self.template} is missing: run tests/fuzz/make_seeds.py {workdir}")
        self.executions = 0

    def close(self) -> None:
        if self.own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _input_path(self, data: bytes) -> Path:
        if self.target == "gguf":
            path = self.tmp / "in.gguf"
        else:
            d = self.tmp / "hf"
            if not d.exists():
                shutil.copytree(self.template, d)
            path = d / "model.safetensors"
        path.write_bytes(data)
        return path

    def run(self, data: bytes) -> None:
        self.executions += 1
        inp = self._input_path(data)
        src = inp if self.target == "gguf" else inp.parent
        out = self.tmp / "out.bin"
        out.unlink(missing_ok=True)
        args = argparse.Namespace(input=str(src), output=str(out), dtype=DTYPES[len(data) % len(DTYPES)],
                                  tokenizer_only=self.target == "gguf" and len(data) % 7 == 0, verbose=False)
        before = hashlib.sha256(data).digest()
        failed = None
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                self.ex.export(args)
            except self.ex.ExportError as e:
                failed = str(e)
        if hashlib.sha256(inp.read_bytes()).digest() != before:
            raise AssertionError("export changed its input file")
        leftovers = [p.name for p in out.parent.glob("out.bin.tmp-*")]
        if leftovers:
            raise AssertionError(f"export left temporary files behind: {leftovers}")
        if failed is not None:
            if not failed.strip() or "\n" in self.ex.show(failed, 600):
                raise AssertionError(f"ExportError without a one-line message: {failed!r}")
            if out.exists():
                raise AssertionError(f"failed export ({failed}) left {out} behind")
            return
        bad = modelfile.problems(out.read_bytes())
        if bad:
            raise AssertionError(f"export wrote an invalid model file: {bad[:3]}")
        layout = gguf_layout_problem(data) if self.target == "gguf" else None
        if layout:
            raise AssertionError(f"export accepted a GGUF that breaks the tensor data layout: {layout}")


# ---------------------------------------------------------------------------------------------
# GGUF tensor layout, read independently of export.py (ggml's docs/gguf.md; block sizes from the gguf package)

GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING_TYPE, GGUF_ARRAY_TYPE, GGUF_UINT32_TYPE = 8, 9, 4


def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    if vtype in GGUF_SCALAR_BYTES:
        return pos + GGUF_SCALAR_BYTES[vtype]
    if vtype == GGUF_STRING_TYPE:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    etype, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if etype in GGUF_SCALAR_BYTES:
        return pos + count * GGUF_SCALAR_BYTES[etype]
    for _ in range(count):
        pos = _skip_value(data, pos, etype)
    return pos


def gguf_layout_problem(data: bytes) -> str | None:
    """For a GGUF that export.py accepted: the first tensor whose data offset is not where the layout puts
    it (0, then each previous tensor's end padded to general.alignment), or None."""
    from gguf.constants import GGML_QUANT_SIZES

    _, _, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    pos, alignment = 24, 32
    for _ in range(n_kv):
        klen = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8:pos + 8 + klen]
        vtype = struct.unpack_from("<I", data, pos + 8 + klen)[0]
        pos += 12 + klen
        if key == b"general.alignment" and vtype == GGUF_UINT32_TYPE:
            alignment = struct.unpack_from("<I", data, pos)[0]
        pos = _skip_value(data, pos, vtype)
    expected = 0
    for _ in range(n_tensors):
        nlen = struct.unpack_from("<Q", data, pos)[0]
        name = data[pos + 8:pos + 8 + nlen].decode("utf-8", "replace")
        n_dims = struct.unpack_from("<I", data, pos + 8 + nlen)[0]
        pos += 12 + nlen
        ne = struct.unpack_from(f"<{n_dims}Q", data, pos)
        ttype, offset = struct.unpack_from("<IQ", data, pos + 8 * n_dims)
        pos += 8 * n_dims + 12
        if offset != expected:
            return f"tensor '{name}' at offset {offset}, expected {expected}"
        block, size = GGML_QUANT_SIZES[ttype]
        nbytes = math.prod(ne) // block * size
        expected = offset + nbytes + (-nbytes) % alignment
    return None


# ---------------------------------------------------------------------------------------------
# Engines

def limit_memory() -> None:
    import resource
    limit = MEMORY_LIMIT_MB << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit * 4, limit * 4))   # address space; RSS is libFuzzer's


def run_atheris(h: Harness, workdir: Path, args: argparse.Namespace) -> None:
    import atheris
    corpus = args.corpus or workdir / "corpus" / h.target
    crashes = workdir / "crashes" / h.target
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    seeds = workdir / "seeds" / h.target
    max_len = max(p.stat().st_size for p in seeds.iterdir())
    # -reload=0: the corpus directory is not reread every second, which would make the run depend on the speed
    budget = [f"-runs={args.runs}", f"-seed={args.seed}", "-reload=0"] if args.runs else [f"-max_total_time={args.seconds}"]
    argv = [sys.argv[0], *budget, f"-timeout={args.timeout}", f"-rss_limit_mb={MEMORY_LIMIT_MB}",
            f"-max_len={max_len}", "-print_final_stats=1", f"-artifact_prefix={crashes}/", str(corpus), str(seeds),
            *map(str, args.inputs)]
    atheris.Setup(argv, h.run)
    atheris.Fuzz()


INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 12, 16, 31, 32, 64, 127, 128, 255, 256, 4096, 0x7FFF, 0xFFFF,
               0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]


def mutate(data: bytearray, rng: random.Random, pool: list[bytes]) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        if not data:
            data = bytearray(rng.choice(pool))
        op, at = rng.randrange(7), rng.randrange(len(data))
        if op == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[at] = rng.randrange(256)
        elif op in (2, 3):
            fmt = "<I" if op == 2 else "<Q"
            v = rng.choice(INTERESTING) & (0xFFFFFFFF if op == 2 else 2**64 - 1)
            if at + struct.calcsize(fmt) <= len(data):
                struct.pack_into(fmt, data, at, v)
        elif op == 4:
            del data[at:at + rng.randint(1, 64)]
        elif op == 5:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            other = rng.choice(pool)
            k = rng.randrange(len(other)) if other else 0
            data[at:] = other[k:k + rng.randint(1, 256)] + data[at:]
    return data


def run_mutate(h: Harness, workdir: Path, args: argparse.Namespace) -> None:
    import signal
    seeds = workdir / "seeds" / h.target
    corpus = args.corpus or workdir / "corpus" / h.target
    crashes = workdir / "crashes" / h.target
    crashes.mkdir(parents=True, exist_ok=True)
    pool = [p.read_bytes() for d in (seeds, corpus, *args.inputs) if d.is_dir() for p in sorted(d.iterdir())]
    rng = random.Random(args.seed)
    seconds, timeout = args.seconds, args.timeout

    def on_alarm(signum, frame):
        raise TimeoutError(f"one input ran longer than {timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    t0 = time.time()
    while (h.executions < args.runs) if args.runs else (time.time() < t0 + seconds):
        data = bytes(mutate(bytearray(rng.choice(pool)), rng, pool))
        signal.alarm(timeout)
        try:
            h.run(data)
        except BaseException:
            signal.alarm(0)
            crash = crashes / f"crash-{hashlib.sha1(data).hexdigest()}"
            crash.write_bytes(data)
            print(f"fuzz_export: failure after {h.executions} executions; input written to {crash}", file=sys.stderr)
            raise
        signal.alarm(0)
    print(f"stat::number_of_executed_units: {h.executions}")
    print(f"stat::average_exec_per_sec:     {h.executions / max(time.time() - t0, 1):.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=("gguf", "safetensors"))
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--timeout", type=int, default=20, help="seconds one input may take")
    ap.add_argument("--engine", choices=("auto", "atheris", "mutate"), default="auto")
    ap.add_argument("--seed", type=int, default=1, help="random seed of either engine (atheris: with --runs)")
    ap.add_argument("--runs", type=int, default=0, help="this many executions instead of --seconds")
    ap.add_argument("--corpus", type=Path, help="the corpus directory (default WORKDIR/corpus/TARGET)")
    ap.add_argument("--inputs", nargs="*", type=Path, default=[], metavar="DIR",
                    help="more directories of starting inputs (read, not written)")
    ap.add_argument("--replay", nargs="+", type=Path, metavar="FILE", help="run these inputs once each and exit")
    ap.add_argument("--scratch", type=Path, help="an existing directory for the inputs and outputs, removed by "
                    "the caller (default: a private one, removed at the end unless atheris ends the process)")
    args = ap.parse_args()
    workdir = args.workdir.resolve()

    engine = args.engine
    if engine == "auto":
        engine = "atheris" if importlib.util.find_spec("atheris") else "mutate"
    limit_memory()
    h = Harness(args.target, workdir, load_export(instrument=engine == "atheris" and not args.replay),
                args.scratch)
    try:
        if args.replay:
            for f in args.replay:
                h.run(f.read_bytes())
                print(f"ok {f}")
            return 0
        budget = f"{args.runs} runs, seed {args.seed}" if args.runs else f"{args.seconds} s"
        print(f"fuzz_export: {args.target}: engine {engine}, {budget}", file=sys.stderr)
        if engine == "atheris":
            run_atheris(h, workdir, args)
        else:
            run_mutate(h, workdir, args)
    finally:
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
