"""Drafters: where a speculative step's guesses come from (speculate.py verifies them).

A drafter proposes up to k tokens to follow a request's tokens so far; the verify step keeps
the longest prefix the model agrees with (acceptance.py), so a drafter changes only the speed,
never the output's distribution. Deterministic drafters (a point-mass draft) are what the
acceptance rule assumes.

    NgramDrafter   prompt lookup: the latest earlier occurrence of the request's last n
                   tokens (n from max_n down to min_n) in its own prompt and output, and the
                   tokens that followed it there (a repeating run: its period, repeated).
                   No model; wins when the output restates its context (code edits,
                   quoting, extraction) or repeats itself.
    ModelDrafter   (draft_model.py) a smaller model's greedy continuation; it keeps a state
                   per slot, so it drafts every request of a step at once (`propose_batch`
                   of (slot, tokens, k) items) instead of `propose`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Drafter(Protocol):
  def propose(self, tokens: np.ndarray, k: int) -> list[int]:
    """Up to k tokens (possibly none) to follow `tokens` [n] int32 (prompt + output)."""


class BatchDrafter(Protocol):
  def propose_batch(self, items: list[tuple[int, np.ndarray, int]]) -> list[list[int]]:
    """(slot, tokens [n] int32, k) per drafting request -> up to k tokens each."""


class NgramDrafter:
  """Prompt lookup over the request's own tokens (see the module docstring)."""

  def __init__(self, max_n: int = 3, min_n: int = 1):
    if not 1 <= min_n <= max_n:
      raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    self.max_n, self.min_n = max_n, min_n

  def propose(self, tokens: np.ndarray, k: int) -> list[int]:
    tokens = np.asarray(tokens)
    size = tokens.size
    for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
      pattern = tokens[size - n:]
      # starts i < size - n of an earlier copy of the last n tokens
      windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
      hits = np.flatnonzero((windows == pattern).all(axis=1))
      if hits.size:
        # what followed the latest copy; where that runs into the end (a repeating run:
        # the copy overlaps the tokens matched), it goes on with its own drafts, i.e. the
        # run's period repeated
        start, seq = int(hits[-1]) + n, tokens.tolist()
        for i in range(k):
          seq.append(seq[start + i])
        return seq[size:]
    return []


def make_drafter(kind: str) -> Drafter:
  """The drafter of a model-free kind (a draft model: draft_model.load)."""
  if kind == "ngram":
    return NgramDrafter()
  raise ValueError(f"unknown drafter {kind!r} (known: 'ngram'; 'draft' is draft_model.load)")


__all__ = ["Drafter", "BatchDrafter", "NgramDrafter", "make_drafter"]
