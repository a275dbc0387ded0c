"""Newton-Schulz once per matrix on a mesh: each orthogonalized block whole on one chip.

A Muon parameter is sharded like its weight: the matrix axes over fsdp (and the expert or
sequence axes the rules add), the batch axes (stacked layers, experts, heads) whole or
over their own axes, and every other mesh axis (data, the slices, sequence for dense
weights) holding copies. Left to the partitioner, Newton-Schulz gathers each matrix and
every chip of the group orthogonalizes all of the group's blocks (and each copy repeats
it): the same matrix computed fsdp x copies times.

`orthogonalize_owned` places the work instead (inside a shard_map, so the partitioner
cannot undo it): the local blocks are flattened onto one batch axis and padded; for each
sharded matrix axis one all-to-all over the mesh axes that split it trades the matrix
shards of all blocks for whole matrices of a 1/n share of the blocks; the mesh axes that
hold copies split the remaining blocks again (a slice, no communication); each chip
orthogonalizes its own blocks; one all-gather over the copies' axes and the reverse
all-to-alls put the result back where the input was. Per chip, ceil(blocks / shards)
matrices instead of every block. The math per block is `newton_schulz`'s, so the
result equals the replicated update to f32 summation order.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers

from k3_jax.optim.newton_schulz import newton_schulz


_DIMS = MuonDimensionNumbers(reduction_axis=1, output_axis=2)   # a stack [blocks, m, n]


class Owner(NamedTuple):
  """Where the Muon parameters lie: the mesh, and each parameter's PartitionSpec from its
  shape and logical axes (the rules the train state is sharded by)."""
  mesh: Mesh
  spec_of: Callable[[tuple[int, ...], tuple], PartitionSpec]


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


class Plan(NamedTuple):
  """How one parameter's blocks are placed (all static)."""
  perm: tuple[int, ...]              # batch axes, then reduction, then output axes
  n_batch: int                       # how many of perm are batch axes
  n_red: int
  matrix_axes: tuple[tuple[str, ...], ...]   # per reduction/output axis: its mesh axes
  copies: tuple[str, ...]            # mesh axes splitting the blocks again (hold copies)
  local_blocks: int                  # blocks on one chip before placement
  padded: int                        # local_blocks padded to shards x copies
  per_chip: int                      # blocks each chip orthogonalizes


def plan(shape: tuple[int, ...], red: tuple[int, ...], out: tuple[int, ...],
         spec: PartitionSpec, mesh: Mesh) -> Plan:
  """The placement of a parameter of `shape` (reduction axes `red`, output axes `out`,
  every other axis a batch axis) sharded by `spec` on `mesh`."""
  nd = len(shape)
  entries = tuple(spec) + (None,) * (nd - len(spec))
  batch = tuple(a for a in range(nd) if a not in red + out)
  size = lambda names: math.prod(mesh.shape[n] for n in names)
  local = math.prod(shape[a] // size(_names(entries[a])) for a in batch)
  matrix_axes = tuple(_names(entries[a]) for a in red + out)
  shards = math.prod(size(n) for n in matrix_axes)
  used = {n for e in entries for n in _names(e)}
  # Copies split the blocks only as far as there are blocks to split (a single matrix
  # stays computed on each copy: no chip is slower than it is now, nothing is padded).
  copies, n = [], 1
  per = -(-local // shards)
  for ax in mesh.axis_names:
    if ax not in used and mesh.shape[ax] > 1 and n * mesh.shape[ax] <= per:
      copies.append(ax)
      n *= mesh.shape[ax]
  padded = -(-local // (shards * n)) * shards * n
  return Plan(batch + red + out, len(batch), len(red), matrix_axes, tuple(copies), local,
              padded, padded // (shards * n))


def _all_to_all(y: jax.Array, names: tuple[str, ...], split: int, concat: int) -> jax.Array:
  """Tiled all-to-all of y over `names`, splitting axis `split` and concatenating `concat`,
  done on a [n, rest] view (split axis first, then contiguous): XLA:CPU's verifier rejects
  the tuple all-to-all JAX emits for some other axis pairs (operands of unequal layouts)."""
  n = math.prod(jax.lax.axis_size(a) for a in names)
  moved = jnp.moveaxis(y, split, 0)                         # split axis first
  c = concat + 1 if concat < split else concat              # where `concat` is in moved
  parts = moved.reshape((n, moved.shape[0] // n) + moved.shape[1:])
  parts = jax.lax.all_to_all(parts, names, 0, 0)           # axis 0: the peer it came from
  parts = jnp.moveaxis(parts, 0, c)                         # the peers just before `concat`
  merged = parts.reshape(parts.shape[:c] + (n * parts.shape[c + 1],) + parts.shape[c + 2:])
  return jnp.moveaxis(merged, 0, split)


def _local(x: jax.Array, p: Plan, steps: int) -> jax.Array:
  """The shard_map body: x is this chip's block of the parameter."""
  y = jnp.transpose(x, p.perm)
  bshape = y.shape[:p.n_batch]
  y = y.reshape((p.local_blocks,) + y.shape[p.n_batch:])
  if p.padded > p.local_blocks:
    y = jnp.pad(y, [(0, p.padded - p.local_blocks)] + [(0, 0)] * (y.ndim - 1))
  for j, names in enumerate(p.matrix_axes):         # matrix shards -> whole matrices
    if names:
      y = _all_to_all(y, names, 0, 1 + j)
  if p.copies:                                      # this copy's share of the blocks
    k = y.shape[0] // math.prod(jax.lax.axis_size(a) for a in p.copies)
    y = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(p.copies) * k, k, 0)
  whole = y.shape
  m = math.prod(whole[1:1 + p.n_red])
  z = newton_schulz(y.reshape(whole[0], m, -1), steps).reshape(whole)
  if p.copies:
    z = jax.lax.all_gather(z, p.copies, axis=0, tiled=True)
  for j in reversed(range(len(p.matrix_axes))):      # and back to matrix shards
    names = p.matrix_axes[j]
    if names:
      z = _all_to_all(z, names, 1 + j, 0)
  z = z[:p.local_blocks].reshape(bshape + z.shape[1:])
  return jnp.transpose(z, tuple(p.perm.index(a) for a in range(x.ndim)))


def block_flops(shape: tuple[int, ...], red: tuple[int, ...], out: tuple[int, ...],
                steps: int = 5) -> float:
  """FLOPs of `steps` Newton-Schulz iterations on one block (wide orientation, m <= n):
  X X^T (2 m^2 n), A A (2 m^3), (b A + c A^2) X (2 m^2 n) each."""
  m, n = math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)
  m, n = min(m, n), max(m, n)
  return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def orthogonalize_owned(x: jax.Array, dims, spec: PartitionSpec, mesh: Mesh,
                        steps: int = 5) -> jax.Array:
  """`muon.orthogonalize(x, dims)` for x sharded by `spec` on `mesh`, each block
  orthogonalized on one chip (see the module docstring). Returns x's sharding."""
  red = tuple(a % x.ndim for a in _tuple(dims.reduction_axis))
  out = tuple(a % x.ndim for a in _tuple(dims.output_axis))
  p = plan(tuple(x.shape), red, out, spec, mesh)
  fn = jax.shard_map(lambda b: _local(b, p, steps), mesh=mesh, in_specs=(spec,),
                     out_specs=spec, check_vma=False)
  return fn(x)


class _Canon(NamedTuple):
  """How a parameter becomes [blocks, m, n] (wide: m <= n) of a stack, and back."""
  perm: tuple[int, ...]
  shape: tuple[int, ...]             # after perm
  n_batch: int
  wide_swap: bool
  key: tuple                         # (m, n, spec of m, spec of n): its stack


def _canon(shape, dims, spec) -> _Canon | None:
  """A parameter whose blocks can join a stack without moving data: batch axes unsharded,
  and in each of its matrix groups (reduction, output) only the first axis sharded (so
  merging the group keeps its sharding). None otherwise (it is orthogonalized alone)."""
  nd = len(shape)
  entries = tuple(spec) + (None,) * (nd - len(spec))
  red = tuple(a % nd for a in _tuple(dims.reduction_axis))
  out = tuple(a % nd for a in _tuple(dims.output_axis))
  batch = tuple(a for a in range(nd) if a not in red + out)
  if any(entries[a] for a in batch) or any(entries[a] for g in (red, out) for a in g[1:]):
    return None
  m, n = math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)
  sm, sn = entries[red[0]], entries[out[0]]
  perm = batch + red + out
  swap = m > n
  key = (n, m, sn, sm) if swap else (m, n, sm, sn)
  return _Canon(perm, tuple(shape[a] for a in perm), len(batch), swap, key)


def orthogonalize_stacked(xs: list, dims: list, specs: list, mesh: Mesh,
                          steps: int = 5) -> list:
  """`orthogonalize_owned` of every parameter in `xs` (their MuonDimensionNumbers and
  PartitionSpecs in `dims`, `specs`), with the blocks of equal (wide) shape and matrix
  sharding stacked on one batch axis first: in one SPMD program every chip runs a
  parameter's padded share, so alone 22 stacked layers on 512 chips cost each chip a
  block per parameter; stacked, the blocks of all parameters of that shape fill the
  chips together (k3: the 93 layers' gate and output projections, 186 blocks, one
  block a chip). A transposed (tall) block is stacked as its transpose: Newton-Schulz
  of X^T is the transpose of Newton-Schulz of X (`newton_schulz` runs wide)."""
  out = [None] * len(xs)
  stacks: dict[tuple, list[int]] = {}
  canons = [_canon(x.shape, d, s) for x, d, s in zip(xs, dims, specs)]
  for i, c in enumerate(canons):
    if c is None:
      out[i] = orthogonalize_owned(xs[i], dims[i], specs[i], mesh, steps)
    else:
      stacks.setdefault(c.key, []).append(i)
  for (m, n, sm, sn), members in stacks.items():
    parts = []
    for i in members:
      c = canons[i]
      y = jnp.transpose(xs[i], c.perm).reshape(-1, *((n, m) if c.wide_swap else (m, n)))
      parts.append(jnp.swapaxes(y, 1, 2) if c.wide_swap else y)
    stack_spec = PartitionSpec(None, sm, sn)
    pin = lambda t: jax.lax.with_sharding_constraint(t, NamedSharding(mesh, stack_spec))
    stack = pin(jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0])
    done = pin(orthogonalize_owned(stack, _DIMS, stack_spec, mesh, steps))
    at = 0
    for i in members:
      c = canons[i]
      k = math.prod(c.shape[:c.n_batch])
      y = done[at:at + k]
      at += k
      y = (jnp.swapaxes(y, 1, 2) if c.wide_swap else y).reshape(c.shape)
      out[i] = jnp.transpose(y, tuple(c.perm.index(a) for a in range(y.ndim)))
  return out


def stacked_flops(shapes: list, dims: list, specs: list, mesh: Mesh, steps: int = 5) -> float:
  """Newton-Schulz FLOPs per chip of `orthogonalize_stacked` (static: from the shapes)."""
  total, stacks = 0.0, {}
  for shape, d, s in zip(shapes, dims, specs):
    c = _canon(shape, d, s)
    red = tuple(a % len(shape) for a in _tuple(d.reduction_axis))
    out = tuple(a % len(shape) for a in _tuple(d.output_axis))
    if c is None:
      total += plan(tuple(shape), red, out, s, mesh).per_chip * block_flops(shape, red, out, steps)
    else:
      stacks[c.key] = stacks.get(c.key, 0) + math.prod(c.shape[:c.n_batch])
  for (m, n, sm, sn), blocks in stacks.items():
    p = plan((blocks, m, n), (1,), (2,), PartitionSpec(None, sm, sn), mesh)
    total += p.per_chip * block_flops((m, n), (0,), (1,), steps)
  return total


def _tuple(a) -> tuple[int, ...]:
  return (a,) if isinstance(a, int) else tuple(a)


__all__ = ["Owner", "Plan", "plan", "block_flops", "orthogonalize_owned", "orthogonalize_stacked", "stacked_flops"]
