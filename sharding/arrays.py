"""Pytrees of arrays (or ShapeDtypeStructs) and their shardings: abstract values carrying
shardings, whole and per-device bytes, and the batch shardings of caches (which carry no
logical axes). Used by the jobs that place state (train, serve) and by `compile`."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import logical_to_spec


def with_shardings(shapes, shardings):
  """ShapeDtypeStructs of `shapes` carrying `shardings` (a prefix tree of `shapes`)."""
  def attach(sh, sub):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), sub)
  return jax.tree.map(attach, shardings, shapes,
                      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def all_finite(tree) -> jax.Array:
  """Whether every float leaf of `tree` is finite, as one traced boolean (the train step's
  guard; a restored checkpoint's check jits it)."""
  leaves = [jax.numpy.isfinite(x).all() for x in jax.tree.leaves(tree)
            if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]   # (bfloat16 too)
  return jax.numpy.stack(leaves).all() if leaves else jax.numpy.bool_(True)


def tree_bytes(tree) -> int:
  """Bytes of a pytree of arrays or ShapeDtypeStructs, whole (not per device)."""
  return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def shard_bytes(shapes, shardings) -> int:
  """Bytes one device holds of `shapes` (arrays or ShapeDtypeStructs) laid out by
  `shardings` (a prefix tree of it): per leaf, its shard's shape times the item size."""
  def one(sh, sub):
    return sum(math.prod(sh.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(sub))
  per_prefix = jax.tree.map(one, shardings, shapes,
                            is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return int(sum(jax.tree.leaves(per_prefix)))


def batch_shardings(tree, mesh: Mesh, batch_dim=0, seq_dim=None):
  """Shardings for a pytree of arrays whose dimension `batch_dim` (an int, or a function of
  the leaf's key path returning one, or None for replicated) is the batch: that dimension
  goes over the batch's mesh axes (per the rules table), the rest stay whole. Used for
  decode caches, which carry no logical axes. seq_dim (same forms; None: none) names a
  cache's length dimension: it takes the mesh axes the batch could not use ("cache_seq"
  in the rules), so a long cache of a small batch is split instead of repeated."""
  def one(path, a):
    dim = batch_dim(path) if callable(batch_dim) else batch_dim
    if dim is None or a.ndim <= dim:
      return NamedSharding(mesh, PartitionSpec())
    axes = [None] * a.ndim
    axes[dim] = "batch"
    sdim = seq_dim(path) if callable(seq_dim) else seq_dim
    if sdim is not None and sdim < a.ndim:
      axes[sdim] = "cache_seq"
    return NamedSharding(mesh, logical_to_spec(a.shape, tuple(axes), mesh))
  return jax.tree_util.tree_map_with_path(one, tree)


__all__ = ["with_shardings", "tree_bytes", "shard_bytes", "batch_shardings"]
