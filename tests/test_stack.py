"""The layer stack's plan (k3_jax/stack.py) and every walker that follows it: the model's
modules and variables, its caches (contiguous and paged, and kv_pages' views of them), the
aux rows (MoE router biases, QK-Clip's MLA layers), the released checkpoint layouts' layer
walk and compile's cache shardings visit the same layers in the same order as the plan.

Each preset keeps its layer structure (depth, MLA and dense layers, scan period, AttnRes)
with small widths, so its abstract model and checkpoint layout are cheap; the plan is
checked to be the preset's own. Abstract shapes only: nothing is compiled except the one
tiny forward that checks the aux rows' order."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax import compile as compile_mod
from k3_jax import stack
from k3_jax.cache import KDAState, MLACache, ModelCache, PagedMLACache
from k3_jax.checkpoint import layouts
from k3_jax.config import validate
from k3_jax.model import DecoderLayer, abstract_model, create_model
from k3_jax.optim.qk_clip import mla_layers
from k3_jax.serve import kv_pages as kv
from sharding.mesh import make_mesh, parse_mesh


def _small(cfg):
  """cfg's layer structure with small widths (its released layout stays expressible)."""
  k, m, e = cfg.kda, cfg.mla, cfg.moe
  return validate(dataclasses.replace(
      cfg, vocab_size=128, d_model=64, dense_intermediate=64, vision=None,
      kda=dataclasses.replace(k, num_heads=2, head_dim=8, gate_rank=8 if k.gate_rank else 0,
                              decay_rank=8 if k.decay_rank else 0),
      mla=dataclasses.replace(m, num_heads=2, q_lora_rank=16 if m.q_lora_rank else 0,
                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=8),
      moe=dataclasses.replace(e, num_experts=4, top_k=2, n_group=1, topk_group=1,
                              expert_intermediate=32, latent_dim=32 if e.latent_dim else 0,
                              qb_bins=0)))


# The presets, and two layouts no preset has: no scanned unit, and nothing unscanned.
EXTRA = {"no_units": dict(num_layers=3, mla_layers=(3,), dense_layers=(1,)),
         "all_units": dict(num_layers=8, mla_layers=(4, 8), dense_layers=())}
NAMES = configs.PRESETS + tuple(EXTRA)


@functools.lru_cache(maxsize=None)
def _cfg(name):
  if name in EXTRA:
    return _small(dataclasses.replace(configs.get("k3_tiny"), name=name, **EXTRA[name]))
  return _small(configs.get(name))


@functools.lru_cache(maxsize=None)
def _model(name):
  return abstract_model(_cfg(name))


@pytest.mark.parametrize("name", configs.PRESETS)
def test_small_config_keeps_the_preset_plan(name):
  assert stack.plan_of(_cfg(name)).layers == stack.plan_of(configs.get(name)).layers


@pytest.mark.parametrize("name", NAMES)
def test_plan_spells_out_the_layout(name):
  cfg = _cfg(name)
  plan = stack.plan_of(cfg)
  prefix, reps, period = cfg.stack_plan()
  assert (plan.prefix, plan.repeats, plan.period) == (prefix, reps, period)
  assert [l.index for l in plan.layers] == list(range(cfg.num_layers))
  assert [(l.mixer, l.ffn) for l in plan.layers] == list(cfg.layer_kinds())
  assert plan.slots == plan.group("prefix") + plan.group("units") + plan.group("suffix")
  assert len(plan.group("prefix")) == prefix and len(plan.unit) == (period if reps else 0)
  for g in stack.GROUPS:
    assert [s.position for s in plan.group(g)] == list(range(len(plan.group(g))))
  for l in plan.layers:
    slot = plan.group(l.group)[l.position]
    assert (slot.mixer, slot.ffn, slot.rows) == (l.mixer, l.ffn, l.rows)
    if l.scanned:
      assert l.index == prefix + l.row * period + l.position and l.rows == reps
      assert l.path == ("units", "layers", l.position) and l.lead == (l.row,)
      assert l.batch_axis == 1
    else:
      assert l.row == 0 and l.rows == 1 and l.lead == () and l.batch_axis == 0
      assert l.path == (l.group, l.position)
  assert stack.plan_of(cfg) is plan                      # cached per config


@pytest.mark.parametrize("name", NAMES)
def test_param_walker_visits_every_decoder_layer(name):
  cfg, model = _cfg(name), _model(name)
  plan = stack.plan_of(cfg)
  mods = plan.modules(model)
  assert [s for s, _ in mods] == list(plan.slots)
  for spec, layer in mods:
    assert isinstance(layer, DecoderLayer)
    assert (layer.mixer_kind, layer.ffn_kind) == (spec.mixer, spec.ffn)
    leaves = jax.tree.leaves(nnx.state(layer, nnx.Param))
    assert leaves and all(a.shape[:len(spec.lead)] == ((spec.rows,) if spec.scanned else ())
                          for a in leaves)
  # the model holds no decoder layer the plan does not name
  paths = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model))}
  layer_paths = {p[:3] if p[0] == "units" else p[:2] for p in paths
                 if p[0] in stack.GROUPS}
  assert layer_paths == {s.path for s in plan.slots}


@pytest.mark.parametrize("name", NAMES)
def test_aux_walkers_follow_the_plan(name):
  """The MoE layers (router biases, aux 'expert_load' / 'new_bias' rows) and QK-Clip's MLA
  layers (aux 'max_logit' rows): the plan's slots in order, `rows` rows each."""
  cfg, model = _cfg(name), _model(name)
  plan = stack.plan_of(cfg)
  kinds = cfg.layer_kinds()
  moe = model.moe_layers()
  assert [(id(m), r) for m, r in moe] == [(id(plan.module(model, s).ffn), s.rows)
                                          for s in plan.moe_slots()]
  mla = mla_layers(model)
  assert [(id(m), r) for m, r in mla] == [(id(plan.module(model, s).mixer), s.rows)
                                          for s in plan.mla_slots()]
  assert plan.moe_rows == sum(f == "moe" for _, f in kinds) == sum(r for _, r in moe)
  assert plan.mla_rows == len(cfg.mla_layers) == sum(r for _, r in mla)
  spans = list(plan.row_spans(plan.moe_slots()))
  assert [r0 for _, r0, _ in spans] == list(np.cumsum([0] + [s.rows for s in
                                                             plan.moe_slots()])[:-1])
  # the forward's aux rows (traced abstractly)
  graphdef, state = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
  aux = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t, train=True)[2], state, tokens)
  if plan.moe_rows:
    assert aux["expert_load"].shape[0] == aux["new_bias"].shape[0] == plan.moe_rows
  assert aux["max_logit"].shape[0] == plan.mla_rows


def test_aux_rows_are_in_router_bias_order():
  """A real forward: with balance "none" the new biases are the biases, so aux['new_bias']
  lists every MoE layer's bias in the order set_router_biases writes them (the plan's)."""
  small = _cfg("k3_tiny")          # 1 unscanned, 2 units of [KDA, MLA], 2 unscanned
  cfg = validate(dataclasses.replace(small, num_layers=7, mla_layers=(3, 5, 6), scan_period=2,
                                     moe=dataclasses.replace(small.moe, balance="none")))
  model = create_model(cfg, seed=0)
  plan = stack.plan_of(cfg)
  assert (plan.prefix, plan.repeats, len(plan.group("suffix"))) == (1, 2, 2)
  e = cfg.moe.num_experts
  want = jnp.arange(plan.moe_rows * e, dtype=jnp.float32).reshape(plan.moe_rows, e)
  model.set_router_biases(want)
  aux = nnx.jit(lambda m, t: m(t, train=True)[2])(model, jnp.zeros((1, 4), jnp.int32))
  np.testing.assert_array_equal(aux["new_bias"], want)
  for spec, row, rows in plan.row_spans(plan.moe_slots()):
    bias = plan.module(model, spec).ffn.bias[...]
    np.testing.assert_array_equal(bias.reshape(rows, e), want[row:row + rows])


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_layout_walks_the_plan(name):
  """Every released tensor of layer i reads the variables of plan.layers[i]: its path and
  leading (stacked row) index."""
  cfg = _cfg(name)
  plan = stack.plan_of(cfg)
  seen = set()
  for entry in layouts.for_config(cfg).entries(cfg):
    m = re.search(r"model\.layers\.(\d+)\.", entry.tensors[0].name)
    if m is None:
      assert entry.path[0] not in stack.GROUPS, entry
      continue
    spec = plan.layers[int(m.group(1))]
    assert entry.path[:len(spec.path)] == spec.path, (entry, spec)
    assert entry.index[:len(spec.lead)] == spec.lead, (entry, spec)
    seen.add(spec.index)
  assert seen == set(range(cfg.num_layers))


def _entry_shapes(e):
  return [a.shape for a in jax.tree.leaves(e)]


@pytest.mark.parametrize("name", NAMES)
def test_cache_walkers_follow_the_plan(name):
  cfg, model = _cfg(name), _model(name)
  plan = stack.plan_of(cfg)
  cache = jax.eval_shape(lambda: model.init_cache(2, 16))
  assert isinstance(cache, ModelCache) and cache.pos.shape == ()
  assert (cache.units is None) == (plan.repeats == 0)
  entries = plan.cache_entries(cache)
  assert [s for s, _ in entries] == list(plan.slots)
  assert stack.cache_leaves(cache) == [e for _, e in entries]
  for spec, e in entries:
    assert isinstance(e, KDAState if spec.mixer == "kda" else MLACache)
    lead = (plan.repeats,) if spec.scanned else ()
    for shape in _entry_shapes(e):
      assert shape[:len(lead)] == lead and shape[spec.batch_axis] == 2
    if spec.mixer == "mla":
      assert e.c_kv.shape[spec.batch_axis + MLACache.SEQ_AXIS] == 16
  # map_cache visits the entries in slot order, with their batch axes
  visits = []
  stack.map_cache(lambda e, axis: visits.append((e, axis)) or e, cache)
  assert visits == [(e, s.batch_axis) for s, e in entries]
  # compile's shardings: batch over the batch's mesh axes at each entry's batch axis, and
  # the MLA latents' length over those the batch of 2 leaves (tests/sharding/test_mesh.py)
  mesh = make_mesh(parse_mesh("fsdp:2,expert:4"), jax.devices()[:8])
  sh = compile_mod.cache_shardings(cache, mesh)
  assert sh.pos.spec == jax.sharding.PartitionSpec()
  for (spec, e), (_, s) in zip(entries, plan.cache_entries(sh)):
    for a, leaf_sh in zip(jax.tree.leaves(e), jax.tree.leaves(s)):
      want = [None] * a.ndim
      want[spec.batch_axis] = "fsdp"
      if isinstance(e, MLACache):
        want[spec.batch_axis + 1] = "expert"
      assert tuple(leaf_sh.spec) + (None,) * (a.ndim - len(leaf_sh.spec)) == tuple(want)


@pytest.mark.parametrize("name", NAMES)
def test_paged_cache_and_kv_pages_follow_the_plan(name):
  cfg, model = _cfg(name), _model(name)
  plan = stack.plan_of(cfg)
  cache = jax.eval_shape(lambda: model.init_paged_cache(2, 5, 8))
  assert cache.pos.shape == (2,)
  for spec, e in plan.cache_entries(cache):
    lead = (plan.repeats,) if spec.scanned else ()
    if spec.mixer == "kda":
      assert isinstance(e, KDAState) and e.state.shape[spec.batch_axis] == 2
    else:
      assert isinstance(e, PagedMLACache) and e.page_table is None
      assert e.c_kv.shape == lead + (5, 8, cfg.mla.kv_lora_rank)

  table = jax.ShapeDtypeStruct((2, 3), jnp.int32)
  paged = jax.eval_shape(kv.with_pages, cache, cache.pos, table)
  for spec, e in plan.cache_entries(paged):
    if spec.mixer == "mla":
      lead = (plan.repeats,) if spec.scanned else ()
      assert e.page_table.shape == lead + (2, 3)
  back = jax.eval_shape(kv.without_pages, paged)
  assert jax.tree.structure(back) == jax.tree.structure(cache)

  states = kv.kda_states(cache)
  assert states.pos is None
  assert [e is None for _, e in plan.cache_entries(states)] == [
      s.mixer == "mla" for s in plan.slots]
  one = jax.eval_shape(kv.take_rows, states, jnp.zeros((1,), jnp.int32))
  zero = jax.eval_shape(lambda s: kv.zeros_rows(s, 1), states)
  for (spec, e), (_, z) in zip(plan.cache_entries(one), plan.cache_entries(zero)):
    if e is not None:
      assert all(s[spec.batch_axis] == 1 for s in _entry_shapes(e))
      assert _entry_shapes(e) == _entry_shapes(z)
  put = jax.eval_shape(kv.put_rows, states, jnp.zeros((1,), jnp.int32), one)
  assert jax.tree.structure(put) == jax.tree.structure(states)
  merged = jax.eval_shape(kv.with_kda_states, cache, put)
  assert jax.tree.structure(merged) == jax.tree.structure(cache)


@pytest.mark.parametrize("name", ["k3_tiny", "no_units"])   # scanned and unscanned KDA entries
def test_put_slots_writes_active_rows_and_leaves_padding_rows_alone(name):
  """kv.put_slots (the verify step's write-back) equals put_rows of the active rows alone,
  with an idle padding row that repeats an active row's slot changing nothing, on every
  KDA entry's batch axis (scanned layers' included)."""
  fill = lambda t, seed: jax.tree.map(
      lambda a: jnp.asarray(np.random.default_rng(seed).normal(size=a.shape), a.dtype), t)
  states = fill(kv.kda_states(_model(name).init_paged_cache(3, 5, 8)), 0)
  values = fill(kv.take_rows(states, jnp.asarray([0, 1, 2], jnp.int32)), 1)
  got = kv.put_slots(states, jnp.asarray([2, 0, 2], jnp.int32),
                     jnp.asarray([True, True, False]), values)
  want = kv.put_rows(states, jnp.asarray([2, 0], jnp.int32),
                     kv.take_rows(values, jnp.asarray([0, 1], jnp.int32)))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
