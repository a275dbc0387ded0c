"""Interpret-mode parity of the Pallas chunked KDA kernels (pallas_kernels/kda.py).

Forward outputs, final state and the gradients of every input (q, k, v, g,
beta, initial_state) of a fixed random linear functional of (o, final state)
are compared with the plain-JAX definition `k3_jax.ops.kda.recurrent_kda`
(jax.grad through its scan).

Tolerances, as max |err| <= tol * max |ref| per array (plus rtol = tol):
  FP32 inputs: tol = 1e-4. Both sides compute in FP32; the kernel
    reassociates the per-token sums into matmuls and solves (I + L)^-1
    blockwise. Measured (all cases here): o, state, dq, dk, dv, dbeta,
    d initial_state <= 1e-5; dg <= 3.1e-5 (dg of the chunk's last token sums
    cancelling O(1) terms, d exp(G_C) S and the k_s exp(G_C - G_s) terms,
    whose float32 round-off shows relative to a small result; the reference
    chunk form shows the same effect at ~6e-6). The kernel clamps g at -16
    per step like the reference chunk form (a decay of 1e-7: an erase), so
    with g down to -20 it differs from the unclamped recurrence by ~1e-7 of
    the state. 1e-4 leaves ~3x headroom.
  BF16 inputs: the kernel gets BF16 q, k, v, g, beta; the reference gets
    float32 copies of the same values, so it is unrounded. The kernel's o and
    input gradients are BF16 (the inputs' dtypes) and the cotangent reaching
    it through o is BF16 as well: a few roundings of 2^-9 relative each.
    Measured max |err| / max |ref| <= 3e-3 (final state, FP32: 1.5e-7);
    tol = 1e-2.

Interpret mode is slow on CPU (the kernels are traced into large XLA
programs), so the default suite runs two small cases with one compiled
value-and-gradient function each; broader sweeps are marked slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops import kda as ref
from pallas_kernels import kda as pk

# Compile time dominates interpret mode: a low backend optimization level
# more than halves it.
_jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _inputs(B, T, H, K, V, seed, gate, dtype=jnp.float32, with_state=True):
  """Model-like inputs: L2-normalized q, k; sigmoid beta; g from the K3
  lower-bound gate (g in (-5, 0)), the Kimi-Linear softplus gate, or
  "strong": uniform in [-20, 0] per step (cumulative in-chunk log decay down
  to ~-1280: the factored form must not overflow), or "mixed": batch row 0
  lower-bound, the last row softplus with its last head strong."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  q = ref.l2_normalize(jax.random.normal(ks[0], (B, T, H, K)))
  k = ref.l2_normalize(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, H, V))
  z = jax.random.normal(ks[3], (B, T, H, K)) * 2.0
  lb = ref.kda_gate_lower_bound(z, jax.random.normal(ks[4], (H,)))
  sp = ref.kda_gate_softplus(
      z, jnp.log(jax.random.uniform(ks[4], (H,), minval=1, maxval=16)))
  strong = jax.random.uniform(ks[5], (B, T, H, K), minval=-20.0, maxval=0.0)
  g = {"lower_bound": lb, "softplus": sp, "strong": strong}.get(gate)
  if gate == "mixed":
    g = jnp.concatenate([lb[:1], sp[1:]], 0)
    g = g.at[-1, :, -1].set(strong[-1, :, -1])
  beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
  s0 = jax.random.normal(ks[7], (B, H, K, V)) if with_state else None
  cast = lambda x: x.astype(dtype)
  return cast(q), cast(k), cast(v), cast(g), cast(beta), s0


@functools.lru_cache(maxsize=None)
def _value_and_grad(kind, chunk_size=64, store_states=False, with_state=True):
  """jit of (o, final_state, grads of every input) for a fixed random
  functional sum(o * r_o) + sum(state * r_s)."""

  def loss(q, k, v, g, beta, s0, seg):
    init = s0 if with_state else None
    if kind == "pallas":
      o, s = pk.chunk_kda(q, k, v, g, beta, initial_state=init,
                          output_final_state=True, chunk_size=chunk_size,
                          segment_ids=seg, interpret=True,
                          store_states=store_states)
    else:
      o, s = ref.recurrent_kda(q, k, v, g, beta, initial_state=init,
                               output_final_state=True, segment_ids=seg)
    kr = jax.random.split(jax.random.PRNGKey(1))
    r_o = jax.random.normal(kr[0], o.shape)
    r_s = jax.random.normal(kr[1], s.shape)
    return (jnp.sum(o.astype(jnp.float32) * r_o) + jnp.sum(s * r_s)), (o, s)

  return _jit(jax.grad(loss, argnums=range(6), has_aux=True))


def _close(name, actual, expected, tol, errors):
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  scale = max(np.max(np.abs(expected)), 1e-3)
  err = float(np.max(np.abs(actual - expected)))
  errors[name] = err / scale
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale,
                             err_msg=name)


def _check(args, seg, tol, chunk_size, store_states=False, with_state=True,
           upcast_reference=False):
  """Kernel vs reference on the same inputs. upcast_reference: the reference
  gets float32 copies of (BF16) inputs, so its outputs and gradients are
  unrounded float32 and the comparison sees the kernel's BF16 rounding."""
  q, k, v, g, beta, s0 = args
  if s0 is None:
    s0 = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
  args = (q, k, v, g, beta, s0)
  ref_args = tuple(x.astype(jnp.float32) for x in args) if upcast_reference else args
  got = _value_and_grad("pallas", chunk_size, store_states, with_state)(
      *args, seg)
  want = _value_and_grad("reference", with_state=with_state)(*ref_args, seg)
  (g_p, (o_p, s_p)), (g_r, (o_r, s_r)) = got, want
  assert o_p.dtype == v.dtype and s_p.dtype == jnp.float32
  errors = {}
  _close("o", o_p, o_r, tol, errors)
  _close("final_state", s_p, s_r, tol, errors)
  names = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
  for name, a, x, b in zip(names, g_p, args, g_r):
    if name == "d_initial_state" and not with_state:
      continue
    assert a.dtype == x.dtype, (name, a.dtype, x.dtype)
    _close(name, a, b, tol, errors)
  return errors


def test_fp32_mixed_decays_padding_initial_state():
  """T = 40 with C = 16 (two full chunks and a padded one), both gates and a
  g-down-to--20 head, a random initial state, recomputed states (default)."""
  args = _inputs(2, 40, 2, 16, 16, seed=0, gate="mixed")
  errors = _check(args, None, 1e-4, chunk_size=16)
  print("fp32 max |err| / max |ref|:", errors)


def test_fp32_segments_two_tile_levels_stored_states():
  """C = 32 (two 16-token tiles: both score levels), packed documents whose
  boundaries fall inside chunks and on a chunk boundary, stored states."""
  args = _inputs(1, 64, 1, 32, 16, seed=1, gate="softplus")
  seg = jnp.array([[0] * 5 + [3] * 27 + [4] * 20 + [9] * 12])  # [1, 64]
  errors = _check(args, seg, 1e-4, chunk_size=32, store_states=True)
  print("fp32 segments max |err| / max |ref|:", errors)


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "strong"])
@pytest.mark.parametrize("T,C", [(64, 32), (100, 64), (37, 16)])
def test_fp32_sweep(gate, T, C):
  args = _inputs(2, T, 2, 32, 32, seed=T + C, gate=gate)
  errors = _check(args, None, 1e-4, chunk_size=C)
  print(f"fp32 {gate} T={T} C={C} max |err| / max |ref|:", errors)


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["lower_bound", "mixed"])
def test_bf16_inputs(gate):
  args = _inputs(2, 50, 2, 16, 16, seed=3, gate=gate, dtype=jnp.bfloat16)
  errors = _check(args, None, 1e-2, chunk_size=16, upcast_reference=True)
  print("bf16 max |err| / max |ref|:", errors)


@pytest.mark.slow
def test_segments_no_initial_state_sweep():
  """Several documents per row (incl. one-token documents and a boundary at
  token 1), two rows with different layouts, no initial state."""
  args = _inputs(2, 70, 2, 16, 16, seed=4, gate="mixed", with_state=False)
  seg = jnp.array([[0] + [1] * 20 + [2] + [3] * 30 + [4] * 18,
                   [5] * 32 + [6] * 32 + [7] * 6])
  errors = _check(args, seg, 1e-4, chunk_size=32, with_state=False)
  print("fp32 segments, no state, max |err| / max |ref|:", errors)


@pytest.mark.slow
def test_forward_only_no_state_matches_chunk_reference():
  """The primal path without gradients or initial state: o equals the
  reference chunk form, and final_state is None unless asked for."""
  q, k, v, g, beta, _ = _inputs(1, 24, 1, 16, 16, seed=5, gate="lower_bound")
  o, s = _jit(functools.partial(pk.chunk_kda, chunk_size=16, interpret=True))(
      q, k, v, g, beta)
  o_r, _ = ref.chunk_kda(q, k, v, g, beta, chunk_size=16)
  assert s is None
  np.testing.assert_allclose(o, o_r, rtol=1e-4, atol=1e-4 * np.abs(o_r).max())


def test_bad_shapes_raise():
  q = k = g = jnp.zeros((1, 16, 1, 16))
  v = jnp.zeros((1, 16, 1, 16))
  beta = jnp.zeros((1, 16, 1))
  s0 = jnp.zeros((1, 1, 16, 16))
  with pytest.raises(ValueError, match="beta has shape"):
    pk.chunk_kda(q, k, v, g, beta[..., None], interpret=True)
  with pytest.raises(ValueError, match="initial_state has shape"):
    pk.chunk_kda(q, k, v, g, beta, initial_state=s0[:, :, :8], interpret=True)
  with pytest.raises(ValueError, match="chunk_size must be positive"):
    pk.chunk_kda(q, k, v, g, beta, chunk_size=0, interpret=True)
  with pytest.raises(ValueError, match="multiple of 16"):   # BF16 tiling
    pk.chunk_kda(*(x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)),
                 chunk_size=8)


def _tpu_compile(topology, dtype, T=256, segments=True):
  """Lower and compile forward and forward+backward through Mosaic for a TPU
  topology (compile-only devices), the kernel inside shard_map over batch and
  heads. Returns the two compiled executables."""
  # Another process (a parallel test or benchmark) may hold libtpu's lock;
  # compile-only use is safe to share.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from pod.topology import topology_devices
  devs = np.array(topology_devices(topology))
  mesh = Mesh(devs.reshape(len(devs) // 2, 2), ("b", "h"))
  B, H, K, V = len(devs) // 2, 4, 128, 128
  tok = P("b", None, "h")

  def local(q, k, v, g, beta, s0, seg):
    return pk.chunk_kda(q, k, v, g, beta, initial_state=s0,
                        output_final_state=True, chunk_size=64,
                        segment_ids=seg if segments else None)

  fwd = jax.shard_map(local, mesh=mesh,
                      in_specs=(tok,) * 5 + (P("b", "h"), P("b")),
                      out_specs=(tok, P("b", "h")), check_vma=False)

  def loss(*args):
    o, s = fwd(*args)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(
      shape, dt, sharding=NamedSharding(mesh, spec))
  args = (sds((B, T, H, K), dtype, tok), sds((B, T, H, K), dtype, tok),
          sds((B, T, H, V), dtype, tok), sds((B, T, H, K), jnp.float32, tok),
          sds((B, T, H), dtype, tok), sds((B, H, K, V), jnp.float32, P("b", "h")),
          sds((B, T), jnp.int32, P("b")))
  return [jax.jit(f).lower(*args).compile()
          for f in (fwd, jax.grad(loss, argnums=range(6)))]


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tpu_compile(topology, dtype):
  """Forward and backward kernels lower through Mosaic and compile for each
  TPU generation at K = V = 128, C = 64, with segments (the superset path);
  the compiled program contains the Pallas custom calls."""
  for c in _tpu_compile(topology, dtype):
    assert "tpu_custom_call" in c.as_text()
