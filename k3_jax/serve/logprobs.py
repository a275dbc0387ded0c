"""Log-probabilities for the completions API (`logprobs`, `echo`).

A token's log-probability is the log-softmax of the model's own logits at the position that
predicts it (before temperature, top-p and penalties, which only shape sampling), computed on
the host in float64 from the float32 rows the engine records (`Request.record_logits`). The
prompt's own tokens (`echo`) are scored teacher-forced by `Scorer`: the engine's prefill
program (steps.score_step: the prefill's model call, every position's logits, over a paged
cache of its own) over the whole prompt, padded on the right to a bucket length (the model
is causal, so padding changes no earlier position). The first prompt token has no predicting
position: its log-probability is null, as in OpenAI's API.
"""

from __future__ import annotations

import threading

import jax
import numpy as np


def log_softmax(row) -> np.ndarray:
  x = np.asarray(row, np.float64)
  m = x.max()
  return x - m - np.log(np.exp(x - m).sum())


def entries(tokenizer, rows, ids, k: int) -> tuple[list, list]:
  """(token_logprobs, top_logprobs) of `ids`, each predicted by the matching row of `rows`
  (None rows: no predicting position -> null entries). top_logprobs: the k most likely
  tokens' text -> log-probability (the chosen token is always among them, as OpenAI does);
  a text two of them share (partial UTF-8 bytes) is written "<|token_id:N|>" for the later."""
  lps, tops = [], []
  for row, tok in zip(rows, ids):
    if row is None:
      lps.append(None)
      tops.append(None)
      continue
    lp = log_softmax(row)
    lps.append(float(lp[tok]))
    if k <= 0:
      tops.append(None)
      continue
    best = np.argsort(-lp, kind="stable")[:k]
    if tok not in best:
      best = np.append(best, tok)
    top = {}
    for t in best:
      key = _piece(tokenizer, int(t))
      if key in top:                 # e.g. two partial UTF-8 bytes, both "\ufffd"
        key = f"<|token_id:{int(t)}|>"
      top[key] = float(lp[t])
    tops.append(top)
  return lps, tops


def _piece(tokenizer, tok: int) -> str:
  return tokenizer.decode([tok]) if tokenizer is not None else str(tok)


def assemble(tokenizer, ids, lps, tops, k: int, start: int = 0) -> dict:
  """OpenAI's completions `logprobs` object for `ids`: tokens (each token's text), their
  log-probabilities, the top-k alternatives (null with logprobs=0) and each token's character
  offset in the returned text, counting from `start`."""
  tokens, offsets, pos = [], [], start
  for t in ids:
    piece = _piece(tokenizer, int(t))
    tokens.append(piece)
    offsets.append(pos)
    pos += len(piece)
  return {"tokens": tokens, "token_logprobs": lps,
          "top_logprobs": tops if k > 0 else None, "text_offset": offsets}


def chat_content(tokenizer, ids, lps, tops) -> list[dict]:
  """The chat API's `logprobs.content` entries of generated ids: each token's text, bytes
  and log-probability, and its alternatives (`tops`: per token [(id, logprob)], most likely
  first), as the engine's step computed them (Request.token_logprobs / top_logprobs: the
  log-softmax of the model's own logits, before logit_bias, grammar masks, penalties and
  temperature)."""
  def one(t, lp):
    return {"token": _piece(tokenizer, int(t)), "logprob": float(lp),
            "bytes": list(tokenizer.decode_bytes([int(t)]))}
  return [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]}
          for t, lp, top in zip(ids, lps, tops)]


class Scorer:
  """Teacher-forced logits of a prompt: `logits(ids)` -> [T, V] float32 rows, row i the
  logits after token i (so row i - 1 predicts token i). One compile per bucket length (a
  power of two, at least 64); calls are serialised (one scoring forward at a time)."""

  def __init__(self, graphdef, params, rest, par, max_len: int, relayed=lambda n, f: f,
               fetch=lambda t: t):
    """relayed / fetch: the runner's (Runner.relayed, Runner.fetch), so that a multi-host
    job runs the forward on every process and the leader can read its rows."""
    from k3_jax.serve import steps
    self.max_len = max_len
    self._lock = threading.Lock()
    self._fwd = relayed("score", jax.jit(steps.bind(steps.score_step, graphdef, par)))
    self._fetch = fetch
    self._params, self._rest = params, rest

  def bucket(self, n: int) -> int:
    b = 64
    while b < n:
      b *= 2
    return b

  def logits(self, ids) -> np.ndarray:
    ids = np.asarray(ids, np.int32).reshape(-1)
    padded = np.zeros((self.bucket(ids.size),), np.int32)
    padded[:ids.size] = ids
    with self._lock:
      out = self._fwd(self._params, self._rest, padded)
      return np.asarray(self._fetch(out))[:ids.size]


def scorer_for(engine) -> Scorer:
  """The engine's Scorer (made on first use by its runner, over its weights)."""
  return engine.scorer()


__all__ = ["log_softmax", "entries", "assemble", "chat_content", "Scorer",
           "scorer_for"]
