"""Multi-controller serving: one engine over every host's devices (docs/serving.md, Multi-host).

Process 0, the leader, runs the HTTP server, the planner and all of the engine's host state
(slots, page tables, the prefix cache's bookkeeping). Every process holds the engine's device
state (parameters, the paged cache, the KDA checkpoints, the penalty counts) as global arrays
over one mesh, and every process must dispatch the same jitted programs in the same order.
So before the leader dispatches a step it publishes the call, a *plan*, in the key-value
store of the distributed runtime that `jax.distributed.initialize` already runs: the step's
name, its host arguments by value (token ids, positions, page-table rows, sampling parameters
and seeds, bias rows), its device arguments as handles. Followers replay the plans in order.
What the leader reads back (the sampled ids and log-probabilities) goes through one more
relayed step, `fetch`, which replicates it, so every host holds it and the leader can read it.

Handles: a device argument is either engine state registered at start-up (`register`, in the
same order on every process) or an output of an earlier relayed call; outputs are numbered in
call order, identically everywhere, so a handle is that number. The leader watches its arrays
through weakrefs; the handles of arrays it has dropped ride along with its next plan and the
followers drop their copies.

Plans live under k3serve/plan/<block>/<seq> (a block is BLOCK plans); followers report their
progress every BLOCK plans and the leader deletes whole blocks every follower has passed.

Liveness (`Group`): every process writes a heartbeat key every peer_timeout / 5 s, and a
watchdog thread reads the others' (the leader watches every follower, a follower the leader).
A process whose beat has not moved for peer_timeout seconds, or whose coordinator cannot be
reached for that long, is lost: the watchdog prints one line naming it and ends this process
with status LOST_EXIT (os._exit: the main thread may be blocked in a collective that will
never finish), so that a supervisor restarts the whole group.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import threading
import time
import weakref
import zlib

import jax
import numpy as np

PREFIX = "k3serve"
BLOCK = 256            # plans per key-value directory (deleted whole)
LOST_EXIT = 3          # exit status when a peer process is lost
STOP = "__stop__"      # the plan that ends the followers (its argument: their exit status)
_COMPRESS_OVER = 1 << 16


class _Handle:
  """A device argument in a plan: the number of the array on every process."""
  __slots__ = ("n",)

  def __init__(self, n: int):
    self.n = n

  def __reduce__(self):
    return _Handle, (self.n,)


def _wait(get, key: str):
  """get(key, timeout_ms) retried while it times out (a blocking read of a key another
  process has not written yet); any other error is raised."""
  while True:
    try:
      return get(key, 1000)
    except Exception as e:
      if "DEADLINE_EXCEEDED" not in str(e):
        raise


def _client():
  from jax._src import distributed
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("multi-host serving needs jax.distributed to be initialised "
                       "(--coordinator_address, --num_processes, --process_id)")
  return client


class Group:
  """The serving processes: heartbeats, the watchdog and the start-up handshake."""

  def __init__(self, peer_timeout: float, client=None):
    self.client = client or _client()
    self.pid, self.n = jax.process_index(), jax.process_count()
    self.peer_timeout = float(peer_timeout)
    self.leader = self.pid == 0
    self.period = max(self.peer_timeout / 5, 0.05)      # seconds between heartbeats
    self._stopped = threading.Event()

  # ----- liveness ------------------------------------------------------------------------
  def start(self) -> None:
    """Starts beating and watching (before loading: a peer that dies while loading is
    noticed too)."""
    threading.Thread(target=self._watch, name="k3-heartbeat", daemon=True).start()

  def stop(self) -> None:
    self._stopped.set()

  def watched(self) -> list[int]:
    return list(range(1, self.n)) if self.leader else [0]

  def _watch(self) -> None:
    beat = 0
    last = {q: (None, time.monotonic()) for q in self.watched()}
    reached = time.monotonic()
    while not self._stopped.is_set():
      now = time.monotonic()
      try:
        beat += 1
        self.client.key_value_set(f"{PREFIX}/beat/{self.pid}", str(beat), allow_overwrite=True)
        for q in last:
          try:
            v = self.client.key_value_try_get(f"{PREFIX}/beat/{q}")
          except Exception as e:                     # not written yet: NOT_FOUND
            if "NOT_FOUND" not in str(e):
              raise
            v = None
          if v != last[q][0]:
            last[q] = (v, now)
          elif now - last[q][1] > self.peer_timeout:
            self.lost(q, f"no heartbeat for {now - last[q][1]:.1f} s")
        reached = now
      except Exception as e:                         # the coordinator (process 0) is gone
        if self._stopped.is_set():
          return
        if now - reached > self.peer_timeout:
          self.lost(0, f"the coordinator did not answer for {now - reached:.1f} s "
                       f"({type(e).__name__})")
      self._stopped.wait(self.period)

  def lost(self, q: int, why: str) -> None:
    """Prints the one line naming the lost process and ends this one."""
    if self._stopped.is_set():
      return
    print(f"k3 serve: process {self.pid} lost process {q} of {self.n} ({why}); exiting with "
          f"status {LOST_EXIT}", file=sys.stderr, flush=True)
    os._exit(LOST_EXIT)

  def settle(self) -> None:
    """Waits long enough for the watchdog to notice a lost peer (called before a fatal exit
    that may have been caused by one, so that the exit names it)."""
    self._stopped.wait(self.peer_timeout + 2 * self.period)

  # ----- start-up ------------------------------------------------------------------------
  def ready(self) -> None:
    """This process has loaded its shards and built its engine."""
    self.client.key_value_set(f"{PREFIX}/ready/{self.pid}", "1", allow_overwrite=True)

  def wait_ready(self, log=print) -> None:
    """The leader: blocks until every follower is ready (no overall bound: loading a large
    model takes minutes; the watchdog ends the wait if one dies)."""
    for q in range(1, self.n):
      _wait(self.client.blocking_key_value_get, f"{PREFIX}/ready/{q}")
      log(f"process {q} of {self.n} is ready")


class Relay:
  """The step relay of one process (see the module docstring)."""

  def __init__(self, group: Group):
    self.group, self.client = group, group.client
    self.leader = group.leader
    self.seq = 0                    # plans sent (leader) / replayed (follower)
    self.next_handle = 0
    self._ids: dict[int, int] = {}                 # leader: id(array) -> handle
    self._arrays: dict[int, jax.Array] = {}        # follower: handle -> array
    self._freed: collections.deque[int] = collections.deque()
    self._lock = threading.RLock()
    self._deleted_blocks = 0
    self.fns: dict[str, object] = {}              # name -> the jitted function
    self.factories: dict[str, object] = {}        # name -> makes it (steps made on first use)
    self.sent_bytes = 0
    self.send_seconds = 0.0

  # ----- handles -------------------------------------------------------------------------
  def register(self, tree) -> None:
    """Numbers the device arrays of `tree`: engine state made at start-up (in the same order
    on every process) and each relayed call's outputs."""
    for leaf in jax.tree.leaves(tree):
      if isinstance(leaf, jax.Array):
        self._own(leaf)

  def _own(self, leaf) -> None:
    h = self.next_handle
    self.next_handle += 1
    if self.leader:
      self._ids[id(leaf)] = h
      weakref.finalize(leaf, self._gone, id(leaf), h)
    else:
      self._arrays[h] = leaf

  def _gone(self, key: int, h: int) -> None:
    if self._ids.get(key) == h:
      del self._ids[key]
    self._freed.append(h)

  def _encode(self, name: str, args):
    """(plan arguments, the leader's own call arguments): device arrays the relay knows
    become handles; a process-local array (made eagerly on this host) goes by value, as the
    numpy array both sides then pass."""
    leaves, tdef = jax.tree.flatten(args)
    sent, local = [], []
    for x in leaves:
      if isinstance(x, jax.Array):
        h = self._ids.get(id(x))
        if h is not None:
          sent.append(_Handle(h))
          local.append(x)
          continue
        if not x.is_fully_addressable:
          raise RuntimeError(f"multi-host relay: an argument of step {name!r} is a global "
                             "array no relayed step made (an eager device op on the leader?)")
        x = np.asarray(x)
      sent.append(x)
      local.append(x)
    return tdef.unflatten(sent), tdef.unflatten(local)

  def _decode(self, args):
    leaves, tdef = jax.tree.flatten(args)
    return tdef.unflatten([self._arrays[x.n] if isinstance(x, _Handle) else x for x in leaves])

  # ----- the leader ----------------------------------------------------------------------
  def _key(self, seq: int) -> str:
    return f"{PREFIX}/plan/{seq // BLOCK}/{seq}"

  def wrap(self, name: str, fn):
    """`fn` (a jitted step) relayed: on the leader each call is published first; followers
    record it under `name` and replay it."""
    self.fns[name] = fn
    if not self.leader:
      return fn

    def call(*args):
      with self._lock:
        sent, local = self._encode(name, args)
        self._send(name, sent)
        out = fn(*local)
        self.register(out)
        return out
    call.__name__ = getattr(fn, "__name__", name)
    return call

  def _send(self, name: str, args) -> None:
    t0 = time.perf_counter()
    freed = []
    while self._freed:
      freed.append(self._freed.popleft())
    data = pickle.dumps((name, args, freed), protocol=pickle.HIGHEST_PROTOCOL)
    data = b"Z" + zlib.compress(data, 1) if len(data) > _COMPRESS_OVER else b"P" + data
    self.client.key_value_set_bytes(self._key(self.seq), data)
    self.seq += 1
    if self.seq % BLOCK == 0:
      self._trim()
    self.sent_bytes += len(data)
    self.send_seconds += time.perf_counter() - t0

  def _trim(self) -> None:
    """Deletes the plan blocks every follower has replayed."""
    done = []
    for q in range(1, self.group.n):
      try:
        done.append(int(self.client.key_value_try_get(f"{PREFIX}/ack/{q}")))
      except Exception:
        done.append(0)
    upto = min(done, default=self.seq) // BLOCK
    for b in range(self._deleted_blocks, upto):
      self.client.key_value_delete(f"{PREFIX}/plan/{b}")
    self._deleted_blocks = max(self._deleted_blocks, upto)

  def stop(self, status: int) -> None:
    """Ends the followers with `status` (the leader's own exit status)."""
    with self._lock:
      self._send(STOP, status)

  # ----- a follower ----------------------------------------------------------------------
  def _get(self, key: str) -> bytes:
    try:
      return _wait(self.client.blocking_key_value_get_bytes, key)
    except Exception as e:                       # the coordinator (process 0) is gone
      self.group.lost(0, f"its next plan could not be read: {str(e).splitlines()[0][:200]}")
      raise

  def follow(self) -> int:
    """Replays the leader's plans until it sends STOP; -> the exit status it sent."""
    while True:
      data = self._get(self._key(self.seq))
      body = zlib.decompress(data[1:]) if data[:1] == b"Z" else data[1:]
      name, args, freed = pickle.loads(body)
      self.seq += 1
      if self.seq % BLOCK == 0:
        self.client.key_value_set(f"{PREFIX}/ack/{self.group.pid}", str(self.seq),
                                  allow_overwrite=True)
      for h in freed:
        self._arrays.pop(h, None)
      if name == STOP:
        return int(args)
      fn = self.fns.get(name)
      if fn is None:
        self.factories[name]()            # registers it (through wrap)
        fn = self.fns[name]
      self.register(fn(*self._decode(args)))


def start(peer_timeout: float) -> Relay | None:
  """The relay of this process when the job has more than one (its watchdog running);
  None for a single process."""
  if jax.process_count() == 1:
    return None
  group = Group(peer_timeout)
  group.start()
  return Relay(group)


__all__ = ["BLOCK", "LOST_EXIT", "Group", "Relay", "start"]
