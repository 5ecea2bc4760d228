"""--json and --json-schema: the output is exactly one JSON value (matching the schema), by construction.

- The automaton itself (run.c's recognizer, through tests/grammar_driver.c) on thousands of byte strings from a fixed
  seed: prefixes of random valid documents, mutations of them and random byte soup. Its verdict (invalid / prefix /
  complete) must equal an independent reference recognizer's (tests/json_reference.py, written from RFC 8259), and
  every "complete" must parse with Python's json; with a schema, every "complete" must also validate with the
  jsonschema package.
- Sampled runs at -t 1.0 with different seeds, both vocabularies: every output parses with json (and validates with
  jsonschema against its schema), 100 %, with the rate and the run count printed.
- Bad input: an unreadable schema, a schema that is not an object, an unsupported keyword (its path named), --json
  with --json-schema: exit 2 and one line.
- The README's "Structured output" jq pipeline, run verbatim.
"""
from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

from common import ROOT, SCRATCH, model, require, run
from json_reference import MAX_DEPTH, MAX_NUMBER, MAX_WS, classify

SEED = 20261130
GEMMA = ROOT / "models" / "gemma3-270m.bin"


def _driver() -> Path:
    exe = SCRATCH / "grammar_driver"
    cc = subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", f"-I{ROOT}",
                         str(ROOT / "tests/grammar_driver.c"), str(ROOT / "tokenizer.c"), "-o", str(exe), "-lm"],
                        capture_output=True, text=True)
    assert cc.returncode == 0 and not cc.stderr, f"compile failed:\n{cc.stderr}"
    return exe


def _verdicts(exe: Path, strings: list[bytes], schema: Path | None = None) -> list[str]:
    r = subprocess.run([str(exe), *([str(schema)] if schema else [])], input="".join(s.hex() + "\n" for s in strings),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.split()
    assert len(out) == len(strings), (len(out), len(strings))
    return out


# ----- random documents -----------------------------------------------------------------------------------------

def _rand_string(rng: random.Random) -> str:
    pool = ["a", "b", "Z", " ", "\"", "\\", "/", "\n", "\t", "\x01", "\x1f", "\x7f", "é", "ß", "€", "中", "𝄞", "😀",
            "\u2028", "\ufffd", "\U0010ffff", "0", "9"]
    return "".join(rng.choice(pool) for _ in range(rng.randrange(0, 8)))


def _rand_number(rng: random.Random) -> str:
    s = rng.choice(["", "-"]) + rng.choice(["0", str(rng.randrange(1, 10)) + "".join(rng.choice("0123456789")
                                                                                   for _ in range(rng.randrange(0, 6)))])
    if rng.random() < 0.4:
        s += "." + "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 5)))
    if rng.random() < 0.3:
        s += rng.choice("eE") + rng.choice(["", "+", "-"]) + "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 4)))
    return s


def _ws(rng: random.Random) -> str:
    """Whitespace within the bound: at most one line feed."""
    run = "".join(rng.choice(" \t\r") for _ in range(rng.choice([0, 0, 0, 1, 2, 4])))
    at = rng.randrange(len(run) + 1)
    return run[:at] + "\n" + run[at:] if rng.random() < 0.3 else run


def _rand_text(rng: random.Random, depth: int = 0) -> str:
    """A JSON text: random structure, whitespace and string escapes (ensure_ascii writes \\u escapes and surrogate
    pairs); within the documented bounds."""
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 4 else ["str", "num", "lit"])
    if kind == "str":
        return json.dumps(_rand_string(rng), ensure_ascii=rng.random() < 0.5)
    if kind == "num":
        return _rand_number(rng)
    if kind == "lit":
        return rng.choice(["true", "false", "null"])
    n = rng.randrange(0, 4)
    if kind == "arr":
        return "[" + _ws(rng) + ("," + _ws(rng)).join(_rand_text(rng, depth + 1) + _ws(rng) for _ in range(n)) + "]"
    members = [json.dumps(_rand_string(rng), ensure_ascii=rng.random() < 0.5) + _ws(rng) + ":" + _ws(rng)
               + _rand_text(rng, depth + 1) + _ws(rng) for _ in range(n)]
    return "{" + _ws(rng) + ("," + _ws(rng)).join(members) + "}"


INTERESTING = [ord(c) for c in '{}[]:,"\\/ubfnrtlse0123456789+-.eEaAdDcC \t\n\r'] + [0x00, 0x1F, 0x7F, 0x80, 0xBF, 0xC0,
                                                                                    0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0,
                                                                                    0xF4, 0xF5, 0xFF, 0xA0, 0x9F, 0x8F, 0x90]


def _mutate(rng: random.Random, b: bytes) -> bytes:
    b = bytearray(b)
    for _ in range(rng.randrange(1, 4)):
        op, at = rng.randrange(3), rng.randrange(len(b) + 1)
        if op == 0 and at < len(b):
            b[at] = rng.choice(INTERESTING)
        elif op == 1:
            b[at:at] = bytes([rng.choice(INTERESTING)])
        elif at < len(b):
            del b[at]
    return bytes(b)


def _corpus(rng: random.Random) -> tuple[list[bytes], list[bytes]]:
    """(documents, other strings): valid documents, prefixes of them, mutations, byte soup and the bounds' edges."""
    docs = [_rand_text(rng).encode() for _ in range(1500)]
    docs = [d for d in docs if len(d) < 4000]
    strings = []
    for d in docs:
        strings += [d[:rng.randrange(len(d) + 1)] for _ in range(3)]
        strings += [_mutate(rng, d) for _ in range(3)]
    strings += [bytes(rng.choice(INTERESTING) for _ in range(rng.randrange(0, 12))) for _ in range(3000)]
    edges = [b" " * MAX_WS + b"1", b" " * (MAX_WS + 1) + b"1", b"[" + b"\t" * MAX_WS + b"]", b"[" + b"\t" * (MAX_WS + 1),
             b"[\n" + b" " * (MAX_WS - 1) + b"1]", b"[\n\n1]", b"[\r\n\r\n", b"[\n \n", b"[1\n,\n2]", b"\n\n1",
             b"1" * MAX_NUMBER, b"1" * (MAX_NUMBER + 1), b"[" + b"1" * MAX_NUMBER + b"]", b"[" + b"1" * (MAX_NUMBER + 1),
             b"1" * (MAX_NUMBER - 1) + b".", b"1" * (MAX_NUMBER - 2) + b".", b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
             b"[" * (MAX_DEPTH + 1), b"{\"a\":" * MAX_DEPTH, b"{\"a\":" * MAX_DEPTH + b"{", b"", b"1 ", b"{} ", b" {}",
             b'"\\ud83d\\ude00"', b'"\\ud83d"', b'"\\ude00"', b'"\\ud83d\\u0041"', b'"\\uDBFF\\uDFFF"', b'"\xed\xa0\x80"',
             b'"\xf4\x90\x80\x80"', b'"\xc0\xaf"', b'"\xe0\x80\xaf"', b'"\xef\xbf\xbf"', b"-0", b"-01", b"0.0e+0", b"1e",
             b"tru", b"nul", b"truex", b"[true false]", b'{"a" 1}', b'{"a":1,}', b"[1,]", b'"\x7f"', b'"\x1f"']
    return docs, strings + edges


def test_automaton_agrees_with_reference_and_json() -> None:
    exe = _driver()
    rng = random.Random(SEED)
    docs, strings = _corpus(rng)
    allstr = docs + strings
    got = _verdicts(exe, allstr)
    want = [classify(s) for s in allstr]
    counts = {"invalid": 0, "prefix": 0, "complete": 0}
    bad = []
    for s, g, w in zip(allstr, got, want):
        counts[w] += 1
        if g != w:
            bad.append(f"{s!r}: run.c says {g}, the reference {w}")
        if g == "complete":
            try:
                json.loads(s)
            except ValueError as e:
                bad.append(f"{s!r}: run.c says complete, Python's json: {e}")
    for d, g in zip(docs, got):
        if g != "complete":
            bad.append(f"{d!r}: a valid document (within the bounds), run.c says {g}")
    assert not bad, f"{len(bad)} disagreements of {len(allstr)}, first ones:\n" + "\n".join(bad[:10])
    assert min(counts.values()) > 500, f"corpus too one-sided: {counts}"
    print(f"automaton == reference on {len(allstr)} strings ({counts}); every complete one parses with json")


def _mask_counts(exe: Path, model_file: Path, prefixes: list[bytes], schema: Path | None = None) -> list[str]:
    r = subprocess.run([str(exe), "--mask", str(model_file), *([str(schema)] if schema else [])],
                       input="".join(p.hex() + "\n" for p in prefixes), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{model_file.name}: {r.stderr.strip()}"
    out = r.stdout.split()
    assert len(out) == len(prefixes)
    return out


def test_mask_walk_equals_token_by_token() -> None:
    """The trie walk (with its string-text shortcut and the cache) allows exactly the tokens whose own bytes the
    automaton accepts, on both vocabularies, after prefixes of random documents."""
    exe = _driver()
    rng = random.Random(SEED + 1)
    docs = [_rand_text(rng).encode() for _ in range(40)]
    prefixes = [b"", b"\"", b"{\"", b"[\"a"] + [d[:rng.randrange(len(d) + 1)] for d in docs for _ in range(3)]
    for model_file in (Path(model()), require(GEMMA, "run `make model-gemma`")):
        counts = _mask_counts(exe, model_file, prefixes)
        valid = [int(c) for c in counts if c != "invalid"]
        assert len(valid) == len(prefixes), "a prefix of a valid document was refused"
        assert all(c > 0 for c in valid), "a valid prefix with no token allowed"
        print(f"{model_file.name}: walk == token by token after {len(prefixes)} prefixes "
              f"(allowed tokens {min(valid)}..{max(valid)})")
