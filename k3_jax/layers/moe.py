"""Stable LatentMoE (docs/architecture.md section 5) and the plain MoE of Kimi Linear.

    s = sigmoid(W_r x)                (full-width router, FP32)
    T = top_k(s + b)                  (b: balancing bias, non-trainable state)
    p = s_T / sum s_T * scale
    z = W_down x                      (d -> l; skipped when latent_dim = 0)
    u = sum_j p_j E_j(z)              (dropless grouped matmul)
    y = Shared(x) + W_up RMSNorm(u)   (RMSNorm and W_up only with a latent)

Routed experts may run quantized (k3_jax/ops/mx_gmm.py): fake-quantized MXFP4 weights and
MXFP8 inputs with quant.qat = "mxfp4_mxfp8", or from packed MXFP4 weights after
`k3_jax.serve.pack.pack_routed_experts` (serving).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.config import ModelConfig, jnp_dtype
from k3_jax.layers.ffn import GatedFFN
from k3_jax.layers.init import Init
from k3_jax.layers.linear import Linear
from k3_jax.layers.norm import RMSNorm
from k3_jax.ops import balance as balance_ops
from k3_jax.ops import moe as moe_ops
from k3_jax.ops import mx_gmm
from k3_jax.partitioning import SINGLE, Parallel


class RouterBias(nnx.Variable):
  """The balancing bias: state, not a parameter (no gradient, no optimizer, no decay)."""


class MoE(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, init: Init, out_std: float | None = None):
    m, d = cfg.moe, cfg.d_model
    dt, pdt = jnp_dtype(cfg.dtype), jnp_dtype(cfg.param_dtype)
    self.cfg = m
    self.kind, self.beta1, self.beta2 = cfg.activation, cfg.situ_beta1, cfg.situ_beta2
    self.dtype = dt
    self.qat = cfg.quant.qat != "none"
    self.router = nnx.Param(init.normal((d, m.num_experts), d ** -0.5, jnp.float32),
                            logical_axes=("embed", "experts"), matrix_axes=("in", "out"))
    self.bias = RouterBias(jnp.zeros((m.num_experts,), jnp.float32), logical_axes=("experts",))
    width = m.latent_dim or d
    if m.latent_dim:
      self.down = Linear(d, width, ("embed", "latent"), init=init, dtype=dt, param_dtype=pdt)
      self.norm = RMSNorm(width, eps=cfg.norm_eps, param_dtype=pdt, axis_name="latent")
      self.up = Linear(width, d, ("latent", "embed"), init=init, dtype=dt, param_dtype=pdt,
                       std=out_std)
    e, f = m.num_experts, m.expert_intermediate
    in_axes = ("experts", "expert_embed", "expert_mlp")
    roles = ("batch", "in", "out")          # one matrix per expert (layers/linear.py)
    self.w_gate = nnx.Param(init.normal((e, width, f), width ** -0.5, pdt),
                            logical_axes=in_axes, matrix_axes=roles)
    self.w_up = nnx.Param(init.normal((e, width, f), width ** -0.5, pdt),
                          logical_axes=in_axes, matrix_axes=roles)
    down_std = f ** -0.5 if (m.latent_dim or out_std is None) else out_std
    self.w_down = nnx.Param(init.normal((e, f, width), down_std, pdt),
                            logical_axes=("experts", "expert_mlp", "expert_embed"),
                            matrix_axes=roles)
    if m.num_shared_experts:
      self.shared = GatedFFN(cfg, d, m.num_shared_experts * f, init=init, out_std=out_std)

  def new_bias(self, scores: jax.Array, load: jax.Array) -> jax.Array:
    """The balancing bias for the NEXT step from this step's router outputs (training)."""
    m, bias = self.cfg, self.bias[...]
    if m.balance == "qb" and m.qb_bins:
      return balance_ops.quantile_balancing_histogram(scores, bias, m.top_k, m.qb_bins)
    if m.balance == "qb":
      return balance_ops.quantile_balancing(scores, bias, m.top_k)
    if m.balance == "sign":
      return balance_ops.sign_balancing(bias, load, m.balance_rate)
    return bias

  def _packed(self) -> bool:
    """Serving from packed MXFP4 weights (k3_jax.serve.pack.pack_routed_experts)?"""
    return isinstance(self.w_gate.get_value(), (mx_gmm.MXArray, mx_gmm.StackedLayer))

  def _expert_weights(self):
    """(w_gate, w_up, w_down): packed MXArrays, MXFP4 fake-quantized (QAT), or plain."""
    ws = [getattr(self, n).get_value() for n in mx_gmm.EXPERT_WEIGHTS]
    if self._packed():
      return ws
    if self.qat:
      return [mx_gmm.qat_weight(w, self.dtype) for w in ws]
    return [w.astype(self.dtype) for w in ws]

  def _gmm(self, kind: str, local: bool, platform: str):
    """The grouped matmul `kind` (the job's, Parallel.kernels.gmm) for this call on
    `platform`. local: it runs on whole local arrays (no mesh, or inside the
    expert-parallel shard_map), so a Pallas kernel may be called directly."""
    base = moe_ops.default_gmm(kind, platform=platform, kernel=local)
    if self._packed():
      return mx_gmm.packed_gmm(base, kernel=local and platform == "tpu")
    return mx_gmm.qat_gmm(base) if self.qat else base

  @jax.named_scope("moe")
  def __call__(self, x: jax.Array, train: bool = False,
               par: Parallel = SINGLE) -> tuple[jax.Array, dict]:
    """x [B, T, D] -> (y [B, T, D], aux): aux['expert_load'] [E] tokens per expert and, when
    training, aux['new_bias'] [E] (the bias itself is only changed by the train step).
    par: the parallel setup (k3_jax/partitioning.py)."""
    m = self.cfg
    b, t, d = x.shape
    xf = x.reshape(b * t, d)                                           # [N, D]
    if par.batch_fills_mesh:   # node decode: the tokens gathered once for the router, latent
      xf = par.gathered(xf, ("batch", None))  # and shared projections (each gathered its own)
    with jax.named_scope("router"):
      scores = moe_ops.router_scores(xf, self.router[...])             # [N, E] f32
      if par.batch_fills_mesh:      # node decode: computed split on E, then per token whole
        scores = par.constrain(par.by_output(scores), ("batch", None))
      weights, ids = moe_ops.select_experts(scores, self.bias[...], m.top_k,
                                            m.routed_scaling_factor, m.n_group, m.topk_group)
    with jax.named_scope("latent_down"):
      z = par.by_output(self.down(xf)) if m.latent_dim else xf         # [N, L]
    ep = par.ops.moe_dispatch                                          # expert-parallel on a mesh
    args = (z.astype(self.dtype), weights, ids, *self._expert_weights())
    kw = dict(activation=self.kind, beta1=self.beta1, beta2=self.beta2,
              gmm=self._gmm(par.kernels.gmm, ep is not None or not par.kernels_sharded,
                            par.platform))
    with jax.named_scope("routed_experts"):
      if ep is not None:
        u = ep(*args, capacity_factor=par.kernels.ep_capacity or None,
               recv_factor=par.kernels.ep_recv_capacity or None, **kw)
      elif not train and xf.shape[0] <= moe_ops.SMALL_TOKENS and not self.qat \
          and not self._packed():           # a decode step: no training-sized layout
        kw.pop("gmm")
        u = moe_ops.moe_small(*args, pair_loop=par.platform == "cpu", **kw)
      else:
        u = moe_ops.moe_dispatch(*args, **kw)                          # [N, L]
    with jax.named_scope("latent_up"):
      y = self.up(par.gathered(self.norm(u), ("batch", None))) if m.latent_dim else u  # [N, D]
    if m.num_shared_experts:
      with jax.named_scope("shared_experts"):
        y = y + self.shared(xf, par)
    with jax.named_scope("balance"):
      aux = {"expert_load": moe_ops.expert_load(ids, m.num_experts)}
      if train:
        aux["new_bias"] = self.new_bias(scores, aux["expert_load"])
    return y.reshape(b, t, d).astype(self.dtype), aux

