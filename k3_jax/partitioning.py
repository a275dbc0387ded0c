"""Logical-axis sharding as one explicit value that model code is called with.

Model code names logical axes only ("batch", "seq", "embed", "heads", ...). What the names
mean on a mesh lives in `sharding/`, which builds a `Parallel` for a mesh
(`sharding.install.parallel_for`): the rules table resolving names to mesh axes (for
`constrain` and `is_split`), the per-shard wrapping of kernels (`shard_kernel`: Pallas /
Mosaic calls cannot be partitioned by the compiler, so on a mesh they run per shard inside
`shard_map`), the target platform (the mesh's, which may be compile-only TPU devices on a
CPU host, so kernels are chosen for the target rather than the host), and the ops that need
explicit collectives on a sharded mesh (expert-parallel MoE dispatch, context-parallel KDA
and MLA) as one typed `ParallelOps` record; a layer calls `par.ops.<op> or reference`.

Every layer, sublayer and op that shards, picks a kernel or calls a parallel op takes the
`Parallel` as its `par` argument; the default `SINGLE` is the single-device program
(`constrain` is the identity, kernels are called directly, the reference ops run). A
`Parallel` is hashable and compared by what determines the traced program (the mesh, the
target platform, the kernel choices and an optional key), not by its callables, so it is a
static value under jit: a step that takes it as a static argument, or is built per `Parallel` and closes over
it, can never reuse a program traced for another setup, while an equal rebuilt setup reuses
the compile; and a step built without one is the single-device program by construction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp

from k3_jax.execution import DEFAULT_KERNELS, Kernels


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
    paged_attention   k3_jax.layers.mla.paged_attention(q_latent, q_rope, pool_c, pool_r,
                      unit, table, pos, scale, block) (decode over page pools: the softmax
                      partials of the cached positions)
  """
  moe_dispatch: Callable | None = None
  chunk_kda: Callable | None = None
  short_conv: Callable | None = None
  latent_attention: Callable | None = None
  absorbed_attention: Callable | None = None
  paged_attention: Callable | None = None


def _callables(ops: ParallelOps) -> bool:
  return any(getattr(ops, f.name) is not None for f in dataclasses.fields(ops))


@dataclasses.dataclass(frozen=True)
class Parallel:
  """How the traced program is parallelised: a static, hashable value (see the module
  docstring). Build it with `sharding.install.parallel_for(mesh)`; `SINGLE` is one device.

  mesh: the mesh (hashable) or None; target: its platform ("tpu", "cpu", "gpu"; None = JAX's
  default backend); key: anything else that tells two setups apart (a hand-built Parallel
  carrying its own ops needs one); kernels: the job's kernel choices (grouped matmul,
  expert-parallel capacity, KDA backend and chunk; k3_jax/execution.py), which layers read
  here rather than from their config. These four are the identity of the value. The
  callables (ops, resolver: (shape, logical axes) -> Sharding, sharder: (fn, in_axes,
  out_axes) -> fn per shard) are carried alongside and not compared: two Parallels that
  compare equal must trace the same program, which `parallel_for` guarantees.
  """
  mesh: Any = None
  target: str | None = None
  key: Hashable = None
  kernels: Kernels = DEFAULT_KERNELS
  ops: ParallelOps = dataclasses.field(default_factory=ParallelOps, compare=False)
  resolver: Callable | None = dataclasses.field(default=None, compare=False, repr=False)
  sharder: Callable | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    if not isinstance(self.ops, ParallelOps):
      raise TypeError(f"Parallel.ops takes a ParallelOps, got {type(self.ops).__name__}")
    if not isinstance(self.kernels, Kernels):
      raise TypeError(f"Parallel.kernels takes a Kernels, got {type(self.kernels).__name__}")
    carries = _callables(self.ops) or self.resolver is not None or self.sharder is not None
    if carries and self.mesh is None and self.key is None:
      raise ValueError("a Parallel carrying ops, rules or kernel sharding needs a mesh or a "
                       "key: it is compared by those, never by its callables")

  @property
  def platform(self) -> str:
    """"tpu", "cpu", "gpu": what the program is compiled for (the mesh's platform, else
    JAX's default backend)."""
    return self.target or jax.default_backend()

  @property
  def batch_fills_mesh(self) -> bool:
    """Is this the decode layout of a batch that fills the mesh (`parallel_for(mesh,
    "slot")`): pages by sequence, the batch over every axis of the pages, the dense weights
    split on their output dimension (k3_jax/compile.py weights_by_output)?"""
    return self.key == SLOT_KEY or (isinstance(self.key, tuple) and len(self.key) == 3
                                    and self.key[:2] == SLOT_KEY)

  @property
  def token_groups(self) -> int:
    """a, the token groups of the node decode's two-way split (`token_groups`): the
    by-output projections run on the devices viewed as [a, n / a], each device the tokens
    of its group and 1 / (n / a) of each weight's outputs (`grouped_mesh`); 1 = every
    device all the step's tokens and 1 / n of each weight (the key's third entry)."""
    return self.key[2] if self.batch_fills_mesh and len(self.key) == 3 else 1

  def _grouped(self):
    """The [a, n / a] view of the mesh where the token groups apply, else None."""
    if self.token_groups == 1 or self.resolver is None:
      return None
    return grouped_mesh(self.mesh, self.token_groups)

  @property
  def kernels_sharded(self) -> bool:
    """Do kernels run per shard (so a kernel called directly would be partitioned by the
    compiler, which Mosaic kernels do not allow)?"""
    return self.sharder is not None

  def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axis names; identity without rules (one device)."""
    if self.resolver is None:
      return x
    if len(axes) != x.ndim:
      raise ValueError(f"constrain: {len(axes)} logical axes {axes} for an array of rank "
                       f"{x.ndim}")
    return jax.lax.with_sharding_constraint(x, self.resolver(x.shape, axes))

  def gathered(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """x, laid out by the logical `axes` (e.g. ("batch", None): the step's tokens split by
    sequence), whole on every device. In the decode layout of a batch that fills the mesh
    (`batch_fills_mesh`) by explicit all-gathers in two stages (`staged_gather`): the TPU
    compiler turns a gather over the whole mesh in one group (the partitioner's, or an
    explicit one) into a dynamic-update-slice into zeros and an all-reduce, ~3 passes over
    the gathered buffer where a gather writes it once (k3 v5p-128: ~1 GB a chip a step at
    64 x 1M). Identity in any other layout."""
    if not self.batch_fills_mesh or self.resolver is None:
      return x
    spec = self.resolver(x.shape, axes).spec
    view = self._grouped()
    if view is not None:
      y = group_gather(x, view, spec, axes)
      if y is not None:
        return y
    return staged_gather(x, self.mesh, spec)

  def heads_grouped(self, heads: int) -> bool:
    """Do the node decode's token groups split `heads` over a group's devices
    (`grouped_heads`; MLA then absorbs kv_b per head where its heads lie, layers/mla.py)?"""
    view = self._grouped()
    return view is not None and grouped_heads(heads, view)

  def gathered_heads(self, x: jax.Array) -> jax.Array:
    """x [B, ..., H, K] laid out by token group, its heads over the group's devices (as
    `by_output(x, heads=True)` leaves it), gathered whole within each group: one
    all-gather over the group's devices (`heads_grouped` only)."""
    from jax.sharding import PartitionSpec
    tg, og = GROUP_AXES
    mid = [None] * (x.ndim - 3)
    return jax.shard_map(lambda v: jax.lax.all_gather(v, og, axis=x.ndim - 2, tiled=True),
                         mesh=self._grouped(), in_specs=PartitionSpec(tg, *mid, og, None),
                         out_specs=PartitionSpec(tg, *mid, None, None), check_vma=False)(x)

  def einsum_by_batch(self, subscripts: str, x: jax.Array, w: jax.Array,
                      x_axes: tuple[str | None, ...], w_axes: tuple[str | None, ...]):
    """einsum(subscripts, x, w) for a contraction over a dimension split alike in x and w
    (laid out by the logical x_axes, w_axes), its output [B, ...] split by sequence. In the
    decode layout of a batch that fills the mesh (`batch_fills_mesh`) the partial sums are
    reduce-scattered in two stages (`staged_einsum_by_batch`), where the partitioner
    all-reduced them whole (the TPU compiler's only form for a reduce-scatter over every
    device). A plain einsum in any other layout."""
    if self.batch_fills_mesh and self.resolver is not None:
      y = staged_einsum_by_batch(subscripts, x, w, self.mesh,
                                 self.resolver(x.shape, x_axes).spec,
                                 self.resolver(w.shape, w_axes).spec)
      if y is not None:
        return y
    return jnp.einsum(subscripts, x, w)

  def by_output(self, y: jax.Array, grouped: bool = True, heads: bool = False) -> jax.Array:
    """A projection's output y [..., F] in the decode layout of a batch that fills the mesh
    (`batch_fills_mesh`: the dense weights split on their output dimension over the model
    dimension's axes, k3_jax/compile.py weights_by_output) constrained to its weight's split:
    F over those axes, the rest whole, so the partitioner gathers the step's few tokens
    instead of the weight (it gathered the MoE latent projection, the router and the LM head
    whole, every step). With token groups (`token_groups` > 1; grouped=False: a weight
    kept on the one-way split, the LM head) the rows by group and F over the group's
    devices, or with heads=True (an output [..., H, K] whose weight splits its heads,
    `grouped_heads`) H over them. Identity in any other layout."""
    if not self.batch_fills_mesh:
      return y
    view = self._grouped() if grouped else None
    if view is not None:
      from jax.sharding import NamedSharding, PartitionSpec
      dim = y.ndim - 2 if heads and grouped_heads(y.shape[-2], view) else y.ndim - 1
      spec = [None] * y.ndim
      spec[0], spec[dim] = GROUP_AXES
      return jax.lax.with_sharding_constraint(y, NamedSharding(view, PartitionSpec(*spec)))
    return self.constrain(y, (None,) * (y.ndim - 1) + ("embed",))

  def by_input(self, x: jax.Array) -> jax.Array:
    """The input x [..., D] of a projection whose weight keeps its model dimension split in
    the decode layout of a batch that fills the mesh (`batch_fills_mesh`; a weight whose
    output the mesh does not divide, e.g. KDA's b_proj [D, 96] on 64 chips) constrained to
    that split: each chip contracts its own slice of D and the small [..., F] partial sums
    are reduced, where the partitioner gathered the weight whole every layer. The same
    constraint as `by_output` (the model dimension's axes on the last dimension), on the
    other side of a matmul. Identity in any other layout."""
    return self.by_output(x, grouped=False)

  def by_batch(self, y: jax.Array) -> jax.Array:
    """A by-output projection's low-rank output y [B, ..., r] split by sequence again in
    the decode layout of a batch that fills the mesh, before a projection that contracts r
    with its weight whole (KDA's decay up-projection): an all-to-all of the small [B, r]
    instead of that projection's partial sums all-reduced at its [B, H, K] output.
    Identity in any other layout."""
    if not self.batch_fills_mesh:
      return y
    return self.constrain(y, ("batch",) + (None,) * (y.ndim - 1))

  def is_split(self, shape: tuple[int, ...], axes: tuple[str | None, ...], dim: int) -> bool:
    """Do the rules split dimension `dim` of an array of this shape and logical axes over
    the mesh? (False without rules.)"""
    if self.resolver is None:
      return False
    entry = self.resolver(tuple(shape), tuple(axes)).spec
    return len(entry) > dim and entry[dim] is not None

  def shard_kernel(self, fn: Callable, in_axes, out_axes) -> Callable:
    """`fn` (arrays -> arrays, written for one shard) as a function of the global arrays.

    in_axes: one tuple of logical axis names (or None = whole) per positional array;
    out_axes: the same for fn's outputs (a tuple of tuples for several outputs). Dimensions
    named alike are split alike. Without kernel sharding this is `fn` itself.
    """
    return fn if self.sharder is None else self.sharder(fn, in_axes, out_axes)


def _stages(n: int, block: int = 1) -> tuple[int, int] | None:
  """(outer, inner) group sizes for a collective over n devices in two stages: inner the
  largest divisor of n at most sqrt(n), above 1, or 4 where each device's part of the split
  dimension (`block`) is at least 8 rows (a tile's) and 4 divides n; None when n has no
  divisor above 1 and below it (a prime, or < 4). Measured alone on the compile-only
  v5p-128, a [B, 7,168] gather and a matmul after it: B = 64 (1 row a chip) 3.9 MB a chip
  at 8 x 8, 5.7 at 16 x 4 (the first stage's [4, 1, 7,168] held in 2-row tiles); B = 1,024
  (16 rows) 33.5 MB at 16 x 4, 35.4 at 8 x 8 (61.5 in one group)."""
  if block >= 8 and n % 4 == 0 and n > 4:
    return n // 4, 4
  inner = max((d for d in range(2, math.isqrt(n) + 1) if n % d == 0), default=None)
  return None if inner is None else (n // inner, inner)


_STAGED = ("gather_outer", "gather_inner")


def _axes(entry) -> tuple:
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _staged_mesh(mesh, axes: tuple, block: int = 1):
  """`mesh`'s devices viewed as [outer, inner, the axes not in `axes`] (`_STAGED` names the
  first two; shard s over `axes` = outer * inner_size + inner, as a spec splitting a
  dimension over `axes` numbers them), or None where their device count has no two-stage
  factoring (`_stages`, for a split dimension of `block` rows a device)."""
  from jax.sharding import Mesh
  stages = _stages(math.prod(mesh.shape[a] for a in axes), block) if axes else None
  if stages is None:
    return None
  names = tuple(mesh.axis_names)
  rest = tuple(a for a in names if a not in axes)
  devices = mesh.devices.transpose([names.index(a) for a in axes + rest])
  return Mesh(devices.reshape(stages + tuple(mesh.shape[a] for a in rest)), _STAGED + rest)


def staged_gather(x: jax.Array, mesh, spec) -> jax.Array:
  """x (laid out by the PartitionSpec `spec` on `mesh`, one dimension split) gathered whole
  on every device by two all-gathers, over groups of `inner` then `outer` devices of that
  dimension's mesh axes (`_stages`), in a `shard_map` over the same devices viewed as
  [outer, inner, the other axes] (shard s of the dimension = outer * inner_size + inner, as
  the spec splits it). The TPU compiler keeps a gather over part of the mesh a gather, where
  it does one over every device as an all-reduce of a zero-filled buffer. Falls back to a
  plain constraint (x whole) when no dimension, or more than one, is split, or the split's
  device count has no two-stage factoring."""
  from jax.sharding import NamedSharding, PartitionSpec
  entries = list(spec) + [None] * (x.ndim - len(spec))
  split = [d for d, e in enumerate(entries) if e is not None]
  whole = lambda: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))
  if len(split) != 1:
    return whole()
  dim, axes = split[0], _axes(entries[split[0]])
  staged = _staged_mesh(mesh, axes, x.shape[dim] // math.prod(mesh.shape[a] for a in axes))
  if staged is None:
    return whole()
  in_spec = PartitionSpec(*[_STAGED if d == dim else None for d in range(x.ndim)])

  def gather(v):
    v = jax.lax.all_gather(v, "gather_inner", axis=dim, tiled=True)
    return jax.lax.all_gather(v, "gather_outer", axis=dim, tiled=True)

  return jax.shard_map(gather, mesh=staged, in_specs=in_spec, out_specs=PartitionSpec(),
                       check_vma=False)(x)


GROUP_AXES = ("token_group", "out_group")
TOKEN_GROUP_ROWS = 16     # a device's rows from which the node decode groups its tokens


def token_groups(rows: int, mesh) -> int:
  """a, the token groups of the node decode (`Parallel.token_groups`) for `rows` tokens a
  step on `mesh`: 2 where each device holds at least TOKEN_GROUP_ROWS of them and the mesh
  has one axis to view as [2, n / 2] (`grouped_mesh`), else 1. Each by-output projection
  then reads its group's T / a tokens and 1 / (n / a) of its weight, T D / a + a W / n,
  where one group reads T D + W / n: k3 v5p-128, 1,024 rows, a KDA projection (T D 14.7 MB,
  W 176 MB) 17.4 -> 12.8 MB, an o-projection (25 MB input) 27.8 -> 18.1; a = 4 doubles the
  weights' share again for a quarter of the tokens (measured: docs/pod-scale.md)."""
  if mesh is None or rows < TOKEN_GROUP_ROWS * mesh.size or grouped_mesh(mesh, 2) is None:
    return 1
  return 2


def grouped_heads(heads: int, view) -> bool:
  """Does a weight whose output is [H, K] split H (not K) over a token group's devices of
  `view` (`grouped_mesh`)? Where they divide H (k3 on v5p-128 in 2 groups: 96 heads over
  32): a device's slice [D, H / 32, K] keeps K's 128 lanes minor, where split on K (4 a
  device) the TPU compiler holds each device's [D, H, 4] with D minor and copies every
  layer's slice out of the layer stack, and back in for the prefetch, before the matmul."""
  return heads % view.shape[GROUP_AXES[1]] == 0


def grouped_mesh(mesh, a: int):
  """`mesh`'s devices viewed as [a, n / a] (GROUP_AXES: shard s of a dimension split over
  the whole mesh = group * (n / a) + index, as a spec splitting it over the mesh numbers
  them; the devices in the mesh's own order, so shardings on either mesh agree), or None
  where the mesh has more than one axis above 1 or a does not divide it."""
  from jax.sharding import Mesh
  if mesh is None or sum(s > 1 for s in mesh.shape.values()) != 1 or mesh.size % a \
      or a < 2 or mesh.size == a:
    return None
  return Mesh(mesh.devices.reshape(a, mesh.size // a), GROUP_AXES)


def group_gather(x: jax.Array, view, spec, axes) -> jax.Array | None:
  """x gathered whole within its token group on the [a, n / a] `view` (`grouped_mesh`):
  x split by row over the whole mesh (spec's first entry; logical axes[0] "batch") or, as
  `Parallel.by_output` leaves it, its rows by group and its last dimension ("embed") over
  the group's devices; -> its group's rows, whole, on each device of the group (one
  all-gather over the n / a devices of the group). None for any other layout."""
  from jax.sharding import PartitionSpec
  entries = list(spec) + [None] * (x.ndim - len(spec))
  split = [d for d, e in enumerate(entries) if e is not None]
  if len(split) != 1:
    return None
  dim = split[0]
  tg, og = GROUP_AXES
  rest = [None] * (x.ndim - 1)
  if dim == 0 and axes[0] == "batch":
    in_spec = PartitionSpec((tg, og), *rest)
  elif dim == x.ndim - 1 and axes[-1] == "embed" and x.ndim >= 2:
    in_spec = PartitionSpec(tg, *rest[:-1], og)
  else:
    return None
  if x.shape[0] % view.shape[tg]:
    return None

  def gather(v):
    return jax.lax.all_gather(v, og, axis=dim, tiled=True)

  return jax.shard_map(gather, mesh=view, in_specs=in_spec,
                       out_specs=PartitionSpec(tg, *rest), check_vma=False)(x)


def staged_einsum_by_batch(subscripts: str, x: jax.Array, w: jax.Array, mesh, x_spec,
                           w_spec) -> jax.Array | None:
  """einsum(subscripts, x, w) contracting a dimension split over the same mesh axes in x
  (laid out by the PartitionSpec x_spec) and w (w_spec), its partial sums reduce-scattered
  on the output's first dimension (the batch) in two stages, over groups of `outer` then
  `inner` devices (`_staged_mesh`): the output split by sequence over those axes. A
  reduce-scatter over every device in one group the TPU compiler does as an all-reduce.
  None where the two specs do not split over one set of axes, or it has no staging."""
  from jax.sharding import PartitionSpec
  found = {_axes(e) for e in list(x_spec) + list(w_spec)} - {()}
  staged = _staged_mesh(mesh, found.pop()) if len(found) == 1 else None
  if staged is None:
    return None
  on = lambda spec: PartitionSpec(*[_STAGED if e is not None else None for e in spec])

  def body(a, b):
    part = jnp.einsum(subscripts, a, b)
    part = jax.lax.psum_scatter(part, "gather_outer", scatter_dimension=0, tiled=True)
    return jax.lax.psum_scatter(part, "gather_inner", scatter_dimension=0, tiled=True)

  return jax.shard_map(body, mesh=staged, in_specs=(on(x_spec), on(w_spec)),
                       out_specs=PartitionSpec(_STAGED), check_vma=False)(x, w)


def all_gather_in_stages(x: jax.Array, axis_name, size: int, tiled: bool = False) -> jax.Array:
  """`jax.lax.all_gather(x, axis_name, tiled=tiled)` (the axis' `size` devices' x stacked on
  a new leading dimension, or concatenated on the first) inside a `shard_map`, as two
  all-gathers over groups of that axis' devices (`axis_index_groups`: `inner` consecutive
  indices, then every `inner`-th; `_stages`), for the reason `staged_gather` gives; one
  gather where `size` has no two-stage factoring."""
  stages = _stages(size)
  if stages is None:
    return jax.lax.all_gather(x, axis_name, tiled=tiled)
  outer, inner = stages
  y = jax.lax.all_gather(x, axis_name, tiled=True, axis_index_groups=[
      [o * inner + i for i in range(inner)] for o in range(outer)])      # [inner n, ...]
  y = jax.lax.all_gather(y, axis_name, tiled=True, axis_index_groups=[
      [o * inner + i for o in range(outer)] for i in range(inner)])      # [outer inner n, ...]
  return y if tiled else y.reshape((size,) + x.shape)


SLOT_KEY = ("page_split", "slot")
"""The key of `parallel_for(mesh, "slot")`'s Parallel (see `batch_fills_mesh`); with token
groups a > 1, SLOT_KEY + (a,) (`Parallel.token_groups`)."""

SINGLE = Parallel()
"""The single-device program: no constraints, kernels called directly, reference ops."""


__all__ = ["Parallel", "ParallelOps", "SINGLE", "SLOT_KEY", "all_gather_in_stages",
           "group_gather", "grouped_heads", "grouped_mesh", "staged_gather", "token_groups"]
