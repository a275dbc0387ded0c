"""`main.py convert` and the generate / train flags that use Hugging Face directories, end to
end in subprocesses (one CPU device, as a user has)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import configs
from k3_jax.checkpoint import convert
from k3_jax.model import create_model

from ckpt_configs import kimi_linear_small  # tests/checkpoint/ckpt_configs.py

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _main(*args, timeout=900):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_convert_dry_run_json_from_preset():
  r = _main("convert", "--config=k3_tiny", "--dry_run", "--json", "--max_shard_size=100KB")
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout)
  assert out["num_tensors"] == len(out["tensors"]) and out["num_shards"] > 1
  assert set(out["tensors"][0]) == {"name", "shape", "dtype", "file"}
  # the preset's tower is part of the plan (as `info` reports it), and only the tower differs
  assert out["total_bytes"] == convert.plan(configs.get_multimodal("k3_tiny"))["total_bytes"]
  vision = [t for t in out["tensors"] if t["name"].startswith(("vision_tower.", "mm_projector."))]
  text = convert.plan(configs.get("k3_tiny"))
  assert len(vision) and out["num_tensors"] == text["num_tensors"] + len(vision)


@pytest.mark.slow   # ~40 s of CLI subprocesses (suite budget); generation from a converted
# directory stays in the default suite through the server tests (serve --hf_dir)
def test_generate_from_hf_dir_with_prompt_ids_json(tmp_path):
  """generate --hf_dir --prompt_ids --json gives exactly the tokens of an in-process greedy
  decode of the same weights """
  from flax import nnx
  from k3_jax.config import SINGLE_STREAM
  from k3_jax.serve.engine import Engine
  cfg = kimi_linear_small()                       # 4 layers: quick to compile
  model = create_model(cfg, seed=11)
  d = str(tmp_path / "hf")
  convert.export_model(model, d)
  r = _main("generate", f"--hf_dir={d}", "--prompt_ids=5,6,7,8,9", "--max_new_tokens=6",
            "--json")
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  ref = list(Engine(cfg, *nnx.split(model, nnx.Param, ...), SINGLE_STREAM).generate([5, 6, 7, 8, 9], 6))
  assert out["token_ids"] == ref and out["prompt_ids"] == [5, 6, 7, 8, 9]


@pytest.mark.slow
def test_train_export_import_resume_chain(tmp_path):
  """train -> convert (export) -> convert (import) -> generate from the imported workdir ==
  generate --hf_dir; train --init_from starts from the released weights."""
  wd, hf, wd2 = str(tmp_path / "run"), str(tmp_path / "hf"), str(tmp_path / "imported")
  r = _main("train", "--config=k3_tiny", "--steps=2", "--eval_every=2", f"--workdir={wd}")
  assert r.returncode == 0, r.stderr[-3000:]
  r = _main("convert", f"--from={wd}", f"--to={hf}")
  assert r.returncode == 0 and "GB/s" in r.stdout, r.stderr[-3000:]
  r = _main("convert", f"--from={wd}", f"--to={hf}")
  assert r.returncode == 2 and "--force" in r.stderr
  r = _main("convert", f"--from={hf}", f"--to={wd2}")
  assert r.returncode == 0, r.stderr[-3000:]
  gen = lambda *a: json.loads(_main("generate", "--prompt_ids=1,2,3", "--max_new_tokens=5",
                                    "--json", *a).stdout.strip().splitlines()[-1])
  assert gen(f"--workdir={wd}") == gen(f"--workdir={wd2}") == gen(f"--hf_dir={hf}")
  r = _main("train", f"--init_from={hf}", "--steps=1", "--eval_every=1", "--batch_size=4",
            "--seq_len=32", f"--workdir={tmp_path / 'ft'}")
  assert r.returncode == 0, r.stderr[-3000:]
