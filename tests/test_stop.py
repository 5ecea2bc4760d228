"""Stop strings (./run --stop STR, run.c "stop strings"): the answer ends just before the first
occurrence of any stop string in the generated text, which is never printed.

Expected values come from outside the code under test: the engine runs (greedy -t 0, or seeded, fixed -n)
WITHOUT --stop to give the full text, the stop strings are chosen from that text here, and the
expected output is the full text cut in Python (`expected_cut`: the occurrence that ends first;
of several ending at the same byte, the longest). Token boundaries come from the lengths of the
tokens' bytes (the ids of a --logprobs run, the bytes from the model file's vocabulary), whose concatenation
must be the text the run prints. Every case runs with lookup decoding off (--lookup 0) and on
(--lookup 8, whose accepted drafts may run past a stop string), which must give the same bytes.
"""
from __future__ import annotations

import functools
import json
import os
import random
import re
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, RUN, SCRATCH, model, require, run  # noqa: E402
from test_bad_inputs import expect_error, tiny_model  # noqa: E402

LOOKUPS = ("0", "8")
FRANCE = ["-i", "The capital of France is"]  # greedy: " Paris.\n\nThe United States has ..." repeated
TABLE = ["-c", "-i", "Make a markdown table of three fruits and their colors."]  # "| ---| ---|" rows
CHINESE = ["-c", "-i", "Translate to Chinese: I love my cat."]  # 3-byte characters, many split across tokens
EMOJI = ["-c", "-i", "Write three emoji that describe happiness."]  # a row of 4-byte emoji
COPY = ["-c", "-i", "Repeat the following text exactly, word for word: The old lighthouse keeper climbed the spiral "
        "stairs every evening at dusk, lit the great lamp, and watched the ships pass safely through the narrow "
        "channel between the rocks. In winter the storms were fierce, but the light never failed."]
PRINTF = ["-i", 'In C, printf("Hello, world']  # '!\\n");' (a backslash and an n), then code lines
TURN_RE = re.compile(rb"^turn (\d+): prefill (\d+) new tokens \((\d+) already cached\)$", re.M)


def stop_arg(s: bytes) -> str:
    """s as a --stop argument: backslash, newline and tab escaped; other bytes as they are."""
    return os.fsdecode(s.replace(b"\\", b"\\\\").replace(b"\n", b"\\n").replace(b"\t", b"\\t"))


def generate(args: list[str], stops: list[bytes] = (), lookup: str = "0", stdin: bytes | None = None) -> bytes:
    """stdout of a greedy run (exit 0 required) with the given stop strings."""
    flags = [f for s in stops for f in ("--stop", stop_arg(s))]
    p = run([model(), "-t", "0", "--lookup", lookup, *args, *flags], stdin=stdin)
    assert p.returncode == 0, f"{args} {flags}: exit {p.returncode}: {p.stderr.decode(errors='replace')[-1000:]}"
    return p.stdout


def first_match(text: bytes, stops: list[bytes]) -> tuple[int, int] | None:
    """(start, end) of the stop string occurrence that ends first (ties: the longest), or None."""
    found = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not found:
        return None
    end, neg_len = min(found)
    return end + neg_len, end


def expected_cut(text: bytes, stops: list[bytes]) -> bytes:
    """text up to the first stop string occurrence (first_match); all of it if none occurs."""
    match = first_match(text, stops)
    return text if match is None else text[:match[0]]


CONTROL = 3  # a control token's type in the tokenizer section (llama.cpp's numbering): it prints nothing


@functools.cache
def vocabulary() -> tuple[list[bytes], list[int]]:
    """Each token's bytes and type, from the model file's tokenizer section (export.py's manual, read by
    tests/tokenizer/variants.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "tokenizer"))
    from variants import read_section
    section = read_section(Path(model()).read_bytes())
    return section["texts"], section["types"]


@functools.cache
def boundaries(args: tuple[str, ...], n: int, stdin: bytes | None = None, trailer: int = 0) -> list[int]:
    """Byte offsets where each of the first n generated tokens ends (args without -n), not counting `trailer`
    bytes the mode adds (chat's newline). One greedy run with --logprobs 0 gives the tokens' ids, the vocabulary
    their bytes; their concatenation must be the text the run without --logprobs prints (what -n 1 .. -n n,
    run one by one, would show, in one run instead of n)."""
    texts, types = vocabulary()
    p = run([model(), "-t", "0", "--lookup", "0", "-n", str(n), "--logprobs", "0", *args], stdin=stdin)
    assert p.returncode == 0, f"{args} --logprobs 0: exit {p.returncode}: {p.stderr.decode(errors='replace')[-1000:]}"
    ids = [json.loads(line)["id"] for line in p.stdout.splitlines() if line.strip()]
    pieces = [b"" if types[i] == CONTROL else texts[i] for i in ids]
    ends = [sum(map(len, pieces[:k + 1])) for k in range(len(pieces))]
    ends += [ends[-1] if ends else 0] * (n - len(ends))  # the answer ended before n tokens
    full = generate(["-n", str(n), *args], stdin=stdin)
    assert b"".join(pieces) == full[:len(full) - trailer], f"the tokens' bytes {pieces!r} are not the text {full!r}"
    return ends


def stop_token(ends: list[int], match_end: int) -> int:
    """The 1-based index of the token whose text completes a match ending at byte match_end."""
    return next(k for k, e in enumerate(ends, 1) if e >= match_end)


def check(args: list[str], full: bytes, stops: list[bytes], expected: bytes | None = None) -> None:
    """With lookup off and on, the run with the stops prints the full text cut in Python."""
    want = expected_cut(full, stops)
    assert want != full, f"the stops {stops} do not occur in the text: the case checks nothing\n{full!r}"
    if expected is not None:
        assert want == expected, f"the case was chosen for {expected!r} but the cut gives {want!r}"
    for lookup in LOOKUPS:
        got = generate(args, stops, lookup)
        assert got == want, f"--lookup {lookup}, stops {stops}:\n got  {got!r}\n want {want!r}\n full {full!r}"


def first_at(text: bytes, s: bytes, at: int) -> bool:
    return text.find(s) == at


# ----- where the stop string lies ---------------------------------------------------------------

def test_stop_string_split_across_two_tokens():
    args = ["-n", "30", *FRANCE]
    full = generate(args)
    picks = [b for b in boundaries(tuple(FRANCE), 30)[2:] if b + 3 <= len(full) and first_at(full, full[b - 3:b + 3], b - 3)]
    assert picks, f"no 6-byte substring first occurring across a token boundary in {full!r}"
    for b in picks[:3]:
        check(args, full, [full[b - 3:b + 3]], full[:b - 3])


def test_stop_string_at_the_very_start():
    args = ["-n", "20", *FRANCE]
    full = generate(args)
    check(args, full, [full[:4]], b"")
    check(args, full, [full[:1]], b"")


def test_overlapping_stop_strings():
    """"bc" inside "abcd": "bc" ends first and wins; "cd" and "bcd" end together: the longer wins."""
    args = ["-n", "40", *FRANCE]
    full = generate(args)
    i = next((i for i in range(1, len(full) - 4) if first_at(full, full[i:i + 4], i) and
              first_at(full, full[i + 1:i + 3], i + 1) and first_at(full, full[i + 2:i + 4], i + 2)), None)
    assert i is not None, f"no suitable 4-byte substring in {full!r}"
    check(args, full, [full[i:i + 4], full[i + 1:i + 3]], full[:i + 1])
    check(args, full, [full[i + 2:i + 4], full[i + 1:i + 4]], full[:i + 1])
    check(args, full, [full[i + 1:i + 4], full[i + 2:i + 4]], full[:i + 1])  # order on the command line does not matter


def test_stop_string_whose_prefix_repeats():
    """"aab" in "aaab": after "aa" + "a" the matcher must keep "aa", not start over."""
    args = ["-n", "40", *TABLE]
    full = generate(args)
    j = next((j for j in range(len(full) - 3) if full[j] == full[j + 1] == full[j + 2] != full[j + 3] and
              first_at(full, full[j + 1:j + 4], j + 1)), None)
    assert j is not None, f"no run of three equal bytes in {full!r}"
    check(args, full, [full[j + 1:j + 4]], full[:j + 1])


def test_multibyte_stop_strings():
    """Chinese and emoji text: stop strings of whole characters whose bytes are split across
    tokens, and one that ends inside a character (the text before it then ends in the
    character's first bytes, written as they are)."""
    args = ["-n", "30", *CHINESE]
    full = generate(args)
    inside = [b for b in boundaries(tuple(CHINESE), 30) if b < len(full) and full[b] & 0xC0 == 0x80]
    assert len(inside) >= 2, f"no token boundary inside a character in {full!r}"
    checked = 0
    for b in inside:
        start = b
        while full[start] & 0xC0 == 0x80:
            start -= 1
        whole = full[start:start + 6]  # the character split at b and the next one
        if whole.decode("utf-8", "ignore").encode() == whole and first_at(full, whole, start):
            check(args, full, [whole], full[:start])
            checked += 1
        if checked == 2:
            break
    assert checked, f"no whole-character stop string across a split character in {full!r}"
    # the last byte before a split and the first after it, both inside one character: the text
    # before the stop string ends in that character's first byte
    b = next((b for b in inside if full[b - 1] & 0xC0 == 0x80 and first_at(full, full[b - 1:b + 1], b - 1)), None)
    assert b is not None, f"no split between two continuation bytes in {full!r}"
    check(args, full, [full[b - 1:b + 1]], full[:b - 1])
    emoji_args = ["-n", "30", *EMOJI]
    text = generate(emoji_args)
    first = next(i for i, c in enumerate(text) if c >= 0xF0)
    check(emoji_args, text, [text[first:first + 4]], text[:first])


def test_several_stop_strings_at_once():
    args = ["-n", "40", *FRANCE]
    full = generate(args)
    words = [w for w in full.split() if len(w) >= 4]
    assert len(words) >= 3, full
    absent = [b"zq%d" % k for k in range(14)]
    check(args, full, [words[2], words[0], b"never seen", words[1]])
    check(args, full, [*absent, words[1], words[2]])  # 16, the most that --stop takes
    assert generate(args, absent) == full


def test_escapes():
    """--stop '\\n' stops at the first newline; '\\\\n' at a backslash followed by n; '\\t' is a tab, not 't'."""
    args = ["-n", "30", *PRINTF]
    full = generate(args)
    assert b"\\n" in full and b"\n" in full and full.find(b"\\n") < full.find(b"\n"), f"need \\n then a newline: {full!r}"
    for arg, want in (("\\n", full[:full.find(b"\n")]), ("\\\\n", full[:full.find(b"\\n")])):
        for lookup in LOOKUPS:
            p = run([model(), "-t", "0", "--lookup", lookup, *args, "--stop", arg])
            assert p.returncode == 0 and p.stdout == want, f"--stop {arg!r}: exit {p.returncode}, {p.stdout!r}, want {want!r}"
    # '\t' is a tab, not the letter t: on a text with t's and no tab it cuts nothing
    args_t = ["-n", "30", "-i", "The capital of France is"]
    text = generate(args_t)
    assert b"\t" not in text and b"t" in text, f"need a text with a t and no tab: {text!r}"
    for lookup in LOOKUPS:
        p = run([model(), "-t", "0", "--lookup", lookup, *args_t, "--stop", "\\t"])
        assert p.returncode == 0 and p.stdout == text, f"--stop '\\t': exit {p.returncode}, {p.stdout!r}, want {text!r}"


def test_lookup_drafts_do_not_run_past_a_stop():
    """The answer copies the prompt, so lookup drafts up to 8 tokens and accepts them in one pass; a
    stop string inside such a run must still cut exactly where plain decoding cuts, and generation
    must end at the token that completed it (-v counts the tokens generated), not at the pass's end."""
    args = ["-n", "80", *COPY]
    full = generate(args)
    ends = boundaries(tuple(COPY), 32)
    starts = [k for k in range(60, min(len(full), ends[-1]) - 4, 13) if first_at(full, full[k:k + 4], k)]
    assert len(starts) >= 3, f"too few stop strings to pick from {full!r}"
    for k in starts[:5]:
        s = full[k:k + 4]
        check(args, full, [s], full[:k])
        want = stop_token(ends, k + 4)
        for lookup in LOOKUPS:
            p = run([model(), "-t", "0", "-v", "--lookup", lookup, *args, "--stop", stop_arg(s)])
            n = re.search(rb"^decode: (\d+) tokens", p.stderr, re.M)
            assert n and int(n.group(1)) == want, f"--lookup {lookup}, stop {s!r}: {n and n.group(0)!r}, want {want} tokens"
    p = run([model(), "-t", "0", "-v", "--lookup-fixed", *args])   # drafts planned on fixed costs: a count that timing cannot move
    m = re.search(rb"lookup: (\d+) drafted, (\d+) accepted", p.stderr)
    assert m and int(m.group(2)) >= 20, f"lookup accepted too few drafts to test this: {p.stderr[-500:]!r}"


def test_random_stop_strings_on_random_text():
    """A tiny random-weight model (test_bad_inputs.tiny_model, byte-level vocabulary) writes random
    bytes: invalid UTF-8, broken characters, runs of one token. Stop strings are random pieces of
    that text (1-3 of them, 1-6 bytes, often overlapping, sometimes a piece and its own suffix or
    prefix); sampled text (-s SEED, --lookup 0) and greedy text (lookup off and on) are cut where
    Python cuts them."""
    tiny = tiny_model()
    cases = [(["-t", "1", "-s", str(seed)], seed) for seed in range(40)] + [(["-t", "0"], seed) for seed in range(40, 55)]
    for flags, seed in cases:
        rng = random.Random(seed)
        base = [tiny, "-i", "hi", "-n", "60", *flags]
        full = run([*base, "--lookup", "0"]).stdout
        stops: list[bytes] = []
        count = rng.randint(1, 3)
        while len(stops) < count:
            start = rng.randrange(len(full))
            piece = full[start:start + rng.randint(1, 6)]
            pieces = rng.choice([[piece], [piece], [piece[1:]], [piece[:-1]], [piece[1:], piece]])  # the last: same end
            stops += [p for p in pieces if p and b"\0" not in p]
        want = expected_cut(full, stops)
        for lookup in LOOKUPS if flags[1] == "0" else ("0",):
            p = run([*base, "--lookup", lookup, *[f for st in stops for f in ("--stop", stop_arg(st))]])
            assert p.returncode == 0 and p.stdout == want, \
                f"{flags} --lookup {lookup}, stops {stops}: exit {p.returncode}\n got  {p.stdout!r}\n want {want!r}\n full {full!r}"


def test_gemma_vocabulary():
    """Gemma 3 (SentencePiece, 262k tokens): a stop string ending inside an accented word, and one
    spanning a sentence boundary, in French text."""
    gemma = require(MODELS / "gemma3-270m.bin", "run `make model-gemma`")
    base = [gemma, "-t", "0", "-n", "30", "-i", "Paris est la capitale de la France. Elle est célèbre pour"]
    full = run(base).stdout
    accented = next((i for i, c in enumerate(full) if c >= 0xC0), None)
    assert accented is not None and b". " in full, f"no accented letter or sentence end in {full!r}"
    for stops in ([full[accented - 2:accented + 2]], [full[full.find(b". "):full.find(b". ") + 4]]):
        for lookup in LOOKUPS:
            p = run([*base, "--lookup", lookup, *[f for st in stops for f in ("--stop", stop_arg(st))]])
            assert p.returncode == 0 and p.stdout == expected_cut(full, stops) != full, \
                f"--lookup {lookup}, stops {stops}: {p.stdout!r}, want {expected_cut(full, stops)!r}"


# ----- modes --------------------------------------------------------------------------------------

def test_chat_wrap_prompt():
    args = ["-n", "40", *TABLE]
    full = generate(args)
    check(args, full, [b"Apple"])
    check(args, full, [b"\n"])


def test_chat_mode_per_answer():
    """Each answer is cut on its own (with "\\n" among the stops every answer is one line), and the
    conversation keeps the tokens fed: turn 2 finds in the cache the prompt of turn 1 plus the
    answer's tokens before the one whose text completed the stop string, and prefills the turn's
    closing (<|im_end|> first: the stopping token is left out) and the new user turn."""
    msg = b"What is the capital of France? Answer in two sentences.\n"
    one = generate(["-m", "chat", "-n", "40"], stdin=msg)
    assert one.endswith(b"\n")
    answer = one[:-1]
    words = [w for w in answer.split() if len(w) >= 5]
    assert len(words) >= 3, answer
    stop = words[2]
    stops = [b"\n", stop]
    assert first_match(answer, stops), f"{stops} not in {answer!r}"
    end, want = first_match(answer, stops)[1], expected_cut(answer, stops)
    fed = stop_token(boundaries(("-m", "chat"), 40, msg, 1), end) - 1
    im_end = run([model(), "--tokenize", "--special", "-i", "<|im_end|>"]).stdout.split()
    assert len(im_end) == 1, f"<|im_end|> is not one token: {im_end}"
    for lookup in LOOKUPS:
        flags = [f for s in stops for f in ("--stop", stop_arg(s))]
        p = run([model(), "-m", "chat", "-t", "0", "-n", "40", "--lookup", lookup, "-v", "--print-prompt-ids", *flags],
                stdin=msg * 2)
        assert p.returncode == 0, p.stderr.decode(errors="replace")[-1000:]
        lines = p.stdout.split(b"\n")
        assert len(lines) == 3 and lines[2] == b"", f"--lookup {lookup}: not two one-line answers: {p.stdout!r}"
        assert lines[0] == want, f"--lookup {lookup}: answer 1 {lines[0]!r}, want {want!r}"
        assert stop not in lines[1], f"--lookup {lookup}: answer 2 holds the stop string: {lines[1]!r}"
        turns = [tuple(map(int, m)) for m in TURN_RE.findall(p.stderr)]
        blocks = re.findall(rb"^ids: (.*)$", p.stderr, re.M)
        assert len(turns) == 2 and len(blocks) == 2, p.stderr.decode(errors="replace")
        (_, prompt1, cached1), (_, _, cached2) = turns
        assert cached1 == 0 and cached2 == prompt1 + fed, \
            f"--lookup {lookup}: turn 2 cached {cached2}, want {prompt1} prompt + {fed} answer tokens fed"
        assert blocks[1].split()[0] == im_end[0], f"--lookup {lookup}: turn 2 prefills {blocks[1][:40]!r}, not <|im_end|> first"


def test_streaming_holds_back_only_possible_starts():
    """Every "e" might begin the stop string "e\\x01" and is held for one byte only, so the text
    streams: when the text of the first 64 tokens has reached the pipe, most of the 400-token run
    (--ignore-eos; less than a stdio buffer of text) is still to come. Text that is held, or not
    flushed as it comes, shows up all at once at the end."""
    args = ["-t", "0", "--ignore-eos", *FRANCE]
    ref = run([model(), "-n", "64", *args]).stdout
    assert ref.count(b"e") >= 5, ref
    proc = subprocess.Popen([str(RUN), model(), "-n", "400", *args, "--stop", "e\x01"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    got, early, deadline = b"", None, time.time() + 300
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            chunk = os.read(proc.stdout.fileno(), 1 << 16) if ready else b""
            if ready and not chunk:
                break
            got += chunk
            if early is None and len(got) >= len(ref):
                early = len(got)
    finally:
        proc.kill()
        proc.wait()
    assert got[:len(ref)] == ref, f"streamed {got[:len(ref)]!r}, want {ref!r}"
    assert early is not None and early < len(got) / 2, \
        f"{early} of {len(got)} bytes had arrived when the first {len(ref)} did: the text was not streamed"


# ----- bad input ----------------------------------------------------------------------------------

def test_stop_bad_values():
    m = model()
    expect_error([m, "-i", "hi", "--stop", ""], 2, "--stop", "non-empty")
    expect_error([m, "-i", "hi", "--stop", "a\\qb"], 2, "--stop", "unknown escape '\\q'")
    expect_error([m, "-i", "hi", "--stop", "\\é"], 2, "unknown escape '\\é'")
    expect_error([m, "-i", "hi", "--stop", "ab\\"], 2, "--stop", "lone backslash")
    expect_error([m, "-i", "hi", *[f for k in range(17) for f in ("--stop", f"s{k}")]], 2, "--stop", "16")
    expect_error([m, "-i", "hi", "--stop", "x" * 257], 2, "--stop", "256 bytes")
    expect_error([m, "-i", "hi", "--stop"], 2, "--stop needs a value")
    assert run([m, "-i", "hi", "-n", "1", "--stop", "x" * 256, *[f for k in range(15) for f in ("--stop", f"s{k}")]]).returncode == 0


def test_stop_with_modes_that_generate_nothing():
    m = model()
    expect_error([m, "--ppl", m, "--stop", "x"], 2, "--ppl", "--stop")
    expect_error([m, "-i", "hi", "--tokenize", "--stop", "x"], 2, "--tokenize", "--stop")
    expect_error([m, "-i", "hi", "--dump-logits", str(SCRATCH / "never-written"), "--stop", "x"], 2, "--dump-logits", "--stop")


# ----- README ---------------------------------------------------------------------------------------

def unescape(arg: str) -> bytes:
    """A --stop argument as the README documents it: \\n, \\t and \\\\ are a newline, a tab, a backslash."""
    return re.sub(rb"\\(.)", lambda m: {b"n": b"\n", b"t": b"\t", b"\\": b"\\"}[m.group(1)], os.fsencode(arg))


def test_readme_stop_examples():
    """Each `./run ... --stop ...` command of the README's "Structured output" section runs verbatim
    from the repository's directory and prints what the same command without its --stop flags
    prints, cut in Python before the first stop string."""
    from test_cli import readme_commands
    from common import ROOT
    commands = [c for c in readme_commands(ROOT / "README.md", ("Structured output",)).get("Structured output", [])
                if "--stop" in c and not re.search(r"[|;&<>`$]", c.split("#")[0])]
    assert len(commands) >= 2, f"the README's Structured output section shows no --stop commands: {commands}"
    for cmd in commands:
        argv = shlex.split(cmd, comments=True)
        assert argv[0] == "./run", cmd
        stops = [unescape(v) for f, v in zip(argv, argv[1:]) if f == "--stop"]
        plain = [a for i, a in enumerate(argv) if a != "--stop" and (i == 0 or argv[i - 1] != "--stop")]
        got = subprocess.run([str(RUN), *argv[1:]], cwd=ROOT, capture_output=True, timeout=300)
        full = subprocess.run([str(RUN), *plain[1:]], cwd=ROOT, capture_output=True, timeout=300)
        assert got.returncode == 0 and full.returncode == 0 and got.stderr == b"", f"`{cmd}`: {got.stderr[-500:]!r}"
        assert expected_cut(full.stdout, stops) != full.stdout, f"`{cmd}`: its stop strings do not occur: {full.stdout!r}"
        assert got.stdout == expected_cut(full.stdout, stops), f"`{cmd}` printed {got.stdout!r}"
