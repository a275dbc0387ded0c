"""The execution config (k3_jax/execution.py): how a job runs the model (mesh, remat,
grad_accum, and the kernels: gmm, ep_capacity, kda_backend, kda_chunk_size), apart from the
ModelConfig. Validated by name; the kernels reach the traced program through the `Parallel`
the model is called with (seen by jit, never context variables); not part of a checkpoint's
model identity, and an old model_config.json that still holds them as model fields loads,
matches and gives them back. Also the typed parallel-op record of k3_jax/partitioning.py."""

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
from k3_jax.checkpoint.manager import CheckpointManager, CheckpointMismatch, saved_execution
from k3_jax.config import MOVED_FIELDS, ConfigError, apply_overrides, from_dict, to_dict
from k3_jax.execution import (ExecConfig, Kernels, PodLayout, apply_run_overrides, check_batch,
                              moved_from, split_overrides)
from k3_jax.layers.init import Init
from k3_jax.layers.moe import MoE

CFG = configs.get("k3_tiny")


@pytest.mark.parametrize("override, field", [("gmm=cuda", "gmm"),
                                             ("ep_capacity=-1", "ep_capacity"),
                                             ("kda_backend=triton", "kda_backend"),
                                             ("kda_chunk_size=-16", "kda_chunk_size"),
                                             ("remat=all", "remat"),
                                             ("grad_accum=0", "grad_accum")])
def test_bad_execution_values_name_the_field(override, field):
  with pytest.raises(ConfigError, match=rf"^{field}="):
    apply_run_overrides(ExecConfig(), [override])
  if field not in ("remat", "grad_accum"):                 # the kernels alone, the same rule
    name, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{field}="):
      Kernels(**{name: type(getattr(Kernels(), name))(value)})
  with pytest.raises(ConfigError, match="batch_size=6: must be divisible by grad_accum=4"):
    check_batch(ExecConfig(grad_accum=4), 6)
  with pytest.raises(ConfigError, match="PodLayout.run"):
    PodLayout("v5p-8", run={"mesh": "fsdp:4"})


def test_model_config_holds_no_execution_fields():
  """The former execution fields are not ModelConfig fields; an --override naming one goes
  to the execution config by its new name, the rest stay the model's."""
  for path in MOVED_FIELDS:
    group, name = path.split(".")
    assert name not in {f.name for f in dataclasses.fields(getattr(CFG, group))}
    with pytest.raises(ConfigError, match="has no field"):
      apply_overrides(CFG, [f"{path}=1"])
  model, run = split_overrides(["kda.num_heads=4", "kda.backend=pallas", "moe.gmm=tiled",
                                "moe.ep_capacity=1.5", "kda.chunk_size=32"])
  assert model == ["kda.num_heads=4"]
  assert apply_run_overrides(ExecConfig(), run).kernels == Kernels(
      gmm="tiled", ep_capacity=1.5, kda_backend="pallas", kda_chunk_size=32)


def _old_config_json(cfg, **moved) -> dict:
  """cfg's to_dict as a model_config.json written before the execution fields moved out."""
  d = json.loads(json.dumps(to_dict(cfg)))
  for path, name in MOVED_FIELDS.items():
    group, field = path.split(".")
    d[group][field] = moved[name]
  return d


def test_old_model_config_with_execution_fields_loads_and_moves_them(tmp_path):
  """A workdir whose model_config.json still holds kda.backend, kda.chunk_size, moe.gmm and
  moe.ep_capacity (as every checkpoint written before the move does): the config loads as
  the same ModelConfig, the settings come back by their ExecConfig names, the checkpoint
  restores bit for bit into a manager opened for the model (no CheckpointMismatch), the
  file is left as it was, and an architecture change is still refused."""
  state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.asarray(3, jnp.int32)}
  mgr = CheckpointManager(str(tmp_path), CFG)
  mgr.save(3, state, {"pos": 7})
  mgr.wait()
  mgr.close()
  cfg_path = os.path.join(tmp_path, "checkpoints", "model_config.json")
  old = {"kda_backend": "pallas", "kda_chunk_size": 32, "gmm": "ragged_dot",
         "ep_capacity": 1.25}
  with open(cfg_path, "w") as f:
    json.dump(_old_config_json(CFG, **old), f)
  saved_text = open(cfg_path).read()

  assert from_dict(json.loads(saved_text)) == CFG
  assert moved_from(json.loads(saved_text)) == old == saved_execution(str(tmp_path))
  assert moved_from(to_dict(CFG)) == {}
  resumed = CheckpointManager(str(tmp_path), CFG)              # no CheckpointMismatch
  assert resumed.latest_step() == 3
  rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  got, data = resumed.restore(jax.eval_shape(lambda: state), {"w": rep, "step": rep})
  np.testing.assert_array_equal(got["w"], state["w"])
  assert int(got["step"]) == 3 and data == {"pos": 7}
  resumed.close()
  assert open(cfg_path).read() == saved_text                    # not overwritten
  assert CFG.kda.num_heads != 4
  with pytest.raises(CheckpointMismatch, match="kda.num_heads"):
    CheckpointManager(str(tmp_path), apply_overrides(CFG, ["kda.num_heads=4"]))


def test_gmm_kernel_changes_the_traced_program_not_the_result():
  """Parallel.kernels.gmm picks the grouped matmul at trace time: "ragged_dot" lowers to the
  ragged_dot primitive, "tiled" to plain einsums; both compute the same layer output
  (tolerance: float32 reassociation of the same sums, 1e-5 relative)."""
  # 80 tokens: above moe_ops.SMALL_TOKENS, so the grouped-matmul path runs (not moe_small)
  x = jax.random.normal(jax.random.key(0), (2, 40, CFG.d_model), jnp.float32)
  outs = {}
  layer = MoE(CFG, init=Init(3))
  graphdef, state = nnx.split(layer)
  for kind in ("tiled", "ragged_dot"):
    par = partitioning.Parallel(kernels=Kernels(gmm=kind))
    f = lambda state, x: nnx.merge(graphdef, state)(x, par=par)[0]
    prims = str(jax.make_jaxpr(f)(state, x))
    assert ("ragged_dot" in prims) == (kind == "ragged_dot"), kind
    outs[kind] = f(state, x)
  np.testing.assert_allclose(outs["ragged_dot"], outs["tiled"], rtol=1e-5, atol=1e-6)
  # the kernels are part of the Parallel's identity: another choice is another program
  assert partitioning.Parallel(kernels=Kernels(gmm="tiled")) != partitioning.SINGLE


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
  with kda_backend=pallas (the kernels, interpret mode here) for steps 3-4; its losses equal
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
  reference = configs.get_exec("k3_tiny")
  pallas = dataclasses.replace(reference, kda_backend="pallas")
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  quiet = lambda s: None
  train.run(CFG, tc, full, mesh, it(), [], ckpt=CheckpointManager(full, CFG), log=quiet,
            run=reference)
  train.run(CFG, tc, part, mesh, it(), [], ckpt=CheckpointManager(part, CFG), log=quiet,
            stop_after=2, run=reference)
  train.run(CFG, tc, part, mesh, it(), [], ckpt=CheckpointManager(part, CFG), log=quiet,
            run=pallas)
  read = lambda d: [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
  want, got = read(full), read(part)
  assert [r["step"] for r in got] == [1, 2, 3, 4]
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-4)
