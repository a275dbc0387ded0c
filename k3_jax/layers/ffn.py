"""Dense gated FFN (layer 1 of K3, and the fused shared experts of the MoE)."""

from __future__ import annotations

import jax
from flax import nnx

from k3_jax.config import ModelConfig, jnp_dtype
from k3_jax.layers.init import Init
from k3_jax.layers.linear import Linear, apply_stacked
from k3_jax.ops.activations import glu
from k3_jax.partitioning import SINGLE, Parallel


class GatedFFN(nnx.Module):
  """out = W_down glu(W_gate x, W_up x), glu = SiTU-GLU (K3) or SwiGLU (Kimi Linear)."""

  def __init__(self, cfg: ModelConfig, dim: int, hidden: int, *, init: Init,
               out_std: float | None = None, mlp_axis: str = "mlp"):
    dt, pdt = jnp_dtype(cfg.dtype), jnp_dtype(cfg.param_dtype)
    self.kind, self.beta1, self.beta2 = cfg.activation, cfg.situ_beta1, cfg.situ_beta2
    self.gate = Linear(dim, hidden, ("embed", mlp_axis), init=init, dtype=dt, param_dtype=pdt)
    self.up = Linear(dim, hidden, ("embed", mlp_axis), init=init, dtype=dt, param_dtype=pdt)
    self.down = Linear(hidden, dim, (mlp_axis, "embed"), init=init, dtype=dt, param_dtype=pdt,
                       std=out_std)

  @jax.named_scope("dense_ffn")
  def __call__(self, x: jax.Array, par: Parallel = SINGLE) -> jax.Array:
    if par.batch_fills_mesh:   # node decode: one by one on their output splits (no stack)
      gate, up = self.gate(x), self.up(x)
    else:
      gate, up = apply_stacked(x, (self.gate, self.up))                # one matmul
    h = glu(gate, up, self.kind, self.beta1, self.beta2)
    # node decode: the hidden, split on its width, gathered whole for the down-projection
    return self.down(par.gathered(h, (None,) * (h.ndim - 1) + ("embed",)))
