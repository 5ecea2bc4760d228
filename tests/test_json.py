"""run.c's JSON reader (json_parse) and string writer (json_put_string) against Python's `json` module.

Python's json is the independent oracle, configured to RFC 8259's strict reading: NaN/Infinity refused
(parse_constant), repeated keys refused (object_pairs_hook), lone surrogates from \\u escapes refused (checked
on the decoded strings), the input decoded as strict UTF-8 first (overlongs, encoded surrogates, > U+10FFFF and
cut-short sequences refused), numbers beyond the double range refused, nesting deeper than run.c's
JSON_MAX_DEPTH (64) refused. Each accepted document must come back from the driver (tests/json_driver.c) as the
canonical text of the value Python read; each refused one as a one-line "at byte N: reason" on stderr. The corpus is a hand-written list with one or more cases per rule, plus
a few thousand generated and mutated documents from a fixed seed. The writer must turn any bytes into JSON that
Python reads back as the bytes decoded with errors="replace", escaped as json.dumps escapes them.
"""
from __future__ import annotations

import json
import math
import random
import re
import subprocess

from common import ROOT, SANITIZE, SCRATCH, build_driver

MAX_DEPTH = 64  # run.c's JSON_MAX_DEPTH (the nesting the reader takes; a documented limit, not a computed value)
SEED = 20261130


# ----- the driver -------------------------------------------------------------------

_built: list[str] = []


# common.SANITIZE at -O0, without the SIMD kernel sets (SCALAR_SET_ONLY): the driver includes the whole of run.c,
# whose instrumented -O1 build with every set takes about 140 s of one core, at -O0 60 s, and at -O0 with the
# scalar set only 4 s; the driver then reads a few thousand small documents and runs no kernel, where -O1's speed
# of execution buys nothing. -O0 instruments every access -O1 does (and the ones -O1 optimizes away).
SANITIZE_O0 = ("-O0", *(f for f in SANITIZE if not f.startswith("-O")), "-DSCALAR_SET_ONLY")


def _driver() -> str:
    """Built once per session, with ASan/UBSan: a read out of bounds fails the test, not only a wrong answer."""
    if _built:
        return _built[0]
    exe = build_driver("json_driver.c", SANITIZE_O0)
    _built.append(str(exe))
    return str(exe)


def driver_many(docs: list[bytes], string_mode: bool = False) -> list[tuple[int, bytes]]:
    """Each input through the driver in one run (its --frames mode): (status, output or error text)."""
    frames = b"".join(b"%d\n" % len(d) + d for d in docs)
    args = [_driver(), "--frames"] + (["--string"] if string_mode else [])
    r = subprocess.run(args, input=frames, capture_output=True, timeout=600)
    assert r.returncode == 0 and not r.stderr, f"driver failed ({r.returncode}): {r.stderr[-3000:]!r}"
    out, at = [], 0
    while at < len(r.stdout):
        head_end = r.stdout.index(b"\n", at)
        rc, n = map(int, r.stdout[at:head_end].split())
        out.append((rc, r.stdout[head_end + 1: head_end + 1 + n]))
        at = head_end + 1 + n + 1
    assert len(out) == len(docs), f"driver answered {len(out)} of {len(docs)} inputs"
    return out


# ----- the oracle -------------------------------------------------------------------

class Obj(list):
    """An object's members as (key, value) pairs in document order."""


def _pairs(pairs: list) -> Obj:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return Obj(pairs)


def _constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _walk(v, depth: int = 0) -> int:
    """Checks strings for lone surrogates and numbers for the double range; returns the nesting depth."""
    if isinstance(v, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in v):
            raise ValueError("lone surrogate")
        return depth
    if isinstance(v, float):
        if math.isinf(v):
            raise ValueError("out of double range")
        return depth
    if isinstance(v, Obj):
        return max([_walk(k) or 0 for k, _ in v] + [_walk(x, depth + 1) for _, x in v] + [depth + 1])
    if isinstance(v, list):
        return max([_walk(x, depth + 1) for x in v] + [depth + 1])
    return depth


def number_text(x: float) -> str:
    """The canonical form of a number: integers below 2^53 as digits, else %.17g (round-trips a double)."""
    return "%.0f" % x if x == math.floor(x) and abs(x) < 2 ** 53 else "%.17g" % x


def canonical(v) -> str:
    if v is None:
        return "null"
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, float):
        return number_text(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, Obj):
        return "{" + ",".join(canonical(k) + ":" + canonical(x) for k, x in v) + "}"
    return "[" + ",".join(canonical(x) for x in v) + "]"


def oracle(doc: bytes) -> bytes | None:
    """The canonical text of doc read strictly by Python's json, or None when it must be refused."""
    try:
        text = doc.decode("utf-8")  # strict: overlongs, encoded surrogates, > U+10FFFF, cut short
        v = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant, parse_int=float)
        if _walk(v) > MAX_DEPTH:
            return None
    except (ValueError, RecursionError):
        return None
    return canonical(v).encode("utf-8")


ERROR_LINE = re.compile(rb"^at byte (\d+): [^\n\r\x00-\x1f]+$")


def disagreements(docs: list[bytes]) -> list[str]:
    problems = []
    for doc, (rc, out) in zip(docs, driver_many(docs)):
        want = oracle(doc)
        if want is None:
            m = ERROR_LINE.match(out)
            if rc != 1:
                problems.append(f"{doc[:80]!r}: accepted as {out[:80]!r}, Python refuses it")
            elif not m or int(m.group(1)) > len(doc):
                problems.append(f"{doc[:80]!r}: error is not one 'at byte N: reason' line within the input: {out!r}")
        elif rc != 0:
            problems.append(f"{doc[:80]!r}: refused ({out.decode(errors='replace')}), Python reads {want[:80]!r}")
        elif out != want:
            problems.append(f"{doc[:80]!r}: read as {out[:120]!r}, Python as {want[:120]!r}")
    return problems


# ----- the hand-written corpus: (document, valid?) with the rule each shows -----------------

VALID = [
    b"0", b"-0", b"1.5e+10", b"-1E-5", b"0.0", b"1e0", b"123456789012345678901234567890",
    b"1e-400",  # below the double range: 0
    b"1.7976931348623157e308", b"4.9e-324", b"9007199254740993", b"0.1", b"-2.5E3",
    b'""', b'"\\u00e9\\u00E9"', b'"\\ud83d\\ude00"', b'"\\uDBFF\\uDFFF"', b'"\\u0000"',
    b'" \\" \\\\ \\/ \\b \\f \\n \\r \\t"', b'"\x7f"', '"é 😀 中"'.encode(), b'"\xf4\x8f\xbf\xbf"',
    b"[]", b"{}", b" \t\r\n[1, 2 ]\n", b'{"a":{"b":[null,true,false]}}', b'{"a":1,"A":1}', b'{"":1}',
    b'{"a\\u0000":1,"a":2}', b'{"a":1,"b":2,"c":{"a":3}}', b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
    b'{"k":' * (MAX_DEPTH - 1) + b"[1]" + b"}" * (MAX_DEPTH - 1), b"true", b"null", b' "x" ',
]
INVALID = [
    b"", b"   ", b"1 2", b"[1,]", b'{"a":1,}', b"[,1]", b"[1,,2]", b"// c\n1", b"/* c */ 1", b"1 # c",
    b"'a'", b"{'a':1}", b"01", b"-01", b"00", b"+1", b".5", b"1.", b"1e", b"1e+", b"-", b"1.e5", b"0x10",
    b"NaN", b"Infinity", b"-Infinity", b"nan", b"[NaN]", b"True", b"tru", b"nul", b"[1 2]", b'{"a" 1}',
    b"{a:1}", b"{1:1}", b'"abc', b"[", b'{"a":1', b'"\\', b"\\u0041",
    b'"\x01"', b'"\t"', b'"\n"', b'"\x00"', b'"\x1f"',  # raw control characters in strings
    b'"\\a"', b'"\\x41"', b"\"\\'\"", b'"\\u12"', b'"\\u12G4"', b'"\\U0041"', b'"\\ "',  # escapes
    b'"\\ud800"', b'"\\udc00"', b'"\\ud800\\u0041"', b'"\\ud800x"', b'"\\udc00\\ud800"', b'{"\\ud800":1}',
    b'"\xc0\xaf"', b'"\xc1\xbf"', b'"\xe0\x80\xaf"', b'"\xf0\x80\x80\xaf"',  # overlong
    b'"\xed\xa0\x80"', b'"\xed\xbf\xbf"',  # surrogates in UTF-8
    b'"\xf4\x90\x80\x80"', b'"\xf5\x80\x80\x80"', b'"\xff"', b'"\xfe"',  # beyond U+10FFFF, never bytes
    b'"\xe2\x82"', b'"\xe2\x82x"', b'"\xf0\x9f\x98"', b'"\x80"', b'"\xc3"',  # cut short, stray continuation
    b'{"a":1,"a":2}', b'{"a":1,"b":{"c":1,"c":2}}', b'{"\\u00e9":1,"\xc3\xa9":2}', b'{"x":1,"y":2,"x":3}',
    b"1e400", b"-1e400", b"1" + b"0" * 400, b"[1e309]",  # beyond the double range
    b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), b'{"k":' * MAX_DEPTH + b"[]" + b"}" * MAX_DEPTH,
    b"[" * 100000 + b"]" * 100000, b"[" * 100000,  # deep: refused, never a stack overflow
    b"1\x00", b"\x00", b"[1,\x002]", b"\x001", b'{"a"\x00:1}',  # NUL outside strings
    b"\xef\xbb\xbf1", b"\x0c1", b"\xc2\xa01", b"1\x0b", b"\xff",  # BOM, other whitespace, stray bytes
]


def test_hand_corpus_oracle_labels():
    """The oracle itself reads the hand-written corpus as labelled (a check of its strict configuration)."""
    wrong = [d[:60] for d in VALID if oracle(d) is None] + [d[:60] for d in INVALID if oracle(d) is not None]
    assert not wrong, f"the oracle disagrees with the corpus labels: {wrong}"


def test_hand_corpus_matches_python():
    problems = disagreements(VALID + INVALID)
    assert not problems, f"{len(problems)} disagreements:\n" + "\n".join(problems[:40])
    print(f"{len(VALID)} valid and {len(INVALID)} invalid hand-written documents agree with Python's json")


# ----- generated documents ----------------------------------------------------------------

WS = [" ", "\t", "\r", "\n"]


def gen_ws(rng: random.Random) -> str:
    return "".join(rng.choice(WS) for _ in range(rng.choice([0, 0, 0, 1, 2])))


def gen_number(rng: random.Random) -> str:
    s = rng.choice(["", "", "-"])
    s += "0" if rng.random() < 0.2 else str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(rng.choice([0, 1, 3, 10, 20, 30])))
    if rng.random() < 0.4:
        s += "." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 25)))
    if rng.random() < 0.3:
        s += rng.choice("eE") + rng.choice(["", "+", "-"]) + str(rng.choice([0, 1, 5, 22, 300, 308, 309, 320, 400]))
    return s


def gen_char(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        return rng.choice("abcxyz ABC019_/-'!~\x7f")
    if r < 0.65:
        return rng.choice(['\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"])
    if r < 0.75:
        return "\\u%04x" % rng.choice([0, 0x1f, 0x41, 0x7f, 0xe9, 0x2028, 0xfffd, rng.randint(0x80, 0xd7ff)])
    if r < 0.8:  # a pair, in either case
        cp = rng.randint(0x10000, 0x10FFFF) - 0x10000
        return ("\\u%04x\\u%04x" if rng.random() < 0.5 else "\\u%04X\\u%04X") % (0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF))
    if r < 0.82:  # a lone surrogate
        return "\\u%04x" % rng.randint(0xD800, 0xDFFF)
    return chr(rng.choice([rng.randint(0x80, 0x7FF), rng.randint(0x800, 0xD7FF), rng.randint(0xE000, 0xFFFF),
                           rng.randint(0x10000, 0x10FFFF)]))


def gen_string(rng: random.Random, keys: list[str] | None = None) -> str:
    if keys and rng.random() < 0.03:  # a repeated key now and then
        return rng.choice(keys)
    s = '"' + "".join(gen_char(rng) for _ in range(rng.choice([0, 1, 2, 5, 12]))) + '"'
    if keys is not None:
        keys.append(s)
    return s


def gen_value(rng: random.Random, depth: int) -> str:
    r = rng.random() if depth < 6 else rng.random() * 0.6
    if r < 0.15:
        return gen_number(rng)
    if r < 0.35:
        return gen_string(rng)
    if r < 0.45:
        return rng.choice(["true", "false", "null"])
    if r < 0.7:
        items = [gen_ws(rng) + gen_value(rng, depth + 1) + gen_ws(rng) for _ in range(rng.randint(0, 5))]
        return "[" + ",".join(items) + gen_ws(rng) + "]"
    keys: list[str] = []
    members = [gen_ws(rng) + gen_string(rng, keys) + gen_ws(rng) + ":" + gen_ws(rng) + gen_value(rng, depth + 1) + gen_ws(rng)
               for _ in range(rng.randint(0, 5))]
    return "{" + ",".join(members) + gen_ws(rng) + "}"


INTERESTING = b'{}[],:"\\ \t\n0123456789eE+-.tfnulr\x00\x01\x1f\x7f\xff\xc3\xa9\xed\xa0\x80\xf4\x90/*\''


def mutate(rng: random.Random, doc: bytes) -> bytes:
    b = bytearray(doc)
    for _ in range(rng.randint(1, 3)):
        op, at = rng.randrange(5), rng.randrange(len(b) + 1)
        if op == 0 and b:
            del b[min(at, len(b) - 1)]
        elif op == 1:
            b[at:at] = bytes([rng.choice(INTERESTING)])
        elif op == 2 and b:
            b[min(at, len(b) - 1)] = rng.choice(INTERESTING)
        elif op == 3:
            b = b[:at]
        else:
            end = min(len(b), at + rng.randint(1, 8))
            b[at:at] = b[at:end]
    return bytes(b)


def generated_corpus(n_valid: int = 2000, n_mutated: int = 3000) -> list[bytes]:
    rng = random.Random(SEED)
    docs = [(gen_ws(rng) + gen_value(rng, 0) + gen_ws(rng)).encode("utf-8", "surrogatepass") for _ in range(n_valid)]
    return docs + [mutate(rng, rng.choice(docs)) for _ in range(n_mutated)]


def test_generated_and_mutated_documents_match_python():
    docs = generated_corpus()
    problems = disagreements(docs)
    accepted = sum(oracle(d) is not None for d in docs)
    assert 0.2 * len(docs) < accepted < 0.8 * len(docs), f"corpus degenerate: {accepted} of {len(docs)} valid"
    assert not problems, f"{len(problems)} of {len(docs)} disagree:\n" + "\n".join(problems[:40])
    print(f"{len(docs)} generated/mutated documents (seed {SEED}, {accepted} valid) agree with Python's json")


# ----- the writer ----------------------------------------------------------------------------

def random_bytes(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.3:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    if r < 0.5:
        return bytes(rng.choice(b'\x00\x01\x08\x09\x0a\x0c\x0d\x1b\x1f "\\/\x7f\x80\xbf\xc0\xc2\xe0\xed\xef\xf0\xf4\xf5\xff')
                     for _ in range(rng.randint(0, 20)))
    text = "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0x7FF), rng.randint(0x800, 0xD7FF),
                                   rng.randint(0xE000, 0xFFFF), rng.randint(0x10000, 0x10FFFF)]))
                   for _ in range(rng.randint(0, 15))).encode()
    if r < 0.75 or not text:
        return text  # valid UTF-8
    cut = rng.randrange(len(text))
    return text[:cut] + text[cut + 1:] if r < 0.9 else text[:cut]  # a byte lost, or cut off mid-character


def test_writer_output_is_json_python_reads_back():
    rng = random.Random(SEED + 1)
    inputs = [bytes(range(256)), b"", b'"\\', b"\x7f", b"\xed\xa0\x80\xf0\x80\xe2\x82A"] + [random_bytes(rng) for _ in range(3000)]
    problems, valid = [], 0
    for data, (rc, out) in zip(inputs, driver_many(inputs, string_mode=True)):
        want = data.decode("utf-8", "replace")
        valid += want.encode() == data
        try:
            got = json.loads(out.decode("utf-8"))  # valid UTF-8, valid JSON, no raw control characters
        except ValueError as e:
            problems.append(f"{data!r}: output {out!r} is not valid: {e}")
            continue
        if rc != 0 or got != want:
            problems.append(f"{data!r}: reads back as {got!r}, not {want!r}")
        elif out != json.dumps(want, ensure_ascii=False).encode():
            problems.append(f"{data!r}: written {out!r}, json.dumps escapes it as {json.dumps(want, ensure_ascii=False)!r}")
    assert 500 < valid < len(inputs) - 500, f"inputs degenerate: {valid} of {len(inputs)} valid UTF-8"
    assert not problems, f"{len(problems)} of {len(inputs)} wrong:\n" + "\n".join(problems[:30])
    print(f"json_put_string: {len(inputs)} byte strings ({valid} valid UTF-8) read back by Python's json")
