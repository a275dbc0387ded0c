"""The Pallas KDA decode-step kernel (interpret mode) vs the reference ops.

Several decode steps of the kernel, each feeding its new state to the next, are compared
with `recurrent_kda` over the same tokens (outputs and final state) and, step by step, with
the reference `kda_decode_step` from the same state.

Tolerances. FP32: the kernel computes k^T S and S^T q as element-wise products summed over
the state's rows, the reference as einsums, so the two differ only by float32 rounding order
(~1e-7 relative per step, growing at most linearly over the steps through the carried
state); we assert 1e-5 of the largest reference entry. BF16 inputs: the reference gets the
same bf16-rounded q, k, v, g (upcast to f32), so the FP32 state math is identical up to
rounding order (same 1e-5 bound on the state); the output is rounded to bf16 (v's dtype) by
both, and the two roundings can land on neighbouring bf16 values, so outputs get one bf16
ulp: 2^-7 of the largest entry.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.kda_decode as kd
from k3_jax.ops import kda

STEPS = 6
FP32_REL = 1e-5
BF16_OUT_REL = 2.0 ** -7


def _close(actual, ref, rel):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  assert actual.shape == ref.shape
  assert np.all(np.isfinite(actual)), "non-finite values"
  scale = max(np.max(np.abs(ref)), 1e-3)
  np.testing.assert_allclose(actual, ref, rtol=0, atol=rel * scale)


def _tokens(B, T, H, K, V, seed=0, dtype=jnp.float32):
  """Tokens as the model makes them: L2-normalised q, k; sigmoid beta. Decays per batch row
  0: K3 lower-bound gate; 1: Kimi-Linear softplus gate; 2+: strong decay, g in [-20, 0].
  Drawn with numpy (jax.random would compile a sampler per shape: seconds each on CPU)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
  unit = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
  q, k, v = unit(normal(B, T, H, K)), unit(normal(B, T, H, K)), normal(B, T, H, V)
  z = normal(B, T, H, K) * 2.0
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))
  lb = -5.0 * sigmoid(np.exp(normal(H))[:, None] * z)               # K3, g_min = -5
  sp = -rng.uniform(1, 16, (H, 1)) * np.logaddexp(0.0, z)           # Kimi Linear
  strong = rng.uniform(-20.0, 0.0, (B, T, H, K))
  row = np.arange(B)[:, None, None, None]
  g = np.where(row == 0, lb, np.where(row == 1, sp, strong)).astype(np.float32)
  beta = sigmoid(normal(B, T, H))
  state = normal(B, H, K, V) * 0.5
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), cast(g), jnp.asarray(beta), jnp.asarray(state)


@functools.lru_cache(maxsize=None)
def _kernel_step(scale):
  return jax.jit(functools.partial(kd.kda_decode_step, scale=scale, interpret=True))


def _run_steps(q, k, v, g, beta, state, scale=None):
  """The kernel over the tokens one at a time; also the reference step from the same state."""
  step = _kernel_step(scale)
  ref_step = jax.jit(functools.partial(kda.kda_decode_step, scale=scale))
  outs, ref_outs = [], []
  for t in range(q.shape[1]):
    args = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
    o_ref, s_ref = ref_step(*args, state)
    o, new_state = step(*args, state)
    assert o.dtype == v.dtype and new_state.dtype == jnp.float32
    _close(new_state, s_ref, FP32_REL)
    ref_outs.append(o_ref)
    outs.append(o)
    state = new_state
  return jnp.stack(outs, 1), jnp.stack(ref_outs, 1), state


@pytest.mark.parametrize("B,H,K,V", [
    (3, 3, 16, 32),
    pytest.param(3, 2, 32, 16, marks=pytest.mark.slow),
])
def test_decode_steps_fp32_match_recurrent(B, H, K, V):
  q, k, v, g, beta, s0 = _tokens(B, STEPS, H, K, V)
  o, o_step_ref, state = _run_steps(q, k, v, g, beta, s0)
  o_rec, s_rec = kda.recurrent_kda(q, k, v, g, beta, initial_state=s0,
                                   output_final_state=True)
  _close(o, o_step_ref, FP32_REL)
  _close(o, o_rec, FP32_REL)
  _close(state, s_rec, FP32_REL)


def test_decode_steps_bf16_match_recurrent():
  B, H, K, V = 3, 2, 16, 16
  q, k, v, g, beta, s0 = _tokens(B, STEPS, H, K, V, seed=1, dtype=jnp.bfloat16)
  o, o_step_ref, state = _run_steps(q, k, v, g, beta, s0, scale=0.3)
  f32 = lambda x: x.astype(jnp.float32)
  o_rec, s_rec = kda.recurrent_kda(f32(q), f32(k), f32(v), f32(g), beta, scale=0.3,
                                   initial_state=s0, output_final_state=True)
  assert o.dtype == jnp.bfloat16
  _close(o, o_step_ref, BF16_OUT_REL)
  _close(o, o_rec, BF16_OUT_REL)
  _close(state, s_rec, FP32_REL)


def test_decode_head_blocks(monkeypatch):
  """More heads than one block holds: the grid walks head blocks of 8 (TPU's rule for a
  [.., Hb, K] block: Hb == H or a multiple of 8), each head updated exactly once."""
  B, H, K, V = 2, 16, 16, 16
  monkeypatch.setattr(kd, "_STATE_BLOCK_BYTES", 8 * K * V * 4)
  assert kd.head_block(H, K, V) == 8
  q, k, v, g, beta, s0 = _tokens(B, 1, H, K, V, seed=2)
  args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
  o, s = jax.jit(functools.partial(kd.kda_decode_step, interpret=True))(*args)
  o_ref, s_ref = kda.kda_decode_step(*args)
  _close(o, o_ref, FP32_REL)
  _close(s, s_ref, FP32_REL)


def test_decode_keeps_idle_rows_and_updates_a_stack_in_place():
  """active [B]: the idle rows' state comes back bit for bit (the kernel selects as it
  writes, in the aliased buffer), the active rows' as without a mask. layer: a stacked
  state [R, B, H, K, V] comes back whole, that layer updated as alone, the others bit for
  bit. ops.kda.decode_step's reference path the same."""
  B, H, K, V = 3, 2, 16, 16
  q, k, v, g, beta, s0 = _tokens(B, 1, H, K, V, seed=3)
  args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
  active = jnp.asarray([True, False, True])
  stack = jnp.stack([s0 * 2.0, s0, s0 - 1.0])                        # [3, B, H, K, V]
  _, s_all = kda.kda_decode_step(*args, s0)
  step = jax.jit(functools.partial(kd.kda_decode_step, interpret=True))
  for got in (step(*args, s0, active=active)[1],
              step(*args, stack, active=active, layer=jnp.int32(1))[1],
              kda.decode_step(*args, s0, active=active)[1],
              kda.decode_step(*args, stack, active=active, layer=jnp.int32(1))[1]):
    if got.ndim == 5:
      np.testing.assert_array_equal(np.asarray(got[::2]), np.asarray(stack[::2]))
      got = got[1]
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(s0[1]))
    _close(got[::2], s_all[::2], FP32_REL)


def test_head_block_choice():
  assert kd.head_block(24, 128, 128) == 8       # 24 heads x 64 KiB > 1 MiB: blocks of 8
  assert kd.head_block(16, 128, 128) == 16      # exactly 1 MiB: one block
  assert kd.head_block(3, 16, 16) == 3          # small: all heads
  assert kd.head_block(64, 128, 128) == 16


def test_decode_rejects_bad_shapes():
  q, k, v, g, beta, s0 = _tokens(2, 1, 2, 16, 16)
  with pytest.raises(ValueError, match=r"state has shape \(2, 2, 16, 8\)"):
    kd.kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0[..., :8],
                       interpret=True)
