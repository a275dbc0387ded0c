"""Newton-Schulz once per block on a mesh (k3_jax/optim/owned.py): the distributed Muon
update equals the one-device update on 8 CPU devices in several meshes (per-head,
per-expert and plain groups, stacked layers, stacks padded to the shard count), the
compiled program's Newton-Schulz FLOPs are the static count, and training matches."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as Dims

import configs
from k3_jax import train
from k3_jax.optim.muon import ADAMW, orthogonalize, param_group
from k3_jax.optim.owned import orthogonalize_owned, plan, stacked_flops
from pod import roofline
from sharding.mesh import make_mesh, parse_mesh
from sharding.rules import logical_to_spec, tree_shardings
from tests.optim.test_muon import _rand_like, _sample_params

MESHES = (("fsdp:8", None), ("fsdp:4,expert:2", None), ("data:2,fsdp:2,expert:2", None),
          ("data:2,fsdp:4", 2))                       # the last: 2 fake slices x 4 devices


def _mesh(spec, slices=None):
  return make_mesh(parse_mesh(spec), devices=jax.devices()[:8], slices=slices)


@pytest.mark.parametrize("shape,dims,spec,placed", [
    # 5 blocks over fsdp x expert (4 shards), split again over the data copies: padded to 8
    ((5, 64, 32), Dims(1, 2), P(None, ("fsdp", "expert"), None), (8, 1, ("data",))),
    # per-head [L, in, H, out]: 18 blocks, 2 fsdp shards x 4 copies (data, expert): 24
    ((3, 32, 6, 16), Dims(1, 3), P(None, "fsdp", None, None), (24, 3, ("data", "expert"))),
    # per-expert [L, E, in, out], experts over expert, both matrix axes split: no copies
    ((2, 4, 24, 48), Dims(2, 3), P(None, "expert", "fsdp", "data"), (4, 1, ())),
])
def test_orthogonalize_owned_equals_replicated(shape, dims, spec, placed):
  """Blocks whole on one chip, padded stacks, matrix axes split over one or two mesh axes,
  copies over the axes the parameter does not use: the same blocks as one device's."""
  mesh = _mesh("data:2,fsdp:2,expert:2")
  x = jax.random.normal(jax.random.key(0), shape)
  want = jax.jit(lambda x: orthogonalize(x, dims))(x)
  got = jax.jit(lambda x: orthogonalize_owned(x, dims, spec, mesh))(
      jax.device_put(x, NamedSharding(mesh, spec)))
  assert got.sharding.spec == spec
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
  p = plan(shape, (dims.reduction_axis,), (dims.output_axis,), spec, mesh)
  assert (p.padded, p.per_chip, p.copies) == placed


def _update_fn(opt):
  def step(p, g):
    u, _ = opt.update(g, opt.init(p), p)
    return optax.apply_updates(p, u)
  return step


_TC = dataclasses.replace(configs.get_train("k3_tiny"), optimizer="muon", steps=10)


@functools.lru_cache(maxsize=None)
def _single():
  """(params, gradients, the one-device Muon + AdamW step's result)."""
  params = _sample_params()
  grads = _rand_like(params, 3)
  return params, grads, jax.jit(_update_fn(train.make_optimizer(_TC)))(params, grads)


@pytest.mark.parametrize("spec,slices", MESHES)
def test_owned_muon_update_equals_single_device(spec, slices):
  """A Per-Head Muon + AdamW step on k3_tiny parameters of every group (per-head q/k/v
  and kv_b, per-expert w_down, plain router / o_proj, stacked and not), the state sharded
  as build_steps shards it, Newton-Schulz owned: equal to the one-device step to f32
  summation order; the compiled program exchanges blocks by all-to-all."""
  params, grads, single = _single()
  mesh = _mesh(spec, slices)
  sh = tree_shardings(params, mesh)
  put = lambda t: jax.device_put(t, sh)
  fn = jax.jit(_update_fn(train.make_optimizer(_TC, mesh)), in_shardings=(sh, sh),
               out_shardings=sh)
  compiled = fn.lower(put(params), put(grads)).compile()
  assert "all-to-all" in compiled.as_text()
  owned = compiled(put(params), put(grads))
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(owned)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


def test_owned_newton_schulz_flops_are_the_static_count():
  """The compiled owned update's matmul FLOPs per device (the roofline's count: only
  Newton-Schulz has matmuls) equal `stacked_flops` from the shapes and specs, and are
  below the partitioner's placement of the same update."""
  params = _sample_params()
  mesh = _mesh("fsdp:8")
  sh = tree_shardings(params, mesh)
  counted = {}
  for placement in ("owned", "sharded"):
    tc = dataclasses.replace(configs.get_train("k3_tiny"), optimizer="muon",
                             muon_placement=placement)
    opt = train.make_optimizer(tc, mesh)
    fn = jax.jit(lambda g, s, p: opt.update(g, s, p)[0], in_shardings=(sh, None, sh))
    state = jax.eval_shape(opt.init, params)
    text = fn.lower(params, state, params).compile().as_text()
    counted[placement] = roofline.program_costs(text).flops
  shapes, dims, specs = [], [], []
  for v in jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "get_metadata")):
    g = param_group(v)
    if g.group != ADAMW:
      shapes.append(tuple(v.shape))
      dims.append(g.dims)
      specs.append(logical_to_spec(tuple(v.shape), v.get_metadata()["logical_axes"], mesh))
  assert counted["owned"] == pytest.approx(stacked_flops(shapes, dims, specs, mesh), rel=1e-6)
  assert counted["owned"] < counted["sharded"]


@pytest.mark.slow
def test_owned_training_matches_partitioner_placement():
  """Three k3_tiny train steps on fsdp:8 with owned Newton-Schulz and with the placement
  left to the partitioner (the optimizer before owned.py): the same losses and weights."""
  from k3_jax.data import mqar
  cfg = configs.get("k3_tiny")
  it = mqar.mqar_dataset(8, 32, cfg.vocab_size, num_kv_pairs=4, seed=1)
  batches = [next(it) for _ in range(3)]
  out = {}
  for placement in ("sharded", "owned"):
    tc = dataclasses.replace(configs.get_train("k3_tiny"), optimizer="muon", batch_size=8,
                             seq_len=32, muon_placement=placement)
    steps = train.build_steps(cfg, tc, _mesh("fsdp:8"))
    state = steps.init()
    losses = []
    for b in batches:
      state, m = steps.train(state, train.put_batch(b, steps.batch_sharding))
      losses.append(float(m["loss"]))
    out[placement] = (losses, jax.tree.leaves(state["params"]))
  np.testing.assert_allclose(out["owned"][0], out["sharded"][0], rtol=1e-5)
  for a, b in zip(out["owned"][1], out["sharded"][1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
