"""Batch mode (./run MODEL --batch FILE): many prompts decoded together, one JSON record per line.

1. Same answers as one at a time: with -t 0 every record's text is byte for byte what `./run -i
   PROMPT` prints for that prompt alone (the expected values: the engine's single-request path,
   which batch mode must not change), for prompts of different lengths (shorter than a KV page,
   several pages, a shared few-shot header), with --parallel 1, 3 and 8, a KV pool so small that
   admission must wait, and on Gemma 3 (sliding-window layers) past its window.
2. Sampling: each record is reproducible from -s and its line number, whatever else is in the
   batch and however many run at once; another seed changes it.
3. Every kind of bad line gets its own error record (with its line number) while the other lines
   run, and the exit status says whether any failed; random lines never crash it.
4. The page pool: a request that can never fit ends with "finish": "context" after the text the
   pool can hold; prompts sharing a header share its pages (less prefill). Gemma 3's sliding-window layers
   give back the pages every query has moved past, so a pool too small for one long sequence's every page
   runs two at once.
5. Ctrl-C: exit 130, the records written are whole JSON lines in input order.
6. Lookup decoding in batch mode leaves every record as it is (greedy: the single runs' texts; sampled:
   the same records with lookup on and off), and its drafts stand on copy prompts.
"""
from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, RUN, SCRATCH, model, require, run  # noqa: E402

WORK = SCRATCH / "batch"
WORK.mkdir(parents=True, exist_ok=True)
GEMMA = MODELS / "gemma3-270m.bin"

# a shared few-shot header of about 250 tokens: every whole KV page (72 positions) of a prompt that ends with one
# more question (about 260 tokens: 3 pages) is the header's, to share. Its prefill is most of these tests' work
# (about 4 ms of CPU a token), hence no longer than that.
HEADER = "Examples:\n" + "".join(f"Q: What is {i} plus {i + 3}?\nA: {2 * i + 3}\n" for i in range(14))
PROMPTS = [
    {"prompt": "The capital of France is", "n": 20},
    {"prompt": "Write a haiku about the sea.", "n": 40, "id": "haiku"},
    {"prompt": HEADER + "Q: What is 50 plus 7?\nA:", "n": 12},
    {"prompt": "Hi", "n": 33},
    {"prompt": HEADER + "Q: What is 61 plus 2?\nA:", "n": 9, "id": 17},
    {"prompt": "List three colors:", "n": 25, "chat": True},
    {"prompt": " ".join(f"word{i}" for i in range(120)) + " Summarize:", "n": 18},
    {"prompt": HEADER + "Q: What is 5 plus 9?\nA:", "n": 15},
    {"prompt": "Once upon a time", "n": 64, "chat": True, "system": "You tell very short stories."},
    {"prompt": "1, 2, 3, 4,", "n": 30},
]


def write_lines(name: str, lines: list) -> Path:
    path = WORK / name
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def batch(path, *extra, model_path=None, stdin: bytes | None = None, timeout: float = 600) -> tuple[int, list[dict], str]:
    r = run([model_path or model(), "--batch", path, *extra], stdin=stdin, timeout=timeout)
    lines = r.stdout.decode().splitlines()
    return r.returncode, [json.loads(line) for line in lines], r.stderr.decode(errors="replace")


@functools.lru_cache(maxsize=None)
def alone(model_path: str, prompt: str, n: int, chat: bool = False, system: str | None = None) -> str:
    """What the engine prints for one prompt on its own (-t 0)."""
    args = [model_path, "-t", "0", "-n", n, "-i", prompt] + (["-c"] if chat else []) + (["-y", system] if system else [])
    r = run(args)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()


def check_identity(records: list[dict], requests: list[dict], model_path: str, default_n: int = 256) -> None:
    assert len(records) == len(requests), f"{len(records)} records for {len(requests)} lines"
    for line, (rec, req) in enumerate(zip(records, requests), 1):
        assert rec["id"] == req.get("id", line), (rec["id"], req.get("id", line))
        want = alone(model_path, req["prompt"], req.get("n", default_n), req.get("chat", False), req.get("system"))
        assert rec["text"] == want, f"line {line}: batch gave {rec['text']!r}, alone {want!r}"
        assert rec["finish"] in ("stop", "length"), rec
        if rec["finish"] == "length":
            assert rec["tokens"] == req.get("n", default_n), rec
        assert 0 <= rec["ttft_ms"] <= rec["total_ms"], rec


def test_greedy_matches_single_requests_at_parallel_1_3_8():
    path = write_lines("identity.jsonl", PROMPTS)
    for b in (1, 3, 8):
        code, recs, err = batch(path, "-t", "0", "--parallel", b)
        assert code == 0, err
        check_identity(recs, PROMPTS, model())


def test_plain_text_lines_and_stdin():
    prompts = ["The capital of France is", "Tell me about the moon.", "def fib(n):"]
    code, recs, err = batch("-", "-t", "0", "-n", "16", "--parallel", "2", stdin="\n".join(prompts).encode() + b"\n")
    assert code == 0, err
    assert [r["id"] for r in recs] == [1, 2, 3]
    for rec, p in zip(recs, prompts):
        assert rec["text"] == alone(model(), p, 16), rec
        ids = run([model(), "--tokenize", "-i", p]).stdout.split()
        assert rec["prompt_tokens"] == len(ids), (rec, len(ids))


def test_tiny_pool_makes_admission_wait_and_changes_nothing():
    path = write_lines("tiny-pool.jsonl", PROMPTS)
    # one page of SmolLM2's f16 cache is ~1.7 MB: 20 MB holds 12 pages; a request with the header needs 4, the
    # 120-word one 4: the lines ask for more than 12 at once (-v: 12 of 12 used at most)
    code, recs, err = batch(path, "-t", "0", "--parallel", "8", "--kv-mem", "20", "-v")
    assert code == 0, err
    check_identity(recs, PROMPTS, model())
    used = re.search(r"KV pages: (\d+) of (\d+)", err)
    assert used and int(used.group(1)) <= int(used.group(2)) <= 12, err


def test_request_larger_than_the_pool_finishes_with_context():
    prompt = "Tell me a long story about a dragon."
    path = write_lines("too-big.jsonl", [{"prompt": prompt, "n": 400}])
    code, recs, err = batch(path, "-t", "0", "--ignore-eos", "--kv-mem", "4")  # 2 pages: 144 positions
    assert code == 0, err
    rec = recs[0]
    assert rec["finish"] == "context", rec
    assert rec["prompt_tokens"] + rec["tokens"] - 1 <= 144, rec
    full = run([model(), "-t", "0", "-n", 400, "--ignore-eos", "-i", prompt]).stdout.decode()
    assert full.startswith(rec["text"]) and len(rec["text"]) < len(full), (rec["text"], full)


def test_shared_header_is_prefilled_once():
    reqs = [{"prompt": HEADER + f"Q: What is {i} plus {i}?\nA:", "n": 4} for i in range(4)]
    path = write_lines("shared.jsonl", reqs)
    code, recs, err = batch(path, "-t", "0", "--parallel", "4", "-v")
    assert code == 0, err
    check_identity(recs, reqs, model())
    prefilled = int(re.search(r"prefill (\d+) tokens", err).group(1))
    total = sum(r["prompt_tokens"] for r in recs)
    # every prompt but the first shares the header's whole pages (72 positions each)
    assert prefilled <= total - 3 * 72 * ((recs[0]["prompt_tokens"] - 1) // 72), (prefilled, total)


def test_prompts_ride_along_in_the_decode_steps():
    """While sequences decode, the prompts waiting to prefill take the rows a decode step leaves (one read of the
    weights serves both) instead of passes of their own: only the first prompt, when nothing decodes yet, has a
    pass to itself. -v's breakdown line counts the prompt rows per step; the texts stay the single runs'."""
    reqs = [{"prompt": f"Tell me one fact about the number {i}.", "n": 24} for i in range(6)]
    path = write_lines("ride.jsonl", reqs)
    code, recs, err = batch(path, "-t", "0", "--parallel", "6", "-v")
    assert code == 0, err
    check_identity(recs, reqs, model())
    m = re.search(r"batch steps: (\d+) of [\d.]+ rows \(and ([\d.]+) prompt rows riding along\)", err)
    assert m, err
    steps, ride = int(m.group(1)), float(m.group(2))
    riders = sum(r["prompt_tokens"] for r in recs[1:])  # every prompt but the first, printed to 0.1 a step
    assert abs(steps * ride - riders) <= 0.05 * steps + 1e-6, (steps, ride, riders, err)


def test_full_steps_are_the_steps_with_every_slot_decoding():
    """-v's line on the steps in which every slot decoded and no prompt rode along (the batch's own speed, which
    make bench sets against prefill). By the schedule the README gives: the first prompt has a pass of its own and
    samples its first token; when the other prompts fit in the rows the first step leaves (64 less one), they all
    ride in it, so every slot decodes from step 2 until the first sequence takes its n-th token in step n - 1:
    n - 2 full steps of `parallel` tokens each (lookup off: one token a sequence a step)."""
    n, par = 20, 5
    reqs = [{"prompt": f"Name a color number {i}.", "n": n} for i in range(par)]
    path = write_lines("full.jsonl", reqs)
    code, recs, err = batch(path, "-t", "0", "--ignore-eos", "--parallel", str(par), "--lookup", "0", "-v")
    assert code == 0, err
    assert sum(r["prompt_tokens"] for r in recs[1:]) <= 63, recs
    m = re.search(r"batch steps with all (\d+) slots decoding and no prompt rows: (\d+), ([\d.]+) ms each, ([\d.]+) tok/s", err)
    assert m, err
    slots, steps, ms, tps = int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4))
    assert (slots, steps) == (par, n - 2), err
    assert abs(tps * ms / 1e3 - par) < 0.01 * par, err  # tokens per full step: one per slot
    # fewer prompts than slots: no step has every slot decoding, and the line is left out
    code, recs, err = batch(path, "-t", "0", "--ignore-eos", "--parallel", str(par + 1), "--lookup", "0", "-v")
    assert code == 0 and "slots decoding" not in err and "batch steps:" in err, err


def test_gemma_sliding_window_past_the_window():
    g = str(require(GEMMA, "run `make model-gemma`"))
    long = "The history of the printing press. " * 60  # ~600 tokens: past Gemma 3's 512-position window
    reqs = [{"prompt": long + "In summary,", "n": 24}, {"prompt": "The three primary colors are", "n": 24},
            {"prompt": long + "The first printer was", "n": 10}]
    path = write_lines("gemma.jsonl", reqs)
    code, recs, err = batch(path, "-t", "0", "--parallel", "3", model_path=g, timeout=900)
    assert code == 0, err
    check_identity(recs, reqs, g)


COPY_LINES = [
    {"prompt": "Repeat the following sentence exactly, word for word: The quick brown fox jumps over the lazy dog near "
               "the old river bank.", "chat": True, "n": 48},
    {"prompt": "Rename the function add to sum in this code and print the whole code:\ndef add(a, b):\n    return a + b"
               "\n\nprint(add(2, 3))\n", "chat": True, "n": 60},
    {"prompt": "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, oranges, figs, dates.",
     "chat": True, "n": 50},
    {"prompt": "Once upon a time", "n": 40},
    {"prompt": HEADER + "Q: What is 50 plus 7?\nA:", "n": 12},
]


def test_lookup_in_batch_gives_the_single_run_texts():
    """Each sequence drafts from its own prompt and output, its verification rows join the step's pass: greedy
    records equal the single runs with lookup off and on, one and three at a time; drafts stand on the copy
    prompts (counted with --lookup-fixed, drafts planned on fixed pass costs: the measured plan's count moves with
    the machine and its load; at least 20 over both runs); the per-token latency percentiles stay reported."""
    path = write_lines("lookup.jsonl", COPY_LINES)
    stood = 0
    for lookup in ("0", "15"):
        for b in ("1", "3"):
            code, recs, err = batch(path, "-t", "0", "--parallel", b, "--lookup", lookup, "--lookup-fixed", "-v")
            assert code == 0, err
            check_identity(recs, COPY_LINES, model())
            lat = re.search(r"per-token latency p50 ([\d.]+) ms, p90 ([\d.]+) ms", err)
            assert lat and 0 < float(lat.group(1)) <= float(lat.group(2)), err
            lk = re.search(r"lookup: (\d+) drafted, (\d+) accepted", err)
            assert not lk if lookup == "0" else True, f"--lookup 0 drafted: {err}"
            if lk:
                stood += int(lk.group(2))
    assert stood > 20, f"only {stood} drafts stood over the copy prompts: lookup hardly ran in batch mode"


def test_sampled_batch_records_do_not_depend_on_lookup():
    reqs = [{"prompt": p["prompt"], "n": 40, "chat": p.get("chat", False)} for p in COPY_LINES]
    path = write_lines("lookup-sampled.jsonl", reqs)
    texts = []
    for lookup in ("0", "15"):
        code, recs, err = batch(path, "-t", "0.8", "-s", "5", "--parallel", "3", "--lookup", lookup)
        assert code == 0, err
        texts.append([r["text"] for r in recs])
    assert texts[0] == texts[1], f"lookup changed sampled records:\n{texts[0]}\n{texts[1]}"


def test_gemma_window_pages_go_back_to_the_pool():
    """Sliding-window reclaim: two ~1,475-token Gemma prompts (21 pages) that share all but their last page, in a
    20-page pool (--kv-mem 27). Without giving back the pages of the 15 local layers that every query has moved past,
    one sequence alone would not fit (it would end at the pool's end); with it, both run at once, the second holding
    the first's prefix, also its local pages its first queries see, and the texts are the single runs'. 21 pages is
    the fewest for which both fit: a sequence of P pages takes 3 global layers x P slabs and 15 local layers x at
    most 10 (the window's 512 positions and a prefill pass), the second 3 x 1 + 15 x 9, so 3P + 288 <= 18 x (P - 1)."""
    g = str(require(GEMMA, "run `make model-gemma`"))
    pages, pool = 21, 20
    long = "The history of the printing press. " * 210
    reqs = [{"prompt": long + "In summary,", "n": 16}, {"prompt": long + "The first printer was", "n": 12}]
    path = write_lines("gemma-reclaim.jsonl", reqs)
    code, recs, err = batch(path, "-t", "0", "--parallel", "2", "--kv-mem", "27", "-v", model_path=g, timeout=900)
    assert code == 0, err
    assert all((pages - 1) * 72 < r["prompt_tokens"] <= pages * 72 - r["tokens"] for r in recs), recs  # as planned
    check_identity(recs, reqs, g)
    used = re.search(r"KV pages: (\d+) of (\d+) used", err)
    kept = re.search(r"pages in use at most (\d+), (\d+) had they kept them", err)
    assert used and int(used.group(2)) == pool, err
    assert kept and int(kept.group(1)) <= pool < int(kept.group(2)), f"no pages given back, or not needed: {err}"
    prefilled = int(re.search(r"prefill (\d+) tokens", err).group(1))
    assert prefilled < recs[0]["prompt_tokens"] + 100, f"the second prompt did not share the first's pages: {err}"


def test_sampled_records_depend_only_on_seed_and_line():
    base = [{"prompt": p["prompt"], "n": 24} for p in PROMPTS[:6]]
    other = list(base)
    other[1] = {"prompt": "Something else entirely.", "n": 40}
    other[4] = "A plain line instead"
    a = batch(write_lines("seed-a.jsonl", base), "-t", "1", "-s", "7", "--parallel", "3")
    b = batch(write_lines("seed-b.jsonl", other), "-t", "1", "-s", "7", "--parallel", "5")
    c = batch(write_lines("seed-a.jsonl", base), "-t", "1", "-s", "8", "--parallel", "3")
    assert a[0] == b[0] == c[0] == 0, (a[2], b[2], c[2])
    for i in (0, 2, 3, 5):
        assert a[1][i]["text"] == b[1][i]["text"], (i, a[1][i], b[1][i])
    assert any(a[1][i]["text"] != c[1][i]["text"] for i in range(6)), "another seed gave the same texts"


BAD_LINES = [
    ('{"prompt": "ok", "n": 3}', None),
    ('{"prompt": "unterminated', "not valid JSON"),
    ('{"prompt": "x",}', "not valid JSON"),
    ("", "the prompt is empty"),
    ('{"prompt": ""}', "the prompt is empty"),
    ('{"prompt": "x", "temperature": 1}', 'unknown field "temperature"'),
    ('{"n": 3}', 'no "prompt"'),
    ('{"prompt": 5}', '"prompt" must be a string'),
    ('{"prompt": "x", "n": "5"}', '"n" must be an integer'),
    ('{"prompt": "x", "n": 2.5}', '"n" must be an integer'),
    ('{"prompt": "x", "n": -1}', '"n" must be an integer'),
    ('{"prompt": "x", "t": -1}', '"t" must be a number'),
    ('{"prompt": "x", "chat": 1}', '"chat" must be true or false'),
    ('{"prompt": "x", "system": null}', '"system" must be a string'),
    ('{"prompt": "x", "id": [1]}', '"id" must be'),
    ('{"prompt": "x", "logprobs": 21}', '"logprobs" must be an integer in [0, 20]'),
    ('{"prompt": "x", "stop": ""}', '"stop" strings must be strings of 1 to 256 bytes'),
    ('{"prompt": "x", "stop": [1]}', '"stop" strings must be'),
    ('{"prompt": "x", "stop": {"a": 1}}', '"stop" must be a string or an array'),
    ('{"prompt": "x", "json": 1}', '"json" must be true or false'),
    ('{"prompt": "x", "schema": []}', '"schema" must be a JSON object'),
    ('{"prompt": "x", "json": false, "schema": {"type": "object"}}', '"json": false for none'),  # (was: the schema applied)
    ('{"prompt": "x", "schema": {"type": "object", "maxItems": 2, "minItems": 3}}', '"schema": $.minItems: greater than maxItems'),
    ('{"prompt": "x"} {"prompt": "y"}', "not valid JSON"),
    ("[1, 2]", None),  # not starting with "{": a plain-text prompt
    ('{"prompt": "' + "many words " * 40 + '"}', "the prompt has"),
    ('{"prompt": "fine", "n": 0, "id": "zero"}', None),
    ("plain text is fine too", None),
]


def test_bad_lines_get_error_records_and_the_rest_runs():
    path = WORK / "bad.txt"
    path.write_text("".join(line + "\n" for line, _ in BAD_LINES))
    code, recs, err = batch(path, "-t", "0", "-n", "4", "--ctx", "64")
    assert code == 1, (code, err)
    assert len(recs) == len(BAD_LINES), recs
    for line, (rec, (text, want)) in enumerate(zip(recs, BAD_LINES), 1):
        if want is None:
            assert "error" not in rec and "text" in rec, (line, rec)
        else:
            assert "text" not in rec and rec["error"].startswith(f"line {line}: ") and want in rec["error"], (line, rec, want)
    zero = next(r for r in recs if r["id"] == "zero")
    assert zero == {**zero, "id": "zero", "text": "", "tokens": 0, "finish": "length"}, zero
    good = write_lines("good.jsonl", ['{"prompt": "ok", "n": 3}'])
    assert batch(good, "-t", "0")[0] == 0


def test_random_lines_never_crash():
    rng = random.Random(5)
    pieces = ['{"prompt": "', '"', "}", "{", "\\u00e9", "\\ud800", "\\", ", \"n\": 2", "\xff", "\x00", "\t", "é", "[", "]",
              "null", "1e999", '"id": ', "chat", ":", "true"]
    lines = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(150)]
    path = WORK / "random.txt"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    code, recs, err = batch(path, "-t", "0", "-n", "2", "--parallel", "8", timeout=900)
    assert code in (0, 1), (code, err)
    assert len(recs) == len(lines), (len(recs), len(lines))
    assert [r.get("id") for r in recs if "error" in r] == [i + 1 for i, r in enumerate(recs) if "error" in r]


def test_interrupt_writes_whole_records_in_order_and_exits_130():
    """Ctrl-C as soon as the first record is out (the batch under way, 4 of its 40 lines of 60 tokens in flight, not
    after a fixed wait: the machine's load does not decide what the signal interrupts, and no CPU is spent waiting)."""
    path = write_lines("long.txt", [f"Write a long essay about topic number {i}." for i in range(40)])
    p = subprocess.Popen([str(RUN), model(), "--batch", path, "-t", "0", "-n", "60", "--ignore-eos", "--parallel", "4"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    first = p.stdout.readline()  # unbuffered: communicate() reads the pipe itself, a buffer's read-ahead would be lost
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err.decode())
    recs = [json.loads(line) for line in (first + out).decode().splitlines()]
    assert 1 <= len(recs) < 40, len(recs)
    assert [r["id"] for r in recs] == list(range(1, len(recs) + 1))
    assert any(r["finish"] == "interrupted" for r in recs), recs
    assert all(r["finish"] in ("length", "interrupted") for r in recs), recs


def test_quiet_stderr_unless_verbose():
    path = write_lines("quiet.txt", ["Hello there", "Good morning"])
    code, recs, err = batch(path, "-n", "4")
    assert code == 0 and err == "", err
    code, recs, err = batch(path, "-n", "4", "-v")
    assert code == 0 and re.search(r"batch: 2/2 done", err) and "tok/s aggregate" in err, err


USAGE = [
    (["--parallel", "4", "-i", "x"], "--parallel and no --batch"),
    (["--kv-mem", "64", "-i", "x"], "--kv-mem and no --batch"),
    (["--batch", "-", "-i", "x"], "--batch and -i cannot be used together"),
    (["--batch", "-", "-m", "chat"], "--batch and -m chat"),
    (["--batch", "-", "--parallel", "0"], "--parallel expects an integer in [1, 64]"),
    (["--batch", "-", "--parallel", "65"], "--parallel expects an integer in [1, 64]"),
    (["--batch", "-", "--kv-mem", "0"], "--kv-mem expects an integer"),
    (["--batch", "-", "--kv-mem", "1"], "holds no KV cache page"),
]


def test_usage_errors():
    for args, want in USAGE:
        r = run([model(), *args], stdin=b"hello\n")
        err = r.stderr.decode()
        assert r.returncode == 2 and want in err and r.stdout == b"", (args, r.returncode, err)
    for target, want in ((WORK / "missing.txt", "No such file"), (WORK, "Is a directory")):
        r = run([model(), "--batch", target])
        err = r.stderr.decode()
        assert r.returncode == 1 and want in err and len(err.splitlines()) == 1 and r.stdout == b"", (target, err)


def test_readme_batch_example_runs_verbatim():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("\n## Batch\n"):]
    script = section[section.index("```sh\n") + 6:section.index("\n```", section.index("```sh\n"))]
    box = WORK / "readme"
    box.mkdir(exist_ok=True)
    for name, target in (("run", RUN), ("models", MODELS)):
        if (box / name).is_symlink():  # a scratch folder kept from a run of another checkout may point elsewhere
            (box / name).unlink()
        (box / name).symlink_to(target)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=box, capture_output=True, timeout=300)
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    first = alone(model(), "The capital of France is", 8) + "\n" + alone(model(), "The capital of Japan is", 8) + "\n"
    assert out.startswith(first), (out, first)
    assert re.search(r"^T-1\t(stop|length)\t", out[len(first):], re.M) and re.search(r"^T-2\t", out, re.M), out


def test_lines_trickling_in_do_not_stall_the_batch():
    """A producer that writes a line and waits for its answer (stdin left open) gets it."""
    import select
    p = subprocess.Popen([str(RUN), model(), "--batch", "-", "-t", "0", "-n", "8"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for i, prompt in enumerate(["The capital of France is", "The capital of Japan is"], 1):
            p.stdin.write(prompt.encode() + b"\n")
            p.stdin.flush()
            ready, _, _ = select.select([p.stdout], [], [], 60)
            assert ready, f"no record for line {i} while stdin stays open"
            rec = json.loads(p.stdout.readline())
            assert rec["id"] == i and rec["text"] == alone(model(), prompt, 8), rec
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert p.returncode == 0, p.stderr.read().decode()


def test_logprobs_field_matches_the_single_request_records():
    reqs = [{"prompt": "What is 2+2?", "chat": True, "n": 6, "logprobs": 3}, {"prompt": "Hi", "n": 4},
            {"prompt": "The capital of France is", "n": 5, "logprobs": 0}]
    code, recs, err = batch(write_lines("logprobs.jsonl", reqs), "-t", "0")
    assert code == 0, err
    assert "logprobs" not in recs[1], recs[1]
    for rec, req in zip((recs[0], recs[2]), (reqs[0], reqs[2])):
        args = [model(), "-t", "0", "-n", req["n"], "-i", req["prompt"], "--logprobs", req["logprobs"]]
        single = [json.loads(x) for x in run(args + (["-c"] if req.get("chat") else [])).stdout.decode().splitlines()]
        assert rec["logprobs"] == single, (rec["logprobs"], single)
        assert len(rec["logprobs"][0]["top"]) == req["logprobs"]
    code, recs, err = batch(write_lines("logprobs-default.txt", ["Hello"]), "-t", "0", "-n", "2", "--logprobs", "1")
    assert code == 0 and len(recs[0]["logprobs"]) == 2 and len(recs[0]["logprobs"][0]["top"]) == 1, recs


def test_stop_field_and_flag_match_the_single_request_mode():
    reqs = [{"prompt": "The capital of France is", "n": 30, "stop": "\n"},
            {"prompt": "Write a haiku about the sea.", "n": 40, "stop": ["sea", "wave"]},
            {"prompt": "The capital of France is", "n": 30}]
    code, recs, err = batch(write_lines("stop.jsonl", reqs), "-t", "0", "--stop", " Paris")
    assert code == 0, err
    for rec, stops in zip(recs, (["\\n"], ["sea", "wave"], [" Paris"])):
        args = [model(), "-t", "0", "-n", 30 if rec["id"] != 2 else 40, "-i", reqs[rec["id"] - 1]["prompt"]]
        single = run(args + [x for s in stops for x in ("--stop", s)]).stdout.decode()
        assert rec["text"] == single, (rec, single)
    assert recs[0]["finish"] == "stop" and recs[2]["finish"] == "stop" and recs[2]["text"] == "", recs


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_and_schema_fields_match_the_single_request_mode():
    ask = "Invent a person: a name and an age."
    reqs = [{"prompt": ask, "chat": True, "n": 64, "schema": PERSON},
            {"prompt": "List three colors as a JSON array.", "chat": True, "n": 48, "json": True},
            {"prompt": ask, "chat": True, "n": 3, "schema": PERSON},
            {"prompt": "x", "schema": {"type": "object", "minimum": 3}},
            {"prompt": "x", "json": True, "schema": PERSON},
            {"prompt": "Hello", "n": 6}]
    code, recs, err = batch(write_lines("json.jsonl", reqs), "-t", "0")
    assert code == 1, (code, err)  # line 3's value is left incomplete
    schema_file = WORK / "person.schema.json"
    schema_file.write_text(json.dumps(PERSON))
    single = run([model(), "-c", "-t", "0", "-n", 64, "--json-schema", schema_file, "-i", ask]).stdout.decode()
    assert recs[0]["text"] == single and json.loads(single).keys() == {"name", "age"}, (recs[0], single)
    assert recs[0]["finish"] == "stop", recs[0]
    single = run([model(), "-c", "-t", "0", "-n", 48, "--json", "-i", reqs[1]["prompt"]]).stdout.decode()
    assert recs[1]["text"] == single, (recs[1], single)
    # whether the model closes a free-form value within n tokens is the model's business (SmolLM2 may
    # count on and on); the record must say which it was
    if recs[1]["finish"] == "stop":
        json.loads(single)
    else:
        assert recs[1]["finish"] == "length" and recs[1]["json_complete"] is False, recs[1]
    assert recs[2]["json_complete"] is False and recs[2]["tokens"] == 3, recs[2]
    assert "json_complete" not in recs[0] and "json_complete" not in recs[5], recs
    assert recs[3]["error"] == 'line 4: "schema": $.minimum: keyword not supported', recs[3]
    assert "cannot be used together" in recs[4]["error"], recs[4]
    # the command line's --json applies to every line, "json": false turns it off for one
    code, recs, err = batch(write_lines("json-default.jsonl", [{"prompt": reqs[1]["prompt"], "chat": True, "n": 48},
                                                               {"prompt": "Hello", "n": 6, "json": False}]), "-t", "0", "--json")
    complete = recs[0]["finish"] == "stop"  # exit 1 when a value is left incomplete
    assert code == (0 if complete else 1) and recs[0]["text"] == single and recs[1]["text"] == alone(model(), "Hello", 6), \
        (code, recs, err)


# --- hardening, round three (issue 23): each test below failed on the code before it -----------------

def test_json_line_with_n_0_counts_as_failed():
    """A "json" or "schema" line with "n": 0 generates no value: "json_complete": false and exit 1, as
    single mode's `-n 0 --json` exits 1; a plain "n": 0 line stays a success."""
    reqs = [{"prompt": "hi", "n": 0, "json": True}, {"prompt": "hi", "n": 0, "schema": {"type": "object"}}]
    for req in reqs:
        code, recs, err = batch(write_lines("n0-json.jsonl", [req]), "-t", "0")
        assert code == 1 and recs[0]["json_complete"] is False and recs[0]["tokens"] == 0, (req, code, recs, err)
    code, recs, err = batch(write_lines("n0-flag.jsonl", [{"prompt": "hi", "n": 0}]), "-t", "0", "--json")
    assert code == 1 and recs[0]["json_complete"] is False, (code, recs, err)
    code, recs, err = batch(write_lines("n0-plain.jsonl", [{"prompt": "hi", "n": 0}]), "-t", "0")
    assert code == 0 and "json_complete" not in recs[0], (code, recs, err)
    single = run([model(), "-t", "0", "-n", "0", "--json", "-i", "hi"])
    assert single.returncode == 1, single.stderr  # the mode batch must agree with


def chatml(system: bytes, user: bytes) -> bytes:
    """SmolLM2's chat template (ChatML) around one user turn, written out by hand."""
    return (b"<|im_start|>system\n" + system + b"<|im_end|>\n<|im_start|>user\n" + user +
            b"<|im_end|>\n<|im_start|>assistant\n")


def tokenized(text: bytes) -> list[int]:
    """The ids of text, control-token texts parsed (a prompt on stdin loses one final newline: add one)."""
    r = run([model(), "--tokenize", "--special"], stdin=text + b"\n")
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.split()]


def ids_lines(err: str) -> dict[int, list[int]]:
    got = {}
    for line in err.splitlines():
        m = re.fullmatch(r"ids \(line (\d+)\): ([\d ]+)", line)
        if m:
            got[int(m.group(1))] = [int(x) for x in m.group(2).split()]
    return got


def test_print_prompt_ids_shows_each_line():
    """--print-prompt-ids with --batch prints each line's prompt ids (it was silently ignored): what the
    hand-written template, or the plain text, tokenizes to."""
    reqs = [{"prompt": "What is 2+2?", "chat": True, "system": "Be brief.", "n": 2}, "The capital of France is",
            {"prompt": "", "n": 2}, {"prompt": "Hi", "n": 0}]
    code, recs, err = batch(write_lines("ids.jsonl", reqs), "-t", "0", "-n", "2", "--print-prompt-ids")
    assert code == 1, (code, err)  # line 3: the prompt is empty
    got = ids_lines(err)
    want = {1: tokenized(chatml(b"Be brief.", b"What is 2+2?")), 2: tokenized(b"The capital of France is"),
            4: tokenized(b"Hi")}
    assert got == want, (got, want, err)
    assert [r["prompt_tokens"] for r in recs if "error" not in r] == [len(want[k]) for k in (1, 2, 4)], recs


def test_system_keeps_every_byte():
    """A "system" string with \\u0000 keeps the NUL and what follows (it was cut there), as "prompt" does."""
    line = {"prompt": "hi", "chat": True, "system": "You are\u0000 a pirate.", "n": 1}
    code, recs, err = batch(write_lines("system-nul.jsonl", [line]), "-t", "0", "--print-prompt-ids")
    want = tokenized(chatml(b"You are\x00 a pirate.", b"hi"))
    cut = tokenized(chatml(b"You are", b"hi"))
    assert len(want) > len(cut), (want, cut)  # the check can tell the two apart
    assert code == 0 and recs[0]["prompt_tokens"] == len(want), (code, recs, len(want), len(cut), err)
    assert ids_lines(err) == {1: want}, err


def test_endless_input_ends_the_batch():
    """`--batch - < /dev/zero` ran forever; now line 1's record comes out and the batch stops, naming why."""
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([str(RUN), model(), "--batch", "-", "-t", "0", "-n", "2"], stdin=zero, capture_output=True,
                           timeout=120)
    recs = [json.loads(x) for x in r.stdout.decode().splitlines()]
    err = r.stderr.decode().splitlines()
    assert r.returncode == 1 and len(recs) == 1 and "longer than the context can hold" in recs[0]["error"], (r.returncode, recs)
    assert len(err) == 1 and re.fullmatch(r"run: line 1 of the --batch input on stdin runs on past \d+ bytes without a "
                                          r"newline: the input after it was not read", err[0]), err
    # a too long line that does end is skipped, and the lines after it run
    data = b"Hello\n" + b"x" * 5_000_000 + b"\nThe capital of France is\n"
    code, recs, err = batch("-", "-t", "0", "-n", "3", stdin=data)
    assert code == 1 and [("error" in r) for r in recs] == [False, True, False], (code, recs, err)
    assert recs[2]["text"] == alone(model(), "The capital of France is", 3), recs
    assert err == "run: 1 of 3 records are errors or incomplete JSON answers (their reasons are on stdout)\n", err


def test_bom_and_blanks_before_the_brace_still_mean_json():
    """A UTF-8 BOM opening the input, and blanks before "{", made the JSON line a plain prompt (its id, n
    ignored); now the line is read as JSON. A BOM before plain text is not part of the prompt."""
    bom = b"\xef\xbb\xbf"
    data = (bom + b'{"prompt": "The capital of France is", "n": 3, "id": "a"}\n'
            b' \t {"prompt": "Hi", "n": 2, "id": "b"}\n'
            b'\t{"prompt": "x", "n": 2, "id": "c",}\n')
    code, recs, err = batch("-", "-t", "0", stdin=data)
    assert [r["id"] for r in recs] == ["a", "b", 3], recs
    assert recs[0]["text"] == alone(model(), "The capital of France is", 3) and recs[1]["tokens"] == 2, recs
    assert "not valid JSON" in recs[2]["error"] and code == 1, recs
    code, recs, err = batch("-", "-t", "0", "-n", "3", stdin=bom + b"The capital of France is\n")
    assert code == 0 and recs[0]["text"] == alone(model(), "The capital of France is", 3), recs
    assert recs[0]["prompt_tokens"] == len(tokenized(b"The capital of France is")), recs


def test_id_numbers_echo_exactly_or_are_refused():
    """An id number is echoed exactly as written; one a reader would take as infinity (1e400) or as 0
    though it is not 0 (0.1e-999, which was echoed) is refused."""
    ids = ["1e400", "0.1e-999", "1e-400", "-0.0e-999", "1e-310", "12345678901234567890.50", "-7"]
    lines = [f'{{"prompt": "hi", "n": 1, "id": {x}}}' for x in ids]
    code, recs, err = batch(write_lines("ids-num.jsonl", lines), "-t", "0")
    out = [r.split('"id": ', 1)[1].split(",", 1)[0] for r in
           run([model(), "--batch", WORK / "ids-num.jsonl", "-t", "0"]).stdout.decode().splitlines()]
    assert code == 1, code
    assert "error" in recs[0] and "out of the range of a double" in recs[0]["error"], recs[0]
    for i in (1, 2):
        assert recs[i]["id"] == i + 1 and "is too small for a double" in recs[i]["error"], recs[i]
    assert out[3:] == ids[3:] and all("text" in r for r in recs[3:]), (out, recs)


def test_stdin_directory_and_closed_stdin_read_alike():
    """A directory as stdin and a closed stdin got differently worded messages."""
    d = os.open("/", os.O_RDONLY)
    try:
        a = subprocess.run([str(RUN), model(), "--batch", "-"], stdin=d, capture_output=True, timeout=60)
    finally:
        os.close(d)
    b = subprocess.run([str(RUN), model(), "--batch", "-"], stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                       preexec_fn=lambda: os.close(0))
    assert a.stderr.decode() == "run: cannot read the --batch input on stdin: Is a directory\n" and a.returncode == 1, a
    assert b.stderr.decode() == "run: cannot read the --batch input on stdin: Bad file descriptor\n" and b.returncode == 1, b


def screen_lines(raw: bytes) -> list[str]:
    """What a terminal shows for raw output: \\r returns to the line's start, ESC [K clears to its end."""
    lines, cur, col = [], [], 0
    text = raw.decode(errors="replace").replace("\r\n", "\n")
    i = 0
    while i < len(text):
        if text.startswith("\033[K", i):
            del cur[col:]
            i += 3
            continue
        c = text[i]
        i += 1
        if c == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        elif c == "\r":
            col = 0
        else:
            cur[col:col + 1] = [c]
            col += 1
    return lines + (["".join(cur)] if cur else [])


def test_records_never_share_a_terminal_line_with_the_progress_text():
    """With stdout and stderr on one terminal, a record was printed after the progress text on its line."""
    import pty
    path = write_lines("tty.txt", ["The capital of France is", "Hello", "The capital of Japan is"])
    master, slave = pty.openpty()
    p = subprocess.Popen([str(RUN), model(), "--batch", path, "-t", "0", "-n", "24", "--parallel", "1"],
                         stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    raw = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end closed
            break
        if not chunk:
            break
        raw += chunk
    p.wait(timeout=120)
    os.close(master)
    assert p.returncode == 0, raw
    shown = screen_lines(raw)
    recs = [line for line in shown if '{"id"' in line]
    assert len(recs) == 3 and all(json.loads(line)["id"] == i for i, line in enumerate(recs, 1)), shown
    assert any(line.startswith("batch: 3/3 done") for line in shown), shown


def test_one_json_line_takes_a_bounded_multiple_of_its_bytes():
    """A 3 MB line of [0,0,...] under an unknown field raised peak RSS by ~49 bytes per byte of the line;
    the JSON reader now takes at most 16 per byte (and 64 KiB), refuses the line for it, and the rise stays
    under 20x the line, room for the line's own buffers. A sanitizer build's RSS (redzones, quarantined
    blocks) says nothing about the reader's allocations: there only the refusal is checked."""
    small = write_lines("mem-small.jsonl", ['{"prompt": "hi", "foo": [0]}'])
    big = WORK / "mem-big.jsonl"
    big.write_text('{"prompt": "hi", "foo": [' + ",".join(["0"] * 1_500_000) + "]}\n")
    peaks = []
    for path in (small, big):
        p = subprocess.Popen([str(RUN), model(), "--batch", path, "-t", "0", "-n", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        out, err = p.stdout.read(), p.stderr.read()
        _, status, usage = os.wait4(p.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 1 and b'"error"' in out, (out, err)
        peaks.append(usage.ru_maxrss * 1024)  # ru_maxrss is in KiB on Linux
    assert b"too many values for the length of the text" in out, out[:300]
    if b"__asan_init" in RUN.read_bytes():
        print("sanitizer build: the refusal checked, not the RSS")
        return
    rise = peaks[1] - peaks[0]
    assert rise < 20 * big.stat().st_size, f"peak RSS rose by {rise / big.stat().st_size:.1f} bytes per byte of the line"
    print(f"a {big.stat().st_size / 1e6:.1f} MB line raised peak RSS by {rise / 1e6:.1f} MB "
          f"({rise / big.stat().st_size:.1f} bytes per byte)")


def test_system_without_chat_and_y_without_a_template_are_errors():
    """Issue 35: options that were silently ignored say so. A batch line's "system" without "chat": true (nor -c)
    gets an error record naming the field, the other lines run; `-y` without -c, -m chat or --batch is a usage
    error naming it."""
    lines = ['{"prompt": "hi", "system": "Be brief.", "n": 1}', '{"system": "Be brief.", "prompt": "hi", "chat": false, "n": 1}',
             '{"prompt": "hi", "system": "Be brief.", "chat": true, "n": 1}', "hello"]
    p = run([model(), "--batch", "-", "-t", "0", "-n", "1"], stdin=("\n".join(lines) + "\n").encode())
    recs = [json.loads(x) for x in p.stdout.decode().splitlines()]
    assert p.returncode == 1 and len(recs) == 4, f"exit {p.returncode}: {recs}"
    for r in recs[:2]:
        assert '"system"' in r.get("error", "") and "chat" in r["error"], r
    assert "text" in recs[2] and "text" in recs[3], recs
    p = run([model(), "-c", "--batch", "-", "-t", "0", "-n", "1"], stdin=(lines[0] + "\n").encode())
    assert p.returncode == 0 and "text" in json.loads(p.stdout), "with -c every line is a chat line"
    for args in (["-i", "hi", "-n", "1"], ["--tokenize", "-i", "hi"]):
        p = run([model(), "-y", "Be brief.", *args], timeout=60)
        err = p.stderr.decode().splitlines()
        assert p.returncode == 2 and not p.stdout and err and err[0].startswith("run: -y "), f"{args}: {err}"
