"""The KDA layer on the Pallas backend: backend choice, kernels per shard, parity.

On this CPU host the Pallas kernels run in interpret mode (the layer asks for it whenever the
compile target is not a TPU), inside shard_map on an 8-device CPU mesh, so the same code path
as on a TPU pod is checked numerically against the reference backend on one device.

Tolerance: the chunk kernel and the reference chunk_kda both reassociate the token recurrence
into matmuls (differently), so outputs, the loss and its gradients agree to float32 rounding
amplified by the chunk sums: 1e-4 of the largest reference entry (the bound the reference's
own chunk-vs-recurrent tests use). The mesh does not change any arithmetic (each shard holds
whole sequences and whole heads).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import configs
from k3_jax.layers.init import Init
from k3_jax.layers.kda import KDA
from k3_jax.ops import moe as moe_ops
from k3_jax.ops.kda import resolve_backend
from sharding.kernels import kernel_specs
from sharding.mesh import make_mesh, parse_mesh
from sharding.install import parallel_for
from pod.topology import topology_devices

CFG = configs.get("k3_tiny")
REL = 1e-4


def _cpu_mesh():
  return make_mesh(parse_mesh("data:2,fsdp:2,tensor:2"))


def test_kernel_specs_split_names_alike():
  mesh = _cpu_mesh()
  tok, vec = ("batch", None, "heads", None), ("batch", None, "heads")
  ins, out = kernel_specs(mesh, [(4, 19, 2, 8), (4, 19, 2)], [tok, vec], (tok, vec))
  assert ins == (P(("data", "fsdp"), None, "tensor", None), P(("data", "fsdp"), None, "tensor"))
  assert out == ins
  # A batch of 2 splits over data only (fsdp does not fit after it); 3 heads stay whole.
  ins, out = kernel_specs(mesh, [(2, 5, 3, 8)], [tok], tok)
  assert ins == (P("data", None, None, None),) and out == P("data", None, None, None)


def test_auto_backend_follows_the_compile_target():
  assert configs.get_exec("k3_tiny").kda_backend == "auto"
  assert resolve_backend("auto") == "reference"             # CPU host, no mesh
  assert resolve_backend("auto", parallel_for(_cpu_mesh())) == "reference"
  tpu = parallel_for(make_mesh(parse_mesh("fsdp:4"), devices=topology_devices("v5p:2x2x1")))
  assert tpu.platform == "tpu"
  assert resolve_backend("auto", tpu) == "pallas"
  assert resolve_backend("reference", tpu) == "reference"
  assert resolve_backend("pallas") == "pallas"
  # The MoE grouped matmul follows the same target.
  # On TPU, ragged_dot's weight gradient is the grouped Pallas kernel where one can run.
  assert moe_ops.default_gmm(platform="tpu") is moe_ops.ragged_dot_tpu_gmm
  assert moe_ops.default_gmm(platform="tpu", kernel=False) is moe_ops.ragged_dot_gmm
  assert moe_ops.default_gmm(platform="cpu") is moe_ops.tiled_gmm


def _run(backend: str, mesh):
  """Loss, parameter gradients, a prefill with a cache, then one decode step."""
  layer = KDA(CFG, init=Init(0))
  kernels = dataclasses.replace(configs.get_exec("k3_tiny").kernels, kda_backend=backend)
  b, t = 4, 21                                   # T not a multiple of the chunk (16)
  x = jax.random.normal(jax.random.key(0), (b, t, CFG.d_model), jnp.float32)
  seg = jnp.asarray(np.repeat([[0] * 9 + [1] * 12], b, 0), jnp.int32)  # two documents

  par = parallel_for(mesh, kernels=kernels)

  def f(layer, x, seg, cache):
    def loss(layer):
      y, _ = layer(x, seg, par=par)
      return jnp.sum(y * jnp.sin(y))
    value, grads = nnx.value_and_grad(loss)(layer)
    y_pre, cache = layer(x[:, :-1], cache=cache, par=par)
    y_dec, cache = layer(x[:, -1:], cache=cache, par=par)
    return value, nnx.state(grads), y_pre, y_dec, cache.state

  return nnx.jit(f)(layer, x, seg, layer.init_cache(b))


@pytest.mark.slow   # ~10 s (suite budget); the kernel vs the reference stays in the default
# suite (test_pallas_kda.py, test_pallas_kda_decode.py)
def test_pallas_layer_on_mesh_matches_reference():
  ref = jax.tree.leaves(_run("reference", None))
  got = jax.tree.leaves(_run("pallas", _cpu_mesh()))
  assert len(got) == len(ref)
  for a, r in zip(got, ref):
    r = np.asarray(r, np.float64)
    np.testing.assert_allclose(np.asarray(a, np.float64), r, rtol=0,
                               atol=REL * max(np.max(np.abs(r)), 1e-3))
