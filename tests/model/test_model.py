"""K3Model: prefill + decode equals one forward pass; packed documents stay isolated;
parameter counts of the presets."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax.model import check_tokens, create_model, decode_step, forward, param_counts, prefill


@functools.lru_cache(maxsize=None)
def tiny():
  # k3_tiny cut to 6 layers that keep every kind: an unscanned dense KDA layer, a scan of
  # 2 x [KDA+MoE, MLA+MoE] units, an unscanned MLA+MoE tail, AttnRes blocks of 4 closing
  # inside the scan: 4 layer bodies per program to compile instead of 9.
  cfg = dataclasses.replace(configs.get("k3_tiny"), num_layers=6, mla_layers=(3, 5, 6),
                            scan_period=2)
  assert cfg.attn_res.enabled
  model = create_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  # Non-zero AttnRes pseudo-queries (they start at zero = uniform mixing), so the tests
  # below see real depth-wise attention.
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: (0.1 * jax.random.normal(jax.random.key(len(path)), x.shape)
                       if any(getattr(p, "key", None) in ("mixer_query", "ffn_query", "final_query")
                              for p in path) else x), state)
  fwd = jax.jit(lambda s, t, seg: forward(nnx.merge(graphdef, s), t, seg))
  pre = jax.jit(lambda s, t: prefill(nnx.merge(graphdef, s), t, 24), )
  dec = jax.jit(lambda s, c, t: decode_step(nnx.merge(graphdef, s), c, t))
  return cfg, state, fwd, pre, dec


T = 32  # one sequence length for every forward call: one compilation


def _ones(b=1):
  return jnp.ones((b, T), jnp.int32)


def test_prefill_then_decode_equals_forward():
  cfg, state, fwd, pre, dec = tiny()
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
  # Row by row: the batch-1 forward program the other tests use (rows are independent).
  full = jnp.concatenate([fwd(state, tokens[i:i + 1], _ones()) for i in range(2)])  # [B,T,V]
  logits, cache = pre(state, tokens[:, :12])
  # f32 throughout; the chunked vs recurrent KDA forms and the absorbed vs plain MLA forms
  # reassociate sums, so logits agree to ~1e-5 relative, not bitwise.
  np.testing.assert_allclose(logits, full[:, :12], rtol=2e-4, atol=2e-4)
  for t in range(12, 20):
    step_logits, cache = dec(state, cache, tokens[:, t])
    np.testing.assert_allclose(step_logits, full[:, t], rtol=2e-4, atol=2e-4)
  assert int(cache.pos) == 20


def test_packed_documents_do_not_interact():
  cfg, state, fwd, _, _ = tiny()
  key_a, key_a2, key_b = jax.random.split(jax.random.key(2), 3)
  n_a = 13   # document a, then document b filling the row; boundary mid KDA chunk
  a = jax.random.randint(key_a, (1, n_a), 0, cfg.vocab_size)
  a2 = jax.random.randint(key_a2, (1, n_a), 0, cfg.vocab_size)
  b = jax.random.randint(key_b, (1, T - n_a), 0, cfg.vocab_size)
  seg = jnp.concatenate([jnp.ones((1, n_a), jnp.int32), 2 * jnp.ones((1, T - n_a), jnp.int32)], 1)
  out = fwd(state, jnp.concatenate([a, b], 1), seg)
  out2 = fwd(state, jnp.concatenate([a2, b], 1), seg)
  # Document b's logits must not depend on the document packed before it (state reset,
  # conv window reset, attention masked by segment; MoE routing is per token). Equal up
  # to f32 rounding: b's in-chunk cumulative decays G_r - G_s are differences of sums
  # that start in document a, so their last bits depend on a (~1e-6 relative).
  np.testing.assert_allclose(out[:, n_a:], out2[:, n_a:], rtol=1e-4, atol=1e-4)
  assert not np.allclose(out[:, :n_a], out2[:, :n_a], atol=1e-2)   # a itself did change
  # ... and equal those of b alone at the start of a row (same shape, so the same program).
  alone = fwd(state, jnp.concatenate([b, a], 1), 3 - seg[:, ::-1])
  np.testing.assert_allclose(out[:, n_a:], alone[:, :T - n_a], rtol=2e-4, atol=2e-4)


def test_forward_is_causal():
  cfg, state, fwd, _, _ = tiny()
  t1 = jax.random.randint(jax.random.key(4), (1, T), 0, cfg.vocab_size)
  t2 = t1.at[:, 10:].set((t1[:, 10:] + 7) % cfg.vocab_size)
  np.testing.assert_allclose(fwd(state, t1, _ones())[:, :10], fwd(state, t2, _ones())[:, :10],
                             rtol=1e-5, atol=1e-5)


def test_token_validation():
  cfg = configs.get("k3_tiny")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    check_tokens([1, 2, 300], cfg)
  with pytest.raises(ValueError, match="max_seq_len"):
    check_tokens(np.zeros(cfg.max_seq_len + 1, np.int32), cfg)


def test_param_counts_k3():
  c = param_counts(configs.get("k3"))
  assert 2.75e12 < c["total_params"] < 2.83e12, c["total_params"]
  assert 100e9 < c["active_params"] < 108e9, c["active_params"]


def test_param_counts_kimi_linear():
  c = param_counts(configs.get("kimi_linear_48b"))
  assert 46e9 < c["total_params"] < 51e9, c["total_params"]
  assert 2.5e9 < c["active_params"] < 3.8e9, c["active_params"]


@pytest.mark.slow      # two fwd+bwd compiles of k3_tiny: ~3 min on the loaded 2-core machine
def test_layer_remat_gradients_equal_plain():
  """remat="layer" (each scanned unit and each layer inside it, and the unscanned layers,
  recomputed in the backward pass) changes what is stored, not the math: the same loss and
  gradients as no remat. f32; the recomputation repeats the same ops, so agreement is to
  rounding (XLA may fuse the recomputed graph differently): 1e-5."""
  cfg, state, *_ = tiny()
  graphdef = nnx.graphdef(create_model(cfg, seed=0))
  tokens = jax.random.randint(jax.random.key(4), (2, T), 0, cfg.vocab_size)

  def loss(s, remat):
    logits = nnx.merge(graphdef, s)(tokens, _ones(2), remat=remat)[0]
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  ref_l, ref_g = jax.jit(jax.value_and_grad(functools.partial(loss, remat="none")))(state)
  l, g = jax.jit(jax.value_and_grad(functools.partial(loss, remat="layer")))(state)
  np.testing.assert_allclose(l, ref_l, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
