"""Read and patch model files (export.py's manual ("The model file")) byte by byte, to craft damaged ones.

Written from the format spec, independently of export.py and run.c: the tests use it to
make one precise defect at a time in an otherwise valid file.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

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
    # the model-family fields (export.py's manual, "The model file"; 0 = not used)
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
ENTRY = {"name": (0, "48s"), "type": (48, "<I"), "rows": (52, "<I"), "cols": (56, "<I"), "layout": (60, "<I"),
         "offset": (64, "<Q"), "size": (72, "<Q")}
TYPE_F32 = 0
VERSION = 2
LAYOUT_ROWS, LAYOUT_PACKED = 0, 1   # an entry's layout: ggml blocks row after row, or packed groups of 16 rows


@dataclass
class Tensor:
    index: int
    name: str
    type: int
    rows: int
    cols: int
    offset: int
    size: int
    layout: int = LAYOUT_ROWS


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
        name, ttype, rows, cols, layout, off, size = struct.unpack_from("<48sIIIIQQ", buf, e)
        out.append(Tensor(i, name.split(b"\0")[0].decode(), ttype, rows, cols, off, size, layout))
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


def relayout(buf: bytes, tensors: list[tuple]) -> bytearray:
    """buf's header and tokenizer section with these tensors (name, type, rows, cols, data[, layout]) in this
    order: the table right after the tokenizer section, each tensor at the next 64-byte boundary after it,
    n_tensors and file_size updated (the layout rules of export.py's manual, "The model file"). data is as stored
    (packed for a LAYOUT_PACKED tensor)."""
    table = get(buf, "table_offset")
    out = bytearray(buf[:table]) + bytes(len(tensors) * TABLE_ENTRY)
    for i, (name, ttype, rows, cols, data, *layout) in enumerate(tensors):
        out += bytes(-len(out) % 64)
        struct.pack_into("<48sIIIIQQ", out, table + i * TABLE_ENTRY, name.encode(), ttype, rows, cols,
                         layout[0] if layout else LAYOUT_ROWS, len(out), len(data))
        out += data
    put(out, "n_tensors", len(tensors))
    return put(out, "file_size", len(out))


TOK_ARRAYS = ("text_offset", "type", "score", "merge", "default_system", "blob")   # in section order
TOK_FLAG_BITS = 3   # tokenizer flags: bit 0 add BOS, bit 1 add EOS, bit 2 space prefix; higher bits unknown


def tok_arrays(buf: bytes) -> list[tuple[str, int, int]]:
    """The tokenizer section's arrays (export.py's manual, "Tokenizer section") as (name, file offset, bytes), in order,
    each from a 4-byte boundary after the 64-byte section header."""
    n = tok_get(buf, "n_vocab")
    sizes = [4 * (n + 1), n, 4 * n, 12 * tok_get(buf, "n_merges"), tok_get(buf, "system_len"), tok_get(buf, "blob_len")]
    out, at = [], 64
    for name, size in zip(TOK_ARRAYS, sizes):
        at += -at % 4
        out.append((name, get(buf, "tok_offset") + at, size))
        at += size
    return out


def with_default_system(buf: bytes, text: bytes) -> bytearray:
    """buf with its tokenizer section rewritten around a new default system prompt (its padding zero), the
    table and the tensors moved after it."""
    sec = bytearray(buf[get(buf, "tok_offset"):get(buf, "tok_offset") + 64])
    for name, off, size in tok_arrays(buf):
        sec += bytes(-len(sec) % 4)
        sec += text if name == "default_system" else buf[off:off + size]
    struct.pack_into(TOKENIZER["system_len"][1], sec, TOKENIZER["system_len"][0], len(text))
    head = bytearray(buf[:HEADER_BYTES]) + sec
    put(head, "tok_size", len(sec))
    put(head, "table_offset", align64(len(head)))
    head += bytes(-len(head) % 64)
    return relayout(head, [(t.name, t.type, t.rows, t.cols, buf[t.offset:t.offset + t.size], t.layout)
                           for t in tensors(buf)])


FLAG_SPLIT = 32   # header flag bit 5: the projections' parts stored as tensors of their own
SPLIT_PARTS = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}   # in the order of the fused rows


def split_form(buf: bytes, retype: dict[str, int] | None = None) -> bytearray:
    """A fused file in the split form (export.py's manual, "The model file", flag bit 5): each layer's wqkv cut into wq,
    wk, wv and w13 into w1, w3, whole rows, so the same bytes. A part named in `retype` becomes a tensor of that
    type holding zeros instead."""
    hd, hid = get(buf, "head_dim"), get(buf, "hidden_dim")
    part_rows = {"wq": get(buf, "n_heads") * hd, "wk": get(buf, "n_kv_heads") * hd, "wv": get(buf, "n_kv_heads") * hd,
                 "w1": hid, "w3": hid}
    out = []
    for t in tensors(buf):
        prefix, _, base = t.name.rpartition(".")
        if base not in SPLIT_PARTS:
            out.append((t.name, t.type, t.rows, t.cols, buf[t.offset:t.offset + t.size], t.layout))
            continue
        data, at = rows_of(buf, t), 0
        row_bytes = len(data) // t.rows
        for part in SPLIT_PARTS[base]:
            name, rows = f"{prefix}.{part}", part_rows[part]
            ttype = retype.get(name, t.type) if retype else t.type
            elems, nbytes = BLOCK[ttype]
            part_data = bytes(rows * t.cols // elems * nbytes) if ttype != t.type else data[at * row_bytes:(at + rows) * row_bytes]
            out.append((name, ttype, rows, t.cols, pack(ttype, rows, t.cols, part_data), LAYOUT_PACKED))
            at += rows
    new = relayout(buf, out)
    return put(new, "flags", get(new, "flags") | FLAG_SPLIT)


BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 3: (32, 20), 2: (32, 18), 6: (32, 22), 7: (32, 24),
         12: (256, 144), 13: (256, 176), 14: (256, 210)}   # type -> (elements, bytes) per block


def align64(x: int) -> int:
    return (x + 63) // 64 * 64


def problems(buf: bytes) -> list[str]:
    """What makes buf an invalid model file by export.py's manual ("The model file")'s layout rules (empty list: none).

    Checks the structure only (magic, sizes, offsets, alignment, tensor byte counts, the sections and
    tensors following each other exactly, reserved and padding bytes zero: between sections, tensors and
    tokenizer arrays, after a name's NUL, in a packed matrix's last group; no unknown tokenizer flag bit),
    the rules every file export.py writes must satisfy whatever its input was."""
    out: list[str] = []
    if len(buf) < HEADER_BYTES or buf[:4] != b"LLMF":
        return ["no LLMF header"]
    if get(buf, "version") != VERSION or get(buf, "header_size") != HEADER_BYTES:
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
    else:
        out += tok_problems(buf)
    table, n = get(buf, "table_offset"), get(buf, "n_tensors")
    if table != align64(tok_off + tok_size) or table + n * TABLE_ENTRY > len(buf):
        return out + ["tensor table misplaced"]
    end = table + n * TABLE_ENTRY
    for t in tensors(buf):
        name_field = buf[table + t.index * TABLE_ENTRY:table + t.index * TABLE_ENTRY + NAME_BYTES]
        if any(name_field.partition(b"\0")[2]):
            out.append(f"{t.name}: nonzero bytes after the name's NUL")
        if t.type not in BLOCK:
            out.append(f"{t.name}: unknown type {t.type}")
            continue
        elems, nbytes = BLOCK[t.type]
        want = packed_size(t.type, t.rows, t.cols) if t.layout == LAYOUT_PACKED else t.rows * t.cols // elems * nbytes
        if t.layout not in (LAYOUT_ROWS, LAYOUT_PACKED):
            out.append(f"{t.name}: unknown layout {t.layout}")
        elif t.cols % elems or t.size != want:
            out.append(f"{t.name}: size {t.size} does not match {t.rows}x{t.cols} of type {t.type}")
        if t.offset != align64(end) or t.offset + t.size > len(buf):
            out.append(f"{t.name}: data misplaced (at {t.offset}, expected {align64(end)})")
        elif any(buf[end:t.offset]):
            out.append(f"nonzero padding before {t.name}")
        elif t.layout == LAYOUT_PACKED and t.size == want and last_group_padding_dirty(buf, t):
            out.append(f"{t.name}: nonzero padding rows or padding in its last group")
        end = t.offset + t.size
    if n and end != len(buf):
        out.append(f"{len(buf) - end} bytes after the last tensor")
    return out


def tok_problems(buf: bytes) -> list[str]:
    """The tokenizer section's padding between its arrays and its flags (export.py's manual, "Tokenizer section")."""
    out, end = [], None
    arrays = tok_arrays(buf)
    if arrays[-1][1] + arrays[-1][2] > len(buf):
        return ["tokenizer arrays run past the end of the file"]
    for name, off, size in arrays:
        if end is not None and any(buf[end:off]):
            out.append(f"nonzero tokenizer padding before its {name} array")
        end = off + size
    if tok_get(buf, "flags") >> TOK_FLAG_BITS:
        out.append(f"unknown tokenizer flag bits {tok_get(buf, 'flags'):#x}")
    return out


def last_group_padding_dirty(buf: bytes, t: Tensor) -> bool:
    """Whether packed tensor t's last group differs from its rows packed again: its padding rows (those of zero
    blocks) or the zeros after its records are not what pack() writes. The last group only, as ./run checks."""
    rows = (t.rows - 1) % PACK_ROWS + 1
    group = buf[t.offset + t.size - group_bytes(t.type, t.cols):t.offset + t.size]
    return pack(t.type, rows, t.cols, unpack(t.type, rows, t.cols, group)) != group


# ---------------------------------------------------------------------------------------------------------------
# Packed matrices (export.py's manual, "Packed matrices"), written from the manual's description element by element:
# unpack() turns a packed tensor back into ggml's blocks, row after row; pack() is its inverse.

PACK_ROWS = 16
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
FLOAT_TYPES = (0, 1, 30)


def group_bytes(ttype: int, cols: int) -> int:
    elems, nbytes = BLOCK[ttype]
    return align64(cols // elems * nbytes * PACK_ROWS)


def packed_size(ttype: int, rows: int, cols: int) -> int:
    return (rows + PACK_ROWS - 1) // PACK_ROWS * group_bytes(ttype, cols)


def _stretch_places(r, e):
    """Where integer e (0..31) of row r of a 32-element stretch lies in the 4-bit form: (byte, nibble shift),
    and its bit field k in the high planes: element 8j + 4h + i is in byte 64j + 4r + i, nibble h, field 2j + h."""
    j, h, i = e // 8, e % 8 // 4, e % 4
    return 64 * j + 4 * r + i, 4 * h, 2 * j + h, 4 * r + i


def _int_layout(ttype: int):
    """For one record of a packed integer type: (head bytes, [(plane bytes, extra bits, nibble bytes)] per
    stretch, stretches): the byte layout of the integers after the head."""
    if ttype == Q8_0:
        return 32, None, 1
    return {Q4_0: (32, 0, 1), Q4_1: (64, 0, 1), Q5_0: (32, 1, 1), Q5_1: (64, 1, 1),
            Q4_K: (256, 0, 8), Q5_K: (256, 1, 8), Q6_K: (288, 2, 8)}[ttype]


@lru_cache(maxsize=None)
def _int_places(ttype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, int]:
    """Where each unsigned integer [row, element] of a packed record lies: (byte of its low 4 bits (all 8 for
    Q8_0), their shift, byte of its high bits, their shift, high-bit mask), tables of shape (16, elements)
    filled element by element from _stretch_places."""
    head, extra, stretches = _int_layout(ttype)
    n = 32 * stretches
    lo_at, lo_shift = np.zeros((PACK_ROWS, n), np.intp), np.zeros((PACK_ROWS, n), np.uint8)
    hi_at, hi_shift = np.zeros((PACK_ROWS, n), np.intp), np.zeros((PACK_ROWS, n), np.uint8)
    if ttype == Q8_0:
        for r in range(PACK_ROWS):
            for e in range(32):
                lo_at[r, e] = head + 64 * (e // 4) + 4 * r + e % 4   # q + 128, as stored
        return lo_at, lo_shift, None, None, 0xFF
    plane_bytes = 64 * extra
    for s in range(stretches):
        base = head + s * (plane_bytes + 256)
        for r in range(PACK_ROWS):
            for e in range(32):
                at, shift, k, pb = _stretch_places(r, e)
                lo_at[r, 32 * s + e], lo_shift[r, 32 * s + e] = base + plane_bytes + at, shift
                if extra:
                    per_byte = 8 // extra
                    hi_at[r, 32 * s + e] = base + 64 * (k // per_byte) + pb
                    hi_shift[r, 32 * s + e] = k % per_byte * extra
    return lo_at, lo_shift, hi_at if extra else None, hi_shift, 0x0F


def _ints_of_record(rec: np.ndarray, ttype: int) -> np.ndarray:
    """Packed records (n, record bytes) -> the unsigned integers [n, 16 rows, elements]."""
    lo_at, lo_shift, hi_at, hi_shift, mask = _int_places(ttype)
    u = (rec[:, lo_at] >> lo_shift) & mask
    if hi_at is not None:
        extra = _int_layout(ttype)[1]
        u |= ((rec[:, hi_at] >> hi_shift) & ((1 << extra) - 1)) << 4
    return u


def _put_ints(rec: np.ndarray, ttype: int, ints: np.ndarray) -> None:
    """The inverse of _ints_of_record: writes ints [groups, 16, elements] into zeroed records."""
    head, extra, stretches = _int_layout(ttype)
    if ttype == Q8_0:
        for r in range(PACK_ROWS):
            for e in range(32):
                rec[:, head + 64 * (e // 4) + 4 * r + e % 4] = ints[:, r, e]
        return
    plane_bytes = 64 * extra
    for s in range(stretches):
        base = head + s * (plane_bytes + 256)
        for r in range(PACK_ROWS):
            for e in range(32):
                at, shift, k, pb = _stretch_places(r, e)
                u = ints[:, r, 32 * s + e]
                rec[:, base + plane_bytes + at] |= (u & 0x0F) << shift
                if extra:
                    per_byte = 8 // extra
                    rec[:, base + 64 * (k // per_byte) + pb] |= (u >> 4) << (k % per_byte * extra)


def _block_ints(blocks: np.ndarray, ttype: int) -> np.ndarray:
    """ggml blocks [n, bytes] -> their unsigned integers [n, elements] (ggml-common.h's layouts)."""
    if ttype == Q8_0:
        return blocks[:, 2:34] ^ 0x80
    if ttype in (Q4_0, Q4_1, Q5_0, Q5_1):
        qs = blocks[:, -16:]
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        if ttype in (Q5_0, Q5_1):
            at = 2 if ttype == Q5_0 else 4
            qh = blocks[:, at:at + 4].copy().view("<u4")[:, 0]
            u |= (((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        return u
    if ttype in (Q4_K, Q5_K):
        qs = blocks[:, -128:].reshape(-1, 4, 32)
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        if ttype == Q5_K:
            qh = blocks[:, 16:48]
            for j in range(8):
                u[:, 32 * j:32 * j + 32] |= ((qh >> j) & 1) << 4
        return u
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    u = np.zeros((blocks.shape[0], 256), dtype=np.uint8)
    for half in range(2):
        for l in range(32):
            a, b, h = ql[:, 64 * half + l], ql[:, 64 * half + 32 + l], qh[:, 32 * half + l]
            for n, v in enumerate([a & 15, b & 15, a >> 4, b >> 4]):
                u[:, 128 * half + 32 * n + l] = v | (((h >> (2 * n)) & 3) << 4)
    return u


def _blocks_of_ints(u: np.ndarray, other: np.ndarray, ttype: int) -> np.ndarray:
    """ggml blocks [n, bytes] from their integers u [n, elements] and the rest of their bytes `other` (the
    blocks with the integer bytes zero)."""
    b = other.copy()
    if ttype == Q8_0:
        b[:, 2:34] = u ^ 0x80
        return b
    if ttype in (Q4_0, Q4_1, Q5_0, Q5_1):
        b[:, -16:] = (u[:, :16] & 15) | ((u[:, 16:] & 15) << 4)
        if ttype in (Q5_0, Q5_1):
            at = 2 if ttype == Q5_0 else 4
            qh = (((u >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
            b[:, at:at + 4] = qh.astype("<u4").view(np.uint8).reshape(-1, 4)
        return b
    if ttype in (Q4_K, Q5_K):
        q = u.reshape(-1, 4, 2, 32)
        b[:, -128:] = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)
        if ttype == Q5_K:
            qh = np.zeros((u.shape[0], 32), dtype=np.uint8)
            for j in range(8):
                qh |= ((u[:, 32 * j:32 * j + 32] >> 4) & 1) << j
            b[:, 16:48] = qh
        return b
    for half in range(2):
        for l in range(32):
            v = [u[:, 128 * half + 32 * n + l] for n in range(4)]
            b[:, 64 * half + l] = (v[0] & 15) | ((v[2] & 15) << 4)
            b[:, 64 * half + 32 + l] = (v[1] & 15) | ((v[3] & 15) << 4)
            b[:, 128 + 32 * half + l] = sum(((v[n] >> 4) & 3) << (2 * n) for n in range(4)).astype(np.uint8)
    return b


def _head_fields(ttype: int) -> list[tuple[int, int]]:
    """The non-integer bytes of a block as (offset in the block, width of a field): fp16 scales 2 bytes
    wide, the K types' scale bytes 1 byte wide; each goes into the record as a [field][row] plane."""
    return {Q4_0: [(0, 2)], Q4_1: [(0, 2), (2, 2)], Q5_0: [(0, 2)], Q5_1: [(0, 2), (2, 2)], Q8_0: [(0, 2)],
            Q4_K: [(0, 2), (2, 2)] + [(4 + i, 1) for i in range(12)],
            Q5_K: [(0, 2), (2, 2)] + [(4 + i, 1) for i in range(12)],
            Q6_K: [(208, 2)] + [(192 + i, 1) for i in range(16)]}[ttype]


def unpack(ttype: int, rows: int, cols: int, data: bytes) -> bytes:
    """A packed matrix -> its rows of ggml blocks (rows * row bytes)."""
    elems, nbytes = BLOCK[ttype]
    nb, gb = cols // elems, group_bytes(ttype, cols)
    groups = (rows + PACK_ROWS - 1) // PACK_ROWS
    g = np.frombuffer(data, dtype=np.uint8).reshape(groups, gb)[:, :nb * nbytes * PACK_ROWS]
    rec = g.reshape(groups, nb, nbytes * PACK_ROWS)
    out = np.zeros((groups, PACK_ROWS, nb, nbytes), dtype=np.uint8)
    if ttype in FLOAT_TYPES:
        out[:] = rec.reshape(groups, nb, PACK_ROWS, nbytes).transpose(0, 2, 1, 3)
    else:   # every block k of every group at once
        at = 0
        for off, width in _head_fields(ttype):
            for r in range(PACK_ROWS):
                out[:, r, :, off:off + width] = rec[:, :, at + width * r:at + width * (r + 1)]
            at += width * PACK_ROWS
        u = _ints_of_record(rec.reshape(groups * nb, -1), ttype).reshape(groups, nb, PACK_ROWS, -1)
        u = u.transpose(0, 2, 1, 3).reshape(groups * PACK_ROWS * nb, -1)
        out = _blocks_of_ints(u, out.reshape(-1, nbytes), ttype)
    return out.reshape(groups * PACK_ROWS, nb * nbytes)[:rows].tobytes()


def pack(ttype: int, rows: int, cols: int, data: bytes) -> bytes:
    """Rows of ggml blocks -> the packed matrix (the last group's missing rows zero, groups padded to 64 bytes)."""
    elems, nbytes = BLOCK[ttype]
    nb, gb = cols // elems, group_bytes(ttype, cols)
    groups = (rows + PACK_ROWS - 1) // PACK_ROWS
    src = np.zeros((groups * PACK_ROWS, nb * nbytes), dtype=np.uint8)
    src[:rows] = np.frombuffer(data, dtype=np.uint8).reshape(rows, nb * nbytes)
    blk = src.reshape(groups, PACK_ROWS, nb, nbytes)
    out = np.zeros((groups, gb), dtype=np.uint8)
    rec = out[:, :nb * nbytes * PACK_ROWS].reshape(groups, nb, nbytes * PACK_ROWS)
    if ttype in FLOAT_TYPES:
        rec[:] = blk.transpose(0, 2, 1, 3).reshape(groups, nb, -1)
        return out.tobytes()
    for k in range(nb):
        r_ = np.zeros((groups, nbytes * PACK_ROWS), dtype=np.uint8)
        at = 0
        for off, width in _head_fields(ttype):
            for r in range(PACK_ROWS):
                r_[:, at + width * r:at + width * (r + 1)] = blk[:, r, k, off:off + width]
            at += width * PACK_ROWS
        u = _block_ints(blk[:, :, k, :].reshape(-1, nbytes), ttype).reshape(groups, PACK_ROWS, -1)
        _put_ints(r_, ttype, u)
        rec[:, k, :] = r_
    return out.tobytes()


def rows_of(buf: bytes, t: Tensor) -> bytes:
    """Tensor t's data as rows of ggml blocks, whatever its layout."""
    data = bytes(buf[t.offset:t.offset + t.size])
    return unpack(t.type, t.rows, t.cols, data) if t.layout == LAYOUT_PACKED else data
