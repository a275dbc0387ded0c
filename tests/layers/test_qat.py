"""MXFP4 / MXFP8 routed experts (ops/mx_gmm.py, serve/pack.py, layers/moe.py): QAT forward and its
straight-through gradients, packed serving weights equal to the QAT forward, greedy
generation from packed weights, and the abstract serving-byte count.

k3_tiny with its MoE widths raised to 32 (one MX block along each contraction axis).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax.ops.mx_gmm import EXPERT_WEIGHTS
from k3_jax.serve import pack
from k3_jax.config import ConfigError, apply_overrides, validate
from k3_jax.layers.init import Init
from k3_jax.layers.moe import MoE
from k3_jax.model import create_model
from k3_jax.ops.mx import MXArray
from k3_jax.config import SINGLE_STREAM
from k3_jax.serve.engine import Engine

WIDE = ["moe.latent_dim=32", "moe.expert_intermediate=32"]


def _cfg(qat="none", *extra):
  return validate(apply_overrides(configs.get("k3_tiny"), WIDE + [f"quant.qat={qat}", *extra]))


@functools.lru_cache(maxsize=None)
def layers():
  """The same MoE layer (same initial values) plain and with QAT; a jitted loss+grad."""
  plain = MoE(_cfg(), init=Init(0, "host"))
  qat = MoE(_cfg("mxfp4_mxfp8"), init=Init(0, "host"))
  x = jax.random.normal(jax.random.key(1), (2, 32, 32), jnp.float32)      # [B, T, D]

  def loss(g, p, r, x):
    y, _ = nnx.merge(g, p, r)(x)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

  vg = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=0)
  return (nnx.split(plain, nnx.Param, ...), nnx.split(qat, nnx.Param, ...), x, vg)


def test_qat_config_validation():
  cfg = configs.get("k3_tiny")
  with pytest.raises(ConfigError, match="quant.qat"):
    validate(apply_overrides(cfg, ["quant.qat=fp8"]))
  with pytest.raises(ConfigError, match="moe.latent_dim=16.*multiple of 32"):
    validate(apply_overrides(cfg, ["quant.qat=mxfp4_mxfp8"]))
  assert apply_overrides(cfg, ["quant.qat=mxfp4_mxfp8"]).quant.qat == "mxfp4_mxfp8"


def _expert_grads(grads):
  flat = nnx.to_flat_state(grads)
  return {p: v.get_value() for p, v in flat if p[-1] in EXPERT_WEIGHTS}


def test_qat_forward_close_and_gradients_flow():
  (g, p, r), (qg, qp, qr), x, vg = layers()
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(qp)):
    np.testing.assert_array_equal(a, b)
  (_, y0), grads0 = vg(g, p, r, x)
  (_, y1), grads1 = vg(qg, qp, qr, x)
  # MXFP4 carries up to ~25% error on an element (values far below their block's max
  # round to 0 or +-0.5 steps), MXFP8 E4M3 ~6%: the layer output moves by some percent
  # (shared expert unquantized, routing unchanged: it reads the unquantized input).
  diff = float(jnp.linalg.norm(y1 - y0) / jnp.linalg.norm(y0))
  assert 1e-3 < diff < 0.2, diff
  e0, e1 = _expert_grads(grads0), _expert_grads(grads1)
  assert set(e1) == set(e0) and len(e1) == 3
  for path, gq in e1.items():
    gq, g0 = np.asarray(gq).ravel(), np.asarray(e0[path]).ravel()
    assert np.isfinite(gq).all() and np.abs(gq).max() > 0, path
    # Straight-through: the quantized path passes the gradient on unchanged, so it stays
    # close to the unquantized one (the forward activations differ slightly).
    cos = float(g0 @ gq / (np.linalg.norm(g0) * np.linalg.norm(gq)))
    assert cos > 0.9, (path, cos)
  # The router gets its gradient through the combine weights, as without QAT.
  router = next(v.get_value() for p, v in nnx.to_flat_state(grads1) if p[-1] == "router")
  assert np.isfinite(router).all() and np.abs(router).max() > 0


def test_packed_forward_equals_qat_forward_and_is_packed():
  _, (qg, qp, qr), x, _ = layers()
  layer = nnx.merge(qg, qp, qr)
  pack.pack_moe(layer)
  pg, pp, pr = nnx.split(layer, nnx.Param, ...)
  packed = [v.get_value() for path, v in nnx.to_flat_state(pp)
            if path[-1] in EXPERT_WEIGHTS]
  assert len(packed) == 3 and all(isinstance(w, MXArray) and w.fmt == "mxfp4" and
                                  w.axis == -2 for w in packed)
  for w in packed:
    assert w.codes.dtype == jnp.uint8 and w.nbytes * 8 == 4.25 * np.prod(w.shape)
  f = jax.jit(lambda g, p, r, x: nnx.merge(g, p, r)(x)[0], static_argnums=0)
  ref, out = f(qg, qp, qr, x), f(pg, pp, pr, x)
  # Same dequantized weights, same MXFP8 activations, same f32 grouped matmuls: equal up
  # to XLA fusion/reassociation in f32 (bit-equal on XLA:CPU; 1e-6 leaves room for others).
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_generate_from_packed_weights_matches_fake_quant():
  qat = _cfg("mxfp4_mxfp8")
  qg, qp, qr = nnx.split(create_model(qat, seed=0), nnx.Param, ...)
  prompt = [5, 17, 99, 3, 250, 8]
  ref = list(Engine(qat, qg, qp, qr, SINGLE_STREAM).generate(prompt, 6))
  out = list(Engine(qat, *pack.pack_state(qg, qp, qr), SINGLE_STREAM).generate(prompt, 6))
  assert out == ref and len(out) == 6


def test_serving_weight_bytes_abstract():
  cfg = validate(apply_overrides(configs.get("k3_tiny"), WIDE))
  out = pack.serving_weight_bytes(cfg)
  assert out["bits_per_routed_weight"] == 4.25
  assert out["total_bytes"] == sum(out["by_part"].values())
  assert out["total_bytes"] == out["routed_expert_bytes"] + out["other_bf16_bytes"]
  m = cfg.moe
  n_moe = cfg.num_layers - len(cfg.dense_layers)
  assert out["routed_expert_params"] == n_moe * m.num_experts * 3 * 32 * 32
  with pytest.raises(ValueError, match="multiple of 32"):      # k3_tiny's latent width 16
    pack.serving_weight_bytes(configs.get("k3_tiny"))


def test_packed_moe_on_tpu_expert_mesh_lowers_to_the_mxfp4_kernel():
  """Serving on a TPU expert mesh: the packed layer's grouped matmuls run the Pallas MXFP4
  kernel inside the expert-parallel shard_map (two Mosaic calls: gate and up in one gated
  call, then down), while the
  same layer lowered for the CPU keeps dequantize + grouped matmul (no Mosaic call).
  Lowering only (no TPU compile) keeps this cheap; compiling is `main.py compile --quant`."""
  from sharding.mesh import make_mesh, parse_mesh
  from sharding.install import parallel_for
  from pod.topology import topology_devices
  wide = ["moe.latent_dim=256", "moe.expert_intermediate=256", "dtype=bfloat16"]
  cfg = validate(apply_overrides(configs.get("k3_tiny"), wide))
  layer = MoE(cfg, init=Init(0, "host"))
  pack.pack_moe(layer)
  g, p, r = nnx.split(layer, nnx.Param, ...)
  x = jax.ShapeDtypeStruct((4, 16, cfg.d_model), jnp.bfloat16)

  def lowered_text(devices, spec):
    mesh = make_mesh(parse_mesh(spec), devices=devices)

    def fwd(p, r, x):
      return nnx.merge(g, p, r)(x, par=parallel_for(mesh))[0]
    with jax.default_matmul_precision("default"):
      return jax.jit(fwd).lower(p, r, x).as_text()

  tpu = lowered_text(topology_devices("v5p:2x2x1"), "expert:4")
  assert "tpu_custom_call" in tpu and "ragged_all_to_all" in tpu
  assert len(re.findall(r"call @_mxfp4_gmm(_\d+)?\b", tpu)) == 2
  cpu = lowered_text(jax.devices()[:4], "expert:4")
  assert "tpu_custom_call" not in cpu
