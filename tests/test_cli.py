"""The command line: -h and --version, flag checking, -v on stderr only,
pipes (`| head -c 40`), and the README's "Chat" and "Scripting" examples run
verbatim.

Expected values come from the issue's wording, the GGUF's own metadata
(context length) and the operating system (core count, cache sizes), not from run.c.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from common import DEFAULT_GGUF, DEFAULT_MODEL, ROOT, RUN, SCRATCH, gguf_metadata, model, require, run

# Every flag the issue and the project brief define; -h must document each one.
VALUE_FLAGS = ["-i", "-n", "-t", "-p", "-k", "-s", "-m", "-y", "--threads", "--ctx", "--kv",
               "--ids", "--dump-logits", "--ppl", "--logprobs"]
SWITCHES = ["-c", "-v", "--special", "--tokenize", "--no-batch", "--scalar", "--print-prompt-ids", "--hugepages",
            "-h", "--help", "--version"]
# Flags that have a default; -h must state it.
DEFAULTS = ["-n", "-t", "-p", "-k", "-s", "-m", "-y", "--threads", "--ctx", "--kv"]
PROMPT = "The capital of France is"


def text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def help_entries() -> dict[str, str]:
    """-h text per flag: the option line plus its indented continuation lines."""
    p = run(["-h"], timeout=30)
    assert p.returncode == 0 and p.stderr == b"", text(p.stderr)
    entries: dict[str, str] = {}
    current = None
    for line in text(p.stdout).splitlines():
        m = re.match(r"^ {2}(-[-\w]+)(?:, (-[-\w]+))?", line)
        if m:
            current = [g for g in m.groups() if g]
            for flag in current:
                entries[flag] = line
        elif current and line.startswith("    ") and line.strip():
            for flag in current:
                entries[flag] += "\n" + line
        else:
            current = None
    return entries


# ----- -h, --version --------------------------------------------------------------

def test_help_documents_every_flag():
    p = run(["-h"], timeout=30)
    assert text(p.stdout).startswith("usage: run MODEL"), text(p.stdout)[:200]
    assert run(["--help"], timeout=30).stdout == p.stdout
    entries = help_entries()
    missing = [f for f in VALUE_FLAGS + SWITCHES if f not in entries and f not in text(p.stdout)]
    assert not missing, f"-h does not document {missing}"


def test_help_gives_every_default():
    entries = help_entries()
    for flag in DEFAULTS:
        assert flag in entries, f"{flag} missing from -h"
        assert "default" in entries[flag], f"-h gives no default for {flag}: {entries[flag]!r}"
    for flag, value in [("-n", "256"), ("-t", "0.8"), ("-p", "0.95"), ("-k", "40"), ("--kv", "f16")]:
        assert re.search(rf"default:? {re.escape(value)}\b", entries[flag]), f"{flag}: {entries[flag]!r}"


def test_help_documents_context_full_and_exit_codes():
    out = text(run(["-h"], timeout=30).stdout)
    assert "context" in out and "dropped" in out, "-h must say what happens when the chat context is full"
    for code in ("0", "1", "2", "130"):
        assert re.search(rf"\b{code}\b", out.split("Exit status", 1)[-1]), f"exit status {code} not in -h"


def test_every_documented_flag_is_accepted():
    """No flag that -h lists is rejected as unknown."""
    for flag in help_entries():
        if flag in ("-h", "--help", "--version"):
            continue
        # -n 0 first: a switch then runs without generating; a value flag
        # at the end must complain about its missing value, not be unknown.
        p = run([model(), "-n", "0", flag], stdin=b"", timeout=60)
        assert b"unknown option" not in p.stderr, f"{flag}: {text(p.stderr)}"


def test_version():
    p = run(["--version"], timeout=30)
    assert p.returncode == 0 and p.stderr == b""
    assert re.fullmatch(r"run \d+\.\d+\.\d+\n", text(p.stdout)), p.stdout


def test_documented_defaults_are_the_real_ones():
    """Sampling: no flags == the documented -t/-p/-k written out. Engine:
    ctx = the GGUF's context_length, KV f16, threads = cores (OpenMP build)."""
    base = [model(), "-i", PROMPT, "-n", "6", "-s", "7"]
    implicit = run(base, timeout=120)
    explicit = run(base + ["-t", "0.8", "-p", "0.95", "-k", "40"], timeout=120)
    assert implicit.returncode == 0 and implicit.stdout, text(implicit.stderr)
    assert implicit.stdout == explicit.stdout, (implicit.stdout, explicit.stdout)

    ctx = gguf_metadata(DEFAULT_GGUF, "llama.context_length")
    p = run([model(), "-i", PROMPT, "-n", "0", "-v"], timeout=60)
    summary = text(p.stderr).splitlines()[0]
    assert f"ctx {ctx}," in summary, f"default ctx should be the model's {ctx}: {summary}"
    assert "(f16)" in summary, f"default KV type should be f16: {summary}"
    assert f"{os.cpu_count()} threads" in summary or "1 threads" in summary, summary


# ----- flag checking ----------------------------------------------------------------

BAD_VALUES = [
    ("-t", "-1"), ("-t", "abc"), ("-t", "nan"), ("-t", "inf"), ("-t", ""),
    ("-p", "2"), ("-p", "0"), ("-p", "-0.5"), ("-p", "1.0001"),
    ("-n", "abc"), ("-n", "-1"), ("-n", "1.5"), ("-n", "10x"), ("-n", ""), ("-n", "99999999999999999999"),
    ("-k", "-1"), ("-k", "x"),
    ("-s", "-1"), ("-s", "seed"),
    ("--threads", "0"), ("--threads", "two"),
    ("--ctx", "0"), ("--ctx", "abc"),
    ("-m", "talk"), ("--kv", "q3"),
]


def test_bad_flag_values_exit_2_naming_the_flag():
    failures = []
    for flag, value in BAD_VALUES:
        p = run([model(), flag, value, "-i", "hi", "-n", "1"], timeout=30)
        err = text(p.stderr)
        if p.returncode != 2 or flag not in err or p.stdout:
            failures.append(f"{flag} {value!r}: exit {p.returncode}, stdout {p.stdout[:40]!r}, stderr {err!r}")
        elif value and f"'{value}'" not in err:
            failures.append(f"{flag} {value!r}: the message does not quote the value: {err!r}")
    assert not failures, "\n".join(failures)


def test_ctx_beyond_the_model_is_a_usage_error():
    p = run([model(), "--ctx", "1000000", "-i", "hi", "-n", "1"], timeout=60)
    assert p.returncode == 2 and b"--ctx" in p.stderr and not p.stdout, text(p.stderr)


def test_unknown_flags_are_one_line_usage_errors():
    for flag in ("--foo", "-x", "--TOKENIZE", "-vv", "--n"):
        p = run([model(), flag, "-i", "hi", "-n", "1"], timeout=30)
        err = text(p.stderr)
        assert p.returncode == 2 and not p.stdout, f"{flag}: exit {p.returncode}: {err!r}"
        assert flag in err, f"{flag}: the message does not name the flag: {err!r}"
        assert len(err.splitlines()) == 1 and "run -h" in err, f"{flag}: not one line pointing to -h: {err!r}"


def test_other_usage_errors_exit_2():
    cases = [
        ([], "no model"),
        ([model(), model(), "-i", "hi"], "two model files"),
        ([model(), "-i"], "-i without a value"),
        ([model(), "-i", "hi", "-n"], "-n without a value"),
        ([model(), "-m", "chat", "-i", "hi"], "-i in chat mode"),
        ([model(), "-i", "hi", "--ids", "1 2"], "-i with --ids"),
        ([model(), "--ids", "1 x", "-n", "1"], "--ids not ids"),
        ([model(), "--ids", "99999999", "-n", "1"], "--ids outside the vocabulary"),
    ]
    for args, why in cases:
        p = run(args, stdin=b"", timeout=30)
        assert p.returncode == 2 and p.stderr.startswith(b"run: ") and not p.stdout, \
            f"{why}: exit {p.returncode}, stderr {text(p.stderr)!r}"


def test_boundary_values_are_accepted():
    p = run([model(), "-i", "hi", "-n", "0", "-t", "0", "-p", "1", "-k", "0", "-s", "0", "--threads", "1",
             "--ctx", "1", "--kv", "f32"], timeout=60)
    assert p.returncode == 0 and p.stdout == b"" and p.stderr == b"", text(p.stderr)
    p = run([model(), "-i", "hi", "-n", "0", "-t", "100", "-s", "2147483647", "--kv", "q8", "-m", "generate"],
            timeout=60)
    assert p.returncode == 0 and p.stderr == b"", text(p.stderr)


def test_empty_prompt_is_an_error():
    """-h: "an empty prompt is an error" — also when -c would wrap it."""
    for args, stdin in [(["-i", ""], None), (["-i", "", "-c"], None), ([], b""), (["-c"], b"\n")]:
        p = run([model(), "-n", "4", "-t", "0", *args], stdin=stdin if stdin is not None else b"", timeout=60)
        assert p.returncode in (1, 2) and b"empty" in p.stderr and not p.stdout, \
            f"{args} stdin {stdin!r}: exit {p.returncode}, stdout {p.stdout[:60]!r}, stderr {text(p.stderr)!r}"


def test_runtime_errors_exit_1():
    p = run([SCRATCH / "no-such-model.bin", "-i", "hi"], timeout=30)
    assert p.returncode == 1 and p.stderr.startswith(b"run: ") and not p.stdout, text(p.stderr)
    p = run([model(), "-i", "hi " * 40, "--ctx", "8", "-n", "1"], timeout=60)
    assert p.returncode == 1 and b"context" in p.stderr, f"prompt longer than --ctx: {text(p.stderr)!r}"


def test_files_that_cannot_be_read_exit_1():
    """Issue 35: one rule for every flag that names a file: one that cannot be opened or read (missing, a
    directory) is a runtime error, exit 1, one line naming it; so is an output that cannot be written.
    `--json-schema /nonexistent` exited 2 while the others exited 1."""
    m = model()
    missing, folder = SCRATCH / "no-such-file", SCRATCH
    cases = []
    for path in (missing, folder):
        cases += [([path, "-i", "hi"], str(path)),
                  ([m, "--ppl", path], str(path)),
                  ([m, "--batch", path], str(path)),
                  ([m, "-i", "hi", "--json-schema", path], f"--json-schema {path}"),
                  ([m, "-i", "hi", "-n", "1", "--prompt-cache", path, "--prompt-cache-ro"], str(path))]
    cases.append(([m, "-i", "hi", "--dump-logits", missing / "logits.bin"], str(missing / "logits.bin")))
    for args, words in cases:
        p = run(args, timeout=60)
        err = text(p.stderr).splitlines()
        assert p.returncode == 1, f"{args[1:]}: exit {p.returncode}, {err}"
        assert len(err) == 1 and err[0].startswith("run: ") and words in err[0] and not p.stdout, f"{args[1:]}: {err}"


# SmolLM2's vocabulary holds no token for these byte values (test_tokenizer.SMOLLM2_UNCOVERED, checked there
# against the model file's single-byte tokens)
SMOLLM2_UNCOVERED = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)])


def test_prompt_bytes_without_a_token_are_one_error_everywhere():
    """Issue 35: a prompt byte with no token in the vocabulary is an error naming it, in every mode: --tokenize
    (it printed an empty line, or the ids of the other bytes), generation, -c, -y, a chat message (refused with
    an empty answer, the chat goes on) and a batch line (its error record). Every other byte value is taken."""
    m = model()
    for b in SMOLLM2_UNCOVERED:
        p = run([m, "--tokenize"], stdin=b"a" + bytes([b]) + b"z")
        err = text(p.stderr).splitlines()
        assert p.returncode == 1 and not p.stdout and len(err) == 1 and f"byte 0x{b:02x} (at offset 1)" in err[0], \
            f"0x{b:02x}: exit {p.returncode}, {p.stdout!r}, {err}"
    covered = bytes(b for b in range(1, 256) if b not in SMOLLM2_UNCOVERED)
    p = run([m, "--tokenize"], stdin=covered + b"z")
    assert p.returncode == 0 and p.stdout.split() and not p.stderr, text(p.stderr)
    bad = os.fsdecode(b"a\xffz")
    for args, words in ((["-i", bad, "-n", "1"], "the prompt has a byte 0xff"),
                        (["-c", "-i", bad, "-n", "1"], "the prompt has a byte 0xff"),
                        (["-c", "-i", "hi", "-y", bad, "-n", "1"], "the system prompt has a byte 0xff")):
        p = run([m, *args], timeout=60)
        err = text(p.stderr).splitlines()
        assert p.returncode == 1 and not p.stdout and len(err) == 1 and words in err[0], f"{args}: {err}"
    p = run([m, "-m", "chat", "-t", "0", "-n", "2"], stdin=b"a\xffz\nhi\n", timeout=60)
    err = text(p.stderr).splitlines()
    answers = p.stdout.decode(errors="replace").split("\n")
    assert p.returncode == 0 and answers[0] == "" and answers[1], f"chat: {answers}"
    assert len(err) == 1 and "byte 0xff" in err[0], f"chat: {err}"
    p = run([m, "--batch", "-", "-t", "0", "-n", "1"], stdin=b"a\xffz\nhi\n", timeout=60)
    recs = [json.loads(x) for x in p.stdout.decode().splitlines()]
    assert p.returncode == 1 and "byte 0xff" in recs[0].get("error", "") and "text" in recs[1], recs


# ----- -v --------------------------------------------------------------------------------

PREFILL_RE = re.compile(r"^prefill: (\d+) tokens in [\d.]+ ms, [\d.]+ tok/s, TTFT [\d.]+ ms")
DECODE_RE = re.compile(r"^decode: (\d+) tokens, [\d.]+ tok/s, ITL [\d.]+ ms.*, p90 [\d.]+ ms")


def test_verbose_only_on_stderr():
    """-v changes nothing on stdout; stderr has the model summary, then the
    prompt tokens, TTFT and prefill tok/s, generated tokens, decode tok/s,
    mean and p90 inter-token latency."""
    args = [model(), "-i", PROMPT, "-t", "0", "-n", "8"]
    quiet, loud = run(args, timeout=120), run(args + ["-v"], timeout=120)
    assert quiet.returncode == loud.returncode == 0 and quiet.stderr == b"", text(quiet.stderr)
    assert quiet.stdout == loud.stdout and quiet.stdout, (quiet.stdout, loud.stdout)
    lines = text(loud.stderr).splitlines()
    assert lines[0].startswith("model: ") and "layers" in lines[0] and "params" in lines[0], lines
    n_prompt = len(run([model(), "-i", PROMPT, "--tokenize"], timeout=30).stdout.split())
    pre = [m for line in lines if (m := PREFILL_RE.match(line))]
    dec = [m for line in lines if (m := DECODE_RE.match(line))]
    assert len(pre) == 1 and int(pre[0].group(1)) == n_prompt, f"prefill line with {n_prompt} tokens: {lines}"
    assert len(dec) == 1 and 1 <= int(dec[0].group(1)) <= 8, f"decode line: {lines}"


MEMORY_RE = re.compile(r"^memory: [\d.]+ MB private .*, ([\d.]+) MB of the ([\d.]+) MB model file resident", re.M)


def test_verbose_memory_line_counts_the_model_file_only():
    """-v's memory line: the MB of the model file in memory is at most the file's size, taken from the file system
    (it once counted every mapped file: "101.7 MB of the 93.4 MB model file"), and after a token that read every
    weight, most of it."""
    p = run([model(), "-i", PROMPT, "-n", "1", "-v"], timeout=120)
    assert p.returncode == 0, text(p.stderr)
    m = MEMORY_RE.search(text(p.stderr))
    assert m, text(p.stderr)
    resident, size = float(m.group(1)), float(m.group(2))
    assert size == round(os.path.getsize(model()) / 2**20, 1), (size, os.path.getsize(model()))
    assert 0.5 * size <= resident <= size, m.group(0)


COPY_RE = re.compile(r"^memory: ([\d.]+) MB private \(the model's ([\d.]+) MB copy, activations, KV cache; "
                     r"([\d.]+) MB of it in huge pages\), peak RSS ([\d.]+) MB$", re.M)


def thp_enabled() -> bool:
    """Whether this kernel gives transparent huge pages to a region that asks (madvise) or to all."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


def test_hugepages_same_text_and_a_private_copy():
    """--hugepages reads the model into private memory in 2 MiB pages: the text is the mapped run's, byte for
    byte (sampled too), and -v says the copy is the file's size, private, and (where the kernel gives huge
    pages) nearly all of it in them; the model file is not mapped (no "model file resident")."""
    for args in (["-t", "0", "-n", "24"], ["-t", "0.9", "-s", "7", "-n", "24"]):
        mapped = run([model(), "-i", PROMPT, *args], timeout=120)
        copied = run([model(), "-i", PROMPT, *args, "--hugepages", "-v"], timeout=120)
        assert mapped.returncode == copied.returncode == 0, text(copied.stderr)
        assert copied.stdout == mapped.stdout and mapped.stdout, (mapped.stdout, copied.stdout)
    err = text(copied.stderr)
    m = COPY_RE.search(err)
    assert m and "model file resident" not in err, err
    private, size, huge, peak = map(float, m.groups())
    assert size == round(os.path.getsize(model()) / 2**20, 1), (size, os.path.getsize(model()))
    assert size <= private <= peak and huge <= private, m.group(0)
    if thp_enabled():  # the copy starts on a 2 MiB boundary and asks for huge pages: all but its last partial one
        assert huge >= size - 2, m.group(0)


# ----- --probe ---------------------------------------------------------------------------

ROOFLINE_RE = re.compile(r"^roofline: .*; decode at \d+% of (\S+) bandwidth \([\d.]+ MB/token at [\d.]+ GB/s(.*)\); "
                         r"decode is \S+-bound$", re.M)


def last_level_cache() -> tuple[int, int]:
    """(level, bytes) of cpu0's last-level data cache as the OS reports it: /sys, else getconf's L3;
    (0, 0) when neither says."""
    best = (0, 0)
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        if (d / "type").read_text().strip() == "Instruction":
            continue
        size = (d / "size").read_text().strip()
        n = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
        best = max(best, (int((d / "level").read_text()), n))
    if best == (0, 0):
        out = subprocess.run(["getconf", "LEVEL3_CACHE_SIZE"], capture_output=True, text=True).stdout.strip()
        best = (3, int(out)) if out.isdigit() and int(out) > 0 else best
    return best


def test_probe_sets_decode_against_the_level_it_streams_from():
    """--probe -v measures DRAM and the last-level cache (its size as the OS reports it) and sets decode
    against the level a token's bytes stream from: a model far smaller than the cache streams from the
    cache and is said not to be DRAM-bound, one more than twice the cache's size streams from DRAM
    (issue 15). The sizes come from the model files and /sys, not from run.c."""
    from test_bad_inputs import tiny_model

    level, size = last_level_cache()
    checked = []
    for path in (tiny_model(), Path(model())):
        p = run([path, "--probe", "-v", "-n", "2", "-i", "a", "-t", "0"], timeout=120)
        err = text(p.stderr)
        assert p.returncode == 0, err
        machine = re.search(r"^machine: \d+ threads, DRAM read [\d.]+ GB/s, .*$", err, re.M)
        assert machine, err
        cache = f", L{level} cache ({size / 2**20:.0f} MiB) read " if size else ", last-level cache size unknown"
        assert cache in machine.group(0), (cache, machine.group(0))
        roof = ROOFLINE_RE.search(err)
        assert roof, err
        weights = path.stat().st_size
        if size and 4 * weights < size:
            assert roof.group(1) == f"L{level}" and "not DRAM-bound" in roof.group(2), (path.name, roof.group(0))
            checked.append("cache")
        elif not size or weights > 2 * size:
            assert roof.group(1) == "DRAM" and "DRAM-bound" not in roof.group(2), (path.name, roof.group(0))
            checked.append("DRAM")
    assert checked, "neither model is clearly inside or outside the cache"


# ----- pipes -----------------------------------------------------------------------------

def pipe_to_head(args: list[str], stdin: bytes = b"", budget: float = 60) -> tuple[int, bytes, bytes, float]:
    """`run ARGS | head -c 40`: (engine status, head's bytes, engine stderr,
    seconds from head's exit to the engine's)."""
    with tempfile.TemporaryFile() as err:
        eng = subprocess.Popen([str(RUN), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        head = subprocess.Popen(["head", "-c", "40"], stdin=eng.stdout, stdout=subprocess.PIPE)
        eng.stdout.close()  # head alone holds the read end, as in a shell pipeline
        eng.stdin.write(stdin)
        eng.stdin.close()
        try:
            got = head.communicate(timeout=budget)[0]
            t_head = time.time()
            code = eng.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            eng.kill(), head.kill(), eng.wait(), head.wait()
            raise AssertionError(f"`run {' '.join(args)} | head -c 40` still running after {budget}s")
        lag = time.time() - t_head
        err.seek(0)
        return code, got, err.read(), lag


def test_head_c_40_generate_exits_quietly():
    code, got, err, lag = pipe_to_head([model(), "-i", "Once upon a time", "-t", "0", "-n", "4000"])
    assert len(got) == 40, f"head got {len(got)} bytes: the engine stopped before the pipe closed"
    assert code == 0 and err == b"", f"exit {code}, stderr {text(err)!r}"
    assert lag < 10, f"the engine ran on {lag:.1f}s after head exited"


def test_head_c_40_chat_exits_quietly():
    code, got, err, lag = pipe_to_head([model(), "-m", "chat", "-t", "0", "-n", "4000"],
                                       stdin=b"Count from 1 to 300, one number per line.\nAnd again.\n")
    assert len(got) == 40, f"head got {len(got)} bytes: {got!r}"
    assert code == 0 and err == b"", f"exit {code}, stderr {text(err)!r}"
    assert lag < 10, f"the engine ran on {lag:.1f}s after head exited"


def test_stdin_prompt_same_as_i():
    """stdin's prompt is -i's with one trailing newline dropped, "\\n" or "\\r\\n"; any other byte stays (a
    lone trailing "\\r" was dropped too, found by a differential tokenizer run against llama.cpp)."""
    for arg, piped in ((PROMPT, PROMPT + "\n"), (PROMPT, PROMPT + "\r\n"), (PROMPT + "\r", PROMPT + "\r"),
                       (PROMPT + "\r", PROMPT + "\r\r\n"), (PROMPT + "\n", PROMPT + "\n\n"), (PROMPT, PROMPT)):
        a = run([model(), "--tokenize", "-i", arg], timeout=30)
        b = run([model(), "--tokenize"], stdin=piped.encode(), timeout=30)
        assert a.returncode == b.returncode == 0 and a.stdout == b.stdout, (piped, a.stdout, b.stdout, b.stderr)


# ----- README examples ----------------------------------------------------------------

README_SECTIONS = ("Chat", "Scripting")


def readme_commands(readme: Path, headings: tuple[str, ...]) -> dict[str, list[str]]:
    """The commands of the ```sh blocks under each `## heading` (up to the
    next `## `), one per line; `\\` continues a line, comments are dropped."""
    out: dict[str, list[str]] = {}
    section, in_block, pending = None, False, ""
    for line in readme.read_text(encoding="utf-8").splitlines():
        if not in_block and line.startswith("## "):
            section = line[3:].strip() if line[3:].strip() in headings else None
            if section:
                out.setdefault(section, [])
        elif line.strip().startswith("```"):
            in_block = not in_block and line.strip() == "```sh" and section is not None
        elif in_block:
            cmd = pending + line
            if cmd.endswith("\\"):
                pending = cmd[:-1] + " "
                continue
            pending = ""
            if cmd.strip() and not cmd.strip().startswith("#"):
                out[section].append(cmd)
    return out


def test_readme_chat_and_scripting_examples_run():
    run_readme_examples(require(ROOT / "README.md", "the README"))


def run_readme_examples(readme: Path) -> None:
    """Each command under the "Chat" and "Scripting" headings runs verbatim
    (bash, pipefail, stdin not a terminal) in a directory that has ./run and
    models/, and exits 0 with no error message."""
    commands = readme_commands(readme, README_SECTIONS)
    for section in README_SECTIONS:
        assert commands.get(section), f"README.md has no ```sh commands under '## {section}'"
    model()
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        (Path(tmp) / "run").symlink_to(RUN.resolve())
        (Path(tmp) / "models").symlink_to(DEFAULT_MODEL.parent.resolve())
        for section in README_SECTIONS:
            for cmd in commands[section]:
                p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=tmp, stdin=subprocess.DEVNULL,
                                   capture_output=True, timeout=120)
                errors = [l for l in text(p.stderr).splitlines() if l.startswith("run: ") or "rror" in l]
                assert p.returncode == 0 and not errors, \
                    f"README '{section}': `{cmd}` exit {p.returncode}: {text(p.stderr)[-500:]!r}"


# Names in README "How it works" that are not ours: libc, instructions.
FOREIGN_NAMES = {"mmap", "expf", "maddubs", "madd", "vpdpbusd"}


def defined_names(source: str) -> set[str]:
    """Functions, macros, types and tables a C file defines (a name followed by '(' or '='
    or ending a typedef, at the start of a definition line)."""
    names = set(re.findall(r"^(?:static\s+|INLINE\s+|const\s+|inline\s+)*[\w\s\*]*?\b(\w+)\s*\(", source, re.M))
    names |= set(re.findall(r"^#define\s+(\w+)", source, re.M))
    names |= set(re.findall(r"^\}\s*(\w+);", source, re.M))
    names |= set(re.findall(r"^static\s+(?:const\s+)?\w+\s+(\w+)\s*\[", source, re.M))
    return names


def test_readme_how_it_works_names_functions_that_exist():
    """Every identifier README's "How it works" puts in backticks is defined in run.c or
    tokenizer.c (or is a file that exists), so the walk through the code stays true."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How it works\n", 1)[1].split("\n## ", 1)[0]
    source = (ROOT / "run.c").read_text() + (ROOT / "tokenizer.c").read_text()
    names = defined_names(source)
    cited = set(re.findall(r"`([A-Za-z_]\w*)`", section))
    assert len(cited) >= 30, f"only {len(cited)} names found in How it works"
    missing = sorted(n for n in cited - FOREIGN_NAMES if n not in names)
    assert not missing, f"README How it works names what run.c does not define: {missing}"
    for path in re.findall(r"`(tests/[\w./]+)`", section):
        assert (ROOT / path).exists(), f"README How it works names a missing file {path}"
