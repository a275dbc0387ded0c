"""The routed experts' serve-time layout on XLA:CPU, built once when an engine takes its
weights: each MoE layer gains its gate and up weights as one [Din, 2 E F] matrix
(ops/moe.flat_experts; layers/moe.FlatExperts), from which a decode step of N k >= 2 E
token-expert pairs runs every expert on every row as two plain matmuls (ops/moe.moe_flat)
instead of a loop over expert tiles that copies each touched expert's weights.

The training layout is untouched (the prefill and the training step read w_gate / w_up as
before); the extra state costs the gate and up weights once more in host memory (the 15M
Kimi-Linear: 29 MB). Only on one CPU device with plain (not packed, not QAT) experts: an
accelerator runs the tiles or the gathered pairs in one fused program, and a mesh places
the experts by their logical axes.
"""

from __future__ import annotations

import contextlib

import jax
from flax import nnx

from k3_jax.layers.moe import FlatExperts
from k3_jax.ops.moe import flat_experts


_ENABLED = [True]


@contextlib.contextmanager
def off():
  """Engines built inside serve their experts from the training layout only (the decode's
  tile loop): the side-by-side of benchmarks/serve.py's pool section."""
  _ENABLED[0] = False
  try:
    yield
  finally:
    _ENABLED[0] = True


def wanted(cfg, mesh=None) -> bool:
  """Does an engine over `mesh` (None: one device) serve `cfg` with the flat layout?"""
  devices = jax.devices() if mesh is None else list(mesh.devices.flat)
  return (_ENABLED[0] and cfg.moe.num_experts > 0 and cfg.quant.qat == "none"
          and devices[0].platform == "cpu" and (mesh is None or len(devices) == 1))


def with_flat_experts(cfg, graphdef, params, rest, mesh=None):
  """(graphdef, params, rest) with every plain MoE layer's FlatExperts added (`wanted`),
  else as given. Params are shared, not copied."""
  if not wanted(cfg, mesh):
    return graphdef, params, rest
  model = nnx.merge(graphdef, params, rest)
  added = 0
  for moe, _ in model.moe_layers():
    if moe._packed() or hasattr(moe, "flat_gu"):
      continue
    moe.flat_gu = FlatExperts(flat_experts(moe.w_gate[...].astype(moe.dtype),
                                           moe.w_up[...].astype(moe.dtype)))
    added += 1
  if not added:
    return graphdef, params, rest
  return nnx.split(model, nnx.Param, ...)


__all__ = ["off", "wanted", "with_flat_experts"]
