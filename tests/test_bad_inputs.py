"""Hostile model files, prompts and flags given to ./run: each gets a clear error or a correct result.

One test per row of the bad-input table in tests/README.md (test_readme_table_is_complete checks
that every row names a test that exists). A refused input must give exit status 1 (runtime,
e.g. a damaged file) or 2 (usage), exactly one line on stderr that starts with "run: " and names
the problem, and nothing on stdout. A sanitizer report or a signal fails the test the same way,
so `make sanitize` (RUN_BIN = the ASan/UBSan build) runs this file to catch silent memory errors.

The damaged files are made from a tiny valid model (tests/make_synthetic.py shapes, exported by
export.py) with one defect each, written by tests/fuzz/modelfile.py from export.py's manual ("The model file").
"""
from __future__ import annotations

import concurrent.futures
import math
import os
import re
import resource
import struct
import subprocess
import time
from pathlib import Path

from common import DEFAULT_MODEL, ROOT, RUN, SCRATCH, TESTS, python, require, run

from fuzz import modelfile as mf
from fuzz.make_seeds import TINY_K, TINY_TIED, TINY_UNTIED

WORK = SCRATCH / "bad_inputs"
WORK.mkdir(parents=True, exist_ok=True)
UNUSUAL_EXIT = "exit status {rc} (a signal or a sanitizer abort?)"


# ---------------------------------------------------------------------------------------------
# Fixtures

def exported(out_name: str, config, src_name: str, *flags: str) -> Path:
    """The synthetic model of shape `config` (tests/make_synthetic.py) exported by export.py with `flags`, rebuilt
    when export.py, make_synthetic.py or the shapes (tests/fuzz/make_seeds.py) change."""
    import make_synthetic as ms
    out = WORK / out_name
    inputs = [ROOT / "export.py", TESTS / "make_synthetic.py", TESTS / "fuzz" / "make_seeds.py"]
    if out.exists() and all(out.stat().st_mtime >= p.stat().st_mtime for p in inputs):
        return out
    src = ms.make_all(WORK / src_name, config, gguf_types=("f32",), hf=False)["gguf-f32"]
    r = python([ROOT / "export.py", src, out, *flags])
    assert r.returncode == 0, f"export of {out_name} failed:\n{r.stderr.decode()}"
    return out


def tiny_model() -> Path:
    """A valid 1-layer model (dim 32, vocab 300, ctx 64, head_dim 16, Q8_0, ChatML)."""
    return exported("tiny.q8_0.bin", TINY_TIED, "src", "--dtype", "q8_0")


def two_layer_model() -> Path:
    """A valid untied 2-layer model (tests/fuzz/make_seeds.py TINY_UNTIED, F32)."""
    return exported("tiny-untied.f32.bin", TINY_UNTIED, "src-untied")


def wide_model() -> Path:
    """A valid tied 1-layer model whose rows are 256 wide (tests/fuzz/make_seeds.py TINY_K, F32: 260 x 256 embedding,
    so its last group has 4 rows and 12 padding rows): every weight type fits its rows."""
    return exported("tiny-wide.f32.bin", TINY_K, "src-wide")


def split_model(wv_type: int | None = None) -> Path:
    """The tiny model in the split form (flag bit 5: wq, wk, wv and w1, w3 instead of wqkv and w13; the same
    blocks), optionally with a wv of another type."""
    buf = mf.split_form(tiny_model().read_bytes(), None if wv_type is None else {"layers.0.wv": wv_type})
    path = WORK / f"tiny-split{'' if wv_type is None else f'-wv{wv_type}'}.bin"
    path.write_bytes(bytes(buf))
    return path


def variant(name: str, patch, base: Path | None = None) -> Path:
    """A copy of the tiny model (or of base) changed by patch(bytearray) -> bytearray|None."""
    buf = bytearray((base or tiny_model()).read_bytes())
    buf = patch(buf) or buf
    path = WORK / f"{name}.bin"
    path.write_bytes(bytes(buf))
    return path


def is_asan_build() -> bool:
    return b"__asan_init" in RUN.read_bytes()


# ---------------------------------------------------------------------------------------------
# Checks

def stderr_lines(r: subprocess.CompletedProcess) -> list[str]:
    text = r.stderr.decode("utf-8", "replace")
    # an allocation refused on purpose (test_out_of_memory) makes ASan warn before returning NULL
    return [ln for ln in text.splitlines() if ln.strip() and "WARNING: AddressSanitizer failed to allocate" not in ln]


def expect_error(args: list, code: int, *words: str, stdin: bytes | None = None, env: dict | None = None,
                 preexec=None, timeout: float = 120) -> str:
    """Run ./run; require exit `code`, one 'run: ...' line on stderr holding every word (a usage error,
    exit 2, too: its pointer to -h is on the same line), and empty stdout."""
    r = subprocess.run([str(RUN), *map(str, args)], input=stdin if stdin is not None else b"", capture_output=True,
                       timeout=timeout, env=env, preexec_fn=preexec)
    lines = stderr_lines(r)
    shown = "\n".join(lines[:20])
    assert r.returncode != 0, f"{args}: exit 0, expected an error; stdout {r.stdout[:200]!r}\n{shown}"
    assert r.returncode in (1, 2), f"{args}: " + UNUSUAL_EXIT.format(rc=r.returncode) + f"\n{shown}"
    assert r.returncode == code, f"{args}: exit {r.returncode}, expected {code}:\n{shown}"
    assert len(lines) == 1 and lines[0].startswith("run: "), f"{args}: expected one 'run: ...' line, got:\n{shown}"
    for w in words:
        assert w.lower() in lines[0].lower(), f"{args}: message does not mention {w!r}: {lines[0]}"
    assert r.stdout == b"", f"{args}: wrote to stdout on error: {r.stdout[:200]!r}"
    return lines[0]


def expect_ok(args: list, stdin: bytes | None = None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    r = run(args, stdin=stdin if stdin is not None else b"", timeout=timeout, env=env)
    assert r.returncode == 0, f"{args}: exit {r.returncode}:\n{r.stderr.decode('utf-8', 'replace')[-2000:]}"
    return r


def expect_file_error(patch, *words: str, name: str, base: Path | None = None) -> str:
    """A damaged copy of the tiny model (or of base; file `name`.bin) must be refused: exit 1, one line naming
    the problem."""
    path = variant(name, patch, base)
    msg = expect_error([path, "-i", "hi", "-n", "2"], 1, str(path))
    reason = msg.replace(str(path), "")      # the words must be in the reason, not in the file name
    for w in words:
        assert w.lower() in reason.lower(), f"message does not mention {w!r}: {msg}"
    return msg


def tokens_of(model: Path, text: str) -> list[int]:
    r = expect_ok([model, "--tokenize", "-i", text])
    return [int(x) for x in r.stdout.split()]


# ---------------------------------------------------------------------------------------------
# Model files: whole-file problems

def test_model_missing():
    expect_error([WORK / "no-such-model.bin", "-i", "hi"], 1, "no-such-model.bin", "cannot open", "no such file")


def test_model_is_directory():
    expect_error([WORK, "-i", "hi"], 1, "not a regular file")


def test_model_empty_file():
    empty = WORK / "empty.bin"
    empty.write_bytes(b"")
    expect_error([empty, "-i", "hi"], 1, "not a model file", "0 bytes")


def test_model_is_a_gguf():
    gguf = WORK / "not-exported.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + bytes(300))
    expect_error([gguf, "-i", "hi"], 1, "not a model file", "export.py")


def test_model_truncated():
    full = tiny_model().read_bytes()
    toks = mf.get(full, "tok_offset")
    table = mf.get(full, "table_offset")
    for cut in (100, 255, 256, toks + 10, table + 5, table + mf.TABLE_ENTRY * 3, len(full) - 1):
        path = WORK / f"truncated-{cut}.bin"
        path.write_bytes(full[:cut])
        msg = expect_error([path, "-i", "hi"], 1, "not a model file" if cut < mf.HEADER_BYTES else "truncated")
        if cut >= mf.HEADER_BYTES:
            assert str(cut) in msg and str(len(full)) in msg, f"message should give both sizes: {msg}"


def test_model_bad_version():
    expect_file_error(lambda b: mf.put(b, "version", 3), "version 3", name="version3")
    # a version-1 file (matrices stored as rows): the message says what to do
    expect_file_error(lambda b: mf.put(b, "version", 1), "version 1", "re-export", name="version1")


def test_model_unsupported_architecture():
    expect_file_error(lambda b: mf.put(b, "arch", 5), "architecture", "5", name="arch5")


def test_model_zero_dim():
    expect_file_error(lambda b: mf.put(b, "dim", 0), "dim 0", name="dim0")


def test_model_heads_not_multiple_of_kv_heads():
    def patch(b):
        mf.put(b, "n_heads", 3)
        mf.put(b, "n_kv_heads", 2)
    expect_file_error(patch, "heads", "3", "2", name="heads3kv2")


def test_model_absurd_context_length():
    expect_file_error(lambda b: mf.put(b, "max_seq_len", 0xFFFFFFFF), "4294967295", name="ctx-huge")


def test_model_window_past_context():
    """window is a u32; 0xFFFFFFFF was read as -1, passed the bound and ran with no window at all."""
    for window in (0xFFFFFFFF, 0x7FFFFFFF):
        expect_file_error(lambda b: mf.put(b, "window", window), "sliding window", str(window), name=f"window-{window:x}")
    expect_file_error(lambda b: mf.put(b, "window_pattern", 0xFFFFFFFF), "pattern", "4294967295", name="pattern-ffff")


def test_model_nan_rope_theta():
    expect_file_error(lambda b: mf.put(b, "rope_theta", math.nan), "rope_theta", name="theta-nan")


def test_model_unknown_feature_flags():
    expect_file_error(lambda b: mf.put(b, "flags", 0x41), "feature flag bit 6", name="flags41")


def test_model_unknown_activation():
    expect_file_error(lambda b: mf.put(b, "activation", 2), "activation 2", name="act2")


# Model files: tokenizer section

def test_tokenizer_section_outside_file():
    expect_file_error(lambda b: mf.put(b, "tok_offset", len(b) + 64), "tokenizer", "outside", name="tok-off")


def test_tokenizer_vocab_count_absurd():
    expect_file_error(lambda b: mf.tok_put(b, "n_vocab", 0x3FFFFFFF), "tokenizer", "truncated", name="tok-nvocab")


def test_tokenizer_unknown_kind():
    expect_file_error(lambda b: mf.tok_put(b, "kind", 7), "tokenizer", "kind", name="tok-kind")


def test_tokenizer_special_id_out_of_range():
    expect_file_error(lambda b: mf.tok_put(b, "bos", 300), "tokenizer", "special token", name="tok-bos")


def test_tokenizer_larger_than_embedding():
    def patch(b):
        mf.put(b, "vocab_size", 299)
    msg = expect_file_error(patch, "tokenizer has 300 tokens", name="tok-vs-embedding")
    assert "299" in msg, msg


# Model files: tensor table

def test_tensor_table_outside_file():
    expect_file_error(lambda b: mf.put(b, "table_offset", len(b) - 40), "tensor table", "outside", name="table-off")


def test_tensor_count_absurd():
    expect_file_error(lambda b: mf.put(b, "n_tensors", 0xFFFFFFFF), "tensor table", name="table-n")


def test_tensor_unsupported_type():
    """Q2_K (ggml type 10) is a real GGUF type that the engine does not run."""
    msg = expect_file_error(lambda b: mf.entry_put(b, "tok_embeddings", "type", 10), "tok_embeddings",
                            "unsupported type", name="tensor-q2k")
    assert "10" in msg, msg


def test_tensor_type_id_out_of_range():
    """Type ids past the table (31: one past BF16 = 30; ggml's count 39; 1000; 2^31 - 1) and a retired id inside
    it (4, ggml's removed Q4_2) are refused with the tensor's name and the id, never used to index the table."""
    for tid in (4, 31, 39, 1000, 0x7FFFFFFF):
        msg = expect_file_error(lambda b, tid=tid: mf.entry_put(b, "layers.0.wo", "type", tid), "layers.0.wo",
                                "unsupported type", name=f"tensor-type-{tid}")
        assert str(tid) in msg, msg
    # 2^32 - 1 (all bits set) too; the message prints it as a signed int, so only the words are checked
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wo", "type", 0xFFFFFFFF), "layers.0.wo", "unsupported type",
                      name="tensor-type-max")


def test_tensor_k_type_on_short_rows():
    """Q4_K (type 12) runs natively, but only on rows that are whole blocks of 256: the tiny model's are not."""
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wo", "type", 12), "layers.0.wo", "q4_k", name="tensor-q4k")


def test_tensor_data_past_end():
    past_end = (len(tiny_model().read_bytes()) + 63) // 64 * 64
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.w13", "offset", past_end), "layers.0.w13",
                      "outside the file", name="tensor-off")


def test_tensor_data_misaligned():
    def patch(b):
        mf.entry_put(b, "norm", "offset", mf.tensor(b, "norm").offset + 4)
    expect_file_error(patch, "norm", "misaligned", name="tensor-misaligned")


def test_tensor_size_disagrees_with_shape():
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wo", "size", mf.tensor(b, "layers.0.wo").size - 34),
                      "layers.0.wo", "size", name="tensor-size")


def test_tensor_name_unterminated():
    expect_file_error(lambda b: mf.entry_put(b, "norm", "name", b"n" * mf.NAME_BYTES), "unterminated name",
                      name="tensor-name")


def test_tensor_name_not_printable():
    # a name quoted in an error must not break the one-line rule (found by fuzzing)
    expect_file_error(lambda b: mf.entry_put(b, "norm", "name", b"no\nrm\x14"), "byte 0x0a", "not printable",
                      name="tensor-name-ctrl")


def test_tensor_missing():
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wo", "name", b"layers.0.wX"), "no tensor layers.0.wo",
                      name="tensor-missing")


def test_tensor_wrong_shape():
    def patch(b):   # w2 written as a 64x32 packed matrix (its own size): only the shape is wrong
        out = []
        for t in mf.tensors(b):
            data = b[t.offset:t.offset + t.size]
            if t.name == "layers.0.w2":
                assert (t.rows, t.cols) == (32, 64), (t.rows, t.cols)
                data = mf.pack(t.type, 64, 32, mf.rows_of(b, t))
                out.append((t.name, t.type, 64, 32, data, t.layout))
            else:
                out.append((t.name, t.type, t.rows, t.cols, data, t.layout))
        return mf.relayout(b, out)
    msg = expect_file_error(patch, "layers.0.w2", "64x32", name="tensor-shape")
    assert "32x64" in msg, msg


def test_packed_matrix_size_disagrees_with_its_shape():
    """A packed matrix one group short (truncated), one record short per group, or with a group too many:
    its size disagrees with its shape; refused naming the tensor, before any token."""
    def resize(delta):
        def patch(b):
            out = [(t.name, t.type, t.rows, t.cols, b[t.offset:t.offset + t.size] if t.name != "layers.0.wo"
                    else b[t.offset:t.offset + t.size + min(0, delta)] + bytes(max(0, delta)), t.layout)
                   for t in mf.tensors(b)]
            return mf.relayout(b, out)
        return patch
    t = mf.tensor(tiny_model().read_bytes(), "layers.0.wo")
    assert t.layout == mf.LAYOUT_PACKED, "the tiny model's wo should be packed"
    group = mf.group_bytes(t.type, t.cols)
    for delta, name in ((-group, "group-short"), (group, "group-more"), (-(group // 2), "record-short")):
        msg = expect_file_error(resize(delta), "layers.0.wo", "size", "packed", name=f"packed-{name}")
        assert str(t.size + delta) in msg, msg


def test_matrix_stored_as_rows_or_vector_packed():
    """A matrix whose entry says rows (layout 0) is refused with the advice to re-export; a norm marked
    packed is refused too; an unknown layout value is refused."""
    def as_rows(b):
        out = []
        for t in mf.tensors(b):
            if t.name == "layers.0.w2":
                out.append((t.name, t.type, t.rows, t.cols, mf.rows_of(b, t), mf.LAYOUT_ROWS))
            else:
                out.append((t.name, t.type, t.rows, t.cols, b[t.offset:t.offset + t.size], t.layout))
        return mf.relayout(b, out)
    expect_file_error(as_rows, "layers.0.w2", "re-export", name="matrix-as-rows")
    def norm_packed(b):
        out = []
        for t in mf.tensors(b):
            data = b[t.offset:t.offset + t.size]
            if t.name == "norm":
                out.append((t.name, t.type, t.rows, t.cols, mf.pack(t.type, t.rows, t.cols, data), mf.LAYOUT_PACKED))
            else:
                out.append((t.name, t.type, t.rows, t.cols, data, t.layout))
        return mf.relayout(b, out)
    expect_file_error(norm_packed, "norm", "packed", name="norm-packed")
    expect_file_error(lambda b: mf.entry_put(b, "norm", "layout", 5), "norm", "layout 5", name="entry-layout")


def test_norm_not_f32():
    def patch(b):
        norm = mf.tensor(b, "norm")
        assert norm.offset + norm.size == len(b), "the tiny model's norm should be its last tensor"
        mf.entry_put(b, "norm", "type", 1)      # F16, with the size an F16 vector has; the file ends with it
        mf.entry_put(b, "norm", "size", norm.cols * 2)
        del b[norm.offset + norm.cols * 2:]
        mf.put(b, "file_size", len(b))
    expect_file_error(patch, "norm", "f32", name="norm-f16")


# Model files: layout. The sections and tensors tile the file exactly (export.py's manual, "The model file"):
# the old loader accepted each of these files and generated from the wrong bytes.

def test_tensor_data_inside_header_tokenizer_or_table():
    """A norm read from offset 0 printed 'ointedointed...': the data must lie after the tensor table."""
    base = tiny_model().read_bytes()
    table = mf.get(base, "table_offset")
    for where, at in (("the header", 0), ("the tokenizer section", mf.HEADER_BYTES), ("the tensor table", table)):
        expect_file_error(lambda b: mf.entry_put(b, "norm", "offset", at), "norm", f"lies in {where}",
                          name=f"norm-in-{where.split()[-1]}")


def test_tensor_data_overlaps_or_leaves_gaps():
    first, second = mf.tensors(tiny_model().read_bytes())[:2]
    expect_file_error(lambda b: mf.entry_put(b, second.name, "offset", first.offset), second.name, "overlaps",
                      name="tensor-overlap")
    expect_file_error(lambda b: mf.entry_put(b, first.name, "offset", first.offset + 64), first.name,
                      "not at the first 64-byte boundary", name="tensor-gap")

    def trailing(b):
        b += bytes(64)
        mf.put(b, "file_size", len(b))
    expect_file_error(trailing, "64 bytes follow", name="trailing-bytes")


def test_tensor_set_matches_header():
    """The table lists exactly the tensors the header's shape implies: n_tensors one too many gave
    'blank tensor type 570230918'; n_layers one short ran a 1-layer model from a 2-layer file."""
    n = mf.get(tiny_model().read_bytes(), "n_tensors")
    expect_file_error(lambda b: mf.put(b, "n_tensors", n + 1), f"tensor table has {n + 1} entries",
                      f"has {n} tensors", name="ntensors-plus-one")
    two = two_layer_model()
    n2 = mf.get(two.read_bytes(), "n_tensors")
    expect_file_error(lambda b: mf.put(b, "n_layers", 1), f"tensor table has {n2} entries", "1-layer",
                      name="nlayers-short", base=two)

    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wo", "name", b"layers.1.wo"), "no tensor layers.0.wo",
                      "layers.1.wo", "1-layer", name="layer-beyond-nlayers")
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wo", "name", b"layers.0.wqkv"), "layers.0.wqkv",
                      "twice", name="tensor-duplicate")


def test_split_file_missing_a_part():
    """A split file (wq, wk, wv instead of wqkv) without wk. The split model itself runs and generates what the
    fused one does (the same blocks)."""
    base = split_model()
    want = expect_ok([tiny_model(), "-i", "hi", "-n", "8", "-t", "0"]).stdout
    assert expect_ok([base, "-i", "hi", "-n", "8", "-t", "0"]).stdout == want, "split and fused files differ"
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wk", "name", b"layers.0.wX"), "no tensor layers.0.wk",
                      name="split-no-wk", base=base)

    def drop_wk(b: bytearray) -> bytearray:
        kept = [(t.name, t.type, t.rows, t.cols, bytes(b[t.offset:t.offset + t.size])) for t in mf.tensors(b)
                if t.name != "layers.0.wk"]
        return mf.relayout(b, kept)
    expect_file_error(drop_wk, "(no layers.0.wk)", name="split-without-wk", base=base)


def test_split_flag_and_fused_tensors_disagree():
    """A split file that also has a wqkv (in place of wk); a fused file with the split flag set; a split file
    without it: each names a tensor that the header's flags leave out."""
    expect_file_error(lambda b: mf.entry_put(b, "layers.0.wk", "name", b"layers.0.wqkv"), "layers.0.wqkv",
                      "sets flag bit 5 (split)", name="split-with-wqkv", base=split_model())
    expect_file_error(lambda b: mf.put(b, "flags", mf.get(b, "flags") | mf.FLAG_SPLIT), "layers.0.wqkv",
                      "sets flag bit 5 (split)", name="fused-flagged-split")
    expect_file_error(lambda b: mf.put(b, "flags", mf.get(b, "flags") & ~mf.FLAG_SPLIT), "layers.0.wq",
                      "does not set flag bit 5 (split)", name="split-unflagged", base=split_model())


def test_split_parts_reading_different_activations():
    """wq and wk Q8_0 (int8 activations) beside an F32 wv (float activations): one projection, two inputs."""
    expect_file_error(lambda b: None, "layers.0.wq (q8_0)", "layers.0.wv (f32)", "different activation formats",
                      name="split-mixed-act", base=split_model(wv_type=mf.TYPE_F32))


def test_sections_placed_exactly():
    expect_file_error(lambda b: mf.put(b, "header_size", 512), "header size 512", "256", name="header-512")
    expect_file_error(lambda b: mf.put(b, "tok_size", mf.get(b, "tok_size") + 1), "tokenizer section size",
                      name="tok-size-plus-one")
    expect_file_error(lambda b: mf.put(b, "tok_offset", 512), "tokenizer section", "right after the header",
                      name="tok-moved")
    expect_file_error(lambda b: mf.put(b, "table_offset", mf.get(b, "table_offset") + 64), "tensor table",
                      "first 64-byte boundary", name="table-moved")


def test_reserved_and_padding_bytes_are_zero():
    def header_reserved(b):
        b[200] = 1
    expect_file_error(header_reserved, "reserved byte 200", name="header-reserved")

    def tok_reserved(b):
        b[mf.get(b, "tok_offset") + 50] = 7
    expect_file_error(tok_reserved, "tokenizer section", "reserved byte 50", name="tok-reserved")
    # The tiny model's tensors all fill whole cache lines (no padding between them); the padding after the
    # tokenizer section goes through the same check (check_padding) as the padding before a tensor.
    base = tiny_model().read_bytes()
    tok_end, table = mf.get(base, "tok_offset") + mf.get(base, "tok_size"), mf.get(base, "table_offset")
    assert tok_end < table, "the test needs padding after the tokenizer section"

    def padding(b):
        b[tok_end] = 1
    expect_file_error(padding, f"padding byte {tok_end}", "tensor table", name="padding")


def test_tensor_name_bytes_after_its_nul():
    """The name field is the name, then NUL padding: a byte after the NUL (here 'norm\\0x') is refused."""
    expect_file_error(lambda b: mf.entry_put(b, "norm", "name", b"norm\0x"), "norm", "byte 5 of its name field",
                      "0x78", name="tensor-name-after-nul")
    expect_file_error(lambda b: mf.entry_put(b, "norm", "name", b"norm" + bytes(mf.NAME_BYTES - 5) + b"\x01"),
                      "byte 47 of its name field", "0x01", name="tensor-name-last-byte")


def test_tokenizer_padding_between_arrays():
    """The arrays of the tokenizer section start on 4-byte boundaries; the bytes between them are zero. The tiny
    model's arrays all end on boundaries, so these files are made with a 17-byte default system prompt (3 bytes of
    padding before the text blob): with zeros there it chats; a nonzero padding byte is refused."""
    prompt = b"You are a helper!"
    with_prompt = mf.with_default_system(tiny_model().read_bytes(), prompt)
    assert not mf.problems(with_prompt), mf.problems(with_prompt)
    ok = variant("tok-system-17", lambda b: mf.with_default_system(b, prompt))
    expect_ok([ok, "-c", "-i", "hi", "-n", "1"])
    name, off, size = [a for a in mf.tok_arrays(with_prompt) if a[0] == "default_system"][0]
    assert size == len(prompt) and (off + size) % 4, "the test needs padding after the system prompt"
    for at in (off + size, off + size + 2):
        def after_system(b, at=at):
            b = mf.with_default_system(b, prompt)
            b[at] = 0x20
            return b
        expect_file_error(after_system, "tokenizer section", f"padding byte {at - mf.get(with_prompt, 'tok_offset')}",
                          "after the default system prompt", "0x20", name=f"tok-system-pad-{at}")


def test_tokenizer_unknown_flag_bits():
    """Tokenizer flags: bits 0-2 (add BOS, add EOS, space prefix); an unknown bit is refused by its number."""
    for bit in (3, 31):
        expect_file_error(lambda b, bit=bit: mf.tok_put(b, "flags", mf.tok_get(b, "flags") | 1 << bit),
                          "tokenizer section", f"unknown flag bit {bit}", "add BOS, add EOS, space prefix",
                          name=f"tok-flag-{bit}")


def test_chat_template_unknown_id_is_named():
    """An unknown chat template id (4, 2^32-1) is named; it is not 'no chat template'. Generating without the
    template still runs."""
    for value in (4, 2**32 - 1):
        path = variant(f"chat-template-{value}", lambda b, v=value: mf.tok_put(b, "chat_template", v))
        msg = expect_error([path, "-c", "-i", "hi"], 1, f"chat template id {value} is unknown", "1 ChatML")
        assert "no chat template" not in msg, msg
        expect_ok([path, "-i", "hi", "-n", "2"])


PACKED_TYPES = (0, 1, 30, 2, 3, 6, 7, 8, 12, 13, 14)   # F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K..Q6_K


def test_packed_padding_rows_and_padding_are_zero():
    """A packed matrix's last group: its padding rows hold zero blocks and the bytes after its records are zero
    (export.py's manual, "Packed matrices"). Per weight type, the 256-wide model's tied embedding (260 rows: 4 in the
    last group) is replaced by random blocks packed by tests/fuzz/modelfile.py; which bytes belong to the padding
    rows is found there too (the bytes that change when the padding rows are packed as 0xFF blocks instead of
    zero ones). The file loads; a byte of a padding row changed is refused, naming the row; a byte of a live row
    is not; nor, as export.py's manual says, the padding at the end of a group other than the last."""
    import numpy as np
    base = wide_model().read_bytes()
    emb = mf.tensor(base, "tok_embeddings")
    rows, cols, live = emb.rows, emb.cols, (emb.rows - 1) % mf.PACK_ROWS + 1
    pad_rows = mf.PACK_ROWS - live
    assert emb.layout == mf.LAYOUT_PACKED and pad_rows, "the test needs a packed embedding with padding rows"
    rng = np.random.default_rng(35)
    for ttype in PACKED_TYPES:
        elems, nbytes = mf.BLOCK[ttype]
        row_bytes = cols // elems * nbytes
        data = rng.integers(0, 256, rows * row_bytes, dtype=np.uint8).tobytes()
        packed = mf.pack(ttype, rows, cols, data)
        marked = mf.pack(ttype, rows + pad_rows, cols, data + b"\xff" * (pad_rows * row_bytes))
        group = mf.group_bytes(ttype, cols)
        last = len(packed) - group
        records = cols // elems * nbytes * mf.PACK_ROWS
        own = [i for i in range(last, len(packed)) if packed[i] != marked[i]]
        assert len(own) == pad_rows * row_bytes, (ttype, len(own))
        live_byte = next(i for i in range(last, last + records) if i not in set(own))

        def with_emb(name, at=None):
            body = bytearray(packed)
            if at is not None:
                body[at] ^= 1
            return variant(f"pad-{ttype}-{name}", lambda b: mf.relayout(b, [
                (t.name, ttype, rows, cols, bytes(body), t.layout) if t.name == "tok_embeddings"
                else (t.name, t.type, t.rows, t.cols, b[t.offset:t.offset + t.size], t.layout) for t in mf.tensors(b)]),
                base=wide_model())
        expect_ok([with_emb("ok"), "--tokenize", "-i", "hi"])
        expect_ok([with_emb("live", live_byte), "--tokenize", "-i", "hi"])
        for at in (own[0], own[len(own) // 2], own[-1]):
            path = with_emb(f"row-{at}", at)
            msg = expect_error([path, "--tokenize", "-i", "hi"], 1, "tensor tok_embeddings", "padding row",
                               f"after its {rows} rows", "not a zero block")
            assert f"byte 0x{packed[at] ^ 1:02x} at byte {at - last} of its last group" in msg, msg
        if last + records < len(packed):        # the types whose records do not fill whole cache lines
            path = with_emb("group-pad", last + records)
            expect_error([path, "--tokenize", "-i", "hi"], 1, "tensor tok_embeddings",
                         f"padding byte {records} of its last group is 0x01")
            expect_ok([with_emb("first-group-pad", records), "--tokenize", "-i", "hi"])


def test_nan_weights_give_an_error_not_garbage():
    """Non-finite weights make every logit NaN: the sampler must neither index outside its
    candidates (it did: heap-buffer-overflow in sample_topp, tests/fuzz/regressions/loader/) nor
    print tokens chosen from NaN (greedy picked token 0 forever)."""
    path = require(TESTS / "fuzz" / "regressions" / "loader" / "nan-final-norm.bin", "checked-in regression input")
    for temp in ("0.8", "0"):
        expect_error([path, "-i", "hi", "-n", "4", "-t", temp, "-s", "1"], 1, "non-finite")


def test_absurd_embedding_scale_gives_an_error_not_silence():
    """A finite but absurd embed_scale (the file's header; Gemma's is sqrt(dim)) makes RMSNorm's sum of squares
    overflow, or underflow to 0, while the activations stay finite: each row came out as zeros (or eps's noise),
    every logit equal, and ./run printed nothing with exit 0 (greedy picked token 0, <|endoftext|>). It must
    say the model failed; a subnormal scale is refused with the header."""
    for scale in (1e20, 1e30, 3e38, 1e-20, 1e-30):
        path = variant(f"embed-scale-{scale:g}", lambda b: mf.put(b, "embed_scale", scale))
        for temp in ("0", "0.8"):
            expect_error([path, "-i", "hi", "-n", "4", "-t", temp, "-s", "1"], 1, "non-finite")
    for scale in (1e-45, 1e-39):
        expect_file_error(lambda b: mf.put(b, "embed_scale", scale), "embedding scale", "normal",
                          name=f"embed-scale-{scale:g}")


def test_damaged_header_bytes_never_crash():
    """Every header byte, tokenizer-header byte and byte of the first two tensor entries set to
    0xFF in turn: ./run must load and generate, or refuse with one line, never crash."""
    base = tiny_model().read_bytes()
    tok, table = mf.get(base, "tok_offset"), mf.get(base, "table_offset")
    spots = list(range(0, 108)) + list(range(tok, tok + 48)) + list(range(table, table + 2 * mf.TABLE_ENTRY))

    def one(at: int) -> str | None:
        buf = bytearray(base)
        buf[at] = 0xFF if buf[at] != 0xFF else 0x7F
        path = WORK / f"ff-{at}.bin"
        path.write_bytes(bytes(buf))
        try:
            r = run([path, "-i", "hi there", "-n", "3", "-t", "0.8", "-s", "7", "--threads", "1"], stdin=b"", timeout=60)
        finally:
            path.unlink()
        lines = stderr_lines(r)
        if r.returncode == 0:
            return None if not lines else f"byte {at}: exit 0 but stderr: {lines[:3]}"
        if r.returncode == 1 and len(lines) == 1 and lines[0].startswith("run: "):
            return None
        return f"byte {at}: exit {r.returncode}, stderr: {lines[:5]}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        bad = [m for m in pool.map(one, spots) if m]
    assert not bad, f"{len(bad)} of {len(spots)} damaged files misbehaved:\n" + "\n".join(bad[:10])


# ---------------------------------------------------------------------------------------------
# Prompts

def test_prompt_longer_than_context():
    model = tiny_model()
    text = "the small model reads the text one token at a time " * 4
    n = len(tokens_of(model, text))
    msg = expect_error([model, "-i", text, "--ctx", "16"], 1, "prompt")
    assert str(n) in msg and "16" in msg, f"message should give both counts ({n} tokens, context 16): {msg}"


def test_n_past_context_is_capped():
    model = tiny_model()
    n_prompt = len(tokens_of(model, "Hi"))
    r = expect_ok([model, "-i", "Hi", "-n", "1000", "-t", "0", "-v"])
    note = [ln for ln in r.stderr.decode().splitlines() if "capped" in ln]
    assert note, f"no note about capping -n under -v:\n{r.stderr.decode()}"
    assert "1000" in note[0] and str(64 - n_prompt + 1) in note[0], note[0]
    quiet = expect_ok([model, "-i", "Hi", "-n", "1000", "-t", "0"])
    assert quiet.stderr == b"", f"without -v stderr must stay empty: {quiet.stderr[:300]!r}"
    assert quiet.stdout == r.stdout, "-v changed the generated text"


def test_empty_prompt():
    model = tiny_model()
    expect_error([model, "-i", ""], 1, "prompt is empty")
    expect_error([model], 1, "prompt is empty", stdin=b"")
    expect_error([model], 1, "prompt is empty", stdin=b"\n")   # the one trailing newline is dropped


def test_prompt_of_bytes_without_tokens():
    """SmolLM2 has no token for bytes such as 0xFF (llama.cpp drops them): such a prompt is refused, naming the
    first such byte, by generation and by --tokenize alike (issue 35: --tokenize printed an empty line)."""
    model = require(DEFAULT_MODEL, "make model")
    expect_error([model, "--tokenize"], 1, "byte 0xff (at offset 0)", "vocabulary", stdin=b"\xff\xfe\xc0")
    expect_error([model], 1, "byte 0xff (at offset 0)", "vocabulary", stdin=b"\xff\xfe\xc0")
    expect_error([model, "-i", os.fsdecode(b"\xff\xfe")], 1, "byte 0xff")


def test_prompt_with_nul_and_invalid_utf8():
    model = tiny_model()
    text = b"a\0b\xff\xc3\x28 \xed\xa0\x80 end"
    ids = [int(x) for x in expect_ok([model, "--tokenize"], stdin=text).stdout.split()]
    # the tiny vocabulary (tests/make_synthetic.py): ids 3..258 are the bytes 0..255 in order
    assert 3 + 0 in ids and 3 + 0xFF in ids, f"NUL and 0xFF must survive tokenization: {ids}"
    expect_ok([model, "-n", "3", "-t", "0"], stdin=text)


def test_control_token_text_is_not_injected():
    model = tiny_model()
    plain = tokens_of(model, "<|im_start|>")
    assert len(plain) > 1, f"<|im_start|> in a prompt must stay text without --special: {plain}"
    special = [int(x) for x in expect_ok([model, "--tokenize", "--special", "-i", "<|im_start|>"]).stdout.split()]
    assert special == [1], f"with --special it is the control token 1: {special}"


def test_huge_prompt_is_linear():
    """A 4 MB prompt of one repeated character (the pre-tokenizer's worst case) is tokenized quickly."""
    model = tiny_model()
    t0 = time.time()
    r = expect_ok([model, "--tokenize"], stdin=b"a" * (4 << 20), timeout=120)
    assert len(r.stdout.split()) > 0 and time.time() - t0 < 60, f"took {time.time() - t0:.1f} s"


def test_ids_out_of_vocabulary():
    model = tiny_model()
    expect_error([model, "--ids", "1 300"], 2, "300", "vocabulary")
    expect_error([model, "--ids", "-1"], 2, "-1", "vocabulary")


def test_ids_not_numbers():
    expect_error([tiny_model(), "--ids", "1,x"], 2, "not a list of token ids")


# ---------------------------------------------------------------------------------------------
# Flags

def test_flag_numbers_out_of_range():
    model = tiny_model()
    cases = [("-n", "-1"), ("-n", "abc"), ("-n", "99999999999999999999"), ("-t", "nan"), ("-t", "inf"), ("-t", "-1"),
             ("-p", "0"), ("-p", "1.5"), ("-k", "-1"), ("-s", "-5"), ("--threads", "0"), ("--ctx", "0")]
    for flag, value in cases:
        expect_error([model, "-i", "hi", flag, value], 2, flag, f"'{value}'")


def test_flag_unknown():
    expect_error([tiny_model(), "-i", "hi", "--bogus"], 2, "unknown option", "--bogus")


def test_flag_missing_value():
    expect_error([tiny_model(), "-i", "hi", "-n"], 2, "-n needs a value")


def test_flag_bad_choice():
    expect_error([tiny_model(), "-i", "hi", "--kv", "f8"], 2, "--kv", "f8")
    expect_error([tiny_model(), "-i", "hi", "-m", "bogus"], 2, "-m", "bogus")


def test_no_model_or_two_models():
    expect_error(["-i", "hi"], 2, "no model file")
    model = tiny_model()
    expect_error([model, model, "-i", "hi"], 2, "unexpected argument")


def test_ctx_larger_than_model():
    expect_error([tiny_model(), "-i", "hi", "--ctx", "100"], 2, "--ctx 100", "64")


def test_kv_q8_with_unsuitable_head_dim():
    expect_error([tiny_model(), "-i", "hi", "--kv", "q8"], 2, "--kv q8", "16")


def test_tiny_temperature():
    """-t 2e-38 made logits/T overflow to inf, softmax NaN, and sample_topp read cand[-1]."""
    r = expect_ok([tiny_model(), "-i", "hi", "-n", "4", "-t", "2e-38", "-s", "1"])
    assert r.stderr == b"", r.stderr[:500]


def test_threads_far_beyond_cores():
    """--threads 1024 on a 2-core machine: spinning barriers across 1024 threads took minutes for
    three tokens. It must still finish promptly (and give the same text as one thread)."""
    model = tiny_model()
    one = expect_ok([model, "-i", "hi", "-n", "3", "-t", "0", "--threads", "1"])
    t0 = time.time()
    many = expect_ok([model, "-i", "hi", "-n", "3", "-t", "0", "--threads", "1024"], timeout=300)
    took = time.time() - t0
    assert many.stdout == one.stdout, "thread count changed the output"
    assert took < 20, f"--threads 1024 took {took:.1f} s for 3 tokens of a 1-layer model"


def test_chat_flag_without_template():
    no_template = variant("no-chat-template", lambda b: mf.tok_put(b, "chat_template", 0))
    expect_error([no_template, "-c", "-i", "hi"], 1, "chat template")


def test_dump_logits_unwritable():
    expect_error([tiny_model(), "-i", "hi", "--dump-logits", WORK / "no-dir" / "x.bin"], 1, "cannot write", "no-dir")


def test_ppl_file_missing():
    expect_error([tiny_model(), "--ppl", WORK / "no-such.txt", "--ctx", "32"], 1, "cannot open", "no-such.txt")


def test_stdout_closed_early():
    """The reader of stdout goes away: exit 0, no SIGPIPE death, no error spew (documented in -h)."""
    p = subprocess.Popen([str(RUN), str(tiny_model()), "-i", "hi", "-n", "60", "-t", "0"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read()
    rc = p.wait(timeout=60)
    assert rc == 0 and not [ln for ln in err.decode().splitlines() if ln.strip()], f"exit {rc}, stderr {err[:300]!r}"


def ppl_text() -> Path:
    """A text file of a few hundred tokens for --ppl on the tiny model."""
    path = WORK / "ppl.txt"
    path.write_text("the small model reads the text one token at a time. " * 20)
    return path


def test_stdout_full_or_closed():
    """Every mode: a stdout that cannot take the output is an error (exit 1, one line), not a lost
    result with exit 0 (--ppl, -h) or a silent exit 1 (generate, chat, --tokenize)."""
    model, text = tiny_model(), ppl_text()
    modes = {"generate": ["-i", "hi", "-n", "4", "-t", "0"], "tokenize": ["--tokenize", "-i", "hi"],
             "chat": ["-m", "chat", "-n", "3", "-t", "0"], "ppl": ["--ppl", text, "--ctx", "32"], "help": ["-h"]}
    for mode, args in modes.items():
        cmd = [str(RUN), str(model), *map(str, args)]
        with open("/dev/full", "wb") as full:
            r = subprocess.run(cmd, input=b"hi\n", stdout=full, stderr=subprocess.PIPE, timeout=120)
        lines = stderr_lines(r)
        assert r.returncode == 1 and lines == ["run: cannot write to stdout: No space left on device"], \
            f"{mode} > /dev/full: exit {r.returncode}, stderr {lines}"
        quoted = " ".join("'" + c.replace("'", "'\\''") + "'" for c in cmd)
        r = subprocess.run(["bash", "-c", f"{quoted} >&-"], input=b"hi\n", stderr=subprocess.PIPE, timeout=120)
        lines = stderr_lines(r)
        assert r.returncode == 1 and len(lines) == 1 and "cannot write to stdout" in lines[0], \
            f"{mode} with stdout closed: exit {r.returncode}, stderr {lines}"


def test_dump_logits_never_leaves_a_partial_file():
    """--dump-logits writes a temporary file and renames it: under a file-size limit (SIGXFSZ killed the
    run), FILE keeps its old contents and no temporary file stays; a device or symlink is not replaced."""
    model = tiny_model()
    out = WORK / "dump" / "logits.bin"
    out.parent.mkdir(exist_ok=True)
    for f in out.parent.iterdir():
        f.unlink()
    out.write_bytes(b"old")

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
    expect_error([model, "-i", "the small model " * 4, "--dump-logits", out], 1, "cannot write", "file too large",
                 preexec=small_files)
    assert out.read_bytes() == b"old" and [f.name for f in out.parent.iterdir()] == ["logits.bin"], \
        f"left behind: {sorted(f.name for f in out.parent.iterdir())}"
    expect_error([model, "-i", "hi", "--dump-logits", "/dev/full"], 1, "/dev/full", "not a regular file")
    link = out.parent / "link.bin"
    link.symlink_to(out)
    expect_error([model, "-i", "hi", "--dump-logits", link], 1, "not a regular file")
    assert link.is_symlink() and out.read_bytes() == b"old"
    expect_ok([model, "-i", "hi", "--dump-logits", out])
    assert out.stat().st_size == len(tokens_of(model, "hi")) * 300 * 4 and len(list(out.parent.iterdir())) == 2


def test_dump_logits_onto_the_model_file():
    """--dump-logits naming the model file (or a hard link to it) ran to the end and renamed the logits over
    the model: exit 0, and the next run found no model. It is refused, and the file stays as it was."""
    copy = WORK / "dump-onto-model.bin"
    copy.write_bytes(tiny_model().read_bytes())
    link = WORK / "dump-onto-model-link.bin"
    link.unlink(missing_ok=True)
    os.link(copy, link)
    before = copy.read_bytes()
    for target in (copy, link):
        expect_error([copy, "-i", "hi", "--dump-logits", target], 1, "--dump-logits", "model file")
        assert copy.read_bytes() == before and link.read_bytes() == before, f"{target}: the model was changed"
    expect_ok([copy, "-i", "hi", "-n", "1"])


def test_flags_that_would_be_ignored_or_name_no_file():
    """A flag that the rest of the command line makes meaningless, and an empty file name, are usage errors
    (they were ignored, or read as the default, or named in an error as ''): exit 2, one line."""
    model = tiny_model()
    expect_error([model, "-i", "hi", "-n", "1", "--no-batch"], 2, "--no-batch", "--dump-logits")
    expect_error([model, "-i", "hi", "-n", "1", "--exact-batch", "4"], 2, "--exact-batch", "--dump-logits")
    expect_error([model, "-i", "hi", "--no-batch", "--exact-batch", "4", "--dump-logits", WORK / "x.f32"], 2,
                 "--no-batch", "--exact-batch")
    expect_error([model, "-i", "hi", "-n", "1", "--kernels", ""], 2, "--kernels", "''")
    expect_error(["", "-i", "hi"], 2, "model file name is empty")
    for flag in ("--dump-logits", "--ppl", "--batch", "--json-schema", "--prompt-cache"):
        expect_error([model, flag, ""], 2, flag, "''")


def chat_two_turns(path: Path, *flags: str, cut: bool = False) -> tuple[int, bytes, str]:
    """Two chat turns on the model at path (exit status, stdout, stderr); with cut the file is truncated
    between them, once the first answer shows the weights in use."""
    p = subprocess.Popen([str(RUN), str(path), "-m", "chat", "-n", "4", "-t", "0", *flags], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.stdin.write(b"hi\n")
        p.stdin.flush()
        first = p.stdout.readline()
        if cut:
            os.truncate(path, 4096)
        p.stdin.write(b"hello again\n")
        p.stdin.close()
        rc = p.wait(timeout=60)
    finally:
        p.kill()
    return rc, first + p.stdout.read(), p.stderr.read().decode()


def test_model_file_shrinks_while_in_use():
    """Truncating the model between chat turns killed the run with SIGBUS (exit 135, no message)."""
    copy = WORK / "shrinking.bin"
    copy.write_bytes(tiny_model().read_bytes())
    rc, _, err = chat_two_turns(copy, cut=True)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1, f"exit {rc} (" + UNUSUAL_EXIT.format(rc=rc) + f"), stderr {lines}"
    assert lines == [f"run: {copy}: the model file changed or shrank while in use"], lines


def test_model_file_shrinks_while_in_use_with_hugepages():
    """With --hugepages the run reads the model into memory of its own: truncating the file between chat turns
    changes nothing, and the answers are the ones an untouched file gives."""
    copy = WORK / "shrinking-copied.bin"
    copy.write_bytes(tiny_model().read_bytes())
    rc, out, err = chat_two_turns(copy, "--hugepages", cut=True)
    assert rc == 0 and err == "", f"exit {rc}, stderr {err!r}"
    assert (rc, out, err) == chat_two_turns(tiny_model(), "--hugepages"), out


def test_model_is_a_fifo():
    """A FIFO as the model path hung forever in open()."""
    fifo = WORK / "model.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    expect_error([fifo, "-i", "hi"], 1, "not a regular file", timeout=20)


def test_endless_input_is_capped():
    """/dev/zero as the prompt, the --ppl text or the chat: read until memory ran out. A prompt cannot
    exceed the context (ctx x the longest token's bytes); --ppl reads at most 64 MiB."""
    model = tiny_model()
    with open("/dev/zero", "rb") as zero:
        for args, words in (([model], ["prompt on stdin", "longer than", "context of 64 tokens"]),
                            ([model, "-m", "chat"], ["chat message", "longer than", "context of 64 tokens"])):
            r = subprocess.run([str(RUN), *map(str, args)], stdin=zero, capture_output=True, timeout=60)
            lines = stderr_lines(r)
            assert r.returncode == 1 and len(lines) == 1 and all(w in lines[0] for w in words), (args, r.returncode, lines)
    expect_error([model, "--ppl", "/dev/zero", "--ctx", "32"], 1, "/dev/zero", "longer than 67108864 bytes", "64 MiB",
                 timeout=60)


def test_ppl_context_too_small():
    """--ppl --ctx 1 or 2 printed 'perplexity: -nan over 0 tokens' with exit 0."""
    for ctx in ("1", "2"):
        expect_error([tiny_model(), "--ppl", ppl_text(), "--ctx", ctx], 2, "--ppl needs --ctx 3")


def test_chat_treats_input_like_generate():
    """Chat -n 0 printed a token (generate prints none); a directory or a closed stdin ended the chat with
    exit 0 and no message (generate reports them)."""
    model = tiny_model()
    r = expect_ok([model, "-m", "chat", "-n", "0", "-t", "0"], stdin=b"hi\nthere\n")
    assert r.stdout == b"\n\n", f"-n 0 must answer with empty lines: {r.stdout!r}"
    directory = os.open(WORK, os.O_RDONLY)
    try:
        r = subprocess.run([str(RUN), str(model), "-m", "chat"], stdin=directory, capture_output=True, timeout=60)
    finally:
        os.close(directory)
    assert r.returncode == 1 and stderr_lines(r) == ["run: cannot read a chat message on stdin: Is a directory"], \
        (r.returncode, stderr_lines(r))
    r = subprocess.run(["bash", "-c", f"'{RUN}' '{model}' -m chat <&-"], capture_output=True, timeout=60)
    assert r.returncode == 1 and stderr_lines(r) == ["run: cannot read a chat message on stdin: Bad file descriptor"], \
        (r.returncode, stderr_lines(r))


def test_chat_message_too_long_names_what_does_not_fit():
    """'message too long: 10 tokens, the context holds 40' named neither the system turn nor the answer's room."""
    model = tiny_model()
    message = "word " * 30
    # -c builds the same opening (system turn) and user turn as the chat's first message
    wrapped = len(tokens_of_args(model, ["--tokenize", "-c", "-i", message]))
    # --ctx 64: at 40 not even an empty message fits beside the system turn and the answer's room, which ends
    # the chat with an error (issue 35, test_chat.test_chat_system_prompt_that_fills_the_context_is_an_error)
    r = expect_ok([model, "-m", "chat", "--ctx", "64", "-n", "8", "-t", "0"], stdin=message.encode() + b"\n")
    lines = stderr_lines(r)
    assert r.stdout == b"\n" and len(lines) == 1 and "message too long" in lines[0], lines
    m = re.search(r"the conversation.s opening \((\d+) tokens\) \+ this message \((\d+)\) \+ room for the answer \((\d+)\) = (\d+) "
                  r"tokens, but the context holds (\d+)", lines[0])
    assert m, lines[0]
    system, msg, answer, total, ctx = map(int, m.groups())
    assert system + msg == wrapped and answer == 8 and total == wrapped + 8 and ctx == 64, (lines[0], wrapped)


def tokens_of_args(model: Path, args: list) -> list[int]:
    return [int(x) for x in expect_ok([model, *args]).stdout.split()]


def test_conflicting_options():
    """Combinations that used to be accepted with one option silently ignored (--ppl with -i printed a
    perplexity; --tokenize with chat an empty line; --dump-logits with chat an empty file)."""
    model, text = tiny_model(), str(ppl_text())
    dump = WORK / "conflict.bin"
    cases = [(["--ppl", text, "-i", "hi"], "--ppl", "-i"), (["--ppl", text, "-m", "chat"], "--ppl", "-m chat"),
             (["--ppl", text, "--dump-logits", dump], "--ppl", "--dump-logits"),
             (["--ppl", text, "--tokenize"], "--ppl", "--tokenize"),
             (["--tokenize", "-m", "chat"], "-m chat", "--tokenize"), (["-c", "--ids", "1 2"], "-c", "--ids"),
             (["-m", "chat", "--dump-logits", dump], "-m chat", "--dump-logits")]
    for args, x, y in cases:
        expect_error([model, *args], 2, x, y, "cannot be used together", stdin=b"hi\n")
    assert not dump.exists(), "a refused --dump-logits created its file"


def test_messages_escape_control_characters():
    """An escape sequence or a newline in an argument was echoed raw: one error spanned two lines or
    coloured the terminal. They are shown escaped, as export.py does."""
    model = tiny_model()
    line = expect_error([model, "-i", "hi", "-m", "\x1b[31mRED"], 2, "-m", "\\x1b[31mRED")
    assert "\x1b" not in line
    expect_error([WORK / "no\nsuch.bin", "-i", "hi"], 1, "no\\nsuch.bin", "cannot open")


def test_flag_numbers_are_decimal():
    """-t 1e-38 was refused as outside [0, 100]; hex floats and leading spaces were accepted."""
    model = tiny_model()
    expect_ok([model, "-i", "hi", "-n", "2", "-t", "1e-38", "-s", "1"])
    for flag, value in (("-t", "0x10"), ("-t", " 1"), ("-n", " 4"), ("-p", "0x1p-1"), ("-k", "+ 4")):
        expect_error([model, "-i", "hi", flag, value], 2, flag, f"'{value}'")
    expect_error([model, "-i", "hi", "-p", "1e-50"], 2, "-p 1e-50", "too small")


def test_ids_beyond_int64_named_as_given():
    """An id past int64 was reported as 9223372036854775807."""
    expect_error([tiny_model(), "--ids", "1 99999999999999999999999"], 2, "token id 99999999999999999999999")


def test_ppl_on_a_directory():
    """--ppl DIR said 'has 0 tokens'."""
    expect_error([tiny_model(), "--ppl", WORK, "--ctx", "32"], 1, "cannot read", "is a directory")


def test_out_of_memory():
    """Memory that cannot be mapped or allocated: one line, exit 1. The address-space limit
    (ulimit -v) works on the plain build; under ASan, which reserves terabytes of shadow memory,
    a cap on single allocations stands in for it (mmap cannot be made to fail there)."""
    model = require(DEFAULT_MODEL, "make model")
    args = [model, "-i", "hi", "-n", "2", "-t", "0", "--threads", "1", "--kv", "f32"]
    if is_asan_build():
        env = dict(os.environ, ASAN_OPTIONS="allocator_may_return_null=1:max_allocation_size_mb=64")
        expect_error(args, 1, "out of memory", env=env)
        return

    def limit(mb: int):
        return lambda: resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))

    expect_error(args, 1, "cannot map", preexec=limit(60))
    expect_error(args, 1, "out of memory", preexec=limit(300))


def test_stacks_too_small_are_refused():
    """A stack overflow is a crash with no message: OMP_STACKSIZE=16k (which libgomp accepts) gave SIGSEGV in the
    wide q4_k product on a worker thread, and `ulimit -s 32` the same on the main thread. Such stacks are refused
    with one line; a worker stack setting does not matter with --threads 1 or without OpenMP, nor one under the
    threads' minimum, which libgomp does not apply."""
    args = [DEFAULT_MODEL, "-i", "hi", "-n", "2", "-t", "0"]
    small = lambda: resource.setrlimit(resource.RLIMIT_STACK, (256 << 10, resource.getrlimit(resource.RLIMIT_STACK)[1]))
    expect_error(args, 1, "stack size limit is 256 KB", "ulimit -s", preexec=small)
    # workers exist in an OpenMP build given 2 CPUs (run caps --threads at the CPUs it may use)
    openmp = b"omp_set_num_threads" in RUN.read_bytes() and len(os.sched_getaffinity(0)) >= 2
    for var, value in (("OMP_STACKSIZE", "16k"), ("OMP_STACKSIZE", " 65535 B"), ("GOMP_STACKSIZE", "20")):
        env = {"OMP_STACKSIZE": None, "GOMP_STACKSIZE": None, var: value}     # over this environment (run)
        if openmp:
            full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}   # the whole one (subprocess)
            expect_error(args + ["--threads", "2"], 1, f"{var}={value}", "at least 64 KB", env=full)
        else:
            expect_ok(args + ["--threads", "2"], env=env)
        expect_ok(args + ["--threads", "1"], env=env)
    expect_ok(args + ["--threads", "2"], env={"OMP_STACKSIZE": "64K", "GOMP_STACKSIZE": None})
    # under the threads' minimum (16 KB on x86-64 glibc) libgomp warns and keeps its default: not refused
    expect_ok(args + ["--threads", "2"], env={"OMP_STACKSIZE": "1k", "GOMP_STACKSIZE": None})


# ---------------------------------------------------------------------------------------------
# The table in tests/README.md

def test_readme_table_is_complete():
    """Every row of the bad-input table names tests that exist; at least 25 rows."""
    import importlib
    text = require(TESTS / "README.md", "the bad-input table").read_text()
    rows = [ln for ln in text.splitlines() if re.match(r"^\|\s*\d+\s*\|", ln)]
    assert len(rows) >= 25, f"only {len(rows)} numbered rows in the bad-input table"
    missing = []
    for row in rows:
        refs = re.findall(r"`(test_\w+)\.(test_\w+)`", row)
        if not refs:
            missing.append(f"row without a test: {row[:80]}")
        for module, fn in refs:
            if not (TESTS / f"{module}.py").exists() or not hasattr(importlib.import_module(module), fn):
                missing.append(f"{module}.{fn}")
    assert not missing, "the table names tests that do not exist:\n" + "\n".join(missing)
