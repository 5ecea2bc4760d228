#!/usr/bin/env python3
"""Write the tokenizer benchmark inputs tests/tokenizer/bench/{english,code,cjk}.txt.

All three are public-domain texts taken from Debian 12 packages (fetched with
`apt-get download`, unpacked with `dpkg-deb -x`; nothing is installed):
  english.txt  the King James Bible (1611; copyright expired), Genesis onwards, one
               paragraph per chapter, from bible-kjv-text (read with bible-kjv's `bible`).
  code.txt     the start of sqlite3.h from libsqlite3-dev ("The author disclaims copyright
               to this source code"), cut at a line end.
  cjk.txt      Tang and Song poems (300 Tang poems, 100 Song ci; 7th-13th century) from
               fortunes-zh's tang300 and song100, colour escapes removed.
Each is about SAMPLE_BYTES long; the benchmark repeats a file until it has 1 MB.

    python3 tests/tokenizer/make_bench_inputs.py
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "bench"
SAMPLE_BYTES = 256 * 1024
PACKAGES = ["bible-kjv", "bible-kjv-text", "libsqlite3-dev", "fortunes-zh"]
BIBLE_BOOKS = ["Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy"]
MAX_CHAPTERS = 60
MAX_VERSES = 200


def unpack(packages: list[str], into: Path) -> Path:
    subprocess.run(["apt-get", "download", *packages], cwd=into, check=True, capture_output=True)
    root = into / "root"
    for deb in sorted(into.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def english(root: Path) -> str:
    bible = [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib")]
    paragraphs: list[str] = []
    size = 0
    for book in BIBLE_BOOKS:
        for chapter in range(1, MAX_CHAPTERS + 1):
            spec = f"{book}{chapter}:1-{book}{chapter}:{MAX_VERSES}"
            out = subprocess.run([*bible, "-f", spec], capture_output=True, text=True).stdout
            # a chapter past the end of the book comes back as the last one: keep matching refs only
            verses = [m.group(2) for m in (re.match(r"^\S*?(\d+):\d+\s+(.*\S)", line) for line in out.splitlines())
                      if m and int(m.group(1)) == chapter]
            if not verses:
                break
            text = f"{book} {chapter}\n\n" + " ".join(verses)
            paragraphs.append(text)
            size += len(text.encode()) + 2
            if size >= SAMPLE_BYTES:
                return "\n\n".join(paragraphs) + "\n"
    return "\n\n".join(paragraphs) + "\n"


def code(root: Path) -> str:
    text = (root / "usr/include/sqlite3.h").read_text(encoding="utf-8")
    cut = text.encode()[:SAMPLE_BYTES].decode("utf-8", "ignore")
    return cut[:cut.rfind("\n") + 1]


def cjk(root: Path) -> str:
    parts = []
    for name in ("tang300", "song100"):
        raw = (root / "usr/share/games/fortunes" / name).read_text(encoding="utf-8")
        raw = re.sub(r"\x1b\[[0-9;]*m", "", raw)
        parts.extend(p.strip("\n") for p in raw.split("\n%\n") if p.strip())
    return "\n\n".join(parts) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = unpack(PACKAGES, Path(tmp))
        for name, make in (("english", english), ("code", code), ("cjk", cjk)):
            text = make(root)
            (OUT / f"{name}.txt").write_text(text, encoding="utf-8")
            print(f"{name}.txt: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
