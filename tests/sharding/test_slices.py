"""Multi-slice data parallelism (`--num_slices`, sharding/mesh.py): the data axis spans the
slices, every other axis stays inside one. On CPU devices (no slice_index) `--num_slices=N`
splits the devices into N fake slices laid out the way create_hybrid_device_mesh lays out
real ones, so the multi-slice train step runs here: 2 slices x 4 devices must train bit for
bit like 1 x 8 with the same data axis."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from k3_jax.config import ConfigError
from sharding.mesh import MESH_AXES, make_mesh, parse_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = MESH_AXES.index("data")


def test_fake_slices_are_the_outer_factor_of_the_data_axis():
  devs = jax.devices()[:8][::-1]              # any order: slices are consecutive groups
  mesh = make_mesh(parse_mesh("data:4,fsdp:2"), devs, slices=2)
  grid = np.moveaxis(mesh.devices, DATA, 0).reshape(4, -1)
  for s in range(2):                          # data rows 2s, 2s+1 = slice s, whole
    assert {d.id for d in grid[2 * s:2 * s + 2].ravel()} == {d.id for d in devs[4 * s:4 * s + 4]}
  # one slice of 4 x 2 slices == the plain 8-device order for the same axes
  plain = make_mesh(parse_mesh("data:4,fsdp:2"), devs)
  assert (mesh.devices == plain.devices).all()


def test_slice_count_errors_name_the_problem():
  devs = jax.devices()[:8]
  with pytest.raises(ConfigError, match="data axis spans the slices"):
    make_mesh(parse_mesh("fsdp:8"), devs, slices=2)
  with pytest.raises(ConfigError, match="does not divide the 8 devices"):
    make_mesh(parse_mesh("data:8"), devs, slices=3)
  with pytest.raises(ConfigError, match="num_slices=0"):
    make_mesh(parse_mesh("data:8"), devs, slices=0)


def test_tpu_devices_must_carry_the_slices_asked_for():
  from sharding.mesh import num_slices
  from pod.topology import topology_devices
  two = topology_devices("v5e:2x2", 2)
  mesh = make_mesh(parse_mesh("data:2,fsdp:-1"), two, slices=2)
  assert num_slices(mesh.devices[0].ravel()) == num_slices(mesh.devices[1].ravel()) == 1
  with pytest.raises(ConfigError, match="form 2 slices"):
    make_mesh(parse_mesh("data:2,fsdp:-1"), two, slices=1)
  with pytest.raises(ConfigError, match="form 1 slice "):
    make_mesh(parse_mesh("data:2,fsdp:-1"), topology_devices("v5e:2x2"), slices=2)


def test_multi_slice_pod_layout_is_the_one_slice_layout_per_slice():
  import configs
  from k3_jax.compile import pod_layout
  from pod.topology import resolve_target
  layouts = configs.get_pod_layouts("k3")
  one = pod_layout(layouts, resolve_target("v5p-4096"), "train")
  # k3 has its own 2- and 4-slice layouts (1024 tokens per chip); 8 slices derive from the
  # 1-slice one
  two = pod_layout(layouts, resolve_target("v5p-4096", 2), "train")
  assert two.topology == "2*v5p-4096" and two.run.mesh.startswith("data:2,")
  assert (two.global_batch, two.run.grad_accum) == (one.global_batch, 1)
  assert pod_layout(layouts, resolve_target("2*v5p-4096"), "train") == two
  four = pod_layout(layouts, resolve_target("v5p-4096", 4), "train")
  assert four.run.mesh == "data:4,fsdp:8,expert:32,sequence:8" and four.global_batch == 1024
  eight = pod_layout(layouts, resolve_target("v5p-4096", 8), "train")
  assert eight.topology == "8*v5p-4096" and eight.run.mesh == "data:8," + one.run.mesh
  assert (eight.global_batch, eight.seq_len, eight.run.remat) == (8 * one.global_batch, 8192,
                                                               "block")
  assert pod_layout(layouts, resolve_target("v5p-8", 2), "train") is None


def _train(tmp, name: str, *extra: str) -> list[dict]:
  wd = os.path.join(tmp, name)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  args = [sys.executable, os.path.join(ROOT, "main.py"), "train", "--config=k3_tiny",
          "--override=num_layers=2", "--override=mla_layers=2", "--override=dense_layers=1",
          "--steps=3", "--batch_size=8", "--seq_len=32", "--checkpoint_every=100",
          "--eval_every=100", "--optimizer=muon", "--mesh=data:2,fsdp:4", f"--workdir={wd}",
          *extra]
  r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f if l.strip()]


@pytest.mark.slow
def test_two_fake_slices_train_bit_for_bit_like_one(tmp_path):
  two = _train(str(tmp_path), "two", "--num_slices=2")
  one = _train(str(tmp_path), "one")
  key = lambda rows: [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
  assert len(key(two)) == 3 and key(two) == key(one)


def test_num_slices_on_train_refuses_a_bad_count(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "train",
                      "--config=k3_tiny", "--mesh=fsdp:8", "--num_slices=2",
                      f"--workdir={tmp_path}/x"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 2 and "data axis spans the slices" in r.stderr, r.stderr[-2000:]
