"""The engine's requests by state, and every move between states.

    waiting  (a queue, oldest first) --seat--> running (holding a slot) --finish--> done
        ^                                          |
        +------------- preempt (newest first) -----+

A request forks (n samples of one prompt) wait on their lead (Request.forks) until its
prefill ends, and queue on their own (`release_forks`) if it ends first. `finish` is the
one place a request ends (stop, length, cancelled, error): its slot and pages go back to the
KV manager and its final update is sent. `fail` ends one request with an error; `die` ends
them all (a fatal fault). Every method is called with `lock` held, or takes it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

import numpy as np

from k3_jax.serve import output, planner
from k3_jax.serve.runner import shared
from k3_jax.serve.requests import EngineFatal, QueueFull, Request

log = logging.getLogger("k3_jax.serve")


class Roster:
  def __init__(self, max_batch: int, max_queue: int, kv):
    self.kv, self.max_queue = kv, max_queue
    self.lock = threading.Condition()
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.free_slots = list(range(max_batch - 1, -1, -1))
    self._admissions = itertools.count()    # admission order (the preemption order's key)
    self.finished_requests = 0
    self.failed_requests = 0
    self.fatal: BaseException | None = None    # set when a device/shared-state fault stopped it
    self.on_done = None      # fn(request) before a finished request's slot and pages go
                             # (the cache tiers' decoded-turn cache, turn_cache.py)

  def enqueue(self, req: Request) -> None:
    """Queues req (or attaches it to the lead it forks from); EngineFatal once stopped,
    QueueFull at the bound."""
    with self.lock:
      if self.fatal is not None:
        raise EngineFatal(f"the engine has stopped: {self.fatal}")
      if len(self.waiting) >= self.max_queue:
        raise QueueFull(f"{len(self.waiting)} requests are waiting (the bound is "
                        f"{self.max_queue}); retry later")
      lead = req.fork_of
      if lead is not None and lead.state in ("waiting", "prefill") and not lead.cancelled \
          and np.array_equal(lead.prompt, req.prompt):
        lead.forks.append(req)
      else:
        req.fork_of = None
        self.waiting.append(req)
      self.lock.notify_all()

  def sweep(self) -> None:
    """Requests past their timeout fail; cancelled ones leave."""
    for r in planner.expired(self.running, self.waiting, time.monotonic()):
      self.fail(r, f"the request ran past its timeout of {r.timeout:g} s", "timeout")
    for r in planner.cancelled(self.running):
      self.finish(r, "cancelled")
    for r in planner.cancelled(self.waiting):
      self.waiting.remove(r)
      self.drop_cancelled(r)

  def drop_cancelled(self, r: Request) -> None:
    """r, cancelled before it held a slot (queued, or a fork not yet started), ends."""
    r.finish_reason, r.state = "cancelled", "done"
    self.release_forks(r)
    r.done_event.set()

  def seat(self, r: Request, slot: int, state: str) -> None:
    """r runs in `slot` (taken off the free list by the caller) from now on."""
    r.slot, r.admitted, r.state = slot, next(self._admissions), state
    self.running.append(r)

  def preempt(self, r: Request) -> None:
    """Takes running request r off its slot and pages (the pool has run out) and queues it
    first: it resumes exactly where it was (its tokens are prefilled again)."""
    with shared("the page pool bookkeeping"):
      self.running.remove(r)
      self.kv.preempt(r.slot)
      self.free_slots.append(r.slot)
    log.info("request %s preempted at %d tokens (%d generated): the KV cache is full",
             r.id, r.pos, len(r.output_ids))
    r.slot, r.pos, r.state, r.features = -1, 0, "waiting", None
    if r.forks:
      self.release_forks(r)
    self.waiting.appendleft(r)

  def release_forks(self, r: Request) -> None:
    """The samples waiting on r (which ends before its prefill did) queue on their own."""
    for f in reversed(r.forks):
      f.fork_of = None
      self.waiting.appendleft(f)
    r.forks = []

  def finish(self, r: Request, reason: str) -> None:
    """Request r is done: its slot and pages freed at once (cached blocks stay with the
    prefix cache), its forks queued on their own, its final update sent."""
    if r in self.running:
      with shared("the page pool bookkeeping"):
        self.running.remove(r)
        if self.on_done is not None and reason in ("stop", "length"):
          self.on_done(r)
        self.kv.release(r.slot)
        self.free_slots.append(r.slot)
    r.features = r.images = r.feed = None
    r.finish_reason, r.state = reason, "done"
    if r.forks:
      self.release_forks(r)
    if reason == "error":
      self.notify(r)
    else:
      self.finished_requests += 1
    if reason not in ("cancelled", "error"):
      try:
        output.push(r)
      except Exception as e:           # the request is done; its callback's fault is its own
        r.error, r.error_type, r.finish_reason = f"{type(e).__name__}: {e}", "request_error", \
            "error"
        log.warning("request %s: the final update failed: %s", r.id, r.error)
    ttft = "-" if r.first_token_at is None else f"{r.first_token_at - r.arrival:.3f}s"
    log.info("request %s: prompt %d tokens (%d cached), generated %d, ttft %s, status %s%s",
             r.id, r.prompt.size, r.cached_tokens, len(r.output_ids), ttft, r.finish_reason,
             f" ({r.error})" if r.error else "")
    r.done_event.set()

  def fail(self, r: Request, e: BaseException | str, error_type: str = "request_error"
           ) -> None:
    """Fails one request alone: records why, frees its slot, pages and pins, wakes it."""
    msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    if not isinstance(e, str):
      log.warning("request %s failed: %s", r.id, msg)
    with self.lock:
      if r.state == "done":
        return
      r.error, r.error_type = msg, error_type
      if r in self.waiting:
        self.waiting.remove(r)
      self.failed_requests += 1
      self.finish(r, "error")

  def notify(self, r: Request) -> None:
    """The final update of a failed request (its callback's own fault is only logged)."""
    if r.on_update is not None:
      try:
        r.on_update(r, "")
      except Exception:
        log.exception("the update callback of failed request %s raised", r.id)

  def die(self, e: BaseException) -> None:
    """A fatal fault: every request fails, and no new one is taken."""
    log.error("engine stopped by a fatal fault: %s: %s", type(e).__name__, e)
    with self.lock:
      self.fatal = e
      reqs = list(self.running) + list(self.waiting)
      for r in reqs + [f for r in reqs for f in r.forks]:
        r.error, r.error_type = f"engine failure: {type(e).__name__}: {e}", "engine_error"
        r.finish_reason, r.state = "error", "done"
        self.failed_requests += 1
        self.notify(r)
        r.done_event.set()
      self.running.clear()
      self.waiting.clear()
      self.lock.notify_all()


__all__ = ["Roster"]
