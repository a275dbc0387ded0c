"""The `Parallel` of a mesh (k3_jax/partitioning.py), the value model code is called with:
the logical-axis rules for its `constrain` calls, the per-shard wrapping of its kernels, the
mesh's platform, and the mesh-parallel ops (expert-parallel MoE, context-parallel KDA and
MLA, the paged decode attention over split page pools) where the mesh has those axes.

Kept apart from sharding/rules.py (the leaf table every other sharding module reads) because
it imports the modules that build the parallel ops.
"""

from __future__ import annotations

import functools

from jax.sharding import Mesh

from k3_jax import partitioning
from k3_jax.execution import DEFAULT_KERNELS, Kernels
from sharding import context, expert, paged
from sharding import kernels as mesh_kernels
from sharding.rules import named_sharding


def mesh_parallel_ops(mesh: Mesh, page_split: str = "column") -> partitioning.ParallelOps:
  """The explicit-collective ops for `mesh` (fields None where the mesh lacks the axis);
  page_split: how the serving cache's pages lie over the mesh (sharding/paged.py)."""
  slot = page_split == "slot"           # the node decode's layout: gathers in two stages
  return partitioning.ParallelOps(**expert.parallel_ops(mesh, staged_gather=slot),
                                  **context.parallel_ops(mesh),
                                  **paged.parallel_ops(mesh, page_split))


@functools.lru_cache(maxsize=64)
def parallel_for(mesh: Mesh | None, page_split: str = "column",
                 kernels: Kernels = DEFAULT_KERNELS, token_groups: int = 1
                 ) -> partitioning.Parallel:
  """The program's parallel setup on `mesh` (`partitioning.SINGLE` for None and the default
  kernels; one device with `kernels` otherwise): model code called with it shards
  activations by the rules table, runs kernels per shard and takes the mesh's
  explicit-collective ops. Memoised per mesh, and equal for equal meshes in any
  case (compared by the mesh and its platform), so a jitted step keyed on it recompiles for
  a different mesh only. page_split="slot": the paged decode attention for pages laid out
  by sequence (paged.PAGE_SPLITS; part of the value's key). kernels: the job's kernel
  choices (k3_jax/execution.py), read by the layers from the value. token_groups (slot
  only): the node decode's token groups a (`partitioning.token_groups`; the weights must
  be laid out for the same a: compile.weights_by_output's `groups`)."""
  if mesh is None:
    return (partitioning.SINGLE if kernels == DEFAULT_KERNELS
            else partitioning.Parallel(kernels=kernels))
  key = None if page_split == "column" else ("page_split", page_split)    # slot: SLOT_KEY
  if page_split == "slot" and token_groups > 1:
    key = key + (token_groups,)
  return partitioning.Parallel(
      mesh=mesh, target=mesh_kernels.mesh_platform(mesh), kernels=kernels, key=key,
      ops=mesh_parallel_ops(mesh, page_split),
      resolver=functools.partial(named_sharding, mesh),
      sharder=functools.partial(mesh_kernels.shard_map_kernel, mesh))


__all__ = ["mesh_parallel_ops", "parallel_for"]
