"""The sampling chain (issue 27): --min-p, --repeat-penalty / --repeat-last-n, --presence-penalty and
--frequency-penalty, their batch fields, and what --logprobs reports.

The independent source is tests/sampling_ref.py, the chain in float64 numpy written from README "Sampling"
and llama.cpp's penalty rule, applied to the engine's own logits of the same tokens fed teacher-forced
(`--dump-logits`) with each position's history (the prompt and the tokens generated before it). On SmolLM2
exported as f32 with an f32 KV cache, batched prefill and decode steps agree to ~1e-5 (test_logprobs), so
every `--logprobs 20` record must list the reference's kept distribution: the same tokens in the same order,
log-probabilities within 1e-4, the drawn token among them. Positions where a cut (top-k, top-p, min-p, the
argmax) is within 1e-4 of deciding the other way are left out. Lookup decoding stays on (the default), so
verification passes are checked too: each of their rows must be penalized with its own history.
"""
from __future__ import annotations

import json
import math
import re

from common import SCRATCH, dumped_logits, exported, model, run
from sampling_ref import Chain, kept

PROMPTS = ("The list of the numbers from one to twenty: one, two, three, four,",
           "My favourite thing to do on a rainy afternoon is")
N_TOP = 20            # --logprobs at its maximum: the whole kept set shows when it has at most 20 tokens
TOL = 1e-4            # per log-probability (f32 model and KV: prefill and decode logits agree to ~1e-5)
NEAR_TIE = 1e-4       # a cut this close (relative) to flipping is left out (logits agree to ~1e-5)
SETTINGS = [
    Chain(temperature=0.7, top_k=20, top_p=0.95, repeat=1.3),
    Chain(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
    Chain(temperature=0.9, top_k=40, top_p=0.9, min_p=0.1, repeat=1.1, last_n=16, presence=0.5, frequency=0.3),
    Chain(temperature=1.3, top_k=10, top_p=0.95, min_p=0.02, presence=1.0),
    Chain(temperature=0.5, top_k=0, top_p=0.8, min_p=0.2, repeat=1.5, last_n=0, frequency=2.0),  # last_n 0: no penalties
    Chain(temperature=1.0, top_k=5, top_p=1.0, repeat=0.8, last_n=8, frequency=1.5),             # repeat < 1 favours repeats
    Chain(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat=1.2, last_n=100000, presence=0.2),  # the whole context
    Chain(temperature=0.0, repeat=1.3, last_n=32, presence=0.4, frequency=0.4),                 # greedy: full softmax reported
]


def records(out: bytes) -> list[dict]:
    return [json.loads(line) for line in out.decode("utf-8").splitlines()]


def prompt_ids(m: str, prompt: str, extra: list[str]) -> list[int]:
    p = run([m, "-i", prompt, "--tokenize", *extra], timeout=120)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return [int(x) for x in p.stdout.split()]


def check_records(recs: list[dict], pids: list[int], logits, chain: Chain, where: str) -> tuple[int, int]:
    """Every record against the reference's kept distribution at its position; returns (checked, near ties)."""
    ids = pids + [r["id"] for r in recs]
    checked = ties = 0
    for j, r in enumerate(recs):
        ref = kept(logits[j], ids[:len(pids) + j], chain)
        if ref.margin < NEAR_TIE:
            ties += 1
            continue
        want = dict(zip(ref.ids.tolist(), ref.logprobs.tolist()))
        top = r["top"]
        n = min(N_TOP, len(ref.ids))
        assert len(top) == n, f"{where} token {j}: {len(top)} alternatives listed, the reference keeps {len(ref.ids)}"
        assert r["id"] in want, f"{where} token {j}: drew {r['id']}, which the reference's chain does not keep"
        assert abs(r["logprob"] - want[r["id"]]) <= TOL, f"{where} token {j}: logprob {r['logprob']} vs {want[r['id']]}"
        for rank, t in enumerate(top):
            assert t["id"] in want, f"{where} token {j}: lists {t['id']}, which the reference does not keep"
            assert abs(t["logprob"] - want[t["id"]]) <= TOL, \
                f"{where} token {j}: {t['id']} has logprob {t['logprob']}, the reference {want[t['id']]}"
            same_rank = t["id"] == ref.ids[rank] or abs(t["logprob"] - ref.logprobs[rank]) <= 2 * TOL
            assert same_rank, f"{where} token {j}: rank {rank} is {t['id']}, the reference's is {ref.ids[rank]}"
        if chain.temperature == 0:
            assert r["id"] == ref.ids[0], f"{where} token {j}: greedy chose {r['id']}, the penalized argmax is {ref.ids[0]}"
        checked += 1
    return checked, ties


def test_logprobs_are_the_numpy_chain_over_many_positions_and_settings():
    """Eight settings (temperatures 0-1.3, top-k on and off, top-p, min-p, every penalty, windows of 8, 16, 32, 64
    and the whole context, a repetition penalty below 1), two prompts each, 40 tokens with lookup decoding on: each
    record is the reference's kept distribution, computed from teacher-forced logits and the position's history.
    On the shipped Q4_1 model (not the f32 export, 2.3x slower), whose lower-precision logits reach a float sum of
    1 before the last candidates: `-p 1` once cut the 4th and 5th of `-k 5` there."""
    m = str(model())
    kv = ["--kv", "f32"]
    total = ties = 0
    for i, chain in enumerate(SETTINGS):
        for prompt in PROMPTS:
            pids = prompt_ids(m, prompt, kv)
            p = run([m, "-i", prompt, *kv, *chain.flags(), "-s", str(11 + i), "-n", "40", "--ignore-eos",
                     "--logprobs", str(N_TOP)], timeout=600)
            assert p.returncode == 0, p.stderr.decode(errors="replace")
            recs = records(p.stdout)
            assert len(recs) == 40
            ids = pids + [r["id"] for r in recs]
            logits = dumped_logits(m, ids[:-1], kv)[len(pids) - 1:]
            c, t = check_records(recs, pids, logits, chain, f"setting {i} ({prompt[:12]}...)")
            total += c
            ties += t
    n = len(SETTINGS) * len(PROMPTS) * 40
    assert total >= 0.9 * n, f"only {total} of {n} positions were away from a near-tie"
    print(f"    {total} of {n} positions match the numpy chain ({ties} near-ties left out)")


def test_penalties_on_a_model_with_logits_of_both_signs():
    """A random 2-layer model (F32, vocabulary 280) gives near-uniform logits of both signs (-3.6 to 3.2), so tokens
    of the history with negative logits carry a visible share of the probability (every listed log-probability
    moves with them): the repetition penalty must multiply those and divide the positive ones.
    Greedy and sampled, strong penalties over the whole context (a prompt of repeated words; the model's context
    is 32 tokens: 10 of prompt, 20 generated)."""
    from test_bad_inputs import two_layer_model
    m = str(two_layer_model())
    kv = ["--kv", "f32"]
    prompt = "abc abc the cat"
    chains = [Chain(temperature=0.0, repeat=2.0, last_n=1000, frequency=0.3),
              Chain(temperature=0.0, repeat=0.5, last_n=1000, presence=0.7),
              Chain(temperature=1.0, top_k=0, top_p=1.0, repeat=3.0, last_n=12, presence=0.2, frequency=0.2),
              Chain(temperature=0.6, top_k=30, top_p=0.9, min_p=0.3, repeat=1.7, last_n=1000)]
    pids = prompt_ids(m, prompt, kv)
    total = negative = 0
    for i, chain in enumerate(chains):
        p = run([m, "-i", prompt, *kv, *chain.flags(), "-s", str(5 + i), "-n", "20", "--ignore-eos",
                 "--logprobs", str(N_TOP)], timeout=300)
        assert p.returncode == 0, p.stderr.decode(errors="replace")
        recs = records(p.stdout)
        assert len(recs) == 20, f"{len(recs)} records"
        ids = pids + [r["id"] for r in recs]
        logits = dumped_logits(m, ids[:-1], kv)[len(pids) - 1:]
        total += check_records(recs, pids, logits, chain, f"chain {i}")[0]
        for j in range(len(recs)):  # a penalized token with a negative logit moves every probability (the normalizer)
            window = ids[:len(pids) + j][-chain.last_n:]
            negative += int(any(logits[j][t] < 0 for t in window))
    assert total >= 0.9 * 20 * len(chains), f"only {total} positions checked"
    assert negative >= 20, f"only {negative} positions penalize a token whose logit is negative: nothing tells the signs apart"
    print(f"    {total} positions match; {negative} penalize tokens with negative logits")


COPY = "Repeat the following sentence exactly, word for word: The quick brown fox jumps over the lazy dog near the old river bank."
CODE = "Rename the function add to sum in this code and print the whole code:\ndef add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
PENALTIES = ["--repeat-penalty", "1.2", "--repeat-last-n", "8", "--frequency-penalty", "0.2"]


def lookup_accepted(stderr: bytes) -> int:
    m = re.search(rb"lookup: \d+ drafted, (\d+) accepted", stderr)
    return int(m.group(1)) if m else 0


def test_greedy_penalties_give_the_same_text_and_records_with_lookup():
    """-t 0 with penalties (a window of 8, so that the copied text, further back, is not penalized and drafts
    stand): the text with --lookup 8 and 15 is --lookup 0's byte for byte (-c, plain, chat), and so are the
    --logprobs records, whose distribution is penalized with each verified position's own history (drafts
    before it included) exactly as a decode step at that position."""
    m = model()
    accepted = 0
    for prompt, args in ((COPY, ["-c"]), (CODE, ["-c"]), (COPY, [])):
        base = ["-t", "0", "-n", "48", *PENALTIES, "-i", prompt, *args]
        plain = run([m, *base, "--lookup", "0"])
        recs = run([m, *base, "--lookup", "0", "--logprobs", "5"])
        assert plain.returncode == 0 and recs.returncode == 0, plain.stderr.decode(errors="replace")
        for n in ("8", "15"):
            p = run([m, *base, "--lookup", n, "-v"])
            assert p.stdout == plain.stdout, f"--lookup {n} {args} changed the greedy text:\n{plain.stdout!r}\n{p.stdout!r}"
            accepted += lookup_accepted(p.stderr)
            r = run([m, *base, "--lookup", n, "--logprobs", "5"])
            assert r.stdout == recs.stdout, f"--lookup {n} {args}: the --logprobs records differ from --lookup 0's"
    msgs = f"{COPY}\nNow repeat it once more.\n".encode()
    chat = ["-m", "chat", "-t", "0", "-n", "48", *PENALTIES]
    base, p = run([m, *chat, "--lookup", "0"], stdin=msgs), run([m, *chat, "-v"], stdin=msgs)
    assert p.stdout == base.stdout, f"chat with lookup differs:\n{base.stdout!r}\n{p.stdout!r}"
    accepted += lookup_accepted(p.stderr)
    assert accepted >= 20, f"only {accepted} drafts stood: verification with penalties was hardly exercised"
    print(f"    {accepted} drafts stood")


def test_batch_fields_sample_as_the_flags_do():
    """The batch fields top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty
    (and t): a greedy line with penalties gives the text `./run -i` gives with the same flags (one from the line's
    fields, one from the command line's flags); a line at "t": 1 with "top_k": 1 gives the greedy text; and a
    sampled line's "logprobs" are the numpy chain's kept distribution (its own top-k and top-p, not the command
    line's), with the line's own history, on the f32 model."""
    m = model()
    greedy = Chain(temperature=0.0, repeat=1.3, last_n=16, presence=0.3, frequency=0.5)
    lines = [json.dumps({"prompt": PROMPTS[0], "n": 32, **greedy.batch_fields()}), PROMPTS[1]]
    cli = ["--repeat-penalty", "1.1", "--frequency-penalty", "0.4", "-t", "0", "-n", "32"]
    p = run([m, "--batch", "-", *cli], stdin=("\n".join(lines) + "\n").encode())
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    got = [json.loads(x)["text"] for x in p.stdout.decode().splitlines()]
    alone = [run([m, "-i", PROMPTS[0], *greedy.flags(), "-n", "32"]), run([m, "-i", PROMPTS[1], *cli])]
    assert got == [a.stdout.decode() for a in alone], f"batch {got!r}\nalone {[a.stdout for a in alone]!r}"
    plain = run([m, "-i", PROMPTS[0], "-t", "0", "-n", "32"]).stdout.decode()
    assert plain != got[0], "the penalties changed nothing: the comparison tells nothing"
    line = {"prompt": PROMPTS[1], "n": 32, "t": 1, "top_k": 1}
    p = run([m, "--batch", "-", "-s", "5"], stdin=(json.dumps(line) + "\n").encode())
    greedy_text = run([m, "-i", PROMPTS[1], "-t", "0", "-n", "32"]).stdout.decode()
    assert p.returncode == 0 and json.loads(p.stdout)["text"] == greedy_text, f"top_k 1 at t 1: {p.stdout!r}"

    f32 = str(exported("f32"))
    chain = Chain(temperature=0.8, top_k=3, top_p=0.9, min_p=0.02, repeat=1.2, last_n=24, presence=0.4, frequency=0.2)
    line = {"prompt": PROMPTS[0], "n": 32, "logprobs": N_TOP, **chain.batch_fields()}
    p = run([f32, "--batch", "-", "--kv", "f32", "-s", "3", "--ignore-eos", "-k", "40", "-p", "1"],
            stdin=(json.dumps(line) + "\n").encode())
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    recs = json.loads(p.stdout)["logprobs"]
    assert len(recs) == 32
    pids = prompt_ids(f32, PROMPTS[0], ["--kv", "f32"])
    ids = pids + [r["id"] for r in recs]
    logits = dumped_logits(f32, ids[:-1], ["--kv", "f32"])[len(pids) - 1:]
    checked, ties = check_records(recs, pids, logits, chain, "batch line")
    assert checked >= 28, f"only {checked} of 32 batch positions checked ({ties} near-ties)"


def test_bad_sampling_values_are_usage_errors():
    """Out-of-range values exit 2 with one line naming the flag: a negative penalty, a repetition penalty of 0 (or
    one that is 0 as a float), min-p outside [0, 1], a negative or fractional --repeat-last-n, nan/inf, no value. In a
    batch, the same values in a line's fields give that line an error record naming the field, and the rest runs."""
    m = model()
    cases = [["--min-p", "-0.1"], ["--min-p", "1.5"], ["--min-p", "x"], ["--min-p", "nan"], ["--min-p"],
             ["--repeat-penalty", "-1"], ["--repeat-penalty", "0"], ["--repeat-penalty", "1e-50"], ["--repeat-penalty", "inf"],
             ["--repeat-last-n", "-1"], ["--repeat-last-n", "2.5"], ["--repeat-last-n", ""],
             ["--presence-penalty", "-0.5"], ["--frequency-penalty", "-1"], ["--frequency-penalty", "1e999"]]
    for extra in cases:
        p = run([m, "-i", "hi", "-n", "1", *extra], timeout=60)
        lines = p.stderr.decode().splitlines()
        assert p.returncode == 2 and p.stdout == b"", f"{extra}: exit {p.returncode}"
        assert lines and lines[0].startswith("run: ") and extra[0] in lines[0], f"{extra}: {lines}"
        assert len(lines) == 1, f"{extra}: {lines}"
    bad = [('"top_k": 2.5', '"top_k" must be an integer in [0, 16777216]'),
           ('"top_k": -1', '"top_k" must be an integer in [0, 16777216]'),
           ('"top_p": 0', '"top_p" must be a number in (0, 1]'),
           ('"top_p": 1e-50', '"top_p" must be a number in (0, 1]'),
           ('"min_p": 2', '"min_p" must be a number in [0, 1]'),
           ('"repeat_penalty": 0', '"repeat_penalty" must be a number in [0.01, 100]'),
           ('"repeat_penalty": 1e-50', '"repeat_penalty" must be a number in [0.01, 100]'),
           ('"repeat_last_n": -1', '"repeat_last_n" must be an integer in [0, 1048576]'),
           ('"repeat_last_n": 2.5', '"repeat_last_n" must be an integer'),
           ('"presence_penalty": "x"', '"presence_penalty" must be a number'),
           ('"frequency_penalty": -0.1', '"frequency_penalty" must be a number in [0, 100]')]
    text = "".join('{"prompt": "hi", "n": 2, %s}\n' % field for field, _ in bad) + "hello\n"
    p = run([m, "--batch", "-", "-t", "0"], stdin=text.encode())
    assert p.returncode == 1, f"exit {p.returncode}: {p.stderr.decode(errors='replace')}"
    recs = [json.loads(x) for x in p.stdout.decode().splitlines()]
    assert len(recs) == len(bad) + 1 and "text" in recs[-1], recs[-1]
    for (field, words), r in zip(bad, recs):
        assert words in r.get("error", ""), f"{field}: {r}"


# Issue 35: the extremes every numeric flag and batch field is run through.
EXTREMES = ("0", "5e-324", "1e-38", "1e38", "-1e38", "inf", "-inf", "nan", "-0")
NOT_JSON = ("inf", "-inf", "nan")   # no JSON number: such a batch line is refused as JSON, before its fields
GEN_FLAGS = ("-n", "-t", "-p", "-k", "-s", "--min-p", "--repeat-penalty", "--repeat-last-n", "--presence-penalty",
             "--frequency-penalty", "--logprobs", "--lookup", "--threads", "--ctx")
BATCH_FIELDS = ("n", "t", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
                "logprobs", "id")
REPEATS = "hello hello hello hello"   # repeated tokens in the penalties' window


def finite_json(line: str, where: str):
    """The line parsed as strict JSON (RFC 8259: no NaN/Infinity, no number beyond the double range)."""
    def constant(c):
        raise AssertionError(f"{where}: non-finite number {c} in {line[:200]!r}")

    def number(text):
        x = float(text)
        assert math.isfinite(x), f"{where}: number {text} is not finite as a double in {line[:200]!r}"
        return x
    try:
        return json.loads(line, parse_constant=constant, parse_float=number)
    except ValueError as e:
        raise AssertionError(f"{where}: not valid JSON ({e}): {line[:200]!r}") from None


def check_flag_outcome(p, flag: str, where: str) -> None:
    """Exit 0 with stdout of valid JSON records with finite numbers, or exit 2 with one line naming the flag."""
    err = p.stderr.decode(errors="replace").splitlines()
    if p.returncode == 2:
        assert p.stdout == b"" and err and err[0].startswith("run: ") and flag in err[0], f"{where}: {err}"
        assert len(err) == 1, f"{where}: {err}"
        return
    assert p.returncode == 0 and not err, f"{where}: exit {p.returncode}, stderr {err}"
    for line in p.stdout.decode().splitlines():
        finite_json(line, where)


def test_every_numeric_flag_at_its_extremes():
    """Each numeric flag at 0, a double's denormal, 1e-38 (a float's), +-1e38, +-inf, nan and -0: either a run
    whose --logprobs records (or batch records) are valid JSON with finite numbers, or exit 2 with one line
    naming the flag. `--repeat-penalty 1e-38` printed "logprob":-nan (its penalized logits overflowed)."""
    m = model()
    dump = SCRATCH / "extremes.logits"
    for flag in GEN_FLAGS + ("--exact-batch", "--parallel", "--kv-mem"):
        for v in EXTREMES:
            if flag == "--exact-batch":
                p = run([m, "-i", "hi", "--dump-logits", dump, flag, v], timeout=60)
            elif flag in ("--parallel", "--kv-mem"):
                p = run([m, "--batch", "-", "-n", "2", flag, v], stdin=b"hi\n", timeout=60)
            else:   # greedy (the full softmax is reported) and sampled
                for t in ("0", "0.8"):
                    p = run([m, "-i", REPEATS, "-n", "4", "-s", "1", "--logprobs", "2", "-t", t, flag, v], timeout=60)
                    check_flag_outcome(p, flag, f"-t {t} {flag} {v}")
                continue
            check_flag_outcome(p, flag, f"{flag} {v}")
    dump.unlink(missing_ok=True)


def test_every_numeric_batch_field_at_its_extremes():
    """The same extremes in each numeric batch field: a record whose numbers are all finite, or an error record
    naming the field ("not valid JSON" for inf and nan, which JSON has no number for); one line never stops the
    others. `"repeat_penalty": 1e-40` printed "logprob":-nan."""
    m = model()
    cases = [(f, v, t) for f in BATCH_FIELDS for v in EXTREMES + ("1e-40",) for t in (0, 0.8) if f != "t" or t]
    lines = "".join('{"prompt": "%s", "n": 4, "logprobs": 2, "t": %s, "%s": %s}\n' % (REPEATS, t, f, v) if f != "t" else
                    '{"prompt": "%s", "n": 4, "logprobs": 2, "t": %s}\n' % (REPEATS, v) for f, v, t in cases)
    p = run([m, "--batch", "-", "-s", "1"], stdin=lines.encode(), timeout=300)
    assert p.returncode == 1, f"exit {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}"
    out = p.stdout.decode().splitlines()
    assert len(out) == len(cases), f"{len(out)} records for {len(cases)} lines"
    for (field, v, _), line in zip(cases, out):
        r = finite_json(line, f'"{field}": {v}')
        if "error" in r:
            named = "not valid JSON" if v in NOT_JSON else f'"{field}"'
            assert named in r["error"], f'"{field}": {v}: {r["error"]}'
        else:
            assert v not in NOT_JSON and "text" in r, f'"{field}": {v}: {r}'
