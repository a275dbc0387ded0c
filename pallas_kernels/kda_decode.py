"""Pallas TPU kernel: one KDA decode step (one token per sequence, a batch of sequences).

Same signature and result as the reference `k3_jax.ops.kda.kda_decode_step`, plus
`interpret` (run the kernel with the Pallas interpreter, e.g. on CPU), `active` (rows
whose state the step may change; an idle row's state is written back unchanged) and `layer`
(the state is a scanned stack [R, B, H, K, V], updated in place at that index):

    q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] float32
    -> (o [B, H, V] in v.dtype, new_state [B, H, K, V] float32)

Per head (docs/architecture.md section 2):  S <- Diag(e^g) S;  S <- S + beta k (v - k^T S)^T;  o = S^T q.

Decode is memory bound: every step reads and writes the whole FP32 state (64 KiB per head
at K = V = 128) for a few FLOPs per element. So the kernel touches the state exactly once:
the grid is (batch, head block), each step loads one [Hb, K, V] block of the state into VMEM,
updates it with element-wise work and reductions (no MXU: a matmul with one row would waste
it), and writes it back to the SAME buffer (`input_output_aliases`): under jit with a
donated state the update happens in place, no second state-sized buffer.

Layout: the per-token vectors arrive as rows (K on the lanes, the dense HBM layout), but the
decay and the outer products act on the state's rows (K on the sublanes). A row is turned
into a column exactly, without a transpose op, by masking it onto the diagonal of a K x K tile
and summing over the lanes (one non-zero term per sum, so no rounding). All math is FP32
whatever the input dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3_jax.ops.kda.common import check_decode_shapes, default_scale

# A state block is at most this many bytes: 1 MiB = 16 heads of 128 x 128 FP32. Pallas
# double-buffers the state block in and out (4 copies) and the per-head temporaries add
# about as much again: Mosaic reports ~6.5 MiB of scoped VMEM for 16 heads, inside the
# default scoped limit of every TPU generation (16 MiB on v5e, 32 MiB on v5p / v6e).
_STATE_BLOCK_BYTES = 1024 * 1024


def head_block(num_heads: int, k_dim: int, v_dim: int) -> int:
  """Heads per grid step: all heads if their state fits the block budget, else the largest
  multiple of 8 dividing num_heads that fits (TPU blocks of [.., Hb, K] need Hb == H or
  Hb % 8 == 0), else 8."""
  per_head = k_dim * v_dim * 4
  if num_heads * per_head <= _STATE_BLOCK_BYTES:
    return num_heads
  fits = [hb for hb in range(8, num_heads, 8)
          if num_heads % hb == 0 and hb * per_head <= _STATE_BLOCK_BYTES]
  if fits:
    return max(fits)
  if num_heads % 8 == 0:
    return 8
  return num_heads


def _to_column(row: jax.Array, eye: jax.Array) -> jax.Array:
  """[1, K] -> [K, 1] exactly: put the row on the diagonal, sum each row of the tile."""
  return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def _decode_kernel(layer_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, keep_ref, s_ref, o_ref,
                   s_out_ref, *, scale: float, heads: int):
  del layer_ref                           # (read by the index maps)
  # Blocks: q/k/g [1, Hb, K]; v [1, Hb, V]; beta [1, Hb, 1]; keep [1, 1, 1] (1: active);
  # state [1, Hb, K, V]; o [1, Hb, V]; s_out aliases the state's buffer.
  k_dim = q_ref.shape[-1]
  eye = (jax.lax.broadcasted_iota(jnp.int32, (k_dim, k_dim), 0)
         == jax.lax.broadcasted_iota(jnp.int32, (k_dim, k_dim), 1))   # [K, K]
  f32 = lambda x: x.astype(jnp.float32)
  active = keep_ref[0] > 0                                            # [1, 1]
  for h in range(heads):                  # static: a few heads per block, 2-D work each
    row = lambda ref: f32(ref[0, pl.ds(h, 1), :])                     # [1, K] / [1, V]
    decay = _to_column(jnp.exp(row(g_ref)), eye)                      # [K, 1]
    k_col = _to_column(row(k_ref), eye)                               # [K, 1]
    q_col = _to_column(row(q_ref), eye) * scale                       # [K, 1]
    old = s_ref[0, h]
    s = decay * old                                                   # [K, V] decayed rows
    pred = jnp.sum(k_col * s, axis=0, keepdims=True)                  # [1, V] k^T S
    beta = f32(beta_ref[0, pl.ds(h, 1), :])                           # [1, 1]
    s = s + k_col * (beta * (row(v_ref) - pred))                      # += k delta^T
    s_out_ref[0, h] = jnp.where(active, s, old)
    o_ref[0, pl.ds(h, 1), :] = jnp.sum(q_col * s, axis=0, keepdims=True).astype(o_ref.dtype)


def decode_cost(q, k, v, g, beta, state) -> pl.CostEstimate:
  """The kernel's analytic cost. Per head, vector work on the [K, V] state (no matmul):
  decay, k^T S (multiply, sum), the rank-1 update (multiply, add) and q^T S (multiply,
  sum), 7 K V; and three row-to-column moves of 2 K^2 each. Bytes: the FP32 state read
  and written once, q, k, v, g, beta read and o written."""
  b, h, k_dim, v_dim = state.shape
  nbytes = lambda a: a.size * jnp.dtype(a.dtype).itemsize
  return pl.CostEstimate(
      flops=b * h * (7 * k_dim * v_dim + 6 * k_dim * k_dim), transcendentals=b * h * k_dim,
      bytes_accessed=(2 * b * h * k_dim * v_dim * 4 + sum(map(nbytes, (q, k, v, g, beta)))
                      + nbytes(v)))


def kda_decode_step(q, k, v, g, beta, state, scale=None, interpret=False, active=None,
                    layer=None):
  """One decode step as a Pallas kernel; see the module docstring for shapes.

  The new state is written into the state's buffer (aliased): donate `state` under jit to
  avoid a copy. active: None, or [B] bool: the rows whose state changes (the others keep
  theirs, selected here rather than after the call, which would need the old state kept:
  a copy of the whole state). layer: None, or the index into a stacked state [R, B, H, K,
  V] (a scanned unit's carry): only that layer's blocks are read and written, in place,
  and the whole stack is returned (sliced out for the call and written back, the state
  took two more passes a layer). Not differentiable (decode is inference only).
  """
  one = state if layer is None else jax.ShapeDtypeStruct(state.shape[1:], state.dtype)
  b, h, k_dim, v_dim = check_decode_shapes(q, k, v, g, beta, one)
  scale = float(default_scale(scale, k_dim))
  hb = head_block(h, k_dim, v_dim)
  stack = state.astype(jnp.float32)
  if layer is None:                       # one layer's state: a free reshape to a stack of 1
    stack, layer = stack[None], 0
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  vec = lambda d: pl.BlockSpec((1, hb, d), lambda i, j, l: (i, j, 0))
  state_spec = pl.BlockSpec((None, 1, hb, k_dim, v_dim), lambda i, j, l: (l[0], i, j, 0, 0))
  kernel = functools.partial(_decode_kernel, scale=scale, heads=hb)
  keep = (jnp.ones((b,), jnp.int32) if active is None else active.astype(jnp.int32))
  o, new_stack = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(b, h // hb),
          in_specs=[vec(k_dim), vec(k_dim), vec(v_dim), vec(k_dim), vec(1),
                    pl.BlockSpec((1, 1, 1), lambda i, j, l: (i, 0, 0)), state_spec],
          out_specs=[vec(v_dim), state_spec]),
      out_shape=[jax.ShapeDtypeStruct((b, h, v_dim), v.dtype),
                 jax.ShapeDtypeStruct(stack.shape, jnp.float32)],
      input_output_aliases={7: 1},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret,
      cost_estimate=decode_cost(q, k, v, g, beta, one),
      name="kda_decode_step",
  )(layer, q, k, v, g, beta.reshape(b, h, 1), keep.reshape(b, 1, 1), stack)
  return o, (new_stack[0] if state.ndim == 4 else new_stack)


__all__ = ["kda_decode_step", "head_block", "decode_cost"]
