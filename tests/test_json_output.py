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

import functools
import json
import os
import random
import re
import subprocess
from pathlib import Path

from common import ROOT, SCRATCH, build_driver, model, require, run
from json_reference import MAX_DEPTH, MAX_NUMBER, MAX_WS, classify

SEED = 20261130
GEMMA = ROOT / "models" / "gemma3-270m.bin"


# The driver includes run.c whole; only its JSON code and its sampling loop are under test here, so it is built
# at -O1 with the kernel sets this CPU runs only: 13 s of compiling instead of 30 at -O2 with every set (measured),
# and the same speed where it counts (the sampled runs and the mask walk: CPU time within 5 %, identical output).
DRIVER_FLAGS = ("-O1", "-march=native", "-DNATIVE_SETS_ONLY")


@functools.cache
def _driver() -> Path:
    return build_driver("grammar_driver.c", DRIVER_FLAGS)


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
    """Whitespace within the bound: spaces and tabs around at most one line break."""
    run = "".join(rng.choice(" \t") for _ in range(rng.choice([0, 0, 0, 1, 2, 4])))
    at = rng.randrange(len(run) + 1)
    return run[:at] + rng.choice(["\n", "\r\n"]) + run[at:] if rng.random() < 0.3 else run


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
             b"[\r", b"[\r\r", b"[\r ", b"[\r1", b"[ \r\n 1]", b"[1\r]", b"[1\r\n]", b" " * (MAX_WS - 1) + b"\r",
             b" " * (MAX_WS - 2) + b"\r", b" " * (MAX_WS - 2) + b"\r\n1", b"1\r",
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


# ----- schemas ----------------------------------------------------------------------------------------------------

SCHEMAS = ROOT / "tests" / "data" / "schemas"
SCHEMA_NAMES = ["person", "orders", "enums", "numbers"]
# beyond the sampled ones, for the automaton alone: declared keys among others, type lists, bounds, nesting
EXTRA_SCHEMAS = {
    "open": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "null"}}},
             "required": ["a", "z"]},
    "lists": {"type": ["array", "string", "boolean"], "minItems": 2, "maxItems": 3, "minLength": 2, "maxLength": 3,
              "items": {"type": ["integer", "string"], "maxLength": 1}},
    "any_items": {"type": "array", "items": {}},
    "untyped": {"properties": {"k": {"const": [1, {"x": None}]}}, "minLength": 1},
}


def _gen_instance(rng: random.Random, schema: dict) -> object:
    """A random value the schema allows (an independent generator: it reads the schema, not run.c)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        types = schema.get("type")
        return rng.choice([v for v in schema["enum"] if types is None or _is_type(v, types)])
    types = schema.get("type", ["null", "boolean", "number", "integer", "string", "array", "object"])
    t = rng.choice(types if isinstance(types, list) else [types])
    if t == "null":
        return None
    if t == "boolean":
        return rng.random() < 0.5
    if t == "integer":
        return rng.choice([0, -7, 12345, -0, 10 ** 12])
    if t == "number":
        return rng.choice([0.5, -1e-3, 12, 3.25e10])
    if t == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 6)
        return "".join(rng.choice("aZ é😀\"\\\n") for _ in range(rng.randint(lo, max(lo, hi))))
    if t == "array":
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 3)
        return [_gen_instance(rng, schema.get("items", {"type": "integer"})) for _ in range(rng.randint(lo, hi))]
    props = schema.get("properties", {})
    out = {k: _gen_instance(rng, props.get(k, {"type": "integer"})) for k in schema.get("required", [])}
    for k, sub in props.items():
        if k not in out and rng.random() < 0.5:
            out[k] = _gen_instance(rng, sub)
    if schema.get("additionalProperties", True) and rng.random() < 0.3:
        out["extra"] = rng.choice([1, "x", [None]])
    keys = list(out)
    rng.shuffle(keys)
    return {k: out[k] for k in keys}


def _is_type(v: object, t: str | list) -> bool:
    ts = t if isinstance(t, list) else [t]
    kinds = {"null": v is None, "boolean": isinstance(v, bool), "string": isinstance(v, str),
             "array": isinstance(v, list), "object": isinstance(v, dict),
             "integer": isinstance(v, int) and not isinstance(v, bool),
             "number": isinstance(v, (int, float)) and not isinstance(v, bool)}
    return any(kinds[x] for x in ts)


def _write(rng: random.Random, v: object, schema: dict | None) -> str:
    """v as JSON text with random whitespace; enum/const values and declared keys in their compact canonical form,
    other strings randomly \\u-escaped."""
    compact = json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    if schema is not None and ("enum" in schema or "const" in schema):
        return compact
    if isinstance(v, dict):
        props = (schema or {}).get("properties", {})
        members = []
        for k, x in v.items():
            key = json.dumps(k, ensure_ascii=False) if k in props or k in (schema or {}).get("required", []) else json.dumps(k)
            members.append(key + _ws(rng) + ":" + _ws(rng) + _write(rng, x, props.get(k)))
        return "{" + _ws(rng) + ("," + _ws(rng)).join(m + _ws(rng) for m in members) + "}"
    if isinstance(v, list):
        items = (schema or {}).get("items")
        return "[" + _ws(rng) + ("," + _ws(rng)).join(_write(rng, x, items) + _ws(rng) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=rng.random() < 0.5)
    return compact


def _schema_files() -> dict[str, Path]:
    files = {name: SCHEMAS / f"{name}.json" for name in SCHEMA_NAMES}
    for name, schema in EXTRA_SCHEMAS.items():
        files[name] = SCRATCH / f"schema_{name}.json"
        files[name].write_text(json.dumps(schema))
    return files


def test_schema_automaton_sound() -> None:
    """For every schema: random instances (written with whitespace and escapes) are complete, their prefixes are
    prefixes, and whatever the automaton calls complete among mutations of them parses with json and validates with
    jsonschema."""
    import jsonschema
    exe = _driver()
    rng = random.Random(SEED + 2)
    total = {"complete": 0, "prefix": 0, "invalid": 0}
    for name, path in _schema_files().items():
        schema = json.loads(path.read_text())
        docs = [_write(rng, _gen_instance(rng, schema), schema).encode() for _ in range(300)]
        for d in docs:
            jsonschema.validate(json.loads(d), schema)  # the generator itself is right
        prefixes = [d[:rng.randrange(len(d))] for d in docs]
        mutants = [_mutate(rng, d) for d in docs for _ in range(4)]
        got = _verdicts(exe, docs + prefixes + mutants, path)
        bad = [f"{d!r}: an instance, run.c says {g}" for d, g in zip(docs, got) if g != "complete"]
        bad += [f"{p!r}: a prefix of an instance, run.c says {g}" for p, g in zip(prefixes, got[len(docs):]) if g == "invalid"]
        for m, g in zip(mutants, got[2 * len(docs):]):
            total[g] += 1
            if g == "complete":
                try:
                    jsonschema.validate(json.loads(m), schema)
                except (ValueError, jsonschema.ValidationError) as e:
                    bad.append(f"{m!r}: run.c says complete, but: {str(e).splitlines()[0]}")
        assert not bad, f"schema {name}: {len(bad)} failures, first ones:\n" + "\n".join(bad[:8])
    assert total["complete"] > 100 and total["invalid"] > 100, total
    print(f"{len(_schema_files())} schemas: every instance complete, every prefix a prefix; of the mutations "
          f"{total['complete']} complete (all valid by jsonschema), {total['prefix']} prefixes, {total['invalid']} invalid")


# ----- sampled runs -----------------------------------------------------------------------------------------------

# Sampled runs per vocabulary and schema (seeds 1..RUNS). The verification is 100 of each
# (`make test-json-full`, about an hour on 2 busy cores); `make test` runs 10 of each on SmolLM2 and 5 on Gemma 3
# (7x the cost per token; its 262k-token vocabulary's masks are also checked token by token in
# test_mask_walk_equals_token_by_token) to stay within its time. JSON_RUNS sets both.
RUNS = int(os.environ.get("JSON_RUNS", "10"))
GEMMA_RUNS = int(os.environ.get("JSON_RUNS", "5"))
N_PREDICT = 256  # room for a pretty-printed value (Gemma writes numbers a digit a token); a schema run must finish in it
PROMPTS = {
    None: "Reply with a short JSON object describing a cat.",
    "person": "Describe a person as JSON: name, age, whether they are a member, and maybe a nickname.",
    "orders": "List up to three orders as JSON, each with an id and a few short tags.",
    "enums": "Pick a color, a size, a shape and a label, as JSON.",
    "numbers": "Give a price, a count, a ratio and a few integer scores as JSON.",
}


def _sample(model_file: Path, schema: str | None, runs: int) -> tuple[int, int, list[str]]:
    """`runs` sampled outputs at -t 1.0 (seeds 1..runs) through the generation loop of --json. Returns how many are
    complete and valid, how many were cut short by -n (plain --json only: each must then be a valid prefix, which
    the reference recognizer checks, and the engine must have said so), and the failures."""
    import jsonschema
    path = SCHEMAS / f"{schema}.json" if schema else None
    r = subprocess.run([str(_driver()), "--sample", str(model_file), str(runs), str(N_PREDICT), PROMPTS[schema],
                        *([str(path)] if path else [])], capture_output=True, timeout=3600)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    parts = r.stdout.split(b"\x1e ")
    outputs, flags = parts[0:1] + [p[2:] for p in parts[1:-1]], [p[:1] for p in parts[1:]]
    assert len(outputs) == runs and len(flags) == runs, f"{len(outputs)} outputs"
    schema_doc = json.loads(path.read_text()) if path else None
    failures, cut = [], 0
    for seed, (out, flag) in enumerate(zip(outputs, flags), 1):
        if flag == b"1" and not schema and classify(out) == "prefix":
            cut += 1
            continue
        try:
            value = json.loads(out)
            if schema_doc:
                jsonschema.validate(value, schema_doc)
            assert flag == b"0", "parsed, but the engine called it incomplete"
        except (ValueError, AssertionError, jsonschema.ValidationError) as e:
            failures.append(f"seed {seed}: {str(e).splitlines()[0]}: {out[:200]!r}")
    return runs - cut - len(failures), cut, failures


def _check_sampling(model_file: Path, runs: int) -> None:
    """Every schema's runs: 100 % complete and valid. Plain --json: every output complete and valid, or (a small
    model's free-form object may run on past -n) a valid prefix the engine reported as incomplete; at least half
    complete."""
    import time
    report, failed = [], []
    for schema in PROMPTS:
        t0 = time.time()
        ok, cut, failures = _sample(model_file, schema, runs)
        report.append(f"{schema or '--json'}: {ok}/{runs} complete and valid ({100 * ok / runs:.0f} %"
                      f"{f', {cut} valid prefixes cut by -n' if cut else ''}, {time.time() - t0:.0f} s)")
        failed += [f"{schema or '--json'} {f}" for f in failures]
        if not schema and ok < runs // 2:
            failed.append(f"--json: only {ok} of {runs} values complete within -n {N_PREDICT}")
    print(f"{model_file.name}, -t 1.0, -n {N_PREDICT}: " + "; ".join(report))
    assert not failed, f"{len(failed)} invalid outputs:\n" + "\n".join(failed[:10])


def test_sampled_outputs_valid_smollm2() -> None:
    _check_sampling(Path(model()), RUNS)


def test_sampled_outputs_valid_gemma3() -> None:
    _check_sampling(require(GEMMA, "run `make model-gemma`"), GEMMA_RUNS)


# ----- the command line -------------------------------------------------------------------------------------------

def test_bad_schema_inputs() -> None:
    """Each exit 2 with one line naming the problem (a file that cannot be opened or read exits 1: issue 35's rule
    for every file a flag names, test_cli.test_files_that_cannot_be_read_exit_1)."""
    bad = SCRATCH / "schema_bad"
    bad.mkdir(exist_ok=True)
    (bad / "list.json").write_text("[1, 2]")
    (bad / "minimum.json").write_text('{"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}')
    (bad / "items.json").write_text('{"items": {"properties": {"a b": {"pattern": "x"}}}}')
    (bad / "broken.json").write_text('{"type": ')
    (bad / "bounds.json").write_text('{"minItems": 3, "maxItems": 2}')
    cases = [
        (["--json-schema", bad / "list.json"], "list.json: the schema must be a JSON object"),
        (["--json-schema", bad / "minimum.json"], "minimum.json: $.properties.age.minimum: keyword not supported"),
        (["--json-schema", bad / "items.json"], 'items.json: $.items.properties["a b"].pattern: keyword not supported'),
        (["--json-schema", bad / "broken.json"], "broken.json: not valid JSON: at byte"),
        (["--json-schema", bad / "bounds.json"], "bounds.json: $.minItems: greater than maxItems"),
        (["--json", "--json-schema", SCHEMAS / "person.json"], "--json and --json-schema cannot be used together"),
        (["--json", "--tokenize"], "--json and --tokenize cannot be used together"),
    ]
    for args, want in cases:
        r = run([model(), "-i", "hi", "-n", "4", *args])
        err = r.stderr.decode()
        assert r.returncode == 2, (args, r.returncode, err)
        assert want in err and err.startswith("run: "), (args, err)
        assert len(err.splitlines()) == 1, (args, err)
        assert r.stdout == b"", args
    print(f"{len(cases)} bad inputs: exit 2, one line each")


def test_incomplete_value_exit_1() -> None:
    """-n running out keeps the text on stdout, says so on stderr, exits 1; -n 0 generates nothing, also incomplete."""
    r = run([model(), "-c", "-t", "0", "-n", "3", "--json-schema", SCHEMAS / "person.json", "-i", "Describe a person as JSON."])
    assert r.returncode == 1, r.stderr
    assert r.stderr.decode() == "run: the JSON value is incomplete: generation stopped at -n\n", r.stderr
    assert r.stdout and classify(r.stdout) == "prefix", r.stdout
    r = run([model(), "-c", "-t", "0", "-n", "0", "--json", "-i", "Describe a cat as JSON."])
    assert r.returncode == 1 and b"incomplete" in r.stderr and r.stdout == b"", r
    # the context ends it, not -n (1000): -n cut to what the context holds must not be blamed (it was)
    r = run([model(), "-c", "-t", "0", "--ctx", "64", "-n", "1000", "--json", "-i",
             "Write a JSON array of the numbers from 1 to 100."])
    assert r.returncode == 1 and r.stdout and classify(r.stdout) == "prefix", r
    assert r.stderr.decode() == "run: the JSON value is incomplete: generation stopped at the end of the context\n", r.stderr


def test_json_with_lookup_and_chat() -> None:
    """Greedy output with lookup decoding equals plain decoding's under the mask (a drafted token the mask forbids
    never stands), with both vocabularies; chat mode gives one value per answer."""
    prompt = "List three countries and their capitals as a JSON array of objects."
    for model_file in (model(), str(require(GEMMA, "run `make model-gemma`"))):
        outs = []
        for lookup in ("0", "8"):
            r = run([model_file, "-c", "-t", "0", "-n", "200", "--lookup", lookup, "--json-schema", SCHEMAS / "orders.json",
                     "-i", prompt])
            assert r.returncode == 0, r.stderr
            outs.append(r.stdout)
        assert outs[0] == outs[1], f"{model_file}: lookup changed the greedy output:\n{outs[0]!r}\n{outs[1]!r}"
        json.loads(outs[0])
    r = run([model(), "-m", "chat", "-t", "0", "-n", "120", "--json"], stdin=b"Describe a cat as JSON.\nNow a dog.\n")
    assert r.returncode == 0, r.stderr
    answers = r.stdout.decode().split("\n")
    values = []
    buf = ""
    for line in answers:  # each answer is a value followed by a newline; values may span lines
        buf += line + "\n"
        try:
            values.append(json.loads(buf))
            buf = ""
        except ValueError:
            pass
    assert len(values) == 2 and not buf.strip(), r.stdout


def _readme_pipeline() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Structured output"):]
    section = section[:section.index("\n## ", 1)]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "no sh block in the README's Structured output section"
    return block.group(1)


def test_readme_jq_pipeline() -> None:
    """The README's jq pipeline, verbatim, in a scratch folder that holds ./run and models/."""
    work = SCRATCH / "readme_jq"
    work.mkdir(exist_ok=True)
    for name, target in (("run", ROOT / "run"), ("models", ROOT / "models")):
        link = work / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    script = _readme_pipeline()
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=work, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert re.fullmatch(r"\S.* is -?\d+ years old\n", out), out
    print(f"README pipeline prints: {out.strip()}")


def test_incomplete_value_names_what_ended_it() -> None:
    """Issue 23: a stop string that ends the text before the value is complete is named (the message said
    "-n"); -n running out with a stop string that never matched still says -n. The stop is the one -v reports.
    In chat, one line per incomplete answer names the cause, and one at the end gives the count."""
    person = "Give a JSON object describing a person."
    ask = ["-c", "-t", "0", "-n", "48", "--json", "-i", person]
    r = run([model(), *ask, "--stop", ",", "-v"])
    err = r.stderr.decode()
    assert r.returncode == 1 and "stopped at stop string 1\n" in err, err
    assert "run: the JSON value is incomplete: generation stopped at stop string 1 (',')\n" in err, err
    assert b"," not in r.stdout and classify(r.stdout) == "prefix", r.stdout
    r = run([model(), "-c", "-t", "0", "-n", "5", "--json", "-i", person, "--stop", "zzz"])
    assert r.returncode == 1 and r.stderr.decode() == "run: the JSON value is incomplete: generation stopped at -n\n", r.stderr
    r = run([model(), "-m", "chat", "-t", "0", "-n", "48", "--json", "--stop", ","], stdin=person.encode() + b"\n")
    assert r.returncode == 1 and r.stderr.decode().splitlines() == [
        "run: this answer is not a complete JSON value: generation stopped at stop string 1 (',')",
        "run: 1 answer was not a complete JSON value"], r.stderr
    # the end of the context is named once, by that line (there was also "answer stopped at the context limit")
    r = run([model(), "-m", "chat", "-t", "0", "-n", "200", "--json", "--ctx", "72"], stdin=person.encode() + b"\n")
    assert r.returncode == 1 and r.stderr.decode().splitlines() == [
        "run: this answer is not a complete JSON value: generation stopped at the end of the context",
        "run: 1 answer was not a complete JSON value"], r.stderr


def nested_arrays(levels: int) -> dict:
    """`levels` arrays, each of exactly one item, around an integer."""
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return schema


def test_schema_depth_matches_what_generation_allows() -> None:
    """Issue 23: output may nest 32 arrays, but a schema of 32 nested arrays was refused ("nested deeper than
    32 levels"). 32 now generates a value 32 deep that jsonschema validates; 33 is refused."""
    import jsonschema
    assert MAX_DEPTH == 32, MAX_DEPTH  # the reference recognizer's (independent) bound
    for levels in (32, 33):
        path = SCRATCH / f"deep{levels}.schema.json"
        path.write_text(json.dumps(nested_arrays(levels)))
        r = run([model(), "-t", "0", "-n", "400", "--json-schema", path, "-i", "Numbers:"])
        if levels == 33:
            err = r.stderr.decode()
            assert r.returncode == 2 and err.startswith("run: --json-schema ") and "nested deeper than 32 levels" in err, err
            continue
        assert r.returncode == 0, r.stderr
        value = json.loads(r.stdout)
        jsonschema.validate(value, nested_arrays(levels))
        depth = 0
        while isinstance(value, list):
            value, depth = value[0], depth + 1
        assert depth == 32 and classify(r.stdout) == "complete", r.stdout
    line = json.dumps({"prompt": "Numbers:", "n": 400, "schema": nested_arrays(32)})
    r = run([model(), "--batch", "-", "-t", "0"], stdin=line.encode() + b"\n")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and "json_complete" not in rec, rec
    jsonschema.validate(json.loads(rec["text"]), nested_arrays(32))
