"""The step relay's bookkeeping (k3_jax/serve/relay.py) in one process: a leader and a
follower Relay over an in-memory stand-in for the distributed key-value store. The
follower replays the leader's plans and must end with the same arrays under the same
handles, drop the ones the leader dropped, take large plans compressed, and leave only the
plan blocks not yet replayed. (The real store and processes: test_multihost_serve.py.)"""

import gc
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.serve import relay as rl


class MemoryKV:
  """The key-value calls the relay makes, on a dict (a missing key times out at once)."""

  def __init__(self):
    self.d = {}

  def key_value_set_bytes(self, key, value):
    assert key not in self.d, key
    self.d[key] = value

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite or key not in self.d, key
    self.d[key] = value

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    if key not in self.d:
      raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
    return self.d[key]

  def key_value_try_get(self, key):
    if key not in self.d:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.d[key]

  def key_value_delete(self, key):
    for k in [k for k in self.d if k == key or k.startswith(key + "/")]:
      del self.d[k]


@pytest.fixture
def pair(monkeypatch):
  monkeypatch.setattr(rl, "BLOCK", 4)
  kv = MemoryKV()
  lead = rl.Relay(types.SimpleNamespace(client=kv, leader=True, n=2, pid=0))
  follow = rl.Relay(types.SimpleNamespace(client=kv, leader=False, n=2, pid=1))
  return kv, lead, follow


def test_follower_replays_to_the_same_arrays(pair):
  kv, lead, follow = pair
  add = jax.jit(lambda a, b: a + b)
  total = jax.jit(lambda a, big: a.sum() + big.sum())
  state = {"w": jnp.arange(4.0), "n": jnp.zeros(())}
  lead.register(state)
  follow.register({"w": jnp.arange(4.0), "n": jnp.zeros(())})   # made alike on each host
  ladd, ltotal = lead.wrap("add", add), lead.wrap("total", total)
  follow.wrap("add", add)
  follow.factories["total"] = lambda: follow.wrap("total", total)   # made on first use

  x = ladd(state["w"], np.float32(1))            # a host scalar by value
  y = ladd(x, x)                                  # a step's output by handle
  x_handle = lead._ids[id(x)]
  del x
  gc.collect()                                    # the leader drops x ...
  z = ladd(y, jnp.ones(4))                        # a process-local array: by value
  big = np.ones(100_000, np.float32)              # a plan over 64 KB: compressed
  t = ltotal(z, big)
  lead.stop(0)
  assert any(v[:1] == b"Z" for v in kv.d.values())

  assert follow.follow() == 0
  assert x_handle not in follow._arrays           # ... and so does the follower
  for out in (y, z, t):
    h = lead._ids[id(out)]
    np.testing.assert_array_equal(np.asarray(follow._arrays[h]), np.asarray(out))
  assert follow.seq == lead.seq == 5
  assert float(t) == float((2 * (np.arange(4.0) + 1) + 1).sum() + 100_000)


def test_replayed_blocks_are_deleted(pair):
  kv, lead, follow = pair
  inc = jax.jit(lambda a: a + 1)
  a = jnp.zeros(2)
  lead.register(a)
  follow.register(jnp.zeros(2))
  linc = lead.wrap("inc", inc)
  follow.wrap("inc", inc)
  for _ in range(10):                             # plans 0..9: blocks 0, 1, 2 of 4
    a = linc(a)
  lead.stop(0)                                    # plan 10
  assert follow.follow() == 0                     # acks 4 and 8
  lead._trim()
  plans = sorted(k for k in kv.d if "/plan/" in k)
  assert plans and all(k.startswith(f"{rl.PREFIX}/plan/2/") for k in plans), plans
  np.testing.assert_array_equal(np.asarray(follow._arrays[lead._ids[id(a)]]), [10.0, 10.0])


def test_an_unknown_step_name_needs_its_factory(pair):
  kv, lead, follow = pair
  f = jax.jit(lambda a: a * 2)
  lead.wrap("twice", f)(np.ones(2, np.float32))
  with pytest.raises(KeyError, match="twice"):
    follow.follow()
