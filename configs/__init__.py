"""Model presets, one module each. `get(name)` returns a validated ModelConfig."""

from __future__ import annotations

import dataclasses
import importlib

from k3_jax.config import ConfigError, ModelConfig, TrainConfig, validate
from k3_jax.execution import ExecConfig, PodLayout

PRESETS = ("k3", "k3_small", "k3_tiny", "kimi_linear_48b")


def get(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise ConfigError(f"unknown config {name!r}; valid configs are: {', '.join(PRESETS)}")
  return validate(importlib.import_module(f"configs.{name}").get_config())


def get_multimodal(name: str) -> ModelConfig:
  """The preset with its vision tower attached (ModelConfig.vision), for jobs that use images.
  Text-only jobs use `get`: their model, checkpoints and outputs are exactly as before."""
  cfg = get(name)
  mod = importlib.import_module(f"configs.{name}")
  if not hasattr(mod, "get_vision_config"):
    raise ConfigError(f"config {name!r} has no vision tower; presets with one: "
                      f"{', '.join(n for n in PRESETS if hasattr(importlib.import_module(f'configs.{n}'), 'get_vision_config'))}")
  return validate(dataclasses.replace(cfg, vision=mod.get_vision_config()))


def get_train(name: str) -> TrainConfig:
  """The preset's default training settings (TrainConfig defaults where it has none)."""
  if name not in PRESETS:
    raise ConfigError(f"unknown config {name!r}; valid configs are: {', '.join(PRESETS)}")
  mod = importlib.import_module(f"configs.{name}")
  return mod.get_train_config() if hasattr(mod, "get_train_config") else TrainConfig()


def get_exec(name: str) -> ExecConfig:
  """The preset's default execution settings (ExecConfig defaults where it has none): what a
  job on it runs with where no flag and no pod layout says otherwise."""
  if name not in PRESETS:
    raise ConfigError(f"unknown config {name!r}; valid configs are: {', '.join(PRESETS)}")
  mod = importlib.import_module(f"configs.{name}")
  return mod.get_exec_config() if hasattr(mod, "get_exec_config") else ExecConfig()


def get_pod_layouts(name: str) -> tuple[PodLayout, ...]:
  """The preset's recommended pod layouts (one per target and step; none for most presets):
  what `compile` applies where a flag is not given."""
  if name not in PRESETS:
    raise ConfigError(f"unknown config {name!r}; valid configs are: {', '.join(PRESETS)}")
  mod = importlib.import_module(f"configs.{name}")
  return tuple(mod.get_pod_layouts()) if hasattr(mod, "get_pod_layouts") else ()
