"""Per-Head Muon (docs/architecture.md section 6): the optax chain K3 trains with.

    Muon   Nesterov momentum 0.95 -> 5 quintic Newton-Schulz steps (after Frobenius
           normalization) -> x 0.2 sqrt(max(fan_in, fan_out)) (Moonlight: update RMS ~ AdamW's)
           -> + decoupled weight decay -> x muon learning rate
    AdamW  everything that is not a matrix (embeddings, LM head, norms, biases, A_h,
           conv kernels, pseudo-queries), with its own learning rate

optax.contrib supplies the momentum + Newton-Schulz transform (`scale_by_muon`) and
`MuonDimensionNumbers`, whose axes that are neither reduction nor output are batch axes
(vmapped: each slice is orthogonalized alone). What this module adds: the Moonlight scale
per orthogonalized block, a public `newton_schulz`, and K3's grouping, read from the
metadata each layer declares on its parameters, never from parameter names:

- `matrix_axes` (layers/linear.py): per axis "in" (fan-in), "out" (fan-out) or "batch".
  A parameter without it is not a matrix -> AdamW.
- leading axes not covered by `matrix_axes` (the "layers" axis the model adds when it
  stacks scanned units) are batch axes too.
- the group is named by the logical names of the batch axes: "experts" -> per-expert Muon,
  "heads" -> per-head Muon (the Q, K, V projections: KDA q/k/v, MLA W_qb / W_kvb), else Muon.

The optimizer runs directly on the nnx State of the parameters, so its state keeps the
Variables (and their logical axes: it is sharded like the parameters).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from k3_jax.optim.newton_schulz import NS_COEFFS, newton_schulz
from k3_jax.optim.owned import orthogonalize_stacked

MUON_RMS = 0.2                            # Moonlight: update RMS that matches AdamW's

MUON, PER_HEAD, PER_EXPERT, ADAMW = "Muon", "per-head Muon", "per-expert Muon", "AdamW"
GROUPS = (PER_HEAD, PER_EXPERT, MUON, ADAMW)


def orthogonalize(x: jax.Array, dims: MuonDimensionNumbers, steps: int = 5) -> jax.Array:
  """`newton_schulz` on each (reduction x output) block of x, every other axis a batch axis.

  Unlike optax's Muon, the batch axes are not flattened into one: flattening the stacked
  "layers" axis with a sharded "experts" axis gives a dimension the partitioner cannot
  keep sharded, so it gathers every expert's update onto every chip (terabytes for k3).
  Here they stay in place (sharded ones stay sharded), and a leading batch axis (the
  stacked "layers", when there are two or more) is looped over with `lax.map`, so one
  layer's Newton-Schulz temporaries are live at a time."""
  red = tuple(a % x.ndim for a in _tuple(dims.reduction_axis))
  out = tuple(a % x.ndim for a in _tuple(dims.output_axis))
  batch = tuple(a for a in range(x.ndim) if a not in red + out)
  perm = batch + red + out
  y = jnp.transpose(x, perm)
  bshape = y.shape[:len(batch)]
  y = y.reshape(bshape + (math.prod(x.shape[a] for a in red),
                          math.prod(x.shape[a] for a in out)))
  if len(batch) >= 2:
    y = jax.lax.map(lambda b: newton_schulz(b, steps), y)
  else:
    y = newton_schulz(y, steps)
  y = y.reshape(bshape + tuple(x.shape[a] for a in red + out))
  return jnp.transpose(y, tuple(perm.index(a) for a in range(x.ndim)))


def scale_by_blockwise_muon(dims_fn, ns_steps: int = 5, beta: float = 0.95,
                            nesterov: bool = True, owner=None) -> optax.GradientTransformation:
  """optax.contrib.scale_by_muon's momentum (same state, same bias-corrected Nesterov
  form) with the orthogonalization of `orthogonalize`, which keeps batch axes sharded.
  owner (optim/owned.Owner: the mesh and the parameters' specs): each block is
  orthogonalized once, whole on one chip (owned.orthogonalize_owned); None leaves the
  placement to the partitioner."""
  base = scale_by_muon(ns_coeffs=NS_COEFFS, ns_steps=ns_steps, beta=beta, nesterov=nesterov,
                       weight_dimension_numbers=dims_fn)

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(
          lambda m, g: beta * m + (1 - beta) * g,
          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
          optax.tree.bias_correction(updates, beta, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    if owner is None or owner.mesh.size == 1:
      new = jax.tree.map(lambda x, d: orthogonalize(x, d, ns_steps), mu_hat, dims_fn(updates),
                         is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
    else:
      blocks, tree = jax.tree.flatten(_muon_blocks(updates, owner),
                                      is_leaf=lambda x: isinstance(x, _Block))
      new = tree.unflatten(orthogonalize_stacked(
          tree.flatten_up_to(mu_hat), [b.dims for b in blocks], [b.spec for b in blocks],
          owner.mesh, ns_steps))
    return new, state._replace(count=count, mu=mu)

  return optax.GradientTransformation(base.init, update_fn)


def scale_by_moonlight(dims_fn, rms: float = MUON_RMS) -> optax.GradientTransformation:
  """update x rms * sqrt(max(fan_in, fan_out)) of each orthogonalized block (fan-in: the
  product of the reduction axes, fan-out of the output axes; batch axes excluded): an
  orthogonal [m, n] block has RMS 1/sqrt(max(m, n)), so the update RMS becomes `rms`."""

  def update_fn(updates, state, params=None):
    del params

    def one(u, dims):
      fan_in = math.prod(u.shape[i] for i in _tuple(dims.reduction_axis))
      fan_out = math.prod(u.shape[i] for i in _tuple(dims.output_axis))
      return u * (rms * math.sqrt(max(fan_in, fan_out)))

    dims = dims_fn(updates)
    return jax.tree.map(one, updates, dims,
                        is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _tuple(a) -> tuple[int, ...]:
  return (a,) if isinstance(a, int) else tuple(a)


# ----- grouping from metadata --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParamGroup:
  """How the optimizer treats one parameter."""
  group: str                               # one of GROUPS
  batch_axes: tuple[str, ...] = ()         # logical names of the batch axes (Muon only)
  dims: MuonDimensionNumbers | None = None  # reduction / output axes (Muon only)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_group(var: nnx.Variable) -> ParamGroup:
  """The group of one parameter, from its declared `matrix_axes` and `logical_axes`."""
  meta = var.get_metadata()
  roles = meta.get("matrix_axes")
  if roles is None:
    return ParamGroup(ADAMW)
  shape = tuple(var.shape)
  axes = tuple(meta.get("logical_axes") or (None,) * len(shape))
  extra = len(shape) - len(roles)
  if extra < 0 or len(axes) != len(shape) or any(r not in ("in", "out", "batch") for r in roles):
    raise ValueError(f"matrix_axes={roles} do not describe a parameter of shape {shape} "
                     f"(logical axes {axes})")
  roles = ("batch",) * extra + tuple(roles)
  red = tuple(i for i, r in enumerate(roles) if r == "in")
  out = tuple(i for i, r in enumerate(roles) if r == "out")
  if not red or not out:
    raise ValueError(f"matrix_axes={roles} of shape {shape} need an 'in' and an 'out' axis")
  batch = tuple(str(axes[i]) for i, r in enumerate(roles) if r == "batch")
  group = PER_EXPERT if "experts" in batch else PER_HEAD if "heads" in batch else MUON
  return ParamGroup(group, batch, MuonDimensionNumbers(reduction_axis=red, output_axis=out))


def param_groups(params) -> list[tuple[str, tuple[int, ...], ParamGroup]]:
  """[(path, shape, ParamGroup)] for every parameter of an nnx State (or abstract one)."""
  out = []
  for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]:
    if _is_var(var):
      name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
      out.append((name, tuple(var.shape), param_group(var)))
  return out


def _raw(v: nnx.Variable):
  return v.get_raw_value()


def _labels(params):
  """Variable -> Variable holding "muon" or "adamw" (same tree structure as params)."""
  def one(v):
    return v.replace("adamw" if param_group(v).group == ADAMW else "muon")
  return jax.tree.map(one, params, is_leaf=_is_var)


def _muon_dims(updates):
  """For the Muon branch (non-Muon leaves arrive masked): the MuonDimensionNumbers of
  each Muon parameter, in a Variable so the tree lines up with the (masked) updates."""
  def one(v):
    if isinstance(_raw(v), optax.MaskedNode):
      return v
    return v.replace(param_group(v).dims)
  return jax.tree.map(one, updates, is_leaf=_is_var)


@dataclasses.dataclass(frozen=True)
class _Block:
  """A Muon parameter's blocks and where they lie (a leaf of the tree: not a pytree)."""
  dims: MuonDimensionNumbers
  spec: object                              # its PartitionSpec on the owner's mesh


def _muon_blocks(updates, owner):
  """_muon_dims with each parameter's PartitionSpec (from its logical axes)."""
  def one(v):
    if isinstance(_raw(v), optax.MaskedNode):
      return v
    axes = tuple(v.get_metadata().get("logical_axes") or (None,) * len(v.shape))
    return v.replace(_Block(param_group(v).dims, owner.spec_of(tuple(v.shape), axes)))
  return jax.tree.map(one, updates, is_leaf=_is_var)


def decay_mask(params):
  """Weight decay on matrices (Muon's and the vocab-sized embedding / LM head), never on
  norms, biases, decay parameters, conv kernels or pseudo-queries."""
  def one(v):
    meta = v.get_metadata()
    return v.replace(meta.get("matrix_axes") is not None
                     or "vocab" in tuple(meta.get("logical_axes") or ()))
  return jax.tree.map(one, params, is_leaf=_is_var)


def per_head_muon(muon_lr: optax.ScalarOrSchedule, adamw_lr: optax.ScalarOrSchedule, *,
                  momentum: float = 0.95, ns_steps: int = 5, weight_decay: float = 0.1,
                  b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                  nesterov: bool = True, owner=None) -> optax.GradientTransformation:
  """K3's optimizer (without clipping): Per-Head Muon on matrices, AdamW on the rest.

  Works on an nnx State of Params carrying `matrix_axes` / `logical_axes` metadata.
  owner (optim/owned.Owner): Newton-Schulz once per block on the owner's mesh."""
  muon = optax.chain(
      scale_by_blockwise_muon(_muon_dims, ns_steps=ns_steps, beta=momentum, nesterov=nesterov,
                              owner=owner),
      scale_by_moonlight(_muon_dims),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(muon_lr))
  adamw = optax.adamw(adamw_lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                      mask=decay_mask)
  return optax.partition({"muon": muon, "adamw": adamw}, _labels)


__all__ = ["newton_schulz", "orthogonalize", "scale_by_blockwise_muon", "per_head_muon", "scale_by_moonlight", "param_group", "param_groups", "ParamGroup",
           "decay_mask", "GROUPS", "NS_COEFFS", "MUON_RMS"]
