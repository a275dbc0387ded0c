"""The train state and how it is made: the optimizer (learning-rate schedule, Per-Head Muon
or AdamW), the model split into `params` (what the optimizer updates) and `rest`, and a
fresh or abstract state {'step', 'params', 'rest', 'opt_state'}.

Apart from train.py (the steps and the loop) so that checkpoint/ (import, sharded loading)
builds the same state without importing training.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from k3_jax.config import ModelConfig, TrainConfig
from k3_jax.model import K3Model, create_model
from k3_jax.optim.muon import decay_mask, per_head_muon
from k3_jax.optim.owned import Owner
from sharding.rules import logical_to_spec


# ----- optimizer ------------------------------------------------------------------

def lr_schedule(tc: TrainConfig, peak: float | None = None) -> optax.Schedule:
  """Cosine decay with linear warmup over `warmup_frac` of the steps (1% by default), to
  `peak` (default tc.learning_rate, the AdamW rate; the Muon group uses tc.muon_lr)."""
  peak = tc.learning_rate if peak is None else peak
  warmup = max(1, int(round(tc.warmup_frac * tc.steps)))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(tc.steps, warmup + 1), end_value=peak * tc.min_lr_ratio)


def make_optimizer(tc: TrainConfig, mesh: Mesh | None = None) -> optax.GradientTransformation:
  """Global-norm clipping, then either Per-Head Muon on matrices + AdamW on the rest
  (optimizer="muon", k3_jax/optim/muon.py) or AdamW everywhere. Weight decay on matrices
  only (not norms, biases, decay parameters), read from the parameters' metadata.
  mesh: where the state lies (sharded by the rules table); with tc.muon_placement="owned"
  each Newton-Schulz block is then computed once, whole on one chip (k3_jax/optim/owned.py);
  "sharded" leaves it to the partitioner."""
  if tc.optimizer == "muon":
    owner = None
    if mesh is not None and mesh.size > 1 and tc.muon_placement == "owned":
      owner = Owner(mesh, lambda shape, axes: logical_to_spec(shape, axes, mesh))
    inner = per_head_muon(lr_schedule(tc, tc.muon_lr), lr_schedule(tc), b1=tc.b1, b2=tc.b2,
                          weight_decay=tc.weight_decay, owner=owner)
  else:
    inner = optax.adamw(lr_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                        mask=decay_mask)
  return optax.chain(optax.clip_by_global_norm(tc.grad_clip), inner)


# ----- state ----------------------------------------------------------------------

def split_model(model: K3Model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, params, rest


def init_state(cfg: ModelConfig, tc: TrainConfig, optimizer, mode: str = "host",
               seed=None) -> tuple[Any, dict]:
  """(graphdef, state) for a freshly initialised model (see layers/init.py for `mode`);
  seed: tc.seed by default (a traced int under the sharded init)."""
  seed = tc.seed if seed is None else seed
  graphdef, params, rest = split_model(create_model(cfg, seed=seed, mode=mode))
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "rest": rest,
           "opt_state": optimizer.init(params)}
  return graphdef, state


def abstract_state(cfg: ModelConfig, tc: TrainConfig, optimizer):
  """(graphdef, state of ShapeDtypeStructs) without allocating anything."""
  out = {}

  def f():
    g, s = init_state(cfg, tc, optimizer, mode="abstract")
    out["graphdef"] = g
    return s

  shapes = jax.eval_shape(f)
  return out["graphdef"], shapes


__all__ = ["lr_schedule", "make_optimizer", "split_model", "init_state", "abstract_state"]
