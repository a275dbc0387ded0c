"""Execution-only config fields (kda.backend, kda.chunk_size, moe.gmm, moe.ep_capacity):
validated by name, seen by jit (they are part of the traced program, not context variables), and not part of a
checkpoint's model identity (resuming under another backend works; another architecture is
still refused). Also the typed parallel-op record of k3_jax/partitioning.py."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax import partitioning
from k3_jax.checkpoint.manager import CheckpointManager, CheckpointMismatch
from k3_jax.config import EXECUTION_FIELDS, ConfigError, apply_overrides, validate
from k3_jax.layers.init import Init
from k3_jax.layers.moe import MoE

CFG = configs.get("k3_tiny")


@pytest.mark.parametrize("override, field", [("moe.gmm=cuda", "moe.gmm"),
                                             ("moe.ep_capacity=-1", "moe.ep_capacity"),
                                             ("kda.backend=triton", "kda.backend"),
                                             ("kda.chunk_size=-16", "kda.chunk_size")])
def test_bad_execution_values_name_the_field(override, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    validate(apply_overrides(CFG, [override]))


def test_resume_under_other_execution_fields(tmp_path):
  """A checkpoint saved with the defaults restores, bit for bit, into a manager opened with
  --override=kda.backend=pallas (and the other execution fields changed); the saved
  model_config.json is left as it was; an architecture change is still refused."""
  state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.asarray(3, jnp.int32)}
  mgr = CheckpointManager(str(tmp_path), CFG)
  mgr.save(3, state, {"pos": 7})
  mgr.wait()
  mgr.close()
  cfg_path = os.path.join(tmp_path, "checkpoints", "model_config.json")
  saved_text = open(cfg_path).read()

  other = validate(apply_overrides(CFG, ["kda.backend=pallas", "kda.chunk_size=32",
                                         "moe.gmm=ragged_dot", "moe.ep_capacity=1.25"]))
  assert set(EXECUTION_FIELDS) == {"kda.backend", "kda.chunk_size", "moe.gmm",
                                   "moe.ep_capacity"}
  resumed = CheckpointManager(str(tmp_path), other)            # no CheckpointMismatch
  assert resumed.latest_step() == 3
  rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  got, data = resumed.restore(jax.eval_shape(lambda: state), {"w": rep, "step": rep})
  np.testing.assert_array_equal(got["w"], state["w"])
  assert int(got["step"]) == 3 and data == {"pos": 7}
  resumed.close()
  assert open(cfg_path).read() == saved_text                    # not overwritten
  assert json.loads(saved_text)["kda"]["backend"] == "auto"
  assert CFG.kda.num_heads != 4
  with pytest.raises(CheckpointMismatch, match="kda.num_heads"):
    CheckpointManager(str(tmp_path), apply_overrides(other, ["kda.num_heads=4"]))


def test_gmm_field_changes_the_traced_program_not_the_result():
  """moe.gmm picks the grouped matmul at trace time from the config: "ragged_dot" lowers
  to the ragged_dot primitive, "tiled" to plain einsums; both compute the same layer output
  (tolerance: float32 reassociation of the same sums, 1e-5 relative)."""
  # 80 tokens: above moe_ops.SMALL_TOKENS, so the grouped-matmul path runs (not moe_small)
  x = jax.random.normal(jax.random.key(0), (2, 40, CFG.d_model), jnp.float32)
  outs = {}
  for kind in ("tiled", "ragged_dot"):
    layer = MoE(apply_overrides(CFG, [f"moe.gmm={kind}"]), init=Init(3))
    graphdef, state = nnx.split(layer)
    f = lambda state, x: nnx.merge(graphdef, state)(x)[0]
    prims = str(jax.make_jaxpr(f)(state, x))
    assert ("ragged_dot" in prims) == (kind == "ragged_dot"), kind
    outs[kind] = f(state, x)
  np.testing.assert_allclose(outs["ragged_dot"], outs["tiled"], rtol=1e-5, atol=1e-6)


def test_parallel_ops_is_a_typed_record():
  assert partitioning.SINGLE.ops == partitioning.ParallelOps()         # one device: none
  fields = {f.name for f in dataclasses.fields(partitioning.ParallelOps)}
  assert fields == {"moe_dispatch", "chunk_kda", "short_conv", "latent_attention",
                    "absorbed_attention", "paged_attention"}
  with pytest.raises(TypeError):
    partitioning.ParallelOps(chunk_kdaa=lambda *a: a)                  # a misspelt op
  with pytest.raises(TypeError, match="ParallelOps"):
    partitioning.Parallel(ops={"chunk_kda": None}, key="dict")
  op = lambda *a, **k: "installed"
  with pytest.raises(ValueError, match="key"):       # would compare equal to SINGLE
    partitioning.Parallel(ops=partitioning.ParallelOps(short_conv=op))
  par = partitioning.Parallel(ops=partitioning.ParallelOps(short_conv=op), key="custom conv")
  assert par.ops.short_conv is op and par.ops.chunk_kda is None
  assert par != partitioning.SINGLE and hash(par) != hash(partitioning.SINGLE)


@pytest.mark.slow
def test_training_resumes_on_the_pallas_backend(tmp_path):
  """End to end: 2 steps on the reference backend, then the run resumes from its checkpoint
  with kda.backend=pallas (the kernels, interpret mode here) for steps 3-4; its losses equal
  an uninterrupted reference run's to 1e-4 relative (the kernel and the reference chunk
  form reassociate the same float32 sums differently; the module tolerance of
  tests/pallas/test_pallas_kda_layer.py)."""
  from k3_jax import train
  from k3_jax.data import mqar
  from sharding.mesh import make_mesh, parse_mesh
  tc = dataclasses.replace(configs.get_train("k3_tiny"), steps=4, batch_size=2, seq_len=32,
                           checkpoint_every=2, eval_every=100, log_every=1)
  mesh = make_mesh(parse_mesh(""), devices=jax.devices()[:1])
  it = lambda: mqar.mqar_dataset(tc.batch_size, tc.seq_len, CFG.vocab_size, num_kv_pairs=4,
                                 seed=3)
  pallas = validate(apply_overrides(CFG, ["kda.backend=pallas"]))
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  quiet = lambda s: None
  train.run(CFG, tc, full, mesh, it(), [], ckpt=CheckpointManager(full, CFG), log=quiet)
  train.run(CFG, tc, part, mesh, it(), [], ckpt=CheckpointManager(part, CFG), log=quiet,
            stop_after=2)
  train.run(pallas, tc, part, mesh, it(), [], ckpt=CheckpointManager(part, pallas), log=quiet)
  read = lambda d: [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
  want, got = read(full), read(part)
  assert [r["step"] for r in got] == [1, 2, 3, 4]
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-4)
