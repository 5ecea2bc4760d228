#!/usr/bin/env python3
"""Generate the Unicode class tables of tokenizer.c (between its BEGIN/END GENERATED markers).

The region sits in the appendix at the end of tokenizer.c, after the logic that uses it.
The class numbers UC_OTHER..UC_SPACE are written by hand where the pre-tokenizer starts
(the code needs them before the tables); the region checks them with a _Static_assert.

The byte-level BPE pre-tokenizers split text with regexes over three classes:
  \\p{L}  letters      general category L*  (Lu Ll Lt Lm Lo)
  \\p{N}  numbers      general category N*  (Nd Nl No)
  \\s     whitespace   Unicode's White_Space property: categories Zs Zl Zp plus the
                      controls U+0009..U+000D and U+0085.
Python's unicodedata has no White_Space property, so it is built from the definition
above; it is checked against str.isspace(), which is White_Space plus U+001C..U+001F
(Python counts those four information separators as space, the oracle llama.cpp and the
Unicode regex \\s do not: tests/tokenizer/corpus.jsonl checks both against llama.cpp).

The Unicode version must be the oracle's: llama.cpp's tables are Unicode 15.1, while the
stdlib unicodedata of Python 3.11 is 14.0 (it lacks e.g. CJK Extensions H and I). So the
tables come from the unicodedata2 package pinned to the version below
(`pip install unicodedata2==15.1.0`, the same API as unicodedata); the stdlib module is
used only if it already has that version.

    python3 tests/gen_unicode.py           # rewrite the region in tokenizer.c
    python3 tests/gen_unicode.py --check   # exit 1 if the region differs from a fresh generation
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

UNICODE_VERSION = "15.1.0"
TOKENIZER_C = Path(__file__).resolve().parent.parent / "tokenizer.c"
BEGIN = "/* BEGIN GENERATED unicode tables"
END = "/* END GENERATED unicode tables */"
MAX_CP = 0x110000
BLOCK_BITS = 7                 # code points per stage-2 block: 128
BITS_PER_CP = 2
CLASS_OTHER, CLASS_LETTER, CLASS_NUMBER, CLASS_SPACE = 0, 1, 2, 3
WHITE_SPACE_CONTROLS = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x85}
ISSPACE_EXTRA = {0x1C, 0x1D, 0x1E, 0x1F}


def unicode_db() -> ModuleType:
    """The unicodedata module whose data is UNICODE_VERSION."""
    import unicodedata
    if unicodedata.unidata_version == UNICODE_VERSION:
        return unicodedata
    try:
        import unicodedata2
    except ImportError:
        sys.exit(f"gen_unicode.py: need Unicode {UNICODE_VERSION} data; stdlib has {unicodedata.unidata_version}: "
                 f"pip install unicodedata2=={UNICODE_VERSION}")
    if unicodedata2.unidata_version != UNICODE_VERSION:
        sys.exit(f"gen_unicode.py: unicodedata2 has Unicode {unicodedata2.unidata_version}, need {UNICODE_VERSION}: "
                 f"pip install unicodedata2=={UNICODE_VERSION}")
    return unicodedata2


def classify(db: ModuleType) -> list[int]:
    classes = [CLASS_OTHER] * MAX_CP
    for cp in range(MAX_CP):
        cat = db.category(chr(cp))
        if cat in ("Zs", "Zl", "Zp") or cp in WHITE_SPACE_CONTROLS:
            classes[cp] = CLASS_SPACE
        elif cat[0] == "L":
            classes[cp] = CLASS_LETTER
        elif cat[0] == "N":
            classes[cp] = CLASS_NUMBER
    space = {cp for cp in range(MAX_CP) if classes[cp] == CLASS_SPACE}
    # The White_Space set has not changed since Unicode 6.3, so the interpreter's own
    # isspace() (whatever its Unicode version) must agree up to the four separators.
    assert space == {cp for cp in range(MAX_CP) if chr(cp).isspace()} - ISSPACE_EXTRA, "White_Space mismatch"
    return classes


def pack_tables(classes: list[int]) -> tuple[int, list[int], list[int]]:
    """Two-stage table: stage1[cp >> 7] = block number, stage2 = blocks of 128 2-bit classes."""
    block = 1 << BLOCK_BITS
    limit = max(cp for cp in range(MAX_CP) if classes[cp] != CLASS_OTHER) + 1
    limit = (limit + block - 1) // block * block
    blocks: dict[tuple[int, ...], int] = {}
    stage1 = []
    for start in range(0, limit, block):
        stage1.append(blocks.setdefault(tuple(classes[start:start + block]), len(blocks)))
    assert len(blocks) <= 256, "stage-1 entries no longer fit in a byte"
    per_byte = 8 // BITS_PER_CP
    stage2 = []
    for blk in blocks:                      # dicts keep insertion order = block number
        for i in range(0, block, per_byte):
            stage2.append(sum(c << (BITS_PER_CP * k) for k, c in enumerate(blk[i:i + per_byte])))
    return limit, stage1, stage2


def c_array(name: str, values: list[int], per_line: int = 24) -> str:
    lines = [f"static const uint8_t {name}[{len(values)}] = {{"]
    for i in range(0, len(values), per_line):
        lines.append("    " + ",".join(str(v) for v in values[i:i + per_line]) + ",")
    lines.append("};")
    return "\n".join(lines)


def generate(db: ModuleType) -> str:
    limit, stage1, stage2 = pack_tables(classify(db))
    src = getattr(db, "__name__", "unicodedata")
    return "\n".join([
        f"{BEGIN}: python3 tests/gen_unicode.py (Unicode {db.unidata_version}, from {src}). Do not edit. */",
        f'#define UC_VERSION "{db.unidata_version}"',
        f"#define UC_LIMIT  0x{limit:X}u  /* every code point from here on is UC_OTHER */",
        f"#define UC_BLOCK_BITS {BLOCK_BITS}",
        f"_Static_assert(UC_OTHER == {CLASS_OTHER} && UC_LETTER == {CLASS_LETTER} && UC_NUMBER == {CLASS_NUMBER} "
        f'&& UC_SPACE == {CLASS_SPACE}, "classes as tests/gen_unicode.py numbers them");',
        "/* class(cp) = (uc_stage2[uc_stage1[cp >> 7] * 32 + (cp & 127) / 4] >> (2 * (cp & 3))) & 3 */",
        c_array("uc_stage1", stage1),
        c_array("uc_stage2", stage2),
        END,
    ])


def replace_region(text: str, region: str) -> str:
    start = text.find(BEGIN)
    end = text.find(END)
    if start < 0 or end < start:
        sys.exit(f"gen_unicode.py: markers '{BEGIN}' ... '{END}' not found in {TOKENIZER_C}")
    return text[:start] + region + text[end + len(END):]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with tokenizer.c instead of rewriting it")
    ap.add_argument("--file", type=Path, default=TOKENIZER_C, help="the C file holding the markers")
    args = ap.parse_args()
    text = args.file.read_text(encoding="utf-8")
    new = replace_region(text, generate(unicode_db()))
    if args.check:
        if new != text:
            print(f"gen_unicode.py: the generated tables in {args.file} differ from a fresh generation", file=sys.stderr)
            return 1
        print(f"gen_unicode.py: {args.file} tables are up to date (Unicode {UNICODE_VERSION})")
        return 0
    if new != text:
        args.file.write_text(new, encoding="utf-8")
    print(f"gen_unicode.py: wrote the Unicode {UNICODE_VERSION} tables into {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
