"""Sharded initialisation (train.sharded_init, `train --init=sharded`, `compile --step=init`).

What is compared:
- layout: on 8 CPU devices (mesh fsdp:4,expert:2) every leaf of the state the one jitted
  program returns has exactly the target sharding, shape and dtype of the abstract state;
  the program takes nothing but the seed (4 bytes of arguments) and holds no array
  constant (nothing built on the host is baked in); each device's outputs are exactly its
  shards (the compiler's per-device output bytes == arrays.shard_bytes of the abstract state).
- values: the same seed gives bitwise the same state, another seed another one; and bitwise
  the state of the host init (Steps.init: the eager draws of layers/init.py placed into
  the shardings), on 8 devices and on 1 (one counter-based draw per parameter element).
- the TPU ahead-of-time compile of the same program for v5p-8 reports per-chip outputs
  equal to the expected parameter + optimizer-state shards.
The model is k3_tiny cut to two layers (a scanned unit of KDA + dense FFN, then MLA + MoE),
so every kind of parameter and the vmapped draw of stacked layers are covered while the
XLA:CPU compile stays short.
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
from pod.topology import resolve_target
from sharding import arrays
from sharding.mesh import make_mesh, parse_mesh

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
  expected = arrays.shard_bytes(steps.abstract_state, steps.state_shardings)
  assert mem.output_size_in_bytes == expected + 8 * len(got)


def _assert_bitwise_equal(a, b):
  for (path, x), (_, y) in zip(_leaves(a), _leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)), \
        jax.tree_util.keystr(path)


def test_sharded_init_is_seeded_and_equals_the_host_init(built):
  steps, _, compiled, a = built
  again, other = compiled(jnp.int32(0)), compiled(jnp.int32(1))
  _assert_bitwise_equal(a, again)                                   # deterministic by seed
  # The optimizer state does not depend on the drawn values; its moments start at zero.
  for x, z in zip(jax.tree.leaves(a["opt_state"]), jax.tree.leaves(other["opt_state"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(z))
    if x.ndim >= 2:
      assert not np.asarray(x).any()
  n_random = 0
  for (path, x), (_, z) in zip(_leaves(a["params"]), _leaves(other["params"])):
    x, z = np.asarray(x, np.float64), np.asarray(z, np.float64)
    if x.std() > 0:
      n_random += 1
      assert not np.array_equal(x, z), jax.tree_util.keystr(path)   # another seed, others
  assert n_random > 20
  # the host init (drawn eagerly, then placed): bit for bit the same state
  _assert_bitwise_equal(a, steps.init())


def test_init_values_do_not_depend_on_the_devices(built):
  """1 device and 8, the sharded and the host init: one state, bit for bit."""
  _, _, _, eight = built
  one = train.build_steps(CFG, TC, make_mesh(parse_mesh(""), devices=jax.devices()[:1]))
  _assert_bitwise_equal(eight, one.init_sharded(jnp.int32(0)))
  _assert_bitwise_equal(eight, one.init())


def test_compile_init_for_tpu_reports_the_state_shards():
  """`compile --step=init`: the TPU compiler's per-chip outputs are the state's shards."""
  from k3_jax.execution import ExecConfig
  rep = compile_step(CFG, TC, resolve_target("v5p-8"), "init", ExecConfig(mesh="fsdp:2,expert:2"))
  # The only argument is the int32 seed (the TPU pads a scalar to a 512-byte tile).
  assert rep["step"] == "init" and rep["fits"] and rep["argument_bytes"] <= 512
  assert rep["expected_state_bytes_per_chip"] == (rep["expected_params_bytes_per_chip"]
                                                  + rep["expected_opt_state_bytes_per_chip"])
  # The TPU lays arrays out in tiles; tiny arrays are padded, so at this size the outputs
  # are up to a few times the exact bytes (for k3 the two agree within 1%, see docs/pod-scale.md).
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
