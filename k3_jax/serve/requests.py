"""Requests and their sampling parameters (with their validation), and the errors a request
can meet: refused (RequestError), queue full (QueueFull), engine stopped (EngineFatal). How
a prompt's prefill is cut into calls is prefill_chunks.py."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import threading
import time
from typing import Callable

import numpy as np

from k3_jax.config import UserError
from k3_jax.serve import limits


class RequestError(UserError):
  """A request the engine refuses (the server answers 400)."""


class QueueFull(RuntimeError):
  """The waiting queue is at its bound (the server answers 429)."""


class EngineFatal(RuntimeError):
  """A fault of the device step or of the engine's shared state (page pool, prefix cache):
  the engine stops (Engine.fatal) and every request fails; the server answers 503."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  max_tokens: int = limits.DEFAULT_MAX_TOKENS
  temperature: float = 0.0            # 0: greedy
  top_p: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  seed: int | None = None             # None: a fresh random seed
  stop: tuple[str, ...] = ()          # stop strings (not included in the text)
  stop_ids: tuple[int, ...] = ()      # stop token ids (counted, not included in the text)
  logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)
  logprobs: int | None = None         # None, or 0-TOP_LOGPROBS: the sampled token's logprob and
                                      # that many most likely alternatives, per token

  def validate(self, openai_ranges: bool = True, vocab_size: int | None = None) -> None:
    """RequestError naming the bad field. openai_ranges: penalties within [-2, 2] and
    logit_bias within [-100, 100] (the API's contract); else any finite value. vocab_size:
    the model's, which logit_bias ids must lie below."""
    self._validate(openai_ranges)
    if self.logprobs is not None and not (isinstance(self.logprobs, int)
                                          and 0 <= self.logprobs <= limits.TOP_LOGPROBS):
      raise RequestError(f"logprobs={self.logprobs!r} must be an integer in "
                         f"[0, {limits.TOP_LOGPROBS}]")
    for tid, v in self.logit_bias:
      if not isinstance(tid, (int, np.integer)) or tid < 0 or (
          vocab_size is not None and tid >= vocab_size):
        raise RequestError(f"logit_bias token id {tid!r} is not in the vocabulary "
                           f"[0, {vocab_size})")
      lo, hi = limits.LOGIT_BIAS
      if not (lo <= v <= hi if openai_ranges else math.isfinite(v)):
        raise RequestError(f"logit_bias[{tid}]={v} must lie in [{lo:g}, {hi:g}]"
                           if openai_ranges else f"logit_bias[{tid}]={v} must be finite")

  def _validate(self, openai_ranges: bool) -> None:
    if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
      raise RequestError(f"max_tokens={self.max_tokens!r} must be a positive integer")
    if not self.temperature >= 0:
      raise RequestError(f"temperature={self.temperature} must be >= 0")
    lo, hi = limits.TOP_P
    if not lo < self.top_p <= hi:
      raise RequestError(f"top_p={self.top_p} must lie in ({lo:g}, {hi:g}]")
    lo, hi = limits.PENALTY
    for name in ("presence_penalty", "frequency_penalty"):
      v = getattr(self, name)
      if not (lo <= v <= hi if openai_ranges else math.isfinite(v)):
        raise RequestError(f"{name}={v} must lie in [{lo:g}, {hi:g}]" if openai_ranges else
                           f"{name}={v} must be finite")
    if any(not isinstance(s, str) or not s for s in self.stop):
      raise RequestError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
  prompt: np.ndarray                                  # [T] int32
  params: SamplingParams
  on_update: Callable[["Request", str], None] | None = None   # (request, new text) per step
  stream: bool = True                # False: on_update only once, with all the text, at the
                                     # end (a non-streaming response: no per-token wake-ups)
  record_logits: bool = False                         # keep each sampled position's logits
  use_prefix_cache: bool = True                       # False: always a cold prefill
  images: dict | None = None         # packed images (data/images.pack_images) whose features
                                     # take the prompt's placeholders, in order
  timeout: float | None = None       # seconds from arrival; then the engine fails it
  fork_of: "Request | None" = None   # another sample of that request's prompt: it starts
                                     # from that request's prefill (state and pages copied)
  constraint: object = None          # a grammar (grammar.py): allowed() -> bool [V] before
                                     # each token, advance(id) after, is_done() -> finished
  id: int = dataclasses.field(default_factory=lambda: next(_ids))
  # ----- engine-owned state ---------------------------------------------------------
  state: str = "waiting"             # waiting | prefill | decode | done
  slot: int = -1
  feed: np.ndarray | None = None     # the tokens its prefill runs: the prompt, or after a
                                     # preemption the prompt and all but the last generated
  admitted: int = -1                 # admission order (the newest is preempted first)
  hashes: list = dataclasses.field(default_factory=list)
  pos: int = 0                       # tokens in the cache
  registered: int = 0                # blocks of this prompt handed to the prefix cache
  cached_tokens: int = 0             # prompt tokens served from the prefix cache
  last_token: int = -1
  output_ids: list = dataclasses.field(default_factory=list)
  text: str = ""
  sent: int = 0                      # chars of text already passed to on_update
  decoder: object = None
  features: object = None            # [M, D] f32 projected image features (during prefill)
  finish_reason: str | None = None   # stop | length | cancelled | error
  error: str | None = None           # why the request failed (finish_reason "error")
  error_type: str | None = None      # request_error | timeout | engine_error
  cancelled: bool = False
  seed: int = 0
  logits: list = dataclasses.field(default_factory=list)
  forks: list = dataclasses.field(default_factory=list)   # samples waiting for this prefill
  token_logprobs: list = dataclasses.field(default_factory=list)  # (params.logprobs set)
  top_logprobs: list = dataclasses.field(default_factory=list)    # [[(id, logprob)], ...]
  arrival: float = dataclasses.field(default_factory=time.monotonic)
  first_token_at: float | None = None
  done_event: threading.Event = dataclasses.field(default_factory=threading.Event)

  def __post_init__(self):
    self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(31)

  def cancel(self) -> None:
    """Thread-safe: the engine frees the slot at its next step."""
    self.cancelled = True


__all__ = ["SamplingParams", "Request", "RequestError", "QueueFull", "EngineFatal"]
