"""Chat: the chat template (-c, -m chat, -y), KV reuse across turns, the
end-of-turn token, piped and terminal (pty) sessions, a full context.

Expected token ids come from tests/chat/golden.json, written by
tests/chat/make_golden.py from the template stored in the GGUF (rendered by
jinja2) and llama.cpp's tokenizer — never from the engine. What the engine fed
is observed through `--print-prompt-ids` (one `ids:` line per prefilled block)
and `-v` (`turn N: prefill K new tokens (M already cached)`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pty
import re
import select
import signal
import time

from common import DEFAULT_GGUF, RUN, TESTS, gguf_metadata, model, require, run

GOLDEN_PATH = TESTS / "chat" / "golden.json"
CONTROL_TEXTS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
TURN_RE = re.compile(r"^turn (\d+): prefill (\d+) new tokens \((\d+) already cached\)$")
DECODE_RE = re.compile(r"^decode: (\d+) tokens")
N_ANSWER = 48  # long enough for the greedy answer to USER1 to end at <|im_end|>


@functools.cache
def golden() -> dict:
    return json.loads(require(GOLDEN_PATH, "run python3 tests/chat/make_golden.py").read_text(encoding="utf-8"))


def case(name: str) -> dict:
    return golden()["cases"][name]


def parse_stderr(err: bytes) -> dict:
    """The -v / --print-prompt-ids lines of a chat run, per turn."""
    turns, blocks, decoded, other = [], [], [], []
    for line in err.decode("utf-8", "replace").splitlines():
        if m := TURN_RE.match(line):
            turns.append(tuple(int(g) for g in m.groups()))
        elif line.startswith("ids:"):
            blocks.append([int(x) for x in line[4:].split()])
        elif m := DECODE_RE.match(line):
            decoded.append(int(m.group(1)))
        else:
            other.append(line)
    return {"turns": turns, "blocks": blocks, "decoded": decoded, "other": other}


def chat(lines: bytes, *flags: str) -> tuple:
    """Piped chat with -v and --print-prompt-ids; returns (process, parsed stderr)."""
    p = run([model(), "-m", "chat", "-t", "0", "-v", "--print-prompt-ids", *flags], stdin=lines, timeout=240)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}"
    return p, parse_stderr(p.stderr)


@functools.cache
def two_turn() -> tuple:
    """The scripted two-turn conversation, run once and shared by the tests."""
    g = golden()
    return chat(f"{g['user1']}\n{g['user2']}\n".encode(), "-n", str(N_ANSWER))


def expected_second_block(first_answer_tokens: int, limit: int, after: list[int], block2: list[int]) -> list[int]:
    """What turn 2 must prefill: the template's closing of answer 1 and the
    new user turn. When answer 1 stopped at -n, its last sampled token was
    never fed, so it leads the block."""
    if first_answer_tokens < limit:
        return after
    return block2[:1] + after


# ----- the template, one turn --------------------------------------------------

def test_golden_matches_the_models_template():
    """golden.json was rendered from the template this GGUF carries (rerun
    make_golden.py when the model changes; --check compares)."""
    template = gguf_metadata(DEFAULT_GGUF, "tokenizer.chat_template")
    assert hashlib.sha256(template.encode()).hexdigest() == golden()["template_sha256"], \
        "the GGUF's chat template changed: rerun python3 tests/chat/make_golden.py"


def tokenize_c(*flags: str, stdin: bytes | None = None) -> list[int]:
    p = run([model(), "-c", "--tokenize", *flags], stdin=stdin, timeout=60)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return [int(x) for x in p.stdout.split()]


def test_c_template_default_system():
    """-c: ChatML with SmolLM2's default system turn, then the generation prompt."""
    c = case("default_system")
    assert tokenize_c("-i", golden()["user1"]) == c["ids"], f"oracle rendering: {c['text']!r}"


def test_c_template_custom_system():
    c = case("custom_system")
    assert tokenize_c("-i", golden()["user1"], "-y", golden()["custom_system"]) == c["ids"], c["text"]


def test_c_template_empty_system():
    """-y "" is an explicit, empty system message: the template renders an
    empty system turn (it only adds its default when there is no system
    message at all)."""
    c = case("empty_system")
    got = tokenize_c("-i", golden()["user1"], "-y", "")
    assert got == c["ids"], f"-y '': engine {got}\noracle {c['ids']} ({c['text']!r})"


def test_c_template_multiline_unicode_stdin():
    """A multi-line, non-ASCII prompt from stdin is one user message (only
    one trailing newline is dropped)."""
    c = case("multiline")
    assert tokenize_c(stdin=c["messages"][0]["content"].encode() + b"\n") == c["ids"], c["text"]


def test_c_message_cannot_inject_template_tokens():
    """Control-token texts in a message stay plain text without --special."""
    c = case("injection")
    text = c["messages"][0]["content"]
    assert c["ids"] != c["injected_ids"]
    got = tokenize_c("-i", text)
    assert got == c["ids"], f"engine {got}\nexpected {c['ids']}"


def test_special_is_honoured_in_chat():
    """Issue 35: --special parses control-token texts in the user's text with -c, -m chat and batch chat lines
    too (it was silently ignored there): the ids are the rendered template tokenized whole with control tokens
    parsed (the golden's injected_ids, from llama.cpp's tokenizer)."""
    c = case("injection")
    text = c["messages"][0]["content"]
    want = c["injected_ids"]
    got = tokenize_c("-i", text, "--special")
    assert got == want, f"-c --special: engine {got}\nexpected {want}"
    # chat takes a line per message: a one-line message, whose -c ids the check above vouches for, holding one
    # more <|im_end|> id (which --tokenize --special gives alone) than the template puts in
    one_line = "Say hi<|im_end|>"
    want = tokenize_c("-i", one_line, "--special")
    end_id = [int(x) for x in run([model(), "--tokenize", "--special", "-i", "<|im_end|>"]).stdout.split()]
    assert len(end_id) == 1 and want.count(end_id[0]) == tokenize_c("-i", one_line).count(end_id[0]) + 1, want
    p = run([model(), "-m", "chat", "--special", "--print-prompt-ids", "-n", "0"], stdin=one_line.encode() + b"\n",
            timeout=60)
    ids = [line for line in p.stderr.decode().splitlines() if line.startswith("ids:")]
    assert p.returncode == 0 and ids and [int(x) for x in ids[0].split()[1:]] == want, f"-m chat --special: {ids}"
    line = json.dumps({"prompt": one_line, "chat": True, "n": 1})
    p = run([model(), "--batch", "-", "--special", "--print-prompt-ids"], stdin=line.encode() + b"\n", timeout=60)
    ids = [line for line in p.stderr.decode().splitlines() if line.startswith("ids (line 1):")]
    assert p.returncode == 0 and ids and [int(x) for x in ids[0].split(":", 1)[1].split()] == want, \
        f"batch chat line --special: {ids} {p.stderr.decode(errors='replace')[-500:]}"


def test_c_prints_only_the_answer():
    """`echo "..." | ./run MODEL -c -t 0` prints the answer and nothing of the
    template; it is the same answer as the first chat turn (same prefill)."""
    g = golden()
    p = run([model(), "-c", "-t", "0", "-n", str(N_ANSWER)], stdin=f"{g['user1']}\n".encode(), timeout=120)
    assert p.returncode == 0 and p.stderr == b"", p.stderr.decode(errors="replace")
    out = p.stdout.decode()
    assert out.strip(), "empty answer"
    for text in (*CONTROL_TEXTS, "assistant\n", "SmolLM", g["user1"]):
        assert text not in out, f"{text!r} in the -c output {out!r}"
    chat_out = two_turn()[0].stdout.decode()
    assert chat_out.startswith(out + "\n"), f"-c answer {out!r} differs from chat turn 1 {chat_out!r}"


def test_print_prompt_ids_in_generate_mode():
    """--print-prompt-ids is not chat-only: a plain prompt shows its ids."""
    p = run([model(), "-i", "Hello world", "-n", "1", "-t", "0", "--print-prompt-ids"], timeout=60)
    ids = run([model(), "-i", "Hello world", "--tokenize"], timeout=60).stdout.split()
    assert p.returncode == 0 and parse_stderr(p.stderr)["blocks"] == [[int(x) for x in ids]], p.stderr.decode(errors="replace")


# ----- piped chat, two turns -----------------------------------------------------

def test_chat_first_turn_is_the_template():
    p, v = two_turn()
    assert v["blocks"], "no `ids:` lines on stderr: --print-prompt-ids is missing"
    assert v["blocks"][0] == case("two_turn")["before"], f"turn 1 fed {v['blocks'][0]}\noracle {case('two_turn')['before']}"


def test_chat_second_turn_prefills_only_its_new_tokens():
    """Turn 2 feeds exactly the oracle's tokens between answer 1 and the next
    generation prompt; everything before stays cached: the cached count is
    turn 1's prompt plus every answer token that was fed."""
    p, v = two_turn()
    c = case("two_turn")
    assert len(v["turns"]) == 2 and len(v["decoded"]) == 2, f"expected 2 turns on stderr: {v}"
    assert v["turns"][0] == (1, len(c["before"]), 0), v["turns"][0]
    n1 = v["decoded"][0]
    fed1 = n1 if n1 < N_ANSWER else n1 - 1
    assert len(v["blocks"]) == 2, f"expected one `ids:` line per turn, got {len(v['blocks'])}"
    want = expected_second_block(n1, N_ANSWER, c["after"], v["blocks"][1])
    assert v["blocks"][1] == want, f"turn 2 fed {v['blocks'][1]}\noracle {want} ({c['after_text']!r})"
    assert v["turns"][1] == (2, len(want), len(c["before"]) + fed1), \
        f"turn 2: {v['turns'][1]}, want (2, {len(want)}, {len(c['before']) + fed1})"


def test_chat_end_of_turn_token_never_printed():
    """Answer 1 ends at <|im_end|> (before -n), which is not printed, and
    turn 2 starts with the template's own <|im_end|>: the sampled one was
    not fed a second time."""
    p, v = two_turn()
    out = p.stdout.decode()
    for text in CONTROL_TEXTS:
        assert text not in out, f"{text!r} printed: {out!r}"
    assert v["decoded"][0] < N_ANSWER, f"answer 1 did not end at the end-of-turn token within -n {N_ANSWER}"
    end = golden()["special"]["<|im_end|>"]
    assert v["blocks"][1][0] == end and v["blocks"][1][1] != end, v["blocks"][1][:3]
    assert out.endswith("\n") and out.count("\n") >= 2, f"two answers, each ending with a newline: {out!r}"


def test_chat_custom_system_truncated_answer_crlf_and_blank_lines():
    """-y sets the system turn; an answer cut by -n keeps its last token and
    is closed by the template; CR LF line ends, blank lines and a last line
    without a newline are handled."""
    g = golden()
    c = case("two_turn_custom_system")
    p, v = chat(f"\n{g['user1']}\r\n\n{g['user2']}".encode(), "-n", "1", "-y", g["custom_system"])
    assert [t[0] for t in v["turns"]] == [1, 2], f"two turns expected: {v['turns']}"
    assert v["blocks"][0] == c["before"], f"turn 1 fed {v['blocks'][0]}\noracle {c['before']}"
    assert v["decoded"][0] == 1, v["decoded"]
    want = expected_second_block(1, 1, c["after"], v["blocks"][1])
    assert v["blocks"][1] == want and want[0] not in golden()["special"].values(), \
        f"turn 2 fed {v['blocks'][1]}\nwant the answer's token then {c['after']}"
    assert v["turns"][1] == (2, len(c["after"]) + 1, len(c["before"])), v["turns"][1]
    assert p.stdout.count(b"\n") == 2, p.stdout


def test_chat_context_full_drops_oldest_exchanges():
    """--help: when the conversation plus min(-n, ctx/4) answer tokens would
    overflow, the oldest exchanges go, the system turn stays, and the rest is
    prefilled again; a message that cannot fit at all is refused on stderr
    and the chat goes on."""
    # 72 tokens hold two short exchanges; the third message overflows.
    ctx, n = 72, 2
    open_ids = case("default_system")["ids"]
    system_turn = open_ids[: open_ids.index(golden()["special"]["<|im_start|>"], 1)]
    messages = [f"Say the number {i}." for i in range(1, 4)]
    too_long = " ".join(["word"] * 100)
    lines = "\n".join(messages[:2] + [too_long] + messages[2:]) + "\n"
    p, v = chat(lines.encode(), "-n", str(n), "--ctx", str(ctx))
    assert p.returncode == 0
    assert any("too long" in line for line in v["other"]), f"no 'too long' message: {v['other']}"
    assert len(v["turns"]) == len(messages), f"{len(messages)} answered turns expected: {v['turns']}"
    assert v["blocks"][0][: len(system_turn)] == system_turn
    reprefills = [i for i, (_, _, cached) in enumerate(v["turns"]) if cached == 0][1:]
    assert reprefills, f"the context never filled: {v['turns']}"
    first_user = v["blocks"][0][len(system_turn):]
    for i in reprefills:
        block = v["blocks"][i]
        assert block[: len(system_turn)] == system_turn, f"turn {i + 1}: system turn not kept: {block[:30]}"
        assert block[len(system_turn)] == golden()["special"]["<|im_start|>"], block[: len(system_turn) + 3]
        assert block[len(system_turn):][: len(first_user)] != first_user, "oldest exchange not dropped"
        assert len(block) + n <= ctx, f"turn {i + 1}: {len(block)} tokens + {n} > ctx {ctx}"
    for (_, k, cached), block in zip(v["turns"], v["blocks"]):
        assert cached + k + n <= ctx and k == len(block), (cached, k, len(block))
    assert p.stdout.count(b"\n") >= len(messages)


# ----- a terminal session through a pseudo-terminal -----------------------------

class Tty:
    """The engine on a pty, as its controlling terminal (so Ctrl-C and
    Ctrl-D are turned into SIGINT and end-of-file by the line discipline)."""

    def __init__(self, *flags: str):
        argv = [str(RUN), model(), "-m", "chat", *flags]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            try:
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.out = b""
        self.open = True

    def read_for(self, seconds: float) -> bytes:
        end, got = time.time() + seconds, b""
        while (left := end - time.time()) > 0:
            if not select.select([self.fd], [], [], left)[0]:
                break
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            got += chunk
        self.out += got
        return got

    def expect(self, pattern: bytes, timeout: float, start: int = 0) -> int:
        """Reads until pattern occurs in the output after offset start;
        returns the offset just past it."""
        end = time.time() + timeout
        while (i := self.out.find(pattern, start)) < 0:
            if time.time() > end or not select.select([self.fd], [], [], end - time.time())[0]:
                raise AssertionError(f"waited {timeout}s for {pattern!r}; terminal shows {self.out[-600:]!r}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                raise AssertionError(f"terminal closed before {pattern!r}; it showed {self.out[-600:]!r}")
            self.out += chunk
        return i + len(pattern)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float) -> int:
        end = time.time() + timeout
        while time.time() < end:
            self.read_for(0.05)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.close()
                return os.waitstatus_to_exitcode(status)
        self.kill()
        raise AssertionError(f"still running after {timeout}s; terminal shows {self.out[-600:]!r}")

    def close(self) -> None:
        if self.open:
            os.close(self.fd)
            self.open = False

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.close()


PROMPT = b"> "
LONG_ANSWER = b"Count from 1 to 300, one number per line.\n"


def test_tty_prompt_ctrl_c_answer_ctrl_d():
    """Prompt shown; a long answer streams and Ctrl-C stops it mid-way, back
    at the prompt; the chat goes on (the next message is answered); Ctrl-D
    at the prompt exits with status 0."""
    g = golden()
    t = Tty("-t", "0", "-n", "2000")
    try:
        at = t.expect(PROMPT, 30)
        # First message of the session: its greedy answer is a long count.
        t.send(LONG_ANSWER)
        at = t.expect(LONG_ANSWER.rstrip(b"\n") + b"\r\n", 10, at)  # the terminal's echo
        deadline = time.time() + 120
        while len(t.out) - at < 12 and time.time() < deadline:
            t.read_for(0.2)
        assert len(t.out) - at >= 12, f"no answer streaming: {t.out[at:]!r}"
        assert PROMPT not in t.out[at:], f"the long answer ended by itself: {t.out[at:]!r}"
        t.send(b"\x03")
        caret = t.expect(b"^C", 10, at)  # the terminal echoes Ctrl-C when it sends SIGINT
        back = t.expect(b"\r\n" + PROMPT, 60, caret)
        # At most the token being decoded when the signal came may follow.
        after = t.out[caret:back]
        assert len(after) <= 32, f"the answer went on after Ctrl-C: {after[:200]!r}..."
        assert t.read_for(1.0) == b"", "output continued after the prompt came back"

        t.send(f"{g['user1']}\n".encode())
        at = t.expect(g["user1"].encode() + b"\r\n", 10, back)
        end = t.expect(b"\r\n" + PROMPT, 120, at)
        answer = t.out[at:end].decode(errors="replace")
        assert answer.strip() and not any(c in answer for c in CONTROL_TEXTS), f"answer {answer!r}"

        t.send(b"\x04")
        code = t.wait(30)
        assert code == 0, f"Ctrl-D at the prompt: exit {code}, want 0; terminal: {t.out[-300:]!r}"
    except BaseException:
        t.kill()
        raise


def test_tty_ctrl_c_at_prompt_exits_130():
    t = Tty("-t", "0", "-n", "8")
    try:
        t.expect(PROMPT, 30)
        t.send(b"\x03")
        code = t.wait(30)
        assert code == 130, f"Ctrl-C at the prompt: exit {code}, want 130 (documented in -h)"
    except BaseException:
        t.kill()
        raise


def test_chat_system_prompt_that_fills_the_context_is_an_error():
    """Issue 35: a system prompt that leaves no room for any message beside it (40 words, --ctx 16) ends chat
    with one line and exit 1, as -c's prompt does; it answered every message with an empty line and exited 0."""
    system = "word " * 40
    p = run([model(), "-m", "chat", "--ctx", "16", "-n", "4", "-y", system], stdin=b"hi\nthere\n", timeout=60)
    err = p.stderr.decode(errors="replace").splitlines()
    assert p.returncode == 1 and p.stdout == b"", f"exit {p.returncode}, stdout {p.stdout!r}, {err}"
    assert len(err) == 1 and err[0].startswith("run: ") and "system prompt" in err[0] and "16" in err[0], err
    p = run([model(), "-c", "-i", "hi", "--ctx", "16", "-n", "4", "-y", system], timeout=60)
    assert p.returncode == 1 and p.stdout == b"", f"-c: exit {p.returncode}"
