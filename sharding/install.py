"""Installs a mesh into model code: the logical-axis rules for its `constrain` calls, the
per-shard wrapping of its kernels, and the mesh-parallel ops (expert-parallel MoE,
context-parallel KDA and MLA) where the mesh has those axes.

Kept apart from sharding/rules.py (the leaf table every other sharding module reads) because
it imports the modules that build the parallel ops.
"""

from __future__ import annotations

import contextlib

from jax.sharding import Mesh

from k3_jax import partitioning
from sharding import context, expert, kernels
from sharding.rules import named_sharding


def mesh_parallel_ops(mesh: Mesh) -> partitioning.ParallelOps:
  """The explicit-collective ops for `mesh` (fields None where the mesh lacks the axis)."""
  return partitioning.ParallelOps(**expert.parallel_ops(mesh), **context.parallel_ops(mesh))


@contextlib.contextmanager
def activation_rules(mesh: Mesh):
  """Within this context, model code's `constrain` calls shard activations on `mesh`; its
  kernels run per shard of `mesh` (sharding/kernels.py); and `partitioning.parallel_ops()`
  gives the mesh's explicit-collective ops."""
  with partitioning.use_resolver(lambda shape, axes: named_sharding(mesh, shape, axes)), \
       partitioning.use_kernel_sharding(
           lambda fn, i, o: kernels.shard_map_kernel(mesh, fn, i, o),
           kernels.mesh_platform(mesh)), \
       partitioning.use_parallel_ops(mesh_parallel_ops(mesh)):
    yield


__all__ = ["activation_rules", "mesh_parallel_ops"]
