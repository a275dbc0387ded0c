"""The batched serving engine: continuous batching over a fixed number of slots.

A short loop over parts with a module each (docs/design.md, Serving: the seams):
kv_manager.KVManager (pages, prefix-cache entries, KDA checkpoints, page tables), planner
(pure decisions of a step), runner.Runner (the device: cache, jitted steps, overlap,
relay), output (a sampled token on the host: detokenise, stops, grammar, streaming),
roster.Roster (the requests by state, and every move between states) and forks (the
samples of one prefill started from it).

Per engine step (`Engine.step`): timed-out or cancelled requests leave; waiting requests
join free slots (a prefix-cache hit and pages from the KV manager, the slot's KDA state
zeroed or loaded from a checkpoint); prefill pieces run, oldest request first, up to
`prefill_chunk` prompt tokens (planner.prefill); a finished prompt samples its first token
and starts its forks (n samples of one prefill); then ONE jit-compiled decode step runs
over the decoding slots (padded to a power of two; all slots with `batch_invariant`).
Hooks: `_take` is where the tokens a step accepted for request r arrive; `Roster.finish`
is where request r ends (slot and pages freed).

Faults (docs/faults.md, Serving): an exception in ONE request's work (admission hashing,
a prefill piece's host work, its output stage, its callback) fails it alone (`Roster.fail`)
and the engine serves on; a fault of the runner (a device step over the shared cache) or of
the shared bookkeeping is fatal: `Engine.fatal` holds it, every request fails, and
`submit` refuses new ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from k3_jax.config import ModelConfig, ServeConfig
from k3_jax.serve import forks, generate, intake, kv_manager, output, planner, speculate
from k3_jax.serve import kv_pages as kv
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve import cache_tiers, turn_cache      # cache tiers
from k3_jax.serve.roster import Roster
from k3_jax.serve.runner import Runner, shared
from k3_jax.serve.prefill_chunks import checkpoint_boundaries
from k3_jax.serve.requests import EngineFatal, QueueFull, Request, RequestError, SamplingParams

log = logging.getLogger("k3_jax.serve")


class Engine:
  def __init__(self, cfg: ModelConfig, graphdef, params, rest, serve: ServeConfig | None = None,
               *, tokenizer=None, mesh=None, relay=None, kernels=None, **settings):
    """serve: the engine's settings (k3_jax/config.py ServeConfig, whose defaults are the
    server's), with `settings` (ServeConfig fields, e.g. max_batch=2) replacing some.
    max_len: tokens per sequence (prompt + generated), default the model's max_seq_len.
    prefill_chunk: tokens per prefill chunk, a multiple of 512. prefix_cache_bytes: the
    prefix cache's budget for cached MLA pages + KDA checkpoints (0 disables it).
    prefix_match_tokens: the grid (tokens, a power of two dividing 512) that hits end on; a
    hit inside a page continues in a copy of that page (steps.copy_page). mesh: the steps
    run under its parallel setup with params placed by their logical axes, the paged cache
    split on its page axis (kv_pages.paged_cache_shardings); None: one device. kernels: the
    job's (execution.Kernels). relay: a multi-host job's step relay (relay.py): every process
    builds the same engine over the global mesh and the leader's steps are replayed."""
    serve = self.serve = dataclasses.replace(serve or ServeConfig(), **settings)
    self.cfg, self.tokenizer, self.mesh, self.relay = cfg, tokenizer, mesh, relay
    self.max_batch, self.prefill_chunk = serve.max_batch, serve.prefill_chunk
    self.prefill_rows = 1 if serve.batch_invariant else serve.max_batch  # prompts a call
    self.overlap = serve.overlap
    self._pending = None     # a dispatched decode step whose tokens are unread (overlap)
    self.match_tokens = serve.prefix_match_tokens   # prefix-cache hits end on this grid
    self.max_len = serve.max_len or cfg.max_seq_len
    if self.max_len > cfg.max_seq_len:
      raise ValueError(f"max_len={self.max_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
    self.pages_per_slot = math.ceil(self.max_len / PAGE)
    run = self.runner = Runner(cfg, graphdef, params, rest, serve.max_batch, mesh, relay, kernels)
    self.graphdef, self.params, self.rest = run.graphdef, run.params, run.rest   # (as placed)
    self.page_bytes, self.ckpt_bytes = self.runner.page_bytes, self.runner.ckpt_bytes
    self.num_pages, self.pool_summary, prefix = self.runner.size_memory(
        serve, self.pages_per_slot, self.max_len)
    self.kv = kv_manager.KVManager(self.num_pages, kv.page_shards(mesh), self.max_batch,
                                   self.pages_per_slot, prefix)
    if relay is not None:
      relay.factories["score"] = self.scorer
    self.speculator = speculate.for_engine(self)   # speculation
    self.tiers = cache_tiers.attach(self)      # cache tiers: host / disk behind the prefix cache
    self.turns = turn_cache.attach(self)       # cache tiers: decoded tokens join the cache
    self.roster = Roster(self.max_batch, serve.max_queue, self.kv)
    if self.turns is not None:                 # cache tiers: the conversation so far
      self.roster.on_done = self.turns.on_finish
    self.step_no = self.generated_tokens = 0

  # the roster's own objects (never copies: a test that reorders the free slots reorders its)
  lock, waiting, running = (property(lambda self, k=k: getattr(self.roster, k))
                            for k in ("lock", "waiting", "running"))
  free_slots = property(lambda self: self.roster.free_slots,
                        lambda self, v: setattr(self.roster, "free_slots", v))
  fatal = property(lambda self: self.roster.fatal)   # set when a fault stopped the engine
  finished_requests = property(lambda self: self.roster.finished_requests)
  failed_requests = property(lambda self: self.roster.failed_requests)
  max_queue = property(lambda self: self.roster.max_queue,       # waiting requests at most
                       lambda self, n: setattr(self.roster, "max_queue", n))

  cache = property(lambda self: self.runner.cache,       # the device state (the runner's)
                   lambda self, v: setattr(self.runner, "cache", v))
  ckpts = property(lambda self: self.runner.ckpts,
                   lambda self, v: setattr(self.runner, "ckpts", v))
  pool = property(lambda self: self.kv.pool)            # (read-only views of the KV manager)
  prefix = property(lambda self: self.kv.prefix)
  tables = property(lambda self: self.kv.tables)

  def scorer(self):
    """The teacher-forced scorer (logprobs.Scorer) over this engine's weights."""
    return self.runner.scorer(self.max_len)

  # ----- submission ---------------------------------------------------------------------
  validate = intake.check_request   # (prompt_ids, params, openai_ranges, images) -> prompt

  def submit(self, prompt_ids, params: SamplingParams = SamplingParams(),
             openai_ranges: bool = True, images: dict | None = None, **kw) -> Request:
    """Queues a request (thread-safe). Raises RequestError for bad input, QueueFull when
    max_queue requests are already waiting. openai_ranges=False lifts the OpenAI bounds on
    the penalties (any finite value). images: packed images (data/images.pack_images) whose
    features replace the prompt's placeholders in order (their counts must match)."""
    prompt = self.validate(prompt_ids, params, openai_ranges, images)
    kw.setdefault("timeout", self.serve.request_timeout or None)
    req = Request(prompt, params, images=images, **kw)
    if self.tiers is not None and images is None and req.use_prefix_cache:   # cache tiers
      self.tiers.prefetch(prompt)              # disk blocks read while it waits
    self.roster.enqueue(req)
    return req

  # ----- the step -----------------------------------------------------------------------
  def has_work(self) -> bool:
    return bool(self.waiting) or self.busy()

  def busy(self) -> bool:
    """A request decoding, or a step whose tokens are unread."""
    return bool(self.running or self._pending is not None)

  def resource_counts(self) -> dict:
    """Slots, pages and prefix-cache pins in use (for /metrics and tests). With nothing
    running: free_slots == max_batch, used_pages == cached_pages, the pins 0."""
    with self.lock:
      return {"free_slots": len(self.free_slots), "running": len(self.running),
              "waiting": len(self.waiting), **self.kv.counts()}

  def step(self) -> bool:
    """One engine step; False when there was nothing to do. A fatal fault (EngineFatal or
    anything escaping the per-request containment) sets `fatal`, fails every request and
    is raised."""
    if self.fatal is not None:
      raise EngineFatal(f"the engine has stopped: {self.fatal}")
    try:
      return self._step()
    except Exception as e:
      self.roster.die(e)
      self._pending = None
      raise

  def _step(self) -> bool:
    with self.lock:
      self.step_no += 1
      self.roster.sweep()
      self._admit()
      pre = [r for r in self.running if r.state == "prefill"]
    self._prefill_all(pre)
    with self.lock:        # (the samples forked off a finished prefill decode too)
      dec = [r for r in self.running if r.state == "decode"]
    unread = self._pending is not None
    if dec or unread:
      self._decode_all(dec)
    return bool(pre) or bool(dec) or unread

  def run_until_done(self, requests=None, max_steps: int = 1_000_000) -> None:
    """Steps until the given requests (default: all) are done."""
    for _ in range(max_steps):
      if requests is None and not self.has_work():
        return
      if requests is not None and all(r.state == "done" for r in requests):
        return
      self.step()
    raise RuntimeError(f"requests not done after {max_steps} engine steps")

  # ----- faults -------------------------------------------------------------------------
  def _own(self, r: Request, fn, *args) -> bool:
    """fn(*args) as request r's own work: an exception fails r alone (EngineFatal, a fault
    of the shared state, passes). -> whether it ran through."""
    try:
      fn(*args)
      return True
    except EngineFatal:
      raise
    except Exception as e:
      self.roster.fail(r, e)
      return False

  # ----- admission, preemption (the samples of one prefill: forks.py) -----------------
  def _admit(self) -> None:
    """Seats waiting requests, oldest first, while a slot is free and the pool holds the
    pages of their tokens and the first generated position (KVManager.acquire); the first
    that does not fit waits (and everything behind it). A preempted request resumes here
    (planner.feed: its tokens are prefilled again)."""
    while self.waiting and self.free_slots:
      r = self.waiting[0]
      feed = planner.feed(r)
      if not self._own(r, intake.prepare, r, feed, self.tokenizer, self.prefix, self.match_tokens,
                       self.cfg):
        continue
      slot = self.free_slots[-1]
      with shared("the page pool / prefix cache bookkeeping"):
        got = self.kv.acquire(slot, r.hashes, feed.size, feed.size + 1, self.step_no,
                              r.use_prefix_cache)
        if got is None:                      # wait for memory
          return
        self.waiting.popleft()
        self.free_slots.pop()
      self.runner.seat(slot)
      if got.ckpt is not None:
        self.runner.load_ckpt(slot, got.ckpt)
      if got.copy_src is not None:   # the hit ends inside a page: continue in a copy of it
        self.runner.copy_page(got.copy_src, got.pages[got.hit_tokens // PAGE])
      with shared("the page pool bookkeeping"):
        self.kv.settle(got)
      r.feed, r.pos = feed, got.hit_tokens
      if not r.output_ids:
        r.cached_tokens = got.hit_tokens
      r.registered = got.hit_tokens // self.match_tokens
      self.roster.seat(r, slot, "prefill")

  def _grow(self, reqs: list[Request], upto) -> list[Request]:
    """Gives each of `reqs` (decoding, oldest first) the pages for positions < upto(r),
    preempting the most recently admitted running requests while the pool has none left
    (possibly the one growing) -> the requests that may run this step."""
    out = []
    with self.lock:
      for r in reqs:
        while r.state == "decode" and not self.kv.grow(r.slot, upto(r)):
          self.roster.preempt(planner.victim(self.running))
        if r.state == "decode":
          out.append(r)
    return [r for r in out if r.state == "decode"]

  # ----- prefill --------------------------------------------------------------------------
  def _prefill_all(self, pre: list[Request]) -> None:
    """This step's prefill (planner.prefill, then planner.calls round by round: one call
    per prompt when batch_invariant), before the step's decode, so a long prompt never
    stalls the running decodes."""
    plans = planner.prefill(pre, self.prefill_chunk, self.match_tokens)
    for k in range(planner.rounds(plans)):
      for size, reqs in planner.calls(plans, k, self.prefill_rows,
                                      lambda r: r.state == "prefill"):
        self._prefill_call(reqs, size)

  def _prefill_call(self, reqs: list[Request], size: int) -> None:
    """One prefill call over the next `size` prompt tokens of each of `reqs`; then each
    request's blocks go to the prefix cache, and a finished prompt samples its first token.
    A fault of one request's host work fails it alone."""
    live = []
    for r in reqs:
      self._own(r, lambda: live.append((r, self.runner.piece_features(r, size))))
    if not live:
      return
    logits = self.runner.prefill(live, size, self.tables, self.pages_per_slot)
    for row, (r, _) in enumerate(live):
      r.pos += size
      if self.prefix is not None:
        with self.lock, shared("the prefix cache bookkeeping"):
          self._register(r)
      if r.pos == r.feed.size:
        self._own(r, self._resumed if r.output_ids else self._prompt_done, r, logits, row)

  def _register(self, r: Request) -> None:
    """Hands the finished blocks of the tokens r prefilled to the prefix cache, and keeps
    the KDA state of this position as a checkpoint when it is one the prefill keeps."""
    keep = r.pos if r.pos % self.match_tokens == 0 and r.pos in checkpoint_boundaries(
        r.feed.size, self.match_tokens) else None
    r.registered, c = self.kv.register(r.slot, r.hashes, r.registered, min(r.pos, r.feed.size),
                                       self.step_no, keep)
    if c is not None:
      self.runner.save_ckpt(r.slot, c)

  def _resumed(self, r: Request, logits, row: int) -> None:
    """A preempted request's tokens are in the cache again: it decodes on from its last
    token (already emitted), with its penalty counts as they were."""
    r.features = None
    self.runner.set_counts(r.slot, r.output_ids)
    r.state = "decode"

  def _prompt_done(self, r: Request, logits, row: int) -> None:
    """r's prompt is in the cache: its first token, from row `row` of the prefill's last
    logits (and its forks', from the same row)."""
    r.features = None
    got = self.runner.first_token(logits, row, r, output.biases([r], self.cfg.vocab_size))
    r.state = "decode"
    forks.start(self, r, logits, row)   # before r's own token, which may already finish it
    self._take(r, got, 0)

  # ----- decode ---------------------------------------------------------------------------
  def _decode_all(self, dec: list[Request]) -> None:
    """One decode step over all slots for the decoding requests `dec`.

    With `overlap` (ServeConfig) the step is dispatched before the previous step's tokens
    are read (one step ahead, planner.decode_rows): a slot whose last token is still unread
    takes it from the device, and the previous step's tokens are read and emitted while this
    step runs. When the unread token ends its request (a stop id or string), its ahead row
    is wasted: that row wrote past the request's tokens in its own pages, and is dropped."""
    if self.speculator is not None:   # speculation: a verify step when some request has drafts
      dec = self.speculator.decode(self, dec)
      if dec is None:
        return
    pend, self._pending = self._pending, None
    if planner.read_first(pend is not None, self.overlap, dec):
      self._read_decode(pend)
      pend = None
      dec = [r for r in dec if r.state == "decode"]
    now, ahead = planner.decode_rows(dec, {id(r) for r, *_ in pend[1]} if pend else set())
    biases = {}
    # the pages of the positions this step writes (preempting when the pool has run out)
    now = self._grow(now, lambda r: r.pos + 1 + (id(r) in ahead))
    now = [r for r in now        # a request's own fault (e.g. its constraint) fails it alone
           if self._own(r, lambda: biases.update(output.biases([r], self.cfg.vocab_size)))]
    got = None
    if now:
      rows = planner.decode_slots([r.slot for r in now], self.max_batch,
                                  self.serve.batch_invariant)
      got = self.runner.decode(now, biases, ahead, self.tables, self.pages_per_slot, rows)
      if self.turns is not None:               # cache tiers: KDA states at grid boundaries
        self.turns.after_decode(now, ahead)
    if pend is not None:
      self._read_decode(pend)        # overlapped with the step just dispatched
    if got is not None:
      if self.overlap:
        self._pending = got
      else:
        self._read_decode(got)

  def _read_decode(self, pend) -> None:
    """Reads a dispatched decode step's tokens back and emits them, for the requests of it
    that are still decoding (one that ended meanwhile drops its row)."""
    got, rows = pend
    live = [(r, row) for r, slot, row in rows if r.state == "decode" and r.slot == slot]
    if not live:
      return
    host = output.HostSampled(got, [r for r, _ in live], self.runner.fetch)
    for r, row in live:
      r.pos += 1
      self._own(r, self._take, r, host, row)

  # ----- output ---------------------------------------------------------------------------
  def _take(self, r: Request, got, row: int) -> None:
    """The tokens a step accepted for request r (row `row` of `got`), through the output
    stage: recorded, detokenised, checked; r finishes or streams what it has."""
    host = got if isinstance(got, output.HostSampled) else output.HostSampled(
        got, [r], self.runner.fetch)
    output.record(r, host, row)
    self.generated_tokens += 1
    reason = output.accept(r, int(host.ids[row]), self.tokenizer)
    if reason is not None:
      with self.lock:
        self.roster.finish(r, reason)      # request r is done
    else:
      output.stream(r)

  generate = generate.generate     # a simple front end: one prompt's tokens as they come


__all__ = ["Engine", "SamplingParams", "Request", "RequestError", "QueueFull"]
