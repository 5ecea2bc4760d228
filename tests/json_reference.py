"""An independent reference for the --json automaton: a recursive-descent recognizer of RFC 8259 JSON text with the
bounds the README's "Structured output" section documents, written from the RFC, not from run.c.

classify(b) says "invalid", "prefix" or "complete": the parser raises Incomplete when it runs out of input where a
value could still go on, Invalid at a byte no JSON text can hold there. UTF-8 validity comes from Python's own strict
decoder (an unfinished sequence is valid when some continuation completes it), and a top-level number is complete
as soon as its digits form one (more digits may follow).
"""
from __future__ import annotations

import re

MAX_WS = 16       # whitespace bytes in a row, of them at most one line break
MAX_NUMBER = 40   # bytes of one number
MAX_DEPTH = 32    # open arrays and objects
WS = b" \t\n\r"
ESCAPES = b'"\\/bfnrt'
HEX = b"0123456789abcdefABCDEF"


class Incomplete(Exception):
    """The input ended where more must come."""


class Invalid(Exception):
    """No JSON text continues the input."""


def _utf8_can_complete(seq: bytes, need: int) -> bool:
    """Whether the first bytes `seq` of a `need`-byte UTF-8 sequence can be completed into a valid character: the
    next missing byte is tried over every continuation value, the ones after it as 0x80 (only a sequence's second
    byte has a narrower range than 0x80-0xBF)."""
    missing = need - len(seq)
    for b in range(0x80, 0xC0):
        try:
            (seq + bytes([b]) + b"\x80" * (missing - 1)).decode("utf-8")
            return True
        except UnicodeDecodeError:
            pass
    return False


class Parser:
    def __init__(self, data: bytes) -> None:
        self.b = data
        self.i = 0

    def peek(self) -> int:
        if self.i >= len(self.b):
            raise Incomplete
        return self.b[self.i]

    def take(self, allowed: bytes) -> int:
        c = self.peek()
        if c not in allowed:
            raise Invalid
        self.i += 1
        return c

    def ws(self) -> None:
        """A whitespace run: at most MAX_WS bytes, spaces and tabs around at most one line break (\\n or \\r\\n)."""
        run = self.b[self.i:self.i + MAX_WS + 1]
        run = run[:len(run) - len(run.lstrip(WS))]
        at_end = self.i + len(run) == len(self.b)
        if at_end and run.endswith(b"\r"):  # its line feed may still come, if there is room for it
            if len(run) + 1 > MAX_WS or not re.fullmatch(rb"[ \t]*(\r?\n)?[ \t]*", run + b"\n"):
                raise Invalid
        elif len(run) > MAX_WS or not re.fullmatch(rb"[ \t]*(\r?\n)?[ \t]*", run):
            raise Invalid
        self.i += len(run)

    def value(self, depth: int) -> None:
        c = self.peek()
        if c == ord("{"):
            self.obj(depth)
        elif c == ord("["):
            self.arr(depth)
        elif c == ord('"'):
            self.string()
        elif c == ord("-") or chr(c).isdigit():
            self.number()
        else:
            for word in (b"true", b"false", b"null"):
                if c == word[0]:
                    for ch in word:
                        self.take(bytes([ch]))
                    return
            raise Invalid

    def arr(self, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise Invalid
        self.take(b"[")
        self.ws()
        if self.peek() == ord("]"):
            self.i += 1
            return
        while True:
            self.ws()
            self.value(depth + 1)
            self.ws()
            if self.take(b",]") == ord("]"):
                return

    def obj(self, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise Invalid
        self.take(b"{")
        self.ws()
        if self.peek() == ord("}"):
            self.i += 1
            return
        while True:
            self.ws()
            if self.peek() != ord('"'):
                raise Invalid
            self.string()
            self.ws()
            self.take(b":")
            self.ws()
            self.value(depth + 1)
            self.ws()
            if self.take(b",}") == ord("}"):
                return

    def hex4(self, ok) -> int:
        """Four hex digits whose value must satisfy ok; at the end of input, some completion must."""
        digits = ""
        for _ in range(4):
            if self.i >= len(self.b):
                free = 4 - len(digits)
                if any(ok(int(digits + f"{x:0{free}x}", 16)) for x in range(16 ** free)):
                    raise Incomplete
                raise Invalid
            digits += chr(self.take(HEX))
        v = int(digits, 16)
        if not ok(v):
            raise Invalid
        return v

    def string(self) -> None:
        self.take(b'"')
        while True:
            c = self.peek()
            if c == ord('"'):
                self.i += 1
                return
            if c < 0x20:
                raise Invalid
            if c == ord("\\"):
                self.i += 1
                e = self.take(ESCAPES + b"u")
                if e == ord("u"):
                    v = self.hex4(lambda v: not 0xDC00 <= v <= 0xDFFF)
                    if 0xD800 <= v <= 0xDBFF:
                        self.take(b"\\")
                        self.take(b"u")
                        self.hex4(lambda v: 0xDC00 <= v <= 0xDFFF)
                continue
            if c < 0x80:
                self.i += 1
                continue
            need = 2 if 0xC0 <= c < 0xE0 else 3 if 0xE0 <= c < 0xF0 else 4 if 0xF0 <= c < 0xF8 else 0
            if not need:
                raise Invalid
            seq = self.b[self.i:self.i + need]
            if len(seq) < need:
                if _utf8_can_complete(seq, need):
                    raise Incomplete
                raise Invalid
            try:
                seq.decode("utf-8")
            except UnicodeDecodeError:
                raise Invalid
            self.i += need

    def number(self) -> None:
        start = self.i
        ends = False  # the text so far is a whole number

        def step(allowed: bytes, ending: bool) -> bool:
            nonlocal ends
            if self.i >= len(self.b) or self.b[self.i] not in allowed:
                return False
            self.i += 1
            ends = ending
            n = self.i - start
            if n > MAX_NUMBER or (n == MAX_NUMBER and not ends):
                raise Invalid
            return True

        def must(allowed: bytes, ending: bool) -> None:
            if self.i >= len(self.b):
                raise Incomplete
            if not step(allowed, ending):
                raise Invalid

        digits = b"0123456789"
        step(b"-", False)
        if self.peek() == ord("0"):
            must(b"0", True)
        else:
            must(b"123456789", True)
            while step(digits, True):
                pass
        if step(b".", False):
            must(digits, True)
            while step(digits, True):
                pass
        if step(b"eE", False):
            step(b"+-", False)
            must(digits, True)
            while step(digits, True):
                pass


def classify(data: bytes) -> str:
    p = Parser(data)
    try:
        p.ws()
        p.value(0)
    except Incomplete:
        return "prefix"
    except Invalid:
        return "invalid"
    return "complete" if p.i == len(data) else "invalid"
