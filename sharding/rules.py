"""The one table mapping logical axis names to mesh axes, and the resolver that applies it.
A leaf of sharding/: the value model code is called with (the rules, the mesh-parallel
ops: `partitioning.Parallel`) is built in sharding/install.py.

Resolution of one array: each logical axis maps to zero or more mesh axes; a mesh axis
already used by an earlier dimension is dropped (activations: "batch" takes data+fsdp, so
"embed" stays whole there while parameters shard "embed" over fsdp), and mesh axes that do
not divide the dimension are dropped (the dimension is replicated over them).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec


MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")

RULES: dict[str, tuple[str, ...]] = {
    # activations: the batch is split over every axis that does not split the sequence or
    # the heads, so no device repeats another's work (the expert axis holds different
    # tokens too; expert parallelism sends each token-expert pair to its expert's owner)
    "batch": ("data", "fsdp", "expert"),
    # the sequence: over `sequence`, and over the batch axes a batch too small for them left
    # unused (one 1M-token prompt on an expert mesh: its tokens split over the experts'
    # chips, which expert parallelism then exchanges as it does batch rows)
    "seq": ("sequence", "expert", "fsdp", "data"),
    # the length of a prefill / decode cache (MLA latents): over the axes its batch left
    # unused, so a 1M-token cache of a few sequences is split over the mesh, not repeated
    "cache_seq": ("sequence", "expert", "fsdp", "data", "tensor"),
    # parameters (and activations where they appear)
    # parameters' model dimension: over fsdp, and over the expert axis too where the batch
    # has not taken it (dense weights then split over every device of an expert mesh
    # instead of repeating on each expert group; activations keep "embed" whole since
    # "batch" took those axes first)
    "embed": ("fsdp", "expert"),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": ("expert",),
    # routed experts' model dimension: over fsdp and the sequence axis too (the experts are
    # nearly all of k3's parameters; without it every sequence shard would hold a whole
    # copy of its fsdp shard of them and of their optimizer state)
    "expert_embed": ("fsdp", "sequence"),
    "expert_mlp": ("tensor",),
    # MLA's low-rank inputs to its head projections (q_b, kv_b: [rank, heads, head_dim]):
    # split like "embed" so those weights are not whole on every device when heads cannot
    # split (tensor axis 1, or 96 heads over 64 devices)
    "q_lora": ("fsdp", "expert"),
    "kv_lora": ("fsdp", "expert"),
    # vision tower (k3_jax/vision): its width is "embed", heads "heads", MLP "mlp"; the merged
    # 2 x 2 features entering the projector split like "embed"
    "merged": ("fsdp", "expert"),
    # never sharded
    "patch": (), "pos_grid": (), "qkv": (),
    "head_dim": (), "conv": (), "rank": (), "latent": (),
    "norm": (), "layers": (),
}


def logical_to_spec(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mesh,
                    rules: dict[str, tuple[str, ...]] = RULES) -> PartitionSpec:
  if len(axes) != len(shape):
    raise ValueError(f"{len(axes)} logical axes {axes} for shape {shape}")
  used: set[str] = set()
  spec = []
  for dim, name in zip(shape, axes):
    if name is not None and name not in rules:
      raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
    chosen = []
    size = 1
    for ax in rules.get(name, ()) if name else ():
      n = mesh.shape[ax]
      if ax in used or n == 1 or dim % (size * n):
        continue
      chosen.append(ax)
      size *= n
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, shape, axes) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(tuple(shape), tuple(axes), mesh))


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def tree_shardings(tree, mesh: Mesh):
  """Shardings for a pytree holding nnx Variables (params, optimizer state): each Variable
  by its logical axes, everything else replicated. The result is a prefix tree of `tree`."""
  replicated = NamedSharding(mesh, PartitionSpec())

  def one(x):
    if _is_var(x) and hasattr(x.get_raw_value(), "shape"):   # (masked optimizer slots: none)
      axes = x.get_metadata().get("logical_axes")
      if axes is not None and len(axes) == len(x.shape):
        return named_sharding(mesh, x.shape, axes)
    return replicated

  return jax.tree.map(one, tree, is_leaf=_is_var)
