"""Routed mixture-of-experts ops: sigmoid router, top-k selection, dropless dispatch.

Shapes: N tokens, D model width, Din expert input width (latent width l for
Stable LatentMoE, model width d for a plain MoE), E experts, F expert
intermediate, k experts per token.

Router (spec section 5):
    s = sigmoid(x W_r)                 (float32)
    T = top_k(s + b)                   (b: balancing bias, never differentiated)
    p_j = s_j / sum_{r in T} s_r       (times the routed scaling factor)

`moe_dispatch` is the dropless path: token-expert pairs are sorted by expert
and each expert's FFN runs as a grouped matmul (`jax.lax.ragged_dot`) over its
contiguous rows only. `moe_dense_reference` runs every expert on every token
and masks; it is the baseline for tests and benchmarks.
"""

from __future__ import annotations

import functools
import importlib

from typing import Callable

import jax
import jax.numpy as jnp

from k3_jax.config import GMM_KINDS
from k3_jax.ops.activations import glu

# gmm(lhs [M, K], rhs [G, K, N], group_sizes [G] int32) -> [M, N]; rows of lhs
# are grouped contiguously, group g multiplies rhs[g].
GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def ragged_dot_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """Default grouped matmul: jax.lax.ragged_dot with a float32 result."""
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


def _tgmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
  """(rows, k, n) tiles of the weight-gradient kernel: 512 where it divides, else 128, else
  the whole dimension."""
  return tuple(512 if d % 512 == 0 else 128 if d % 128 == 0 else d for d in (m, k, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot_tgmm(lhs, rhs, group_sizes, interpret=False):
  return ragged_dot_gmm(lhs, rhs, group_sizes)


def _ragged_dot_tgmm_fwd(lhs, rhs, group_sizes, interpret):
  return ragged_dot_gmm(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _ragged_dot_tgmm_bwd(interpret, res, ct):
  # (the package's `gmm` attribute is its custom_vjp function; the kernels are the module's)
  megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  lhs, rhs, group_sizes = res
  ct = ct.astype(rhs.dtype)                     # the MXU's input type, as the forward's
  # d lhs: rows grouped as in the forward, each times its group's rhs^T (ragged rows)
  d_lhs = jax.lax.ragged_dot(ct, jnp.swapaxes(rhs, 1, 2), group_sizes,
                             preferred_element_type=jnp.float32).astype(lhs.dtype)
  # d rhs[g] = lhs[rows of g]^T ct[rows of g]: the grouped transposed kernel, which visits
  # each row tile once (XLA's own transpose of ragged_dot is a masked matmul of every row
  # against every group: G times the work)
  d_rhs = megablox.tgmm(lhs.T.astype(rhs.dtype), ct, group_sizes, jnp.float32,
                        _tgmm_tiling(*lhs.shape, ct.shape[1]), interpret=interpret)
  return d_lhs, d_rhs.astype(rhs.dtype), None


_ragged_dot_tgmm.defvjp(_ragged_dot_tgmm_fwd, _ragged_dot_tgmm_bwd)


def ragged_dot_tpu_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                       interpret: bool = False) -> jax.Array:
  """`ragged_dot_gmm` for training on TPU: the same forward, and a backward whose weight
  gradient is the grouped transposed-matmul Pallas kernel of jax (megablox tgmm) instead of
  XLA's transpose of ragged_dot, which the TPU compiler writes as a dense matmul of all
  rows against every group (k3: 28 local experts, 25 TFLOP a call where 0.9 are useful;
  7.0 of the train step's 8.8 PFLOP a chip). interpret: run the kernel in Pallas
  interpret mode (tests on CPU)."""
  return _ragged_dot_tgmm(lhs, rhs, group_sizes, interpret)


def _tile_rows(m: int, g: int) -> int:
  """Rows per tile for `tiled_gmm` and `_moe_tiles_batched` (training's program): about
  the mean group size m / g, a power of two in [8, 256]. Padding is at most g * (tile - 1)
  rows, but XLA:CPU's per-tile matmuls and per-tile weight picks cost less with fewer,
  larger tiles: at 16 experts x 4 (the served 15M Kimi-Linear) and m = 16,384 pairs
  (eight 512-token prompts), 256 rows took 69 ms where 128 took 80 and 32 147; at m =
  2,048 (one prompt) 32 to 128 rows cost about the same, 256 more (benchmarks/moe.py
  --tiles)."""
  t = 8
  while t < 256 and 2 * t * g <= m:
    t *= 2
  return t


def tiled_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
              tile: int | None = None) -> jax.Array:
  """Grouped matmul as dense per-tile matmuls: each group's rows are padded to a multiple
  of `tile`, every tile belongs to one group, and tile j computes lhs_tile . rhs[group_j].

  Same signature and result as `ragged_dot_gmm`. FLOPs are those of the real rows plus at
  most G * (tile - 1) padding rows; used where `ragged_dot` has no native lowering (XLA:CPU
  lowers it to a masked matmul against every group, G times the work).
  """
  m, kdim = lhs.shape
  g, _, n = rhs.shape
  t = tile or _tile_rows(m, g)
  num_tiles = -(-(m + g * (t - 1)) // t)                                 # static bound
  ends = jnp.cumsum(group_sizes)                                         # [G]
  starts = ends - group_sizes
  padded = (group_sizes + t - 1) // t * t                                # [G]
  padded_starts = jnp.cumsum(padded) - padded
  row = jnp.arange(m)
  group_of_row = jnp.minimum(jnp.searchsorted(ends, row, side="right"), g - 1)   # [M]
  dest = padded_starts[group_of_row] + row - starts[group_of_row]        # [M]
  lhs_pad = jnp.zeros((num_tiles * t, kdim), lhs.dtype).at[dest].set(lhs)
  tile_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_tiles) * t, side="right")
  tile_group = jnp.minimum(tile_group, g - 1)                            # [num_tiles]
  out = jnp.einsum("tmk,tkn->tmn", lhs_pad.reshape(num_tiles, t, kdim), rhs[tile_group],
                   preferred_element_type=jnp.float32)                   # [tiles, t, N]
  return out.reshape(num_tiles * t, n)[dest]


def default_gmm(kind: str = "auto", platform: str | None = None,
                kernel: bool = True) -> GroupedMatmul:
  """"ragged_dot" (native on TPU and GPU), "tiled" (plain JAX, for XLA:CPU), or "auto":
  tiled when compiling for CPU and ragged_dot otherwise (the model passes the job's
  Parallel.kernels.gmm).
  `platform` is the compile target (e.g. "tpu" for an ahead-of-time TPU compile from a CPU
  host); None = JAX's default backend. On TPU, where the call may run a Pallas kernel
  (`kernel`: on whole local arrays, no mesh or inside a shard_map), ragged_dot's weight
  gradient is the grouped kernel (`ragged_dot_tpu_gmm`)."""
  platform = platform or jax.default_backend()
  if kind == "auto":
    kind = "tiled" if platform == "cpu" else "ragged_dot"
  if kind not in GMM_KINDS:
    raise ValueError(f"unknown grouped matmul {kind!r}; expected one of {GMM_KINDS}")
  if kind == "tiled":
    return tiled_gmm
  return ragged_dot_tpu_gmm if platform == "tpu" and kernel else ragged_dot_gmm




def router_scores(x: jax.Array, w_router: jax.Array) -> jax.Array:
  """Sigmoid router scores in float32. x [N, D], w_router [D, E] -> [N, E]."""
  logits = jnp.dot(x.astype(jnp.float32), w_router.astype(jnp.float32))  # [N, E]
  return jax.nn.sigmoid(logits)


def _group_mask(biased: jax.Array, n_group: int, topk_group: int) -> jax.Array:
  """Keep the experts of the `topk_group` best groups, others -> -inf.

  Group score = sum of the top-2 biased scores in the group (DeepSeek-V3).
  biased [N, E] -> [N, E].
  """
  n, e = biased.shape
  per_group = e // n_group
  grouped = biased.reshape(n, n_group, per_group)                        # [N, G, E/G]
  top2, _ = jax.lax.top_k(grouped, min(2, per_group))                    # [N, G, 2]
  group_scores = jnp.sum(top2, axis=-1)                                  # [N, G]
  _, keep_groups = jax.lax.top_k(group_scores, topk_group)               # [N, topk_group]
  keep = jnp.sum(jax.nn.one_hot(keep_groups, n_group, dtype=jnp.int32), axis=1) > 0  # [N, G]
  keep = jnp.repeat(keep, per_group, axis=1)                             # [N, E]
  return jnp.where(keep, biased, -jnp.inf)


def select_experts(scores: jax.Array, bias: jax.Array, top_k: int,
                   routed_scaling_factor: float = 1.0, n_group: int = 1,
                   topk_group: int = 1) -> tuple[jax.Array, jax.Array]:
  """Pick top-k experts on scores + bias; weight them by renormalised unbiased scores.

  scores [N, E] (router sigmoid outputs), bias [E] (balancing bias; wrapped in
  stop_gradient). Returns (weights [N, k] float32, expert_ids [N, k] int32).
  Gradients reach `scores` through the weights only; the choice is discrete.
  With n_group > 1, routing is group-limited: only experts in the `topk_group`
  best groups (group score = sum of its top-2 biased scores) can be chosen.
  """
  n, e = scores.shape
  if not 1 <= top_k <= e:
    raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
  if n_group < 1 or e % n_group != 0:
    raise ValueError(f"n_group={n_group} must be >= 1 and divide num_experts={e}")
  if n_group > 1:
    if not 1 <= topk_group <= n_group:
      raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if top_k > topk_group * (e // n_group):
      raise ValueError(f"top_k={top_k} exceeds the {topk_group} kept groups x "
                       f"{e // n_group} experts per group")

  scores = scores.astype(jnp.float32)
  biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]  # [N, E]
  biased = jax.lax.stop_gradient(biased)  # selection only; weights come from `scores`
  if n_group > 1:
    biased = _group_mask(biased, n_group, topk_group)
  _, expert_ids = jax.lax.top_k(biased, top_k)                            # [N, k]
  expert_ids = expert_ids.astype(jnp.int32)
  chosen = jnp.take_along_axis(scores, expert_ids, axis=-1)               # [N, k]
  weights = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + 1e-20)
  return weights * routed_scaling_factor, expert_ids


def expert_load(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """Tokens routed to each expert. expert_ids [N, k] -> counts [E] int32."""
  return jnp.bincount(expert_ids.reshape(-1), length=num_experts).astype(jnp.int32)


def moe_dispatch(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                 w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                 activation: str = "situ", beta1: float = 4.0, beta2: float = 25.0,
                 gmm: GroupedMatmul | None = None) -> jax.Array:
  """Dropless routed-expert FFN via grouped matmuls.

  x [N, Din]; weights [N, k] combine weights; expert_ids [N, k] int32;
  w_gate, w_up [E, Din, F]; w_down [E, F, Din]. Returns y [N, Din] in x.dtype:
      y_i = sum_j weights[i, j] * FFN_{expert_ids[i, j]}(x_i)
  Every token-expert pair is computed (no capacity, no drops); each expert
  only sees its own rows.
  """
  if gmm is None:
    gmm = default_gmm()
  if gmm is tiled_gmm:        # plain tiled path: one padded layout for all three matmuls
    return _moe_tiled(x, weights, expert_ids, w_gate, w_up, w_down, activation, beta1, beta2)
  n, k = expert_ids.shape
  e = w_gate.shape[0]

  with jax.named_scope("dispatch"):
    flat_ids = expert_ids.reshape(-1)                                    # [N*k]
    order = jnp.argsort(flat_ids, stable=True)                           # [N*k] pair index, sorted by expert
    token_of_pair = order // k                                           # [N*k] source token of each sorted row
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)    # [E]
    xs = jnp.take(x, token_of_pair, axis=0)                              # [N*k, Din]

  with jax.named_scope("experts"):
    gate = gmm(xs, w_gate, group_sizes)                                  # [N*k, F] f32
    up = gmm(xs, w_up, group_sizes)                                      # [N*k, F] f32
    h = glu(gate, up, activation, beta1=beta1, beta2=beta2)              # [N*k, F] f32
    h = h.astype(x.dtype)
    out_sorted = gmm(h, w_down, group_sizes).astype(jnp.float32)         # [N*k, Din]

  with jax.named_scope("combine"):
    inverse = jnp.argsort(order)                                         # [N*k] sorted row of each pair
    out = jnp.take(out_sorted, inverse, axis=0).reshape(n, k, -1)        # [N, k, Din]
    y = jnp.sum(out * weights.astype(jnp.float32)[..., None], axis=1)    # [N, Din]
  return y.astype(x.dtype)


SMALL_TOKENS = 64    # at most this many tokens (a decode step): moe_small, not the gmm layout


def moe_small(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
              w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
              activation: str = "situ", beta1: float = 4.0, beta2: float = 25.0,
              pair_loop: bool = False) -> jax.Array:
  """`moe_dispatch` for a handful of tokens (decode), with no sort, no group sizes and no
  tile padding: each row's result depends on that row alone (batch invariance).

  Fewer token-expert pairs than experts (N k < E: a decode batch of a big MoE): each pair's
  expert is applied to its token, so a step reads the experts its tokens chose and no
  other: with `pair_loop` (XLA:CPU) in a loop over the pairs reading each expert's weights
  where they lie, otherwise (one fused program on an accelerator) with each pair's weights
  gathered. At E = 16, k = 4, Din = 256, F = 128 on 2 CPU cores, seven such layers took
  0.97 ms for 1 token and 2.3 for 2 with the loop, 1.5 and 4.6 gathered (weights copied).
  Otherwise, with `pair_loop`: the tiled layout (`_moe_tiled`: its loop, or under `grad`
  its batched form) with tiles of about the rows an expert gets (`decode_tile`), each
  touched expert's weights read once in place and only its rows computed. A tile's rows are separate rows of one matmul, so each
  row's bits are still its own on XLA:CPU (bitwise with the other rows changed and moved,
  tested). Seven such layers, same sizes: 8 tokens 3.5 ms where every expert took 4.6, 16
  tokens 4.5 vs 6.0, 40 (a batch-8 verify window) 6.3 vs 11.3. Otherwise every expert runs
  on every token (E/k times the FLOPs, but each expert's weights are read once, which is
  what a memory-bound step pays for). Same arguments and result as `moe_dispatch`.

  (Reading each expert's gate and up weights side by side, one matmul for both, was a
  serve-time layout on XLA:CPU until stop 54 (12-05): 7.52 -> 6.87 ms a batch-8 step when
  it came, it read 0.87-0.998x of its time in five later runs against the layout here, and
  cost a second copy of those weights.)"""
  n, k = expert_ids.shape
  e = w_gate.shape[0]
  f32 = jnp.float32
  if n * k < e and pair_loop:
    with jax.named_scope("experts_loop"):
      def one_pair(i, y):
        tok, j = i // k, expert_ids[i // k, i % k]
        out = _expert_rows(x[tok][None], j, w_gate, w_up, w_down, activation, beta1,
                           beta2)[0]                                     # [Din]
        return y.at[tok].add(out * weights[tok, i % k].astype(f32))
      y = jax.lax.fori_loop(0, n * k, one_pair, jnp.zeros((n, x.shape[1]), f32))
  elif pair_loop:
    with jax.named_scope("experts_tiles"):
      y = _moe_tiled(x, weights, expert_ids, w_gate, w_up, w_down, activation, beta1,
                     beta2, tile=decode_tile(n * k, e))     # differentiable (custom VJP)
  elif n * k < e:
    with jax.named_scope("experts_gathered"):
      ids = expert_ids.reshape(-1)                                       # [M = N k]
      xs = jnp.repeat(x, k, axis=0)                                      # [M, Din]
      pick = lambda w: jnp.take(w, ids, axis=0)
      gate = jnp.einsum("md,mdf->mf", xs, pick(w_gate), preferred_element_type=f32)
      up = jnp.einsum("md,mdf->mf", xs, pick(w_up), preferred_element_type=f32)
      h = glu(gate, up, activation, beta1=beta1, beta2=beta2).astype(x.dtype)
      out = jnp.einsum("mf,mfd->md", h, pick(w_down), preferred_element_type=f32)
      y = jnp.sum(out.reshape(n, k, -1) * weights.astype(f32)[..., None], axis=1)
  else:
    with jax.named_scope("experts_all"):
      # E leads as a batch axis of both operands, so the weights are read in their stored
      # layout (no per-step transpose of [E, Din, F] into one [Din, E F] matrix)
      xe = jnp.broadcast_to(x[None], (e,) + x.shape)                     # [E, N, Din]
      gate = jnp.einsum("end,edf->enf", xe, w_gate, preferred_element_type=f32)
      up = jnp.einsum("end,edf->enf", xe, w_up, preferred_element_type=f32)
      h = glu(gate, up, activation, beta1=beta1, beta2=beta2).astype(x.dtype)
      out = jnp.einsum("enf,efd->end", h, w_down, preferred_element_type=f32)   # [E, N, Din]
      comb = jnp.zeros((n, e), f32).at[jnp.arange(n)[:, None], expert_ids].add(
          weights.astype(f32))                                           # [N, E]
      y = jnp.einsum("ne,end->nd", comb, out)
  return y.astype(x.dtype)


def stack_gate_up(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
  """w_gate, w_up [..., E, Din, F] -> [..., E, Din, 2F]: each expert's gate and up weights
  side by side, read by one matmul (the batched tiles of training)."""
  return jnp.concatenate([w_gate, w_up], axis=-1)


def decode_tile(m: int, e: int) -> int:
  """`moe_small`'s tile for m token-expert pairs over e experts: the power of two at or
  above the mean rows an expert gets, at least 4 and at most LOOP_TILE (measured at E = 16:
  4 best for 32 and 64 pairs, 8-16 for 160; smaller tiles run more loop steps, larger ones
  compute padding)."""
  return min(LOOP_TILE, max(4, 1 << (-(-m // e) - 1).bit_length()))


def _expert_rows(xt, j, w_gate, w_up, w_down, activation, beta1, beta2):
  """Expert j's FFN on rows xt [r, Din], its weights read where they lie (the loops of
  `moe_small` and `_moe_tile_loop`) -> [r, Din] float32."""
  f32 = jnp.float32
  h = glu(jnp.dot(xt, w_gate[j], preferred_element_type=f32),
          jnp.dot(xt, w_up[j], preferred_element_type=f32),
          activation, beta1=beta1, beta2=beta2).astype(xt.dtype)
  return jnp.dot(h, w_down[j], preferred_element_type=f32)


LOOP_TILE = 64   # `decode_tile`'s largest tile, and the prefill loop's below THREADED_ROWS
THREADED_ROWS = 256   # rows an expert gets from which `prefill_tile` takes tiles that large
PREFILL_TILE_MAX = 512


def prefill_tile(m: int, e: int) -> int:
  """`_moe_tile_loop`'s tile for m token-expert pairs over e experts: LOOP_TILE while an
  expert gets fewer than THREADED_ROWS rows on average, else the power of two at or below
  that mean, at most PREFILL_TILE_MAX. XLA:CPU runs a tile's matmul on one core until it is
  about [256, 256] x [256, 128]; larger ones use every core. Measured on the served 15M
  Kimi-Linear's experts (E = 16, k = 4, Din = 256, F = 128; 2 cores, nothing else running),
  ms a layer per 512 tokens at tiles 64 / 256 / 512: 6.7 / 8.3 / 11.1 at 512 tokens (one
  prompt: padding costs more than the threads give), 5.5 / 5.3 / 4.4 at 2,048, 5.5 / 4.7 /
  3.8 at 4,096 (1,024: 4.7)."""
  mean = -(-m // e)
  if mean < THREADED_ROWS:
    return LOOP_TILE
  return min(PREFILL_TILE_MAX, 1 << (mean.bit_length() - 1))


def _moe_tiled(x, weights, expert_ids, w_gate, w_up, w_down, activation, beta1, beta2,
               tile: int | None = None):
  """`moe_dispatch` with the tiled layout: the token-expert pairs sorted by expert and
  written ONCE into a tile-padded buffer, every tile one expert's rows.

  Two programs compute it, one result (to float rounding):
  - called plainly (inference, the served steps): `_moe_tile_loop`, a loop over the tiles
    that hold rows, each multiplying against its expert's weights where they lie;
  - differentiated (training): `_moe_tiles_batched`, batched per-tile matmuls against
    per-tile copies of the weights, whose backward is matmuls (a loop's backward adds each
    tile's weight gradient into a whole [E, Din, F] carry, 2-4x slower).
  On the served 15M Kimi-Linear's experts (E = 16, k = 4, Din = 256, F = 128) on 2 busy
  CPU cores (`benchmarks/moe.py --tiles`) the loop took 7.3 ms at 512 tokens where the
  batched form took 14.6 (each at its best tile), and 82-94 ms at 4,096 where it took 160:
  the batched form copies each tile's weights and runs the static bound of tiles, padding
  included (2x the rows at 512 tokens). The loop's tile: 32 to 256 rows are within the
  noise of each other at 4,096 tokens, 16 and 256 slower at 512. Adding each tile's rows
  into its tokens' outputs inside the loop, not gathering them back after it, took 4,096
  tokens from 97 to 69 ms (same run).
  x [N, Din]; weights, expert_ids [N, k]; w_gate, w_up [E, Din, F]; w_down [E, F, Din]."""
  return _tiled_moe((activation, beta1, beta2, tile), x, weights, expert_ids, w_gate, w_up,
                    w_down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled_moe(opts, x, weights, expert_ids, w_gate, w_up, w_down):
  return _moe_tile_loop(x, weights, expert_ids, w_gate, w_up, w_down, *opts)


def _tiled_moe_fwd(opts, x, weights, expert_ids, w_gate, w_up, w_down):
  y, vjp = jax.vjp(lambda *a: _moe_tiles_batched(a[0], a[1], expert_ids, *a[2:], *opts),
                   x, weights, w_gate, w_up, w_down)
  return y, vjp


def _tiled_moe_bwd(opts, vjp, ct):
  dx, dweights, dgate, dup, ddown = vjp(ct)
  return dx, dweights, None, dgate, dup, ddown


_tiled_moe.defvjp(_tiled_moe_fwd, _tiled_moe_bwd)


def _moe_tile_loop(x, weights, expert_ids, w_gate, w_up, w_down, activation, beta1, beta2,
                   tile: int | None = None):
  """The tiled layout run as loops over the tiles that hold rows (`used`, known only at
  run time: no padding tile beyond the last expert's is computed), each tile's three
  matmuls against its expert's weights read in place, its rows weighted and added into
  their tokens' outputs (a padding row adds 0 x its output to a spare row). A token's k
  pairs are added in expert order within each loop. Not reverse-differentiable (a loop of
  run-time length): `_moe_tiled` differentiates `_moe_tiles_batched` instead.

  With tiles larger than LOOP_TILE, an expert's rows past its last whole tile go to a
  second loop of LOOP_TILE-row tiles unless they fill more than half a tile
  (`_split_layout`): padded up to the large tile, an expert one row past a tile boundary
  computed a whole tile of padding (with 16 experts at the mean of 512 rows, about half
  of them; the large tiles alone ran ~1.5x the rows)."""
  n, k = expert_ids.shape
  e, din, f = w_gate.shape
  t = tile or prefill_tile(n * k, e)
  f32 = jnp.float32
  with jax.named_scope("dispatch"):
    xe = jnp.concatenate([x, jnp.zeros((1, din), x.dtype)], axis=0)      # [N+1, Din]
    regions = _split_layout(expert_ids, weights, n, k, e, t,
                            LOOP_TILE if t > LOOP_TILE else None)

  y = jnp.zeros((n + 1, din), f32)
  for size, src, tile_expert, row_weight, used in regions:
    xs = jnp.take(xe, src, axis=0).reshape(-1, size, din)                # [tiles, t, Din]
    token = src.reshape(-1, size)                                        # n = the spare row
    row_weight = row_weight.reshape(-1, size)

    def one_tile(i, y, xs=xs, token=token, row_weight=row_weight, tile_expert=tile_expert):
      out = _expert_rows(xs[i], tile_expert[i], w_gate, w_up, w_down, activation, beta1,
                         beta2)                                                   # [t, Din]
      return y.at[token[i]].add(out * row_weight[i][:, None])

    with jax.named_scope("experts"):         # each tile's rows added into y as it goes
      y = jax.lax.fori_loop(0, used, one_tile, y)
  with jax.named_scope("combine"):
    return y[:n].astype(x.dtype)                                         # the spare row off


def _split_layout(expert_ids, weights, n, k, e, t, small):
  """`_moe_tile_loop`'s layout: a list of regions (tile rows, src [rows] token of each row
  (n = the zero pad row), tile_expert [tiles], row_weight [rows] (0 on padding), used: the
  tiles that hold rows). Every expert's rows in pair order; with `small`, each expert
  takes floor(g / t) tiles of t rows, one more when its remainder exceeds t / 2, and the
  rows left (at most t / 2) go to the second region's `small`-row tiles."""
  flat_ids = expert_ids.reshape(-1)                                      # [M] pair -> expert
  m = n * k
  sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)            # [E]
  order = jnp.argsort(flat_ids, stable=True)                             # sorted row -> pair
  rank = jnp.zeros((m,), jnp.int32).at[order].set(      # [M] the pair's row in its expert
      jnp.arange(m, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[flat_ids[order]])
  token = jnp.arange(m, dtype=jnp.int32) // k
  pair_weight = weights.reshape(-1).astype(jnp.float32)
  if small is None:
    parts = [(t, sizes, m + e * (t - 1))]
  else:
    big = sizes // t + (sizes % t > t // 2)                              # [E] large tiles
    in_big = jnp.minimum(sizes, big * t)
    parts = [(t, in_big, m + e * (t // 2)), (small, sizes - in_big, e * (t // 2 + small - 1))]
  regions, offset = [], jnp.zeros_like(rank)
  for size, count, bound in parts:                  # count [E]: the rows this region holds
    num_tiles = -(-bound // size)                                        # static bound
    rows = num_tiles * size
    padded = (count + size - 1) // size * size
    padded_ends = jnp.cumsum(padded)
    r = rank - offset                                                    # [M] row in region
    mine = (r >= 0) & (r < count[flat_ids])
    dest = jnp.where(mine, padded_ends[flat_ids] - padded[flat_ids] + r, rows)
    src = jnp.full((rows,), n, jnp.int32).at[dest].set(token, mode="drop")
    row_weight = jnp.zeros((rows,), jnp.float32).at[dest].set(pair_weight, mode="drop")
    tile_expert = jnp.minimum(jnp.searchsorted(   # [tiles, E] compares: one fusion, where
        padded_ends, jnp.arange(num_tiles) * size,  # "scan" is a loop of ~5 small steps
        side="right", method="compare_all"), e - 1)
    regions.append((size, src, tile_expert, row_weight, padded_ends[-1] // size))
    offset = offset + count[flat_ids]
  return regions


def _moe_tiles_batched(x, weights, expert_ids, w_gate, w_up, w_down, activation, beta1,
                       beta2, tile: int | None = None):
  """The tiled layout as batched matmuls (what `_moe_tiled` differentiates): gate and up
  run as one matmul per tile against [Din, 2F] weights, down in the same padded layout,
  and the combine gathers each pair's row back. The per-tile expert weights are picked
  with a one-hot matmul (its backward is a matmul, not a scatter-add). Same FLOPs on real
  rows as three `tiled_gmm` calls, one layout instead of three scatters into padding and
  two un-pad / re-pad round trips."""
  n, k = expert_ids.shape
  e, din, f = w_gate.shape
  m = n * k
  t = tile or _tile_rows(m, e)
  num_tiles = -(-(m + e * (t - 1)) // t)                                 # static bound
  rows = num_tiles * t
  with jax.named_scope("dispatch"):
    dest, src, tile_group, _ = _tiled_layout(expert_ids, n, k, e, t, num_tiles, rows)
    onehot = jax.nn.one_hot(tile_group, e, dtype=w_gate.dtype)           # [tiles, E]
    xe = jnp.concatenate([x, jnp.zeros((1, din), x.dtype)], axis=0)      # [N+1, Din]
    xs = jnp.take(xe, src, axis=0).reshape(num_tiles, t, din)            # [tiles, t, Din]
  with jax.named_scope("experts"):
    w_gu = stack_gate_up(w_gate, w_up)                                   # [E, Din, 2F]
    w_gu_t = jnp.einsum("te,edf->tdf", onehot, w_gu)                     # [tiles, Din, 2F]
    gu = jnp.einsum("tmd,tdf->tmf", xs, w_gu_t,
                    preferred_element_type=jnp.float32)                  # [tiles, t, 2F]
    h = glu(gu[..., :f], gu[..., f:], activation, beta1=beta1, beta2=beta2).astype(x.dtype)
    w_d_t = jnp.einsum("te,efd->tfd", onehot.astype(w_down.dtype), w_down)  # [tiles, F, Din]
    out = jnp.einsum("tmf,tfd->tmd", h, w_d_t,
                     preferred_element_type=jnp.float32).reshape(rows, din)  # [rows, Din]
  with jax.named_scope("combine"):
    pair_out = jnp.take(out, dest, axis=0).reshape(n, k, din)            # [N, k, Din]
    y = jnp.sum(pair_out * weights.astype(jnp.float32)[..., None], axis=1)  # [N, Din]
  return y.astype(x.dtype)


def _tiled_layout(expert_ids, n, k, e, t, num_tiles, rows):
  """`_moe_tiles_batched`'s layout: (dest [M] padded row of each pair, src [rows] token of
  each padded row (n = the zero pad row), tile_group [tiles] expert of each tile, used: how
  many tiles hold rows, the rest padding)."""
  m = n * k
  flat_ids = expert_ids.reshape(-1)                                      # [M] pair -> expert
  order = jnp.argsort(flat_ids, stable=True)                             # [M] sorted row -> pair
  group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)      # [E]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  padded = (group_sizes + t - 1) // t * t                                # [E]
  padded_ends = jnp.cumsum(padded)
  padded_starts = padded_ends - padded
  sorted_ids = flat_ids[order]                                           # [M] expert of sorted row
  dest_sorted = padded_starts[sorted_ids] + jnp.arange(m) - starts[sorted_ids]   # [M]
  dest = jnp.zeros((m,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))  # pair -> row
  src = jnp.full((rows,), n, jnp.int32).at[dest_sorted].set(
      (order // k).astype(jnp.int32))                                    # [rows] token (n = pad)
  tile_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * t,
                                            side="right"), e - 1)       # [tiles]
  return dest, src, tile_group, padded_ends[-1] // t


def moe_dense_reference(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                        activation: str = "situ", beta1: float = 4.0,
                        beta2: float = 25.0) -> jax.Array:
  """Baseline: run EVERY expert on every token, then mask with the combine weights.

  Same arguments and result as `moe_dispatch`; costs E/k times the FLOPs.
  """
  n, _ = x.shape
  e = w_gate.shape[0]
  f32 = jnp.float32
  # Operands are upcast to f32 (bf16 x bf16 products are exact in f32, so this
  # matches a bf16 matmul with f32 accumulation; XLA:CPU has no batched
  # bf16 x bf16 -> f32 dot). The hidden is rounded to x.dtype as in moe_dispatch.
  xf = x.astype(f32)
  gate = jnp.einsum("nd,edf->nef", xf, w_gate.astype(f32))                 # [N, E, F]
  up = jnp.einsum("nd,edf->nef", xf, w_up.astype(f32))                     # [N, E, F]
  h = glu(gate, up, activation, beta1=beta1, beta2=beta2).astype(x.dtype)  # [N, E, F]
  out = jnp.einsum("nef,efd->ned", h.astype(f32), w_down.astype(f32))      # [N, E, Din]
  combine = jnp.zeros((n, e), f32).at[jnp.arange(n)[:, None], expert_ids].add(
      weights.astype(f32))                                                 # [N, E]
  y = jnp.einsum("ne,ned->nd", combine, out)                               # [N, Din]
  return y.astype(x.dtype)
