"""Test vocabularies derived from the real ones (shared by make_goldens.py and the tests).

SmolLM2's tokenizer was trained with single digits, so its vocabulary has no multi-digit
token, and no word that BPE would split differently from the whole: with it alone, the
digit rules of the gpt-2 / llama3 / qwen2 pre-tokenizers (\\p{N}+, \\p{N}{1,3}, \\p{N}) and
llama3's ignore_merges would give the same ids. The pre-tokenizer variants therefore use
SmolLM2's vocabulary and merges plus EXTRA appended tokens (ids from 49152 on, in order):
  - "00".."99" (merge "a b") and "000".."999" (merge "ab c"), appended as the last merges;
  - a few words with no merge path (ignore_merges emits them whole, BPE cannot), some of
    them made of characters new in Unicode 15.0 / 15.1.
The oracle gets them appended to the GGUF arrays (make_goldens.py); the tests append them
to the tokenizer section that export.py wrote for the unmodified GGUF.
"""
from __future__ import annotations

DIGITS = "0123456789"
# Words no merge path leads to: llama3's ignore_merges emits them whole when a pre-token is
# exactly the word, BPE cannot. The last four tie the result to the Unicode version of the
# letter/number classes: U+2EBF0 (CJK Ext. I, a letter since Unicode 15.1), U+31350 (CJK
# Ext. H, 15.0), U+1E030 (a modifier letter, 15.0) and U+1D2C0 (a Kaktovik numeral, 15.0)
# are unassigned in older tables, which would split "a\U0002EBF0" or join "\U0001D2C0!".
NO_MERGE_WORDS = ["qzxq", " qzxq", "zzqzz", "Qzxq", "\tqzxq",
                  "a\U0002EBF0", "\U00031350x", "b\U0001E030", "\U0001D2C0!"]


def extra_tokens() -> list[tuple[str, tuple[str, str] | None]]:
    """(token text, merge (left, right) or None), in id order; texts are the decoded strings."""
    out: list[tuple[str, tuple[str, str] | None]] = []
    out += [(a + b, (a, b)) for a in DIGITS for b in DIGITS]
    out += [(a + b + c, (a + b, c)) for a in DIGITS for b in DIGITS for c in DIGITS]
    out += [(w, None) for w in NO_MERGE_WORDS]
    return out


def gpt2_encode(text: str) -> str:
    """The GPT-2 byte-to-unicode form of a string's UTF-8 bytes, as GGUF stores it
    (bytes_to_unicode in openai/gpt-2 src/encoder.py)."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(0x100 + extra)
            extra += 1
    return "".join(mapping[b] for b in text.encode("utf-8"))


# --- the tokenizer section of a model file (export.py's manual ("The model file")), for building test variants ---

import struct  # noqa: E402

HEADER_SIZE = 256
SECTION_HEADER = 64


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def read_section(model: bytes) -> dict:
    """Split a model file's tokenizer section into its fields and arrays."""
    off, size = struct.unpack_from("<QQ", model, 72)
    sec = model[off:off + size]
    (kind, pre, n, n_merges, bos, eos, eot, unk, flags, chat, sys_len, blob_len) = struct.unpack_from("<IIIIiiiiIIII", sec, 0)
    pos = SECTION_HEADER
    offsets = list(struct.unpack_from(f"<{n + 1}I", sec, pos))
    pos = _align(pos + 4 * (n + 1), 4)
    types = list(sec[pos:pos + n])
    pos = _align(pos + n, 4)
    scores = list(struct.unpack_from(f"<{n}f", sec, pos))
    pos = _align(pos + 4 * n, 4)
    merges = [tuple(struct.unpack_from("<iii", sec, pos + 12 * i)) for i in range(n_merges)]
    pos = _align(pos + 12 * n_merges, 4)
    system = sec[pos:pos + sys_len]
    pos = _align(pos + sys_len, 4)
    blob = sec[pos:pos + blob_len]
    texts = [blob[offsets[i]:offsets[i + 1]] for i in range(n)]
    return dict(kind=kind, pre=pre, bos=bos, eos=eos, eot=eot, unk=unk, flags=flags, chat=chat, texts=texts,
                types=types, scores=scores, merges=merges, system=system, header=model[:HEADER_SIZE])


def write_model(path, s: dict) -> None:
    """A tokenizer-only model file holding section s (header copied, offsets updated)."""
    n = len(s["texts"])
    blob = b"".join(s["texts"])
    offsets = [0]
    for t in s["texts"]:
        offsets.append(offsets[-1] + len(t))
    sec = bytearray(struct.pack("<IIIIiiiiIIII", s["kind"], s["pre"], n, len(s["merges"]), s["bos"], s["eos"], s["eot"],
                                s["unk"], s["flags"], s["chat"], len(s["system"]), len(blob)).ljust(SECTION_HEADER, b"\0"))

    def add(data: bytes) -> None:
        sec.extend(b"\0" * (_align(len(sec), 4) - len(sec)))
        sec.extend(data)

    add(struct.pack(f"<{n + 1}I", *offsets))
    add(bytes(s["types"]))
    add(struct.pack(f"<{n}f", *s["scores"]))
    add(b"".join(struct.pack("<iii", *m) for m in s["merges"]))
    add(s["system"])
    add(blob)
    table = _align(HEADER_SIZE + len(sec), 64)
    header = bytearray(s["header"])
    struct.pack_into("<I", header, 68, 0)                       # n_tensors
    struct.pack_into("<QQQQ", header, 72, HEADER_SIZE, len(sec), table, table)
    with open(path, "wb") as f:
        f.write(bytes(header) + bytes(sec) + b"\0" * (table - HEADER_SIZE - len(sec)))


def add_extra_tokens(s: dict) -> None:
    """Append extra_tokens() (and their merges) to a byte-level BPE section, as the GGUF variant has them."""
    ids = {t: i for i, t in enumerate(s["texts"])}
    for text, merge in extra_tokens():
        raw = text.encode("utf-8")
        if raw in ids:
            raise AssertionError(f"extra token {text!r} is already in the vocabulary")
        ids[raw] = len(s["texts"])
        s["texts"].append(raw)
        s["types"].append(1)
        s["scores"].append(0.0)
        if merge:
            s["merges"].append((ids[merge[0].encode()], ids[merge[1].encode()], ids[raw]))
