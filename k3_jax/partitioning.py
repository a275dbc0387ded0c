"""Logical-axis sharding hooks used by model code.

Model code names logical axes only ("batch", "seq", "embed", "heads", ...). The mapping to
mesh axes lives in `sharding/`, which installs it here with `use_rules(mesh, rules)`.
Without installed rules, `constrain` is the identity, so single-device code is untouched.

Ops that need explicit collectives on a sharded mesh (expert-parallel MoE dispatch, context-
parallel KDA and MLA) are installed the same way, by name, with `use_parallel_ops`; a layer
calls `parallel_op(name, reference)(...)`, which is the reference op unless `sharding/`
installed a mesh-parallel version with the same signature for the active mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax

# A function mapping (shape, logical axes) -> jax.sharding.Sharding, or None.
_RESOLVER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("k3_resolver",
                                                                          default=None)


@contextlib.contextmanager
def use_resolver(resolver: Callable):
  token = _RESOLVER.set(resolver)
  try:
    yield
  finally:
    _RESOLVER.reset(token)


_PARALLEL_OPS: contextvars.ContextVar[dict] = contextvars.ContextVar("k3_parallel_ops",
                                                                    default={})


@contextlib.contextmanager
def use_parallel_ops(ops: dict[str, Callable]):
  token = _PARALLEL_OPS.set(dict(ops))
  try:
    yield
  finally:
    _PARALLEL_OPS.reset(token)


def parallel_op(name: str, default: Callable) -> Callable:
  """The mesh-parallel version of op `name` installed for the active mesh, else `default`
  (the single-device reference, which the installed version must equal)."""
  return _PARALLEL_OPS.get().get(name, default)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Sharding constraint by logical axis names; identity when no rules are installed."""
  resolver = _RESOLVER.get()
  if resolver is None:
    return x
  if len(axes) != x.ndim:
    raise ValueError(f"constrain: {len(axes)} logical axes {axes} for an array of rank {x.ndim}")
  return jax.lax.with_sharding_constraint(x, resolver(x.shape, axes))
