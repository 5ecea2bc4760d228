"""--logprobs N (issue 18): one JSON record per generated token with its log-probability and the N most likely.

The independent source is the engine's own logits of the same tokens, fed teacher-forced through
`./run --dump-logits` (common.dumped_logits) and turned into log-probabilities in float64 numpy here:
- with -t 0 the records' log-probabilities are the temperature-1 log-softmax of those logits, so their sum is the
  sequence log-likelihood of the generated ids. Batched prefill, decode steps and lookup's verification passes
  give bit-identical logits (issue 26), so on the default q4_1 model the records equal the scoring within 1e-9
  (float64 rounding of the same floats); on SmolLM2 exported as f32 with an f32 KV cache as well (within 1e-4, the
  bound from before the paths were made identical, kept as a second model's check).
- sampled (-t 0.7 -k 5, default -p 0.95) the records must give the distribution drawn from: softmax(logits / T)
  cut to the 5 most likely, then to the smallest prefix reaching 0.95, renormalized, recomputed here.
Lookup decoding (on by default) must not change the records: greedy records with --lookup 8 equal --lookup 0's
byte for byte while drafts stand. The end-of-turn token that stops an answer has a record (its id is the GGUF's
eos_token_id); chat answers are separated by one empty line.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from common import DEFAULT_GGUF, DEFAULT_MODEL, ROOT, RUN, SCRATCH, dumped_logits, exported, gguf_metadata, model, require, run

PROMPT = "The list of the numbers from one to twenty: one, two, three, four,"
OPEN_PROMPT = "My favourite thing to do on a rainy afternoon is"
F32_TOL = 1e-4  # per token, f32 weights and KV cache: batched prefill vs decode steps differ by ~3e-6 (measured)
TOP_KEYS = {"id", "text", "logprob"}


def records(out: bytes) -> list[dict]:
    """stdout of a --logprobs run: every line one JSON record of the documented shape."""
    recs = []
    for line in out.decode("utf-8").splitlines():
        r = json.loads(line)
        assert set(r) == TOP_KEYS | {"top"}, f"record keys {sorted(r)}"
        assert all(set(t) == TOP_KEYS for t in r["top"]), r
        recs.append(r)
    return recs


def generate(m: str, *args: str, stdin: bytes | None = None) -> tuple[list[dict], str]:
    p = run([m, *args], stdin=stdin, timeout=600)
    assert p.returncode == 0, f"./run {' '.join(args)}: exit {p.returncode}: {p.stderr.decode(errors='replace')}"
    return records(p.stdout), p.stderr.decode(errors="replace")


def prompt_ids(m: str, *args: str) -> list[int]:
    p = run([m, *args, "--tokenize"], timeout=120)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return [int(x) for x in p.stdout.split()]


def log_softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def teacher_forced(m: str, ids: list[int], n_prompt: int, args: list[str]) -> np.ndarray:
    """Rows of the logits that predicted ids[n_prompt:], from the whole sequence fed at once."""
    return dumped_logits(m, ids[:-1], args)[n_prompt - 1:]


def check_greedy(recs: list[dict], logits: np.ndarray, tol: float, n_top: int) -> str:
    """Records of a -t 0 run against the temperature-1 log-softmax of the teacher-forced logits."""
    ls = log_softmax(logits)
    ids = [r["id"] for r in recs]
    want = ls[np.arange(len(ids)), ids]
    got = np.array([r["logprob"] for r in recs])
    worst = np.abs(got - want).max()
    assert worst <= tol, f"a token's log-probability is {worst:.3g} off the teacher-forced one (tolerance {tol})"
    assert abs(got.sum() - want.sum()) <= tol * len(ids), f"sum {got.sum()!r}, sequence log-likelihood {want.sum()!r}"
    for j, r in enumerate(recs):
        order = np.lexsort((np.arange(ls.shape[1]), -ls[j]))[:n_top]  # by falling log-probability, ties by id
        assert len(r["top"]) == n_top, f"token {j}: {len(r['top'])} alternatives, not {n_top}"
        assert r["id"] == order[0], f"token {j}: -t 0 chose {r['id']}, the argmax is {order[0]}"
        for t, o in zip(r["top"], order):
            assert abs(t["logprob"] - ls[j, t["id"]]) <= tol, f"token {j}: alternative {t} is off {ls[j, t['id']]!r}"
            near_tie = abs(ls[j, o] - ls[j, t["id"]]) <= 2 * tol
            assert t["id"] == o or near_tie, f"token {j}: alternative {t['id']} where numpy ranks {o}"
    return f"{len(ids)} tokens, sum {got.sum():.6f} vs {want.sum():.6f}, worst token {worst:.2g}"


def test_greedy_logprobs_sum_to_the_sequence_log_likelihood():
    """-t 0: each log-probability, and their sum, equal the teacher-forced log-softmax (f32 model, f32 KV)."""
    m = str(exported("f32"))
    args = ["-i", PROMPT, "--kv", "f32"]
    pids = prompt_ids(m, *args)
    for lookup in ("0", "8"):
        recs, _ = generate(m, *args, "-t", "0", "-n", "40", "--ignore-eos", "--logprobs", "5", "--lookup", lookup)
        assert len(recs) == 40, f"-n 40 --ignore-eos gave {len(recs)} records"
        ids = pids + [r["id"] for r in recs]
        print(f"    --lookup {lookup}: " + check_greedy(recs, teacher_forced(m, ids, len(pids), ["--kv", "f32"]), F32_TOL, 5))


def test_logprobs_equal_teacher_forced_scoring_exactly():
    """Issue 26: generation (batched prefill, then decode steps, with and without lookup's verification passes)
    and teacher-forced scoring of the same ids (one batched pass) see the very same logits, so on the default
    q4_1 model the records equal the scoring's log-softmax up to float64's rounding of those floats (1e-9),
    and the scoring's logits equal decode steps' (--no-batch) bit for bit."""
    m = model()
    args = ["-i", PROMPT]
    pids = prompt_ids(m, *args)
    for lookup in ("0", "8"):
        recs, _ = generate(m, *args, "-t", "0", "-n", "48", "--ignore-eos", "--logprobs", "5", "--lookup", lookup)
        ids = pids + [r["id"] for r in recs]
        scored = teacher_forced(m, ids, len(pids), [])
        assert np.array_equal(scored, teacher_forced(m, ids, len(pids), ["--no-batch"])), "prefill and decode logits differ"
        print(f"    --lookup {lookup}: " + check_greedy(recs, scored, 1e-9, 5))


def test_greedy_one_token_prompt_is_exact_and_lookup_keeps_the_records():
    """A one-token prompt is prefilled as a decode step, so --no-batch scoring gives the very logits the
    sampler saw (q4_1 model): within 1e-9. With --lookup 8 the records are byte-identical while drafts stand."""
    m = model()
    base = ["--ids", "504", "-t", "0", "-n", "64", "--ignore-eos", "--logprobs", "4", "-v"]
    p0 = run([m, *base, "--lookup", "0"], timeout=300)
    p8 = run([m, *base, "--lookup", "8", "--lookup-fixed"], timeout=300)   # drafts that do not depend on timing
    assert p0.returncode == 0 and p8.returncode == 0, (p0.stderr, p8.stderr)
    lookup_line = [ln for ln in p8.stderr.decode().splitlines() if ln.startswith("lookup:")]
    assert lookup_line and " 0 accepted" not in lookup_line[0], f"no draft stood: {lookup_line}"
    assert p8.stdout == p0.stdout, "records differ with lookup decoding"
    recs = records(p0.stdout)
    ids = [504] + [r["id"] for r in recs]
    print("    " + check_greedy(recs, teacher_forced(m, ids, 1, ["--no-batch"]), 1e-9, 4) + f"; {lookup_line[0]}")


def test_chat_wrap_records_include_the_end_of_turn_token():
    """-c: the answer's last record is the end-of-turn token that stopped it, and the sum over all records
    (end included) is the log-likelihood of the answer with its end. -n N: exactly N records, no end token."""
    m = str(exported("f32"))
    eos = int(gguf_metadata(DEFAULT_GGUF, "tokenizer.ggml.eos_token_id"))
    args = ["-i", "Name three colors.", "-c", "--kv", "f32"]
    pids = prompt_ids(m, *args)
    recs, _ = generate(m, *args, "-t", "0", "-n", "200", "--logprobs", "3")
    assert recs and recs[-1]["id"] == eos, f"last record {recs[-1] if recs else None}, not the end token {eos}"
    assert recs[-1]["text"] == "<|im_end|>", recs[-1]
    assert all(r["id"] != eos for r in recs[:-1])
    ids = pids + [r["id"] for r in recs]
    print("    " + check_greedy(recs, teacher_forced(m, ids, len(pids), ["--kv", "f32"]), F32_TOL, 3))
    short, _ = generate(m, *args, "-t", "0", "-n", str(len(recs) - 2), "--logprobs", "3")
    assert short == recs[:len(recs) - 2], "-n N: the first N records of the longer run"


def test_chat_mode_answers_end_with_an_empty_line():
    """-m chat: each answer's records, then one empty line; the records' texts are the text-mode answer."""
    m = model()
    msgs = b"What is the capital of France?\nAnd of Italy?\n"
    p = run([m, "-m", "chat", "-t", "0", "-n", "24", "--logprobs", "2"], stdin=msgs, timeout=300)
    plain = run([m, "-m", "chat", "-t", "0", "-n", "24"], stdin=msgs, timeout=300)
    assert p.returncode == 0 and plain.returncode == 0, (p.stderr, plain.stderr)
    out = p.stdout.decode()
    assert out.endswith("\n\n"), out[-80:]
    answers = out[:-2].split("\n\n")
    texts = plain.stdout.decode().split("\n")[:-1]
    assert len(answers) == 2 == len(texts), f"{len(answers)} answers with --logprobs, {len(texts)} without"
    for block, text in zip(answers, texts):
        recs = records(block.encode())
        spoken = "".join(r["text"] for r in recs if not r["text"].startswith("<|"))
        assert spoken == text, f"records spell {spoken!r}, the text answer is {text!r}"


def check_sampled(recs: list[dict], logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> int:
    """Each record's top list is the kept, renormalized distribution recomputed from the logits; returns how
    many positions were checked (a position whose nucleus boundary is a near-tie is left out)."""
    checked = 0
    for j, r in enumerate(recs):
        top = r["top"]
        lp = [t["logprob"] for t in top]
        assert 1 <= len(top) <= top_k, f"token {j}: {len(top)} alternatives with -k {top_k}"
        assert lp == sorted(lp, reverse=True) and all(x <= 1e-12 for x in lp), f"token {j}: {lp}"
        assert abs(sum(np.exp(lp)) - 1) <= 1e-5, f"token {j}: kept probabilities sum to {sum(np.exp(lp))}"
        chosen = [t for t in top if t["id"] == r["id"]]
        assert chosen and chosen[0]["logprob"] == r["logprob"], f"token {j}: drawn {r['id']} is not in its top list"
        p = np.exp(log_softmax(logits[j:j + 1], temperature)[0])
        order = np.lexsort((np.arange(p.size), -p))[:top_k]
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, top_p) + 1) if cum[-1] >= top_p else top_k
        if np.min(np.abs(cum - top_p)) < 1e-4 or (keep < top_k and abs(p[order[keep - 1]] - p[order[keep]]) < 1e-6):
            continue
        want = np.log(p[order[:keep]] / p[order[:keep]].sum())
        assert [t["id"] for t in top] == list(order[:keep]), f"token {j}: kept {[t['id'] for t in top]}, numpy {order[:keep]}"
        assert np.abs(np.array(lp) - want).max() <= F32_TOL, f"token {j}: {lp} vs {want}"
        checked += 1
    return checked


def test_sampled_logprobs_describe_the_distribution_drawn_from():
    """-t 0.7 -k 5 (-p 0.95): at most 5 alternatives, by falling probability, summing to 1, the drawn token among
    them; each list is numpy's top-k/top-p cut of softmax(logits / 0.7), renormalized. With lookup on (the
    counting prompt makes drafts stand; the open one makes lists of every length)."""
    m = str(exported("f32"))
    runs = [(PROMPT, "1"), (PROMPT, "2"), (OPEN_PROMPT, "1"), (OPEN_PROMPT, "2"), (OPEN_PROMPT, "3")]
    total = drafted = 0
    lengths: list[int] = []
    for prompt, seed in runs:
        args = ["-i", prompt, "--kv", "f32"]
        pids = prompt_ids(m, *args)
        recs, err = generate(m, *args, "-t", "0.7", "-k", "5", "-s", seed, "-n", "32", "--ignore-eos",
                             "--logprobs", "20", "-v", "--lookup-fixed")
        assert len(recs) == 32
        drafted += sum(int(ln.split()[1]) for ln in err.splitlines() if ln.startswith("lookup:"))
        lengths += [len(r["top"]) for r in recs]
        ids = pids + [r["id"] for r in recs]
        total += check_sampled(recs, teacher_forced(m, ids, len(pids), ["--kv", "f32"]), 0.7, 5, 0.95)
    n = len(lengths)
    assert total >= 0.8 * n, f"only {total} of {n} positions away from a top-p near-tie"
    assert lengths.count(5) >= 10 and sum(1 < k < 5 for k in lengths) >= 10, f"lists too uniform: {lengths}"
    assert drafted > 0, "lookup decoding drafted nothing: the composition was not exercised"
    print(f"    {total} of {n} sampled positions match numpy's kept distribution (lists of 5: {lengths.count(5)}, "
          f"of 2-4: {sum(1 < k < 5 for k in lengths)}); {drafted} drafts checked")


def test_fewer_alternatives_are_the_head_of_the_list():
    """--logprobs 2 and 20 with one seed: the same draws (reporting takes nothing from the generator), each list
    of 2 the first 2 of the list of 20, probabilities <= 1 and summing to at most 1."""
    args = [model(), "-i", OPEN_PROMPT, "-t", "0.7", "-k", "5", "-s", "11", "-n", "24", "--ignore-eos", "--logprobs"]
    two, _ = generate(*args, "2")
    twenty, _ = generate(*args, "20")
    assert [(r["id"], r["logprob"]) for r in two] == [(r["id"], r["logprob"]) for r in twenty]
    assert all(a["top"] == b["top"][:2] for a, b in zip(two, twenty)), "a short list is not the head of the long one"
    assert any(len(r["top"]) > 2 for r in twenty), "every kept set had 2 tokens or fewer: nothing cut"
    for r in two:
        probs = [math.exp(t["logprob"]) for t in r["top"]]
        assert len(probs) <= 2 and all(p <= 1 for p in probs) and sum(probs) <= 1 + 1e-9, r


def test_zero_alternatives_give_empty_top_lists():
    recs, _ = generate(model(), "-i", PROMPT, "-t", "0.8", "-s", "7", "-n", "12", "--logprobs", "0")
    assert recs and all(r["top"] == [] for r in recs), recs[:2]
    assert all(r["logprob"] <= 0 for r in recs)


def test_bad_logprobs_values_exit_2():
    """--logprobs outside 0..20, not a number, missing, or with a mode that generates nothing: exit 2, one line."""
    m = model()
    cases = [["--logprobs", "50"], ["--logprobs", "-1"], ["--logprobs", "21"], ["--logprobs", "2.5"],
             ["--logprobs", "x"], ["--logprobs", ""], ["--logprobs"],
             ["--logprobs", "3", "--tokenize"], ["--logprobs", "3", "--ppl", "README.md"],
             ["--logprobs", "3", "--dump-logits", "/tmp/never-written.f32"]]
    for extra in cases:
        p = run([m, "-i", "hi", *extra] if "--ppl" not in extra else [m, *extra], timeout=60)
        lines = p.stderr.decode().splitlines()
        assert p.returncode == 2 and p.stdout == b"", f"{extra}: exit {p.returncode}, stdout {p.stdout[:80]!r}"
        assert lines and lines[0].startswith("run: ") and "--logprobs" in lines[0], f"{extra}: {lines}"
        assert len(lines) == 1, f"{extra}: {lines}"


def readme_logprobs_commands() -> list[str]:
    """The ```sh commands of README's "Log-probabilities" subsection (up to the next heading)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    at = text.index("\n### Log-probabilities\n")
    end = min(i for i in (text.find("\n## ", at + 1), text.find("\n### ", at + 1), len(text)) if i > 0)
    part = text[at:end]
    blocks = part.split("```sh\n")[1:]
    return [ln for b in blocks for ln in b.split("```")[0].splitlines() if ln.strip() and not ln.startswith("#")]


def test_readme_logprobs_examples_run():
    """The README's jq pipelines run verbatim (bash, pipefail) and print what they say: token<TAB>percent lines,
    then one number, the sum of the records' log-probabilities."""
    model()
    require(Path(shutil.which("jq") or "/nonexistent/jq"), "install jq (Debian: apt-get install jq)")
    commands = readme_logprobs_commands()
    assert len(commands) == 2, commands
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        (Path(tmp) / "run").symlink_to(RUN.resolve())
        (Path(tmp) / "models").symlink_to(DEFAULT_MODEL.parent.resolve())
        outs = []
        for cmd in commands:
            p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=tmp, stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=120)
            assert p.returncode == 0 and not p.stderr, f"`{cmd}`: exit {p.returncode}: {p.stderr[-500:]!r}"
            outs.append(p.stdout.decode())
        recs = records(run([DEFAULT_MODEL, "-c", "-t", "0", "-n", "16", "-i", "What is 2+2?", "--logprobs", "0"]).stdout)
    rows = [ln.rsplit("\t", 1) for ln in outs[0].splitlines()]
    assert [int(pc) for _, pc in rows] == [math.floor(100 * math.exp(r["logprob"]) + 0.5) for r in recs], rows  # jq rounds half up
    assert abs(float(outs[1]) - sum(r["logprob"] for r in recs)) < 1e-9, outs[1]
