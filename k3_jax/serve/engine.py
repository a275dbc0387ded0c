"""The batched serving engine: continuous batching over a fixed number of slots.

Per engine step (`Engine.step`): finished or cancelled requests leave; waiting requests join
free slots (prefix-cache lookup, pages pinned and allocated, the slot's KDA state zeroed or
loaded from a checkpoint); prefill chunks run for the prefilling requests, oldest first, up
to `prefill_chunk` prompt tokens per step (whole 512-token blocks, then the tail in pieces of
4^k tokens; scheduler.prefill_plan); then ONE jit-compiled
decode step runs over all `max_batch` slots with fixed shapes (idle slots are masked: their
KDA state is kept, their MLA writes go to the null page).

Device state (kv_pages.py): the paged cache of K3Model.init_paged_cache, the read-only KDA
checkpoint slots of the prefix cache, and per-slot generated-token counts (penalties).

Images (a model with a vision tower): a request may carry packed images whose features take
the prompt's placeholder tokens. The tower runs once per request, when its first prefill
piece holding a placeholder comes up (a prefix-cache hit past the images skips it); each
prefill piece then takes the features of its own placeholders, in order. The prefix cache
keys the blocks holding placeholders on the images' content (prefix_cache.image_salts), so
two images of one size never share KV or KDA state.

Faults (docs/faults.md, Serving): an exception while handling ONE request (its admission's
hashing, a prefill piece's host work, decoding/emitting its token, its stop-string check, its
update callback) fails that request alone (`_fail`: error/error_type set, finish_reason
"error", slot, pages and pins freed) and the engine keeps serving the others. A fault of the
device step (any jitted call: it runs over the shared cache) or of the shared bookkeeping
(page pool, prefix cache) is fatal: `Engine.fatal` holds it, every request fails, and
`submit` refuses new ones.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import threading
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3_jax.cache import PagedMLACache
from k3_jax.config import ModelConfig, ServeConfig, UserError
from k3_jax.data import images as im
from k3_jax.model import check_tokens
from k3_jax.partitioning import SINGLE
from k3_jax.serve import kv_pages as kv
from k3_jax.serve import kv_manager
from k3_jax.serve import cache_tiers, turn_cache      # cache tiers
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.prefix_cache import block_hashes, image_salts
from k3_jax.serve import steps
from k3_jax.stack import cache_leaves
from k3_jax.serve.scheduler import (EngineFatal, QueueFull, Request, RequestError,
                                    SamplingParams, checkpoint_boundaries, prefill_plan)

log = logging.getLogger("k3_jax.serve")


def _guard(name: str, fn, seen: set):
  """fn (a jitted step) whose exceptions become EngineFatal (they hit the shared cache), and
  which logs the first call of each new argument shape (a compile) with its duration."""
  def call(*args):
    key = (name,) + tuple(getattr(x, "shape", None) for a in args
                          for x in (jax.tree.leaves(a) if isinstance(a, (steps.DecodeBatch,
                                                                         tuple)) else [a])
                          if hasattr(x, "shape"))
    new = key not in seen
    t0 = time.monotonic()
    if new:
      log.info("compiling %s for shapes %s", name, key[1:])
    try:
      out = fn(*args)
      if new:
        jax.block_until_ready(out)
    except EngineFatal:
      raise
    except Exception as e:
      raise EngineFatal(f"the {name} device step failed: {type(e).__name__}: {e}") from e
    if new:
      seen.add(key)
      log.info("compiled %s in %.2f s", name, time.monotonic() - t0)
    return out
  return call


@contextlib.contextmanager
def _shared(what: str):
  """A context in which any exception is a fault of the engine's shared state."""
  try:
    yield
  except EngineFatal:
    raise
  except Exception as e:
    raise EngineFatal(f"{what} failed: {type(e).__name__}: {e}") from e


class _HostSampled:
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


DECODE_MIN_PAGES = 8      # smallest decode attention window: 8 pages = 4,096 tokens


class Engine:
  def __init__(self, cfg: ModelConfig, graphdef, params, rest, serve: ServeConfig | None = None,
               *, tokenizer=None, mesh=None, relay=None, **settings):
    """serve: the engine's settings (k3_jax/config.py ServeConfig, whose defaults are the
    server's), with `settings` (ServeConfig fields, e.g. max_batch=2) replacing some.
    max_len: tokens per sequence (prompt + generated), default the model's max_seq_len.
    prefill_chunk: tokens per prefill chunk, a multiple of 512. prefix_cache_bytes: the
    prefix cache's budget for cached MLA pages + KDA checkpoints (0 disables it).
    prefix_match_unit: the grid (tokens, a power of two dividing 512) that hits end on; a
    hit inside a page continues in a copy of that page (steps.copy_page). mesh:
    the steps run under its parallel setup (sharding.install.parallel_for) with params
    placed by their logical axes, the paged cache split on its page axis
    (kv_pages.paged_cache_shardings); None: the single-device program. relay: a multi-host
    job's step relay (relay.py): every process builds the same engine over the global mesh
    and the leader's steps are replayed by the others."""
    serve = dataclasses.replace(serve or ServeConfig(), **settings)
    max_batch, max_len, prefix_cache_bytes = (serve.max_batch, serve.max_len,
                                              serve.prefix_cache_bytes)
    self.serve = serve
    self.cfg, self.tokenizer, self.mesh = cfg, tokenizer, mesh
    self.max_batch, self.prefill_chunk, self.max_queue = (max_batch, serve.prefill_chunk,
                                                          serve.max_queue)
    self.prefill_rows = 1 if serve.batch_invariant else max_batch   # prompts per prefill call
    self.overlap = serve.overlap
    self._pending = None     # a dispatched decode step whose tokens are unread (overlap)
    self.unit = serve.prefix_match_unit         # prefix-cache hits end on this grid
    self.max_len = max_len or cfg.max_seq_len
    if self.max_len > cfg.max_seq_len:
      raise ValueError(f"max_len={self.max_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
    self.pages_per_slot = math.ceil(self.max_len / PAGE)
    self.graphdef = graphdef
    if mesh is not None:
      from sharding.rules import tree_shardings   # jobs may use sharding
      params = jax.device_put(params, tree_shardings(params, mesh))
      rest = jax.device_put(rest, tree_shardings(rest, mesh))
    self.params, self.rest = params, rest

    # ----- memory: probe the sizes, then allocate the pools ---------------------------------
    model = nnx.merge(graphdef, params, rest)
    probe = jax.eval_shape(lambda: model.init_paged_cache(1, 1, PAGE))
    self.page_bytes = sum(kv.tree_bytes(e) for e in cache_leaves(probe)
                          if isinstance(e, PagedMLACache))
    self.ckpt_bytes = kv.tree_bytes(kv.kda_states(probe))
    cache_pages = 0
    if prefix_cache_bytes > 0 and self.page_bytes:
      cache_pages = min(prefix_cache_bytes // self.page_bytes, 64 * max_batch * self.pages_per_slot)
    # at most one checkpoint per cached block (PAGE // unit blocks per page)
    num_ckpt = min(prefix_cache_bytes // max(self.ckpt_bytes, 1),
                   max(cache_pages, 0) * (PAGE // self.unit))
    use_prefix = prefix_cache_bytes > 0 and num_ckpt > 0
    shards = kv.page_shards(mesh)
    self.num_pages = self._pool_pages(serve, shards, cache_pages, num_ckpt if use_prefix else 0)
    self.cache = self._zero_cache(model, max_batch)
    self.kv = kv_manager.KVManager(
        self.num_pages, shards, max_batch, self.pages_per_slot,
        dict(num_ckpt_slots=num_ckpt, budget_bytes=prefix_cache_bytes,
             page_bytes=self.page_bytes, ckpt_bytes=self.ckpt_bytes, unit=self.unit)
        if use_prefix else None)
    if use_prefix:
      self.ckpts = kv.zeros_rows(kv.kda_states(self.cache), num_ckpt)
    self.counts = jnp.zeros((max_batch, cfg.vocab_size), jnp.int32)
    self.relay = relay
    self._build_steps()
    if relay is not None:     # the device state every process made alike, in one order
      relay.register((self.params, self.rest, self.cache, self.counts,
                      getattr(self, "ckpts", None), self._no_bias, self._prev))
      from k3_jax.serve import logprobs
      relay.factories["score"] = lambda: logprobs.scorer_for(self)
    self.tiers = cache_tiers.attach(self)      # cache tiers: host / disk behind the prefix cache
    self.turns = turn_cache.attach(self)       # cache tiers: decoded tokens join the cache

    # ----- host state ---------------------------------------------------------------------
    self.lock = threading.Condition()
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.free_slots = list(range(max_batch - 1, -1, -1))
    self.step_no = 0
    self._admissions = itertools.count()    # admission order (the preemption order's key)
    self.generated_tokens = 0
    self.finished_requests = 0
    self.failed_requests = 0
    self.fatal: BaseException | None = None    # set when a device/shared-state fault stopped it

  def _pool_pages(self, serve: ServeConfig, shards: int, cache_pages: int, num_ckpt: int
                  ) -> int:
    """The page pool's size from its byte budget (ServeConfig.kv_cache_bytes, or the
    default kv_manager.auto_budget picks), capped at what max_batch sequences of max_len and
    a full prefix cache could ever hold; logged with the tokens it holds."""
    budget, how = serve.kv_cache_bytes, "--kv_cache_bytes"
    if not budget:
      devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()
      fixed = (self.max_batch + num_ckpt) * self.ckpt_bytes // shards
      budget, how, measured = kv_manager.auto_budget(devices, fixed, shards)
      if measured and jax.process_count() > 1:    # every process must build the same pool
        from jax.experimental import multihost_utils
        budget = int(np.min(multihost_utils.process_allgather(np.int64(budget))))
    # the most pages the engine could ever hold (every slot at max_len, the prefix cache full)
    cap = kv.pool_pages(self.max_batch, self.pages_per_slot, cache_pages, shards)
    try:
      n = kv_manager.pool_size(budget, self.page_bytes, shards, cap)
    except ValueError as e:
      raise UserError(str(e)) from None
    msg = (f"KV cache: {n - 1} pages of {PAGE} tokens = {(n - 1) * PAGE:,} tokens "
           f"({n * self.page_bytes / 2**20:,.1f} MiB over {shards} page shard(s); budget "
           f"{budget / 2**20:,.1f} MiB from {how}{', capped at what max_batch x max_len needs' if n == cap else ''}); "
           f"max_len {self.max_len:,} tokens per sequence")
    log.info(msg)
    self.pool_summary = msg
    return n

  @property
  def pool(self):
    return self.kv.pool

  @property
  def prefix(self):
    return self.kv.prefix

  @property
  def tables(self) -> np.ndarray:
    return self.kv.tables

  def _zero_cache(self, model, max_batch: int):
    """The paged cache, all zeros (init_paged_cache's values), made on its devices: split by
    kv_pages.paged_cache_shardings on a mesh (never gathered on one device first)."""
    abstract = jax.eval_shape(lambda: model.init_paged_cache(max_batch, self.num_pages, PAGE))
    zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    if self.mesh is None:
      return zeros()
    return jax.jit(zeros, out_shardings=kv.paged_cache_shardings(abstract, self.mesh))()

  # ----- compiled steps -----------------------------------------------------------------
  def _parallel(self):
    if self.mesh is None:
      return SINGLE
    from sharding.install import parallel_for
    return parallel_for(self.mesh)

  def _build_steps(self):
    # The jitted steps (steps.py) belong to this engine and close over its parallel setup:
    # another mesh is another engine, with its own compiles.
    self.par = self._parallel()
    seen = self._compiled = set()
    (p_leaves, p_def), (r_leaves, r_def) = (jax.tree.flatten(t) for t in (self.params,
                                                                            self.rest))
    self.weights = (p_leaves, r_leaves)       # what prefill / decode / encode take
    jitted = self.jitted = steps.jit_steps(self.graphdef, self.par, treedefs=(p_def, r_def))
    self._steps = steps.Steps(*(_guard(name, self.relayed(name, fn), seen)
                                for name, fn in zip(steps.Steps._fields, jitted)))
    self._fetch = None
    if self.relay is not None:   # what the leader reads, replicated onto every host
      from jax.sharding import NamedSharding, PartitionSpec
      self._fetch = _guard("fetch", self.relayed("fetch", jax.jit(
          lambda t: t, out_shardings=NamedSharding(self.mesh, PartitionSpec()))), seen)
    self._feature_zeros = {}
    v = self.cfg.vocab_size
    self._no_bias = {}         # rows -> zeros [rows, V] kept on the device (_zero_bias)
    self._prev = jnp.zeros((self.max_batch,), jnp.int32)    # the last decode step's ids

  def relayed(self, name: str, fn):
    """fn (a jitted device step) as this engine runs it: published to the other processes
    first in a multi-host job (relay.py), itself otherwise."""
    return fn if self.relay is None else self.relay.wrap(name, fn)

  def fetch(self, tree):
    """Device arrays the host reads, readable here (replicated in a multi-host job)."""
    return tree if self._fetch is None else self._fetch(tree)

  # ----- submission ---------------------------------------------------------------------
  def validate(self, prompt_ids, params: SamplingParams, openai_ranges: bool = True,
               images: dict | None = None) -> np.ndarray:
    params.validate(openai_ranges, self.cfg.vocab_size)
    if np.size(prompt_ids) == 0:
      raise RequestError("the prompt is empty: give at least one token")
    try:
      prompt = check_tokens(prompt_ids, self.cfg).reshape(-1).astype(np.int32)
    except ValueError as e:
      raise RequestError(str(e)) from None
    self._check_images(prompt, images)
    if prompt.size + params.max_tokens > self.max_len:
      raise RequestError(
          f"prompt ({prompt.size} tokens) + max_tokens ({params.max_tokens}) exceeds the "
          f"context of {self.max_len} tokens")
    if not self.kv.ever_fits(prompt.size + params.max_tokens):
      raise RequestError(
          f"prompt ({prompt.size} tokens) + max_tokens ({params.max_tokens}) needs "
          f"{math.ceil((prompt.size + params.max_tokens) / PAGE)} pages of {PAGE} tokens; the "
          f"KV cache holds {self.num_pages - 1} (raise --kv_cache_bytes or lower max_tokens)")
    if params.stop and self.tokenizer is None:
      raise RequestError("stop strings need a tokenizer; this engine has none")
    return prompt

  def _check_images(self, prompt: np.ndarray, images: dict | None) -> None:
    v = self.cfg.vision
    if images is None:
      if v is not None and np.any(prompt == v.image_token_id):
        raise RequestError(f"the prompt holds image placeholder tokens (id {v.image_token_id}) "
                           "but no images: send images as image content parts")
      return
    if v is None:
      raise RequestError(f"model {self.cfg.name!r} has no vision tower: it cannot take images")
    try:
      im.check_placeholders(prompt, int(images["merge_idx"].shape[0]), v)
    except ValueError as e:
      raise RequestError(str(e)) from None

  def submit(self, prompt_ids, params: SamplingParams = SamplingParams(),
             openai_ranges: bool = True, images: dict | None = None, **kw) -> Request:
    """Queues a request (thread-safe). Raises RequestError for bad input, QueueFull when
    max_queue requests are already waiting. openai_ranges=False lifts the OpenAI bounds on
    the penalties (any finite value). images: packed images (data/images.pack_images) whose
    features replace the prompt's placeholders in order (their counts must match)."""
    prompt = self.validate(prompt_ids, params, openai_ranges, images)
    kw.setdefault("timeout", self.serve.request_timeout or None)
    req = Request(prompt, params, images=images, **kw)
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
    return req

  # ----- the step -----------------------------------------------------------------------
  def has_work(self) -> bool:
    return bool(self.waiting or self.running or self._pending is not None)

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
      self._die(e)
      raise

  def _die(self, e: BaseException) -> None:
    log.error("engine stopped by a fatal fault: %s: %s", type(e).__name__, e)
    with self.lock:
      self.fatal = e
      reqs = list(self.running) + list(self.waiting)
      for r in reqs + [f for r in reqs for f in r.forks]:
        r.error, r.error_type = f"engine failure: {type(e).__name__}: {e}", "engine_error"
        r.finish_reason, r.state = "error", "done"
        self.failed_requests += 1
        self._notify(r)
        r.done_event.set()
      self.running.clear()
      self.waiting.clear()
      self._pending = None
      self.lock.notify_all()

  def _notify(self, r: Request) -> None:
    """The final update of a failed request (its callback's own fault is only logged)."""
    if r.on_update is not None:
      try:
        r.on_update(r, "")
      except Exception:
        log.exception("the update callback of failed request %s raised", r.id)

  def _own(self, r: Request, fn, *args) -> bool:
    """fn(*args) as request r's own work: an exception fails r alone (EngineFatal, a fault
    of the shared state, passes). -> whether it ran through."""
    try:
      fn(*args)
      return True
    except EngineFatal:
      raise
    except Exception as e:
      self._fail(r, e)
      return False

  def _fail(self, r: Request, e: BaseException | str, error_type: str = "request_error"
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
      self._finish(r, "error")

  def _step(self) -> bool:
    with self.lock:
      self.step_no += 1
      now = time.monotonic()
      for r in [r for r in list(self.running) + list(self.waiting)
                if r.timeout is not None and now - r.arrival > r.timeout and not r.cancelled]:
        self._fail(r, f"the request ran past its timeout of {r.timeout:g} s", "timeout")
      for r in [r for r in self.running if r.cancelled]:
        self._finish(r, "cancelled")
      for r in [r for r in self.waiting if r.cancelled]:
        self.waiting.remove(r)
        r.finish_reason, r.state = "cancelled", "done"
        self._release_forks(r)
        r.done_event.set()
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

  def _admit(self) -> None:
    """Seats waiting requests, oldest first, while a slot is free and the pool holds the
    pages of their tokens and the first generated position (kv_manager.acquire); the first
    that does not fit waits (and everything behind it). A preempted request (one with
    generated tokens) resumes here: its prompt and all but its last generated token are
    prefilled again, and it continues decoding from that last token."""
    while self.waiting and self.free_slots:
      r = self.waiting[0]
      feed = r.prompt if not r.output_ids else np.concatenate(
          [r.prompt, np.asarray(r.output_ids[:-1], np.int32)])
      try:                                   # this request's own host work
        decoder = r.decoder
        if decoder is None and self.tokenizer is not None:
          decoder = self.tokenizer.stream_decoder()
        if self.prefix is not None:
          salts = None if r.images is None else image_salts(
              feed, r.images, self.cfg.vision.image_token_id, self.unit)
          r.hashes = block_hashes(feed, block=self.unit, salts=salts)
      except EngineFatal:
        raise
      except Exception as e:
        self._fail(r, e)
        continue
      slot = self.free_slots[-1]
      with _shared("the page pool / prefix cache bookkeeping"):
        got = self.kv.acquire(slot, r.hashes, feed.size, feed.size + 1, self.step_no,
                              r.use_prefix_cache)
        if got is None:                      # wait for memory
          return
        self.waiting.popleft()
        self.free_slots.pop()
      self._seat(slot)
      if got.ckpt is not None:
        self.cache = self._steps.load_slot(self.cache, self.ckpts, np.int32(slot),
                                           np.int32(got.ckpt))
      if got.copy_src is not None:   # the hit ends inside a page: continue in a copy of it
        self.cache = self._steps.copy_page(self.cache, np.int32(got.copy_src),
                                           np.int32(got.pages[got.hit_tokens // PAGE]))
      with _shared("the page pool bookkeeping"):
        self.kv.settle(got)
      r.slot, r.feed, r.admitted = slot, feed, next(self._admissions)
      r.pos = got.hit_tokens
      if not r.output_ids:
        r.cached_tokens = got.hit_tokens
      r.registered = got.hit_tokens // self.unit
      r.state = "prefill"
      r.decoder = decoder
      self.running.append(r)

  def _seat(self, slot: int) -> None:
    """Readies `slot` for a new request: its KDA state and penalty counts zeroed (a freed
    slot may still hold another request's; always overwrite all of it)."""
    self.cache, self.counts = self._steps.zero_slot(self.cache, self.counts, np.int32(slot))

  def _preempt(self, r: Request) -> None:
    """Takes running request r off its slot and pages (the pool has run out) and queues it
    first: it resumes exactly where it was (_admit recomputes its tokens)."""
    with _shared("the page pool bookkeeping"):
      self.running.remove(r)
      self.kv.release(r.slot)
      self.kv.preemptions += 1
      self.free_slots.append(r.slot)
    log.info("request %s preempted at %d tokens (%d generated): the KV cache is full",
             r.id, r.pos, len(r.output_ids))
    r.slot, r.pos, r.state, r.features = -1, 0, "waiting", None
    if r.forks:
      self._release_forks(r)
    self.waiting.appendleft(r)

  def _grow(self, reqs: list[Request], upto) -> list[Request]:
    """Gives each of `reqs` (decoding, oldest first) the pages for positions < upto(r),
    preempting the most recently admitted running requests while the pool has none left
    (possibly the one growing) -> the requests that may run this step."""
    out = []
    with self.lock:
      for r in reqs:
        while r.state == "decode" and not self.kv.grow(r.slot, upto(r)):
          self._preempt(max(self.running, key=lambda q: (q.admitted, q.id)))
        if r.state == "decode":
          out.append(r)
    return [r for r in out if r.state == "decode"]

  def _prefill_all(self, pre: list[Request]) -> None:
    """This step's prefill: at most `prefill_chunk` prompt tokens over the prefilling
    requests, oldest first (a long prompt takes the whole budget; several short ones share
    it), then the step's decode runs, so a long prompt never stalls the running decodes.
    Each request's pieces are the ones `_pieces` gives it whatever else runs; round k runs
    every request's k-th piece, the pieces of one size together in calls of up to
    `prefill_rows` prompts (one call per prompt when batch_invariant)."""
    budget, plans = self.prefill_chunk, []
    for r in pre:
      if budget <= 0:
        break
      plans.append((r, self._pieces(r, budget)))
      budget -= sum(plans[-1][1])
    for k in range(max((len(p) for _, p in plans), default=0)):
      groups: dict[int, list[Request]] = {}
      for r, sizes in plans:
        if k < len(sizes) and r.state == "prefill":
          groups.setdefault(sizes[k], []).append(r)
      for size, reqs in groups.items():
        for i in range(0, len(reqs), self.prefill_rows):
          self._prefill_call(reqs[i:i + self.prefill_rows], size)

  def _pieces(self, r: Request, budget: int) -> list[int]:
    """The lengths of r's prefill calls this step: whole blocks (at most `budget` tokens,
    rounded down to whole blocks, at least one), or the pieces below a block up to its next
    block boundary or the prompt's end (several prefill_plan segments, each ending where a
    checkpoint may be kept)."""
    n, pos, sizes = r.feed.size, r.pos, []
    chunk = max(PAGE, budget // PAGE * PAGE)
    while pos < n:
      plan = prefill_plan(pos, n, chunk, self.unit)
      if pos > r.pos and plan[0] >= PAGE:
        break                        # whole blocks start a chunk of their own
      sizes += plan
      pos += sum(plan)
      if plan[0] >= PAGE:
        break
    return sizes

  def _prefill_call(self, reqs: list[Request], size: int) -> None:
    """One prefill call: the next `size` prompt tokens of each of `reqs` (at most
    prefill_rows), padded to a power-of-two row count (1 when batch_invariant); then each
    request's blocks go to the prefix cache, and a finished prompt samples its first token.
    A fault of one request's host work fails it alone."""
    live = []
    for r in reqs:
      self._own(r, lambda: live.append((r, self._piece_features(r, size))))
    if not live:
      return
    rows = 1 << (len(live) - 1).bit_length()
    pad = [live[0]] * (rows - len(live))
    tokens = np.stack([r.feed[r.pos:r.pos + size] for r, _ in live + pad])
    slots = np.array([r.slot for r, _ in live + pad], np.int32)
    pos = np.array([r.pos for r, _ in live + pad], np.int32)
    width = self._bucket(int(pos.max()) + size)        # the columns the pieces can see
    tables = np.zeros((rows, width), np.int32)          # padding: the null page
    tables[:len(live)] = self.tables[slots[:len(live)], :width]
    valid = np.arange(rows) < len(live)
    feats = None if live[0][1] is None else tuple(f for _, f in live + pad)
    logits, self.cache = self._steps.prefill(*self.weights, self.cache, slots,
                                             tokens, pos, tables, valid, feats)
    for row, (r, _) in enumerate(live):
      r.pos += size
      if self.prefix is not None:
        with self.lock, _shared("the prefix cache bookkeeping"):
          self._register(r)
      if r.pos == r.feed.size:
        self._own(r, self._resumed if r.output_ids else self._prompt_done, r, logits, row)

  def _resumed(self, r: Request, logits, row: int) -> None:
    """A preempted request's tokens are in the cache again: it decodes on from its last
    token (already emitted), with its penalty counts as they were."""
    r.features = None
    self.counts = self._steps.set_counts(
        self.counts, np.int32(r.slot),
        np.bincount(r.output_ids, minlength=self.cfg.vocab_size).astype(np.int32))
    r.state = "decode"

  def _prompt_done(self, r: Request, logits, row: int) -> None:
    """r's prompt is in the cache: its first token, from row `row` of the prefill's last
    logits (and its forks', from the same row)."""
    r.features = None
    got, self.counts = self._steps.first_token(
        logits, np.int32(row), self.counts, np.int32(r.slot),
        self._sampling([r], 1, self._biases([r]), first=True))
    r.state = "decode"
    self._fork(r, logits, row)       # before r's own token, which may already finish it
    self._take(r, got, 0)

  def _fork(self, lead: Request, logits, row: int) -> None:
    """Starts the samples waiting on `lead`'s prefill (Request.fork_of) from it, now that
    its slot holds the state after the prompt: each gets a slot with that KDA state, shares
    the prompt's whole pages, continues in a copy of the partial last one, and samples its
    first token from the same logits with its own parameters. One that finds no slot or
    pages joins the queue as a request of its own (a cold prefill, prefix cache permitting)."""
    with self.lock:
      forks, lead.forks = lead.forks, []
    n = lead.prompt.size
    full, part = divmod(n, PAGE)
    for f in forks:
      if f.cancelled:
        f.finish_reason, f.state = "cancelled", "done"
        f.done_event.set()
        continue
      with self.lock, _shared("the page pool bookkeeping"):
        fresh = self.kv.fork(lead.slot, self.free_slots[-1], full, n + 1) \
            if self.free_slots else None
        if fresh is None:
          f.fork_of = None
          self.waiting.appendleft(f)
          continue
        slot = self.free_slots.pop()
        f.slot, f.feed, f.admitted = slot, lead.feed, next(self._admissions)
        f.pos = f.cached_tokens = n
        f.hashes, f.registered = lead.hashes, lead.registered
        f.state = "decode"
        self.running.append(f)
      try:
        self._seat(slot)
        self.cache = self._steps.copy_slot(self.cache, np.int32(lead.slot), np.int32(slot))
        if part:
          self.cache = self._steps.copy_page(self.cache, np.int32(self.tables[lead.slot, full]),
                                             np.int32(fresh[0]))
        f.decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        got, self.counts = self._steps.first_token(
            logits, np.int32(row), self.counts, np.int32(slot),
            self._sampling([f], 1, self._biases([f]), first=True))
        self._take(f, got, 0)
      except EngineFatal:
        raise
      except Exception as e:
        self._fail(f, e)

  def _release_forks(self, r: Request) -> None:
    """The samples waiting on r (which ends before its prefill did) queue on their own."""
    for f in reversed(r.forks):
      f.fork_of = None
      self.waiting.appendleft(f)
    r.forks = []

  def _piece_features(self, r: Request, size: int):
    """Features [size, D] f32 for the placeholders of the prompt piece [r.pos, r.pos + size),
    in order (rows past them repeat the last one; never read); None for a text-only model."""
    v = self.cfg.vision
    if v is None:
      return None
    piece = r.feed[r.pos:r.pos + size]
    if r.images is None or not np.any(piece == v.image_token_id):
      if size not in self._feature_zeros:             # one zeros buffer per piece size
        self._feature_zeros[size] = self._steps.piece_features(
            self.cfg.d_model, None, np.zeros(size, np.int32))
      return self._feature_zeros[size]
    if r.features is None:                            # the tower runs once per request
      r.features = self._steps.encode(*self.weights,
                                      jax.tree.map(np.asarray, r.images))
    done = int(np.count_nonzero(r.feed[:r.pos] == v.image_token_id))
    rows = np.minimum(done + np.arange(size), r.features.shape[0] - 1).astype(np.int32)
    return self._steps.piece_features(self.cfg.d_model, r.features, rows)

  def _register(self, r: Request) -> None:
    """Hands the finished blocks of the tokens r prefilled to the prefix cache, and keeps
    the KDA state of this position as a checkpoint when it is one the prefill keeps."""
    u = self.unit
    keep = r.pos if r.pos % u == 0 and r.pos in checkpoint_boundaries(r.feed.size, u) \
        else None
    r.registered, c = self.kv.register(r.slot, r.hashes, r.registered, min(r.pos, r.feed.size),
                                       self.step_no, keep)
    if c is not None:
      self.ckpts = self._steps.save_ckpt(self.ckpts, self.cache, np.int32(r.slot), np.int32(c))

  def _sampling(self, reqs: list[Request], rows: int, biases: dict | None = None,
                first: bool = False, ahead: set = frozenset()) -> steps.Sampling:
    """The Sampling rows of `reqs` at their slots (row 0 when `first`: the prompt's first
    token, which no penalty touches). biases: request id -> its bias row (_bias_row); with
    none the bias is a zeros array kept on the device. ahead: the id()s of requests whose
    last token is still unread (their token index is one more than the host has seen)."""
    seeds, n = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    temp, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    pres, freq = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    bias = np.zeros((rows, self.cfg.vocab_size), np.float32) if biases else None
    for r in reqs:
      s, p = (0 if first else r.slot), r.params
      seeds[s], temp[s], top_p[s] = r.seed, p.temperature, p.top_p
      n[s] = len(r.output_ids) + (id(r) in ahead)
      if not first:
        pres[s], freq[s] = p.presence_penalty, p.frequency_penalty
      if biases and r.id in biases:
        bias[s] = biases[r.id]
    return steps.Sampling(seeds, n, temp, top_p, pres, freq,
                          self._zero_bias(rows) if bias is None else bias)

  def _zero_bias(self, rows: int):
    """A zeros [rows, V] bias on the device (the steps' bias when no row has one)."""
    if rows not in self._no_bias:
      self._no_bias[rows] = jnp.zeros((rows, self.cfg.vocab_size), jnp.float32)
    return self._no_bias[rows]

  def _biases(self, reqs: list[Request]) -> dict:
    """request id -> bias row, for the requests with a logit_bias or a constraint."""
    return {r.id: self._bias_row(r) for r in reqs
            if r.params.logit_bias or r.constraint is not None}

  def _bias_row(self, r: Request) -> np.ndarray:
    """[V] f32: the request's logit_bias, and -inf where its constraint forbids a token."""
    row = np.zeros(self.cfg.vocab_size, np.float32)
    for tid, v in r.params.logit_bias:
      row[tid] += v
    if r.constraint is not None:
      allowed = np.asarray(r.constraint.allowed(), bool)
      if allowed.shape != row.shape or not allowed.any():
        raise RuntimeError(f"the request's constraint allows {int(allowed.sum())} of "
                           f"{allowed.size} tokens over a vocabulary of {row.size}")
      row[~allowed] = -np.inf
    return row

  def _decode_all(self, dec: list[Request]) -> None:
    """One decode step over all slots for the decoding requests `dec`.

    With `overlap` (ServeConfig) the step is dispatched before the previous step's tokens
    are read (one step ahead): a slot whose last token is still unread takes it from the
    device (DecodeBatch.from_prev), and the previous step's tokens are read and emitted
    (detokenised, stop-checked, pushed to their streams) while this step runs. A request is
    carried ahead only when its unread token cannot end it by length and it has no
    constraint (whose bias row needs that token first; any constrained request makes the
    step wait). When the unread token does end it (a stop id or string), its ahead row is
    wasted: that row wrote past the request's tokens in its own pages, and is dropped."""
    pend, self._pending = self._pending, None
    if pend is not None and (not self.overlap or any(r.constraint is not None for r in dec)):
      self._read_decode(pend)
      pend = None
      dec = [r for r in dec if r.state == "decode"]
    unread = {id(r) for r, *_ in pend[1]} if pend is not None else set()
    ahead = {id(r) for r in dec if id(r) in unread and not r.cancelled
             and len(r.output_ids) + 2 <= r.params.max_tokens}
    now = [r for r in dec if id(r) not in unread or id(r) in ahead]
    biases = {}
    # the pages of the positions this step writes (preempting when the pool has run out)
    now = self._grow(now, lambda r: r.pos + 1 + (id(r) in ahead))
    now = [r for r in now        # a request's own fault (e.g. its constraint) fails it alone
           if self._own(r, lambda: biases.update(self._biases([r])))]
    got = None
    if now:
      got = self._dispatch_decode(now, biases, ahead)
    if pend is not None:
      self._read_decode(pend)        # overlapped with the step just dispatched
    if got is not None:
      if self.overlap:
        self._pending = got
      else:
        self._read_decode(got)

  def _dispatch_decode(self, now: list[Request], biases: dict, ahead: set):
    """Dispatches the decode step for `now` (those whose id is in `ahead` take their unread
    token from the device) -> (the step's Sampled, [(request, slot)])."""
    b = self.max_batch
    tokens, pos, active = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, bool)
    from_prev = np.zeros(b, bool)
    tables = np.zeros_like(self.tables)               # idle rows: the null page
    for r in now:
      s = r.slot
      active[s], tables[s] = True, self.tables[s]
      if id(r) in ahead:
        from_prev[s], pos[s] = True, r.pos + 1
      else:
        tokens[s], pos[s] = r.last_token, r.pos
    sampling = self._sampling(now, b, biases, ahead=ahead)
    # Attend over a power-of-two bucket of pages that covers the longest active sequence
    # (at least DECODE_MIN_PAGES), not the whole max_len: short requests on a long-context
    # engine stay cheap, and only log2(max_len / 4K) decode shapes ever compile.
    bucket = self._bucket(int(pos.max()) + 1)
    batch = steps.DecodeBatch(tokens, pos, tables[:, :bucket], active, sampling, self._prev,
                              from_prev)
    rows = self._rows(now)
    if rows is not None:        # fewer requests than slots: run only their rows
      fields = [getattr(sampling, f.name) for f in dataclasses.fields(sampling)]
      bias = fields.pop()
      batch = steps.DecodeBatch(
          tokens[rows], pos[rows], tables[rows, :bucket], active[rows],
          steps.Sampling(*(a[rows] for a in fields),
                         self._zero_bias(rows.size) if biases is None or not biases
                         else bias[rows]),
          self._prev, from_prev[rows], rows)
    got, self.cache, self.counts = self._steps.decode(*self.weights, self.cache,
                                                      self.counts, batch)
    self._prev = got.by_slot
    if self.turns is not None:                 # cache tiers: KDA states at grid boundaries
      self.turns.after_decode(now, pos)
    row_of = {int(s): i for i, s in enumerate(rows)} if rows is not None else None
    return got, [(r, r.slot, r.slot if row_of is None else row_of[r.slot]) for r in now]

  def _rows(self, now: list[Request]) -> np.ndarray | None:
    """The slots a decode step over `now` runs: without batch invariance, its requests'
    slots padded with idle ones to a power of two (so log2(max_batch) + 1 shapes compile);
    None: all of them. (XLA:CPU's matrix products sum in an order that depends on the row
    count, so a step over fewer rows moves the logits in the last bits.)"""
    n = 1 << (len(now) - 1).bit_length()
    if self.serve.batch_invariant or n >= self.max_batch:
      return None
    taken = sorted(r.slot for r in now)
    idle = [s for s in range(self.max_batch) if s not in set(taken)]
    return np.asarray(taken + idle[:n - len(taken)], np.int32)

  def _bucket(self, tokens: int) -> int:
    """Page-table columns a step over positions < tokens reads: a power of two (at least
    DECODE_MIN_PAGES, at most max_len's), so only log2(max_len / 4K) shapes compile and a
    short sequence on a long-context engine never touches max_len's worth of columns."""
    need = -(-tokens // PAGE)
    return min(self.pages_per_slot, max(DECODE_MIN_PAGES, 1 << (need - 1).bit_length()))

  def _read_decode(self, pend) -> None:
    """Reads a dispatched decode step's tokens back and emits them, for the requests of it
    that are still decoding (one that ended meanwhile drops its row)."""
    got, rows = pend
    live = [(r, row) for r, slot, row in rows if r.state == "decode" and r.slot == slot]
    if not live:
      return
    host = _HostSampled(got, [r for r, _ in live], self.fetch)
    for r, row in live:
      r.pos += 1
      self._own(r, self._take, r, host, row)

  def _take(self, r: Request, got, row: int) -> None:
    """Records what the step sampled for `r` at `row` (logits, logprobs), then emits it."""
    host = got if isinstance(got, _HostSampled) else _HostSampled(got, [r], self.fetch)
    if r.record_logits:
      r.logits.append(host.logits[row])
    k = r.params.logprobs
    if k is not None:
      r.token_logprobs.append(float(host.logprob[row]))
      r.top_logprobs.append([(int(i), float(v)) for i, v in
                             zip(host.top_ids[row, :k], host.top_logprobs[row, :k])])
    self._emit(r, int(host.ids[row]))

  # ----- output -------------------------------------------------------------------------
  def _emit(self, r: Request, tid: int) -> None:
    now = time.monotonic()
    if r.first_token_at is None:
      r.first_token_at = now
    r.output_ids.append(tid)
    r.last_token = tid
    self.generated_tokens += 1
    finish, flush = None, True
    if tid in r.params.stop_ids:
      finish, flush = "stop", False
    elif r.decoder is not None:
      start = max(0, len(r.text) - max((len(s) for s in r.params.stop), default=0))
      # an id past the tokenizer's vocabulary (a model vocab larger than the tokenizer's)
      # reads as U+FFFD, not as an exception
      vocab = getattr(self.tokenizer, "vocab_size", None)
      r.text += "\ufffd" if vocab is not None and not 0 <= tid < vocab \
          else r.decoder.add(tid)
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
    if finish is not None:
      if r.decoder is not None and flush:
        r.text += r.decoder.flush()
      with self.lock:
        self._finish(r, finish)
    elif r.on_update is not None and r.stream:
      self._push(r, hold=max((len(s) for s in r.params.stop), default=1) - 1)

  def _push(self, r: Request, hold: int = 0) -> None:
    if r.on_update is None:
      return
    upto = max(r.sent, len(r.text) - hold)
    delta, r.sent = r.text[r.sent:upto], upto
    r.on_update(r, delta)

  def _finish(self, r: Request, reason: str) -> None:
    """Frees the slot and the request's pages at once (cached blocks stay with the cache)."""
    if r in self.running:
      with _shared("the page pool bookkeeping"):
        self.running.remove(r)
        if self.turns is not None and reason in ("stop", "length"):
          self.turns.on_finish(r)              # cache tiers: the conversation so far
        self.kv.release(r.slot)
        self.free_slots.append(r.slot)
    r.features = r.images = r.feed = None
    r.finish_reason, r.state = reason, "done"
    if r.forks:
      self._release_forks(r)
    if reason == "error":
      self._notify(r)
    else:
      self.finished_requests += 1
    if reason not in ("cancelled", "error"):
      try:
        self._push(r)
      except Exception as e:           # the request is done; its callback's fault is its own
        r.error, r.error_type, r.finish_reason = f"{type(e).__name__}: {e}", "request_error", \
            "error"
        log.warning("request %s: the final update failed: %s", r.id, r.error)
    ttft = "-" if r.first_token_at is None else f"{r.first_token_at - r.arrival:.3f}s"
    log.info("request %s: prompt %d tokens (%d cached), generated %d, ttft %s, status %s%s",
             r.id, r.prompt.size, r.cached_tokens, len(r.output_ids), ttft, r.finish_reason,
             f" ({r.error})" if r.error else "")
    r.done_event.set()

  # ----- a simple front end ---------------------------------------------------------------
  def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, stop_ids=(), frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, images: dict | None = None) -> Iterator[int]:
    """Yields up to max_new_tokens sampled token ids for one prompt (a stop id is yielded,
    then generation ends). The penalties lower the logits of tokens already generated
    (sampling.penalize; the prompt is not counted); unlike the server, which keeps the
    OpenAI range [-2, 2], any finite value is accepted here. images: packed images for the
    prompt's placeholders (see submit)."""
    try:
      req = self.submit(prompt_ids, SamplingParams(
          max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
          stop_ids=tuple(stop_ids), frequency_penalty=frequency_penalty,
          presence_penalty=presence_penalty), openai_ranges=False, images=images)
    except RequestError as e:
      raise UserError(str(e)) from None
    sent = 0
    while True:
      while sent < len(req.output_ids):
        yield req.output_ids[sent]
        sent += 1
      if req.state == "done":
        if req.error:
          raise RuntimeError(f"the request failed: {req.error}")
        return
      self.step()


__all__ = ["Engine", "SamplingParams", "Request", "RequestError", "QueueFull"]
