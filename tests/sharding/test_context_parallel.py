"""Context parallelism: the KDA layer (KCP: local chunked KDA, one all-gather of the shard
transitions and zero-start states, the FP32 chain, conv halo) and the MLA layer (latent KV
gathered, causal mask by global position) with the sequence split 2, 4 and 8 ways (and 8
ways over three mesh axes, for a batch of one) equal the single-device layers, forward and
gradients, with and without packed documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax.layers.init import Init
from k3_jax.layers.kda import KDA
from k3_jax.layers.mla import MLA
from k3_jax.ops import conv as conv_ops
from k3_jax.ops import kda as kda_ops
from sharding import context
from sharding.mesh import make_mesh, parse_mesh
from sharding.install import parallel_for

CFG = configs.get("k3_tiny")
B, T = 2, 32
# Documents: row 0 changes at 5, 7 (so the halo of the shard starting at 8 spans two
# documents), 16 (a shard start for every split) and 26; row 1's middle document spans
# every shard.
SEG = np.stack([np.repeat([0, 1, 2, 3, 4], [5, 2, 9, 10, 6]),
                np.repeat([0, 1, 2], [3, 26, 3])]).astype(np.int32)


def _mesh(p):
  return make_mesh(parse_mesh(f"sequence:{p},data:{8 // p}"))


def _close(got, want, rtol):
  """|got - want| <= rtol * max|want| elementwise: errors relative to the array's scale."""
  got, want = np.asarray(got), np.asarray(want)
  scale = float(np.max(np.abs(want))) or 1.0
  np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


@pytest.fixture(scope="module")
def x():
  return jax.random.normal(jax.random.key(0), (B, T, CFG.d_model), jnp.float32)


def _layer_fn(layer_cls, mesh):
  graphdef, params = nnx.split(layer_cls(CFG, init=Init(0)))

  par = parallel_for(mesh)

  def loss(params, x, seg):
    y = nnx.merge(graphdef, params)(x, seg, par=par)[0]
    return jnp.sum(jnp.sin(y)), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), params


_REF = {}


def _reference(layer_cls, x, seg):
  key = (layer_cls.__name__, seg is not None, x.shape)
  if key not in _REF:
    fn, params = _layer_fn(layer_cls, None)
    _REF[key] = fn(params, x, seg)
  return _REF[key]


def _check_layer(layer_cls, x, p, with_seg, collectives, mesh=None):
  seg = jnp.asarray(SEG[:x.shape[0]]) if with_seg else None
  (_, y1), g1 = _reference(layer_cls, x, seg)
  fn, params = _layer_fn(layer_cls, mesh or _mesh(p))
  lowered = fn.lower(params, x, seg)
  text = lowered.as_text()
  for op in collectives:                 # the context-parallel path was really taken
    assert op in text, op
  (_, y2), g2 = lowered.compile()(params, x, seg)
  # FP32 throughout; the chain and the moved chunk boundaries reassociate sums, so outputs
  # agree to ~1e-6 of their scale and gradients (sums over 64 tokens) to ~1e-5.
  _close(y2, y1, 1e-5)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
    _close(a, b, 1e-4)


@pytest.mark.parametrize("p,with_seg", [
    (4, True), (8, True),           # and 8 ways over three axes: the batch-of-one test below
    pytest.param(2, False, marks=pytest.mark.slow),
    pytest.param(2, True, marks=pytest.mark.slow), pytest.param(4, False, marks=pytest.mark.slow),
    pytest.param(8, False, marks=pytest.mark.slow)])
def test_kcp_kda_layer_equals_single_device(x, p, with_seg):
  _check_layer(KDA, x, p, with_seg, ("all_gather",))


@pytest.mark.parametrize("p,with_seg", [
    (2, True), (4, False), (8, True),
    pytest.param(2, False, marks=pytest.mark.slow), pytest.param(4, True, marks=pytest.mark.slow),
    pytest.param(8, False, marks=pytest.mark.slow)])
def test_sequence_sharded_mla_layer_equals_single_device(x, p, with_seg):
  _check_layer(MLA, x, p, with_seg, ("all_gather",))


@pytest.mark.parametrize("layer_cls", [      # KDA's split: test_kcp_kda_layer_equals_single_device
    pytest.param(KDA, marks=pytest.mark.slow), MLA])
def test_batch_of_one_splits_its_sequence_over_the_axes_the_batch_left(x, layer_cls):
  """One sequence on a data x expert x sequence mesh: the batch cannot split, so "seq"
  takes sequence, then expert, then data (8 shards of 4 tokens, numbered sequence-major):
  the ops read their split from the resolved spec, and the halo, the KCP chain and the
  MLA offsets follow the same numbering as the layout."""
  mesh = make_mesh(parse_mesh("data:2,expert:2,sequence:2"))
  assert context.seq_split(mesh, 1, T) == ("sequence", "expert", "data")
  assert context.seq_split(mesh, 8, T) == ("sequence",)        # the batch took the rest
  _check_layer(layer_cls, x[:1], 8, True, ("all_gather",), mesh=mesh)


@pytest.mark.slow
def test_kcp_prefill_form_carries_initial_and_final_state():
  """With an initial state and the final state requested (prefill from a cache), and a conv
  cache: KCP and the halo'd conv equal the single-device ops (forward)."""
  h, k, p = 2, 8, 4
  keys = jax.random.split(jax.random.key(3), 8)
  q = kda_ops.l2_normalize(jax.random.normal(keys[0], (B, T, h, k)))
  kk = kda_ops.l2_normalize(jax.random.normal(keys[1], (B, T, h, k)))
  v = jax.random.normal(keys[2], (B, T, h, k))
  g = kda_ops.kda_gate_lower_bound(jax.random.normal(keys[3], (B, T, h, k)), jnp.zeros(h))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, h)))
  s0 = jax.random.normal(keys[5], (B, h, k, k))
  xc = jax.random.normal(keys[6], (B, T, h * k))
  w = jax.random.normal(keys[7], (4, h * k))
  cache = xc[:, :3] * 0.5
  seg = jnp.asarray(SEG)
  mesh = _mesh(p)

  def both(kda_fn, conv_fn):
    o, s = kda_fn(q, kk, v, g, beta, initial_state=s0, output_final_state=True,
                  chunk_size=16, segment_ids=seg)
    y, c = conv_fn(xc, w, segment_ids=seg, cache=cache)
    return o, s, y, c

  want = jax.jit(lambda: both(kda_ops.chunk_kda, conv_ops.short_conv))()
  got = jax.jit(lambda: both(lambda *a, **kw: context.kcp_chunk_kda(mesh, *a, **kw),
                             lambda *a, **kw: context.kcp_short_conv(mesh, *a, **kw)))()
  for a, b in zip(got, want):
    _close(a, b, 1e-5)
