"""QK-Clip: rescales exactly the MLA heads whose max logit exceeded tau, as
docs/architecture.md section 6 says, and a re-run of the forward on the same batch then
puts a clipped head's max logit on tau (exactly where nothing upstream of its layer moved)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax import train
from k3_jax.data import mqar
from k3_jax.model import create_model
from k3_jax.optim.qk_clip import TAU, mla_layers, qk_clip
from sharding.mesh import make_mesh

CFG = configs.get("k3_tiny")
# The default test's model: k3_tiny cut to 6 layers (tests/model/test_model.py's), MLA as
# scanned rows 0 and 1 of a scan of 2 x [KDA, MLA] units and as the unscanned last layer:
# the three places the test clips (k3_tiny's 13 layers clip the same three, at twice the
# forward's compile).
CLIP_CFG = dataclasses.replace(CFG, num_layers=6, mla_layers=(3, 5, 6), scan_period=2)
BOOST = 40.0     # logits scale with BOOST^2: k3_tiny's max logits (~4) become ~6000 > tau


def _tokens():
  it = mqar.mqar_dataset(4, 32, CFG.vocab_size, num_kv_pairs=4, seed=5)
  return jnp.asarray(next(it)["inputs"])


def _boost(model, picks):
  """Multiplies the query and key weights of the (aux row, head) pairs in `picks` by BOOST."""
  row = 0
  for mla, rows in mla_layers(model):
    q = mla.q_b if mla.c.q_lora_rank else mla.q_proj
    for r in range(rows):
      for h in range(mla.c.num_heads):
        if (row + r, h) in picks:
          for w in (q.w, mla.kv_b.w):
            idx = (r, slice(None), h) if rows > 1 or w[...].ndim == 4 else (slice(None), h)
            w[...] = w[...].at[idx].multiply(BOOST)
    row += rows


def _qk_weights(model):
  out = []
  for mla, _ in mla_layers(model):
    q = mla.q_b if mla.c.q_lora_rank else mla.q_proj
    out.append((np.asarray(q.w[...]), np.asarray(mla.kv_b.w[...])))
  return out


def test_qk_clip_rescales_exactly_the_heads_over_tau():
  model = create_model(CLIP_CFG)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = _tokens()
  fwd = jax.jit(lambda p: nnx.merge(graphdef, p, rest)(tokens)[2]["max_logit"])
  n_rows = len(fwd(params))
  layers = mla_layers(model)
  assert sum(r for _, r in layers) == n_rows == len(CLIP_CFG.mla_layers)
  assert [r for _, r in layers] == [2, 1]                 # a stacked layer, then one alone
  picks = {(0, 1), (n_rows - 1, 0)}
  # A head of a scanned (stacked) MLA layer too, when k3_tiny has one.
  stacked_first = next((sum(r for _, r in layers[:i]) for i, (_, r) in enumerate(layers)
                        if r > 1), None)
  if stacked_first is not None:
    picks.add((stacked_first + 1, 0))
  _boost(model, picks)
  params = nnx.state(model, nnx.Param)
  before = np.asarray(fwd(params))                                   # [n_mla, H]
  over = {tuple(i) for i in np.argwhere(before > TAU)}
  assert over == picks, (before, picks)
  w_before = _qk_weights(model)
  boosted = jax.tree.map(np.array, nnx.state(model, nnx.Param))   # a copy, for below

  n_clipped = qk_clip(model, jnp.asarray(before), TAU)
  assert int(n_clipped) == len(picks)

  # Weights: exactly the specified factors on the clipped heads, nothing else touched.
  c = CLIP_CFG.mla
  n, p = c.qk_nope_head_dim, c.qk_rope_head_dim
  row = 0
  for (mla, rows), (q0, kv0), (q1, kv1) in zip(layers, w_before, _qk_weights(model)):
    q0, kv0, q1, kv1 = (a if a.ndim == 4 else a[None] for a in (q0, kv0, q1, kv1))
    for r in range(rows):
      for h in range(c.num_heads):
        g = TAU / before[row + r, h] if (row + r, h) in picks else 1.0
        np.testing.assert_allclose(q1[r, :, h, :n], q0[r, :, h, :n] * np.sqrt(g), rtol=1e-6)
        np.testing.assert_allclose(q1[r, :, h, n:], q0[r, :, h, n:] * g, rtol=1e-6)
        np.testing.assert_allclose(kv1[r, :, h, :n], kv0[r, :, h, :n] * np.sqrt(g), rtol=1e-6)
        np.testing.assert_array_equal(kv1[r, :, h, n:], kv0[r, :, h, n:])     # v untouched
        if g == 1.0:
          np.testing.assert_array_equal(q1[r, :, h], q0[r, :, h])
    row += rows

  # Re-running the forward. Within one layer every logit of a clipped head is scaled by
  # exactly gamma (c_q, c_kv and k_rope do not depend on the clipped weights), so in the
  # first MLA layer (nothing upstream changed) the clipped head's max lands on tau up to
  # f32 rounding (relative ~1e-6; we allow 1e-4) and its other heads are untouched. Later
  # layers also see inputs changed by the earlier clip (a smaller attention output), so
  # there the joint clip is not exact; each of them is checked alone below.
  after = np.asarray(fwd(nnx.state(model, nnx.Param)))
  np.testing.assert_allclose(after[0, 1], TAU, rtol=1e-4)
  np.testing.assert_allclose(after[0, 0], before[0, 0], rtol=1e-5)
  assert (after < 10).sum() == (before < 10).sum()     # the unclipped heads stay small

  # One clipped head at a time, from the boosted weights: nothing upstream of its layer
  # changes, so wherever the layer sits (unscanned, a scanned row, the last layer) its max
  # logit lands on tau and the layer's other heads keep theirs exactly (same rounding).
  for pick in sorted(picks):
    nnx.update(model, jax.tree.map(jnp.asarray, boosted))
    only = np.zeros_like(before)
    only[pick] = before[pick]
    assert int(qk_clip(model, jnp.asarray(only), TAU)) == 1
    alone = np.asarray(fwd(nnx.state(model, nnx.Param)))
    np.testing.assert_allclose(alone[pick], TAU, rtol=1e-4, err_msg=str(pick))
    others = [h for h in range(before.shape[1]) if h != pick[1]]
    np.testing.assert_allclose(alone[pick[0], others], before[pick[0], others], rtol=1e-5)


@pytest.mark.slow
def test_train_step_clips_and_reports_to_metrics():
  """In the jit train step: the metric counts the clipped heads, and after the step the
  same batch shows no head above tau (the tiny learning rate barely moves the weights:
  within 1%)."""
  tc = dataclasses.replace(configs.get_train("k3_tiny"), optimizer="muon", batch_size=4,
                           seq_len=32, learning_rate=1e-6, muon_lr=1e-6)
  steps = train.build_steps(CFG, tc, make_mesh(devices=jax.devices()[:1]))
  state = steps.init()
  model = nnx.merge(steps.graphdef, state["params"], state["rest"])
  _boost(model, {(0, 1)})
  state["params"] = jax.device_put(nnx.state(model, nnx.Param), steps.state_shardings["params"])
  it = mqar.mqar_dataset(4, 32, CFG.vocab_size, num_kv_pairs=4, seed=5)
  batch = next(it)
  tokens = jnp.asarray(batch["inputs"])
  fwd = lambda s: np.asarray(
      nnx.merge(steps.graphdef, s["params"], s["rest"])(tokens, jnp.asarray(
          batch["segment_ids"]))[2]["max_logit"])
  assert (fwd(state) > TAU).sum() == 1
  state, m = steps.train(state, train.put_batch(batch, steps.batch_sharding))
  assert int(m["qk_clipped_heads"]) == 1 and float(m["max_logit"]) > TAU
  assert fwd(state).max() <= TAU * 1.01
