"""Logical-axis sharding hooks used by model code.

Model code names logical axes only ("batch", "seq", "embed", "heads", ...). The mapping to
mesh axes lives in `sharding/`, which installs it here with `use_rules(mesh, rules)`.
Without installed rules, `constrain` is the identity, so single-device code is untouched.

Kernels (Pallas / Mosaic calls) cannot be partitioned by the compiler: on a mesh they must run
per shard inside `shard_map`. `shard_kernel` gives model code that by logical names too; the
wrapping itself is installed by `sharding/` along with the rules (`use_kernel_sharding`).
`target_platform` tells model code what the traced program is compiled for (the platform of
the installed mesh's devices, which may be compile-only TPU devices on a CPU host), so it can
choose kernels for the target rather than for the host.

Ops that need explicit collectives on a sharded mesh (expert-parallel MoE dispatch, context-
parallel KDA and MLA) are installed the same way, as one typed `ParallelOps` record, with
`use_parallel_ops`; a layer calls `parallel_ops().<op> or reference`, i.e. the reference op
unless `sharding/` installed a mesh-parallel version with the same signature for the active
mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable

import jax

# A function mapping (shape, logical axes) -> jax.sharding.Sharding, or None.
_RESOLVER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("k3_resolver",
                                                                          default=None)


# (fn, in_axes, out_axes) -> fn run per shard on the installed mesh; and that mesh's platform.
_KERNEL_SHARDER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "k3_kernel_sharder", default=None)
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("k3_platform",
                                                                      default=None)


@contextlib.contextmanager
def use_resolver(resolver: Callable):
  token = _RESOLVER.set(resolver)
  try:
    yield
  finally:
    _RESOLVER.reset(token)


@dataclasses.dataclass(frozen=True)
class ParallelOps:
  """Mesh-parallel versions of ops, one field per op; None = run the reference (the
  partitioner handles it). Each takes the mesh-bound arguments of its reference:

    moe_dispatch      k3_jax.ops.moe.moe_dispatch(x, weights, expert_ids, w_gate, w_up,
                      w_down, activation, beta1, beta2, gmm), plus capacity_factor
                      (None = dropless; the expert-parallel buffer bound)
    chunk_kda         k3_jax.ops.kda.chunk.chunk_kda(q, k, v, g, beta, scale, initial_state,
                      output_final_state, chunk_size, segment_ids), plus local_fn (the
                      per-shard chunked KDA: reference or kernel)
    short_conv        k3_jax.ops.conv.short_conv(x, weight, segment_ids, cache)
    latent_attention  k3_jax.ops.attention.latent_attention(q_nope, q_rope, c_kv, k_r,
                      w_kvb, scale, dtype, q_segment_ids, kv_segment_ids, q_offset)
    absorbed_attention  k3_jax.ops.attention.blockwise_absorbed_attention(q_latent, q_rope,
                      c_kv, k_rope, scale, q_pos) (prefill over a cache)
  """
  moe_dispatch: Callable | None = None
  chunk_kda: Callable | None = None
  short_conv: Callable | None = None
  latent_attention: Callable | None = None
  absorbed_attention: Callable | None = None


_PARALLEL_OPS: contextvars.ContextVar[ParallelOps] = contextvars.ContextVar(
    "k3_parallel_ops", default=ParallelOps())


@contextlib.contextmanager
def use_parallel_ops(ops: ParallelOps):
  if not isinstance(ops, ParallelOps):
    raise TypeError(f"use_parallel_ops takes a ParallelOps, got {type(ops).__name__}")
  token = _PARALLEL_OPS.set(ops)
  try:
    yield
  finally:
    _PARALLEL_OPS.reset(token)


def parallel_ops() -> ParallelOps:
  """The mesh-parallel ops installed for the active mesh (fields None where there are none;
  an installed op must equal its single-device reference)."""
  return _PARALLEL_OPS.get()


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Sharding constraint by logical axis names; identity when no rules are installed."""
  resolver = _RESOLVER.get()
  if resolver is None:
    return x
  if len(axes) != x.ndim:
    raise ValueError(f"constrain: {len(axes)} logical axes {axes} for an array of rank {x.ndim}")
  return jax.lax.with_sharding_constraint(x, resolver(x.shape, axes))


def is_split(shape: tuple[int, ...], axes: tuple[str | None, ...], dim: int) -> bool:
  """Do the installed rules split dimension `dim` of an array of this shape and logical
  axes over the mesh? (False without installed rules.)"""
  resolver = _RESOLVER.get()
  if resolver is None:
    return False
  entry = resolver(tuple(shape), tuple(axes)).spec
  return len(entry) > dim and entry[dim] is not None


@contextlib.contextmanager
def use_kernel_sharding(sharder: Callable, platform: str):
  """Install how kernels run per shard (see `shard_kernel`) and the target platform."""
  t1, t2 = _KERNEL_SHARDER.set(sharder), _PLATFORM.set(platform)
  try:
    yield
  finally:
    _PLATFORM.reset(t2)
    _KERNEL_SHARDER.reset(t1)


def mesh_installed() -> bool:
  """Is a mesh installed (so a kernel called directly would be partitioned by the compiler,
  which Mosaic kernels do not allow)?"""
  return _KERNEL_SHARDER.get() is not None


def target_platform() -> str:
  """"tpu", "cpu", "gpu": the platform of the installed mesh, else JAX's default backend."""
  return _PLATFORM.get() or jax.default_backend()


def shard_kernel(fn: Callable, in_axes, out_axes) -> Callable:
  """`fn` (arrays -> arrays, written for one shard) as a function of the global arrays.

  in_axes: one tuple of logical axis names (or None = whole) per positional array; out_axes:
  the same for fn's outputs (a tuple of tuples for several outputs). Dimensions named alike
  are split alike. Without installed kernel sharding this is `fn` itself.
  """
  sharder = _KERNEL_SHARDER.get()
  return fn if sharder is None else sharder(fn, in_axes, out_axes)
