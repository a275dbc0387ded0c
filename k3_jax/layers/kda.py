"""Kimi Delta Attention layer (docs/architecture.md section 2), K3 and Kimi-Linear variants.

    q, k, v = SiLU(conv4(W x)); q, k L2-normalised per head
    beta    = sigmoid(W_beta x)                       one per head
    z       = W_up W_down x + b                       low rank, per channel
    g       = g_min sigmoid(e^A z)  (K3)   |   -e^A softplus(z)  (Kimi Linear)
    o       = delta rule (chunked for many tokens, one recurrent step for decode)
    y       = W_o [ sigmoid(W_g x) * RMSNorm_head(o) ]

Cache (decode): a KDAState (k3_jax/cache.py): the state and the three conv windows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.cache import KDAState
from k3_jax.config import ModelConfig, jnp_dtype
from k3_jax.layers.init import Init
from k3_jax.layers.kda_window import window_call
from k3_jax.layers.linear import Linear, apply_stacked
from k3_jax.ops import conv as conv_ops
from k3_jax.ops import kda as kda_ops
from k3_jax.ops.norms import rms_norm
from k3_jax.partitioning import SINGLE, Parallel


def decay_bias_init(init: Init, shape, g_min: float | None) -> jax.Array:
  """Bias b of the decay logit so that the initial per-step log decay is -dt, dt ~ logU(1e-3, 0.1).

  Kimi Linear (softplus): b = softplus^-1(dt). K3 (lower bound; a project choice mirroring
  it): g_min sigmoid(b) = -dt, so b = logit(dt / |g_min|).
  """
  return init.uniform(shape, math.log(1e-3), math.log(0.1), then=_decay_bias, g_min=g_min)


def _decay_bias(log_dt, g_min):
  dt = jnp.exp(log_dt)
  if g_min is None:
    return jnp.log(jnp.expm1(dt))
  p = dt / abs(g_min)
  return jnp.log(p) - jnp.log1p(-p)


class KDA(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, init: Init, out_std: float | None = None):
    c, d = cfg.kda, cfg.d_model
    h, k = c.num_heads, c.head_dim
    dt, pdt = jnp_dtype(cfg.dtype), jnp_dtype(cfg.param_dtype)
    self.c, self.dtype, self.eps = c, dt, cfg.norm_eps
    lin = dict(init=init, dtype=dt, param_dtype=pdt)
    self.q_proj = Linear(d, (h, k), ("embed", "heads", "head_dim"), batch_axes=("heads",),
                         **lin)
    self.k_proj = Linear(d, (h, k), ("embed", "heads", "head_dim"), batch_axes=("heads",),
                         **lin)
    self.v_proj = Linear(d, (h, k), ("embed", "heads", "head_dim"), batch_axes=("heads",),
                         **lin)
    conv_shape = (c.conv_size, h, k)
    conv_axes = ("conv", "heads", "head_dim")
    self.q_conv = nnx.Param(init.normal(conv_shape, c.conv_size ** -0.5, pdt),
                            logical_axes=conv_axes)
    self.k_conv = nnx.Param(init.normal(conv_shape, c.conv_size ** -0.5, pdt),
                            logical_axes=conv_axes)
    self.v_conv = nnx.Param(init.normal(conv_shape, c.conv_size ** -0.5, pdt),
                            logical_axes=conv_axes)
    self.b_proj = Linear(d, h, ("embed", "heads"), **lin)
    rank = c.decay_rank or k
    self.f_down = Linear(d, rank, ("embed", "rank"), **lin)
    self.f_up = Linear(rank, (h, k), ("rank", "heads", "head_dim"), **lin)
    softplus = c.decay == "softplus"
    self.dt_bias = nnx.Param(decay_bias_init(init, (h, k), None if softplus else c.g_min),
                             logical_axes=("heads", "head_dim"))
    a_init = (init.uniform((h,), 1.0, 16.0, then=jnp.log)
              if softplus else jnp.zeros((h,), jnp.float32))
    self.a_log = nnx.Param(a_init, logical_axes=("heads",))
    if c.gate_rank:
      self.g_down = Linear(d, c.gate_rank, ("embed", "rank"), **lin)
      self.g_up = Linear(c.gate_rank, (h, k), ("rank", "heads", "head_dim"), **lin)
    else:
      self.g_proj = Linear(d, (h, k), ("embed", "heads", "head_dim"), **lin)
    self.o_norm = nnx.Param(jnp.ones((k,), pdt), logical_axes=("head_dim",))
    self.o_proj = Linear((h, k), d, ("heads", "head_dim", "embed"), std=out_std, **lin)

  # ----- pieces ---------------------------------------------------------------
  @jax.named_scope("conv")
  def _conv(self, x, weight, segment_ids, cache, par: Parallel = SINGLE):
    b, t, h, k = x.shape
    w = weight[...].reshape(self.c.conv_size, h * k)
    flat = x.reshape(b, t, h * k)
    if t == 1 and cache is not None:
      y, new = conv_ops.short_conv_step(flat[:, 0], w, cache)
      y = y[:, None]
    else:
      conv = par.ops.short_conv or conv_ops.short_conv                # halo'd on a sequence mesh
      y, new = conv(flat, w, segment_ids=segment_ids, cache=cache)
    return jax.nn.silu(y.astype(jnp.float32)).reshape(b, t, h, k), new

  @jax.named_scope("projections")
  def _inputs(self, x, par: Parallel = SINGLE):
    """Every projection of x, stacked into as few matmuls as the shapes allow (layers/linear.
    apply_stacked): q, k, v (and the full-rank output gate) as one; the decay's and the
    low-rank gate's down projections as one when their ranks agree. Returns (q, k, v
    [B, T, H, K] before the conv, decay input z_f [B, T, r], gate logits [B, T, H, K]).
    Where the batch fills the mesh: one by one on the weights' output splits (`_by_output`).
    """
    heads = [self.q_proj, self.k_proj, self.v_proj] + ([] if self.c.gate_rank else [self.g_proj])
    if par.batch_fills_mesh:
      return self._by_output(x, heads, par)
    out = apply_stacked(x, heads)
    if self.c.gate_rank and self.g_down.out_shape == self.f_down.out_shape:
      zf, zg = apply_stacked(x, (self.f_down, self.g_down))
    else:
      zf, zg = self.f_down(x), self.g_down(x) if self.c.gate_rank else None
    gate = self.g_up(zg) if self.c.gate_rank else out[3]
    return out[0], out[1], out[2], par.by_batch(zf), gate

  def _by_output(self, x, heads, par: Parallel):
    """`_inputs` where the batch fills the mesh (node decode): the tokens gathered once,
    each projection computed one by one on its weight's output split where it lies, its
    output sent back by sequence (no per-layer stack of the weights: the stack was relaid
    out and copied, k3 v5p-128 64 x 1M ~0.5 GB a chip a step; one by one without these
    constraints the partitioner gathered each weight whole, ~340 GB); the low-rank decay
    (and gate) inputs split on their rank, then whole for their up-projections, which
    `compile.weights_by_output` splits on their output (`_decay`; whole on every chip,
    each read 3 MB a layer: 0.2 GB a step; and the decay's down-projection, alone, was
    gathered whole)."""
    split = lambda a: par.by_batch(par.by_output(a, heads=True))
    whole = lambda a: par.gathered(par.by_output(a), (None, None, "embed"))
    xw = par.gathered(x, ("batch", None, None))
    out = [split(lin(xw)) for lin in heads]
    zf = whole(self.f_down(xw))
    if self.c.gate_rank:
      out.append(split(self.g_up(whole(self.g_down(xw)))))
    return out[0], out[1], out[2], zf, out[3]

  @jax.named_scope("decay")
  def _decay(self, zf, par: Parallel = SINGLE):
    # (by_output, by_batch: node decode, f_up split on its output, `_by_output`)
    z = par.by_output(self.f_up(zf), heads=True).astype(jnp.float32) + self.dt_bias[...]
    if self.c.decay == "softplus":
      return par.by_batch(kda_ops.kda_gate_softplus(z, self.a_log[...]))
    return par.by_batch(kda_ops.kda_gate_lower_bound(z, self.a_log[...], self.c.g_min))

  def init_cache(self, batch: int) -> KDAState:
    h, k, w = self.c.num_heads, self.c.head_dim, self.c.conv_size
    conv = jnp.zeros((batch, w - 1, h * k), self.dtype)
    return KDAState(state=jnp.zeros((batch, h, k, k), jnp.float32),
                    conv_q=conv, conv_k=conv, conv_v=conv)

  @jax.named_scope("output")
  def _output(self, o, gate, par: Parallel = SINGLE):
    o = rms_norm(o.astype(jnp.float32), self.o_norm[...], self.eps)     # [B, T, H, V]
    o = jax.nn.sigmoid(gate.astype(jnp.float32)) * o
    # node decode: gathered whole for o_proj (split on its output, the model dimension)
    return self.o_proj(par.gathered(o.astype(self.dtype), ("batch", None, None, None)))

  # ----- forward --------------------------------------------------------------
  @jax.named_scope("kda")
  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
               cache: KDAState | None = None,
               par: Parallel = SINGLE) -> tuple[jax.Array, KDAState | None]:
    """x [B, T, D] -> (y [B, T, D], new cache or None). With a cache and T == 1 the
    one-step recurrence runs; otherwise the chunked form (from the cached state). par: the
    parallel setup (k3_jax/partitioning.py)."""
    if cache is not None and cache.window is not None:   # speculation: a verify step's window
      return window_call(self, x, cache, par)
    b, t, _ = x.shape
    if cache is not None and cache.unit is not None and t != 1:
      raise ValueError("a stacked KDA state (KDAState.unit) is for one-token decode steps")
    get = (lambda n: getattr(cache, n)) if cache is not None else (lambda n: None)
    xq, xk, xv, zf, gate = self._inputs(x, par)
    q, cq = self._conv(xq, self.q_conv, segment_ids, get("conv_q"), par)
    k, ck = self._conv(xk, self.k_conv, segment_ids, get("conv_k"), par)
    v, cv = self._conv(xv, self.v_conv, segment_ids, get("conv_v"), par)
    q, k = kda_ops.l2_normalize(q), kda_ops.l2_normalize(k)            # [B, T, H, K] f32
    q = par.constrain(q, ("batch", "seq", "heads", None))
    beta = jax.nn.sigmoid(par.by_batch(self.b_proj(par.by_input(x))).astype(jnp.float32))
    g = self._decay(zf, par)                                           # [B, T, H, K] f32
    if cache is not None and t == 1:
      # idle rows keep their state inside the step (the kernel selects as it writes)
      # (a scanned layer's: the whole stacked state, updated in place at its unit)
      o, state = kda_ops.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                     cache.state, backend=par.kernels.kda_backend, par=par,
                                     active=cache.active, layer=cache.unit)
      o = o[:, None]
    else:
      o, state = kda_ops.chunk_kda(q, k, v, g, beta, chunk_size=par.kernels.kda_chunk_size,
                                   initial_state=None if cache is None else cache.state,
                                   output_final_state=cache is not None,
                                   segment_ids=segment_ids, backend=par.kernels.kda_backend,
                                   par=par)
    y = self._output(o, gate, par)
    if cache is None:
      return y, None
    if cache.active is not None:   # idle rows keep their state (selected here, per layer,
      keep = lambda new, old: jnp.where(                   # as the new state is written)
          cache.active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old.astype(new.dtype))
      cq, ck, cv = (keep(n, o) for n, o in ((cq, cache.conv_q), (ck, cache.conv_k),
                                            (cv, cache.conv_v)))
      if t != 1:
        state = keep(state, cache.state)
    return y, KDAState(state=state, conv_q=cq, conv_k=ck, conv_v=cv, active=cache.active,
                       unit=cache.unit)


__all__ = ["KDA"]
