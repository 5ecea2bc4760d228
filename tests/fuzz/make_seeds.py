#!/usr/bin/env python3
"""Build the seed corpora and fixtures of the fuzz targets (tests/fuzz/README in tests/README.md).

    python3 tests/fuzz/make_seeds.py WORKDIR

Seeds are real files made by the real tools, kept small so that libFuzzer mutates the
interesting bytes and not megabytes of weights:

  models/      tiny llama models (tests/make_synthetic.py shapes, shrunk) exported by export.py
               in every output dtype and native weight type (the K types and K mixes on a 256-wide
               model), tied and untied; tokenizer-only exports of the real
               SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece) GGUFs and of a tiny
               SentencePiece GGUF written here.
  seeds/loader/       the tiny model files                     -> fuzz_loader
  seeds/tok_section/  their tokenizer sections, cut out         -> fuzz_tok_section
  seeds/tokenizer/    [selector byte][text] inputs              -> fuzz_tokenizer
  seeds/gguf/         tiny GGUF files (f32, f16, q8_0, q4_1, SentencePiece)  -> fuzz_export.py gguf
  seeds/safetensors/  model.safetensors of tiny HF dirs (F32, BF16)          -> fuzz_export.py safetensors
  seeds/json/         small JSON documents, valid and not                     -> fuzz_json
  hf_template/        config.json + tokenizer files the safetensors target pairs with each input
  vocab.list          model files whose tokenizers fuzz_tokenizer loads (one path a line; the
                      selector byte of an input picks one)

Re-running is cheap: outputs that exist and are newer than their inputs are kept.
"""
from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import make_synthetic as ms  # noqa: E402  (test helper, shared with test_synthetic.py)
from fuzz import modelfile  # noqa: E402

EXPORT = ROOT / "export.py"
SMOL_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_GGUF = ROOT / "models" / "gemma3-270m-q4_k_m.gguf"
HEADER_BYTES = 256
TOK_OFFSET_AT, TOK_SIZE_AT = 72, 80

# Shapes as small as the format allows while keeping GQA, a tail in every loop and 32-wide blocks.
TINY_TIED = replace(ms.SynthConfig(), dim=32, hidden_dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    vocab_size=300, max_seq_len=64)
TINY_UNTIED = replace(ms.untied_config(), dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=280, max_seq_len=32)
# The smallest shapes whose every row is a whole number of 256-blocks, so the K types cover every matrix.
TINY_K = replace(ms.SynthConfig(), dim=256, hidden_dim=256, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=128,
                 vocab_size=260, max_seq_len=32)

# Texts for the tokenizer target: ordinary prose, code, CJK, control-token look-alikes, invalid
# UTF-8, long runs (the pre-tokenizers' and merge loops' worst cases).
TEXTS = [
    b"Hello world! The three most useful things to know about Python are",
    b"  leading spaces,\ttabs\r\nand CRLF\n\n\nnewlines   trailing  ",
    b"def f(x):\n    return x**2 + 1_000  # comment\n",
    "日本語のテキストと한국어 텍스트, emoji 🙂👍🏽 and accents: café naïve".encode(),
    b"<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\n<bos></s><unk>",
    b"\xff\xfe\x80\xc3\x28\xe2\x82\xed\xa0\x80\xf4\x90\x80\x80\x00nul",
    b"I'm you're we'll they'd IT'S 12345678901234567890 3.14159",
    "\u2581 already escaped \u2581\u2581 spaces".encode(),
    b"a" * 300 + b" " * 100 + b"!" * 50,
    bytes(range(256)),
]


# Documents for the JSON target: every kind of value, escapes and surrogate pairs, raw UTF-8, numbers at the
# double range's edges, nesting around JSON_MAX_DEPTH (64), and a few refusals (duplicate key, lone surrogate).
JSON_SEEDS = [
    b'{"id": 42, "text": "caf\u00e9 \ud83d\ude00", "logprob": -0.125, "top": [{"id": 7, "text": "\n", "logprob": -2.5e-3}]}',
    b' [true, false, null, 0, -0, 1.5E+10, -2e-308, 1.7976931348623157e308, 123456789012345678901] ',
    '{"é中": "😀\u0000\"\\\/\b\f\n\r\t", "": {}, "a": [[], [{}]]}'.encode(),
    b"[" * 63 + b"1" + b"]" * 63,
    b'{"k":' * 65 + b"0" + b"}" * 65,
    b'{"a": 1, "a": 2}',
    b'"\ud800"',
    b'{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}',
    b"[" + b",".join(b'{"n":%d,"s":"%s"}' % (i, b"x" * i) for i in range(40)) + b"]",
    # the memory bound (fuzz_json.c lowers its base): tiny values past it, the same padded with blanks
    # (accepted, while its shorter canonical text is not), short strings, an object of small members
    b"[" + b",".join([b"0"] * 400) + b"]",
    b"[" + b" , ".join([b"0"] * 200) + b"]",
    b"[" + b",".join([b'""'] * 200) + b"]",
    b"{" + b",".join(b'"k%d":{}' % i for i in range(120)) + b"}",
    # strings whose escapes shrink when decoded (one block of the written length); a number that ends the input
    b'"\\u0000\\ud83d\\ude00\\n\\"\\/ \\u00e9"',
    b"-12345678901234567890.5e-3",
    b'{"prompt": "hi", "id": 0.1e-999, "system": "a\\u0000b"}',
]


def newer(out: Path, *inputs: Path) -> bool:
    return out.exists() and all(out.stat().st_mtime >= i.stat().st_mtime for i in inputs if i.exists())


def export(src: Path, out: Path, *flags: str) -> Path:
    if newer(out, src, EXPORT):
        return out
    r = subprocess.run([sys.executable, str(EXPORT), str(src), str(out), *flags], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"make_seeds: export.py {src} failed:\n{r.stderr}")
    return out


def tokenizer_section(model: Path) -> bytes:
    data = model.read_bytes()
    off, size = struct.unpack_from("<QQ", data, TOK_OFFSET_AT)
    return data[off:off + size]


def write_spm_gguf(path: Path) -> Path:
    """A tiny SentencePiece vocabulary: byte fallback, scored merges, control and user-defined tokens."""
    from gguf import GGUFWriter, TokenType

    pieces = ["\u2581", "\u2581t", "he", "\u2581the", "\u2581a", "in", "er", "on", "\u2581th", "\u2581w", "is", "at",
              "en", "re", "\u2581s", "an", "\u2581is", "\u2581\u2581", "\u2581\u2581\u2581\u2581", "ing", "\u2581in", "or"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.UNKNOWN] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))]
    for text, ttype in [("<start_of_turn>", TokenType.CONTROL), ("<end_of_turn>", TokenType.CONTROL),
                        ("<br>", TokenType.USER_DEFINED), ("\n\n", TokenType.USER_DEFINED)]:
        tokens.append(text)
        types.append(ttype)
        scores.append(0.0)
    w = GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-spm")
    w.add_context_length(32)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.add_chat_template("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
                        "{{ message['content'] }}<end_of_turn>\n{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_sources(src: Path) -> dict[str, Path]:
    """The synthetic GGUF/HF sources (rebuilt only when make_synthetic.py changed)."""
    stamp = src / ".stamp"
    if not newer(stamp, Path(ms.__file__), Path(__file__)):
        shutil.rmtree(src, ignore_errors=True)
        ms.make_all(src / "tied", TINY_TIED)
        ms.make_all(src / "untied", TINY_UNTIED, gguf_types=("f32", "q8_0"), hf=False)
        ms.make_all(src / "k", TINY_K, gguf_types=("f32",), hf=False)
        write_spm_gguf(src / "spm.gguf")
        stamp.touch()
    return {"tied": src / "tied", "untied": src / "untied", "k": src / "k", "spm": src / "spm.gguf"}


def check_loader_types(loader: Path) -> None:
    """Every weight type the engine runs (export.py's NATIVE_TYPES, ggml ids) is in some loader seed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_make_seeds", EXPORT)
    exp = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = exp        # its dataclasses look their module up
    spec.loader.exec_module(exp)
    seen = {t.type for f in loader.iterdir() for t in modelfile.tensors(f.read_bytes())}
    missing = [exp.GGML_TYPES[t][0] for t in exp.NATIVE_TYPES if t not in seen]
    if missing:
        raise SystemExit(f"make_seeds: no loader seed holds a tensor of type {', '.join(missing)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=Path)
    args = ap.parse_args()
    work: Path = args.workdir.resolve()
    for p in (SMOL_GGUF, GEMMA_GGUF):
        if not p.exists():
            raise SystemExit(f"make_seeds: missing {p} (make model / the Gemma 3 GGUF fetch)")
    src = make_sources(work / "src")
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)

    loader = []
    for dtype in ("f32", "f16", "q8_0", "q4_1"):
        loader.append(export(src["tied"] / "model.f32.gguf", models / f"tied.{dtype}.bin", "--dtype", dtype))
    loader.append(export(src["tied"] / "model.q4_1.gguf", models / "tied.native-q4_1.bin", "--dtype", "q4_1"))
    loader.append(export(src["tied"] / "hf-bf16", models / "tied.hf-bf16.bin", "--dtype", "f32"))
    # every other native weight type (issue 13): the 32-element types on the tiny model, BF16 kept from the
    # bf16 safetensors, the K types and the llama.cpp-style mixes on 256-wide rows
    for dtype in ("q4_0", "q5_0", "q5_1"):
        loader.append(export(src["tied"] / "model.f32.gguf", models / f"tied.{dtype}.bin", "--dtype", dtype))
    loader.append(export(src["tied"] / "hf-bf16", models / "tied.keep-bf16.bin", "--dtype", "keep"))
    for dtype in ("q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m"):
        loader.append(export(src["k"] / "model.f32.gguf", models / f"k.{dtype}.bin", "--dtype", dtype))
    loader.append(export(src["untied"] / "model.q8_0.gguf", models / "untied.q8_0.bin", "--dtype", "q8_0"))
    loader.append(export(src["untied"] / "model.f32.gguf", models / "untied.f16.bin", "--dtype", "f16"))
    split = models / "untied.q8_0-split.bin"   # the split form (flag bit 5) of the same blocks
    split.write_bytes(bytes(modelfile.split_form((models / "untied.q8_0.bin").read_bytes())))
    loader.append(split)
    spm_tok = export(src["spm"], models / "spm.tok.bin", "--tokenizer-only")
    loader.append(export(src["tied"] / "model.f32.gguf", models / "tied.tok.bin", "--tokenizer-only"))  # BPE, no tensors
    smol_tok = export(SMOL_GGUF, models / "smollm2.tok.bin", "--tokenizer-only")
    gemma_tok = export(GEMMA_GGUF, models / "gemma3.tok.bin", "--tokenizer-only")

    seeds = work / "seeds"
    shutil.rmtree(seeds, ignore_errors=True)
    for target in ("loader", "tok_section", "tokenizer", "gguf", "safetensors", "json"):
        (seeds / target).mkdir(parents=True)
    for m in loader + [spm_tok]:
        shutil.copy(m, seeds / "loader" / m.name)
    for m in (models / "tied.f32.bin", models / "untied.q8_0.bin", spm_tok):
        (seeds / "tok_section" / (m.stem + ".sec")).write_bytes(tokenizer_section(m))

    vocabs = [smol_tok, gemma_tok, models / "tied.f32.bin", spm_tok]
    (work / "vocab.list").write_text("".join(f"{v}\n" for v in vocabs))
    for sel in range(len(vocabs)):
        for flags in (0, 4, 8):          # plain / TOK_PARSE_SPECIAL / TOK_ADD_SPECIAL (see fuzz_tokenizer.c)
            for i, text in enumerate(TEXTS):
                (seeds / "tokenizer" / f"v{sel}-f{flags}-{i}").write_bytes(bytes([sel | flags]) + text)
    for bench in sorted((ROOT / "tests" / "tokenizer" / "bench").glob("*.txt")):
        (seeds / "tokenizer" / f"bench-{bench.stem}").write_bytes(b"\0" + bench.read_bytes()[:2000])

    for i, doc in enumerate(JSON_SEEDS):
        (seeds / "json" / f"doc-{i}.json").write_bytes(doc)

    for name in ("model.f32.gguf", "model.f16.gguf", "model.q8_0.gguf", "model.q4_1.gguf"):
        shutil.copy(src["tied"] / name, seeds / "gguf" / f"tied.{name}")
    shutil.copy(src["untied"] / "model.q8_0.gguf", seeds / "gguf" / "untied.model.q8_0.gguf")
    shutil.copy(src["spm"], seeds / "gguf" / "spm.gguf")

    shutil.copy(src["tied"] / "hf" / "model.safetensors", seeds / "safetensors" / "f32.safetensors")
    shutil.copy(src["tied"] / "hf-bf16" / "model.safetensors", seeds / "safetensors" / "bf16.safetensors")
    tmpl = work / "hf_template"
    shutil.rmtree(tmpl, ignore_errors=True)
    tmpl.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src["tied"] / "hf" / f, tmpl / f)

    check_loader_types(seeds / "loader")
    for target in sorted(p.name for p in seeds.iterdir()):
        files = list((seeds / target).iterdir())
        print(f"make_seeds: {target:12s} {len(files):3d} seeds, largest {max(f.stat().st_size for f in files):,} bytes")


if __name__ == "__main__":
    main()
