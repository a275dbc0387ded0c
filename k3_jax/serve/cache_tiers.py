"""Host-memory and disk tiers behind the device prefix cache (prefix_cache.py).

The device cache's entries (a block's MLA page, and the KDA checkpoint at its end when it
has one) are demoted, not dropped, when the device cache evicts them: their arrays are
copied to host memory (`HostTier`, its own byte budget, least recently used first out) and,
with a disk directory, written to a file too (cache_disk.DiskTier: write-through, so the
disk holds what the host holds and more, and a restarted server finds it). An entry leaves
the host tier when it is promoted back or pushed out by its budget; the disk keeps its file
until its own budget pushes it out.

Every entry lives in exactly one of device and host memory; the device entries of a chain
are a prefix of it (the device cache evicts leaves first and registers children under
cached parents), so a lookup walks the device entries, then continues through the host and
disk tiers, and promotes the lower-tier blocks up to the last boundary with a checkpoint
before the device lookup runs: the hit (and `cached_tokens`) counts every tier.

Copies: a demotion dispatches a jitted gather of the page (and checkpoint) and starts its
copy to the host (copy_to_host_async); nothing waits for it, the arrays become numpy when
first read. A promotion writes the host arrays into a freshly allocated page (and checkpoint
slot) with a jitted scatter, dispatched in order with the engine's steps. Restored bits are
the bits demoted, so a hit from any tier is the same computation as a device hit.

Blocks of one page (a match grid finer than the page) demoted from one device page share
one host copy of it (the copy made for the first of them, the page's latest block, is valid
for every earlier one); the disk stores each block's page in its own file.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time

import jax
import numpy as np

from k3_jax.cache import PagedMLACache, replace
from k3_jax.config import UserError
from k3_jax.serve import kv_pages as kv
from k3_jax.serve.cache_disk import Block, DiskTier, spec
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.prefix_cache import block_hashes
from k3_jax.stack import map_cache

log = logging.getLogger("k3_jax.serve")

TIERS = ("device", "host", "disk")


# ----- device copies -------------------------------------------------------------------------

def read_page(cache, p):
  """The MLA page `p` of every MLA layer (a ModelCache with only those entries)."""
  def pick(e, axis):
    if not isinstance(e, PagedMLACache):
      return None
    take = (lambda a: a[p]) if axis == 0 else (lambda a: a[:, p])
    return replace(e, c_kv=take(e.c_kv), k_r=take(e.k_r), page_table=None)
  return map_cache(pick, cache, pos=None)


def write_page(cache, p, page):
  """cache with page `p` of every MLA layer set to `page` (read_page's layout)."""
  def put(e, d, axis):
    if not isinstance(e, PagedMLACache):
      return e
    one = (lambda a, v: a.at[p].set(v)) if axis == 0 else (lambda a, v: a.at[:, p].set(v))
    return replace(e, c_kv=one(e.c_kv, d.c_kv), k_r=one(e.k_r, d.k_r))
  return map_cache(put, cache, page)


def read_ckpt(ckpts, c):
  return kv.take_rows(ckpts, c[None])


def write_ckpt(ckpts, c, row):
  return kv.put_rows(ckpts, c[None], row)


class EngineIO:
  """The device side of the tiers: reads and writes the engine's page pools and checkpoint
  rows (its `cache` and `ckpts`, replaced as the steps replace them)."""

  def __init__(self, engine):
    self.engine = engine
    self._read_page = jax.jit(read_page)
    self._write_page = jax.jit(write_page, donate_argnums=(0,))
    self._read_ckpt = jax.jit(read_ckpt)
    self._read_state = jax.jit(lambda cache, slot: read_ckpt(kv.kda_states(cache), slot))
    self._write_ckpt = jax.jit(write_ckpt, donate_argnums=(0,))
    self.page_def = jax.tree.structure(jax.eval_shape(read_page, engine.cache, 0))
    self.ckpt_def = jax.tree.structure(jax.eval_shape(read_ckpt, engine.ckpts, np.int32(0)))
    self.page_spec = spec(jax.tree.leaves(jax.eval_shape(read_page, engine.cache, 0)))
    self.ckpt_spec = spec(jax.tree.leaves(jax.eval_shape(read_ckpt, engine.ckpts, np.int32(0))))

  @staticmethod
  def _start(tree) -> list:
    leaves = jax.tree.leaves(tree)
    for a in leaves:
      a.copy_to_host_async()
    return leaves

  def read_page(self, p: int) -> list:
    return self._start(self._read_page(self.engine.cache, np.int32(p)))

  def read_ckpt(self, c: int) -> list:
    return self._start(self._read_ckpt(self.engine.ckpts, np.int32(c)))

  def read_state(self, slot: int, rows=None) -> list:
    """Slot `slot`'s KDA state now (checkpoint layout): the engine's, or row `slot` of
    `rows` (a kda_states-layout array, e.g. the decoded-turn cache's tail)."""
    if rows is not None:
      return self._start(self._read_ckpt(rows, np.int32(slot)))
    return self._start(self._read_state(self.engine.cache, np.int32(slot)))

  def write_page(self, p: int, leaves: list) -> None:
    e = self.engine
    e.cache = self._write_page(e.cache, np.int32(p), self.page_def.unflatten(leaves))

  def write_ckpt(self, c: int, leaves: list) -> None:
    e = self.engine
    e.ckpts = self._write_ckpt(e.ckpts, np.int32(c), self.ckpt_def.unflatten(leaves))


def host_arrays(arrays: list) -> list:
  """Device arrays (their host copy started) -> numpy (waits only for what is unfinished)."""
  return [a if isinstance(a, np.ndarray) else np.asarray(a) for a in arrays]


def fingerprint(cfg, params, tokenizer, match_tokens: int) -> str:
  """What a disk-tier file must match to be served: the model (its config, and the first
  values of every parameter array), the tokenizer (its kind, size and the ids of a probe
  text) and the match grid (match_tokens)."""
  h = hashlib.blake2b(digest_size=16)
  h.update(repr(cfg).encode())
  h.update(f"unit={match_tokens}".encode())     # its old name: the disk caches' keys stay
  for leaf in jax.tree.leaves(params):
    a = getattr(leaf, "value", leaf)
    head = a[(0,) * (a.ndim - 1)] if a.ndim > 1 else a
    h.update(np.asarray(jax.device_get(head[:64])).tobytes())
  if tokenizer is not None:
    h.update(type(tokenizer).__name__.encode())
    h.update(str(getattr(tokenizer, "vocab_size", "")).encode())
    try:
      probe = tokenizer.encode("The prefix cache's probe: 12345 \u00fcn\u00efc\u00f6d\u00e9 {}")
      h.update(np.asarray(probe, np.int64).tobytes())
    except Exception:
      pass
  return h.hexdigest()


# ----- the host tier -------------------------------------------------------------------------

@dataclasses.dataclass
class _Shared:
  """A host copy of a page that several blocks of it may name."""
  arrays: list
  refs: int = 0


class HostTier:
  """Blocks in host memory, least recently used first out, within `budget` bytes."""

  def __init__(self, budget: int):
    self.budget = budget
    self.blocks: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
    self.used = 0

  def __contains__(self, h) -> bool:
    return h in self.blocks

  def get(self, h: bytes) -> Block | None:
    got = self.blocks.get(h)
    return None if got is None else Block(got[0], host_arrays(got[1].arrays), got[2])

  def has_ckpt(self, h: bytes) -> bool:
    return self.blocks[h][2] is not None

  def put(self, h: bytes, parent, page: _Shared, ckpt, page_bytes: int,
          ckpt_bytes: int) -> list[bytes]:
    """Adds a block -> the blocks pushed out to make room, oldest first (the disk tier, when
    there is one, has them already: the tiers write through)."""
    if h in self.blocks:                    # (replaced: its bytes counted once)
      self.pop(h)
    page.refs += 1
    self.used += (page_bytes if page.refs == 1 else 0) + (ckpt_bytes if ckpt else 0)
    self.blocks[h] = (parent, page, ckpt, page_bytes, ckpt_bytes)
    out = []
    while self.used > self.budget and self.blocks:
      out.append(next(iter(self.blocks)))
      self.pop(out[-1])
    return out

  def pop(self, h: bytes) -> None:
    parent, page, ckpt, page_bytes, ckpt_bytes = self.blocks.pop(h)
    page.refs -= 1
    self.used -= (page_bytes if page.refs == 0 else 0) + (ckpt_bytes if ckpt else 0)


# ----- the tiers together -------------------------------------------------------------------

@dataclasses.dataclass
class TierStats:
  hit_tokens: int = 0              # prompt tokens of hits served from this tier's blocks
  blocks_in: int = 0               # blocks promoted from this tier (demoted into it: below)
  blocks_out: int = 0
  seconds_in: float = 0.0          # host time promoting out of it / demoting into it
  seconds_out: float = 0.0
  written_around: int = 0          # blocks placed here because the device cache had no room


class CacheTiers:
  def __init__(self, prefix, io, host_bytes: int, disk: DiskTier | None = None):
    """prefix: the device PrefixCache (its evictions demote here); io: EngineIO."""
    self.prefix, self.io, self.disk = prefix, io, disk
    self.host = HostTier(host_bytes)
    self.page_bytes, self.ckpt_bytes = prefix.page_bytes, prefix.ckpt_bytes
    self.match_tokens = prefix.match_tokens
    self._copies: dict[int, _Shared] = {}     # device page -> its host copy (while cached)
    self.stats = {t: TierStats() for t in TIERS}
    self.deferred = 0                         # admissions put off for a disk read under way
    self.no_room = 0                          # promotions cut short: no device room for them
    prefix.spill = self.demote

  # ----- demotion ----------------------------------------------------------------------------
  def demote(self, h: bytes, e, last_of_page: bool) -> None:
    """The device cache is evicting block h (entry e): keep its arrays in the host tier
    (and on disk)."""
    t0 = time.perf_counter()
    page = self._copies.get(e.page)
    if page is None:
      page = self._copies[e.page] = _Shared(self.io.read_page(e.page))
    if last_of_page:
      del self._copies[e.page]
    ckpt = self.io.read_ckpt(e.ckpt) if e.ckpt is not None else None
    s = self._keep(h, e.parent, page, ckpt)
    s.blocks_out += 1
    s.seconds_out += time.perf_counter() - t0

  def _keep(self, h: bytes, parent, page: _Shared, ckpt) -> TierStats:
    """Block h into the host tier (and on disk) -> the stats of the tier it went to."""
    if self.disk is not None:
      self.disk.put(h, Block(parent, page.arrays, ckpt))
    if self.host.budget > 0:
      self.host.put(h, parent, page, ckpt, self.page_bytes, self.ckpt_bytes)
    return self.stats["host" if self.host.budget > 0 else "disk"]

  # ----- write-around ------------------------------------------------------------------------
  def write_around(self, hashes: list[bytes], start: int, stop: int, page_of) -> int:
    """Blocks start..stop-1 of a running sequence (block i's latents in its device page
    page_of(i)) that the device cache could not take (its budget full of blocks running
    requests pin, or their parent is not on the device): kept in the lower tiers instead of
    dropped, with one host copy per page -> the end of the run placed (start when none:
    its chain is in no tier). The copies are dispatched now, in order with the steps, so
    they read the latents this step wrote."""
    copies, i = {}, start
    for i in range(start, stop):
      h, parent = hashes[i], (hashes[i - 1] if i else None)
      if parent is not None and parent not in self.prefix.entries and self._where(parent) is None:
        return i
      p = page_of(i)
      if p not in copies:
        copies[p] = _Shared(self.io.read_page(p))
      t0 = time.perf_counter()
      s = self._keep(h, parent, copies[p], None)
      s.written_around += 1
      s.blocks_out += 1
      s.seconds_out += time.perf_counter() - t0
    return stop

  def write_around_ckpt(self, h: bytes, parent, page_of, state) -> bool:
    """The KDA state state() (checkpoint-layout leaves, copy started) as the checkpoint of
    block h, written around the device (h must be in a lower tier) -> whether kept."""
    if self._where(h) is None:
      return False
    state = state()
    if h in self.host:
      _, page, _, _, _ = self.host.blocks[h]
      self.host.put(h, parent, page, state, self.page_bytes, self.ckpt_bytes)
      if self.disk is not None:
        self.disk.put(h, Block(parent, page.arrays, state))
      return True
    self.disk.put(h, Block(parent, self.io.read_page(page_of()), state))
    return True

  # ----- promotion ---------------------------------------------------------------------------
  def _where(self, h: bytes):
    """(tier, has a checkpoint) of a block outside device memory, or None."""
    if h in self.host:
      return "host", self.host.has_ckpt(h)
    d = self.disk.peek(h) if self.disk is not None else None
    return None if d is None else ("disk", d.has_ckpt)

  def promote(self, hashes: list[bytes], max_blocks: int, step: int) -> dict[int, str] | None:
    """Brings the lower-tier blocks that extend the device hit on `hashes` (up to the last
    boundary with a checkpoint among the first max_blocks) into device memory -> {block
    index: the tier it came from}; None (nothing done: admit the request later) while some
    of them are still being read from disk and other requests are running (with none
    running, the step has nothing else to do and waits for the reads)."""
    entries, first, best, where = self.prefix.entries, None, 0, []
    for i, h in enumerate(hashes[:max_blocks]):
      e = entries.get(h)
      if e is not None and first is None:
        if e.step == step:
          break
        best = i + 1 if e.ckpt is not None else best
        continue
      w = self._where(h)
      if w is None:
        break
      first = i if first is None else first
      where.append(w[0])
      if w[1]:
        best = i + 1
    promoted = {}
    if first is None or best <= first:
      return promoted
    on_disk = [hashes[i] for i in range(first, best) if where[i - first] == "disk"]
    if on_disk and self.disk.prefetch(on_disk) and self.io.engine.running:
      self.deferred += 1              # other requests run meanwhile; admit it when read
      return None
    i = first
    while i < best:                   # one page column at a time
      t0, col, group = time.perf_counter(), i * self.match_tokens // PAGE, []
      while i + len(group) < best and (i + len(group)) * self.match_tokens // PAGE == col:
        got = self._fetch(hashes[i + len(group)])   # (where it is now: room-making moves)
        if got is None:
          break
        group.append(got)
      n = self._install(hashes, i, [g[0] for g in group]) if group else 0
      for k in range(n):
        promoted[i + k] = group[k][1]
        st = self.stats[group[k][1]]
        st.blocks_in += 1
        st.seconds_in += (time.perf_counter() - t0) / n
      if n < len(group) or not group:
        self.no_room += bool(group)
      if n == 0 or i + n < best and (i + n) * self.match_tokens // PAGE == col:
        break                         # no room, or a block no tier holds intact
      i += n
    return promoted

  def prefetch(self, tokens) -> None:
    """A request for `tokens` is queued: start reading the blocks that only the disk holds
    of the chain past the device and host tiers (thread-safe; nothing waits for the reads)."""
    if self.disk is None:
      return
    hs, i = block_hashes(tokens, self.match_tokens), 0
    entries = self.prefix.entries
    while i < len(hs) and hs[i] in entries:
      i += 1
    want = []
    for h in hs[i:]:
      if h in self.host:
        continue
      if self.disk.peek(h) is None:
        break
      want.append(h)
    self.disk.prefetch(want)

  def _fetch(self, h: bytes):
    """(Block, tier) of a lower-tier block, taken out of the host tier; None when no tier
    has it (intact)."""
    if h in self.host:
      b = self.host.get(h)
      self.host.pop(h)
      return b, "host"
    b = self.disk.get(h) if self.disk is not None else None
    return None if b is None else (b, "disk")

  def _install(self, hashes, i: int, blocks: list) -> int:
    """Blocks i, i+1, .. of one page column (their Blocks) into one fresh device page,
    written from the last one's page (valid for every earlier block of the column, as the
    device cache reads a page from its last block), each with its checkpoint slot when it
    has one; registered in the device cache -> how many (0 when it has no room)."""
    pc, pool = self.prefix, self.prefix.pool
    parent = hashes[i - 1] if i else None
    if parent is not None:
      pc.entries[parent].children += 1          # room-making must not evict its parent
    n = 0
    try:
      col = i * self.match_tokens // PAGE
      if not pc.free_pages(1, col):
        return 0
      page = pool.alloc(1, col)[0]               # (our reference keeps them all unevictable)
      self.io.write_page(page, blocks[-1].page)
      for k, b in enumerate(blocks):
        j = i + k
        if not pc.register_block(hashes[j], hashes[j - 1] if j else None, page, step=-1):
          break
        n += 1
        if b.ckpt is not None:
          c = pc.alloc_checkpoint(hashes[j])
          if c is not None:
            self.io.write_ckpt(c, b.ckpt)
      pool.decref([page])
    finally:
      if parent is not None:
        pc.entries[parent].children -= 1
    return n

  def persist(self) -> int:
    """Writes every block of the device and host tiers that the disk tier lacks to it and
    waits for the writes (a draining server: the next one starts with them) -> blocks
    written. Call it with the engine idle."""
    if self.disk is None:
      return 0
    n = 0
    def lacks(h, ckpt) -> bool:            # (or holds it without the checkpoint it has)
      d = self.disk.peek(h)
      return d is None or (ckpt and not d.has_ckpt)
    for h, e in list(self.prefix.entries.items()):
      if lacks(h, e.ckpt is not None):
        self.disk.put(h, Block(e.parent, self.io.read_page(e.page),
                               self.io.read_ckpt(e.ckpt) if e.ckpt is not None else None))
        n += 1
    for h in list(self.host.blocks):
      if lacks(h, self.host.has_ckpt(h)):
        self.disk.put(h, self.host.get(h))
        n += 1
    self.disk.flush()
    return n

  def counted(self, hit_blocks: int, promoted: dict[int, str]) -> None:
    """A lookup hit `hit_blocks` blocks, `promoted` (promote's) of them from lower tiers:
    each block's tokens count as hits of the tier it came from."""
    lower = 0
    for i, tier in promoted.items():
      if i < hit_blocks:
        self.stats[tier].hit_tokens += self.match_tokens
        lower += 1
    self.stats["device"].hit_tokens += (hit_blocks - lower) * self.match_tokens

  def summary(self) -> dict:
    out = {"host_bytes": self.host.used, "host_budget_bytes": self.host.budget,
           "host_blocks": len(self.host.blocks), "promotions_without_room": self.no_room,
           "admissions_deferred": self.deferred}
    if self.disk is not None:
      d = self.disk
      out.update(disk_bytes=d.used, disk_budget_bytes=d.budget, disk_blocks=len(d.index),
                 disk_writes=d.writes, disk_reads=d.reads, disk_skipped=d.skipped,
                 disk_write_seconds=d.write_seconds, disk_read_seconds=d.read_seconds)
    return out


class TierMetrics:
  """A prometheus collector of the tiers (server.py /metrics): per tier the prompt tokens
  its blocks served, blocks promoted out of it and demoted into it with the host seconds
  spent, its bytes and budget; the disk tier's file writes, reads and skipped files."""

  def __init__(self, engine):
    self.engine = engine

  def collect(self):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    t = self.engine.tiers
    fams = {
        "hit_tokens": ("prompt tokens served from blocks of this tier", "hit_tokens"),
        "promoted_blocks": ("blocks promoted out of this tier to the device", "blocks_in"),
        "demoted_blocks": ("blocks demoted into this tier", "blocks_out"),
        "promotion_seconds": ("host seconds promoting blocks out of this tier",
                              "seconds_in"),
        "demotion_seconds": ("host seconds demoting blocks into this tier (copies are "
                             "started, not waited for)", "seconds_out"),
        "written_around_blocks": ("blocks placed in this tier because the device cache "
                                  "had no room for them (of the demoted ones)",
                                  "written_around")}
    for name, (doc, field) in fams.items():
      c = CounterMetricFamily(f"k3_prefix_cache_tier_{name}", doc, labels=["tier"])
      for tier, st in t.stats.items():
        c.add_metric([tier], getattr(st, field))
      yield c
    used = GaugeMetricFamily("k3_prefix_cache_tier_bytes", "bytes held in this tier",
                             labels=["tier"])
    budget = GaugeMetricFamily("k3_prefix_cache_tier_budget_bytes", "this tier's budget",
                               labels=["tier"])
    rows = [("device", t.prefix.used, t.prefix.budget), ("host", t.host.used, t.host.budget)]
    if t.disk is not None:
      rows.append(("disk", t.disk.used, t.disk.budget))
    for tier, u, b in rows:
      used.add_metric([tier], u)
      budget.add_metric([tier], b)
    yield used
    yield budget
    if t.disk is not None:
      d = t.disk
      for name, doc, v in (("writes", "block files written", d.writes),
                           ("reads", "block files read", d.reads),
                           ("skipped", "block files skipped (damaged or another model's)",
                            d.skipped),
                           ("write_seconds", "seconds writing block files", d.write_seconds),
                           ("read_seconds", "seconds reading block files", d.read_seconds)):
        c = CounterMetricFamily(f"k3_prefix_cache_disk_{name}", doc)
        c.add_metric([], v)
        yield c


def attach(engine) -> CacheTiers | None:
  """The tiers of `engine` (its ServeConfig's host_cache_bytes, disk_cache_dir,
  disk_cache_bytes) behind its prefix cache, or None when neither tier is on."""
  s = engine.serve
  if engine.prefix is None or not (s.host_cache_bytes > 0 or s.disk_cache_dir):
    return None
  if engine.relay is not None:
    raise UserError("--host_cache_bytes / --disk_cache_dir: the prefix cache's host and disk "
                    "tiers serve a single process only (not a multi-host job)")
  io = EngineIO(engine)
  disk = None
  if s.disk_cache_dir:
    fp = fingerprint(engine.cfg, engine.params, engine.tokenizer, engine.match_tokens)
    try:
      disk = DiskTier(s.disk_cache_dir, s.disk_cache_bytes, fp, io.page_spec, io.ckpt_spec)
    except OSError as e:
      raise UserError(f"--disk_cache_dir={s.disk_cache_dir!r}: {e}") from None
  tiers = CacheTiers(engine.prefix, io, s.host_cache_bytes, disk)
  engine.kv.tiers = tiers
  return tiers


__all__ = ["CacheTiers", "HostTier", "TierMetrics", "EngineIO", "attach", "fingerprint",
           "read_page", "write_page", "TIERS"]
