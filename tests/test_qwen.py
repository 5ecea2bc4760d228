"""Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the real model (`make model-qwen`), against llama.cpp.

The GGUF as shipped (Q4_K and Q6_K tensors) is exported with export.py's default (--dtype keep: its
blocks copied bit for bit) into SCRATCH, re-exported whenever export.py or the GGUF is newer, so the test
runs whatever file format export.py writes now. llama.cpp ran the same GGUF: its outputs are in
tests/golden/qwen2.5_coder_1.5b.json, written by tests/oracle/make_qwen_goldens.py (by hand, with
llama-cpp-python; settings and measured noise in its "meta"). Checked:
  * tokenization: `./run --tokenize -i TEXT [--special]` gives llama.cpp's ids exactly;
  * the chat template: `./run -c --tokenize -i USER [-y SYSTEM]` gives the ids of the GGUF's own Jinja template
    as llama-cpp-python renders it (create_chat_completion's way), the default system message included, and
    with a message (or system message) that starts with a line break, whose first token the template's
    "user\n" shares once rendered as one text;
  * teacher-forced top-1 (`--ids ... --dump-logits`, the batched prefill) equals llama.cpp's wherever
    llama.cpp's top1-top2 margin exceeds MARGIN_FACTOR x the largest margin change a correct computation
    showed (meta.measured_noise), on at least MIN_CHECKED positions; and the logits at llama.cpp's top-10 ids
    within TOL_FACTOR x the largest difference measured. Both from each sequence's second position on: at the
    first, Qwen2's massive activations make the logits depend on whether activations are rounded to 8 bits
    by 10-15 (meta.measured_noise.position_0), so it tells a rounding, not an error (every later position
    attends to it, and the greedy text checks it);
  * greedy text (`-i TEXT`, `-c -i USER`, and a two-turn `-m chat` on stdin, whose prefilled blocks are also
    compared with the template's ids) reproduces llama.cpp's answers, and may part from them only at a
    near-tie: a token where either of llama.cpp's own computations (the batch, or the one-token step that
    picked it) had a margin within GREEDY_MARGIN_FACTOR x the largest margin change measured.
Like llama.cpp in the goldens, the engine runs with an F32 KV cache and 2 threads.

Tolerances. The Q4_K / Q6_K matrices round their inputs to 8 bits, llama.cpp and this engine each in their
own way, so the two sit about one activation-rounding noise apart (sqrt(2) x when the roundings are
independent). The goldens measure it with llama.cpp on an F32 file of the same weights, which rounds no
activation; llama.cpp fed one token per call is the second source (it shares llama.cpp's rounding for the
first positions, so it reads lower). The factors are those of tests/test_oracle_quant.py.
"""
from __future__ import annotations

import functools
import json

import numpy as np

import common  # noqa: E402
from common import QWEN_GGUF, RUN, TESTS, gguf_metadata, qwen_model, require, run, sha256_file
from test_oracle import first_divergence

GOLDEN = TESTS / "golden" / "qwen2.5_coder_1.5b.json"
THREADS = 2
CTX = 1024          # the oracle's n_ctx: every golden sequence fits (the model's own 32768 needs a 1.9 GB F32 cache)
KV = "f32"          # llama.cpp's cache in the goldens
TOL_FACTOR = 2.0            # logit bounds: this x the largest difference a correct computation showed
MARGIN_FACTOR = 1.5         # top-1 compared where llama.cpp's gap exceeds this x the largest gap change
GREEDY_MARGIN_FACTOR = TOL_FACTOR   # the one-token decode path rounds on its own too (test_oracle_quant.py)
MIN_CHECKED = 300           # the top-1 test must compare at least this many positions
NOISE_SOURCES = ("llamacpp_one_token_per_decode", "llamacpp_f32_same_weights")
NEVER_A_TIE = float("inf")  # the margin of a separator the engine prints itself (chat's newline after -n)


@functools.cache
def golden() -> dict:
    return json.loads(require(GOLDEN, "checked-in golden; regenerate with tests/oracle/make_qwen_goldens.py").read_text())


@functools.cache
def model() -> str:
    """The engine's file of the very GGUF the goldens were made from."""
    require(RUN, "the engine binary; build it with `make`")
    want = golden()["meta"]["source_gguf_sha256"]
    got = sha256_file(require(QWEN_GGUF, "fetch it with `make model-qwen`"))
    assert got == want, f"{QWEN_GGUF} (sha256 {got}) is not the file the goldens were made from ({want})"
    return str(qwen_model())


def engine(args: list, stdin: bytes | None = None, timeout: float = 600):
    """./run on the model with the oracle's settings; a failed run fails the test."""
    p = run([model(), *args, "--threads", THREADS, "--ctx", CTX, "--kv", KV], stdin=stdin, timeout=timeout)
    assert p.returncode == 0, f"./run {' '.join(map(str, args))[:200]} failed ({p.returncode}): " \
                              f"{p.stderr.decode(errors='replace')[-2000:]}"
    return p


def tolerances() -> dict[str, float]:
    noise = golden()["meta"]["measured_noise"]
    sources = [noise[k] for k in NOISE_SOURCES]
    gap = max(s["margin_change_max"] for s in sources)
    return {"margin": MARGIN_FACTOR * gap, "greedy_margin": GREEDY_MARGIN_FACTOR * gap,
            "max": TOL_FACTOR * max(s["top10_max"] for s in sources),
            "mean": TOL_FACTOR * max(s["top10_mean"] for s in sources)}


def first_position() -> int:
    return golden()["meta"]["measured_noise"]["first_position"]


def sequence(entry: dict) -> list[int]:
    return [t for s in entry["segments"] for t in s["prompt_ids"] + s["continuation_ids"]]


def run_entry(name: str) -> dict:
    return next(e for e in golden()["runs"] if e["name"] == name)


@functools.cache
def ours(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Our argmax at every position of a run's sequence, and our logits at llama.cpp's top-10 ids."""
    e = run_entry(name)
    logits = common.dumped_logits(model(), sequence(e), ["--threads", THREADS, "--ctx", CTX, "--kv", KV])
    return logits.argmax(axis=1), np.take_along_axis(logits, np.asarray(e["top10_ids"]), axis=1).astype(np.float64)


def answer_pieces(entry: dict, turns: int, eog_piece: bytes) -> list[tuple[bytes, float]]:
    """What the engine must print for the first `turns` answers of a run, token by token, each with the
    smaller of llama.cpp's two margins where it was chosen. An answer's end-of-generation token prints as
    eog_piece (chat: its newline; -c and plain text: nothing); an answer cut by -n gets chat's newline,
    which is never a near-tie."""
    out = []
    for s in entry["segments"][:turns]:
        start = s["offset"] + len(s["prompt_ids"]) - 1
        for i, (hexpiece, greedy_gap) in enumerate(zip(s["continuation_pieces_hex"], s["greedy_margin"])):
            last_eog = s["stopped_at_eog"] and i == len(s["continuation_ids"]) - 1
            out.append((eog_piece if last_eog else bytes.fromhex(hexpiece), min(entry["margin"][start + i], greedy_gap)))
        if not s["stopped_at_eog"] and eog_piece:
            out.append((eog_piece, NEVER_A_TIE))
    return out


def divergence(name: str, pieces: list[tuple[bytes, float]], text: bytes) -> str:
    """'' when `text` is the pieces' text, or leaves it only at a near-tie; else what went wrong."""
    i = first_divergence([p for p, _ in pieces], text)
    if i is None:
        return ""
    gap, bound = pieces[i][1], tolerances()["greedy_margin"]
    agreed = b"".join(p for p, _ in pieces[:i])
    print(f"    {name}: parted from llama.cpp at token {i} of {len(pieces)} (llama.cpp margin {gap:.3f}, "
          f"near-tie bound {bound:.3f})")
    if gap <= bound:
        return ""
    return (f"{name}: parted from llama.cpp at token {i} where llama.cpp's margin is {gap:.3f} > {bound:.3f}\n"
            f"  agreed    {agreed[-80:]!r}\n  ours then {text[len(agreed):len(agreed) + 40]!r}\n"
            f"  llama.cpp {b''.join(p for p, _ in pieces[i:i + 8])!r}")


# ----------------------------------------------------------------------------------------------------------------

def test_qwen_goldens_consistent():
    """Complete goldens from this GGUF (its template text), with both noise sources measured and a chat of two
    turns; the bounds they give must leave enough positions to compare."""
    g = golden()
    assert g["meta"]["chat_template_text"] == gguf_metadata(require(QWEN_GGUF, "`make model-qwen`"), "tokenizer.chat_template"), \
        "the GGUF's chat template is not the one the goldens rendered: rerun tests/oracle/make_qwen_goldens.py"
    for e in g["runs"]:
        n = len(sequence(e))
        for key in ("top1", "margin", "top10_ids", "top10_logits"):
            assert len(e[key]) == n, f"{e['name']}: {key} has {len(e[key])} entries, want {n}"
        at = 0
        for s in e["segments"]:
            assert s["offset"] == at, f"{e['name']}: segment at {s['offset']}, want {at}"
            at += len(s["prompt_ids"]) + len(s["continuation_ids"])
            assert len(s["continuation_pieces_hex"]) == len(s["greedy_margin"]) == len(s["continuation_ids"]) > 0
    assert any(len(e["segments"]) >= 2 for e in g["runs"]), "no two-turn chat in the goldens"
    for k in NOISE_SOURCES:
        assert k in g["meta"]["measured_noise"], f"noise source {k} not measured"
    assert all(tolerances()[k] > 0 for k in ("margin", "max", "mean"))


def test_qwen_tokenize_matches_llamacpp():
    failures = []
    for e in golden()["tokenize"]:
        p = engine(["--tokenize", "-i", e["text"]] + (["--special"] if e["special"] else []))
        got = [int(t) for t in p.stdout.split()]
        if got != e["ids"]:
            at = next((i for i, (a, b) in enumerate(zip(got, e["ids"])) if a != b), min(len(got), len(e["ids"])))
            failures.append(f"{e['name']}: first difference at id {at}: ours {got[at:at + 8]}, llama.cpp {e['ids'][at:at + 8]}")
    assert not failures, "tokenization differs from llama.cpp:\n" + "\n".join(failures)


def check_templates(cases: list[dict]) -> None:
    """`-c --tokenize` of each case's message (with its -y) against the template's ids."""
    assert cases, "no such template case in the goldens"
    failures = []
    for t in cases:
        system = [] if t["system"] is None else ["-y", t["system"]]
        got = [int(x) for x in engine(["-c", "--tokenize", "-i", t["user"], *system]).stdout.split()]
        if got != t["ids"]:
            failures.append(f"{t['name']}: ours {got}\n  llama.cpp {t['ids']} ({t['text']!r})")
    assert not failures, "-c prompt ids differ from the template's:\n" + "\n".join(failures)


def test_qwen_chat_template_matches_llamacpp():
    """-c builds the GGUF template's prompt, the default system message when no -y is given included."""
    check_templates([t for t in golden()["templates"] if "leading_newline" not in t["name"]])


def test_qwen_chat_template_message_starting_with_a_line_break():
    """The template renders "<|im_start|>user\n" + MESSAGE as one text: a message (or -y) that starts with a
    line break shares its first token with the template's "\n" ("\n\n" is one token), as llama.cpp and
    transformers tokenize the rendered prompt."""
    check_templates([t for t in golden()["templates"] if "leading_newline" in t["name"]])


def test_qwen_top1_matches_llamacpp():
    bound = tolerances()["margin"]
    failures, checked, total = [], 0, 0
    for e in golden()["runs"]:
        top1, _ = ours(e["name"])
        for pos, (want, gap) in enumerate(zip(e["top1"], e["margin"])):
            if pos < first_position():
                continue
            total += 1
            if gap > bound:
                checked += 1
                if top1[pos] != want:
                    failures.append(f"{e['name']} pos {pos}: ours {top1[pos]}, llama.cpp {want} (margin {gap:.3f})")
    print(f"    top-1 compared at {checked} of {total} positions (llama.cpp margin > {bound:.3f})")
    assert checked >= MIN_CHECKED, f"only {checked} of {total} positions have a margin > {bound:.3f}"
    assert not failures, f"{len(failures)} of {checked} top-1 mismatches:\n" + "\n".join(failures[:20])


def test_qwen_logits_match_llamacpp():
    """Our logits at llama.cpp's top-10 ids of every position, within the measured noise."""
    tol = tolerances()
    diffs, worst, where = [], 0.0, ""
    for e in golden()["runs"]:
        d = np.abs(ours(e["name"])[1] - np.asarray(e["top10_logits"]))[first_position():]
        diffs.append(d.reshape(-1))
        if d.max() > worst:
            pos, k = np.unravel_index(d.argmax(), d.shape)
            pos += first_position()
            worst, where = float(d.max()), f"{e['name']} pos {pos} id {e['top10_ids'][pos][k]}"
    mean = float(np.concatenate(diffs).mean())
    print(f"    |logit diff| at llama.cpp's top-10: max {worst:.3f} ({where}), mean {mean:.4f} "
          f"(bounds {tol['max']:.3f}, {tol['mean']:.4f})")
    assert worst < tol["max"], f"logits differ by {worst:.3g} at {where} (bound {tol['max']:.3g})"
    assert mean < tol["mean"], f"logits differ by {mean:.3g} on average (bound {tol['mean']:.3g})"


def test_qwen_greedy_text_matches_llamacpp():
    """Plain prompts through -i and single chat turns through -c: llama.cpp's greedy answers."""
    failures = []
    for e in golden()["runs"]:
        if len(e["segments"]) != 1:
            continue
        mode = ["-i", e["text"]] if "text" in e else ["-c", "-i", e["users"][0]]
        p = engine([*mode, "-t", 0, "-n", golden()["meta"]["n_continue"]])
        failures.append(divergence(e["name"], answer_pieces(e, 1, b""), p.stdout))
    failures = [f for f in failures if f]
    assert not failures, "greedy text differs from llama.cpp:\n" + "\n".join(failures)


def test_qwen_chat_turns_match_llamacpp():
    """A two-turn chat piped into -m chat: each turn prefills exactly the template's new ids (turn 2: the
    end of answer 1 and the new user turn, everything before it cached), and both answers are llama.cpp's.
    (Single turns through -c: test_qwen_greedy_text_matches_llamacpp.)"""
    for e in (e for e in golden()["runs"] if len(e["segments"]) >= 2):
        segs = e["segments"]
        lines = "".join(u + "\n" for u in e["users"]).encode()
        p = engine(["-m", "chat", "-t", 0, "-n", golden()["meta"]["n_continue"], "--print-prompt-ids"], stdin=lines)
        blocks = [[int(x) for x in line[4:].split()] for line in p.stderr.decode().splitlines() if line.startswith("ids:")]
        assert blocks[:1] == [segs[0]["prompt_ids"]], f"{e['name']} turn 1 fed {blocks[:1]}\n  template {segs[0]['prompt_ids']}"
        pieces = answer_pieces(e, len(segs), b"\n")
        failure = divergence(e["name"] + " (-m chat)", pieces, p.stdout)
        assert not failure, failure
        if first_divergence([q for q, _ in pieces], p.stdout) is None:
            # Both answers are llama.cpp's, so the later blocks are determined: the template's end-of-turn
            # token that closes the previous answer (the generated one is not fed), then the new user turn.
            want = [s["continuation_ids"][-1:] + t["prompt_ids"] for s, t in zip(segs, segs[1:])]
            assert blocks[1:] == want, f"{e['name']}: later turns fed {blocks[1:]}\n  template {want}"
