"""One home per default, one draw per parameter.

- TrainConfig: every field declares its help and whether it shapes the compiled steps
  (config.option); the CLI defines a flag for each, `train` lists them all, and the steps'
  cache key (train._step_relevant) ignores exactly the fields declared step=False.
- ServeConfig: the `serve` flags, loader.ServeOptions and a bare Engine default to it.
- Init: the host init (eager, blockwise) and the traced one (jit, vmapped rows of stacked
  layers) give bit-identical weights for a seed; another seed gives others.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import main
from k3_jax import train
from k3_jax.config import (SERVE_PAGE, ConfigError, ServeConfig, TrainConfig, apply_overrides,
                           flag_fields, validate)
from k3_jax.model import create_model


def test_every_train_config_field_is_declared_and_a_flag_of_train():
  for f in flag_fields(TrainConfig):
    assert f.metadata["help"], f.name
    assert isinstance(f.metadata["step"], bool), f.name
    assert f.name in main.FLAGS, f.name
    assert main.FLAGS[f.name].default is None, f.name          # None: the preset's value
    assert f.name in main.COMMANDS["train"].flags, f.name
    choices = f.metadata["choices"]
    if choices:
      assert f.default in choices and main.FLAGS[f.name].parser.enum_values == list(choices)
  assert main.TRAIN_CONFIG_FLAGS == tuple(f.name for f in dataclasses.fields(TrainConfig))


def test_only_step_fields_change_the_steps_cache_key():
  tc = TrainConfig()
  key = train._step_relevant(tc)
  for f in dataclasses.fields(TrainConfig):
    d, choices = f.default, f.metadata["choices"]
    other = (next(c for c in choices if c != d) if choices else
             d + "x" if isinstance(d, str) else d + 1)
    changed = train._step_relevant(dataclasses.replace(tc, **{f.name: other}))
    assert (changed == key) is (not f.metadata["step"]), f.name
  assert not {f.name for f in dataclasses.fields(TrainConfig) if not f.metadata["step"]} - {
      "init", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
      "log_every", "dataset", "tokenizer"}


def test_serve_defaults_have_one_home():
  from k3_jax.serve import kv_pages
  from k3_jax.serve.engine import Engine
  from k3_jax.serve.loader import ServeOptions
  default = ServeConfig()
  for f in flag_fields(ServeConfig):
    assert f.metadata["help"] and f.name in main.COMMANDS["serve"].flags, f.name
    assert main.FLAGS[f.name].default == getattr(default, f.name), f.name
  assert ServeOptions().serve == default
  assert kv_pages.PAGE == SERVE_PAGE
  cfg = validate(apply_overrides(configs.get("k3_tiny"), ["max_seq_len=512", "num_layers=2",
                                                           "mla_layers=(2,)"]))
  g, p, r = nnx.split(create_model(cfg), nnx.Param, ...)
  eng = Engine(cfg, g, p, r)                                 # no settings: the defaults
  assert eng.serve == default
  assert (eng.max_batch, eng.prefill_chunk, eng.max_queue) == (
      default.max_batch, default.prefill_chunk, default.max_queue)
  assert eng.max_len == cfg.max_seq_len and eng.prefix is not None
  assert Engine(cfg, g, p, r, max_batch=2, prefix_cache_bytes=0).serve == dataclasses.replace(
      default, max_batch=2, prefix_cache_bytes=0)


def test_execution_settings_have_one_home():
  """Every ExecConfig field is declared once (k3_jax/execution.py) and is the one flag of
  train and compile (serve: all but the train-only ones), default None = the base's value;
  no ModelConfig, TrainConfig or ServeConfig field repeats one; the kernels' defaults are
  ExecConfig's, the single-device Parallel's and a bare Engine's."""
  from k3_jax import partitioning
  from k3_jax.execution import DEFAULT_KERNELS, TRAIN_ONLY, ExecConfig, Kernels, PodLayout
  names = tuple(f.name for f in flag_fields(ExecConfig))
  assert main.EXEC_CONFIG_FLAGS == names
  for f in flag_fields(ExecConfig):
    assert f.metadata["help"] and main.FLAGS[f.name].default is None, f.name
    for command in ("train", "compile"):
      assert f.name in main.COMMANDS[command].flags, (command, f.name)
    assert (f.name in main.COMMANDS["serve"].flags) is (f.name not in TRAIN_ONLY), f.name
  others = [f.name for cls in (TrainConfig, ServeConfig) for f in dataclasses.fields(cls)]
  cfg = configs.get("k3_tiny")
  others += [f"{g}.{f.name}" for g in ("kda", "moe") for f in dataclasses.fields(getattr(cfg, g))]
  assert not set(names) & set(others)
  assert not {"kda.backend", "kda.chunk_size", "moe.gmm", "moe.ep_capacity"} & set(others)
  kernels = {f.name for f in dataclasses.fields(Kernels)}
  assert ExecConfig().kernels == DEFAULT_KERNELS == Kernels() == partitioning.SINGLE.kernels
  assert {n: getattr(ExecConfig(), n) for n in kernels} == dataclasses.asdict(Kernels())
  assert PodLayout("v5p-8").run == ExecConfig()


@pytest.mark.parametrize("bad", [dict(max_batch=0), dict(prefill_chunk=768),
                                 dict(prefill_chunk=0), dict(prefix_cache_bytes=-1),
                                 dict(max_len=0), dict(port=70000),
                                 dict(speculative="eagle"), dict(num_speculative_tokens=0),
                                 dict(draft_dir="runs/d"),   # without --speculative=draft
                                 dict(speculative="draft")])  # without --draft_dir
def test_serve_config_is_validated(bad):
  with pytest.raises(ConfigError, match=next(iter(bad))):
    ServeConfig(**bad)


# three identical KDA + MoE layers: one scanned unit stacked 3 times (rows 0..2)
STACKED = validate(apply_overrides(configs.get("k3_tiny"), [
    "num_layers=3", "mla_layers=()", "dense_layers=()", "scan_period=1"]))


def _bits(tree):
  return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def test_host_and_traced_init_are_bit_identical():
  assert STACKED.stack_plan()[1] == 3
  host = nnx.state(create_model(STACKED, seed=5))
  again = nnx.state(create_model(STACKED, seed=5))
  other = nnx.state(create_model(STACKED, seed=6))
  traced = jax.jit(lambda s: nnx.state(create_model(STACKED, seed=s, mode="jax")),
                   compiler_options={"xla_backend_optimization_level": 0})(jnp.int32(5))
  for a, b, t in zip(_bits(host), _bits(again), _bits(traced), strict=True):
    assert np.array_equal(a, b) and np.array_equal(a, t)
  drawn = [(np.asarray(x, np.float32), np.asarray(y, np.float32))
           for x, y in zip(jax.tree.leaves(host), jax.tree.leaves(other))
           if np.asarray(x, np.float32).std() > 0]
  assert len(drawn) > 10 and all(not np.array_equal(x, y) for x, y in drawn)
  # the rows of a stacked unit are drawn from their own streams
  w = nnx.state(create_model(STACKED, seed=5)).units.layers[0].ffn.w_gate[...]
  assert w.shape[0] == 3 and not np.array_equal(w[0], w[1])


def test_init_draws_have_the_intended_distribution():
  from k3_jax.layers.init import Init
  x = np.asarray(Init(0).normal((256, 512), 0.5), np.float64)
  assert abs(x.mean()) < 0.01 and abs(x.std() - 0.5) < 0.01
  assert np.abs(x).max() <= 2 / 0.8796256610342398 * 0.5 * (1 + 1e-6)
  u = np.asarray(Init(0).uniform((100_000,), 1.0, 16.0), np.float64)
  assert u.min() >= 1.0 and u.max() < 16.0 and abs(u.mean() - 8.5) < 0.1
  b = Init(0).normal((64, 64), 1.0, jnp.bfloat16)
  assert b.dtype == jnp.bfloat16
