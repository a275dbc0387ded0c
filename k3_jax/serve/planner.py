"""The planner: what one engine step does, decided from the engine's state alone.

Pure functions of the requests' host state (no device, no page pool): the engine asks them
at each phase of its step and carries the plan out (engine.py), so each decision is
testable on plain objects (tests/serve/test_planner.py).

    expired, cancelled   the requests that leave before anything runs
    feed        the tokens a request's prefill runs when it is (re)admitted
    prefill     this step's prefill pieces: at most the token budget, oldest request first
    rounds      those pieces as model calls: round k runs every request's k-th piece, the
                pieces of one size together, a power-of-two count of prompts a call (at
                most `rows`)
    decode_rows which decoding requests this step runs, and which of them run one step
                ahead of the host (overlap: their last token is still on the device)
    decode_slots  the slots the decode step runs (all, or without batch invariance only
                the decoding ones, padded to a power of two)
    victim      the request to preempt when the page pool runs out: the newest admitted
"""

from __future__ import annotations

import numpy as np

from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.prefill_chunks import prefill_plan
from k3_jax.serve.requests import Request


def expired(running: list[Request], waiting, now: float) -> list[Request]:
  """The requests past their timeout (they fail before anything runs)."""
  return [r for r in list(running) + list(waiting)
          if r.timeout is not None and now - r.arrival > r.timeout and not r.cancelled]


def cancelled(reqs) -> list[Request]:
  return [r for r in reqs if r.cancelled]


def feed(r: Request) -> np.ndarray:
  """The tokens r's prefill runs: its prompt, or after a preemption its prompt and all but
  its last generated token (it continues decoding from that one)."""
  return r.prompt if not r.output_ids else np.concatenate(
      [r.prompt, np.asarray(r.output_ids[:-1], np.int32)])


def pieces(n: int, pos: int, budget: int, match_tokens: int) -> list[int]:
  """The lengths of the prefill calls of a feed of n tokens at position pos this step:
  whole blocks (at most `budget` tokens, rounded down to whole blocks, at least one), or
  the pieces below a block up to its next block boundary or the prompt's end (several
  prefill_plan segments, each ending where a checkpoint may be kept)."""
  start, sizes = pos, []
  chunk = max(PAGE, budget // PAGE * PAGE)
  while pos < n:
    plan = prefill_plan(pos, n, chunk, match_tokens)
    if pos > start and plan[0] >= PAGE:
      break                        # whole blocks start a chunk of their own
    sizes += plan
    pos += sum(plan)
    if plan[0] >= PAGE:
      break
  return sizes


def prefill(pre: list[Request], budget: int,
            match_tokens: int) -> list[tuple[Request, list[int]]]:
  """This step's prefill: (request, its piece lengths) for the prefilling requests `pre`,
  oldest first, while the budget of prompt tokens lasts (a long prompt takes it all; short
  ones share it). Each request's pieces are the ones `pieces` gives it whatever else runs."""
  plans = []
  for r in pre:
    if budget <= 0:
      break
    plans.append((r, pieces(r.feed.size, r.pos, budget, match_tokens)))
    budget -= sum(plans[-1][1])
  return plans


def rounds(plans: list[tuple[Request, list[int]]]) -> int:
  return max((len(p) for _, p in plans), default=0)


def calls(plans: list[tuple[Request, list[int]]], k: int, rows: int, alive=lambda r: True
          ) -> list[tuple[int, list[Request]]]:
  """Round k of `plans` as model calls (size, requests): every request's k-th piece that is
  still `alive`, the pieces of one size together in calls of a power-of-two count of
  prompts, the largest that fits first, at most `rows` (7 prompts: 4, 2, 1). A call is
  padded to a power of two (runner.prefill), so 3 prompts padded to 4 would compute a
  fourth prompt's worth of padding; two calls of 2 and 1 compute none."""
  groups: dict[int, list[Request]] = {}
  for r, sizes in plans:
    if k < len(sizes) and alive(r):
      groups.setdefault(sizes[k], []).append(r)
  out = []
  for size, reqs in groups.items():
    while reqs:
      n = 1 << (min(len(reqs), rows).bit_length() - 1)
      out.append((size, reqs[:n]))
      reqs = reqs[n:]
  return out


def read_first(pending: bool, overlap: bool, dec: list[Request]) -> bool:
  """Whether the unread step must be read before this one is dispatched: always without
  overlap, and when a decoding request has a constraint (its bias row needs its token)."""
  return pending and (not overlap or any(r.constraint is not None for r in dec))


def decode_rows(dec: list[Request], unread: set) -> tuple[list[Request], set]:
  """(the requests of `dec` this decode step runs, the id()s of those that run ahead).

  unread: the id()s of requests whose last token is in the step not yet read. Such a
  request runs ahead (its token taken on the device) when that token cannot end it by
  length and it is not cancelled; otherwise it sits this step out (its token is read
  while the step runs)."""
  ahead = {id(r) for r in dec if id(r) in unread and not r.cancelled
           and len(r.output_ids) + 2 <= r.params.max_tokens}
  return [r for r in dec if id(r) not in unread or id(r) in ahead], ahead


def decode_slots(slots: list[int], max_batch: int, batch_invariant: bool
                 ) -> np.ndarray | None:
  """The slots a decode step over requests at `slots` runs: without batch invariance, those
  slots padded with idle ones to a power of two (so log2(max_batch) + 1 shapes compile);
  None: all of them. (XLA:CPU's matrix products sum in an order that depends on the row
  count, so a step over fewer rows moves the logits in the last bits.)"""
  n = 1 << (len(slots) - 1).bit_length()
  if batch_invariant or n >= max_batch:
    return None
  taken = sorted(slots)
  idle = [s for s in range(max_batch) if s not in set(taken)]
  return np.asarray(taken + idle[:n - len(taken)], np.int32)


def victim(running: list[Request]) -> Request:
  """The request preempted when the pool has no page left: the most recently admitted."""
  return max(running, key=lambda q: (q.admitted, q.id))


__all__ = ["expired", "cancelled", "feed", "pieces", "prefill", "rounds", "calls", "read_first",
           "decode_rows", "decode_slots", "victim"]
