"""Kernels on a mesh: run a per-shard kernel (a Pallas / Mosaic call) inside shard_map.

XLA cannot partition a Mosaic custom call, so a kernel called on sharded arrays must be
wrapped in `jax.shard_map`: each device runs the kernel on its own block. Model code asks
for that by logical names through `Parallel.shard_kernel` (k3_jax/partitioning.py); this
module turns the names into PartitionSpecs with the same rules table as every other array
(`sharding.rules`), so e.g. "batch" splits over data+fsdp and "heads" over tensor.
Dimensions a kernel must see whole (time for the chunked KDA scan, head dims) are named None
and are gathered.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from sharding.rules import RULES, logical_to_spec


def _is_axes(x) -> bool:
  """One array's logical axes: a tuple of names / None (not a tuple of such tuples)."""
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def kernel_specs(mesh: Mesh, shapes, in_axes, out_axes, rules=RULES):
  """(in_specs, out_specs) for arrays of `shapes` named `in_axes`, outputs named `out_axes`.

  Each logical name gets ONE assignment of mesh axes for the whole call, resolved (by the
  rules table, dropping mesh axes that do not divide) at the size of its first occurrence
  among the inputs, so that every dimension with that name is split the same way. Names
  seen only in outputs are not split.
  """
  sizes: dict[str, int] = {}
  for shape, axes in zip(shapes, in_axes):
    if len(shape) != len(axes):
      raise ValueError(f"kernel input of shape {shape} named by {len(axes)} axes {axes}")
    for dim, name in zip(shape, axes):
      if name is not None:
        sizes.setdefault(name, dim)
  names = tuple(sizes)
  joint = logical_to_spec(tuple(sizes[n] for n in names), names, mesh, rules)
  assign = dict(zip(names, joint))
  spec = lambda axes: PartitionSpec(*(assign.get(n) if n else None for n in axes))
  in_specs = tuple(spec(a) for a in in_axes)
  out_specs = spec(out_axes) if _is_axes(out_axes) else tuple(spec(a) for a in out_axes)
  return in_specs, out_specs


def shard_map_kernel(mesh: Mesh, fn: Callable, in_axes, out_axes) -> Callable:
  """`fn` run per shard of `mesh` (see kernel_specs for how names become specs)."""
  in_axes = tuple(tuple(a) for a in in_axes)

  def wrapped(*arrays):
    if len(arrays) != len(in_axes):
      raise ValueError(f"kernel called with {len(arrays)} arrays, named {len(in_axes)}")
    in_specs, out_specs = kernel_specs(mesh, [x.shape for x in arrays], in_axes, out_axes)
    # check_vma=False: a Pallas call has no rule for varying-manual-axes inference.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*arrays)

  return wrapped


def mesh_platform(mesh: Mesh) -> str:
  """The platform the mesh's devices belong to ("tpu" also for compile-only TPU devices)."""
  return mesh.devices.flat[0].platform
