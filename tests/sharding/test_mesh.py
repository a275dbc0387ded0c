"""Meshes from flags, validated against devices and the model config; TPU device order
(single slice and multi-slice) on compile-only devices; Cloud TPU names."""

import jax
import pytest

import configs
from k3_jax.config import ConfigError
from sharding.mesh import make_mesh, mesh_shape, num_slices, parse_mesh, validate_mesh
from sharding.rules import logical_to_spec
from pod.topology import resolve_target, topology_devices

K3 = configs.get("k3")


def test_parse_and_shape():
  assert mesh_shape(parse_mesh("fsdp:256,expert:8"), 2048) == (1, 256, 8, 1, 1)
  assert mesh_shape(parse_mesh("fsdp:-1,expert:8"), 2048) == (1, 256, 8, 1, 1)
  assert mesh_shape(parse_mesh(""), 8) == (1, 8, 1, 1, 1)          # default: fsdp over all
  with pytest.raises(ConfigError, match="given twice"):
    parse_mesh("fsdp:2,fsdp:4")
  with pytest.raises(ConfigError, match="needs 16 devices, but 8"):
    mesh_shape(parse_mesh("fsdp:4,expert:4"), 8)
  with pytest.raises(ConfigError, match="not divisible by the fixed"):
    mesh_shape(parse_mesh("fsdp:-1,expert:3"), 8)


def test_validate_names_the_field_and_axis():
  validate_mesh(K3, {"fsdp": 256, "expert": 8}, global_batch=2048, seq_len=8192)
  with pytest.raises(ConfigError, match="moe.num_experts=896 is not divisible by mesh expert "
                                        "axis 6"):
    validate_mesh(K3, {"fsdp": 2, "expert": 6})
  with pytest.raises(ConfigError, match="kda.num_heads=96 is not divisible by mesh tensor axis 64"):
    validate_mesh(K3, {"tensor": 64})
  with pytest.raises(ConfigError, match="d_model=7168 is not divisible by mesh fsdp axis 2048"):
    validate_mesh(K3, {"fsdp": 2048})
  with pytest.raises(ConfigError, match="global batch=100 .* fsdp:256\\*expert:8 = 2048"):
    validate_mesh(K3, {"fsdp": 256, "expert": 8}, global_batch=100)
  with pytest.raises(ConfigError, match="seq_len=1000 .* sequence axis 16"):
    validate_mesh(K3, {"fsdp": 16, "sequence": 16}, seq_len=1000)


def test_rules_shard_params_and_batch():
  mesh = make_mesh(parse_mesh("data:2,fsdp:2,expert:2"))
  # parameters: experts over expert, their model dim over fsdp
  assert logical_to_spec((8, 16, 4), ("experts", "expert_embed", "expert_mlp"), mesh) == \
      jax.sharding.PartitionSpec("expert", "fsdp", None)
  # activations: the batch over data, fsdp and expert; embed then stays whole
  assert logical_to_spec((8, 4, 16), ("batch", "seq", "embed"), mesh) == \
      jax.sharding.PartitionSpec(("data", "fsdp", "expert"), None, None)
  mesh = make_mesh(parse_mesh("fsdp:2,sequence:2,tensor:2"))
  assert logical_to_spec((4, 8, 6, 3), ("batch", "seq", "heads", "head_dim"), mesh) == \
      jax.sharding.PartitionSpec("fsdp", "sequence", "tensor", None)


def test_cloud_names():
  t = resolve_target("v5p-4096")
  assert (t.topology, t.chips, t.chip_hbm_bytes) == ("v5p:8x16x16", 2048, 95 * 2 ** 30)
  assert resolve_target("v5p-128").chips == 64
  assert resolve_target("v5e-256").topology == "v5e:16x16"
  assert resolve_target("v6e-256").chips == 256
  assert resolve_target("v5p:4x4x8").chips == 128
  t = resolve_target("2*v5p-128")
  assert (t.num_slices, t.chips) == (2, 128)
  with pytest.raises(ValueError, match="v5p-4096"):
    resolve_target("v5p-100")


def test_tpu_single_slice_mesh_is_topology_ordered():
  devs = topology_devices("v5p:4x4x4")                        # 64 compile-only chips
  mesh = make_mesh(parse_mesh("fsdp:16,expert:4"), devs)
  assert mesh.devices.shape == (1, 16, 4, 1, 1) and mesh.devices.size == 64
  # each expert group (innermost axis) is 4 physically adjacent chips: a ring in one row
  for row in mesh.devices.reshape(16, 4):
    coords = [tuple(d.coords) for d in row]
    assert len({c[:2] for c in coords}) == 1 or len({c[1:] for c in coords}) == 1 or \
        len({(c[0], c[2]) for c in coords}) == 1, coords


def test_tpu_multi_slice_data_axis_spans_slices():
  devs = topology_devices("v5e:2x2", 2)
  assert num_slices(devs) == 2
  mesh = make_mesh(parse_mesh("data:2,fsdp:-1"), devs)
  for i in range(2):
    assert {d.slice_index for d in mesh.devices[i].ravel()} == {i}
  with pytest.raises(ConfigError, match="data axis spans the slices"):
    make_mesh(parse_mesh("fsdp:-1"), devs)


def test_cache_length_takes_the_axes_a_small_batch_leaves():
  """Serving caches (sharding.arrays.batch_shardings with seq_dim): a batch of 2 on
  fsdp:2,expert:4 takes fsdp; the cache length takes expert (4-way), so a long cache of a
  few sequences is split over the mesh instead of repeated on every expert group. A batch
  that fills the batch axes leaves the length whole, as before."""
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  from sharding.arrays import batch_shardings
  mesh = make_mesh(parse_mesh("fsdp:2,expert:4"), jax.devices()[:8])
  cache = {"pos": jax.ShapeDtypeStruct((), jnp.int32),
           "units": [{"c_kv": jax.ShapeDtypeStruct((3, 2, 1024, 8), jnp.bfloat16),
                      "state": jax.ShapeDtypeStruct((3, 2, 4, 8, 8), jnp.float32)}]}
  bdim = lambda path: None if path[0].key == "pos" else 1
  sdim = lambda path: 2 if path[-1].key == "c_kv" else None
  sh = batch_shardings(cache, mesh, bdim, sdim)
  assert sh["pos"].spec == P()
  assert sh["units"][0]["c_kv"].spec == P(None, "fsdp", "expert", None)
  assert sh["units"][0]["state"].spec == P(None, "fsdp", None, None, None)
  full = {"c_kv": jax.ShapeDtypeStruct((3, 8, 1024, 8), jnp.bfloat16)}
  assert (batch_shardings(full, mesh, 1, 2)["c_kv"].spec
          == P(None, ("fsdp", "expert"), None, None))
