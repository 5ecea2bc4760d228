"""Perplexity from per-position logits, written from llama.cpp's definition (independent of run.c).

llama.cpp's `llama-perplexity` (and `./run --ppl`) cut the token sequence into
consecutive, non-overlapping windows of `ctx` tokens and drop the incomplete
tail. Each window is evaluated from position 0 (with add-BOS models its first
token is replaced by BOS). Only the second half of each window is scored, so
every scored token has at least ctx/2 tokens of context: the logits at
positions p = ctx/2 .. ctx-2 are scored against the token at p + 1.

    perplexity = exp( mean over scored (p, window) of  logsumexp(logits[p]) - logits[p][token[p + 1]] )

A library for tests/test_quant.py (no command line).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Window:
    tokens: list[int]      # the ctx tokens fed to the model (BOS substituted when asked)
    targets: list[int]     # the tokens predicted at the scored positions
    first: int             # first scored position; positions first .. ctx-2 are scored


def windows(tokens: Sequence[int], ctx: int, bos: int | None = None) -> list[Window]:
    """The windows llama.cpp's perplexity evaluates for `tokens`; `bos` is substituted at position 0 when given."""
    if ctx < 2:
        raise ValueError("ctx must be at least 2")
    first = ctx // 2
    out = []
    for start in range(0, len(tokens) - ctx + 1, ctx):
        win = list(tokens[start:start + ctx])
        targets = win[first + 1:ctx]           # read before BOS substitution (position 0 is never a target)
        if bos is not None:
            win[0] = bos
        out.append(Window(win, targets, first))
    return out


def scored_count(n_tokens: int, ctx: int) -> int:
    return (n_tokens // ctx) * (ctx - 1 - ctx // 2)


def window_nll(logits: np.ndarray, window: Window) -> np.ndarray:
    """Negative log-likelihood (float64) of each scored target; logits is [ctx, vocab]."""
    rows = np.asarray(logits, dtype=np.float64)[window.first:len(window.tokens) - 1]
    top = rows.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    return log_z - rows[np.arange(len(window.targets)), window.targets]


def perplexity(tokens: Sequence[int], ctx: int, logits_of: Callable[[list[int]], np.ndarray],
               bos: int | None = None) -> tuple[float, int]:
    """(perplexity, number of scored tokens); logits_of(window tokens) returns [ctx, vocab] logits."""
    nll = [window_nll(logits_of(w.tokens), w) for w in windows(tokens, ctx, bos)]
    if not nll:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of {ctx}")
    all_nll = np.concatenate(nll)
    return math.exp(float(all_nll.mean())), int(all_nll.size)
