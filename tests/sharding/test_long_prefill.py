"""The long-prompt prefill path in miniature: one sequence on an 8-device mesh whose batch
axes it cannot fill, so its tokens split over sequence x expert x data (rules "seq"), with
KCP, the halo'd conv, expert-parallel MoE over the same chips, and the blockwise absorbed
MLA over the gathered cache. Its last-position logits and its whole cache equal the
single-device prefill's (what `compile --step=prefill` builds for 1M tokens on v5p-128)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax.model import create_model, prefill
from sharding.install import parallel_for
from sharding.mesh import make_mesh, parse_mesh

T = 64


@pytest.mark.slow   # 13 s (suite budget); the sequence split itself: test_context_parallel
def test_batch_of_one_prefill_on_a_mesh_equals_one_device():
  # k3_tiny cut to 6 layers keeping every kind the path shards (dense and MoE FFNs, KDA and
  # MLA mixers, a scan of 2 x [KDA, MLA] units and unscanned layers around it): 4 layer
  # bodies to compile, twice (mesh and one device), instead of 9.
  cfg = dataclasses.replace(configs.get("k3_tiny"), num_layers=6, mla_layers=(3, 5, 6),
                            scan_period=2)
  graphdef, state = nnx.split(create_model(cfg, seed=0))
  tokens = jax.random.randint(jax.random.key(4), (1, T), 0, cfg.vocab_size)
  mesh = make_mesh(parse_mesh("data:2,expert:2,sequence:2"))

  def run(state, tokens, last_only, on=None):        # on: a mesh, or None = one device
    return prefill(nnx.merge(graphdef, state), tokens, T, last_only=last_only,
                   par=parallel_for(on))

  def on_mesh(state, tokens):
    return run(state, tokens, True, mesh)

  want_logits, want_cache = jax.jit(lambda s, t: run(s, t, False))(state, tokens)
  lowered = jax.jit(on_mesh).lower(state, tokens)
  assert "all_gather" in lowered.as_text()        # the context-parallel ops were taken
  logits, cache = lowered.compile()(state, tokens)
  assert logits.shape == (1, 1, cfg.vocab_size)
  # FP32 model; the KCP chain, the moved KDA chunk boundaries and the online softmax
  # reassociate sums: ~1e-6 relative, as in tests/model (prefill vs forward: 2e-4).
  np.testing.assert_allclose(logits[:, 0], want_logits[:, -1], rtol=2e-4, atol=2e-4)
  flat = lambda c: jax.tree_util.tree_flatten_with_path(c)[0]
  for (path, got), (_, want) in zip(flat(cache), flat(want_cache)):
    scale = float(jnp.max(jnp.abs(want))) or 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * scale,
                               err_msg=jax.tree_util.keystr(path))
