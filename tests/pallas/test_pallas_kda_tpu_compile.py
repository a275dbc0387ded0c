"""The Pallas KDA backend compiles for TPU from this CPU host (compile-only libtpu devices).

What is checked: with the kda_backend kernel choice "auto" (resolved from the compile target, not from the
host) or "pallas", the KDA layer lowers to Mosaic kernels (forward, backward, decode) that
run per shard inside shard_map on a TPU mesh, and libtpu compiles the program. The default
suite compiles one KDA layer (forward + gradient, and a decode step); the slow test compiles
the whole k3_tiny train step, where the MoE layers must also pick the TPU grouped matmul
(ragged_dot), not the CPU one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import configs
from k3_jax import train
from k3_jax.cache import KDAState
from k3_jax.layers.init import Init
from k3_jax.layers.kda import KDA
from sharding.mesh import make_mesh, parse_mesh
from sharding.install import parallel_for
from pod.topology import topology_devices

TOPOLOGY = "v5p:2x2x1"        # 4 chips: batch over data, heads over tensor
MESH = "data:2,tensor:2"


@pytest.fixture(scope="module")
def tpu_mesh():
  return make_mesh(parse_mesh(MESH), devices=topology_devices(TOPOLOGY))


def _kernel_calls(text: str) -> int:
  return text.count("tpu_custom_call")


def test_kda_layer_compiles_for_tpu(tpu_mesh):
  cfg = configs.get("k3_tiny")
  kernels = configs.get_exec("k3_tiny").kernels          # chunks of 16
  assert kernels.kda_backend == "auto"
  gd, params = nnx.split(nnx.eval_shape(lambda: KDA(cfg, init=Init(0, mode="abstract"))))
  rep = NamedSharding(tpu_mesh, PartitionSpec())
  by_batch = NamedSharding(tpu_mesh, PartitionSpec("data"))
  ps = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), params)
  b, t, d = 4, 40, cfg.d_model             # T not a multiple of the chunk (16): padded
  x = jax.ShapeDtypeStruct((b, t, d), jnp.float32, sharding=by_batch)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=by_batch)

  par = parallel_for(tpu_mesh, kernels=kernels)

  def loss_and_grad(params, x, seg):
    def loss(p):
      y, _ = nnx.merge(gd, p)(x, seg, par=par)
      return jnp.sum(jnp.square(y.astype(jnp.float32)))
    return jax.value_and_grad(loss)(params)

  lowered = jax.jit(loss_and_grad).lower(ps, x, seg)
  text = lowered.as_text()
  # Forward and backward kernels, each inside shard_map (a manual computation).
  assert _kernel_calls(text) >= 2
  assert "manual_computation" in text or "shard_map" in text
  compiled = lowered.compile()
  assert compiled.memory_analysis().argument_size_in_bytes > 0

  h, k = cfg.kda.num_heads, cfg.kda.head_dim
  conv = jax.ShapeDtypeStruct((b, cfg.kda.conv_size - 1, h * k), jnp.float32,
                              sharding=by_batch)
  cache = KDAState(state=jax.ShapeDtypeStruct((b, h, k, k), jnp.float32, sharding=by_batch),
                   conv_q=conv, conv_k=conv, conv_v=conv)

  def decode(params, x, cache):
    return nnx.merge(gd, params)(x, cache=cache, par=par)

  tok = jax.ShapeDtypeStruct((b, 1, d), jnp.float32, sharding=by_batch)
  lowered = jax.jit(decode, donate_argnums=(2,)).lower(ps, tok, cache)
  text = lowered.as_text()
  assert _kernel_calls(text) == 1 and "kda_decode_step" in text
  lowered.compile()


@pytest.mark.slow
def test_k3_tiny_train_step_compiles_for_tpu_with_pallas(tpu_mesh):
  """The whole train step (13 layers, MoE, AttnRes, AdamW) for a v5p slice. Minutes on CPU."""
  cfg = configs.get("k3_tiny")
  run = dataclasses.replace(configs.get_exec("k3_tiny"), kda_backend="pallas")
  tc = configs.get_train("k3_tiny")
  steps = train.build_steps(cfg, tc, tpu_mesh, run)
  batch = {n: jax.ShapeDtypeStruct((tc.batch_size, tc.seq_len), jnp.int32)
           for n in ("inputs", "targets", "segment_ids", "loss_mask")}
  lowered = steps.train.lower(steps.abstract_state, batch)
  text = lowered.as_text()
  assert _kernel_calls(text) >= 2
  # The compile target (TPU), not the CPU host, picks the MoE grouped matmul.
  assert "ragged_dot" in text
  compiled = lowered.compile()
  assert compiled.memory_analysis().temp_size_in_bytes >= 0
