"""Expert parallelism: the shard_map'd MoE dispatch equals the single-device dispatch (forward
and gradients) for expert axes 2, 4 and 8 with uneven routing; the MoE layer on an expert
mesh equals the layer on one device (outputs, load counts, QB bias, gradients); the TPU path
(ragged_all_to_all + ragged_dot) compiles for a TPU topology ahead of time; tokens the
expert axis does not split (a small decode batch) take the exchange-free psum path, with the
same result (plain and packed MXFP4 experts) and the MXFP4 kernel on TPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax.layers.init import Init
from k3_jax.layers.moe import MoE
from k3_jax.ops import moe as moe_ops
from sharding import expert
from sharding.mesh import make_mesh, parse_mesh
from sharding.install import parallel_for

N, D, F, E, K = 32, 8, 16, 8, 2


@pytest.fixture(scope="module")
def data():
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
  first = r.integers(0, 3, size=N)
  # Uneven: experts 0-2 take every first choice, 3-5 every second; 6 and 7 get nothing, so
  # with 8 expert shards two devices receive no rows and with 4 one device gets 7/16 of them.
  ids = jnp.asarray(np.stack([first, first + 3], 1), jnp.int32)       # [N, K]
  return dict(x=f(N, D), weights=jnp.asarray(r.uniform(size=(N, K)), jnp.float32),
              ids=ids, w_gate=f(E, D, F), w_up=f(E, D, F), w_down=f(E, F, D))


def _loss(dispatch):
  # Differentiable in x, the combine weights and all expert weights; sin() makes the
  # cotangent depend on the output.
  def loss(x, weights, w_gate, w_up, w_down, ids):
    return jnp.sum(jnp.sin(dispatch(x, weights, ids, w_gate, w_up, w_down)))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


@pytest.fixture(scope="module")
def reference(data):
  d = data
  return _loss(moe_ops.moe_dispatch)(d["x"], d["weights"], d["w_gate"], d["w_up"],
                                     d["w_down"], d["ids"])


def _check(got, want):
  # f32 with the same per-row products and the same k-term combine order; only the tiled
  # grouped matmul's row grouping differs, so agreement is to f32 rounding (~1e-7 seen).
  (l1, g1), (l2, g2) = got, want
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec,exchange", [("expert:2,data:4", "all_to_all"),
                                           ("expert:4,fsdp:2", "all_to_all"),
                                           ("expert:8", "all_to_all"),
                                           ("expert:4,data:2", "ragged_reference")])
def test_ep_dispatch_equals_single_device(data, reference, spec, exchange):
  mesh = make_mesh(parse_mesh(spec))
  dispatch = lambda *a: expert.expert_parallel_dispatch(mesh, *a, exchange=exchange)
  d = data
  args = (d["x"], d["weights"], d["w_gate"], d["w_up"], d["w_down"], d["ids"])
  _check(_loss(dispatch)(*args), reference)
  # The tokens really are split over the expert axis too, and rows move by all_to_all
  # (the ragged reference emulates ragged_all_to_all with all-gathers).
  assert expert.token_axes(mesh, N)[-1] == "expert"
  text = jax.jit(dispatch).lower(d["x"], d["weights"], d["ids"], d["w_gate"], d["w_up"],
                                 d["w_down"]).as_text()
  assert ("all_gather" if exchange == "ragged_reference" else "all_to_all") in text


def test_moe_layer_on_expert_mesh_equals_single_device():
  cfg = configs.get("k3_tiny")
  layer = MoE(cfg, init=Init(1))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  # A non-zero balancing bias, so routing is uneven and the QB update has work to do.
  rest["bias"].value = jnp.linspace(-0.3, 0.3, cfg.moe.num_experts)
  x = jax.random.normal(jax.random.key(0), (4, 16, cfg.d_model), jnp.float32)

  def run(mesh):
    def loss(params, x):
      y, aux = nnx.merge(graphdef, params, rest)(x, train=True, par=parallel_for(mesh))
      return jnp.sum(jnp.sin(y)), (y, aux)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)

  (l1, (y1, aux1)), g1 = run(None)
  (l2, (y2, aux2)), g2 = run(make_mesh(parse_mesh("expert:4,data:2")))
  np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-6)
  # Routing, load and the QB bias are computed over the global batch in both cases.
  np.testing.assert_array_equal(aux2["expert_load"], aux1["expert_load"])
  assert int(jnp.max(aux1["expert_load"])) > int(jnp.min(aux1["expert_load"]))   # uneven
  np.testing.assert_allclose(aux2["new_bias"], aux1["new_bias"], atol=1e-6)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_ep_compiles_for_tpu_with_ragged_all_to_all():
  """The TPU path (ragged_all_to_all both ways, ragged_dot locally), forward and backward,
  compiles for a 4-chip v5p slice ahead of time (XLA:CPU lacks ragged_all_to_all)."""
  from pod.topology import topology_devices
  mesh = make_mesh(parse_mesh("expert:4"), devices=topology_devices("v5p:2x2x1"))
  assert expert.mesh_platform(mesh) == "tpu"
  s = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)

  def loss(x, weights, ids, w_gate, w_up, w_down):
    y = expert.expert_parallel_dispatch(mesh, x, weights, ids, w_gate, w_up, w_down)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 3, 4, 5)))
  # The tests' global "highest" matmul precision would ask the TPU grouped-matmul kernel
  # for fp32 contraction of bf16 operands, which it rejects; training uses the default.
  with jax.default_matmul_precision("default"):
    lowered = step.lower(s(64, 128), s(64, 2, dt=jnp.float32), s(64, 2, dt=jnp.int32),
                         s(8, 128, 256), s(8, 128, 256), s(8, 256, 128))
    compiled = lowered.compile()
  text = compiled.as_text()
  assert "ragged-all-to-all" in text and "all-to-all" in text
  assert compiled.memory_analysis().temp_size_in_bytes > 0


@pytest.mark.slow
def test_train_step_on_expert_and_sequence_mesh_equals_single_device():
  """Two train steps of k3_tiny on fsdp:2,expert:2,sequence:2 (EP MoE dispatch, KCP KDA,
  sequence-sharded MLA, FSDP parameters) equal the single-device steps. Slow: one more
  compile of the full train step (~4.5 min on a loaded 2-core machine); the single-device
  step is the one tests/test_train.py compiles (same config, train config and mesh)."""
  import dataclasses
  from k3_jax import train
  from k3_jax.data import mqar
  cfg = configs.get("k3_tiny")
  tc = dataclasses.replace(configs.get_train("k3_tiny"), batch_size=8, seq_len=32,
                           learning_rate=1e-2)
  it = mqar.mqar_dataset(tc.batch_size, tc.seq_len, cfg.vocab_size, num_kv_pairs=4, seed=1)
  batches = [next(it) for _ in range(2)]

  def run(mesh):
    steps = train.build_steps(cfg, tc, mesh)
    state, losses = steps.init(), []
    for b in batches:
      state, m = steps.train(state, train.put_batch(b, steps.batch_sharding))
      losses.append(float(m["loss"]))
    return state, losses

  s1, l1 = run(make_mesh(parse_mesh(""), devices=jax.devices()[:1]))
  s8, l8 = run(make_mesh(parse_mesh("fsdp:2,expert:2,sequence:2")))
  # As tests/test_train.py: f32, reduction order differs across devices (loss ~1e-6 apart
  # measured); Adam turns 1e-7 gradient noise on near-zero gradients into ~1e-6 parameter
  # differences, hence the absolute tolerance. The QB biases ("rest") are compared too.
  np.testing.assert_allclose(l1, l8, rtol=1e-5)
  for a, b in zip(jax.tree.leaves((s1["params"], s1["rest"])),
                  jax.tree.leaves((s8["params"], s8["rest"]))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _kept_pairs(ids, shards, p, cap, total=None):
  """[N, K] bool: the pairs a capacity of `cap` rows per (source, destination) keeps. Tokens
  are split into `shards` contiguous blocks; block b is source b % p of its expert group
  (the expert axis is the last token axis). Each source sorts its pairs by expert (stable)
  and keeps the first `cap` for each destination device; with `total`, a destination also
  keeps at most `total` rows, its sources taken in order."""
  ids = np.asarray(ids)
  n_loc, el = ids.shape[0] // shards, E // p
  kept = np.zeros(ids.shape, bool)
  got = np.zeros((shards // p, p), int)                # rows each destination has kept
  for b in range(shards):
    flat = ids[b * n_loc:(b + 1) * n_loc].reshape(-1)
    order = np.argsort(flat, kind="stable")
    seen = np.zeros(p, int)
    for pair in order:
      dst = flat[pair] // el
      if seen[dst] < cap and (total is None or got[b // p, dst] < total):
        kept[b * n_loc + pair // K, pair % K] = True
        got[b // p, dst] += 1
      seen[dst] += 1
  return kept


@pytest.mark.parametrize("exchange", [pytest.param("all_to_all", marks=pytest.mark.slow),
                                      "ragged_reference"])
def test_ep_capacity_drops_exactly_the_overflow(data, exchange):
  """capacity_factor=1: at most n k / P rows per (source, destination); the uneven routing
  overflows it, and the result equals the dropless dispatch with the dropped pairs' combine
  weights set to 0 (forward)."""
  d = data
  mesh = make_mesh(parse_mesh("expert:4,data:2"))
  n_loc = N // 8
  cap = -(-n_loc * K // 4)
  kept = _kept_pairs(d["ids"], 8, 4, cap)
  assert 0 < (~kept).sum() < kept.size                      # some, not all, pairs dropped
  got = jax.jit(lambda *a: expert.expert_parallel_dispatch(mesh, *a, exchange=exchange,
                                                           capacity_factor=1.0))(
      d["x"], d["weights"], d["ids"], d["w_gate"], d["w_up"], d["w_down"])
  want = moe_ops.moe_dispatch(d["x"], jnp.where(kept, d["weights"], 0.0), d["ids"],
                              d["w_gate"], d["w_up"], d["w_down"])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_ep_recv_bound_drops_exactly_the_overflow(data):
  """recv_factor=1: the ragged exchange packs each device's received rows and keeps at most
  n k of them (its sources in order); the uneven routing sends one device 7/16 of all rows,
  so it drops some, and the result equals the dispatch with the dropped pairs' combine
  weights set to 0. With the chunk bound too, both apply."""
  d = data
  mesh = make_mesh(parse_mesh("expert:4,data:2"))
  n_loc = N // 8
  args = (d["x"], d["weights"], d["ids"], d["w_gate"], d["w_up"], d["w_down"])
  for cap, capacity in ((n_loc * K, None), (-(-n_loc * K // 4), 1.0)):
    kept = _kept_pairs(d["ids"], 8, 4, cap, total=n_loc * K)
    assert 0 < (~kept).sum() < kept.size
    got = jax.jit(lambda *a: expert.expert_parallel_dispatch(
        mesh, *a, exchange="ragged_reference", capacity_factor=capacity,
        recv_factor=1.0))(*args)
    want = moe_ops.moe_dispatch(d["x"], jnp.where(kept, d["weights"], 0.0), d["ids"],
                                d["w_gate"], d["w_up"], d["w_down"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_ep_capacity_is_a_config_field_jit_sees():
  """The ep_capacity kernel choice reaches the traced program through the Parallel the
  layer is called with: ONE jitted function applied to the same layer under two capacities
  gives two programs (no stale trace): the bounded one equals the dispatch called with that capacity directly (same
  routing, same rows dropped) and differs from the dropless one (which the test above
  checks against one device)."""
  from k3_jax.execution import Kernels
  cfg = configs.get("k3_tiny")
  mesh = make_mesh(parse_mesh("expert:4,data:2"))
  x = jax.random.normal(jax.random.key(1), (4, 8, cfg.d_model), jnp.float32)

  def layer():
    m = MoE(cfg, init=Init(1))
    m.bias.value = jnp.linspace(-2.0, 2.0, cfg.moe.num_experts)   # very uneven routing
    return m

  @nnx.jit(static_argnums=2)
  def forward(m, x, capacity):
    return m(x, par=parallel_for(mesh, kernels=Kernels(ep_capacity=capacity)))[0]

  dropless, bounded = forward(layer(), x, 0.0), forward(layer(), x, 1.0)
  assert float(jnp.max(jnp.abs(bounded - dropless))) > 1e-3     # rows were dropped

  # The same bounded result from the dispatch given capacity_factor=1 explicitly.
  m = layer()
  xf = x.reshape(-1, cfg.d_model)
  weights, ids = moe_ops.select_experts(moe_ops.router_scores(xf, m.router[...]), m.bias[...],
                                        cfg.moe.top_k, cfg.moe.routed_scaling_factor)
  z = m.down(xf) if cfg.moe.latent_dim else xf
  u = jax.jit(lambda *a: expert.expert_parallel_dispatch(
      mesh, *a, activation=m.kind, beta1=m.beta1, beta2=m.beta2,
      gmm=moe_ops.default_gmm(platform="cpu"), capacity_factor=1.0))(
          z, weights, ids, *m._expert_weights())
  y = m.up(m.norm(u)) if cfg.moe.latent_dim else u
  if cfg.moe.num_shared_experts:
    y = y + m.shared(xf)
  np.testing.assert_allclose(bounded, y.reshape(x.shape), rtol=1e-5, atol=1e-6)


# Replicated tokens: NR tokens, which neither expert axis (4, 8) divides, so every device of
# the expert group holds them all and takes the psum path (no all-to-all).
NR = 6


@pytest.fixture(scope="module")
def few(data):
  """The first NR tokens of `data`, routed to experts 0-5 only: with 8 expert shards devices
  6 and 7 own no chosen expert (no local pairs), with 4 device 3 owns none."""
  d = dict(data)
  for name in ("x", "weights", "ids"):
    d[name] = data[name][:NR]
  return d


def _dispatch_args(d):
  return (d["x"], d["weights"], d["ids"], d["w_gate"], d["w_up"], d["w_down"])


@pytest.fixture(scope="module")
def few_reference(few):
  """(output, (loss, grads)) of the one-device dispatch on `few`."""
  d = few
  return (jax.jit(moe_ops.moe_dispatch)(*_dispatch_args(d)),
          _loss(moe_ops.moe_dispatch)(d["x"], d["weights"], d["w_gate"], d["w_up"],
                                      d["w_down"], d["ids"]))


@pytest.mark.parametrize("spec", ["expert:8", "expert:4,data:2"])
def test_ep_replicated_tokens_equals_single_device(few, few_reference, spec):
  """Forward and gradients of the replicated-token path equal the one-device dispatch; it
  exchanges nothing (one all-reduce, no all-to-all), while a token count the expert axis
  divides still takes the all-to-all path. With data:2 the tokens are split over data
  (3 per shard) and replicated over expert."""
  mesh = make_mesh(parse_mesh(spec))
  assert "expert" not in expert.token_axes(mesh, NR)
  dispatch = lambda *a: expert.expert_parallel_dispatch(mesh, *a)
  d = few
  args = (d["x"], d["weights"], d["w_gate"], d["w_up"], d["w_down"], d["ids"])
  # Same products in f32; only the order of the k-term sum differs (per device, then the
  # psum over devices), so agreement is to f32 rounding (~1e-8 seen): _check's tolerance.
  _check(_loss(dispatch)(*args), few_reference[1])
  text = jax.jit(dispatch).lower(*_dispatch_args(d)).as_text()
  assert "all_to_all" not in text and "all_reduce" in text
  s = lambda a, n: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype)
  sharded = [s(a, 8) for a in _dispatch_args(d)[:3]] + list(_dispatch_args(d)[3:])
  assert "all_to_all" in jax.jit(dispatch).lower(*sharded).as_text()


def test_ep_replicated_tokens_padding_rows_are_zero(few, few_reference):
  """Rows past a device's real pairs contribute exactly 0, whatever the grouped matmul
  leaves there (here NaN; expert:8 also has devices with no pairs at all)."""
  mesh = make_mesh(parse_mesh("expert:8"))

  def nan_padding_gmm(lhs, rhs, group_sizes):
    out = moe_ops.tiled_gmm(lhs, rhs, group_sizes)
    return jnp.where(jnp.arange(lhs.shape[0])[:, None] < group_sizes.sum(), out, jnp.nan)

  got = jax.jit(lambda *a: expert.expert_parallel_dispatch(mesh, *a, gmm=nan_padding_gmm))(
      *_dispatch_args(few))
  # f32, summation order only (as above)
  np.testing.assert_allclose(got, few_reference[0], rtol=1e-5, atol=1e-6)


def test_ep_replicated_tokens_packed_mxfp4():
  """The packed MXFP4 grouped matmul (serving; the plain-JAX reference on CPU) through the
  replicated-token path equals the one-device dispatch with the same gmm."""
  from k3_jax.ops import mx_gmm
  r = np.random.default_rng(1)
  n, dm, f, e, k = 3, 32, 32, 8, 4                    # MX blocks of 32 along contractions
  f32 = lambda *s: jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
  ids = jnp.asarray(np.stack([r.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
  args = (f32(n, dm), jnp.asarray(r.uniform(size=(n, k)), jnp.float32), ids,
          *(mx_gmm.pack_weight(w) for w in (f32(e, dm, f), f32(e, dm, f), f32(e, f, dm))))
  gmm = mx_gmm.packed_gmm(moe_ops.default_gmm("tiled"))
  mesh = make_mesh(parse_mesh("expert:4"), devices=jax.devices()[:4])
  got = jax.jit(lambda *a: expert.expert_parallel_dispatch(mesh, *a, gmm=gmm))(*args)
  # f32, summation order only (as above)
  want = jax.jit(lambda *a: moe_ops.moe_dispatch(*a, gmm=gmm))(*args)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_ep_replicated_tokens_on_tpu_use_the_mxfp4_kernel():
  """On a TPU mesh (lowered ahead of time) the replicated-token path runs the packed MXFP4
  Pallas kernel for its grouped matmuls (gate and up in one gated call, then down), and
  exchanges nothing (no all-to-all of either kind)."""
  from k3_jax.ops import mx_gmm
  from pod.topology import topology_devices
  mesh = make_mesh(parse_mesh("expert:4"), devices=topology_devices("v5p:2x2x1"))
  s = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  packed = lambda *shape: jax.eval_shape(mx_gmm.pack_weight, s(*shape))
  gmm = mx_gmm.packed_gmm(moe_ops.default_gmm("ragged_dot"), kernel=True)
  fn = jax.jit(lambda *a: expert.expert_parallel_dispatch(mesh, *a, gmm=gmm))
  with jax.default_matmul_precision("default"):
    text = fn.lower(s(3, 256), s(3, 4, dt=jnp.float32), s(3, 4, dt=jnp.int32),
                    packed(8, 256, 512), packed(8, 256, 512), packed(8, 512, 256)).as_text()
  assert "tpu_custom_call" in text
  assert len(re.findall(r"call @_mxfp4_gmm(_\d+)?\b", text)) == 2     # gate + up, down
  assert "all_to_all" not in text and "all_reduce" in text
