"""Read and patch model files (README.md ("The model file")) byte by byte, to craft damaged ones.

Written from the format spec, independently of export.py and run.c: the tests use it to
make one precise defect at a time in an otherwise valid file.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER_BYTES = 256
TABLE_ENTRY = 80
NAME_BYTES = 48

# header field -> (offset, struct format)
HEADER = {
    "magic": (0, "4s"), "version": (4, "<I"), "header_size": (8, "<I"), "arch": (12, "<I"),
    "dim": (16, "<I"), "hidden_dim": (20, "<I"), "n_layers": (24, "<I"), "n_heads": (28, "<I"),
    "n_kv_heads": (32, "<I"), "head_dim": (36, "<I"), "vocab_size": (40, "<I"), "max_seq_len": (44, "<I"),
    "rope_theta": (48, "<f"), "norm_eps": (52, "<f"), "flags": (56, "<I"), "activation": (60, "<I"),
    "rope_dim": (64, "<I"), "n_tensors": (68, "<I"), "tok_offset": (72, "<Q"), "tok_size": (80, "<Q"),
    "table_offset": (88, "<Q"), "file_size": (96, "<Q"),
    # the model-family fields (README "The model file"; 0 = not used)
    "embed_scale": (104, "<f"), "attn_scale": (108, "<f"), "window": (112, "<I"), "window_pattern": (116, "<I"),
    "rope_theta_local": (120, "<f"), "rope_scale_global": (124, "<f"),
}
HEADER_RESERVED = 128  # header bytes from here to HEADER_BYTES are zero
# tokenizer section header field -> (offset within the section, format)
TOKENIZER = {
    "kind": (0, "<I"), "pre": (4, "<I"), "n_vocab": (8, "<I"), "n_merges": (12, "<I"), "bos": (16, "<i"),
    "eos": (20, "<i"), "eot": (24, "<i"), "unk": (28, "<i"), "flags": (32, "<I"), "chat_template": (36, "<I"),
    "system_len": (40, "<I"), "blob_len": (44, "<I"),
}
# tensor table entry field -> (offset within the entry, format)
ENTRY = {"name": (0, "48s"), "type": (48, "<I"), "rows": (52, "<I"), "cols": (56, "<I"), "reserved": (60, "<I"),
         "offset": (64, "<Q"), "size": (72, "<Q")}
TYPE_F32 = 0


@dataclass
class Tensor:
    index: int
    name: str
    type: int
    rows: int
    cols: int
    offset: int
    size: int


def get(buf: bytes, field: str):
    off, fmt = HEADER[field]
    return struct.unpack_from(fmt, buf, off)[0]


def put(buf: bytearray, field: str, value) -> bytearray:
    off, fmt = HEADER[field]
    struct.pack_into(fmt, buf, off, value)
    return buf


def tok_get(buf: bytes, field: str):
    off, fmt = TOKENIZER[field]
    return struct.unpack_from(fmt, buf, get(buf, "tok_offset") + off)[0]


def tok_put(buf: bytearray, field: str, value) -> bytearray:
    off, fmt = TOKENIZER[field]
    struct.pack_into(fmt, buf, get(buf, "tok_offset") + off, value)
    return buf


def tensors(buf: bytes) -> list[Tensor]:
    out, base = [], get(buf, "table_offset")
    for i in range(get(buf, "n_tensors")):
        e = base + i * TABLE_ENTRY
        name, ttype, rows, cols, _, off, size = struct.unpack_from("<48sIIIIQQ", buf, e)
        out.append(Tensor(i, name.rstrip(b"\0").decode(), ttype, rows, cols, off, size))
    return out


def tensor(buf: bytes, name: str) -> Tensor:
    for t in tensors(buf):
        if t.name == name:
            return t
    raise KeyError(name)


def entry_put(buf: bytearray, name: str, field: str, value) -> bytearray:
    t = tensor(buf, name)
    off, fmt = ENTRY[field]
    struct.pack_into(fmt, buf, get(buf, "table_offset") + t.index * TABLE_ENTRY + off, value)
    return buf


def fill_f32(buf: bytearray, name: str, value: float) -> bytearray:
    """Overwrite every element of an F32 tensor with value (e.g. NaN or inf)."""
    t = tensor(buf, name)
    assert t.type == TYPE_F32, f"{name} is not F32"
    buf[t.offset:t.offset + t.size] = struct.pack("<f", value) * (t.size // 4)
    return buf


BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 3: (32, 20)}   # type -> (elements, bytes) per block


def align64(x: int) -> int:
    return (x + 63) // 64 * 64


def problems(buf: bytes) -> list[str]:
    """What makes buf an invalid model file by README.md ("The model file")'s layout rules (empty list: none).

    Checks the structure only (magic, sizes, offsets, alignment, tensor byte counts, the sections and
    tensors following each other exactly, reserved and padding bytes zero), the rules every file
    export.py writes must satisfy whatever its input was."""
    out: list[str] = []
    if len(buf) < HEADER_BYTES or buf[:4] != b"LLMF":
        return ["no LLMF header"]
    if get(buf, "version") != 1 or get(buf, "header_size") != HEADER_BYTES:
        out.append("bad version or header size")
    if get(buf, "file_size") != len(buf):
        out.append(f"header file_size {get(buf, 'file_size')} != actual {len(buf)}")
    if any(buf[HEADER_RESERVED:HEADER_BYTES]):
        out.append("nonzero reserved header bytes")
    tok_off, tok_size = get(buf, "tok_offset"), get(buf, "tok_size")
    if tok_off != HEADER_BYTES or tok_off + tok_size > len(buf):
        out.append("tokenizer section misplaced")
    elif any(buf[tok_off + 48:tok_off + 64]):
        out.append("nonzero reserved tokenizer header bytes")
    table, n = get(buf, "table_offset"), get(buf, "n_tensors")
    if table != align64(tok_off + tok_size) or table + n * TABLE_ENTRY > len(buf):
        return out + ["tensor table misplaced"]
    end = table + n * TABLE_ENTRY
    for t in tensors(buf):
        if t.type not in BLOCK:
            out.append(f"{t.name}: unknown type {t.type}")
            continue
        elems, nbytes = BLOCK[t.type]
        if t.cols % elems or t.size != t.rows * t.cols // elems * nbytes:
            out.append(f"{t.name}: size {t.size} does not match {t.rows}x{t.cols} of type {t.type}")
        if t.offset != align64(end) or t.offset + t.size > len(buf):
            out.append(f"{t.name}: data misplaced (at {t.offset}, expected {align64(end)})")
        elif any(buf[end:t.offset]):
            out.append(f"nonzero padding before {t.name}")
        end = t.offset + t.size
    if n and end != len(buf):
        out.append(f"{len(buf) - end} bytes after the last tensor")
    return out
