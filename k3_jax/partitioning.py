"""Logical-axis sharding hooks used by model code.

Model code names logical axes only ("batch", "seq", "embed", "heads", ...). The mapping to
mesh axes lives in `sharding/`, which installs it here with `use_rules(mesh, rules)`.
Without installed rules, `constrain` is the identity, so single-device code is untouched.
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


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Sharding constraint by logical axis names; identity when no rules are installed."""
  resolver = _RESOLVER.get()
  if resolver is None:
    return x
  if len(axes) != x.ndim:
    raise ValueError(f"constrain: {len(axes)} logical axes {axes} for an array of rank {x.ndim}")
  return jax.lax.with_sharding_constraint(x, resolver(x.shape, axes))
