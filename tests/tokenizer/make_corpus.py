#!/usr/bin/env python3
"""Write tests/tokenizer/corpus.jsonl: the strings the tokenizer is checked on.

One JSON object per line: {"cat": category, "text": str} for valid UTF-8, or
{"cat": category, "hex": "..."} for byte strings that are not (invalid UTF-8,
encoded surrogates, lone bytes). The content is deterministic: handwritten samples
plus seeded random combinations, plus excerpts of the public-domain benchmark texts in
tests/tokenizer/bench/ (see make_bench_inputs.py). Regenerating must give the same file;
the goldens (make_goldens.py) are computed from it.

    python3 tests/tokenizer/make_corpus.py
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import unicodedata

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.jsonl"
BENCH = HERE / "bench"
SEED = 20240613

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "I can't believe it's not butter.",
    "She said: \"Don't go there; it's dangerous.\"",
    "In 1492, Columbus sailed the ocean blue.",
    "The meeting is at 3:30 p.m. on Tuesday, March 5th, 2024.",
    "Prices rose by 3.5% in Q3 (compared with 2.1% in Q2).",
    "E-mail me at john.doe@example.com or visit https://example.org/path?q=1&r=2#frag.",
    "Well... I suppose that's one way to look at it?!",
    "To be, or not to be, that is the question:",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were perfectly normal.",
    "It was the best of times, it was the worst of times.",
    "Tokenizers split text into pieces; language models predict the next piece.",
    "Wait—what? No… that can't be right.",
    "“Smart quotes” and ‘single quotes’ are common in edited prose.",
    "The U.S.A. and the U.K. signed the agreement.",
    "He scored 98/100 on the test, ranking #1 of 250 students.",
    "Temperature: -40°C equals -40°F.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.",
    "ALL CAPS SENTENCES ARE SHOUTING, AREN'T THEY?",
    "camelCaseIdentifiersAndSnake_case_names_and-kebab-case",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "AbCdEfGhIjKlMnOpQrStUvWxYz",
    "Supercalifragilisticexpialidocious is a long word.",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "   leading spaces and trailing spaces   ",
    "Tabs\tbetween\twords\tand a trailing tab\t",
    "Line one\nLine two\n\nLine four after a blank line\n",
    "Windows line endings\r\nare different\r\n",
    "Old Mac line endings\rwere carriage returns\r",
    "What's up? I'm fine, you're great, we've won, they'll see, he'd know.",
    "O'Neil and D'Angelo met at Ma'am's house.",
    "rock 'n' roll, '90s music, 'til dawn",
]

CODE = [
    "int main(void) {\n    printf(\"Hello, world!\\n\");\n    return 0;\n}\n",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))\n",
    "for (size_t i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "static inline uint32_t rotl(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Foo(Bar):\n    \"\"\"Docstring.\"\"\"\n\n    def __init__(self, x=None, *args, **kwargs):\n        super().__init__()\n        self._x = x\n",
    "import numpy as np\nx = np.arange(10).reshape(2, 5)\nprint(x @ x.T)\n",
    "lambda x: [y**2 for y in range(x) if y % 2 == 0]",
    "const add = (a, b) => a + b;\nexport default function App() { return <div className=\"app\">{items.map(i => <Item key={i.id} {...i} />)}</div>; }",
    "if (x !== undefined && y?.z ?? false) { console.log(`value: ${x}`); }",
    "fn main() {\n    let v: Vec<u8> = vec![1, 2, 3];\n    println!(\"{:?}\", v.iter().map(|x| x * 2).collect::<Vec<_>>());\n}\n",
    "impl<'a, T: Clone + 'a> Iterator for Foo<'a, T> { type Item = &'a T; }",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hi\")\n}\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'A%' ORDER BY name DESC LIMIT 10;",
    "<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>Test</title></head>\n<body><p>Hi &amp; bye</p></body>\n</html>",
    "{\"key\": [1, 2.5, -3e10, true, false, null], \"nested\": {\"a\": \"b\\u00e9\"}}",
    "name: test\nsteps:\n  - run: make -j4\n  - run: ./run --help\n",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\" | tr a-z A-Z; done 2>&1 >/dev/null\n",
    "(defun square (x) (* x x))\n(mapcar #'square '(1 2 3))",
    "main :: IO ()\nmain = mapM_ print $ take 10 $ filter even [1..]",
    "public static void main(String[] args) throws IOException { System.out.println(args.length); }",
    "x = a->b.c[d++] << 2 >>= 3 && !e || ~f ^ g % h;",
    "    \t    mixed indentation\n\t\t  and more\n",
    "// comment\n/* block\n   comment */\n# shell comment\n-- sql comment\n",
    "regex = r'^(?:[a-z0-9!#$%&*+/=?^_`{|}~-]+)@\\w+\\.\\w{2,}$'",
    "\\begin{equation} E = mc^2 \\quad \\sum_{i=1}^{n} x_i^2 \\end{equation}",
    "diff --git a/x.c b/x.c\n@@ -1,3 +1,4 @@\n-old line\n+new line\n",
    "0x7FFFFFFF 0b1010 0o755 1_000_000 3.14f 2.5e-3 1e+10 .5 5.",
]

SCRIPTS = {
    "latin": [
        "Voilà, c'est très élégant : l'été à Paris, où l'on mange des crêpes.",
        "Straße, Größe, Übermaß, Äpfel und Öl — schön!",
        "¿Dónde está la estación? ¡Mañana será otro día!",
        "Zażółć gęślą jaźń. Łódź, Kraków, Gdańsk.",
        "Tiếng Việt có nhiều dấu: ả, ạ, ặ, ẫ, ợ, ữ.",
        "Čeština: příliš žluťoučký kůň úpěl ďábelské ódy.",
        "Ísland, Færeyjar, Þórr, Ðð, æ, ø, å.",
        "Türkçe: İstanbul, ığdır, şeker, çay, göz.",
        "Română: știință, țară, întâi.",
        "naïve café coöperate résumé façade jalapeño",
    ],
    "greek": ["Γειά σου Κόσμε! Η γλώσσα μου έδωσαν ελληνική.", "Ἐν ἀρχῇ ἦν ὁ λόγος, καὶ ὁ λόγος ἦν πρὸς τὸν θεόν.",
              "αβγδεζηθικλμνξοπρστυφχψω ΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ"],
    "cyrillic": ["Привет, мир! Как дела?", "Съешь же ещё этих мягких французских булок, да выпей чаю.",
                 "Україна, Київ, їжак, ґанок.", "Ђорђе, Љубљана, Њујорк, Џеп — ћирилица.", "ЁЛКА ёлка Ёж"],
    "arabic": ["مرحبا بالعالم! كيف حالك؟", "اللُّغَةُ العَرَبِيَّةُ جَمِيلَةٌ جِدًّا.", "رقم ١٢٣٤٥ و ٦٧٨٩٠",
               "كتب محمد ٣ كتب في عام ٢٠٢٤م."],
    "hebrew": ["שלום עולם! מה שלומך?", "בְּרֵאשִׁית בָּרָא אֱלֹהִים אֵת הַשָּׁמַיִם וְאֵת הָאָרֶץ.", "עברית 123 English"],
    "devanagari": ["नमस्ते दुनिया! आप कैसे हैं?", "हिन्दी भाषा में ५ अंक: ०१२३४५६७८९", "क्षत्रिय ज्ञान श्री द्वार"],
    "thai": ["สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ", "กรุงเทพมหานคร อมรรัตนโกสินทร์", "๑๒๓๔๕ บาท"],
    "chinese": ["你好，世界！今天天气很好。", "我们在北京大学学习中文和数学。", "這是繁體中文的句子，包含「引號」與《書名號》。",
                "一二三四五六七八九十百千万亿", "人工智能（AI）正在改变世界。2024年，模型越来越大。"],
    "japanese": ["こんにちは世界！元気ですか？", "日本語の文章には、ひらがな・カタカナ・漢字が混ざります。", "ｶﾀｶﾅ（半角）とカタカナ（全角）",
                 "東京スカイツリーは634メートルです。", "ー〜・「」『』【】"],
    "korean": ["안녕하세요 세계! 잘 지내세요?", "한국어는 띄어쓰기를 사용합니다.", "대한민국 서울특별시 2024년"],
    "other": ["Հայերեն, ქართული ენა, ᏣᎳᎩ, ᠮᠣᠩᠭᠣᠯ", "አማርኛ ቋንቋ", "தமிழ் மொழி, తెలుగు, ಕನ್ನಡ, മലയാളം, বাংলা, ગુજરાતી, ਪੰਜਾਬੀ",
              "ລາວ, ខ្មែរ, မြန်မာ, བོད་ཡིག, සිංහල", "ᚠᚢᚦᚨᚱᚲ ᚷᚹ (runes), 𐌰𐌱𐌲 (Gothic), 𓀀𓀁 (hieroglyphs)"],
}

EMOJI = [
    "😀", "😀😃😄😁", "I ❤️ NY", "👍🏽 thumbs up", "👍🏻👍🏼👍🏽👍🏾👍🏿", "👨‍👩‍👧‍👦 family", "👩🏽‍💻 coder", "🏳️‍🌈 flag",
    "🏴‍☠️ pirate", "🇺🇸🇯🇵🇩🇪🇫🇷", "🇺🇸 🇬🇧 🇨🇳", "1️⃣2️⃣3️⃣ #️⃣ *️⃣", "☺ ☺️ ✌ ✌️", "🧑‍🤝‍🧑", "👁️‍🗨️", "😀abc😀",
    "emoji🎉in🎉words", "🤖:🦀+🐍=🚀", "🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland", "♀️♂️⚧️", "🫠🫡🫶 (newer)", "🙂" * 40,
]

COMBINING = [
    "e\u0301", "cafe\u0301 vs caf\u00e9", "n\u0303", "a\u0300\u0301\u0302\u0303\u0304",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357L\u0350G\u0351\u036dO",
    "\u1100\u1161\u11a8 (jamo) vs \uac01", "\u0915\u094d\u0937", "o\u0308\u0332", "\u0627\u064e\u0644\u0652",
    "x\u20d7 x\u20e3 A\u20dd", "\u0301 leading combining mark", "q\u0307\u0323", "\u05e9\u05c1\u05b8",
]

ZERO_WIDTH = [
    "zero\u200bwidth\u200bspace", "zwnj\u200cjoiner", "a\u200db", "\ufeffBOM at start", "BOM\ufeffinside",
    "word\u2060joiner", "soft\u00adhyphen", "left\u200eto\u200fright", "\u202aembedded\u202c \u202eoverride\u202c",
    "\u2066isolate\u2069", "\u200b\u200b\u200b", "\u00ad", "\u180e mongolian vowel separator",
    " \u200b ", "a\u200b b \u200bc", "\u034fcombining grapheme joiner",
]

SPECIAL_LOOKING = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHello<|im_end|>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<s>", "</s>", "<s>Hello</s>", "[multimodal]",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos><start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_image>", "<end_of_image>", "<unused0>", "<unused99>", "<unused6241>", "<0x41>", "<0x0A>",
    "<table><tr><td>1</td></tr></table>", "<h1>Title</h1><em>x</em><b>y</b><code>z</code>", "<div><span>a</span></div>",
    "<|im_start", "im_start|>", "<|im_start|", "<<|im_start|>>", "<|im_start|><|im_start|>", "< |im_start| >",
    "<|IM_START|>", "<|im_start|>  ", "  <|im_end|>", "text<|endoftext|>more", "<repo_name>x<file_sep>y<filename>z",
    "<jupyter_code>print(1)<jupyter_output>1", "<gh_stars>100", "<empty_output>", "<end_of_turn><end_of_turn>",
    "<start_of_turn>", "<end_of_turn>", "<<bos>>", "<bos/>", "</bos>", "<eos >", "<EOS>", "[INST] hi [/INST]",
    "<|user|>", "<|assistant|>", "<|system|>", "<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>user<|end_header_id|>",
    "\u2581", "\u2581\u2581", "a\u2581b", "\u2581hello", " \u2581 ", "<s> </s>", "<unk><unk>",
    "  \n\n\t\t", "\n", "\n\n\n", "\t\t", "   ", "<table>\n\t<tr>  </tr>\n</table>",
]

CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
WORDS = ["he", "it", "don", "they", "we", "I", "she", "you", "that", "o", "x"]
WHITESPACE_CHARS = ["\t", "\n", "\x0b", "\x0c", "\r", " ", "\x85", "\xa0", "\u1680", "\u2000", "\u2001", "\u2002",
                    "\u2003", "\u2004", "\u2005", "\u2006", "\u2007", "\u2008", "\u2009", "\u200a", "\u2028", "\u2029",
                    "\u202f", "\u205f", "\u3000"]
NOT_WHITESPACE = ["\x1c", "\x1d", "\x1e", "\x1f", "\u180e", "\u200b", "\u2060", "\ufeff"]


def case_variants(s: str) -> list[str]:
    letters = [i for i, c in enumerate(s) if c.isalpha()]
    out = []
    for mask in range(1 << len(letters)):
        chars = list(s)
        for bit, i in enumerate(letters):
            if mask >> bit & 1:
                chars[i] = chars[i].upper()
        out.append("".join(chars))
    return out


def contractions() -> list[str]:
    out = []
    for c in CONTRACTIONS:
        for v in case_variants(c):
            out += [f"he{v} here", f"HE{v}", f"{v}", f" {v}", f"x{v}x", f"{v}{v}", f"'{v}"]
    for w in WORDS:
        for c in CONTRACTIONS:
            out.append(f"{w}{c}")
            out.append(f"{w.upper()}{c.upper()}")
    out += ["it’s (typographic)", "''s", "'", "''", "' s", "'S'T'RE", "x'", "'1", "'é", "'ß", "'\u212a"]
    return out


def whitespace(rng: random.Random) -> list[str]:
    out = []
    runs = [" ", "\t", "\n", "\r\n", "\r", " \n", "\n ", " \t", "\t\n", "\n\n \n"]
    for r in runs:
        for k in (1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 40):
            out += [r * k, "a" + r * k + "b", r * k + "a", "a" + r * k, "1" + r * k + "2", "." + r * k + "."]
    for ch in WHITESPACE_CHARS + NOT_WHITESPACE:
        out += [ch, f"a{ch}b", f"{ch}{ch}a", f"a {ch}b", f"a{ch} b", f"x{ch}{ch}{ch}", f"{ch}1", f"!{ch}!",
                f" {ch}", f"{ch} ", f"a{ch}\n", f"\n{ch}z"]
        # next to runs of spaces, whether ch is \s decides which spaces merge ("  " is a token)
        out += [f"a  {ch}", f"{ch}  b", f"  {ch}  ", f"a   {ch}b", f"{ch}\n\n", f"\t\t{ch}x", f"x{ch}    y"]
    for _ in range(60):
        n = rng.randint(1, 20)
        mid = "".join(rng.choice(WHITESPACE_CHARS[:6] + ["  ", "\r\n"]) for _ in range(n))
        out.append(rng.choice(["", "word", "x", "1", "."]) + mid + rng.choice(["", "word", "y", "2", "?"]))
    return out


def numbers(rng: random.Random) -> list[str]:
    out = []
    for k in range(1, 41):
        digits = "".join(str((i * 7 + 3) % 10) for i in range(k))
        out += [digits, f" {digits}", f"x{digits}", f"{digits}x"]
    for v in (0, 7, 42, 1000, 12345, 1234567, 1234567890, 98765432101234):
        out += [f"{v:,}", f"{v:_}", f"{v:,}".replace(",", "."), f"{v:,}".replace(",", " "),
                f"{v:,}".replace(",", "\u202f"), f"-{v}", f"+{v}", f"${v:,}.00", f"{v}%", f"#{v}", f"v{v}.0"]
    out += ["3.14159", "2.718281828459045", "-0.5", ".5", "1e10", "6.022e23", "1.6E-19", "0x1F", "0b1011", "1/2",
            "12:30:45", "2024-01-31", "31/12/1999", "+1 (555) 123-4567", "192.168.0.1", "1.2.3.4.5.6.7.8",
            "½ ¼ ¾ ⅓", "x² + y³ = z⁴", "H₂O CO₂", "Ⅰ Ⅱ Ⅲ Ⅳ Ⅻ ⅻ", "① ② ③ ⑳", "١٢٣٤٥٦٧٨٩٠", "۱۲۳۴۵", "०१२३४५",
            "১২৩", "๑๒๓", "１２３４５", "𝟏𝟐𝟑", "٣.١٤", "𞋀𞋁", "⑴⒈", "1st 2nd 3rd 4th 21st", "1,000,000.00",
            "100,000", "3,14", "007", "0000000000", "9" * 100]
    for _ in range(60):
        k = rng.randint(1, 25)
        s = "".join(rng.choice("0123456789") for _ in range(k))
        sep = rng.choice(["", ",", ".", " ", "-", "/", ":", "_"])
        out.append(sep.join(s[i:i + 3] for i in range(0, len(s), 3)))
    return out


def punctuation(rng: random.Random) -> list[str]:
    out = ["!!!", "?!", "...", "…", "—", "--", "---", "<<>>", "{{}}", "[[]]", "***", "~~~", "&&", "||", "::", "->",
           "=>", "!=", "===", "/**/", "#!", "@@", "$$$", "%%", "^^", "``", "```python", "''", "\"\"", "(((", ")))",
           "a...b", "wait!!!", "what?!?!", "end.", " .", " ,", ". . .", "«»", "„“", "‹›", "¡¿", "·•", "§¶", "†‡",
           "¦", "©®™", "°±×÷", "∑∏∫√∞≈≠≤≥", "←↑→↓↔", "♠♣♥♦", "★☆", "✓✗", "€£¥₹₽₿", "、。，！？；：", "（）【】《》",
           "\\n", "\\\\", "/\\/\\", "_-_-_", "+-+-+", "|-|", "=+=", "<->"]
    pool = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    for _ in range(120):
        k = rng.randint(1, 12)
        s = "".join(rng.choice(pool) for _ in range(k))
        out.append(rng.choice(["", " ", "a", "1"]) + s + rng.choice(["", " ", "b", "2", "\n"]))
    return out


def unicode_sweep(rng: random.Random) -> list[str]:
    """Code points of every general category, in contexts where their class matters."""
    by_cat: dict[str, list[int]] = {}
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        by_cat.setdefault(unicodedata.category(chr(cp)), []).append(cp)
    out = []
    for cat in sorted(by_cat):
        cps = by_cat[cat]
        for _ in range(12 if cat not in ("Cn", "Co") else 6):
            ch = chr(rng.choice(cps))
            out.append(rng.choice([f"{ch}", f"a{ch}b", f" {ch}", f"{ch}{ch} x", f"1{ch}2", f"'{ch}", f"!{ch}!", f"{ch}\n"]))
    # letters and numbers new in Unicode 15.0 / 15.1 (the oracle's tables are 15.1)
    for cp in (0x1E030, 0x1E04F, 0x31350, 0x3134A + 6, 0x2EBF0, 0x2EE5D, 0x1D2C0, 0x1D2D3, 0x11F04, 0x1E4D0,
               0x1E4F0, 0x10EFD, 0x1133B, 0x2FFC, 0x31EF):
        ch = chr(cp)
        out += [f"a{ch}b", f" {ch}{ch}", f"{ch}1"]
    # characters just outside the letter/number ranges the splitter cares about
    for ch in "ªºˆ˜ʰ々〆〇ⅰↀ↉⁰₀𝟎𝟘µß\u0345\u1e9e\uff21\uff41\u2160\u3007\U0001d400\U0001f130":
        out += [ch, f"x{ch}y", f" {ch}1"]
    return out


def scripts(rng: random.Random) -> list[str]:
    out = []
    for lines in SCRIPTS.values():
        out += lines
        for line in lines:
            words = line.split()
            for _ in range(2):
                k = rng.randint(1, max(1, len(words)))
                out.append(" ".join(rng.sample(words, k)))
    cjk = (BENCH / "cjk.txt").read_text(encoding="utf-8").split("\n")
    out += [line for line in cjk[:400:5] if line.strip()]
    return out


def bench_excerpts(name: str, count: int, rng: random.Random, max_len: int = 400) -> list[str]:
    text = (BENCH / name).read_text(encoding="utf-8")
    out = []
    for _ in range(count):
        start = rng.randrange(0, len(text) - 10)
        length = rng.randint(5, max_len)
        out.append(text[start:start + length])
    return out


def random_mixes(rng: random.Random, count: int) -> list[str]:
    atoms = ["hello", "World", " ", "  ", "\n", "\t", "123", "4", "'s", "'LL", "!", "?!", "...", "é", "ß", "中文", "日本",
             "한국", "Ωμέγα", "Жук", "مرحبا", "שלום", "नमस्ते", "ไทย", "😀", "👍🏽", "🇯🇵", "\u200b", "\u0301", "\u00a0",
             "\u3000", "<|im_start|>", "<s>", "</s>", "<bos>", "\r\n", "0x1F", "3.14", "_", "-", "/", "\\", "\"", "`"]
    out = []
    for _ in range(count):
        out.append("".join(rng.choice(atoms) for _ in range(rng.randint(1, 14))))
    for _ in range(count // 3):
        out.append("".join(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x3000, 0xD7FF),
                                           rng.randint(0xE000, 0xFFFD), rng.randint(0x10000, 0x10FFFF)]))
                           for _ in range(rng.randint(1, 12))))
    return out


def merge_probes() -> list[str]:
    """Words that are tokens only in the test variants (variants.py): ignore_merges shows here."""
    words = ["qzxq", " qzxq", "a qzxq b", "zzqzz", "qzxqzzqzz", "Qzxq", "QZXQ", "qzxq's", "x qzxq", "\tqzxq",
             "1qzxq", "qzxq1", "zzqzz zzqzz", "\nqzxq", "(qzxq)", "a\U0002EBF0", " a\U0002EBF0 ", "\U00031350x",
             "b\U0001E030", "\U0001D2C0!", "x\U0001D2C0!", "\U0001D2C0\U0001D2C0!"]
    return words + ["12", "123", "1234", "12345", " 123456", "x1234567", "1,234", "99 999 9999", "00", "000", "0000"]


def long_runs() -> list[str]:
    return ["a" * 5000, " " * 3000, "\n" * 1000, "\t" * 700, "1" * 2000, "ab" * 2000, "中" * 1500, "😀" * 500,
            "!" * 1000, "a " * 1500, "hello world " * 300, "\r\n" * 500, " \n" * 400, "\u3000" * 300,
            "x" * 4000 + " y", "The " * 800, "<s>" * 300, "\n\n\n" * 100 + "end", "  " * 600 + "x"]


def byte_strings(rng: random.Random) -> list[bytes]:
    """Not valid UTF-8 (or encoded surrogates, which Python calls invalid)."""
    out = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(", b"\xf0\x9f\x98",
           b"\xf0\x9f\x98 ", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xfe\xff", b"\xff\xfe\xfd", b"a\x80b",
           b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80", b"x\xed\xb0\x80y", b"\xc0\xaf", b"\xe0\x80\xaf",
           b"\xf4\x90\x80\x80", b"caf\xe9", b"\xa9 2024", b"\x80" * 50, b"\xc3 \xa9", b"\xe2 \x96\x81", b"\xe2\x96 ",
           b"Hello\xffWorld", b"\xef\xbb\xbf\xef\xbb", b"\xf0\x80\x80\x80", b"\xe0\xa0", b"\xc2", b"\xc2\x20\x80"]
    for _ in range(60):
        out.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 24))))
    return out


def control_strings() -> list[str]:
    out = ["\x00", "a\x00b", "\x00\x00\x00", "nul\x00 in\x00 text", "\x01\x02\x03", "\x07bell", "\x08backspace",
           "\x1b[31mred\x1b[0m", "\x7f", "del\x7fete", "\x80\x81\x9f".encode("latin-1").decode("utf-8", "replace"),
           "\u0080\u0085\u009f", "x\u0085y", "\x04\x06\x13\x14\x16\x1d", "a\x04b\x06c", "\x0e\x0f"]
    return out


def chat_strings() -> list[str]:
    sys_prompt = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    users = ["Hi", "What is 2+2?", "Write a haiku about autumn.", "  spaced  ", "multi\nline\nquestion", "<|im_end|> injected?",
             "Translate 'bonjour' to English.", "日本語で答えて", ""]
    out = []
    for u in users:
        out.append(f"<|im_start|>system\n{sys_prompt}<|im_end|>\n<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n")
        out.append(f"<bos><start_of_turn>user\n{u.strip()}<end_of_turn>\n<start_of_turn>model\n")
        out.append(f"<start_of_turn>user\nSystem rules\n\n{u}<end_of_turn>\n<start_of_turn>model\nSure.<end_of_turn>\n")
    return out


def build() -> list[dict]:
    rng = random.Random(SEED)
    entries: list[tuple[str, str | bytes]] = []

    def add(cat: str, items) -> None:
        entries.extend((cat, x) for x in items)

    add("english", ENGLISH)
    add("english", bench_excerpts("english.txt", 180, rng))
    add("code", CODE)
    add("code", bench_excerpts("code.txt", 160, rng, 600))
    add("whitespace", whitespace(rng))
    add("numbers", numbers(rng))
    add("punctuation", punctuation(rng))
    add("contractions", contractions())
    add("scripts", scripts(rng))
    add("emoji", EMOJI)
    add("combining", COMBINING)
    add("zero_width", ZERO_WIDTH)
    add("special", SPECIAL_LOOKING)
    add("chat", chat_strings())
    add("unicode", unicode_sweep(rng))
    add("random", random_mixes(rng, 240))
    add("merge_probes", merge_probes())
    add("long", long_runs())
    add("control", control_strings())
    add("bytes", byte_strings(rng))
    seen: set[bytes] = set()
    out = []
    for cat, x in entries:
        raw = x if isinstance(x, bytes) else x.encode("utf-8")
        if raw in seen:
            continue
        seen.add(raw)
        try:
            out.append({"cat": cat, "text": raw.decode("utf-8")})
        except UnicodeDecodeError:
            out.append({"cat": cat, "hex": raw.hex()})
    return out


def entry_bytes(entry: dict) -> bytes:
    return bytes.fromhex(entry["hex"]) if "hex" in entry else entry["text"].encode("utf-8")


def load_corpus(path: Path = CORPUS) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if corpus.jsonl differs from a fresh build")
    args = ap.parse_args()
    if unicodedata.unidata_version != "14.0.0":
        # the sweep samples code points by the stdlib's categories; pin it so the file is reproducible
        print(f"make_corpus.py: expected the stdlib Unicode 14.0.0 (Python 3.11), have {unicodedata.unidata_version}",
              file=sys.stderr)
    text = "".join(json.dumps(e, ensure_ascii=True) + "\n" for e in build())
    if args.check:
        same = CORPUS.read_text(encoding="utf-8") == text
        print("make_corpus.py: corpus.jsonl is " + ("up to date" if same else "STALE"))
        return 0 if same else 1
    CORPUS.write_text(text, encoding="utf-8")
    counts: dict[str, int] = {}
    for line in text.splitlines():
        cat = json.loads(line)["cat"]
        counts[cat] = counts.get(cat, 0) + 1
    print(f"make_corpus.py: {sum(counts.values())} strings: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
