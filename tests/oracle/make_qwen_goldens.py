#!/usr/bin/env python3
"""Goldens for Qwen2.5-Coder-1.5B-Instruct Q4_K_M (models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf, `make
model-qwen`) from llama.cpp, for tests/test_qwen.py.

Run once by hand with llama-cpp-python 0.3.36 (and jinja2, the `gguf` package); the output,
tests/golden/qwen2.5_coder_1.5b.json, is checked in and the test only reads it. llama.cpp runs the GGUF
itself, as shipped (Q4_K and Q6_K tensors), the file the engine runs after `export.py` (--dtype keep).

What it records:
  tokenize   llama.cpp's ids (llama_tokenize, the model's own add-special rules, which add no BOS for Qwen)
             of varied texts: code in several languages, English with contractions in both cases, digits
             and numbers in several scripts, CJK, emoji sequences, whitespace runs, combining marks, and
             control-token texts as plain text and parsed (--special): what Qwen2's pre-tokenizer regex
             splits differently from GPT-2's.
  templates  the chat prompt llama-cpp-python builds from the GGUF's own Jinja template
             (tokenizer.chat_template) for one user message, as Llama.create_chat_completion does it
             (Jinja2ChatFormatter, then tokenize(prompt, add_bos=False, special=True)): with no system
             message (the template then writes its default, "You are Qwen, created by Alibaba Cloud. ..."),
             with one from -y, with an empty one, with a multi-line Unicode message.
  runs       greedy continuations (N_CONTINUE tokens at most, one llama_decode per token, stopping at
             llama.cpp's end-of-generation tokens) of plain-text prompts, of single chat turns, and of a
             two-turn chat whose second turn is built from the template (the first answer's ids kept, as a
             chat that keeps its KV cache feeds them); then the whole sequence teacher-forced in one batch:
             top-1, top1-top2 margin and top-10 ids and logits at every position. Each generated token also
             keeps the margin llama.cpp saw when it picked it (greedy_margin).

meta.measured_noise scores other correct computations of the same sequences with the statistics the test
uses (make_family_goldens.noise_stats, from each sequence's second position: FIRST_POSITION below says why;
position_0 holds the first positions' apart): llama.cpp fed one token per llama_decode call, and llama.cpp on an
F32 GGUF holding this file's dequantized weights (llama_model_quantize, ftype ALL_F32; checked equal to the
`gguf` package's dequantization), which rounds no activation to 8 bits: the Q4_K / Q6_K path rounds each
matrix input to 8-bit blocks, so the difference is one full activation-rounding noise, the kind of
difference an engine that rounds on its own carries.

    python3 tests/oracle/make_qwen_goldens.py [--scratch DIR] [--threads 2] [--no-f32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
import make_family_goldens as mg  # noqa: E402
from common import sha256_file  # noqa: E402

QWEN_GGUF = ROOT / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
OUT = ROOT / "tests" / "golden" / "qwen2.5_coder_1.5b.json"
N_CTX = 1024          # every run's sequence fits
N_CONTINUE = 64       # greedy tokens per answer, at most
# The statistics start at each sequence's second position. The first token's hidden state carries Qwen2's
# massive activations (one dimension in the thousands), so whether a matrix rounds its input to 8-bit blocks
# decides its logits there: llama.cpp on F32 weights is 10-15 logits away from llama.cpp on the Q4_K file at
# position 0 (measured; 0.7 at most elsewhere), while two computations that both round agree. Position 0 is
# recorded apart (position_0) and not compared.
FIRST_POSITION = 1

# ---- tokenization texts: (name, text, parse control-token texts) --------------------------------------------------
TOKENIZE: list[tuple[str, str, bool]] = [
    ("python", "import os\n\n\nclass Cache:\n    \"\"\"LRU cache.\"\"\"\n\n    def __init__(self, size: int = 128) -> None:\n"
               "        self._data: dict[str, bytes] = {}\n        self.size = size  # entries\n\n"
               "    @property\n    def full(self):\n        return len(self._data) >= self.size\n\n"
               "print(f\"{os.getcwd()!r:>20}\")\n", False),
    ("c", "#include <stdio.h>\n\nstatic int sum(const int *a, size_t n) {\n\tint s = 0;\n\tfor (size_t i = 0; i < n; i++)"
          "\n\t\ts += a[i];\n\treturn s;\n}\n\nint main(void) { unsigned x = 0xFFu; x >>= 2; printf(\"%u\\n\", x); return 0; }\n",
     False),
    ("javascript", "const add = (a, b) => a + b;\nexport default async function load(url) {\n  const res = await fetch(`${url}?q=1`);"
                   "\n  if (res.status !== 200) throw new Error('bad');\n  return /^[a-z]+$/i.test(res.url) ?? null;\n}\n", False),
    ("rust", "fn longest<'a>(x: &'a str, y: &'a str) -> &'a str {\n    if x.len() > y.len() { x } else { y }\n}\n"
             "let v: Vec<u32> = (0..10).map(|i| i * i).collect();\nprintln!(\"{:?}\", v);\n", False),
    ("go_sql_shell", "func (s *Server) Start() error {\n\treturn http.ListenAndServe(\":8080\", nil)\n}\n"
                     "SELECT id, COUNT(*) AS n FROM orders WHERE total >= 100.50 GROUP BY id ORDER BY n DESC;\n"
                     "for f in *.log; do grep -c ERROR \"$f\" 2>&1 | tee -a out.txt; done && echo $((1+2))\n", False),
    ("html_json", "<div class=\"card\">\n  <a href=\"https://example.com/a/b?c=1&d=2#top\">link</a>\n</div>\n"
                  "{\"name\": \"Ada\", \"tags\": [\"x\", \"y\"], \"score\": -1.5e-3, \"ok\": true, \"none\": null}\n", False),
    ("english", "The quick brown fox didn't jump; it's tired. We've seen they'll wait, I'm sure, and you'd agree.\n"
                "I'M SURE THEY'LL COME. DON'T WORRY, IT'S FINE. She said: \"O'Brien's dog's bone.\"", False),
    # Qwen2's regex takes 's 't 're 've 'm 'll 'd in any case, even when more letters follow: 'TWAS -> 'T WAS.
    ("contractions", "'TWAS 'Tis 'REALLY 'Sdeath 'LLama 'Mighty 'Dunno 'VEry 'realty 'served", False),
    ("digits", "1234567890 3.14159 1,000,000 2024-11-30 07:45:59 0x1F 1e-9 -42 +7 100% $19.99 "
               "\u0661\u0662\u0663 \u096a\u096b \u00bd \u00b2 \u2160\u2161 \uff11\uff12\uff13", False),
    ("cjk", "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002"
            "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca\u3002"
            "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4. \u51fd\u6570 add(a, b) \u8fd4\u56de\u548c\u3002", False),
    ("emoji", "Ship it \U0001F680\U0001F680! \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 "
              "\U0001F1EB\U0001F1F7 \u2764\ufe0f \U0001F642\U0001F643 \u2705done", False),
    ("whitespace", "a  b   c\t\td\n\n\n  e   \n\t \n    f\r\ng\rh      \n        \n                return x\n   ", False),
    ("scripts_marks", "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac, \u0440\u0443\u0441\u0441\u043a\u0438\u0439, "
                      "\u0939\u093f\u0928\u094d\u0926\u0940, \u0627\u0644\u0639\u0631\u0628\u064a\u0629, "
                      "\u05e2\u05d1\u05e8\u05d9\u05ea, cafe\u0301, na\u00efve, \u1e9e, \u0130stanbul", False),
    ("punctuation", "!!!??? ... --- *** ==> <= >= != :: ;; \"quoted\" 'single' `back` (a[b]{c}) @user #tag ~/x_y-z",
     False),
    ("long_words", " supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis "
                   "camelCaseIdentifier snake_case_identifier SCREAMING_SNAKE __dunder__ a.b.c", False),
    ("control_text_plain", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><|fim_prefix|>", False),
    ("control_text_special", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", True),
    ("fim_special", "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c<|fim_middle|>", True),
]

# ---- chat templates: (name, system message or None for the template's default, user message) -------------------
TEMPLATES: list[tuple[str, str | None, str]] = [
    ("default_system", None, "hi there"),
    ("custom_system", "You are a terse assistant. Answer in one line.", "Name three sorting algorithms."),
    ("empty_system", "", "What is a mutex?"),
    ("multiline_unicode", None, "Fix this:\n\tprint('h\u00e9llo \u4e16\u754c \U0001F642')\n\n  done"),
    # The template's text runs on into the message ("user\n" + message is one text between two control tokens),
    # so a message that starts with a line break shares its first token with the template: "\n\n" is one token.
    ("leading_newline", None, "\n  indented, after a blank line"),
    ("system_leading_newline", "\nAnswer in French.", "Hello"),
]

# ---- greedy runs ------------------------------------------------------------------------------------------------
DIJKSTRA = ("import heapq\n\n\ndef dijkstra(graph, source):\n"
            "    \"\"\"Shortest distances from source in a graph {node: [(neighbour, weight), ...]}.\"\"\"\n")
VEC = ("#include <stdlib.h>\n\n/* A growable array of ints. */\ntypedef struct {\n    int *data;\n    size_t len, cap;\n} vec;\n\n"
       "/* Appends x; returns 0, or -1 when memory runs out (v unchanged). */\nstatic int vec_push(vec *v, int x)\n{\n")
PRESS = ("Before the printing press, a book was copied by hand, and a single copy of a long work could take a scribe "
         "many months. When movable metal type arrived in Europe in the fifteenth century,")
# (name, plain text or None, chat user messages or None)
RUNS: list[tuple[str, str | None, list[str] | None]] = [
    ("text_python", DIJKSTRA, None),
    ("text_c", VEC, None),
    ("text_prose", PRESS, None),
    ("chat_c", None, ["Fix the bug in this C function and reply with the fixed function only:\n\n"
                      "int sum(int *a, int n) { int s = 0; for (int i = 0; i <= n; i++) s += a[i]; return s; }"]),
    ("chat_zh", None, ["\u7528\u4e00\u53e5\u8bdd\u89e3\u91ca\u4ec0\u4e48\u662f\u9012\u5f52\u3002"]),
    ("chat_two_turns", None, ["What is the time complexity of binary search? Answer in one short sentence.",
                              "And of linear search?"]),
]


def template_text(llm) -> str:
    return llm.metadata["tokenizer.chat_template"]


def chat_prompt(llm, messages: list[dict]) -> list[int]:
    """The ids Llama.create_chat_completion feeds for `messages` with the GGUF's own template (its
    'chat_template.default' handler): Jinja2ChatFormatter's prompt, tokenized with control texts parsed
    and a BOS only when the formatter did not add the special tokens itself."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    vocab = llm._model.vocab
    import llama_cpp

    eos = llm.detokenize([llama_cpp.llama_vocab_eos(vocab)], special=True).decode()
    bos = llm.detokenize([llama_cpp.llama_vocab_bos(vocab)], special=True).decode()
    fmt = Jinja2ChatFormatter(template=template_text(llm), eos_token=eos, bos_token=bos)
    result = fmt(messages=messages)
    return llm.tokenize(result.prompt.encode(), add_bos=not result.added_special, special=True)


def messages_for(system: str | None, users: list[str], answers: list[str] = ()) -> list[dict]:
    msgs = [] if system is None else [{"role": "system", "content": system}]
    for i, u in enumerate(users):
        msgs.append({"role": "user", "content": u})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def greedy_with_margins(llm, prompt_ids: list[int], n: int) -> tuple[list[int], list[float], bool]:
    """Greedy continuation, one llama_decode per token, with the top1-top2 gap llama.cpp saw at each pick;
    stops after one of llama.cpp's end-of-generation tokens (which is kept, like mg.greedy)."""
    import llama_cpp

    llm.reset()
    llm.eval(prompt_ids)
    out, gaps = [], []
    for _ in range(n):
        row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top2 = np.argsort(-row, kind="stable")[:2]
        out.append(int(top2[0]))
        gaps.append(round(float(row[top2[0]]) - float(row[top2[1]]), 5))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, out[-1]):
            return out, gaps, True
        llm.eval([out[-1]])
    return out, gaps, False


def segment(llm, prompt_ids: list[int], offset: int) -> dict:
    cont, gaps, eog = greedy_with_margins(llm, prompt_ids, N_CONTINUE)
    return {"offset": offset, "prompt_ids": prompt_ids, "continuation_ids": cont, "greedy_margin": gaps,
            "stopped_at_eog": eog,
            "continuation_text": b"".join(mg.piece(llm, t) for t in cont).decode("utf-8", "replace"),
            "continuation_pieces_hex": [mg.piece(llm, t).hex() for t in cont]}


def chat_run(llm, users: list[str]) -> list[dict]:
    """One segment per user turn. A later turn's prompt is the template's rendering of the whole conversation
    (earlier answers as their text) after the ids already in the sequence; it must re-tokenize the earlier
    answers to the very ids generated (else the conversation cannot be told as one sequence: pick another)."""
    segs: list[dict] = []
    seq: list[int] = []
    answers: list[str] = []
    for turn in range(len(users)):
        full = chat_prompt(llm, messages_for(None, users[:turn + 1], answers))
        if full[:len(seq)] != seq:
            raise SystemExit(f"turn {turn + 1}: the template's rendering does not start with the ids so far "
                             f"(an answer re-tokenizes differently): choose another conversation")
        seg = segment(llm, full, len(seq))
        seg["prompt_ids"] = full[len(seq):]
        segs.append(seg)
        seq = full + seg["continuation_ids"]
        if turn + 1 < len(users):
            if not seg["stopped_at_eog"]:
                raise SystemExit(f"turn {turn + 1} did not end within {N_CONTINUE} tokens: choose a shorter question")
            answers.append(b"".join(bytes.fromhex(h) for h in seg["continuation_pieces_hex"][:-1]).decode())
    return segs


def positions_stats(runs: list[dict], others: list[tuple[np.ndarray, np.ndarray]], start: int, stop: int | None) -> dict:
    """mg.noise_stats over positions start:stop of every run."""
    keys = ("top1", "margin", "top10_logits")
    return mg.noise_stats([{k: e[k][start:stop] for k in keys} for e in runs],
                          [(at[start:stop], top1[start:stop]) for at, top1 in others])


def sequence(entry: dict) -> list[int]:
    return [t for s in entry["segments"] for t in s["prompt_ids"] + s["continuation_ids"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/oracle-qwen-scratch"), help="where the F32 GGUF goes")
    ap.add_argument("--threads", type=int, default=mg.N_THREADS)
    ap.add_argument("--no-f32", action="store_true", help="skip the F32 noise source (needs ~7 GB of disk and memory)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    mg.N_THREADS = args.threads
    import llama_cpp

    t0 = time.time()
    llm = mg.open_llama(QWEN_GGUF, N_CTX, N_CTX)
    tokenize = [{"name": n, "text": t, "special": sp, "ids": llm.tokenize(t.encode(), add_bos=True, special=sp)}
                for n, t, sp in TOKENIZE]
    templates = []
    for name, system, user in TEMPLATES:
        ids = chat_prompt(llm, messages_for(system, [user]))
        templates.append({"name": name, "system": system, "user": user, "ids": ids,
                          "text": llm.detokenize(ids, special=True).decode()})
    runs = []
    for name, text, users in RUNS:
        t1 = time.time()
        if text is not None:
            entry = {"name": name, "text": text,
                     "segments": [segment(llm, llm.tokenize(text.encode(), add_bos=True, special=False), 0)]}
        else:
            entry = {"name": name, "users": users, "segments": chat_run(llm, users)}
        entry.update(mg.top_summary(mg.teacher_forced(llm, sequence(entry))))
        runs.append(entry)
        for s in entry["segments"]:
            print(f"[qwen] {name}: {len(s['prompt_ids'])} prompt + {len(s['continuation_ids'])} generated "
                  f"(eog={s['stopped_at_eog']}) :: {s['continuation_text'][:70]!r}", flush=True)
        print(f"[qwen] {name}: {time.time() - t1:.0f}s", flush=True)
    eog_ids = [i for i in range(llama_cpp.llama_vocab_n_tokens(llm._model.vocab))
               if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i)]
    eog = {str(i): llm.detokenize([i], special=True).decode() for i in eog_ids}
    llm.close()

    others = {}
    one = mg.open_llama(QWEN_GGUF, N_CTX, 1)
    others["llamacpp_one_token_per_decode"] = [mg.at_golden_ids(e, mg.teacher_forced(one, sequence(e))) for e in runs]
    one.close()
    conversion = None
    if not args.no_f32:
        args.scratch.mkdir(parents=True, exist_ok=True)
        f32 = args.scratch / "qwen2.5-coder-1.5b.F32.gguf"
        if not f32.exists():
            mg.make_f32_gguf(QWEN_GGUF, f32)
        conversion = mg.verify_f32_gguf(QWEN_GGUF, f32)
        full = mg.open_llama(f32, N_CTX, N_CTX)
        others["llamacpp_f32_same_weights"] = [mg.at_golden_ids(e, mg.teacher_forced(full, sequence(e))) for e in runs]
        full.close()
    noise = {k: positions_stats(runs, v, FIRST_POSITION, None) for k, v in others.items()}
    noise["position_0"] = {k: positions_stats(runs, v, 0, 1) for k, v in others.items()}
    noise["first_position"] = FIRST_POSITION
    margins = np.concatenate([np.asarray(e["margin"][FIRST_POSITION:]) for e in runs])
    noise["margin_quantiles"] = {str(q): float(np.quantile(margins, q)) for q in (0.01, 0.05, 0.1, 0.25, 0.5)}
    noise["positions"] = int(margins.size)

    meta = {"source_gguf": QWEN_GGUF.name, "source_gguf_sha256": sha256_file(QWEN_GGUF),
            "oracle_model": "the source GGUF as shipped (Q4_K and Q6_K tensors)", "settings": mg.settings(N_CTX),
            "tokenize": "llm.tokenize(text, add_bos=True, special=...): the model's add-special rules (no BOS for Qwen)",
            "chat_template": "Jinja2ChatFormatter(GGUF tokenizer.chat_template) as Llama.create_chat_completion "
                             "applies it, tokenized with special=True",
            "chat_template_text": None, "llamacpp_eog_tokens": eog, "n_continue": N_CONTINUE, "top_k": mg.TOP_K,
            "f32_conversion": conversion, "measured_noise": noise,
            "generated_by": "tests/oracle/make_qwen_goldens.py", "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.time() - t0)}
    vocab_only = llama_cpp.Llama(model_path=str(QWEN_GGUF), vocab_only=True, verbose=False)
    meta["chat_template_text"] = template_text(vocab_only)
    vocab_only.close()
    write(args.out, meta, tokenize, templates, runs)
    print("[qwen] noise", json.dumps(noise), flush=True)


def write(path: Path, meta: dict, tokenize: list[dict], templates: list[dict], runs: list[dict]) -> None:
    """Readable meta block, then one compact line per entry (as make_family_goldens.write_json)."""
    def lines(items: list[dict]) -> str:
        return ",\n".join(json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in items)

    with open(path, "w", encoding="utf-8") as f:
        f.write('{"meta": ' + json.dumps(meta, indent=1, sort_keys=True, ensure_ascii=False) + ",\n")
        f.write('"tokenize": [\n' + lines(tokenize) + '\n],\n"templates": [\n' + lines(templates) + "\n],\n")
        f.write('"runs": [\n' + lines(runs) + "\n]}\n")


if __name__ == "__main__":
    main()
