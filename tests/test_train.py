"""Train step: learns, equals itself sharded over 8 devices, accumulates gradients exactly,
and resumes from a checkpoint (data iterator included) as if never interrupted."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from k3_jax import train
from k3_jax.checkpoint.manager import CheckpointManager, CheckpointMismatch
from k3_jax.config import apply_overrides
from k3_jax.execution import ExecConfig
from k3_jax.data import mqar
from sharding.mesh import make_mesh, parse_mesh

CFG = configs.get("k3_tiny")
TC = dataclasses.replace(configs.get_train("k3_tiny"), batch_size=8, seq_len=32,
                         learning_rate=1e-2)
# The compiled-step tests (compile time dominates them): k3_tiny cut to 6 layers that keep
# every kind -- an unscanned dense KDA layer, a scan of 2 x [KDA+MoE, MLA+MoE] units, an
# unscanned MLA+MoE tail -- and AttnRes blocks closing inside the scan: 4 layer bodies to
# compile instead of 9.
STEP_CFG = dataclasses.replace(CFG, num_layers=6, mla_layers=(3, 5, 6), scan_period=2)


def _batches(n, seed=0):
  it = mqar.mqar_dataset(TC.batch_size, TC.seq_len, CFG.vocab_size, num_kv_pairs=4, seed=seed)
  return [next(it) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def _steps(mesh_spec: str, grad_accum: int = 1):
  devices = jax.devices()[:1] if mesh_spec == "single" else jax.devices()
  mesh = make_mesh(parse_mesh("" if mesh_spec == "single" else mesh_spec), devices=devices)
  return train.build_steps(STEP_CFG, TC, mesh, ExecConfig(grad_accum=grad_accum))


def _run(steps, batches):
  state = steps.init()
  losses = []
  for b in batches:
    state, m = steps.train(state, train.put_batch(b, steps.batch_sharding))
    losses.append(float(m["loss"]))
  return state, losses


def test_loss_falls_on_a_repeated_batch():
  steps = _steps("single")
  b = _batches(1)[0]
  _, losses = _run(steps, [b] * 6)
  assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow   # 38 s of 8-device compiles (suite budget); the sharded optimizer step
# alone stays in the default suite (tests/optim/test_muon.py)
def test_sharded_equals_single_device():
  batches = _batches(2, seed=1)
  s1, l1 = _run(_steps("single"), batches)
  s8, l8 = _run(_steps("data:2,fsdp:4"), batches)
  # Same math, different reduction order across devices: f32 agreement ~1e-6.
  np.testing.assert_allclose(l1, l8, rtol=1e-5)
  # Parameters and the Quantile Balancing biases (exact quantiles over the global batch).
  p1 = jax.tree.leaves((s1["params"], s1["rest"]))
  p8 = jax.tree.leaves((s8["params"], s8["rest"]))
  # Adam divides by sqrt(v): for near-zero gradients it turns 1e-7 reduction-order noise
  # into ~1e-6 parameter differences after two steps, hence the absolute tolerance.
  for a, b in zip(p1, p8):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # The parameters really are distributed over the 8 devices.
  emb = s8["params"]["embed"]["table"][...]
  assert len(emb.sharding.device_set) == 8 and not emb.sharding.is_fully_replicated


def test_router_bias_updated_by_train_step_only():
  steps = _steps("single")
  state = steps.init()
  biases = lambda s: [np.asarray(l) for l in jax.tree.leaves(s["rest"])]
  before = biases(state)
  assert all((b == 0).all() for b in before)
  b = train.put_batch(_batches(1, seed=3)[0], steps.batch_sharding)
  # Evaluation leaves state alone: its program returns the loss terms only (no state to
  # carry a moved bias out) and donates none of its inputs. Checked on its lowering, not
  # run: the eval step's compile (~5 s) is the CLI tests' (eval_loss in tests/test_cli.py).
  assert jax.tree.map(lambda x: x.shape, jax.eval_shape(steps.eval, state, b)) == ((), ())
  assert not any(a.donated for a in jax.tree.leaves(steps.eval.lower(state, b).args_info))
  assert all((x == y).all() for x, y in zip(before, biases(state)))
  state, m = steps.train(state, b)
  after = biases(state)
  assert any(np.abs(a).max() > 0 for a in after)          # QB moved the biases ...
  assert all(abs(float(a.mean())) < 1e-5 for a in after)  # ... and centred them
  assert {"load_max_mean", "zero_load_experts", "load_max_mean_avg"} <= set(m)
  # The bias is state, not a parameter: the optimizer holds nothing for it.
  assert not any(any(getattr(k, "key", None) == "bias" for k in path) for path, _ in
                 jax.tree_util.tree_flatten_with_path(state["opt_state"])[0])


@pytest.mark.slow
def test_grad_accumulation_equals_one_big_batch():
  batch = _batches(1, seed=2)
  s1, l1 = _run(_steps("single"), batch)
  s2, l2 = _run(_steps("single", 2), batch)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_resume_continues_exactly(tmp_path):
  tc = dataclasses.replace(TC, checkpoint_every=3, eval_every=100, log_every=1)
  mesh = _steps("single").mesh
  it = lambda: mqar.mqar_dataset(tc.batch_size, tc.seq_len, CFG.vocab_size, num_kv_pairs=4,
                                 seed=7)
  full_dir, part_dir = str(tmp_path / "full"), str(tmp_path / "part")
  train.run(STEP_CFG, tc, full_dir, mesh, it(), [], ckpt=CheckpointManager(full_dir, STEP_CFG),
            log=lambda s: None)
  # Interrupted run: 2 steps, then a fresh process resumes to 4.
  train.run(STEP_CFG, tc, part_dir, mesh, it(), [], ckpt=CheckpointManager(part_dir, STEP_CFG),
            log=lambda s: None, stop_after=2)
  train.run(STEP_CFG, tc, part_dir, mesh, it(), [], ckpt=CheckpointManager(part_dir, STEP_CFG),
            log=lambda s: None)
  read = lambda d: [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
  full, part = read(full_dir), read(part_dir)
  assert [r["step"] for r in part] == [1, 2, 3, 4]
  np.testing.assert_allclose([r["loss"] for r in full], [r["loss"] for r in part], rtol=1e-6)
  for key in ("loss", "grad_norm", "lr_adamw", "tokens_per_sec", "step_time"):
    assert key in full[-1]
  assert "lr_muon" not in full[-1]                  # TC trains with AdamW alone
  # The logged rate is the schedule's at the step that was taken (step r["step"] - 1).
  np.testing.assert_allclose([r["lr_adamw"] for r in full],
                             [float(train.lr_schedule(tc)(r["step"] - 1)) for r in full],
                             rtol=1e-6)


def test_lr_metrics_log_each_optimizer_group_rate():
  """Under muon both rates are logged, each the cosine schedule from its own peak (before,
  one `lr` was AdamW's even under Muon); under adamw only lr_adamw."""
  muon = dataclasses.replace(TC, optimizer="muon", muon_lr=0.02, learning_rate=0.004, steps=50)
  for step in (0, 1, 10, 49):
    m = train.lr_metrics(muon, step)
    assert float(m["lr_adamw"]) == pytest.approx(float(train.lr_schedule(muon, 0.004)(step)))
    assert float(m["lr_muon"]) == pytest.approx(float(train.lr_schedule(muon, 0.02)(step)))
    if step:
      assert float(m["lr_muon"]) == pytest.approx(5 * float(m["lr_adamw"]))
  assert set(train.lr_metrics(dataclasses.replace(muon, optimizer="adamw"), 3)) == {"lr_adamw"}


def test_checkpoint_of_another_config_is_refused(tmp_path):
  other = apply_overrides(CFG, ["d_model=48"])
  # A config left by a start that failed before any checkpoint protects nothing: replaced.
  CheckpointManager(str(tmp_path), CFG).close()
  CheckpointManager(str(tmp_path), other).close()
  ckpt = CheckpointManager(str(tmp_path), CFG)
  ckpt.save(1, {"x": jnp.zeros((2,))}, {})
  ckpt.wait()
  with pytest.raises(CheckpointMismatch, match="d_model"):
    CheckpointManager(str(tmp_path), other)


def test_bf16_state_leaves_the_step_in_its_dtypes():
  """A BF16 model under Muon: every leaf of the state (parameters, Muon momentum, AdamW
  moments) leaves the step in the dtype it came in, so the donated state is reused and the
  second step finds the same signature. (A float32 token count once promoted BF16
  gradients, and with them the momentum, to float32: 1.5x the state per chip at k3 size.)
  Shapes only: jax.eval_shape traces the real step without running it (5 layers: every
  kind of parameter and optimizer group, half the tracing of 13)."""
  cfg = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16", num_layers=5,
                            mla_layers=(4, 5))
  tc = dataclasses.replace(TC, optimizer="muon")
  optimizer = train.make_optimizer(tc)
  graphdef, state = train.abstract_state(cfg, tc, optimizer)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _batches(1)[0].items()}
  new_state, _ = jax.eval_shape(
      functools.partial(train.train_step, graphdef, optimizer, cfg, tc), state, batch)
  dtypes = lambda t: jax.tree.map(lambda x: str(x.dtype), t)
  assert "bfloat16" in jax.tree.leaves(dtypes(state["opt_state"]))
  assert dtypes(new_state) == dtypes(state)


def test_micro_batch_rows_must_split_over_the_batch_axes():
  """A micro-batch smaller than the batch shards is refused before compiling: the rules would
  replicate its rows over the axes that do not divide them (at k3 scale: 6.09T of
  temporaries, reported by the TPU compiler after 20 minutes)."""
  from k3_jax.config import ConfigError
  from sharding.mesh import validate_mesh
  sizes = {"data": 2, "fsdp": 2, "expert": 2}
  validate_mesh(CFG, sizes, 16, grad_accum=2)               # 8 rows over 8 shards
  with pytest.raises(ConfigError, match=r"micro-batch=4 \(global batch 8 / grad_accum 2\) "
                     r"is not divisible by mesh data:2\*fsdp:2\*expert:2 = 8"):
    validate_mesh(CFG, sizes, 8, grad_accum=2)
  validate_mesh(CFG, sizes, 8)                               # one batch of 8 rows splits
  validate_mesh(CFG, {"fsdp": 4, "sequence": 2}, 8, grad_accum=2)   # sequence: not a batch axis
  with pytest.raises(ConfigError, match=r"global batch=12 is not divisible by grad_accum=8"):
    validate_mesh(CFG, {"fsdp": 1}, 12, grad_accum=8)        # not the floor-divided rows
