"""The routed experts' serve-time layout on XLA:CPU, built once when an engine takes its
weights: each MoE layer gains its experts' gate and up weights side by side, [E, Din, 2F]
(ops/moe.stack_gate_up; layers/moe.GateUpExperts), so the decode's loops (ops/moe.
moe_small: over token-expert pairs, or over expert tiles) take one weight slice and one
matmul for both where they took two of each.

The training layout is untouched (the prefill and the training step read w_gate / w_up as
before); the extra state costs the gate and up weights once more in host memory (the 15M
Kimi-Linear: 29 MB). Only on one CPU device with plain (not packed, not QAT) experts: an
accelerator runs the decode's MoE as one fused program, and a mesh places the experts by
their logical axes.
"""

from __future__ import annotations

import contextlib

import jax
from flax import nnx

from k3_jax.layers.moe import GateUpExperts
from k3_jax.ops.moe import stack_gate_up

_ENABLED = [True]


@contextlib.contextmanager
def off():
  """Engines built inside serve their experts from the training layout only: the
  side-by-side of benchmarks/serve.py's pool section."""
  _ENABLED[0] = False
  try:
    yield
  finally:
    _ENABLED[0] = True


def wanted(cfg, mesh=None) -> bool:
  """Does an engine over `mesh` (None: one device) serve `cfg` with the layout?"""
  devices = jax.devices() if mesh is None else list(mesh.devices.flat)
  return (_ENABLED[0] and cfg.moe.num_experts > 0 and cfg.quant.qat == "none"
          and devices[0].platform == "cpu" and (mesh is None or len(devices) == 1))


def with_gate_up(cfg, graphdef, params, rest, mesh=None):
  """(graphdef, params, rest) with every plain MoE layer's GateUpExperts added (`wanted`),
  else as given. Params are shared, not copied."""
  if not wanted(cfg, mesh):
    return graphdef, params, rest
  model = nnx.merge(graphdef, params, rest)
  added = 0
  for moe, _ in model.moe_layers():
    if moe._packed() or hasattr(moe, "gate_up"):
      continue
    moe.gate_up = GateUpExperts(stack_gate_up(moe.w_gate[...].astype(moe.dtype),
                                              moe.w_up[...].astype(moe.dtype)))
    added += 1
  if not added:
    return graphdef, params, rest
  return nnx.split(model, nnx.Param, ...)


__all__ = ["off", "wanted", "with_gate_up"]
