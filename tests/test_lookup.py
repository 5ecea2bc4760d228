"""Lookup decoding (./run --lookup N, on by default): the output must be what plain decoding gives.

1. One set of logits: batched prefill, verification passes (`--dump-logits --exact-batch K`) and decode
   steps (`--no-batch`) give bit-identical logits for every weight type, kernel set and KV cache type.
   Expected values: the engine's own decode steps, the path lookup must not change.
2. Greedy text with lookup equals greedy text without it, byte for byte, on the real model in
   plain generation, `-c` and chat mode, on prompts that copy from their input (where drafts
   stand) and open-ended ones; the copy prompts must actually draft and accept (else the test
   checks nothing).
3. Sampling keeps its distribution: a tiny model designed so that its next token is one of three
   with probabilities near 0.5 / 0.3 / 0.2 (so lookup's drafts both stand and fall), many seeds
   with and without lookup, and a chi-square test of homogeneity per generated position. The
   same test must detect a small real change (temperature 1.0 vs 1.6): it has the power to fail.
   And since a draft stands exactly when the draw plain decoding makes equals it, a seed gives
   the same sampled text with and without lookup, byte for byte.
4. The drafting logic (tests/lookup_driver.c, which includes run.c) against references written
   from its contracts: the copy pointer's search and its moves, and the planner's draft lengths
   against every combination of lengths; and the pointer token by token, with its return to the
   copy after an edit, against a Python model of it (`reference_pointer`) on edited copies.
"""
from __future__ import annotations

import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_MODEL, ROOT, SCRATCH, model, require, run  # noqa: E402
import test_synthetic as ts  # noqa: E402

WORK = SCRATCH / "lookup"
WORK.mkdir(parents=True, exist_ok=True)


def dump(path: Path, ids: list[int], extra: list[str]) -> bytes:
    out = WORK / "logits.bin"
    p = run([path, "--ids", " ".join(map(str, ids)), "--dump-logits", out, *extra], timeout=300)
    assert p.returncode == 0, f"./run {' '.join(extra)}: exit {p.returncode}\n{p.stderr.decode(errors='replace')}"
    return out.read_bytes()


@functools.cache
def kernel_sets() -> tuple[str, ...]:
    """The kernel sets this build runs on this CPU, as ./run lists them for an unknown --kernels name."""
    p = run([require(DEFAULT_MODEL, "run `make model`"), "--kernels", "none", "-i", "x"])
    m = re.search(rb"available: ([^)]*)\)", p.stderr)
    assert p.returncode == 2 and m, f"--kernels none should list the sets: {p.stderr!r}"
    return tuple(m.group(1).decode().split(", "))


def test_prefill_decode_and_verify_logits_are_identical():
    """One set of logits (issue 26): batched prefill (the default --dump-logits), one decode step per token
    (--no-batch) and verification passes of K tokens (--exact-batch K) give bit-identical logits, for every
    weight type, kernel set and KV cache type on the tiny models, and on SmolLM2 and Gemma 3 with prompts
    longer than an attention chunk (256 positions; Gemma's past its 512-position sliding window)."""
    checked = 0
    # the tied model has GQA 6:2 and head_dim 16, the untied one MQA and head_dim 32 (a q8 KV cache needs 32)
    for kind, kvs in (("tied", ("f32", "f16")), ("untied", ("f32", "f16", "q8"))):
        ids = ts.token_ids(kind, 40, seed=5)
        for dtype in ("f32", "f16", "q8_0", "q4_1"):
            path = ts.exported(kind, "f32", dtype)
            for kernels, kv in ((["--kernels", k], v) for k in kernel_sets() for v in kvs):
                ref = dump(path, ids, ["--no-batch", "--kv", kv, *kernels])
                assert dump(path, ids, ["--kv", kv, *kernels]) == ref, (
                    f"{kind} {dtype} {' '.join(kernels)} --kv {kv}: batched prefill differs from decode steps")
                for k in (2, 5, 16):
                    got = dump(path, ids, ["--exact-batch", str(k), "--kv", kv, *kernels])
                    assert got == ref, (f"{kind} {dtype} {' '.join(kernels)} --kv {kv}: "
                                        f"verification passes of {k} tokens differ from decode steps")
                    checked += 1
    # the real models' blocks and shapes, past a chunk of attention (and Gemma's window: with the best set only, the
    # scalar set's 262,144-row output head one token at a time takes minutes; its paths are one function anyway).
    # 270 tokens: 14 positions see two chunks, a verification pass of 7 (252-258) and a prefill pass of 72 (216-287)
    # cross the chunk's end; Gemma's 530: 18 positions past its window, the pass 511-517 crosses it. Each token costs
    # a decode step (Gemma's 262,144-row head: 20 ms of CPU) and a logits row in each of three dumps.
    rng = np.random.default_rng(3)
    for path, n, kvs, sets in ((require(DEFAULT_MODEL, "run `make model`"), 270, ("f16", "q8"), kernel_sets()[1:]),
                               # the scalar set costs ~160 ms of CPU a token here: 16 tokens, two passes of 7 and one of 2
                               (require(DEFAULT_MODEL, "run `make model`"), 16, ("f16",), ("scalar",)),
                               (require(ROOT / "models" / "gemma3-270m.bin", "run `make model-gemma`"), 530, ("f16",),
                                ("",))):
        ids = [int(i) for i in rng.integers(100, 40000, size=n)]
        for k in sets:
            for kv in kvs:
                opts = ["--kv", kv] + (["--kernels", k] if k else [])   # "": the set the engine picks
                ref = dump(path, ids, ["--no-batch", *opts])
                assert dump(path, ids, opts) == ref, f"{path.name}, {k or 'default'} kernels, --kv {kv}: prefill differs from decode"
                assert dump(path, ids, ["--exact-batch", "7", *opts]) == ref, (
                    f"{path.name}, {k or 'default'} kernels, --kv {kv}: verification passes differ from decode steps")
                checked += 2
    print(f"{checked} configurations bit-identical; kernel sets {', '.join(kernel_sets())}")


COPY = "Repeat the following sentence exactly, word for word: The quick brown fox jumps over the lazy dog near the old river bank."
SUMMARY = ("Summarize in one sentence: The city council met on Tuesday to discuss the new park. Residents asked for "
           "more trees, a playground and longer opening hours. The council agreed to plant fifty trees this spring.")
CODE = ("Rename the function add to sum in this code and print the whole code:\n"
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
STORY = "Once upon a time"


def lookup_stats(stderr: bytes) -> tuple[int, int]:
    m = re.search(rb"lookup: (\d+) drafted, (\d+) accepted", stderr)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def test_greedy_text_identical_with_and_without_lookup():
    """Greedy text with lookup equals plain decoding's. The drafts that the passes' measured costs choose vary with
    the machine and its load (a session on another CPU saw 23 stand where this one sees ~60), so the runs whose
    drafts are counted plan them on fixed costs (--lookup-fixed: the same drafts on any machine); one run per
    prompt keeps the measured plan, for the identity alone."""
    m = model()
    accepted_total = 0
    cases = [(COPY, ["-c"], "f16", ("8", "15", "1")), (SUMMARY, ["-c"], "f16", ("8",)), (CODE, ["-c"], "q8", ("8",)),
             (STORY, [], "f16", ("8",)), (COPY, [], "q8", ("15",))]
    for prompt, args, kv, lookups in cases:
        base = run([m, "-t", "0", "-n", "64", "--kv", kv, "--lookup", "0", "-i", prompt, *args])
        assert base.returncode == 0, base.stderr.decode(errors="replace")
        for n, plan in [(n, "--lookup-fixed") for n in lookups] + [("15", "-v")]:
            p = run([m, "-t", "0", "-n", "64", "--kv", kv, "--lookup", n, plan, "-v", "-i", prompt, *args])
            assert p.returncode == 0, p.stderr.decode(errors="replace")
            assert p.stdout == base.stdout, (f"--lookup {n} --kv {kv} {args} changed the greedy text:\n"
                                             f"without: {base.stdout!r}\nwith:    {p.stdout!r}")
            accepted_total += lookup_stats(p.stderr)[1] if plan == "--lookup-fixed" else 0
    assert accepted_total > 30, f"only {accepted_total} drafts stood over the copy prompts: lookup hardly ran"
    # chat mode: the whole conversation is the lookup source
    msgs = f"{COPY}\nNow repeat it once more.\n".encode()
    base = run([m, "-m", "chat", "-t", "0", "-n", "48", "--lookup", "0"], stdin=msgs)
    p = run([m, "-m", "chat", "-t", "0", "-n", "48", "-v", "--lookup-fixed"], stdin=msgs)
    assert base.returncode == 0 and p.returncode == 0, p.stderr.decode(errors="replace")
    assert p.stdout == base.stdout, f"chat with lookup differs:\n{base.stdout!r}\n{p.stdout!r}"
    assert lookup_stats(p.stderr)[1] > 0, "chat: no draft stood"


def test_sampled_text_identical_with_and_without_lookup():
    """A draft stands when the token drawn as plain decoding draws it equals the draft: one seed, one text,
    whatever number of drafts the plan makes (drafts counted on the fixed plan; the measured one for seed 1)."""
    m = model()
    accepted = 0
    for prompt, args in ((COPY, ["-c"]), (CODE, ["-c"]), (STORY, [])):
        for seed in ("1", "2", "3"):
            common = [m, "-t", "0.8", "-s", seed, "-n", "48", "-i", prompt, *args]
            base = run([*common, "--lookup", "0"])
            p = run([*common, "-v", *(["--lookup-fixed"] if seed != "1" else [])])
            assert base.returncode == 0 and p.returncode == 0, p.stderr.decode(errors="replace")
            assert p.stdout == base.stdout, (f"-s {seed}: lookup changed the sampled text:\n"
                                             f"without: {base.stdout!r}\nwith:    {p.stdout!r}")
            accepted += lookup_stats(p.stderr)[1] if seed != "1" else 0
    assert accepted > 10, f"only {accepted} drafts stood: the sampled verification path hardly ran"


@functools.cache
def lookup_driver() -> Path:
    exe = SCRATCH / "lookup_driver"
    # -O0 and no SIMD kernel set (SCALAR_SET_ONLY): the driver includes the whole of run.c (-O2: 25 s of CPU to
    # compile, -O0: 14, -O0 scalar only: about 3), runs no kernel, and runs in 0.1 s either way. gcc's range
    # analysis at -O0 cannot see that read_family's message fits (the -O2 builds check it).
    cc = subprocess.run(["cc", "-O0", "-DSCALAR_SET_ONLY", "-Wno-format-truncation", "-std=c11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", f"-I{ROOT}",
                         str(ROOT / "tests/lookup_driver.c"), str(ROOT / "tokenizer.c"), "-o", str(exe), "-lm"],
                        capture_output=True, text=True)
    assert cc.returncode == 0 and not cc.stderr, f"compile failed:\n{cc.stderr}"
    return exe


def test_drafting_logic_against_references():
    out = subprocess.run([str(lookup_driver())], capture_output=True, text=True, timeout=300)
    print(out.stdout, end="")
    assert out.returncode == 0 and "all lookup checks passed" in out.stdout, out.stdout + out.stderr


# The copy pointer, written from README's "Lookup decoding" and run.c's contract (not from its code): after each
# token joins the text, a pointer whose guess was that token moves on (its run grows); one that missed is dropped,
# and if its run was at least ANCHOR_RUN tokens, where it stood becomes the anchor. Then the search: the longest end
# of the text (at most MATCH_MAX tokens) that occurred before, the latest of equals; when that is shorter than
# RESYNC_BEAT and there is an anchor, the first of the RESYNC_WINDOW tokens from the anchor on (before the last
# token) that equals the last token is the source instead, with a run of its own match plus one.
MATCH_MAX, ANCHOR_RUN, RESYNC_WINDOW, RESYNC_BEAT = 32, 4, 16, 4


def matched(ids: list[int], i: int, n: int) -> int:
    """How many tokens ending at ids[i] equal those ending at ids[n-1] (at most MATCH_MAX)."""
    g = 0
    while g < MATCH_MAX and i - g >= 0 and ids[i - g] == ids[n - 1 - g]:
        g += 1
    return g


def reference_pointer(ids: list[int], first: int, resync: bool = True) -> list[tuple[int, int, int]]:
    """(src, run, anchor) after each token from ids[first - 1] on joined the text (src -1: no pointer)."""
    src, run, anchor, out = -1, 0, 0, []
    for n in range(first, len(ids) + 1):
        if src >= 0 and ids[src] == ids[n - 1]:
            src, run = src + 1, run + 1
        else:
            if src >= 0 and run >= ANCHOR_RUN:
                anchor = src
            run, src = 0, -1
            for i in range(n - 2, -1, -1):   # latest first: a later one replaces an earlier only when longer
                g = matched(ids, i, n)
                if g > run:
                    run, src = g, i + 1
            if resync and run < RESYNC_BEAT and anchor > 0:
                for a in range(anchor, min(anchor + RESYNC_WINDOW, n - 1)):
                    if ids[a] == ids[n - 1]:
                        run, src = matched(ids, a, n) + 1, a + 1
                        break
        out.append((src, run, anchor))
    return out


def edited_copy(rng: np.random.Generator, source: list[int], vocab: int) -> list[int]:
    """An answer that copies `source` with edits: tokens replaced, inserted or left out, one to three at a time."""
    out, i = [], 0
    while i < len(source):
        r = rng.random()
        if r < 0.06:                                  # replace a few tokens
            out += [int(t) for t in rng.integers(0, vocab, size=rng.integers(1, 4))]
            i += int(rng.integers(1, 4))
        elif r < 0.10:                                # insert a few
            out += [int(t) for t in rng.integers(0, vocab, size=rng.integers(1, 4))]
        elif r < 0.13:                                # leave a few out
            i += int(rng.integers(1, 4))
        else:
            out.append(source[i])
            i += 1
    return out


def test_pointer_returns_to_the_copy_after_edits():
    """The copy pointer (lookup_adapt, through lookup_driver --trace) against reference_pointer, a Python model
    written from the contract, token by token, on answers that copy a source with edits: small vocabularies (many
    coincidental matches) and large ones (copies that are the only match). And the resync pays: over the same
    texts, drafts from the pointer stand for more of the answer than from a pointer that always searches."""
    rng = np.random.default_rng(34)
    lines, texts = [], []
    for trial in range(120):
        vocab = (6, 40, 5000)[trial % 3]
        source = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(20, 300)))]
        answer = edited_copy(rng, source, vocab)
        if trial % 4 == 0:
            answer += edited_copy(rng, answer, vocab)   # an answer that copies itself too
        ids = source + answer
        texts.append((ids, len(source) + 1))
        lines.append(f"{len(source) + 1} " + " ".join(map(str, ids)))
    p = subprocess.run([str(lookup_driver()), "--trace"], input="\n".join(lines) + "\n", capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = p.stdout.splitlines()
    assert len(got) == len(texts), f"{len(got)} traces for {len(texts)} texts"
    resyncs, stood = 0, {True: 0, False: 0}
    for t, ((ids, first), line) in enumerate(zip(texts, got)):
        nums = [int(x) for x in line.split()]
        trace = list(zip(nums[0::3], nums[1::3], nums[2::3]))
        want = reference_pointer(ids, first)
        for j, (g, w) in enumerate(zip(trace, want)):
            assert g == w, f"text {t}, after token {first + j - 1}: pointer (src, run, anchor) {g}, expected {w}"
        assert len(trace) == len(want), f"text {t}: {len(trace)} states, expected {len(want)}"
        resyncs += sum(1 for (s, r, a) in want if a > 0 and a <= s - 1 < a + RESYNC_WINDOW)
        for resync in (True, False):
            stood[resync] += sum(s >= 0 and ids[s] == ids[first + j]
                                 for j, (s, _, _) in enumerate(reference_pointer(ids, first, resync)[:-1]))
    assert resyncs > 100, f"only {resyncs} pointer states near an anchor: the edits hardly exercise the resync"
    print(f"guesses that stood: {stood[True]} with the resync, {stood[False]} searching only")
    assert stood[True] > stood[False] * 1.03, f"the resync does not pay: {stood}"


# ----------------------------------------------------------------------------------------------------------------
# Sampling

FAVOURITES = "xyz"  # the designed model's three likely tokens (byte tokens: one character each)
RUNS = 1000
MIN_EACH_WAY = 500  # drafts that stood, and drafts that fell, over the RUNS seeds: both paths taken often


@functools.cache
def concentrated_model() -> Path:
    """A tiny model whose next token is x, y or z with probabilities near 0.5, 0.3, 0.2 whatever the
    context (with small context-dependent changes): the embedding carries a large constant in dimension 0,
    the layers add little, and the output head reads dimension 0 mostly for those three rows. Its text is
    made of x, y and z, so lookup always finds n-grams and its drafts are among the sampler's top 3:
    they stand about as often as they fall."""
    import make_synthetic as ms
    cfg = ms.untied_config(seed=77)
    w = ms.make_weights(cfg)
    w["model.embed_tokens.weight"] *= 0.1
    w["model.embed_tokens.weight"][:, 0] = 10.0
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] *= 0.05
    w["model.norm.weight"][:] = 1.0
    head = w["lm_head.weight"]
    head *= 0.02
    ids = [3 + ord(c) for c in FAVOURITES]  # byte tokens follow the 3 control tokens (make_synthetic.make_tokenizer)
    head[ids, 0] = (0.30, 0.25, 0.21)
    gguf = WORK / "concentrated.gguf"
    ms.write_gguf(gguf, cfg, w, ms.make_tokenizer(cfg.vocab_size), "f32")
    out = WORK / "concentrated.bin"
    p = ts.python([ts.EXPORT, gguf, out])
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return out


def sample_counts(temperature: str, lookup: str, runs: int = RUNS) -> tuple[list[dict[str, int]], int, int]:
    """Per generated position, how often each character came out over `runs` seeds."""
    counts: list[dict[str, int]] = [dict() for _ in range(8)]
    drafted = accepted = 0
    for seed in range(runs):
        p = run([concentrated_model(), "-i", "xyzzy", "-n", "8", "-t", temperature, "-k", "3", "-p", "1", "-s", str(seed),
                 "--lookup", lookup, "--lookup-fixed", "-v", "--threads", "1"])
        assert p.returncode == 0, p.stderr.decode(errors="replace")
        text = p.stdout.decode(errors="replace")
        assert len(text) == 8 and set(text) <= set(FAVOURITES), f"unexpected text {text!r}: the model is not as designed"
        for i, ch in enumerate(text):
            counts[i][ch] = counts[i].get(ch, 0) + 1
        d, a = lookup_stats(p.stderr)
        drafted, accepted = drafted + d, accepted + a
    return counts, drafted, accepted


def combined_p_value(a: list[dict[str, int]], b: list[dict[str, int]]) -> float:
    """One chi-square test of homogeneity over all positions: the positions' statistics and degrees of
    freedom added (the designed model's next token hardly depends on the context, so the positions are
    nearly independent samples)."""
    stat = dof = 0.0
    for x, y in zip(a, b):
        s_, d_ = chi_square_stat(x, y)
        stat, dof = stat + s_, dof + d_
    return chi2_sf(stat, int(dof))


def chi_square_stat(a: dict, b: dict) -> tuple[float, int]:
    """Pearson's chi-square statistic of the test that two samples come from one distribution (categories
    with an expected count below 5 pooled), and its degrees of freedom."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    na, nb = sum(a.values()), sum(b.values())
    rows, pool = [], [0, 0]
    for k in keys:
        ca, cb = a.get(k, 0), b.get(k, 0)
        if (ca + cb) * min(na, nb) / (na + nb) < 5:
            pool[0] += ca
            pool[1] += cb
        else:
            rows.append((ca, cb))
    if sum(pool):
        rows.append(tuple(pool))
    stat = 0.0
    for ca, cb in rows:
        tot = ca + cb
        for c, n in ((ca, na), (cb, nb)):
            e = tot * n / (na + nb)
            stat += (c - e) ** 2 / e
    return stat, len(rows) - 1


def chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution (regularized upper incomplete gamma Q(k/2, x/2)),
    by its series for the lower part; exact enough for a test threshold."""
    if k <= 0:
        return 1.0
    s, xh = k / 2.0, x / 2.0
    term = total = 1.0 / s
    n = 1
    while term > 1e-15 * total and n < 10000:
        term *= xh / (s + n)
        total += term
        n += 1
    lower = math.exp(s * math.log(xh) - xh - math.lgamma(s)) * total if xh > 0 else 0.0
    return max(0.0, 1.0 - lower)


def test_sampled_distribution_unchanged_by_lookup():
    plain, _, _ = sample_counts("1", "0")
    looked, drafted, accepted = sample_counts("1", "8")
    # --lookup-fixed: drafts planned by the text alone, not by the passes' measured times (a faster or a busier
    # machine drafted 21 or 49 times in all, and a few dozen let the count that stood fall under any share)
    assert min(accepted, drafted - accepted) >= MIN_EACH_WAY, (
        f"drafts must both stand and fall often to test both paths (drafted {drafted}, stood {accepted})")
    p = combined_p_value(plain, looked)
    print(f"{RUNS} seeds each, 8 positions x 3 tokens; drafts {drafted}, stood {accepted}; chi-square p = {p:.3f}")
    assert p > 1e-3, f"lookup changed the sampled distribution (p = {p:.2e})"
    # power: the same test tells a small real change of the distribution (x: 0.50 -> 0.43)
    warmer, _, _ = sample_counts("1.6", "0")
    p2 = combined_p_value(plain, warmer)
    print(f"temperature 1.0 vs 1.6: p = {p2:.2e}")
    assert p2 < 1e-3, f"the test cannot tell temperature 1.0 from 1.6 (p = {p2:.3f}): it has no power"
