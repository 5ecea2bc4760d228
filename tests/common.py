"""Shared helpers for the tests: paths, running ./run, scratch space."""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
MODELS = ROOT / "models"
# The engine under test; `make sanitize` points this at the ASan/UBSan build.
RUN = Path(os.environ.get("RUN_BIN", ROOT / "run"))
DEFAULT_GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = MODELS / "smollm2-135m-instruct.bin"
SCRATCH = Path(os.environ.get("TEST_SCRATCH", tempfile.gettempdir())) / "llm-tests"
SCRATCH.mkdir(parents=True, exist_ok=True)


def run(args: list[str], stdin: bytes | None = None, timeout: float = 300, binary: Path | None = None) -> subprocess.CompletedProcess:
    """Run the engine with `args`; returns the completed process (bytes stdout/stderr)."""
    return subprocess.run([str(binary or RUN), *map(str, args)], input=stdin, capture_output=True, timeout=timeout)


def python(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a Python script of the project (e.g. export.py) with the current interpreter."""
    import sys
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, timeout=timeout)


def require(path: Path, how: str) -> Path:
    """Fail (never skip) when a prerequisite file is missing."""
    if not path.exists():
        raise AssertionError(f"missing {path}: {how}")
    return path


def exported(dtype: str) -> Path:
    """SmolLM2 exported from the default GGUF with --dtype dtype into SCRATCH
    (re-exported when export.py or the GGUF is newer than the file)."""
    require(DEFAULT_GGUF, "run `make model`")
    out = SCRATCH / f"smollm2-{dtype}.bin"
    sources = [DEFAULT_GGUF, ROOT / "export.py"]
    if not out.exists() or out.stat().st_mtime < max(p.stat().st_mtime for p in sources):
        r = python([ROOT / "export.py", DEFAULT_GGUF, out, "--dtype", dtype])
        assert r.returncode == 0, r.stderr.decode()
    return out


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB pieces (model files are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
