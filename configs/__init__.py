"""Model presets, one module each. `get(name)` returns a validated ModelConfig."""

from __future__ import annotations

import importlib

from k3_jax.config import ConfigError, ModelConfig, TrainConfig, validate

PRESETS = ("k3", "k3_small", "k3_tiny", "kimi_linear_48b")


def get(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise ConfigError(f"unknown config {name!r}; valid configs are: {', '.join(PRESETS)}")
  return validate(importlib.import_module(f"configs.{name}").get_config())


def get_train(name: str) -> TrainConfig:
  """The preset's default training settings (TrainConfig defaults where it has none)."""
  if name not in PRESETS:
    raise ConfigError(f"unknown config {name!r}; valid configs are: {', '.join(PRESETS)}")
  mod = importlib.import_module(f"configs.{name}")
  return mod.get_train_config() if hasattr(mod, "get_train_config") else TrainConfig()
