"""A reference of the engine's sampling chain in float64 numpy, written from README "Sampling" and from
llama.cpp's penalty rule, sharing no code with run.c.

The chain, for the logits l of one position and the ids fed before it (the prompt's included):
1. penalties (llama.cpp's `llama_sampler_penalties_apply`): every token t seen c > 0 times among the last
   `last_n` ids gets l[t] / repeat (l[t] * repeat when l[t] <= 0), then l[t] -= c * frequency + presence;
2. greedy (temperature 0): the argmax; the reported distribution is softmax(l) at temperature 1, uncut;
3. otherwise p = softmax(l / T) over the whole vocabulary, ordered by falling p (ties: lower id first), and
   cut to a prefix: top-k (the first k; 0 = off), top-p (the shortest prefix whose p, normalized over the whole
   vocabulary, sums to >= top_p), min-p (p >= min_p * the first's p); the kept p renormalized.

`kept()` also says how close the position is to a cut's boundary (a near-tie), where float32 rounding in the
engine may legitimately decide the other way; the tests leave such positions out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chain:
    """One setting of the chain (the engine's flags in brackets)."""
    temperature: float = 0.8      # -t
    top_k: int = 40               # -k
    top_p: float = 0.95           # -p
    min_p: float = 0.0            # --min-p
    repeat: float = 1.0           # --repeat-penalty
    last_n: int = 64              # --repeat-last-n
    presence: float = 0.0         # --presence-penalty
    frequency: float = 0.0        # --frequency-penalty

    def flags(self) -> list[str]:
        return ["-t", repr(self.temperature), "-k", str(self.top_k), "-p", repr(self.top_p), "--min-p", repr(self.min_p),
                "--repeat-penalty", repr(self.repeat), "--repeat-last-n", str(self.last_n),
                "--presence-penalty", repr(self.presence), "--frequency-penalty", repr(self.frequency)]

    def batch_fields(self) -> dict:
        return {"t": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "repeat_penalty": self.repeat, "repeat_last_n": self.last_n, "presence_penalty": self.presence,
                "frequency_penalty": self.frequency}


def penalized(logits: np.ndarray, history: list[int], c: Chain) -> np.ndarray:
    """Step 1 on a copy of one position's logits, in float64."""
    out = logits.astype(np.float64).copy()
    window = history[max(0, len(history) - c.last_n):] if c.last_n > 0 else []
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    for t, n in zip(ids.tolist(), counts.tolist()):
        out[t] = out[t] * c.repeat if out[t] <= 0 else out[t] / c.repeat
        out[t] -= n * c.frequency + c.presence
    return out


@dataclass
class Kept:
    ids: np.ndarray        # the kept tokens, most likely first
    logprobs: np.ndarray   # their log-probabilities in the renormalized distribution
    margin: float          # relative distance of the nearest cut decision from flipping (small: a near-tie)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def kept(logits: np.ndarray, history: list[int], c: Chain) -> Kept:
    """Steps 1-3 for one position: the distribution a token is drawn from."""
    lg = penalized(logits, history, c)
    if c.temperature == 0:
        ls = log_softmax(lg)
        order = np.lexsort((np.arange(ls.size), -ls))
        gap = ls[order[0]] - ls[order[1]]
        return Kept(order, ls[order], float(gap))
    p = np.exp(log_softmax(lg / c.temperature))
    order = np.lexsort((np.arange(p.size), -p))
    ps = p[order]
    margins = [np.inf]
    keep = ps.size if c.top_k <= 0 else min(c.top_k, ps.size)
    if 0 < c.top_k < ps.size:
        margins.append((ps[c.top_k - 1] - ps[c.top_k]) / ps[c.top_k - 1])
    if c.top_p < 1:
        cum = np.cumsum(ps[:keep])
        reach = np.nonzero(cum >= c.top_p)[0]
        if reach.size:
            keep = int(reach[0]) + 1
        # the decision: the last kept sum reaches top_p, the one before does not
        margins.append(float(np.min(np.abs(cum[max(0, keep - 2):keep] - c.top_p))) / c.top_p)
    if c.min_p > 0:
        floor = c.min_p * ps[0]
        above = int(np.count_nonzero(ps[:keep] >= floor))
        keep = min(keep, above)
        near = ps[:min(ps.size, keep + 1)]
        margins.append(float(np.min(np.abs(near - floor))) / floor)
    k = ps[:keep]
    return Kept(order[:keep], np.log(k / k.sum()), float(min(margins)))
