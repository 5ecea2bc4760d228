#!/usr/bin/env python3
"""Compute the expected token ids of tests/tokenizer/corpus.jsonl with llama.cpp.

The oracle is llama.cpp through llama-cpp-python (`pip install llama-cpp-python`):
`Llama(model_path=GGUF, vocab_only=True).tokenize(text_bytes, add_bos=..., special=...)`.
It is needed only here; the goldens it writes are checked in, so the tests do not need it.

Vocabularies (GGUFs under models/, fetched by the Makefile):
  smollm2         SmolLM2-135M-Instruct.Q4_1.gguf: byte-level BPE, pre-tokenizer "smollm"
  smollm2-gpt2    SmolLM2's vocabulary and merges plus the extra digit / no-merge tokens of
                  variants.py, with tokenizer.ggml.pre = "gpt-2"
  smollm2-llama3  ... with "llama-bpe" (llama.cpp's llama3 splitter, ignore_merges on)
  smollm2-qwen2   ... with "qwen2"
  gemma3          gemma3-270m-q4_k_m.gguf: SentencePiece-style BPE, 262,144 tokens
  gemma3-prefix   the same with tokenizer.ggml.add_space_prefix = true (the Llama 2 rule)
The variants are metadata-only GGUFs written with the gguf package (every key copied, the
changes applied, no tensors); the tests build the matching model files by making the
same changes to the tokenizer section export.py wrote for the original GGUF.

Goldens (tests/tokenizer/goldens/NAME.MODE.txt), one line per corpus entry:
  plain    tokenize(add_bos=False, special=False) for every entry
  special  tokenize(add_bos=True, special=True) for the categories in SPECIAL_CATS
A line holds the ids separated by spaces, or "skip" where the oracle cannot be asked:
for byte-level BPE, input that is not UTF-8 (llama.cpp replaces invalid bytes by U+FFFD
and re-encodes overlong forms, while our tokenizer keeps every byte; it would even abort
on sequences above U+10FFFF). meta.json records versions, hashes and counts.

    python3 tests/tokenizer/make_goldens.py

--aliases writes goldens/pre_aliases.json instead: for every tokenizer.ggml.pre name of ALIASES (the
names llama.cpp's src/llama-vocab.cpp maps to the gpt-2, smollm, llama3 and qwen2 splitters), the
smollm2 variant (SmolLM2's vocabulary plus the extra tokens) named that way, with add_bos_token and
bos_token_id removed so that the name's own defaults count, tokenized by llama.cpp in both modes:
a sha256 of each mode's golden text, and whether it equals the first name of its group's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from make_corpus import entry_bytes, load_corpus  # noqa: E402
from variants import extra_tokens, gpt2_encode  # noqa: E402

GOLDENS = HERE / "goldens"
SMOLLM2_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_GGUF = ROOT / "models" / "gemma3-270m-q4_k_m.gguf"
SPECIAL_CATS = ("special", "chat", "random", "long")

EXTRA = "extra tokens"   # marker in a change set: append variants.extra_tokens()
DROP = None              # a change set value: leave the key out

# tokenizer.ggml.pre names by the splitter llama.cpp uses for them (src/llama-vocab.cpp at
# ggml-org/llama.cpp@0c1e57098: the pre_type each name sets in llama_vocab::impl::load, and the regexes
# llm_tokenizer_bpe gives that pre_type; llama3's with ignore_merges). The first of each group is the
# name the other goldens use.
ALIASES = {
    "gpt2": ["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
             "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"],
    "smollm": ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
    "llama3": ["llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
               "glm4", "glm5"],
    "qwen2": ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"],
}
ALIAS_DROPPED_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id")

# name -> (source GGUF, {key: new value} or None, byte-level BPE?)
VOCABS = {
    "smollm2": (SMOLLM2_GGUF, None, True),
    "smollm2-gpt2": (SMOLLM2_GGUF, {"tokenizer.ggml.pre": "gpt-2", EXTRA: True}, True),
    "smollm2-llama3": (SMOLLM2_GGUF, {"tokenizer.ggml.pre": "llama-bpe", EXTRA: True}, True),
    "smollm2-qwen2": (SMOLLM2_GGUF, {"tokenizer.ggml.pre": "qwen2", EXTRA: True}, True),
    "gemma3": (GEMMA3_GGUF, None, False),
    "gemma3-prefix": (GEMMA3_GGUF, {"tokenizer.ggml.add_space_prefix": True}, False),
}


def with_extra_tokens(name: str, value: list) -> list:
    """Append variants.extra_tokens() to a byte-level BPE GGUF array."""
    extra = extra_tokens()
    if name == "tokenizer.ggml.tokens":
        have = set(value)
        added = [gpt2_encode(text) for text, _ in extra]
        clash = [t for t in added if t in have]
        if clash:
            raise SystemExit(f"make_goldens.py: extra tokens already in the vocabulary: {clash[:5]}")
        return value + added
    if name == "tokenizer.ggml.token_type":
        return value + [1] * len(extra)
    if name == "tokenizer.ggml.merges":
        return value + [f"{gpt2_encode(a)} {gpt2_encode(b)}" for _, m in extra if m for a, b in [m]]
    return value


def write_variant(src: Path, dst: Path, changes: dict) -> None:
    """Copy every metadata key of src into a tensor-less GGUF, with `changes` applied."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in changes and changes[name] is DROP:
            continue
        value = changes.get(name, field.contents())
        if changes.get(EXTRA):
            value = with_extra_tokens(name, value)
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    missing = set(changes) - set(reader.fields) - {EXTRA}
    if missing:
        raise SystemExit(f"make_goldens.py: {src} has no key {missing}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def oracle_can_take(raw: bytes, byte_level: bool) -> bool:
    if not byte_level:
        return True
    try:
        raw.decode("utf-8", "surrogatepass")   # exactly what llama.cpp's decoder round-trips
        return True
    except UnicodeDecodeError:
        return False


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def golden_lines(llm, corpus: list[dict], mode: str, byte_level: bool) -> list[str]:
    """llama.cpp's ids for every corpus entry in `mode` (plain / special), "skip" where it cannot be asked."""
    add_bos = special = mode == "special"
    lines = []
    for entry in corpus:
        raw = entry_bytes(entry)
        if (mode == "special" and entry["cat"] not in SPECIAL_CATS) or not oracle_can_take(raw, byte_level):
            lines.append("skip")
        else:
            lines.append(" ".join(map(str, llm.tokenize(raw, add_bos=add_bos, special=special))))
    return lines


def lines_sha256(lines: list[str]) -> str:
    return hashlib.sha256(("\n".join(lines) + "\n").encode()).hexdigest()


def alias_goldens() -> None:
    """goldens/pre_aliases.json (see --aliases in the module docstring)."""
    import llama_cpp

    corpus = load_corpus()
    out = {"oracle": f"llama-cpp-python {llama_cpp.__version__} (vendored llama.cpp), vocab_only=True",
           "vocabulary": f"{SMOLLM2_GGUF.name} plus variants.extra_tokens(), without {', '.join(ALIAS_DROPPED_KEYS)}",
           "gguf_sha256": sha256(SMOLLM2_GGUF), "aliases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, names in ALIASES.items():
            for name in names:
                path = Path(tmp) / "alias.gguf"
                write_variant(SMOLLM2_GGUF, path, {"tokenizer.ggml.pre": name, EXTRA: True,
                                                   **dict.fromkeys(ALIAS_DROPPED_KEYS, DROP)})
                llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
                rec = {"kind": kind}
                for mode in ("plain", "special"):
                    rec[mode] = lines_sha256(golden_lines(llm, corpus, mode, True))
                del llm
                first = out["aliases"].get(names[0], rec)
                rec["same_as_first"] = {m: rec[m] == first[m] for m in ("plain", "special")}
                out["aliases"][name] = rec
                print(f"{name}: {kind}, same ids as {names[0]}: {rec['same_as_first']}", flush=True)
    (GOLDENS / "pre_aliases.json").write_text(json.dumps(out, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="vocabulary names to regenerate (default: all)")
    ap.add_argument("--aliases", action="store_true", help="write only goldens/pre_aliases.json")
    args = ap.parse_args()
    if args.aliases:
        alias_goldens()
        return 0
    import llama_cpp

    corpus = load_corpus()
    GOLDENS.mkdir(exist_ok=True)
    meta_path = GOLDENS / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.update({"oracle": f"llama-cpp-python {llama_cpp.__version__} (vendored llama.cpp), vocab_only=True",
                 "corpus_entries": len(corpus), "special_categories": list(SPECIAL_CATS)})
    meta.setdefault("goldens", {})
    with tempfile.TemporaryDirectory() as tmp:
        for name, (src, changes, byte_level) in VOCABS.items():
            if args.only and name not in args.only:
                continue
            if not src.exists():
                raise SystemExit(f"make_goldens.py: missing {src} (run make in the repository root to fetch it)")
            gguf_path = src
            if changes:
                gguf_path = Path(tmp) / f"{name}.gguf"
                write_variant(src, gguf_path, changes)
            llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
            for mode, add_bos, special in (("plain", False, False), ("special", True, True)):
                lines = golden_lines(llm, corpus, mode, byte_level)
                skipped = lines.count("skip")
                (GOLDENS / f"{name}.{mode}.txt").write_text("\n".join(lines) + "\n")
                meta["goldens"][f"{name}.{mode}"] = {
                    "gguf": src.name, "gguf_sha256": sha256(src), "changes": changes or {},
                    "add_bos": add_bos, "special": special, "checked": len(corpus) - skipped, "skipped": skipped}
                print(f"{name}.{mode}: {len(corpus) - skipped} strings, {skipped} skipped")
            del llm
    meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
