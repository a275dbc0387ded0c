"""What inference (generate, serving) loads from a training workdir: the model config, the
parameters and balancing biases of a good checkpoint (never the optimizer state), and the
tokenizer the model was trained with."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from k3_jax.checkpoint.manager import CheckpointManager, saved_config
from k3_jax.checkpoint.resume import saved_train_config
from k3_jax.config import ModelConfig
from k3_jax.model import create_model
from sharding.rules import tree_shardings


@dataclasses.dataclass
class Loaded:
  cfg: ModelConfig
  step: int
  graphdef: Any
  params: Any        # nnx.State of the Params
  rest: Any          # nnx.State of everything else (the MoE balancing biases)


def abstract_inference_state(cfg: ModelConfig):
  """(graphdef, {"step", "params", "rest"} as ShapeDtypeStructs): the checkpoint entries
  inference reads, nothing allocated."""
  out = {}

  def f():
    g, params, rest = nnx.split(create_model(cfg, mode="abstract"), nnx.Param, ...)
    out["graphdef"] = g
    return {"step": jnp.zeros((), jnp.int32), "params": params, "rest": rest}

  shapes = jax.eval_shape(f)
  return out["graphdef"], shapes


def load_for_inference(workdir: str, mesh: Mesh, step: int | None = None,
                       log: Callable[[str], None] = print) -> Loaded:
  """Parameters and balancing biases of `step` (default: the newest good checkpoint; a
  damaged or non-finite newer one is reported in one line and skipped). Reads only."""
  cfg = saved_config(workdir)
  if cfg is None:
    raise FileNotFoundError(f"no checkpoints in {workdir}: train first "
                            f"(python main.py train --workdir={workdir})")
  ckpt = CheckpointManager(workdir, cfg, read_only=True)
  graphdef, abstract = abstract_inference_state(cfg)
  shardings = tree_shardings(abstract, mesh)
  good, params, rest = ckpt.restore_params(abstract, shardings, step=step, log=log)
  ckpt.close()
  return Loaded(cfg, good, graphdef, params, rest)


def trained_tokenizer(workdir: str, override: str | None = None) -> str:
  """The tokenizer spec to use with a workdir's model: `override` if given, else the one in
  its train_config.json ("byte" when none is recorded). A recorded file that no longer
  exists is a clear error."""
  if override:
    return override
  saved = saved_train_config(workdir) or {}
  spec = saved.get("tokenizer") or "byte"
  if spec != "byte" and not os.path.exists(spec):
    raise FileNotFoundError(
        f"{workdir} was trained with tokenizer {spec!r} (train_config.json), which no longer "
        f"exists; pass --tokenizer=PATH to the same BPE file")
  return spec
