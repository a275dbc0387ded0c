"""How a job runs the model, apart from what the model is: the execution config.

`ModelConfig` (k3_jax/config.py) says what the model computes and what a checkpoint must
match. `ExecConfig` says how one job runs it on its hardware: the mesh, rematerialisation,
gradient accumulation, and the kernels (`Kernels`: the routed experts' grouped matmul, the
expert-parallel capacity, the KDA backend and chunk length). Changing an execution setting
changes the traced program, never the parameters, so a checkpoint written under one resumes
or serves under another. Train, compile and serve each take one `ExecConfig`: the command
line fills it from its flags in one place (main.py), and the model code reads the kernel
choices from the `Parallel` it is called with (`Parallel.kernels`, k3_jax/partitioning.py),
never from a config it was built with.

`PodLayout` is a named preset of it: the execution config a model preset recommends for one
step on one TPU target, with the operating point `compile` measures there (the batch and
lengths).

Plain data: no jax import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from k3_jax.config import (GMM_KINDS, KDA_BACKENDS, MOVED_FIELDS, ConfigError, apply_overrides,
                           option)

REMAT_MODES = ("none", "block", "layer", "dots")


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
  if not ok:       # the message form of config.py's checks: field=value: rule
    raise ConfigError(f"{name}={value!r}: {rule}")


@dataclass(frozen=True)
class Kernels:
  """The kernel choices model code reads at trace time (carried by `Parallel.kernels`; part
  of the traced program's identity, so a jitted step never reuses a trace made for others).

  gmm: the routed experts' grouped matmul, "ragged_dot" | "tiled" | "auto" (by the compile
  target: tiled for CPU, else ragged_dot). ep_capacity: the expert-parallel capacity factor
  c (at most ceil(c n k / P) rows per device pair, the rest dropped; sharding/expert.py);
  0 = dropless. ep_recv_capacity: r bounds the rows a device receives in the ragged expert
  exchange at ceil(r n k) (its buffers and expert FFN that many rows); 0 = P pairs' worth.
  kda_backend: "reference" | "pallas" | "auto" (pallas when compiling for
  TPU). kda_chunk_size: the chunked KDA's chunk length; 0 = by backend (16 on the reference
  path, 64 for Pallas; k3_jax.ops.kda.CHUNK_BY_BACKEND); any length gives the same result
  up to rounding."""
  gmm: str = "auto"
  ep_capacity: float = 0.0
  kda_backend: str = "auto"
  kda_chunk_size: int = 0
  ep_recv_capacity: float = 0.0

  def __post_init__(self):
    check_kernels(self)


def check_kernels(k) -> None:
  """The kernel fields' rules (of a Kernels or an ExecConfig), each error naming its field."""
  _require(k.gmm in GMM_KINDS, "gmm", k.gmm, f"must be one of {', '.join(map(repr, GMM_KINDS))}")
  _require(isinstance(k.ep_capacity, (int, float)) and k.ep_capacity >= 0, "ep_capacity",
           k.ep_capacity, "must be >= 0 (0 = dropless; c > 0 bounds the expert-parallel "
           "buffers)")
  _require(isinstance(k.ep_recv_capacity, (int, float)) and k.ep_recv_capacity >= 0,
           "ep_recv_capacity", k.ep_recv_capacity, "must be >= 0 (0: no receive bound)")
  _require(k.kda_backend in KDA_BACKENDS, "kda_backend", k.kda_backend,
           f"must be one of {', '.join(map(repr, KDA_BACKENDS))}")
  _require(isinstance(k.kda_chunk_size, int) and k.kda_chunk_size >= 0, "kda_chunk_size",
           k.kda_chunk_size, "must be >= 0 (0 = by backend)")


DEFAULT_KERNELS = Kernels()


@dataclass(frozen=True)
class ExecConfig:
  """How one job runs the model (the module docstring): every field is a flag of the jobs
  that read it (`train`, `compile`; `serve` all but TRAIN_ONLY), default None there = the
  preset's (or its pod layout's) value. Validated on construction; an error names the
  field."""
  mesh: str = option("", "mesh axes, e.g. data:2,fsdp:4 (default: fsdp over all devices; "
                     "serve: one device)")
  remat: str = option("none", "none | block (recompute each scanned unit) | layer (block, and "
                      "each layer on its own within it) | dots (keep matmuls)",
                      choices=REMAT_MODES)
  grad_accum: int = option(1, "micro-batches per train step")
  gmm: str = option("auto", "routed-expert grouped matmul: ragged_dot (TPU/GPU) | tiled "
                    "(plain JAX) | auto (by the compile target: tiled for CPU, else "
                    "ragged_dot)", choices=GMM_KINDS)
  ep_capacity: float = option(0.0, "expert-parallel capacity factor c (rows per "
                              "source-destination bounded at c*n*k/P; 0: dropless)")
  kda_backend: str = option("auto", "KDA kernels: reference (plain JAX) | pallas | auto "
                            "(pallas when compiling for TPU)", choices=KDA_BACKENDS)
  kda_chunk_size: int = option(0, "chunked KDA's chunk length (0: by backend, 16 on the "
                               "reference path, 64 for Pallas; results equal up to rounding)")
  ep_recv_capacity: float = option(0.0, "expert-parallel receive bound r (rows a device "
                                   "receives in the ragged exchange at most r*n*k; 0: none)")

  def __post_init__(self):
    _require(isinstance(self.mesh, str), "mesh", self.mesh, "must be a mesh spec string")
    _require(self.remat in REMAT_MODES, "remat", self.remat,
             f"must be one of {', '.join(map(repr, REMAT_MODES))}")
    _require(isinstance(self.grad_accum, int) and self.grad_accum > 0, "grad_accum",
             self.grad_accum, "must be positive")
    check_kernels(self)

  @property
  def kernels(self) -> Kernels:
    """The kernel choices model code reads (through `Parallel.kernels`)."""
    return Kernels(self.gmm, self.ep_capacity, self.kda_backend, self.kda_chunk_size,
                   self.ep_recv_capacity)

  def given(self, **values) -> "ExecConfig":
    """This config with every value that is not None (a flag that was given) put in."""
    return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None})


# The fields a serving job has no use for (they shape the train step only).
TRAIN_ONLY = ("remat", "grad_accum")


def check_batch(run: ExecConfig, batch_size: int) -> None:
  """A train batch splits into run.grad_accum equal micro-batches."""
  _require(batch_size % run.grad_accum == 0, "batch_size", batch_size,
           f"must be divisible by grad_accum={run.grad_accum}")


def split_overrides(overrides) -> tuple[list[str], list[str]]:
  """(model overrides, run overrides): `--override` items naming an ExecConfig field
  (kda_backend=pallas), or a former model field that is an execution setting now
  (config.MOVED_FIELDS: kda.backend=pallas, by its ExecConfig name), are the run's; the
  rest stay the model's."""
  names = {f.name for f in dataclasses.fields(ExecConfig)}
  model, run = [], []
  for item in overrides:
    path, eq, value = item.partition("=")
    name = MOVED_FIELDS.get(path.strip(), path.strip())
    if eq and name in names:
      run.append(f"{name}={value}")
    else:
      model.append(item)
  return model, run


def apply_run_overrides(run: ExecConfig, overrides) -> ExecConfig:
  """run with `field=value` items applied (unknown fields are errors naming them)."""
  return apply_overrides(run, list(overrides))


def moved_from(model_dict: dict) -> dict[str, Any]:
  """The execution settings an old model_config.json held as model fields (kda.backend,
  kda.chunk_size, moe.gmm, moe.ep_capacity), by their ExecConfig field names; {} for a new
  one (config.from_dict drops them from the model)."""
  out = {}
  for path, name in MOVED_FIELDS.items():
    group, field = path.split(".")
    sub = model_dict.get(group)
    if isinstance(sub, dict) and field in sub:
      out[name] = sub[field]
  return out


@dataclass(frozen=True)
class PodLayout:
  """A model preset's recommended execution of one step on one TPU target (a named preset
  of ExecConfig): `compile` takes `run` for every execution flag not given, and the
  operating point (global_batch, seq_len, cache_len, expert_format; 0 / "" = the command's
  own default) for the shape flags not given. An explicit flag always wins."""
  topology: str                     # Cloud TPU name or explicit grid, e.g. "v5p-4096"
  step: str = "train"               # "train" | "prefill" | "decode"
  run: ExecConfig = ExecConfig()
  global_batch: int = 0
  seq_len: int = 0
  cache_len: int = 0                # prefill / decode
  expert_format: str = ""           # prefill / decode: "dense" | "mxfp4"

  def __post_init__(self):
    if not isinstance(self.run, ExecConfig):
      raise ConfigError(f"PodLayout.run={self.run!r}: must be an ExecConfig")


__all__ = ["Kernels", "DEFAULT_KERNELS", "ExecConfig", "PodLayout", "REMAT_MODES",
           "TRAIN_ONLY", "check_batch", "check_kernels", "split_overrides",
           "apply_run_overrides", "moved_from"]
