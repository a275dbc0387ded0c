"""Parallelism is an argument: the mesh rules and the parallel ops reach the traced program
only as an explicit, hashable `Parallel` (static under jit), so jit's cache keys on it. A
step traced under one setup is never reused under another, an equal rebuilt setup reuses
the compile, and a step built without one is the single-device program."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs
from k3_jax import partitioning, train
from k3_jax.config import apply_overrides
from k3_jax.model import create_model, forward
from k3_jax.partitioning import SINGLE, Parallel
from sharding import install
from sharding.install import parallel_for
from sharding.mesh import make_mesh, parse_mesh

# Two layers: a dense KDA layer and an MLA + MoE layer (every mixer and the MoE dispatch
# under each setup; a third, KDA + MoE layer added a third of the compiles and nothing new).
CFG = apply_overrides(configs.get("k3_tiny"), ["num_layers=2", "mla_layers=(2,)"])


def _mesh(n: int):
  return make_mesh(parse_mesh(f"data:{n}"), devices=jax.devices()[:n])


def _model():
  return nnx.split(create_model(CFG, seed=0))


def test_parallel_is_compared_by_its_setup_not_its_callables():
  m2 = _mesh(2)
  a = parallel_for(m2)
  assert parallel_for(m2) is a                                   # memoised per mesh
  install.parallel_for.cache_clear()
  b = parallel_for(_mesh(2))                                     # rebuilt: new callables
  assert b is not a and b.resolver is not a.resolver
  assert b == a and hash(b) == hash(a)
  assert a != parallel_for(_mesh(4)) and a != SINGLE
  assert parallel_for(None) is SINGLE
  assert a.platform == "cpu" and a.kernels_sharded and not SINGLE.kernels_sharded
  assert SINGLE == Parallel() and SINGLE.ops == partitioning.ParallelOps()
  slot = parallel_for(m2, "slot")                     # the decode of a batch filling the mesh
  assert slot != a and slot.batch_fills_mesh and not (a.batch_fills_mesh or
                                                      SINGLE.batch_fills_mesh)


def test_a_step_is_never_reused_under_another_parallel_setup():
  graphdef, state = _model()
  tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, CFG.vocab_size)
  traces = []

  def fwd(state, tokens, par):
    traces.append(par)
    return forward(nnx.merge(graphdef, state), tokens, par=par)

  step = jax.jit(fwd, static_argnames="par")
  want = step(state, tokens, par=SINGLE)
  m2, m4 = _mesh(2), _mesh(4)
  for par in (parallel_for(m2), parallel_for(m4)):
    np.testing.assert_allclose(step(state, tokens, par=par), want, rtol=2e-5, atol=2e-5)
  assert traces == [SINGLE, parallel_for(m2), parallel_for(m4)]     # one trace per setup
  install.parallel_for.cache_clear()
  for par in (parallel_for(_mesh(2)), parallel_for(m4), SINGLE):       # equal: reused
    step(state, tokens, par=par)
  assert len(traces) == 3 and step._cache_size() == 3


def _constraints(par) -> int:
  graphdef, state = _model()
  tokens = jnp.zeros((4, 16), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda s, t: forward(nnx.merge(graphdef, s), t, par=par))(state, tokens)
  return str(jaxpr).count("sharding_constraint")


def test_a_step_built_without_a_parallel_is_the_single_device_program():
  graphdef, state = _model()
  tokens = jnp.zeros((4, 16), jnp.int32)
  text = jax.jit(lambda s, t: forward(nnx.merge(graphdef, s), t)).lower(state, tokens).as_text()
  assert "sharding" not in text and "shard_map" not in text
  assert _constraints(SINGLE) == 0 and _constraints(parallel_for(_mesh(2))) > 0


def test_train_steps_carry_the_parallel_of_their_mesh():
  tc = configs.get_train("k3_tiny")
  s2, s4 = train.build_steps(CFG, tc, _mesh(2)), train.build_steps(CFG, tc, _mesh(4))
  assert s2.par == parallel_for(_mesh(2)) and s4.par == parallel_for(_mesh(4))
  assert s2.train is not s4.train                      # a program per mesh, never shared
  assert train.build_steps(CFG, tc, _mesh(2)).train is s2.train
