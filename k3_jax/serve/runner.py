"""The runner: the device side of the serving engine.

It owns what lives on the accelerator (the weights placed on the mesh, the paged cache,
the prefix cache's KDA checkpoint rows, each slot's generated-token counts for the
penalties, the last decode step's ids) and the jitted steps of steps.py that update them,
and turns the engine's requests into those steps' host arrays (token rows, page-table
columns, Sampling rows). Memory is sized here too: the bytes of one MLA page and of one
slot's KDA state, and the page pool's size from its byte budget.

In a multi-host job every step is published to the other processes first (relay.py), and
what the leader reads is replicated (`fetch`).

Faults: every device step runs through `guard`: an exception there is EngineFatal (the
steps run over the shared cache, whose state is then unknown); the engine stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3_jax.cache import PagedMLACache
from k3_jax.config import ModelConfig, ServeConfig, UserError
from k3_jax.execution import DEFAULT_KERNELS, Kernels
from k3_jax.serve import kv_manager
from k3_jax.serve import kv_pages as kv
from k3_jax.serve import steps
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.requests import EngineFatal
from k3_jax.stack import cache_leaves

log = logging.getLogger("k3_jax.serve")

DECODE_MIN_PAGES = 8      # smallest decode attention window: 8 pages = 4,096 tokens


def shape_key(name: str, args) -> tuple:
  """(step name, the shapes of its array arguments): what `guard` counts as one compile."""
  return (name,) + tuple(getattr(x, "shape", None) for a in args
                         for x in (jax.tree.leaves(a) if isinstance(a, (steps.DecodeBatch,
                                                                        tuple)) else [a])
                         if hasattr(x, "shape"))


def guard(name: str, fn, seen: set):
  """fn (a jitted step) whose exceptions become EngineFatal (they hit the shared cache), and
  which logs the first call of each new argument shape (a compile) with its duration."""
  def call(*args):
    key = shape_key(name, args)
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
def shared(what: str):
  """A context in which any exception is a fault of the engine's shared state."""
  try:
    yield
  except EngineFatal:
    raise
  except Exception as e:
    raise EngineFatal(f"{what} failed: {type(e).__name__}: {e}") from e


def bucket(tokens: int, pages_per_slot: int) -> int:
  """Page-table columns a step over positions < tokens reads: a power of two (at least
  DECODE_MIN_PAGES, at most max_len's), so only log2(max_len / 4K) shapes compile and a
  short sequence on a long-context engine never touches max_len's worth of columns."""
  need = -(-tokens // PAGE)
  return min(pages_per_slot, max(DECODE_MIN_PAGES, 1 << (need - 1).bit_length()))


class Runner:
  def __init__(self, cfg: ModelConfig, graphdef, params, rest, max_batch: int, mesh=None,
               relay=None, kernels: Kernels | None = None):
    """The weights placed (by their logical axes on `mesh`; as given without one) and the
    sizes of one MLA page and one slot's KDA state probed; `allocate` makes the rest.
    kernels: the job's kernel choices (k3_jax/execution.py; None: the defaults)."""
    self.cfg, self.graphdef, self.mesh, self.relay = cfg, graphdef, mesh, relay
    self.kernels = kernels or DEFAULT_KERNELS
    self.max_batch = max_batch
    if mesh is not None:
      from sharding.rules import tree_shardings   # jobs may use sharding
      params = jax.device_put(params, tree_shardings(params, mesh))
      rest = jax.device_put(rest, tree_shardings(rest, mesh))
    self.params, self.rest = params, rest
    self.model = nnx.merge(graphdef, params, rest)
    probe = jax.eval_shape(lambda: self.model.init_paged_cache(1, 1, PAGE))
    self.page_bytes = sum(kv.tree_bytes(e) for e in cache_leaves(probe)
                          if isinstance(e, PagedMLACache))
    self.ckpt_bytes = kv.tree_bytes(kv.kda_states(probe))
    self._scorer = None

  def size_memory(self, serve: ServeConfig, pages_per_slot: int, max_len: int
                  ) -> tuple[int, str, dict | None]:
    """The page pool and the prefix cache sized from their byte budgets, then allocated
    (`allocate`) -> (pool pages, a line saying so, the prefix cache's settings for
    kv_manager.KVManager or None without one)."""
    budget, match_tokens = serve.prefix_cache_bytes, serve.prefix_match_tokens
    cache_pages = 0
    if budget > 0 and self.page_bytes:
      cache_pages = min(budget // self.page_bytes, 64 * self.max_batch * pages_per_slot)
    # at most one checkpoint per cached block (PAGE // match_tokens blocks per page)
    num_ckpt = min(budget // max(self.ckpt_bytes, 1),
                   max(cache_pages, 0) * (PAGE // match_tokens))
    use_prefix = budget > 0 and num_ckpt > 0
    shards = kv.page_shards(self.mesh)
    # the most pages the engine could ever hold (every slot at max_len, the prefix cache full)
    cap = kv.pool_pages(self.max_batch, pages_per_slot, cache_pages, shards)
    n, msg = self._pool_pages(serve, shards, cap, num_ckpt if use_prefix else 0, max_len)
    self.allocate(n, num_ckpt if use_prefix else 0)
    return n, msg, (dict(num_ckpt_slots=num_ckpt, budget_bytes=budget,
                         page_bytes=self.page_bytes, ckpt_bytes=self.ckpt_bytes,
                         match_tokens=match_tokens)
                    if use_prefix else None)

  def _pool_pages(self, serve: ServeConfig, shards: int, cap: int, num_ckpt: int,
                 max_len: int) -> tuple[int, str]:
    """The page pool's size from its byte budget (ServeConfig.kv_cache_bytes, or the
    default kv_manager.auto_budget picks), at most `cap` (what max_batch sequences of
    max_len and a full prefix cache could ever hold) -> (pages, a line saying so)."""
    budget, how = serve.kv_cache_bytes, "--kv_cache_bytes"
    if not budget:
      devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()
      fixed = (self.max_batch + num_ckpt) * self.ckpt_bytes // shards
      budget, how, measured = kv_manager.auto_budget(devices, fixed, shards)
      if measured and jax.process_count() > 1:    # every process must build the same pool
        from jax.experimental import multihost_utils
        budget = int(np.min(multihost_utils.process_allgather(np.int64(budget))))
    try:
      n = kv_manager.pool_size(budget, self.page_bytes, shards, cap)
    except ValueError as e:
      raise UserError(str(e)) from None
    capped = ", capped at what max_batch x max_len needs" if n == cap else ""
    msg = (f"KV cache: {n - 1} pages of {PAGE} tokens = {(n - 1) * PAGE:,} tokens "
           f"({n * self.page_bytes / 2**20:,.1f} MiB over {shards} page shard(s); budget "
           f"{budget / 2**20:,.1f} MiB from {how}{capped}); "
           f"max_len {max_len:,} tokens per sequence")
    log.info(msg)
    return n, msg

  def allocate(self, num_pages: int, num_ckpt: int) -> None:
    """The paged cache (all zeros, made on its devices), `num_ckpt` checkpoint rows (0: no
    prefix cache), the counts, and the jitted steps; registered with the relay."""
    abstract = jax.eval_shape(lambda: self.model.init_paged_cache(self.max_batch, num_pages,
                                                                  PAGE))
    zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    self.cache = zeros() if self.mesh is None else jax.jit(
        zeros, out_shardings=kv.paged_cache_shardings(abstract, self.mesh))()
    self.ckpts = kv.zeros_rows(kv.kda_states(self.cache), num_ckpt) if num_ckpt else None
    self.counts = jnp.zeros((self.max_batch, self.cfg.vocab_size), jnp.int32)
    self._build_steps()
    if self.mesh is None:
      self.cache, self.counts, self.prev, self.ckpts = self._placed_as_stepped(
          (self.cache, self.counts, self.prev, self.ckpts))
    if self.relay is not None:     # the device state every process made alike, in one order
      self.relay.register((self.params, self.rest, self.cache, self.counts, self.ckpts,
                           self.no_bias, self.prev))

  def _build_steps(self):
    # The jitted steps (steps.py) belong to this runner and close over its parallel setup:
    # another mesh (or kernels) is another engine, with its own compiles.
    from sharding.install import parallel_for
    self.par = parallel_for(self.mesh, kernels=self.kernels)
    seen = self.compiled = set()   # (step name, shapes) compiled so far
    (p_leaves, p_def), (r_leaves, r_def) = (jax.tree.flatten(t) for t in (self.params,
                                                                            self.rest))
    self.weights = (p_leaves, r_leaves)       # what prefill / decode / encode take
    jitted = self.jitted = steps.jit_steps(self.graphdef, self.par, treedefs=(p_def, r_def))
    self.steps = steps.ServeSteps(*(guard(name, self.relayed(name, fn), seen)
                               for name, fn in zip(steps.ServeSteps._fields, jitted)))
    self._fetch = None
    if self.relay is not None:   # what the leader reads, replicated onto every host
      from jax.sharding import NamedSharding, PartitionSpec
      self._fetch = guard("fetch", self.relayed("fetch", jax.jit(
          lambda t: t, out_shardings=NamedSharding(self.mesh, PartitionSpec()))), seen)
    self._feature_zeros = {}
    self.no_bias = {}         # rows -> zeros [rows, V] kept on the device (zero_bias)
    self.prev = jnp.zeros((self.max_batch,), jnp.int32)    # the last decode step's ids

  def _placed_as_stepped(self, tree):
    """tree's arrays (made by jnp, not yet on a sharding) placed where the steps return
    them: on the weights' one-device mesh when the weights lie on one (a loaded
    checkpoint), replicated. A jitted step keys its compile on its arguments' shardings
    too, so a cache first passed unplaced compiled every step's first shape twice (once
    for the fresh arrays, again for the step's outputs)."""
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = next((getattr(x.sharding, "mesh", None) for x in jax.tree.leaves(self.params)
                 if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
    if mesh is None:
      return tree
    return jax.tree.map(lambda a: jax.device_put(
        a, NamedSharding(mesh, PartitionSpec(*[None] * a.ndim))), tree)

  def relayed(self, name: str, fn):
    """fn (a jitted device step) as this runner runs it: published to the other processes
    first in a multi-host job (relay.py), itself otherwise."""
    return fn if self.relay is None else self.relay.wrap(name, fn)

  def fetch(self, tree):
    """Device arrays the host reads, readable here (replicated in a multi-host job)."""
    return tree if self._fetch is None else self._fetch(tree)

  def scorer(self, max_len: int):
    """The teacher-forced scorer over these weights (logprobs.Scorer), made on first use."""
    if self._scorer is None:
      from k3_jax.serve import logprobs
      self._scorer = logprobs.Scorer(self.graphdef, self.params, self.rest, self.par,
                                     max_len, self.relayed, self.fetch)
    return self._scorer

  # ----- slot state ----------------------------------------------------------------------
  def seat(self, slot: int) -> None:
    """Readies `slot` for a new request: its KDA state and penalty counts zeroed (a freed
    slot may still hold another request's; always overwrite all of it)."""
    self.cache, self.counts = self.steps.zero_slot(self.cache, self.counts, np.int32(slot))

  def load_ckpt(self, slot: int, c: int) -> None:
    self.cache = self.steps.load_slot(self.cache, self.ckpts, np.int32(slot), np.int32(c))

  def save_ckpt(self, slot: int, c: int) -> None:
    self.ckpts = self.steps.save_ckpt(self.ckpts, self.cache, np.int32(slot), np.int32(c))

  def compile_ckpt_steps(self) -> int:
    """Compiles save_ckpt and load_slot for this engine's state without running them
    (lowered and compiled ahead: nothing is read or written; the later calls find the
    program in JAX's cache) -> how many compiled. The prefix cache first calls them when
    traffic does (0.3 s each for the 15M Kimi-Linear on CPU). None without checkpoints or
    under a relay (whose hosts compile in step)."""
    if self.ckpts is None or self.relay is not None:
      return 0
    todo = [("save_ckpt", (self.ckpts, self.cache)), ("load_slot", (self.cache, self.ckpts))]
    done = 0
    for name, state in todo:
      args = state + (np.int32(0), np.int32(0))
      key = shape_key(name, args)
      if key in self.compiled:
        continue
      getattr(self.jitted, name).lower(*args).compile()
      self.compiled.add(key)
      done += 1
    return done

  def copy_page(self, src: int, dst: int) -> None:
    self.cache = self.steps.copy_page(self.cache, np.int32(src), np.int32(dst))

  def copy_slot(self, src: int, dst: int) -> None:
    self.cache = self.steps.copy_slot(self.cache, np.int32(src), np.int32(dst))

  def set_counts(self, slot: int, output_ids) -> None:
    """A resumed request's penalty counts, as they were."""
    self.counts = self.steps.set_counts(
        self.counts, np.int32(slot),
        np.bincount(output_ids, minlength=self.cfg.vocab_size).astype(np.int32))

  # ----- steps ---------------------------------------------------------------------------
  def sampling(self, reqs, rows: int, biases: dict | None = None, first: bool = False,
               ahead: set = frozenset()) -> steps.Sampling:
    """The Sampling rows of `reqs` at their slots (row 0 when `first`: the prompt's first
    token, which no penalty touches). biases: request id -> its bias row
    (output.bias_row); with none the bias is a zeros array kept on the device. ahead: the
    id()s of requests whose last token is still unread (their token index is one more than
    the host has seen)."""
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
                          self.zero_bias(rows) if bias is None else bias)

  def sampling_rows(self, sampling: steps.Sampling, rows: np.ndarray, biased: bool
                    ) -> steps.Sampling:
    """The Sampling rows `rows` of a full one (`sampling`'s bias a kept zeros array when
    no row is `biased`)."""
    fields = [getattr(sampling, f.name) for f in dataclasses.fields(sampling)]
    bias = fields.pop()
    return steps.Sampling(*(a[rows] for a in fields),
                          bias[rows] if biased else self.zero_bias(rows.size))

  def zero_bias(self, rows: int):
    """A zeros [rows, V] bias on the device (the steps' bias when no row has one)."""
    if rows not in self.no_bias:
      self.no_bias[rows] = jnp.zeros((rows, self.cfg.vocab_size), jnp.float32)
    return self.no_bias[rows]

  def piece_features(self, r, size: int):
    """Features [size, D] f32 for the placeholders of the prompt piece [r.pos, r.pos + size),
    in order (rows past them repeat the last one; never read); None for a text-only model.
    The tower runs once per request, on its first piece holding a placeholder."""
    v = self.cfg.vision
    if v is None:
      return None
    piece = r.feed[r.pos:r.pos + size]
    if r.images is None or not np.any(piece == v.image_token_id):
      if size not in self._feature_zeros:             # one zeros buffer per piece size
        self._feature_zeros[size] = self.steps.piece_features(
            self.cfg.d_model, None, np.zeros(size, np.int32))
      return self._feature_zeros[size]
    if r.features is None:                            # the tower runs once per request
      r.features = self.steps.encode(*self.weights, jax.tree.map(np.asarray, r.images))
    done = int(np.count_nonzero(r.feed[:r.pos] == v.image_token_id))
    rows = np.minimum(done + np.arange(size), r.features.shape[0] - 1).astype(np.int32)
    return self.steps.piece_features(self.cfg.d_model, r.features, rows)

  def prefill(self, live: list, size: int, tables: np.ndarray, pages_per_slot: int):
    """One prefill call: the next `size` prompt tokens of each (request, its features) of
    `live`, padded to a power-of-two row count (padding rows repeat the first and read the
    null page) -> the rows' last logits [rows, V]."""
    rows = 1 << (len(live) - 1).bit_length()
    pad = [live[0]] * (rows - len(live))
    tokens = np.stack([r.feed[r.pos:r.pos + size] for r, _ in live + pad])
    slots = np.array([r.slot for r, _ in live + pad], np.int32)
    pos = np.array([r.pos for r, _ in live + pad], np.int32)
    width = bucket(int(pos.max()) + size, pages_per_slot)   # the columns the pieces can see
    table = np.zeros((rows, width), np.int32)               # padding: the null page
    table[:len(live)] = tables[slots[:len(live)], :width]
    valid = np.arange(rows) < len(live)
    feats = None if live[0][1] is None else tuple(f for _, f in live + pad)
    logits, self.cache = self.steps.prefill(*self.weights, self.cache, slots, tokens, pos,
                                            table, valid, feats)
    return logits

  def first_token(self, logits, row: int, r, bias: dict) -> steps.Sampled:
    """r's first token, sampled from row `row` of a prefill's last logits."""
    got, self.counts = self.steps.first_token(
        logits, np.int32(row), self.counts, np.int32(r.slot),
        self.sampling([r], 1, bias, first=True))
    return got

  def decode(self, now: list, biases: dict, ahead: set, tables: np.ndarray,
             pages_per_slot: int, rows: np.ndarray | None = None):
    """Dispatches the decode step for `now` (those whose id() is in `ahead` take their
    unread token from the device) over the slots `rows` (planner.decode_slots; None: all)
    -> (the step's Sampled, [(request, its slot, its row in the step)])."""
    b = self.max_batch
    tokens, pos, active = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, bool)
    from_prev = np.zeros(b, bool)
    for r in now:
      s = r.slot
      active[s] = True
      if id(r) in ahead:
        from_prev[s], pos[s] = True, r.pos + 1
      else:
        tokens[s], pos[s] = r.last_token, r.pos
    sampling = self.sampling(now, b, biases, ahead=ahead)
    # Attend over a power-of-two bucket of pages that covers the longest active sequence
    # (at least DECODE_MIN_PAGES), not the whole max_len: short requests on a long-context
    # engine stay cheap, and only log2(max_len / 4K) decode shapes ever compile. Only those
    # columns are copied (a 1M-token max_len's tables are 2,048 columns a slot).
    width = bucket(int(pos.max()) + 1, pages_per_slot)
    table = np.zeros((b, width), np.int32)            # idle rows: the null page
    for r in now:
      table[r.slot] = tables[r.slot, :width]
    batch = steps.DecodeBatch(tokens, pos, table, active, sampling, self.prev, from_prev)
    if rows is not None:        # fewer requests than slots: run only their rows
      batch = steps.DecodeBatch(
          tokens[rows], pos[rows], table[rows], active[rows],
          self.sampling_rows(sampling, rows, bool(biases)), self.prev, from_prev[rows], rows)
    got, self.cache, self.counts = self.steps.decode(*self.weights, self.cache, self.counts,
                                                     batch)
    self.prev = got.by_slot
    row_of = {int(s): i for i, s in enumerate(rows)} if rows is not None else None
    return got, [(r, r.slot, r.slot if row_of is None else row_of[r.slot]) for r in now]


__all__ = ["Runner", "guard", "shared", "bucket", "DECODE_MIN_PAGES"]
