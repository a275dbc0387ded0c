"""safetensors export / import: round trips (bit-identical parameters, byte-identical files),
MXFP4 experts, the dry-run plan, and the errors that must come before anything is written."""

import dataclasses
import filecmp
import json
import os

import jax
import numpy as np
import pytest

import configs
from flax import nnx

from k3_jax.checkpoint import convert, safetensors_io as stio
from k3_jax.checkpoint.inference import load_for_inference
from k3_jax.checkpoint.layouts import LayoutError
from k3_jax.model import create_model
from k3_jax.ops.mx import dequantize, quantize
from sharding.mesh import make_mesh

from ckpt_configs import k3_tiny_mx, kimi_linear_small  # tests/checkpoint/ckpt_configs.py


def _same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _files(d):
  return sorted(p for p in os.listdir(d))


@pytest.mark.parametrize("name", ["k3_tiny", "kimi_linear_small"])
def test_roundtrip_bit_identical_and_deterministic(name, tmp_path):
  cfg = configs.get("k3_tiny") if name == "k3_tiny" else kimi_linear_small()
  model = create_model(cfg, seed=1)
  flat = convert.flat_state(model)
  out = convert.export_model(model, str(tmp_path / "a"), max_shard_size="40KB")
  assert out["num_shards"] > 1                                 # sharding and the index work
  cfg2, back = convert.load_flat(str(tmp_path / "a"))
  assert set(back) == set(flat)
  bad = [p for p in flat if not _same_bits(flat[p], back[p])]
  assert not bad, bad[:3]
  # converting the imported state again gives byte-identical files
  convert.export_state(cfg2, back, str(tmp_path / "b"), max_shard_size="40KB")
  assert _files(tmp_path / "a") == _files(tmp_path / "b")
  _, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b",
                                         _files(tmp_path / "a"), shallow=False)
  assert not mismatch and not errors, (mismatch, errors)


def test_mxfp4_experts_packed_and_byte_identical(tmp_path):
  cfg = k3_tiny_mx()
  model = create_model(cfg, seed=2)
  flat = convert.flat_state(model)
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  convert.export_model(model, a)
  with open(os.path.join(a, "config.json")) as f:
    hf = json.load(f)
  assert hf["model_type"] == "kimi_k3" and hf["quantization_config"]["format"] == \
      "mxfp4-pack-quantized"
  r = stio.Reader(a)
  name = "language_model.model.layers.1.mlp.experts.3.w2.weight"   # layer 2 = first MoE
  packed, scale = r.get(name + "_packed"), r.get(name + "_scale")
  r.close()
  # [out, in/2] and [out, in/32]; w2 is the down projection (in = expert_intermediate)
  assert packed.dtype == np.uint8 and packed.shape == (32, 16) and scale.shape == (32, 1)
  path, idx = ("units", "layers", 0, "ffn", "w_down"), (0, 3)        # k3_tiny: layer 2
  w = np.asarray(flat[path])[idx]                                   # [in, out]
  mx = quantize(w, "mxfp4", -2)
  assert packed.tobytes() == np.asarray(mx.codes).T.tobytes()       # low nibble = even column
  assert scale.tobytes() == np.asarray(mx.scales).T.tobytes()
  cfg2, back = convert.load_flat(a)
  assert _same_bits(back[path][idx], np.asarray(dequantize(mx, np.float32)))
  assert _same_bits(back[("embed", "table")], flat[("embed", "table")])
  convert.export_state(cfg2, back, b)                               # codes and scales again
  _, mismatch, errors = filecmp.cmpfiles(a, b, _files(a), shallow=False)
  assert not mismatch and not errors
  # streamed from an Orbax checkpoint, packed expert by expert as each is read: the bytes
  # the in-memory export packs from the whole stacked variable
  work, c = str(tmp_path / "work"), str(tmp_path / "c")
  convert.import_to_workdir(a, work)
  convert.export_workdir(work, c)
  same = [p for p in _files(a) if p != stio.INDEX_NAME]           # the index adds source_step
  assert set(_files(c)) - set(_files(a)) == {   # a workdir's export adds the run's tokenizer
      "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
  assert set(_files(a)) <= set(_files(c))
  _, mismatch, errors = filecmp.cmpfiles(a, c, same, shallow=False)
  assert not mismatch and not errors, (mismatch, errors)


def test_orbax_roundtrip_through_cli_library(tmp_path):
  """HF dir -> Orbax workdir (import) -> HF dir (export): the same bytes; the workdir holds a
  step-0 train state that `generate`/`train` restore. With k3_tiny's vision tower: it is
  imported into Orbax and exported again like the rest."""
  cfg = configs.get_multimodal("k3_tiny")
  a = str(tmp_path / "a")
  convert.export_model(create_model(cfg, seed=5), a)
  work = str(tmp_path / "work")
  res = convert.run(a, work)
  assert res["direction"] == "import"
  with pytest.raises(FileExistsError):
    convert.run(a, work)                                            # no overwrite without force
  loaded = load_for_inference(work, make_mesh(devices=jax.devices()[:1]))   # as generate
  cfg_w, flat = loaded.cfg, [tuple(p) for p, _ in nnx.to_flat_state(loaded.params)]
  assert loaded.step == 0 and cfg_w.layer_kinds() == cfg.layer_kinds() and cfg_w.moe == cfg.moe
  assert cfg_w.vision == cfg.vision and any(p[0] == "vision" for p in flat)
  res = convert.run(work, str(tmp_path / "b"))
  assert res["direction"] == "export" and res["gb_per_s"] > 0
  shards = [p for p in _files(a) if p.endswith(".safetensors")]
  _, mismatch, errors = filecmp.cmpfiles(a, tmp_path / "b", shards, shallow=False)
  assert not mismatch and not errors


def test_dry_run_plan_from_preset():
  p = convert.run(None, None, cfg=configs.get("k3_small"), dry_run=True, max_shard_size="1MB")
  assert p["layout"] == "kimi_k3" and p["num_shards"] > 1
  names = {t["name"]: t for t in p["tensors"]}
  assert names["language_model.model.layers.1.mlp.experts.31.w1.weight_packed"]["shape"] == \
      [192, 48]
  assert p["total_bytes"] == sum(
      int(np.prod(t["shape"])) * (1 if t["dtype"] == "U8" else 4) for t in p["tensors"])


@pytest.mark.slow
def test_dry_run_k3_release_inventory():
  p = convert.plan(configs.get("k3"))
  packed = [t for t in p["tensors"] if t["name"].endswith("weight_packed")]
  assert len(packed) == 92 * 896 * 3
  assert 1.50e12 < p["total_bytes"] < 1.62e12                       # release: about 1.56 TB
  # with the released vision tower (27 blocks of 6 tensors + patch embedding, position
  # table, final norm, 3 projector tensors), about 0.45B parameters in BF16
  mm = convert.plan(configs.get_multimodal("k3"))
  vision = [t for t in mm["tensors"] if t["name"].startswith(("vision_tower.", "mm_projector."))]
  assert len(vision) == 27 * 6 + 3 + 3 == mm["num_tensors"] - p["num_tensors"]
  assert all(t["dtype"] == "BF16" for t in vision)
  assert 0.8e9 < mm["total_bytes"] - p["total_bytes"] < 1.0e9


@pytest.mark.slow
def test_roundtrip_k3_small(tmp_path):
  cfg = configs.get("k3_small")
  model = create_model(cfg, seed=1)
  flat = convert.flat_state(model)
  convert.export_model(model, str(tmp_path / "a"), expert_format="dense")
  _, back = convert.load_flat(str(tmp_path / "a"))
  assert all(_same_bits(flat[p], back[p]) for p in flat)


# ----- errors before anything is written ---------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("e") / "hf")
  convert.export_model(create_model(configs.get("k3_tiny"), seed=0), d)
  return d


def _copy_without(src, dst, drop=(), add=None, reshape=None):
  """A copy of an export with tensors dropped / added / reshaped (one shard)."""
  from safetensors.numpy import save_file
  r = stio.Reader(src)
  tensors = {n: r.get(n) for n in r.names() if n not in drop}
  r.close()
  if add:
    tensors.update(add)
  if reshape:
    n = reshape
    tensors[n] = tensors[n].reshape(-1)
  os.makedirs(dst)
  save_file(tensors, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f, \
       open(os.path.join(dst, "config.json"), "w") as g:
    g.write(f.read())
  return dst


def test_import_errors_name_the_tensor(exported, tmp_path):
  n = "language_model.model.layers.0.self_attn.q_proj.weight"
  with pytest.raises(LayoutError, match=f"missing tensor {n}"):
    convert.load_flat(_copy_without(exported, str(tmp_path / "m"), drop=[n]))
  with pytest.raises(LayoutError, match="unexpected tensor extra.weight"):
    convert.load_flat(_copy_without(exported, str(tmp_path / "x"),
                                    add={"extra.weight": np.zeros(3, np.float32)}))
  with pytest.raises(LayoutError, match=f"tensor {n} has shape"):
    convert.load_flat(_copy_without(exported, str(tmp_path / "s"), reshape=n))
  bad = _copy_without(exported, str(tmp_path / "t"))
  with open(os.path.join(bad, "config.json"), "w") as f:
    json.dump({"model_type": "llama"}, f)
  with pytest.raises(LayoutError, match="unknown model_type 'llama'"):
    convert.load_flat(bad)


def test_convert_source_must_be_a_checkpoint(tmp_path):
  with pytest.raises(FileNotFoundError, match="neither a Hugging Face checkpoint"):
    convert.run(str(tmp_path), str(tmp_path / "out"))


def test_export_refuses_before_writing(exported, tmp_path):
  before = sorted(os.listdir(exported))
  with pytest.raises(FileExistsError, match="--force"):
    convert.export_model(create_model(configs.get("k3_tiny")), exported)
  assert sorted(os.listdir(exported)) == before
  # a weight the layout cannot express: MXFP4 experts of width 16
  out = str(tmp_path / "never")
  with pytest.raises(LayoutError, match="must be multiples of 32"):
    convert.export_model(create_model(configs.get("k3_tiny")), out, expert_format="mxfp4")
  cfg = dataclasses.replace(kimi_linear_small(), activation="situ")
  with pytest.raises(LayoutError, match="activation='situ'"):
    convert.export_model(create_model(cfg), out)
  assert not os.path.exists(out) and not any(p.startswith("never") for p in os.listdir(tmp_path))
  # --force replaces only with a complete export
  convert.export_model(create_model(configs.get("k3_tiny"), seed=9), exported, force=True)
  assert sorted(os.listdir(exported)) == before


# ----- the vision tower in the K3 layout ---------------------------------------------------

def test_vision_tower_roundtrip(tmp_path):
  """k3_tiny with its tower: the tower's tensors carry the names of k3_jax/vision/names.py
  with its transforms (compared with names.export_vision of the same weights), config.json
  carries the tower, the round trip is bit-identical and converting again gives
  byte-identical files. (The streamed Orbax import of a tower: the test below.)"""
  from k3_jax.vision import names
  cfg = configs.get_multimodal("k3_tiny")
  model = create_model(cfg, seed=4)
  flat = convert.flat_state(model)
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  convert.export_model(model, a, max_shard_size="40KB")
  released = names.export_vision(model.vision, cfg.vision, cfg.d_model, "k3")
  r = stio.Reader(a)
  on_disk = {n: r.get(n) for n in r.names() if n.startswith(("vision_tower.", "mm_projector."))}
  r.close()
  assert set(on_disk) == set(released) == set(names.vision_names(cfg.vision, cfg.d_model))
  assert all(_same_bits(on_disk[n], released[n]) for n in released)
  cfg2, back = convert.load_flat(a)
  assert cfg2.vision == cfg.vision
  bad = [p for p in flat if not _same_bits(flat[p], back[p])]
  assert not bad and set(back) == set(flat), bad[:3]
  convert.export_state(cfg2, back, b, max_shard_size="40KB")
  _, mismatch, errors = filecmp.cmpfiles(a, b, _files(a), shallow=False)
  assert not mismatch and not errors


# ----- import streams ----------------------------------------------------------------------

def test_import_streams_with_bounded_host_memory(tmp_path):
  """The import never holds the model: the peak of host memory allocated while it runs
  (tracemalloc sees numpy buffers, and the rows a tensorstore transaction holds until its
  commit, here 1 MB) stays below half the parameters' bytes (measured: 0.2 of them): the
  importer this replaced held the model in numpy (load_flat), then as jax arrays, and so
  failed this at once. The checkpoint it writes restores
  bit-identically, with the fresh AdamW state (zeros) that train.abstract_state
  describes."""
  import tracemalloc
  import jax
  from k3_jax import train
  from k3_jax.checkpoint.manager import CheckpointManager, saved_config
  from benchmarks.convert_memory import random_value, write_random_hf
  from k3_jax.checkpoint.layouts.common import variable_shapes
  from k3_jax.config import TrainConfig, apply_overrides
  from sharding.rules import tree_shardings
  # 4 layers with wide experts: few leaves (the fixed cost, about 16 MB of Python objects
  # while tracing the abstract state and writing Orbax's metadata) against 78 MB
  cfg = apply_overrides(kimi_linear_small(), ["d_model=128", "moe.num_experts=32",
                                              "moe.expert_intermediate=512"])
  hf, work = str(tmp_path / "hf"), str(tmp_path / "work")
  model_bytes = write_random_hf(cfg, hf, "4MB", seed=6)             # variable by variable
  assert model_bytes > 7e7                                           # many rows, many shards
  tracemalloc.start()
  try:
    convert.import_to_workdir(hf, work, batch_bytes=1 << 20)        # rows held until commit
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < model_bytes / 2, (peak, model_bytes)
  cfg_w = saved_config(work)                      # the config derived from config.json
  assert cfg_w.moe == cfg.moe and cfg_w.d_model == cfg.d_model
  tc = TrainConfig(optimizer="adamw")
  opt = train.make_optimizer(tc)
  _, abstract = train.abstract_state(cfg_w, tc, opt)
  mgr = CheckpointManager(work, cfg_w, read_only=True)
  state, _ = mgr.restore(abstract, tree_shardings(abstract, make_mesh(devices=jax.devices()[:1])))
  mgr.close()
  got = {tuple(p): v.get_value() for part in ("params", "rest")
         for p, v in nnx.to_flat_state(state[part])}
  value = random_value(cfg, seed=6)
  assert set(got) == set(variable_shapes(cfg))
  bad = [p for p in got if not _same_bits(value(p), got[p])]
  assert not bad, bad[:3]
  fresh = jax.eval_shape(opt.init, abstract["params"])
  assert jax.tree.structure(state["opt_state"]) == jax.tree.structure(fresh)
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(state["opt_state"]))
  assert int(state["step"]) == 0


def test_export_streams_with_bounded_host_memory(tmp_path):
  """The export never holds the model: reading the Orbax checkpoint row by row (one layer's
  slice, one expert's matrix) as each shard is written, the peak of host memory allocated
  while it runs (tracemalloc: numpy buffers, the rows tensorstore hands over) stays below
  half the parameters' bytes; the export this replaced restored every parameter first (a
  peak of at least the model) and failed this at once. Its shards are byte-identical to the
  source directory's (same shard size). (Streamed MXFP4 packing: in
  test_mxfp4_experts_packed_and_byte_identical.)"""
  import tracemalloc
  from benchmarks.convert_memory import write_random_hf
  from k3_jax.config import apply_overrides
  cfg = apply_overrides(kimi_linear_small(), ["d_model=128", "moe.num_experts=32",
                                              "moe.expert_intermediate=512"])
  hf, work, out = str(tmp_path / "hf"), str(tmp_path / "work"), str(tmp_path / "out")
  model_bytes = write_random_hf(cfg, hf, "4MB", seed=7)
  assert model_bytes > 7e7
  convert.import_to_workdir(hf, work)
  tracemalloc.start()
  try:
    res = convert.export_workdir(work, out, max_shard_size="4MB")
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < model_bytes / 2, (peak, model_bytes)       # measured: 0.11 (old: 1.02)
  assert res["step"] == 0 and res["num_shards"] > 10
  files = [p for p in _files(hf) if p.endswith(".safetensors")]
  assert files == [p for p in _files(out) if p.endswith(".safetensors")]
  _, mismatch, errors = filecmp.cmpfiles(hf, out, files, shallow=False)
  assert not mismatch and not errors, (mismatch, errors)

