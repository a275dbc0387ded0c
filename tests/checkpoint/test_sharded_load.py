"""Direct sharded loading: every variable built with jax.make_array_from_callback from
safetensors slices on an 8-device CPU mesh (fsdp 2 x expert 2 x tensor 2). Each device's
callback reads only the bytes of its own shard (the rows / columns / experts it holds), and
the result equals a plain (whole-tensor) load bit for bit."""

import numpy as np
import pytest

from k3_jax.checkpoint import convert
from k3_jax.checkpoint.sharded_load import load_sharded, model_shardings
from k3_jax.model import create_model
from sharding.mesh import make_mesh, parse_mesh

from ckpt_configs import k3_tiny_mx, kimi_linear_small  # tests/checkpoint/ckpt_configs.py


@pytest.mark.parametrize("which", ["kimi_linear", "kimi_k3_mxfp4"])
def test_sharded_load_reads_only_owned_slices(which, tmp_path):
  cfg = kimi_linear_small() if which == "kimi_linear" else k3_tiny_mx()
  d = str(tmp_path / "hf")
  convert.export_model(create_model(cfg, seed=7), d, max_shard_size="64KB")
  _, plain = convert.load_flat(d)
  mesh = make_mesh(parse_mesh("fsdp:2,expert:2,tensor:2"))
  log = []
  cfg2, arrays = load_sharded(d, lambda c: model_shardings(c, mesh), log=log)
  shardings = model_shardings(cfg2, mesh)
  for p, a in arrays.items():
    assert a.sharding == shardings[p]
    assert np.asarray(a).tobytes() == plain[p].tobytes(), p
  # Each callback read exactly its shard's bytes where the layout allows slicing (F32 on
  # disk, same as in memory): "linear" weights, same-shape tensors, and whole experts (and
  # whole MXFP4 expert tensors, whose packed bytes are fewer than the FP32 shard's).
  small = ("conv", "a_log", "dt_bias", "_query")   # reshaped or folded: read whole (tiny)
  sharded_vars = set()
  for path, index, nbytes in log:
    name = "/".join(map(str, path))
    shard = np.empty(plain[path].shape, np.float32)[index]
    if any(s in name for s in small):
      continue
    if which == "kimi_k3_mxfp4" and path[-1] in ("w_gate", "w_up", "w_down"):
      # [.., E, in, out]: packed codes + scales of the held output columns, over the held
      # input range widened to whole 32-element blocks
      n_in = -(-shard.shape[-2] // 32) * 32
      rows = shard.size // shard.shape[-2]
      assert nbytes == rows * (n_in // 2 + n_in // 32), (name, index)
    else:
      assert nbytes == shard.nbytes, (name, index, nbytes, shard.nbytes)
    if shard.size < plain[path].size:
      sharded_vars.add(path)
  assert len(sharded_vars) > 20     # most variables really are split across devices
