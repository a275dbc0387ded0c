"""QK-Clip for the MLA layers (docs/architecture.md section 6, from Kimi K2).

The attention op already reports each head's maximum pre-softmax logit over the batch
(aux['max_logit'] [n_mla_layers, H], free: a max over logits it computes anyway). After the
optimizer step, every head whose maximum exceeded tau gets gamma = tau / max:

    q_nope (W_qb or W_q, per head)  x sqrt(gamma)
    q_rope (per head)               x gamma
    k_nope (W_kvb, per head)        x sqrt(gamma)
    v, and the shared k_rope        untouched

so each of that head's logits q.k = q_nope.k_nope + q_rope.k_rope is scaled by exactly
gamma for the same inputs (c_q and c_kv do not depend on these weights): the head's
maximum on that batch becomes tau.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax import stack

TAU = 100.0


def mla_layers(model) -> list[tuple[object, int]]:
  """(MLA module, rows) in aux['max_logit'] order: the plan's MLA slots (k3_jax/stack.py;
  a scanned layer's weights are stacked over `repeats` rows)."""
  plan = stack.plan_of(model.cfg)
  return [(layer.mixer, spec.rows) for spec, layer in plan.modules(model, plan.mla_slots())]


def _head_factors(gamma: jax.Array, first: int, rest: int, rest_power: float) -> jax.Array:
  """[..., H] gammas -> [..., H, first + rest] factors: sqrt(gamma) on the first `first`
  channels, gamma ** rest_power on the others."""
  g = gamma[..., None]
  return jnp.concatenate([jnp.broadcast_to(jnp.sqrt(g), gamma.shape + (first,)),
                          jnp.broadcast_to(g ** rest_power, gamma.shape + (rest,))], axis=-1)


def _scale(w: jax.Array, factors: jax.Array) -> jax.Array:
  """w [(R,) in, H, C] times factors [R, H, C] (per stacked row, head and channel)."""
  if w.ndim == 4:                                  # stacked: [R, in, H, C]
    f = factors[:, None]
  else:                                            # [in, H, C]
    f = factors[0][None]
  return (w.astype(jnp.float32) * f).astype(w.dtype)


def qk_clip(model, max_logit: jax.Array, tau: float = TAU) -> jax.Array:
  """Rescales, in place, the query/key weights of every MLA head whose max logit exceeded
  tau. max_logit: [n_mla_layers, H] (aux order). Returns the number of clipped heads."""
  row = 0
  clipped = jnp.zeros((), jnp.int32)
  for mla, rows in mla_layers(model):
    c = mla.c
    n, p, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    m = max_logit[row:row + rows].astype(jnp.float32)            # [rows, H]
    over = m > tau
    gamma = jnp.where(over, tau / jnp.where(over, m, 1.0), 1.0)
    clipped = clipped + over.sum().astype(jnp.int32)
    q = mla.q_b if c.q_lora_rank else mla.q_proj
    q.w[...] = _scale(q.w[...], _head_factors(gamma, n, p, 1.0))
    mla.kv_b.w[...] = _scale(mla.kv_b.w[...], _head_factors(gamma, n, v, 0.0))
    row += rows
  if row != max_logit.shape[0]:
    raise ValueError(f"max_logit has {max_logit.shape[0]} rows, the model {row} MLA layers")
  return clipped


__all__ = ["qk_clip", "mla_layers", "TAU"]
