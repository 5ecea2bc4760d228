"""--prompt-cache FILE (issue 27): the K and V of a prompt's tokens kept on disk, loaded by a later run whose
prompt begins with them.

The independent source of the identity tests is the same command without the cache: with it, stdout must be
the same bytes: the `--logprobs 20` records (the ids, and 17 significant digits of 20 log-probabilities per token: the
logits), greedy on Gemma 3, sampled with a seed over the whole vocabulary on SmolLM2, in plain generation, `-c` with a
long `-y` system prompt (SmolLM2), `-m chat` and `--batch`, on SmolLM2 and on Gemma 3 (sliding window of 512, with
prompts longer than it). This
holds when prefilling from a position P gives the logits prefilling the whole prompt gives (issue 26).
The file's layout is read here from README "Prompt cache" (`read_cache`), not from run.c: its size must be the
header, the ids and exactly n positions' K and V in the KV type in use. A file that does not fit (another model,
--kv, --ctx, damaged, truncated) must be ignored with a -v line, or refused with --prompt-cache-ro; a path that is
not a regular file is an error; a write that fails (an unwritable directory, a full disk, a signal) leaves no
partial file.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

from common import DEFAULT_MODEL, KERNELS_ENV, MODELS, RUN, SCRATCH, model, require, run

WORK = SCRATCH / "prompt_cache"
WORK.mkdir(parents=True, exist_ok=True)
GEMMA = MODELS / "gemma3-270m.bin"
HEADER = 256
KV_ROW = {"f32": lambda hd: 4 * hd, "f16": lambda hd: 2 * hd, "q8": lambda hd: hd // 32 * 34, "q4": lambda hd: hd // 32 * 18}
# a document longer than Gemma's 512-position window, and a system prompt
DOCUMENT = " ".join(f"Note {i}: the station at kilometre {7 * i} of the old northern railway was opened in {1850 + i} and "
                    f"closed in {1950 + i}; its platform was {20 + i % 9} metres long." for i in range(15))
SYSTEM = " ".join(["You are a careful assistant for a railway museum: answer in one short sentence, quote the notes "
                   "when you can, and say so when the notes do not tell."] * 14)
QUESTIONS = ("\nQuestion: when was the station at kilometre 70 opened?\nAnswer:",
             "\nQuestion: how long was the platform of note 5?\nAnswer:")
SHORT = "The station at kilometre 70 of the old northern railway was opened in"


def gemma() -> str:
    require(RUN, "build the engine with `make`")
    return str(require(GEMMA, "run `make model-gemma`"))


def fresh(name: str) -> Path:
    path = WORK / name
    path.unlink(missing_ok=True)
    return path


def engine(args: list, stdin: bytes | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    p = run(args, stdin=stdin, timeout=timeout)
    assert p.returncode == 0, f"./run {' '.join(map(str, args[1:]))[:300]}: exit {p.returncode}: " \
                              f"{p.stderr.decode(errors='replace')[-800:]}"
    return p


def loaded(stderr: bytes) -> list[int]:
    """The -v lines' counts of tokens loaded from the cache, in order."""
    return [int(x) for x in re.findall(rb"prompt cache: (\d+) of the prompt's \d+ tokens loaded", stderr)]


def model_shape(path: str) -> tuple[int, int, int]:
    """n_layers, n_kv_heads, head_dim from a model file's header (export.py's manual, "The model file")."""
    head = Path(path).read_bytes()[:HEADER] if Path(path).stat().st_size < (1 << 20) else open(path, "rb").read(HEADER)
    return struct.unpack_from("<I", head, 24)[0], struct.unpack_from("<I", head, 32)[0], struct.unpack_from("<I", head, 36)[0]


def read_cache(path: Path) -> dict:
    """The fields of a cache file as README "Prompt cache" lays them out."""
    b = path.read_bytes()
    assert b[:4] == b"LLMC", f"{path}: magic {b[:4]!r}"
    version, file_version, kv_type = struct.unpack_from("<3I", b, 4)
    model_size, model_hash = struct.unpack_from("<2Q", b, 16)
    ctx, layers, kv_heads, head_dim, row, n = struct.unpack_from("<6I", b, 32)
    kernels = b[56:72].rstrip(b"\0").decode()
    kv_at = HEADER + (4 * n + 63) // 64 * 64
    return {"version": version, "file_version": file_version, "kv_type": kv_type, "model_size": model_size,
            "model_hash": model_hash, "ctx": ctx, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "row": row, "n": n, "kernels": kernels, "size": len(b),
            "ids": list(struct.unpack_from(f"<{n}i", b, HEADER)),
            "kv": np.frombuffer(b, np.uint8, offset=kv_at).reshape(layers, 2, kv_heads, n, row) if len(b) > kv_at else None}


def tokenize(m: str, *args: str) -> list[int]:
    return [int(x) for x in engine([m, "--tokenize", *args]).stdout.split()]


# ------------------------------------------------------------------------------------------------------------
# The same output with and without the cache


_uncached: dict[tuple, bytes] = {}


def without_cache(args: list, stdin: bytes | None = None) -> bytes:
    """stdout of ./run ARGS (no --prompt-cache), run once per distinct command: the reference output is
    deterministic (greedy, or sampled with a seed), so a repeated command need not be run again."""
    key = (tuple(map(str, args)), stdin)
    if key not in _uncached:
        _uncached[key] = engine(args, stdin=stdin).stdout
    return _uncached[key]


# --logprobs 20 last: batch lines ask for their records themselves (check_batch drops it)
GREEDY = ["-t", "0", "--logprobs", "20"]
# -k 0 -p 1: the sampled distribution is the whole vocabulary's softmax at -t 0.8, so its 20 records per token depend
# on every logit as greedy's do (with the default top-k and top-p a confident token's record is one entry, logprob 0)
SAMPLED = ["-t", "0.8", "-s", "7", "-k", "0", "-p", "1", "--logprobs", "20"]


def modes(m: str) -> tuple[list[str], ...]:
    """The runs compared with and without the cache. --logprobs 20 (every token's logits to 17 digits) is what
    shows the loaded K and V are right; a seeded sampled run adds that the sampler's state does not depend on where
    prefill started, which does not depend on the model. SmolLM2 runs one sampled run with its records (both checks
    in one run: the records hold the ids drawn and the logits' softmax), Gemma 3 (there for its sliding window) the
    greedy records."""
    return (GREEDY,) if m == str(GEMMA) else (SAMPLED,)


def same_with_cache(m: str, cache: Path, args: list, stdin: bytes | None = None, where: str = "") -> bytes:
    """Runs args without and with --prompt-cache (--logprobs 20 records, which hold the text's ids: greedy on
    Gemma 3, sampled with a seed on SmolLM2: `modes`) and requires the same stdout bytes; returns the cached runs'
    stderr (-v)."""
    err = b""
    for mode in modes(m):
        want = without_cache([m, *args, *mode], stdin=stdin)
        p = engine([m, *args, *mode, "--prompt-cache", cache, "-v"], stdin=stdin)
        assert p.stdout == want, (f"{where} {' '.join(mode)}: the output with the cache differs:\n"
                                  f"without: {want[:600]!r}\nwith:    {p.stdout[:600]!r}")
        err += p.stderr
    return err


def check_plain(m: str, name: str) -> str:
    cache = fresh(name)
    first = ["-i", DOCUMENT + QUESTIONS[0], "-n", "16"]
    err = same_with_cache(m, cache, first, where="first run")
    assert b"saved" in err and cache.exists(), "the first run did not write the cache"
    n_doc = len(tokenize(m, "-i", DOCUMENT))
    second = ["-i", DOCUMENT + QUESTIONS[1], "-n", "16"]
    err = same_with_cache(m, cache, second, where="another question")
    got = loaded(err)
    assert got and min(got) >= n_doc - 2, f"loaded {got} tokens, the document alone has {n_doc}"
    err = same_with_cache(m, cache, second, where="the same prompt again")  # all but its last token loaded
    return f"document {n_doc} tokens, loaded {loaded(err)}"


def test_plain_prompt_gives_the_same_output_with_the_cache():
    """A document (Gemma: longer than its window) then a question: the first run writes the cache, a second
    question loads the document's tokens, the same prompt again loads all but its last token; every run's records
    (greedy on Gemma 3, sampled on SmolLM2) are those without the cache. SmolLM2 and Gemma 3."""
    print("    SmolLM2: " + check_plain(model(), "plain-smollm2.cache"))
    print("    Gemma 3: " + check_plain(gemma(), "plain-gemma.cache"))


def check_system(m: str, name: str) -> str:
    cache = fresh(name)
    n_sys = len(tokenize(m, "-c", "-y", SYSTEM, "-i", "x"))
    errs = []
    for q in ("When did the first station open?", "Which station was the longest?", "When did the first station open?"):
        errs.append(same_with_cache(m, cache, ["-c", "-y", SYSTEM, "-i", q, "-n", "16"], where=f"-c {q!r}"))
    got = loaded(errs[1]) + loaded(errs[2])
    assert got and min(got) >= n_sys - 12, f"loaded {got} tokens of a {n_sys}-token system turn"
    return f"system turn ~{n_sys} tokens, loaded {got}"


def test_chat_wrap_with_a_long_system_prompt_gives_the_same_output():
    """-c -y with a long system prompt, three questions (the third repeats the first): each answer is the answer
    without the cache, and the later ones load the system turn. SmolLM2: the system turn is text to the cache (a
    prefix of ids), whatever the template; Gemma 3's template with a system prompt, loaded from the cache, is checked
    in -m chat and --batch below, past its window (here it would be 473 tokens, inside it)."""
    print("    SmolLM2: " + check_system(model(), "system-smollm2.cache"))


def check_chat(m: str, name: str) -> str:
    base = ["-m", "chat", "-y", SYSTEM, "-n", "24"]
    first, other = b"When did the first station open?\nAnd the last one?\n", \
        b"When did the first station open?\nWhich one was the longest?\nThank you.\n"
    counts = {}
    for mode in modes(m):
        cache = fresh(name)
        for label, msgs in (("writes", first), ("the same again", first), ("another second message", other)):
            want = without_cache([m, *base, *mode], stdin=msgs)
            p = engine([m, *base, *mode, "--prompt-cache", cache, "-v"], stdin=msgs)
            assert p.stdout == want, (f"chat {' '.join(mode)}, {label}: the answers differ with the cache:\n"
                                      f"without: {want[:600]!r}\nwith:    {p.stdout[:600]!r}")
            counts[(mode[1], label)] = loaded(p.stderr)
        assert len(counts[(mode[1], "the same again")]) == 2, f"the same conversation did not load at both turns: {counts}"
        assert len(counts[(mode[1], "another second message")]) == 2, f"the shared part of turn 2 was not loaded: {counts}"
    return f"loaded {counts}"


def test_chat_mode_conversation_gives_the_same_answers():
    """-m chat over stdin (--logprobs 20: greedy on Gemma 3, sampled with a seed on SmolLM2): the cache holds the conversation at
    each turn; the same conversation again loads it at both turns (the first's answer, decoded, included), another
    second message loads the shared part of turn 2. Every answer is the one without the cache. SmolLM2, Gemma 3."""
    print("    SmolLM2: " + check_chat(model(), "chat-smollm2.cache"))
    print("    Gemma 3: " + check_chat(gemma(), "chat-gemma.cache"))


def check_batch(m: str, name: str, system: str = SYSTEM) -> str:
    cache = fresh(name)
    engine([m, "-c", "-y", system, "-i", "Hello.", "-n", "1", "--prompt-cache", cache])  # the system turn, cached
    lines = [json.dumps({"prompt": q, "chat": True, "system": system, "n": 16, "logprobs": 20})
             for q in ("When did the first station open?", "Which station was the longest?", "Name one station.")]
    lines.append(json.dumps({"prompt": "The weather today is", "n": 12, "logprobs": 20}))
    text = ("\n".join(lines) + "\n").encode()
    for mode in (mode[:-2] for mode in modes(m)):  # --logprobs 20 left out: the lines ask for logprobs themselves
        want = engine([m, "--batch", "-", *mode], stdin=text).stdout
        p = engine([m, "--batch", "-", *mode, "--prompt-cache", cache, "--prompt-cache-ro", "-v"], stdin=text)
        without, with_cache = ([{k: v for k, v in json.loads(line).items() if not k.endswith("_ms")}
                                for line in out.decode().splitlines()] for out in (want, p.stdout))
        assert with_cache == without, f"batch {' '.join(mode)}: the records differ with the cache"
        got = loaded(p.stderr)
        assert len(got) >= 3, f"only {len(got)} lines loaded from the cache: {got}"
    return f"loaded {got}"


def test_batch_lines_that_share_the_prefix_start_from_it():
    """--batch: three chat lines with the cached system turn start from it, a plain line does not share it; the
    records (text and logprobs: greedy on Gemma 3, sampled on SmolLM2) are those without the cache. SmolLM2 and Gemma 3, whose
    system turn here is longer than its sliding window (512): batch mode gives a local layer's pages back once
    they leave every window, except with a prompt cache, whose file must hold every position."""
    print("    SmolLM2: " + check_batch(model(), "batch-smollm2.cache"))
    print("    Gemma 3: " + check_batch(gemma(), "batch-gemma.cache", SYSTEM + " " + SYSTEM))


# ------------------------------------------------------------------------------------------------------------
# The file


def test_file_holds_the_prompts_ids_and_exactly_their_kv():
    """The file read by README's layout: the prompt's ids (--tokenize's), the run's identity (model size, --kv,
    --ctx, the model's shape), and a size of header + ids + n x layers x 2 x kv_heads x row bytes of the KV type,
    for every --kv. A later run that loads a prefix and writes its own prompt keeps the loaded rows bit for bit
    (Gemma's sliding-window layers too: every position is stored)."""
    # every --kv on SmolLM2; Gemma 3 (its shape, and its sliding-window layers' rows all stored) with one: the size
    # of a KV type's row is the same rule whatever the model, and each Gemma run prefills 634 tokens. The layout of
    # the other types is checked on the short prompt (16 tokens, not 663: the size rule holds for any n); the last
    # type's file, of the document, is the one a later run loads from below.
    for m, kvs in ((model(), ("f16", "f32", "q8", "q4")), (gemma(), ("q8",))):
        layers, kv_heads, head_dim = model_shape(m)
        for kv in kvs:
            cache = fresh(f"layout-{kv}.cache")
            prompt = DOCUMENT + QUESTIONS[0] if kv == kvs[-1] else SHORT
            engine([m, "-i", prompt, "--kv", kv, "--ctx", "2048", "-n", "1", "--prompt-cache", cache])
            f = read_cache(cache)
            ids = tokenize(m, "-i", prompt)
            row = KV_ROW[kv](head_dim)
            assert f["ids"] == ids, f"{kv}: the file's ids are not the prompt's"
            assert (f["layers"], f["kv_heads"], f["head_dim"], f["row"], f["ctx"]) == (layers, kv_heads, head_dim, row, 2048), f
            assert f["model_size"] == Path(m).stat().st_size and f["version"] == 1 and f["file_version"] == 2, f
            want = HEADER + (4 * len(ids) + 63) // 64 * 64 + len(ids) * layers * 2 * kv_heads * row
            assert f["size"] == want, f"{kv}: {f['size']} bytes, the prompt's K and V take {want} with the header and ids"
        second = DOCUMENT + QUESTIONS[1]
        p = engine([m, "-i", second, "--kv", kvs[-1], "--ctx", "2048", "-n", "1", "--prompt-cache", cache, "-v"])
        assert loaded(p.stderr), "the second question loaded nothing"
        g = read_cache(cache)
        common = 0
        while f["ids"][common] == g["ids"][common]:
            common += 1
        assert common > 300, common
        assert np.array_equal(f["kv"][:, :, :, :common], g["kv"][:, :, :, :common]), "loaded rows changed on the way"
        assert g["ids"] == tokenize(m, "-i", second)
        # every position is stored: the first 100 rows of a long prompt's file are a 120-token prompt's (whose
        # prefill leaves every row in place, even in a ring of Gemma's window + 72 positions)
        short = fresh("layout-short.cache")
        engine([m, "--ids", " ".join(map(str, g["ids"][:120])), "--kv", kvs[-1], "--ctx", "2048", "-n", "1",
                "--prompt-cache", short])
        assert np.array_equal(read_cache(short)["kv"][:, :, :, :100], g["kv"][:, :, :, :100]), \
            "the long prompt's file does not hold its first positions' rows"


def test_n_0_fills_the_cache():
    """-n 0 with --prompt-cache prefills the prompt into the file and prints nothing; a run of the same prompt
    then loads all but its last token."""
    m = model()
    cache = fresh("n0.cache")
    p = engine([m, "-i", DOCUMENT, "-n", "0", "--prompt-cache", cache])
    assert p.stdout == b"" and read_cache(cache)["ids"] == tokenize(m, "-i", DOCUMENT)
    p = engine([m, "-i", DOCUMENT, "-n", "4", "-t", "0", "--prompt-cache", cache, "-v"])
    assert loaded(p.stderr) == [len(tokenize(m, "-i", DOCUMENT)) - 1], p.stderr.decode()


# ------------------------------------------------------------------------------------------------------------
# Caches that cannot be used, paths that are not files, writes that fail


def one_line_error(p: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = p.stderr.decode(errors="replace").splitlines()
    assert p.returncode == code and p.stdout == b"", f"exit {p.returncode} (want {code}), stdout {p.stdout[:80]!r}: {lines}"
    assert lines and lines[0].startswith("run: ") and all(w in lines[0] for w in words), f"want {words} in {lines}"
    assert len(lines) == 1, lines
    return lines[0]


def made_for(m: str, args: list, name: str, prompt: str = SHORT) -> Path:
    cache = fresh(name)
    engine([m, "-i", prompt, "-n", "1", *args, "--prompt-cache", cache])
    return cache


def check_unusable(m: str, cache: Path, *words: str) -> None:
    """cache cannot serve `./run m -i SHORT`: read-only it is refused naming why (exit 1, the file unchanged);
    otherwise ignored with a -v line, the output the uncached one, and the file replaced by this run's."""
    args = ["-i", SHORT, "-t", "0", "-n", "8"]
    before = cache.read_bytes()
    one_line_error(run([m, *args, "--prompt-cache", cache, "--prompt-cache-ro"]), 1, "--prompt-cache-ro", str(cache), *words)
    assert cache.read_bytes() == before, "--prompt-cache-ro changed the file"
    want = engine([m, *args]).stdout
    p = engine([m, *args, "--prompt-cache", cache, "-v"])
    notes = [ln for ln in p.stderr.decode().splitlines() if "ignored" in ln]
    assert p.stdout == want and not loaded(p.stderr), "an unusable cache changed the output or was loaded"
    assert notes and all(w in notes[0] for w in words), f"-v: {notes}"
    assert read_cache(cache)["ids"] == tokenize(m, "-i", SHORT), "the unusable file was not replaced by this run's"


def other_weights(m: str) -> Path:
    """The model file with other weights in the same shapes, as a fine-tune would be: the lowest bit of one byte of
    every 4 KiB of its tensor data flipped (header, tokenizer and tensor table unchanged)."""
    out = WORK / "other-weights.bin"
    data = bytearray(Path(m).read_bytes())
    table, n_tensors = struct.unpack_from("<Q", data, 88)[0], struct.unpack_from("<I", data, 68)[0]
    start = (table + 80 * n_tensors + 63) // 64 * 64
    view = np.frombuffer(data, np.uint8)
    view[start + 8::4096] ^= 1
    out.write_bytes(data)
    return out


def test_a_cache_for_another_model_kv_or_context_is_ignored_or_refused():
    """A cache made with another model file (Gemma's for SmolLM2, and SmolLM2's file with other weights in the same
    shapes), another --kv, another --ctx, another kernel set: ignored with -v (and replaced), refused with
    --prompt-cache-ro."""
    m = model()
    check_unusable(m, made_for(gemma(), [], "other-model.cache"), "another model file")
    check_unusable(m, made_for(str(other_weights(m)), [], "other-weights.cache"), "another model file")
    check_unusable(m, made_for(m, ["--kv", "q8"], "other-kv.cache"), "--kv q8", "--kv f16")
    check_unusable(m, made_for(m, ["--ctx", "1024"], "other-ctx.cache"), "--ctx 1024")
    other = "avx2" if os.environ.get(KERNELS_ENV) == "scalar" else "scalar"   # not the set a forced run uses
    check_unusable(m, made_for(m, ["--kernels", other], "other-kernels.cache"), f"{other} kernel set")


def test_a_damaged_or_truncated_cache_is_ignored_or_refused():
    """Truncated (to nothing, inside the header, the ids, the K and V, one byte short), one byte too long, a
    flipped byte in the header, the ids and the K and V rows, a token count past the context: never loaded."""
    m = model()
    good = made_for(m, [], "good.cache").read_bytes()
    f = read_cache(WORK / "good.cache")
    kv_at = f["size"] - f["kv"].nbytes
    damaged = {"empty": b"", "inside the header": good[:100], "inside the ids": good[:HEADER + 20],
               "inside the rows": good[:kv_at + 5000], "one byte short": good[:-1], "one byte long": good + b"\0"}
    for at in (30, HEADER + 8, kv_at + 7, len(good) - 3):
        damaged[f"flipped at {at}"] = good[:at] + bytes([good[at] ^ 0x10]) + good[at + 1:]
    for what, data in damaged.items():
        cache = WORK / "damaged.cache"
        cache.write_bytes(data)
        words = ("checksum",) if what.startswith("flipped") else ()
        check_unusable(m, cache, *words)


def test_paths_that_are_not_regular_files_are_errors():
    """A directory, a FIFO (never opened for reading: it would hang), a device, and without -ro a symlink (the new
    file would replace the link): exit 1, one line, nothing generated, nothing created."""
    m = model()
    d = WORK / "a-directory"
    d.mkdir(exist_ok=True)
    fifo = WORK / "a-fifo"
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    link = WORK / "a-link.cache"
    link.unlink(missing_ok=True)
    link.symlink_to(made_for(m, [], "link-target.cache"))
    for path, ro in ((d, False), (d, True), (fifo, False), (fifo, True), (Path("/dev/null"), False), (link, False)):
        extra = ["--prompt-cache-ro"] if ro else []
        p = run([m, "-i", "hi", "-n", "4", "--prompt-cache", path, *extra], timeout=60)
        one_line_error(p, 1, str(path), "not a regular file")
    assert not list(WORK.glob("*.tmp-*")), "a temporary file was left"
    p = engine([m, "-i", SHORT + " the year", "-n", "4", "-t", "0", "--prompt-cache", link, "--prompt-cache-ro", "-v"])
    assert loaded(p.stderr), "--prompt-cache-ro did not read through the symlink"


def test_missing_file_read_only_and_usage_errors():
    """--prompt-cache-ro of a missing file: exit 1. --prompt-cache-ro alone, or --prompt-cache with --ppl,
    --dump-logits or --tokenize: exit 2. Read-only never writes, even when the prompt is not in the file."""
    m = model()
    one_line_error(run([m, "-i", "hi", "--prompt-cache", WORK / "missing.cache", "--prompt-cache-ro"]), 1,
                   "missing.cache", "No such file")
    assert not (WORK / "missing.cache").exists()
    for extra in (["-i", "hi", "--prompt-cache-ro"], ["--ppl", "README.md", "--prompt-cache", "x.cache"],
                  ["-i", "hi", "--dump-logits", WORK / "l.f32", "--prompt-cache", "x.cache"],
                  ["-i", "hi", "--tokenize", "--prompt-cache", "x.cache"]):
        one_line_error(run([m, *extra]), 2, "--prompt-cache")
    cache = made_for(m, [], "ro.cache")
    before = cache.read_bytes()
    engine([m, "-i", "Something else entirely", "-n", "4", "--prompt-cache", cache, "--prompt-cache-ro"])
    assert cache.read_bytes() == before


def as_nobody() -> None:
    os.setgid(65534)
    os.setuid(65534)


def test_failed_writes_leave_no_partial_file_and_the_answer_goes_on():
    """An unwritable directory (a directory of mode 555, entered as an unprivileged user when the tests run as
    root), a missing directory, and a full disk (a file-size limit of 64 KiB, EFBIG as ENOSPC would be): one
    warning line, the answer printed as without the cache, exit 0, no file and no temporary file. The short prompt's
    file (about 16 tokens of 23 KB of f16 K and V each) is still five times the limit: the write fails part way."""
    import resource
    m = model()
    want = engine([m, "-i", SHORT, "-t", "0", "-n", "8"]).stdout
    locked = WORK / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o555)
    os.chmod(WORK, 0o755)
    cases = [(locked / "x.cache", as_nobody if os.geteuid() == 0 else None, "Permission denied"),
             (WORK / "no-such-dir" / "x.cache", None, "No such file or directory"),
             (WORK / "full.cache", lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)), "File too large")]
    (WORK / "full.cache").unlink(missing_ok=True)
    for path, pre, why in cases:
        p = subprocess.run([str(RUN), m, "-i", SHORT, "-t", "0", "-n", "8", "--prompt-cache", str(path)],
                           capture_output=True, timeout=300, preexec_fn=pre)
        lines = p.stderr.decode().splitlines()
        assert p.returncode == 0 and p.stdout == want, f"{path}: exit {p.returncode}, {lines}"
        assert len(lines) == 1 and lines[0].startswith("run: warning: cannot write the prompt cache") and why in lines[0], lines
        assert not path.exists(), f"{path} was written"
        if path.parent.exists():
            assert not list(path.parent.glob("*.tmp-*")), f"a temporary file was left in {path.parent}"
    locked.chmod(0o755)


def watch_write(cmd: list, cache: Path, sig: int | None) -> tuple[set[int], bool]:
    """Runs cmd, watching cache's size every millisecond; with sig, sends it as soon as a temporary file appears
    next to cache (the write under way). Returns the sizes seen and whether the signal was sent."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sizes, sent = set(), False
    while p.poll() is None:
        if cache.exists():
            sizes.add(cache.stat().st_size)
        if sig and not sent and list(cache.parent.glob(cache.name + ".tmp-*")):
            p.send_signal(sig)
            sent = True
        time.sleep(0.001)
    if cache.exists():
        sizes.add(cache.stat().st_size)
    return sizes, sent


def test_signals_never_leave_a_partial_file():
    """Over a run that replaces a small cache with a 22 MB one (SmolLM2, a 480-token prompt, --kv f32: twice the
    bytes per token of f16 for half the prefill), the file is only ever the old one or the new one, whole (its size
    watched every millisecond). SIGTERM, SIGINT and SIGHUP sent while the temporary file exists (the write under
    way) leave the old file as it was and no temporary file."""
    m = model()
    cache = made_for(m, ["--kv", "f32"], "signals.cache")
    old = cache.read_bytes()
    cmd = [str(RUN), m, "-i", DOCUMENT, "--kv", "f32", "-n", "2", "--prompt-cache", str(cache)]
    sizes, _ = watch_write(cmd, cache, None)
    new = cache.stat().st_size
    assert sizes <= {len(old), new} and new > 10 * len(old), f"sizes seen {sorted(sizes)}: old {len(old)}, new {new}"
    engine([m, "-i", DOCUMENT, "--kv", "f32", "-n", "1", "--prompt-cache", cache, "--prompt-cache-ro"])  # it loads
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        cache.write_bytes(old)
        sizes, sent = watch_write(cmd, cache, sig)
        assert sent, f"the write of {new} bytes was never seen under way: no {sig.name} sent"
        assert cache.read_bytes() == old, f"{sig.name} during the write changed the old file"
        assert not list(WORK.glob("signals.cache.tmp-*")), f"{sig.name} during the write left a temporary file"


def test_readme_prompt_cache_examples_run():
    """The commands of README "Prompt cache" run verbatim (bash, pipefail) where ./run, models/ and README.md are: the first
    answers and writes readme.cache, the second loads all but a few tokens of the first's prompt and prints that
    -v line."""
    import tempfile
    from test_cli import readme_commands
    model()
    commands = readme_commands(Path(__file__).resolve().parent.parent / "README.md", ("Prompt cache",))["Prompt cache"]
    assert len(commands) == 3, commands
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        (Path(tmp) / "run").symlink_to(RUN.resolve())
        (Path(tmp) / "models").symlink_to(DEFAULT_MODEL.parent.resolve())
        (Path(tmp) / "README.md").symlink_to(Path(__file__).resolve().parent.parent / "README.md")
        script = "\n".join(commands)
        p = subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=tmp, stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=600)
        assert p.returncode == 0 and not p.stderr, f"exit {p.returncode}: {p.stderr[-500:]!r}"
        assert (Path(tmp) / "readme.cache").exists()
        m = re.search(rb"prompt cache: (\d+) of the prompt's (\d+) tokens loaded", p.stdout)
        assert m and int(m.group(2)) - int(m.group(1)) < 20, f"the second command printed {p.stdout[-400:]!r}"


# ------------------------------------------------------------------------------------------------------------
# A file that changes during the run, and paths that must not be replaced (issue 35)


def fed_line_by_line(args: list, lines: list[bytes], between) -> tuple[bytes, int, str]:
    """Runs ./run ARGS with stdin a pipe fed one line at a time: after each line but the last it reads one line of
    stdout (that line's answer or record: no timing involved) and calls between(). Returns stdout, the exit status
    (negative: the signal that ended it) and stderr."""
    err_path = WORK / "fed.stderr"
    with open(err_path, "wb") as err:
        p = subprocess.Popen([str(RUN), *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        watchdog = threading.Timer(600, p.kill)
        watchdog.start()
        out = b""
        try:
            for i, line in enumerate(lines):
                p.stdin.write(line)
                p.stdin.flush()
                if i + 1 < len(lines):
                    out += p.stdout.readline()
                    between()
            p.stdin.close()
        except BrokenPipeError:
            pass  # it ended early: its status says how
        out += p.stdout.read()
        status = p.wait()
        watchdog.cancel()
    return out, status, err_path.read_text(errors="replace")


def records(out: bytes) -> list[dict]:
    """Batch records without their timings."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_ms")} for line in out.decode().splitlines()]


def check_fed(m: str, args: list, lines: list[bytes], between, what: str) -> None:
    """The run fed line by line (between() after each line's output) gives the output without the cache."""
    want = engine([m, *args], stdin=b"".join(lines)).stdout
    for ro in ([], ["--prompt-cache-ro"]):
        prepare = between.prepare()
        out, status, err = fed_line_by_line([m, *args, "--prompt-cache", prepare, *ro], lines, between)
        label = f"{what}{' with --prompt-cache-ro' if ro else ''}"
        assert status == 0, f"{label}: exit {status} ({'signal ' + signal.Signals(-status).name if status < 0 else err[-400:]})"
        same = records(out) == records(want) if "--batch" in args else out == want
        assert same, f"{label}: the output differs from the run without the cache:\nwithout: {want[:400]!r}\nwith:    {out[:400]!r}"


class Truncate:
    """Makes a cache that holds the run's first prompt, and cuts it to 4096 bytes when called (between lines)."""
    def __init__(self, m: str, name: str, make: list, stdin: bytes | None = None):
        self.m, self.cache, self.make, self.stdin = m, WORK / name, make, stdin

    def prepare(self) -> Path:
        fresh(self.cache.name)
        engine([self.m, *self.make, "--prompt-cache", self.cache], stdin=self.stdin)
        assert self.cache.stat().st_size > 4096
        return self.cache

    def __call__(self) -> None:
        os.truncate(self.cache, 4096)


def test_a_cache_that_shrinks_during_chat_or_batch_never_ends_the_run():
    """-m chat and --batch, with and without --prompt-cache-ro, the file holding the first turn or line's prompt,
    cut to 4096 bytes after the first answer or record (stdin fed line by line): the run goes on to the end
    (it died of SIGBUS, the later answers and records lost), with the output of the run without the cache."""
    m = model()
    msgs = [b"Hello there\n", b"What is two plus two?\n"]
    chat = ["-m", "chat", "-t", "0", "-n", "8", "--stop", "\n"]  # --stop: each answer exactly one line
    check_fed(m, chat, msgs, Truncate(m, "shrinks-chat.cache", chat, b"".join(msgs)), "-m chat")
    lines = [json.dumps({"prompt": p, "n": 6}).encode() + b"\n" for p in (SHORT, SHORT + " 1870, and")]
    batch = ["--batch", "-", "-t", "0"]
    check_fed(m, batch, lines, Truncate(m, "shrinks-batch.cache", ["-i", SHORT, "-n", "1"]), "--batch")


class RewriteInPlace:
    """Makes a cache of SHORT (the first line's prompt), and when called writes another prompt's cache (the second
    line's prefix, more tokens) over its bytes in the same file: another header, ids and K and V."""
    OTHER = DOCUMENT[:200]

    def __init__(self, m: str):
        self.m, self.cache = m, WORK / "rewritten.cache"
        other = made_for(m, [], "rewritten-other.cache", self.OTHER)
        self.other = other.read_bytes()

    def prepare(self) -> Path:
        return made_for(self.m, [], self.cache.name)

    def __call__(self) -> None:
        with open(self.cache, "r+b") as f:
            f.write(self.other)
            f.truncate()


def test_a_cache_rewritten_in_place_between_batch_lines_never_changes_the_answers():
    """--batch with and without --prompt-cache-ro: the file holds the first line's prompt; after its record another
    prompt's cache is written over the file's bytes, and the second line begins with that other prompt. Its
    record is the one without the cache (it was garbage, exit 0: the old header's count and offsets read with the
    new file's ids and K and V)."""
    m = model()
    rewrite = RewriteInPlace(m)
    lines = [json.dumps({"prompt": p, "n": 8}).encode() + b"\n" for p in (SHORT, rewrite.OTHER + " In short,")]
    check_fed(m, ["--batch", "-", "-t", "0"], lines, rewrite, "--batch, the file rewritten in place")


def test_a_path_that_is_not_a_prompt_cache_is_refused_and_left_as_it_is():
    """--prompt-cache naming a text file, or the model file itself (a copy here: the engine before the fix replaced
    it), is refused before any work: exit 1, one line naming the path and why, the file byte-identical; with
    --prompt-cache-ro the model file is refused too. An empty file, or one that begins with the cache's magic
    however damaged, is still a cache to replace (test_a_damaged_or_truncated_cache_is_ignored_or_refused)."""
    m = model()
    notes = WORK / "notes.txt"
    notes.write_bytes(b"my notes: do not overwrite\n")
    one_line_error(run([m, "-i", "hi", "-n", "4", "--prompt-cache", notes]), 1, str(notes), "not a prompt cache")
    assert notes.read_bytes() == b"my notes: do not overwrite\n", "the text file was changed"
    copy = WORK / "model-copy.bin"
    shutil.copyfile(m, copy)
    before = copy.read_bytes()
    for ro in ([], ["--prompt-cache-ro"]):
        one_line_error(run([copy, "-i", "hi", "-n", "4", "--prompt-cache", copy, *ro]), 1, str(copy), "the model file")
        assert copy.read_bytes() == before, f"the model file was changed {ro}"
    assert not list(WORK.glob("*.tmp-*")), "a temporary file was left"


def test_empty_and_too_long_cache_names_are_errors_before_any_work():
    """--prompt-cache "" is a usage error (exit 2; it was a warning, exit 0). A name whose temporary name (the
    name + ".tmp-PID") is longer than a file name can be (255 bytes), or a path longer than the engine holds (4199),
    is an error before any work (exit 1, nothing generated): it was a warning after the answer."""
    m = model()
    one_line_error(run([m, "-i", "hi", "-n", "4", "--prompt-cache", ""]), 2, "--prompt-cache", "file name")
    long_name = WORK / ("c" * 250)
    one_line_error(run([m, "-i", "hi", "-n", "4", "--prompt-cache", long_name]), 1, "name too long", "255")
    long_path = WORK / "/".join(["d" * 200] * 22) / "x.cache"
    one_line_error(run([m, "-i", "hi", "-n", "4", "--prompt-cache", long_path]), 1, "name too long", "temporary name")
    assert not long_name.exists()


def test_a_text_file_put_in_the_caches_place_during_chat_is_left_as_it_is():
    """-m chat whose cache holds only the first turn: after the first answer the file is replaced by a text file, so
    the second turn's conversation (not held) would be written there. The text file stays byte-identical, one warning
    line says why, and the answers are those without the cache (the text was replaced)."""
    m = model()
    msgs = [b"Hello there\n", b"What is two plus two?\n"]
    chat = ["-m", "chat", "-t", "0", "-n", "8", "--stop", "\n"]
    cache = fresh("replaced-by-text.cache")
    engine([m, *chat, "--prompt-cache", cache], stdin=msgs[0])
    text = b"my notes: do not overwrite\n"

    def put_text() -> None:
        cache.unlink()
        cache.write_bytes(text)
    out, status, err = fed_line_by_line([m, *chat, "--prompt-cache", cache], msgs, put_text)
    assert status == 0 and out == engine([m, *chat], stdin=b"".join(msgs)).stdout, f"exit {status}: {out!r} {err}"
    assert cache.read_bytes() == text, "the text file put in the cache's place was replaced"
    lines = err.splitlines()
    assert len(lines) == 1 and "not a prompt cache" in lines[0] and str(cache) in lines[0], lines
