"""The output stage: what becomes of a sampled token on the host.

For one request at a time: the step's row read back (`HostSampled`: ids always, logits and
logprobs only when a request wants them), recorded (logits, logprobs), detokenised, checked
against the stop ids, the stop strings (across token boundaries), the grammar and max_tokens,
and streamed (`push`: the text not yet sent, less a tail that may still become a stop
string). Before a step, `biases` gives the rows the sampler adds to the logits (logit_bias,
and -inf where a request's grammar forbids a token).

Faults: everything here is one request's own work; the engine runs it so that an exception
fails that request alone (Engine._own).
"""

from __future__ import annotations

import time

import numpy as np

from k3_jax.serve import steps
from k3_jax.serve.requests import Request


class HostSampled:
  """A step's Sampled read back to the host: the ids always, the rest only when one of
  `reqs` wants it (logits, logprobs)."""

  def __init__(self, got: steps.Sampled, reqs: list[Request], fetch=lambda t: t):
    want_logits = any(r.record_logits for r in reqs)
    want_lp = any(r.params.logprobs is not None for r in reqs)
    picked = fetch((got.ids, got.logits if want_logits else None,
                    (got.logprob, got.top_ids, got.top_logprobs) if want_lp else None))
    self.ids = np.asarray(picked[0])
    self.logits = np.asarray(picked[1]) if want_logits else None
    if want_lp:
      self.logprob, self.top_ids, self.top_logprobs = (np.asarray(a) for a in picked[2])


def bias_row(r: Request, vocab_size: int) -> np.ndarray:
  """[V] f32: the request's logit_bias, and -inf where its constraint forbids a token."""
  row = np.zeros(vocab_size, np.float32)
  for tid, v in r.params.logit_bias:
    row[tid] += v
  if r.constraint is not None:
    allowed = np.asarray(r.constraint.allowed(), bool)
    if allowed.shape != row.shape or not allowed.any():
      raise RuntimeError(f"the request's constraint allows {int(allowed.sum())} of "
                         f"{allowed.size} tokens over a vocabulary of {row.size}")
    row[~allowed] = -np.inf
  return row


def biases(reqs: list[Request], vocab_size: int) -> dict:
  """request id -> bias row, for the requests with a logit_bias or a constraint."""
  return {r.id: bias_row(r, vocab_size) for r in reqs
          if r.params.logit_bias or r.constraint is not None}


def record(r: Request, host: HostSampled, row: int) -> None:
  """What the step computed for r at `row` besides the id: its logits, its logprobs."""
  if r.record_logits:
    r.logits.append(host.logits[row])
  k = r.params.logprobs
  if k is not None:
    r.token_logprobs.append(float(host.logprob[row]))
    r.top_logprobs.append([(int(i), float(v)) for i, v in
                           zip(host.top_ids[row, :k], host.top_logprobs[row, :k])])


def _hold(r: Request) -> int:
  return max((len(s) for s in r.params.stop), default=0)


def accept(r: Request, tid: int, tokenizer) -> str | None:
  """Appends token `tid` to r: its text (detokenised), then the checks in order (stop id,
  stop strings, grammar, max_tokens) -> the finish reason, or None while r goes on."""
  if r.first_token_at is None:
    r.first_token_at = time.monotonic()
  r.output_ids.append(tid)
  r.last_token = tid
  finish, flush = None, True
  if tid in r.params.stop_ids:
    finish, flush = "stop", False
  elif r.decoder is not None:
    start = max(0, len(r.text) - _hold(r))
    # an id past the tokenizer's vocabulary (a model vocab larger than the tokenizer's)
    # reads as U+FFFD, not as an exception
    vocab = getattr(tokenizer, "vocab_size", None)
    r.text += "\ufffd" if vocab is not None and not 0 <= tid < vocab else r.decoder.add(tid)
    for s in r.params.stop:
      i = r.text.find(s, start)
      if i >= 0:
        r.text, finish, flush = r.text[:i], "stop", False
        break
  if r.constraint is not None:          # the grammar sees every sampled token
    r.constraint.advance(tid)
    if finish is None and r.constraint.is_done():
      finish = "stop"
  if finish is None and len(r.output_ids) >= r.params.max_tokens:
    finish = "length"
  if finish is not None and r.decoder is not None and flush:
    r.text += r.decoder.flush()
  return finish


def push(r: Request, hold: int = 0) -> None:
  """Passes r's text not yet sent, less its last `hold` characters, to its callback."""
  if r.on_update is None:
    return
  upto = max(r.sent, len(r.text) - hold)
  delta, r.sent = r.text[r.sent:upto], upto
  r.on_update(r, delta)


def stream(r: Request) -> None:
  """The update of a streaming request that goes on: its text but what a stop string may
  still claim."""
  if r.on_update is not None and r.stream:
    push(r, hold=max(_hold(r), 1) - 1)


__all__ = ["HostSampled", "bias_row", "biases", "record", "accept", "push", "stream"]
