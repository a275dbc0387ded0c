"""Sharded initialisation (train.sharded_init, `train --init=sharded`, `compile --step=init`).

What is compared:
- layout: on 8 CPU devices (mesh fsdp:4,expert:2) every leaf of the state the one jitted
  program returns has exactly the target sharding, shape and dtype of the abstract state;
  the program takes nothing but the seed (4 bytes of arguments) and holds no array
  constant (nothing built on the host is baked in); each device's outputs are exactly its
  shards (the compiler's per-device output bytes == aot.shard_bytes of the abstract state).
- values: the same seed gives bitwise the same state, another seed another one; constant
  leaves (norm weights, zeros) equal the numpy host init exactly; random leaves are not
  the numpy init's values (another RNG: jax.random threefry, not numpy PCG64) but the same
  distribution: a normal truncated at 2 standard deviations, so per leaf the mean, the
  standard deviation and the range match the numpy init's (tolerances below).
- the TPU ahead-of-time compile of the same program for v5p-8 reports per-chip outputs
  equal to the expected parameter + optimizer-state shards.
The model is k3_tiny cut to two layers (a scanned unit of KDA + dense FFN, then MLA + MoE),
so every kind of parameter and the vmapped draw of stacked layers are covered while the
XLA:CPU compile stays short. The mesh-independence of the
values (1 device vs 8) is a slow test on the whole k3_tiny.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from k3_jax import train
from k3_jax.compile import compile_step
from k3_jax.config import apply_overrides
from k3_jax.model import create_model
from sharding import aot
from sharding.mesh import make_mesh, parse_mesh
from sharding.topology import resolve_target

CFG = apply_overrides(configs.get("k3_tiny"), ["num_layers=2", "mla_layers=(2,)",
                                               "scan_period=1"])
TC = dataclasses.replace(configs.get_train("k3_tiny"), optimizer="muon")
MESH = "fsdp:4,expert:2"


@pytest.fixture(scope="module")
def built():
  assert CFG.stack_plan()[1] >= 1          # a scanned unit: the vmapped draw is exercised
  steps = train.build_steps(CFG, TC, make_mesh(parse_mesh(MESH)))
  # What `train --init=sharded` runs (train.run's fresh start) ...
  lines = []
  state = train.fresh_state(steps, dataclasses.replace(TC, init="sharded"), lines.append)
  assert "sharded on 8 devices" in lines[0]
  # ... is this program (the jit call above compiled it: lowering and compiling are cached)
  lowered = steps.init_sharded.lower(jnp.int32(0))
  compiled = lowered.compile()
  return steps, lowered, compiled, state


def _leaves(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def test_sharded_init_creates_each_leaf_in_its_sharding(built):
  steps, lowered, compiled, state = built
  got, want = _leaves(state), _leaves(steps.abstract_state)
  assert len(got) == len(want) > 50
  for (path, a), (_, w) in zip(got, want):
    assert (a.shape, a.dtype) == (w.shape, w.dtype), jax.tree_util.keystr(path)
  checked = []

  def same_sharding(path, sh, sub):       # shardings: a prefix tree (one per Variable)
    for a in jax.tree.leaves(sub):
      assert a.sharding == sh, (jax.tree_util.keystr(path), a.sharding, sh)
      checked.append(a)
  jax.tree_util.tree_map_with_path(same_sharding, steps.state_shardings, state,
                                   is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  assert len(checked) == len(got)
  # The parameters really are split: the embedding over fsdp, the experts over expert.
  emb = state["params"]["embed"]["table"][...]
  assert not emb.sharding.is_fully_replicated
  w_up = [a for path, a in got if "w_up" in jax.tree_util.keystr(path)][0]    # [E, L, F]
  assert "expert" in str(w_up.sharding.spec)
  # One program, whose only input is the seed: nothing comes from the host ...
  mem = compiled.memory_analysis()
  assert mem.argument_size_in_bytes == 4
  # ... and no array constant is baked into it (a host-drawn value would be one): every
  # dense constant in the lowered program is a splat (dense<0.0>) or a few scalars.
  text = lowered.as_text()
  blobs = re.findall(r'dense<"0x([0-9A-Fa-f]*)">', text)
  assert max((len(b) // 2 for b in blobs), default=0) <= 64, "a large constant"
  # Each device outputs exactly its shards of the state (XLA:CPU pads nothing), plus the
  # output tuple itself: one 8-byte pointer per leaf.
  expected = aot.shard_bytes(steps.abstract_state, steps.state_shardings)
  assert mem.output_size_in_bytes == expected + 8 * len(got)


def test_sharded_init_is_seeded_and_drawn_as_the_host_init(built):
  _, _, compiled, a = built
  again, other = compiled(jnp.int32(0)), compiled(jnp.int32(1))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(again)):     # deterministic by seed
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The optimizer state does not depend on the drawn values; its moments start at zero.
  for x, z in zip(jax.tree.leaves(a["opt_state"]), jax.tree.leaves(other["opt_state"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(z))
    if x.ndim >= 2:
      assert not np.asarray(x).any()
  _, params, rest = train.split_model(create_model(CFG, seed=0))    # the numpy host init
  n_random = 0
  for (path, x), (_, z), (_, h) in zip(_leaves((a["params"], a["rest"])),
                                       _leaves((other["params"], other["rest"])),
                                       _leaves((params, rest))):
    name = jax.tree_util.keystr(path)
    x, z, h = (np.asarray(v, np.float64) for v in (x, z, h))
    if h.std() == 0:                       # constants (norm weights, biases): the same
      np.testing.assert_array_equal(x, h, err_msg=name)
      np.testing.assert_array_equal(z, h, err_msg=name)
      continue
    n_random += 1
    assert not np.array_equal(x, z), name                      # another seed, other values
    assert not np.array_equal(x, h), name                      # another RNG than numpy's
    n = h.size
    if n < 64:
      continue
    # Same distribution. For n draws of a normal truncated at +-2 sigma (kurtosis 2.36),
    # the standard error of the sample mean is sd/sqrt(n) and of the sample sd about
    # 0.58 sd/sqrt(n); the difference of two independent samples has sqrt(2) x that. Six
    # standard errors: a false alarm has odds below 1e-8 per leaf.
    sd = h.std()
    assert abs(x.mean() - h.mean()) <= 6 * np.sqrt(2) * sd / np.sqrt(n), name
    assert abs(x.std() - sd) <= 6 * np.sqrt(2) * 0.58 * sd / np.sqrt(n), name
    # The support: truncation at 2 sd of the underlying normal puts every value within
    # 2 / 0.8796 = 2.27 sd of the mean (the sd estimated from the host draws, +6 SE).
    bound = 2 / 0.8796256610342398 * sd * (1 + 6 * 0.58 / np.sqrt(n))
    assert np.abs(x - h.mean()).max() <= bound, name
  assert n_random > 20


def test_compile_init_for_tpu_reports_the_state_shards():
  """`compile --step=init`: the TPU compiler's per-chip outputs are the state's shards."""
  rep = compile_step(CFG, TC, resolve_target("v5p-8"), "init", "fsdp:2,expert:2")
  # The only argument is the int32 seed (the TPU pads a scalar to a 512-byte tile).
  assert rep["step"] == "init" and rep["fits"] and rep["argument_bytes"] <= 512
  assert rep["expected_state_bytes_per_chip"] == (rep["expected_params_bytes_per_chip"]
                                                  + rep["expected_opt_state_bytes_per_chip"])
  # The TPU lays arrays out in tiles; tiny arrays are padded, so at this size the outputs
  # are up to a few times the exact bytes (for k3 the two agree within 1%, see README).
  assert rep["expected_state_bytes_per_chip"] <= rep["output_bytes"] \
      <= 8 * rep["expected_state_bytes_per_chip"]
  assert rep["expected_state_bytes_per_chip"] < rep["state_bytes"]       # really split


def test_init_mode_rule():
  abstract = train.abstract_state(CFG, TC, train.make_optimizer(TC))[1]
  cpu = jax.devices()
  assert train.init_mode("auto", abstract, cpu) == "host"          # small, on CPUs
  assert train.init_mode("sharded", abstract, cpu) == "sharded"
  assert train.init_mode("host", abstract, cpu) == "host"
  huge = {"w": jax.ShapeDtypeStruct((train.host_memory_bytes() // 8,), jnp.float32)}
  assert train.init_mode("auto", huge, cpu) == "sharded"            # half the host


@pytest.mark.slow
def test_sharded_init_values_do_not_depend_on_the_mesh():
  """Threefry is partitionable: each device draws its own shard of the same values."""
  cfg, tc = configs.get("k3_tiny"), configs.get_train("k3_tiny")
  one = train.build_steps(cfg, tc, make_mesh(parse_mesh(""), devices=jax.devices()[:1]))
  eight = train.build_steps(cfg, tc, make_mesh(parse_mesh("data:2,fsdp:4")))
  for x, y in zip(jax.tree.leaves(one.init_sharded(jnp.int32(3))),
                  jax.tree.leaves(eight.init_sharded(jnp.int32(3)))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
