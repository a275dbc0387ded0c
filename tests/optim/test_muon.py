"""Per-Head Muon: Newton-Schulz, per-head / per-expert orthogonalization, the Moonlight
scale, the parameter groups of k3_tiny, and the sharded optimizer step."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import configs
from k3_jax import train
from k3_jax.layers.init import Init
from k3_jax.layers.linear import Linear
from k3_jax.layers.moe import RouterBias
from k3_jax.layers.norm import RMSNorm
from k3_jax.model import create_model
from k3_jax.optim.muon import (ADAMW, MUON, NS_COEFFS, PER_EXPERT, PER_HEAD, newton_schulz,
                               orthogonalize, param_group, param_groups, per_head_muon)
from sharding.mesh import make_mesh, parse_mesh
from sharding.rules import tree_shardings

CFG = configs.get("k3_tiny")
# 5 quintic steps leave the singular values of a well-conditioned matrix oscillating in
# about [0.68, 1.13] (the coefficients maximise the slope at 0 instead of converging).
SV_LO, SV_HI = 0.6, 1.25


@pytest.mark.parametrize("shape", [(96, 24), (24, 96), (3, 40, 24), (2, 3, 24, 40)])
def test_newton_schulz_singular_values_near_one(shape):
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 3.0
  y = newton_schulz(x)
  assert y.shape == x.shape
  s = np.linalg.svd(np.asarray(y), compute_uv=False)
  assert s.min() > SV_LO and s.max() < SV_HI, (s.min(), s.max())
  # Same singular vectors as x: U^T y V is diagonal (y = U f(S) V^T).
  u, _, vt = np.linalg.svd(np.asarray(x), full_matrices=False)
  core = np.swapaxes(u, -1, -2) @ np.asarray(y) @ np.swapaxes(vt, -1, -2)
  off = core - np.einsum("...ii->...i", core)[..., None] * np.eye(core.shape[-1])
  assert np.abs(off).max() < 1e-4


def test_orthogonalize_equals_optax_flattened_batch():
  """`orthogonalize` keeps the batch axes in place (and loops over the first) instead of
  flattening them as optax does; the blocks and the math are the same. f32 throughout; ours
  normalises with eps 1e-7 vs optax's 1e-8, far below the 1e-5 tolerance."""
  from optax.contrib import MuonDimensionNumbers
  from optax.contrib._muon import orthogonalize_via_newton_schulz
  x = jax.random.normal(jax.random.key(0), (3, 4, 24, 5, 16))      # [L, E, in, H, out]
  for dims in (MuonDimensionNumbers(reduction_axis=2, output_axis=4),
               MuonDimensionNumbers(reduction_axis=(2, 3), output_axis=(4,)),
               MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=(3, 4))):
    want = orthogonalize_via_newton_schulz(x, jnp.asarray(NS_COEFFS), 5,
                                           dimension_numbers=dims)
    np.testing.assert_allclose(orthogonalize(x, dims), want, rtol=1e-5, atol=1e-5)


def test_newton_schulz_batch_axes_are_independent():
  x = jax.random.normal(jax.random.key(1), (4, 16, 24))
  y = newton_schulz(x)
  for i in range(4):
    np.testing.assert_allclose(y[i], newton_schulz(x[i]), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="ndim >= 2"):
    newton_schulz(jnp.ones((5,)))


class _Heads(nnx.Module):
  """A per-head projection, the same weight layout without per-head metadata, a norm."""

  def __init__(self):
    init = Init(0)
    self.q = Linear(32, (4, 8), ("embed", "heads", "head_dim"), init=init,
                    batch_axes=("heads",))
    self.g = Linear(32, (4, 8), ("embed", "heads", "head_dim"), init=init)
    self.norm = RMSNorm(32, axis_name="embed")


def _first_update(params, grads, **kw):
  """The first Per-Head Muon update with unit learning rates and no weight decay. At step 1
  the Nesterov momentum is a positive multiple of the gradient and Newton-Schulz is
  scale-invariant, so the update is exactly -0.2 sqrt(max(fan_in, fan_out)) NS(grad)."""
  opt = per_head_muon(1.0, 1.0, weight_decay=0.0, **kw)
  return jax.jit(lambda p, g: opt.update(g, opt.init(p), p)[0])(params, grads)


def _rand_like(params, seed=0):
  leaves, tdef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tdef, [jax.random.normal(k, l.shape) for k, l in zip(keys, leaves)])


def test_per_head_update_orthogonalizes_each_head_alone():
  params = nnx.state(_Heads(), nnx.Param)
  grads = _rand_like(params)
  u = _first_update(params, grads)
  g_q = grads["q"]["w"][...]                                         # [D, H, K]
  # Each head's [D, K] block alone, scaled by 0.2 sqrt(max(32, 8)).
  per_head = -0.2 * np.sqrt(32) * newton_schulz(jnp.transpose(g_q, (1, 0, 2)))
  np.testing.assert_allclose(u["q"]["w"][...], jnp.transpose(per_head, (1, 0, 2)),
                             rtol=1e-4, atol=1e-6)
  # ... which is not the whole [D, H*K] matrix orthogonalized at once.
  whole = (-0.2 * np.sqrt(32) * newton_schulz(g_q.reshape(32, 32))).reshape(32, 4, 8)
  assert np.abs(u["q"]["w"][...] - whole).max() > 0.1 * np.abs(whole).max()
  # The same layout without per-head metadata is the whole-matrix update.
  g_g = grads["g"]["w"][...]
  np.testing.assert_allclose(
      u["g"]["w"][...], (-0.2 * np.sqrt(32) * newton_schulz(g_g.reshape(32, 32))).reshape(
          32, 4, 8), rtol=1e-4, atol=1e-6)
  # The norm gain goes to AdamW: first step -lr * g / (|g| + eps) = -sign(g).
  np.testing.assert_allclose(u["norm"]["weight"][...], -np.sign(grads["norm"]["weight"][...]),
                             rtol=1e-4)


@functools.lru_cache(maxsize=None)
def _tiny_params():
  return nnx.state(create_model(CFG), nnx.Param)


# One parameter of each kind (stacked and not): the optimizer runs on any pytree of
# Variables, and a few leaves compile in seconds where the whole tree takes minutes.
_SAMPLE = ("units/layers/2/mixer/kv_b/w", "units/layers/0/mixer/q_proj/w",
           "prefix/0/mixer/k_proj/w", "units/layers/3/ffn/w_down", "units/layers/3/ffn/router",
           "units/layers/2/mixer/o_proj/w", "embed/table", "units/layers/0/mixer_norm/weight",
           "units/layers/0/mixer/q_conv")


def _sample_params():
  flat = _flat(_tiny_params())
  return {n.replace("/", "."): flat[n] for n in _SAMPLE}


def _flat(tree):
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): v
          for path, v in jax.tree_util.tree_flatten_with_path(
              tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}


def test_stacked_per_head_and_per_expert_blocks_and_update_rms():
  params = _sample_params()
  grads = _rand_like(params, seed=2)
  u, g = _first_update(params, grads), grads
  # Stacked MLA W_kvb [layers, R, H, n + v]: one [R, n + v] block per (layer, head).
  name = "units.layers.2.mixer.kv_b.w"
  gw = jnp.transpose(g[name][...], (0, 2, 1, 3))                     # [L, H, R, C]
  want = -0.2 * np.sqrt(max(gw.shape[-2:])) * newton_schulz(gw)
  np.testing.assert_allclose(u[name][...], jnp.transpose(want, (0, 2, 1, 3)), rtol=1e-4,
                             atol=1e-6)
  # Stacked routed experts [layers, E, in, out]: one block per (layer, expert).
  name = "units.layers.3.ffn.w_down"
  want = -0.2 * np.sqrt(max(g[name].shape[-2:])) * newton_schulz(g[name][...])
  np.testing.assert_allclose(u[name][...], want, rtol=1e-4, atol=1e-6)
  # Update RMS ~ 0.2 (times the unit learning rate) for every Muon parameter: an
  # orthogonal [m, n] block has RMS 1/sqrt(max(m, n)); the quintic's singular values in
  # [0.6, 1.25] bound the RMS to 0.2 * [0.6, 1.25].
  rms = {n: float(jnp.sqrt(jnp.mean(u[n][...] ** 2))) for n in u
         if param_group(params[n]).group != ADAMW}
  assert len(rms) == 6
  bad = {n: r for n, r in rms.items() if not 0.2 * SV_LO <= r <= 0.2 * SV_HI}
  assert not bad, bad
  assert abs(np.median(list(rms.values())) - 0.2) < 0.03


# The intended group of each k3_tiny parameter, written out by what it is (the optimizer
# itself never looks at names: it reads the layers' metadata).
_PER_HEAD = r"mixer/(q_proj|k_proj|v_proj|q_b|kv_b)/w$"
_PER_EXPERT = r"ffn/w_(gate|up|down)$"
_ADAMW = (r"(embed/table|lm_head/w|norm/weight|mixer/(dt_bias|a_log|o_norm|[qkv]_conv)"
          r"|_query/w)$")


def _intended(name: str) -> str:
  if re.search(_PER_HEAD, name):
    return PER_HEAD
  if re.search(_PER_EXPERT, name):
    return PER_EXPERT
  if re.search(_ADAMW, name):
    return ADAMW
  return MUON


def test_every_k3_tiny_parameter_in_its_intended_group():
  _, state = train.abstract_state(CFG, dataclasses.replace(configs.get_train("k3_tiny"),
                                                           optimizer="muon"),
                                  per_head_muon(1e-3, 1e-3))
  rows = param_groups(state["params"])
  assert len(rows) == len(jax.tree.leaves(state["params"]))
  seen = set()
  for name, shape, grp in rows:
    assert grp.group == _intended(name), (name, grp)
    seen.add(grp.group)
    if grp.group == MUON:    # the rest of the matrices: Linear weights and the router
      assert name.endswith("/w") or name.endswith("ffn/router"), name
    stacked = name.startswith("units/")
    lead = ("layers",) if stacked else ()
    if grp.group == PER_HEAD:
      assert grp.batch_axes == lead + ("heads",), (name, grp)
    elif grp.group == PER_EXPERT:
      assert grp.batch_axes == lead + ("experts",), (name, grp)
    elif grp.group == MUON:
      assert grp.batch_axes == lead, (name, grp)
  assert seen == {PER_HEAD, PER_EXPERT, MUON, ADAMW}
  # The QB router bias is state, not a parameter: the optimizer never holds it.
  rest = state["rest"]
  biases = [v for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
            if isinstance(v, RouterBias)]
  assert biases and not any(isinstance(v, RouterBias) for v in jax.tree.leaves(
      state["opt_state"], is_leaf=lambda x: isinstance(x, nnx.Variable)))


def test_sharded_optimizer_step_equals_single_device():
  """Two Muon + AdamW updates of k3_tiny parameters of every kind with the state
  fsdp-sharded over 8 CPU devices (as build_steps shards it) equal the single-device ones
  (the whole train step: the slow test below)."""
  params = _sample_params()
  tc = dataclasses.replace(configs.get_train("k3_tiny"), optimizer="muon", steps=10)
  opt = train.make_optimizer(tc)
  g1, g2 = _rand_like(params, 3), _rand_like(params, 4)

  def two_steps(p, a, b):
    s = opt.init(p)
    for g in (a, b):
      u, s = opt.update(g, s, p)
      p = optax.apply_updates(p, u)
    return p

  single = jax.jit(two_steps)(params, g1, g2)
  mesh = make_mesh(parse_mesh("fsdp:8"), devices=jax.devices()[:8])
  sh = tree_shardings(params, mesh)
  put = lambda t: jax.device_put(t, sh)
  sharded = jax.jit(two_steps, in_shardings=(sh, sh, sh), out_shardings=sh)(
      put(params), put(g1), put(g2))
  table = sharded["embed.table"][...]
  assert len(table.sharding.device_set) == 8 and not table.sharding.is_fully_replicated
  # Same math, different reduction order across devices; Adam's division by sqrt(v) turns
  # ~1e-7 noise in tiny gradients into ~1e-6 differences, hence the absolute tolerance.
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_sharded_muon_train_step_equals_single_device():
  """The whole jit train step with Per-Head Muon and QK-Clip: data:2,fsdp:4 vs one device."""
  from k3_jax.data import mqar
  tc = dataclasses.replace(configs.get_train("k3_tiny"), optimizer="muon", batch_size=8,
                           seq_len=32)
  it = mqar.mqar_dataset(8, 32, CFG.vocab_size, num_kv_pairs=4, seed=1)
  batches = [next(it) for _ in range(2)]
  out = []
  for spec, devices in (("", jax.devices()[:1]), ("data:2,fsdp:4", jax.devices()[:8])):
    steps = train.build_steps(CFG, tc, make_mesh(parse_mesh(spec), devices=devices))
    state = steps.init()
    losses = []
    for b in batches:
      state, m = steps.train(state, train.put_batch(b, steps.batch_sharding))
      losses.append(float(m["loss"]))
    out.append((losses, jax.tree.leaves((state["params"], state["rest"]))))
  np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5)
  for a, b in zip(out[0][1], out[1][1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
