import dataclasses

import pytest

import configs
from k3_jax.config import ConfigError, apply_overrides, validate, validate_train, TrainConfig
from sharding.mesh import mesh_shape, parse_mesh


def test_unknown_config_lists_valid_ones():
  with pytest.raises(ConfigError) as e:
    configs.get("k4")
  for name in configs.PRESETS:
    assert name in str(e.value)


def test_override_unknown_field_is_named():
  with pytest.raises(ConfigError, match="num_hedas"):
    apply_overrides(configs.get("k3_tiny"), ["kda.num_hedas=4"])
  with pytest.raises(ConfigError, match="nonexistent"):
    apply_overrides(configs.get("k3_tiny"), ["nonexistent=1"])


def test_override_applies_and_parses_types():
  cfg = apply_overrides(configs.get("k3_tiny"),
                        ["kda.num_heads=4", "moe.routed_scaling_factor=2.5", "mla_layers=4,8",
                         "mla.output_gate=false"])
  assert cfg.kda.num_heads == 4 and cfg.moe.routed_scaling_factor == 2.5
  assert cfg.mla_layers == (4, 8) and cfg.mla.output_gate is False
  with pytest.raises(ConfigError, match="kda.num_heads"):
    apply_overrides(configs.get("k3_tiny"), ["kda.num_heads=four"])


@pytest.mark.parametrize("override,field", [
    ("moe.top_k=99", "moe.top_k"), ("kda.decay=exp", "kda.decay"), ("mla_layers=0,4", "mla_layers"),
    ("kda.g_min=1.0", "kda.g_min"), ("moe.n_group=3", "moe.n_group"), ("d_model=0", "d_model"),
])
def test_validation_names_field_value_and_rule(override, field):
  with pytest.raises(ConfigError) as e:
    validate(apply_overrides(configs.get("k3_tiny"), [override]))
  assert field in str(e.value)


def test_train_validation():
  cfg = configs.get("k3_tiny")
  with pytest.raises(ConfigError, match="seq_len"):
    validate_train(TrainConfig(seq_len=100_000), cfg)
  from k3_jax.execution import ExecConfig, check_batch      # grad_accum: an execution setting
  with pytest.raises(ConfigError, match="grad_accum"):
    check_batch(ExecConfig(grad_accum=4), validate_train(TrainConfig(batch_size=6, seq_len=32),
                                                         cfg).batch_size)


def test_stack_plan_scans_the_repeating_blocks():
  # k3: layer 1 (dense FFN) unscanned, 22 x 4 layers scanned, 4 unscanned at the end.
  assert configs.get("k3").stack_plan() == (1, 22, 4)
  pre, reps, per = configs.get("k3_tiny").stack_plan()
  assert reps >= 2 and pre + reps * per <= 13


def test_mesh_parsing_and_errors():
  assert mesh_shape(parse_mesh("data:2,fsdp:-1"), 8) == (2, 4, 1, 1, 1)
  with pytest.raises(ConfigError, match="bogus"):
    parse_mesh("bogus:2")
  with pytest.raises(ConfigError, match="needs 6 devices"):
    mesh_shape(parse_mesh("data:2,fsdp:3"), 8)


def test_configs_are_frozen():
  cfg = configs.get("k3_tiny")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.d_model = 3
