"""K3Model: embedding -> hybrid decoder layers (the repeating part under one scan) ->
final norm -> LM head; plus forward / prefill / decode entry points and parameter counts.

Layer layout comes from the stack plan (k3_jax/stack.py): a few unscanned leading layers
(the dense FFN layer breaks the pattern), `repeats` identical units of `period` layers whose
parameters are stacked on a leading "layers" axis and run under `jax.lax.scan` (compile
time does not grow with depth), then the unscanned trailing layers.

Cache (prefill/decode): a ModelCache (k3_jax/cache.py), grouped as the layers are.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3_jax import stack
from k3_jax.cache import KDAState, MLACache, ModelCache, PagedMLACache, replace
from k3_jax.config import ConfigError, ModelConfig, UserError, jnp_dtype
from k3_jax.layers import attn_res
from k3_jax.layers.embed import Embed, LMHead
from k3_jax.layers.ffn import GatedFFN
from k3_jax.layers.init import Init
from k3_jax.layers.kda import KDA
from k3_jax.layers.mla import MLA, page_slots
from k3_jax.layers.moe import MoE
from k3_jax.layers.norm import RMSNorm
from k3_jax.ops import mx_gmm, rope_pages
from k3_jax.ops.vision import scatter_features
from k3_jax.partitioning import SINGLE, Parallel
from k3_jax.vision.tower import VisionEncoder


class DecoderLayer(nnx.Module):
  """Pre-norm mixer (KDA or MLA) and FFN (dense or MoE) with residual adds."""

  def __init__(self, cfg: ModelConfig, mixer: str, ffn: str, *, init: Init):
    pdt = jnp_dtype(cfg.param_dtype)
    self.mixer_kind, self.ffn_kind = mixer, ffn
    self.eps = cfg.norm_eps
    self.block_size = cfg.attn_res.block_size if cfg.attn_res.enabled else 0
    if self.block_size:
      self.mixer_query = attn_res.PseudoQuery(cfg.d_model)
      self.ffn_query = attn_res.PseudoQuery(cfg.d_model)
    out_std_scale = (2 * cfg.num_layers) ** -0.5
    self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, axis_name="embed")
    self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, axis_name="embed")
    if mixer == "kda":
      out = cfg.kda.num_heads * cfg.kda.head_dim
      self.mixer = KDA(cfg, init=init, out_std=out ** -0.5 * out_std_scale)
    else:
      out = cfg.mla.num_heads * cfg.mla.v_head_dim
      self.mixer = MLA(cfg, init=init, out_std=out ** -0.5 * out_std_scale)
    if ffn == "dense":
      self.ffn = GatedFFN(cfg, cfg.d_model, cfg.dense_intermediate, init=init,
                          out_std=cfg.dense_intermediate ** -0.5 * out_std_scale)
    else:
      width = cfg.moe.latent_dim or cfg.d_model
      self.ffn = MoE(cfg, init=init, out_std=width ** -0.5 * out_std_scale)

  def init_cache(self, batch: int, max_len: int) -> KDAState | MLACache:
    if self.mixer_kind == "kda":
      return self.mixer.init_cache(batch)
    return self.mixer.init_cache(batch, max_len)

  def init_paged_cache(self, batch: int, num_pages: int,
                       page_size: int) -> KDAState | PagedMLACache:
    if self.mixer_kind == "kda":
      return self.mixer.init_cache(batch)
    return self.mixer.init_paged_cache(num_pages, page_size)

  # The two sublayers, each mapping its (residual-stream) input to the output that is
  # added back. Attention Residuals will build each sublayer's input from several
  # sources instead of the running sum; these are the hooks it plugs into.
  @jax.named_scope("mixer")
  def mixer_sublayer(self, x, segment_ids=None, cache=None, pos=0, par: Parallel = SINGLE):
    """-> (y, new cache or None, aux)."""
    h = self.mixer_norm(x)
    if self.mixer_kind == "kda":
      y, cache = self.mixer(h, segment_ids, cache, par=par)
      return y, cache, {}
    y, cache, max_logit = self.mixer(h, segment_ids, cache, pos, par=par)
    return y, cache, {"max_logit": max_logit}

  @jax.named_scope("ffn")
  def ffn_sublayer(self, x, train=False, par: Parallel = SINGLE):
    """-> (y, aux)."""
    h = self.ffn_norm(x)
    if self.ffn_kind == "moe":
      return self.ffn(h, train, par=par)
    return self.ffn(h, par), {}

  def __call__(self, x, segment_ids=None, cache=None, pos=0, layer_idx=0, train=False,
               par: Parallel = SINGLE):
    """x: the residual stream [B, T, D], or with Attention Residuals the source bank
    (layers/attn_res.py). -> (x, new cache or None, aux dict)."""
    if self.block_size:
      return self._attn_res_call(x, segment_ids, cache, pos, layer_idx, train, par)
    y, cache, aux = self.mixer_sublayer(x, segment_ids, cache, pos, par)
    x = par.constrain(x + y, ("batch", "seq", "embed"))
    y, ffn_aux = self.ffn_sublayer(x, train, par)
    x = par.constrain(x + y, ("batch", "seq", "embed"))
    return x, cache, {**aux, **ffn_aux}

  def _attn_res_call(self, stream, segment_ids, cache, pos, layer_idx, train, par):
    y, cache, aux = self.mixer_sublayer(self.mixer_query(stream, self.eps), segment_ids, cache,
                                        pos, par)
    stream = attn_res.add_output(stream, y)
    y, ffn_aux = self.ffn_sublayer(self.ffn_query(stream, self.eps), train, par)
    stream = attn_res.add_output(stream, y)
    stream = attn_res.close_block(stream, (layer_idx + 1) % self.block_size == 0)
    return stream, cache, {**aux, **ffn_aux}


def _packed_routed(path, variable) -> bool:
  """nnx filter: a packed (MXFP4, serving) routed-expert weight."""
  return path[-1] in mx_gmm.EXPERT_WEIGHTS and isinstance(variable.get_value(), mx_gmm.MXArray)


def _held_whole(par: Parallel):
  """nnx filter of the unit weights the layer scan passes whole with the unit's index
  (mx_gmm.StackedLayer) instead of slicing them: the packed routed experts, and in the
  decode layout of a batch that fills the mesh MLA's kv_b, whose two halves (the query's
  and the output's absorption) are each read from the stack in place (layers/mla.py); as
  the scan's slice, the layer's kv_b was copied out and read again every step (k3 v5p-128,
  64 x 1M: ~1.1 GB a chip)."""
  if not par.batch_fills_mesh:
    return _packed_routed
  return lambda path, v: _packed_routed(path, v) or tuple(path[-2:]) == ("kv_b", "w")


def _remat_policy(remat: str):
  return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable if remat == "dots"
          else jax.checkpoint_policies.nothing_saveable)


def call_layer(layer: DecoderLayer, remat: str, x, segment_ids, cache, pos, layer_idx, train,
               par: Parallel = SINGLE):
  """One decoder layer; with `remat` != "none" it is rematerialised on its own: the backward
  pass keeps only its inputs (and, for "dots", its matmul outputs) and recomputes the rest,
  so at most one layer's intermediates are live at a time."""
  if remat == "none":
    return layer(x, segment_ids, cache, pos, layer_idx, train, par)
  graphdef, state = nnx.split(layer)

  def run(state, x, cache):
    return nnx.merge(graphdef, state)(x, segment_ids, cache, pos, layer_idx, train, par)

  return jax.checkpoint(run, policy=_remat_policy(remat))(state, x, cache)


class Unit(nnx.Module):
  """`period` consecutive decoder layers: the body of the scan."""

  def __init__(self, cfg: ModelConfig, kinds, *, init: Init):
    self.layers = nnx.List([DecoderLayer(cfg, m, f, init=init) for m, f in kinds])

  def __call__(self, x, segment_ids=None, caches=None, pos=0, first_layer=0, train=False,
               layer_remat: str = "none", par: Parallel = SINGLE):
    """layer_remat: rematerialise each layer on its own (`call_layer`) inside the unit."""
    new_caches, auxes = [], []
    for i, layer in enumerate(self.layers):
      with jax.named_scope(f"unit_layer_{i}"):
        x, c, aux = call_layer(layer, layer_remat, x, segment_ids,
                               None if caches is None else caches[i], pos, first_layer + i,
                               train, par)
      new_caches.append(c)
      auxes.append(aux)
    return x, (None if caches is None else tuple(new_caches)), auxes


def _stacked_units(cfg: ModelConfig, kinds, reps: int, init: Init) -> Unit:
  """One Unit whose variables hold `reps` units' values stacked on a leading "layers" axis.
  Row i is drawn from init.children()(i) in every mode, so the traced (vmapped) and the host
  (row by row) construction give the same values."""
  child = init.children()
  if init.mode == "jax":
    # Traced (the sharded init): each leaf is drawn once as [reps, ...] under vmap, so the
    # program holds one draw per unit parameter, not reps, and no stacking copy.
    out = {}

    def one(i):
      out["graphdef"], state = nnx.split(Unit(cfg, kinds, init=child(i)))
      return state
    stacked = jax.vmap(one)(jnp.arange(reps))
    graphdef = out["graphdef"]
  else:
    graphdef, first = nnx.split(Unit(cfg, kinds, init=child(0)))
    states = [first] + [nnx.split(Unit(cfg, kinds, init=child(i)))[1] for i in range(1, reps)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  units = nnx.merge(graphdef, stacked)
  for _, node in nnx.iter_graph(units):
    if isinstance(node, nnx.Variable) and "logical_axes" in node.get_metadata():
      node.set_metadata(logical_axes=("layers",) + tuple(node.get_metadata()["logical_axes"]))
  return units


POOL_WRITES = ("in_layer", "after_scan")
"""Where a scanned MLA layer's new latents go into the serving pools (K3Model, pool_write):
in_layer: each layer writes them into the stacked pools, carried by the scan, then reads;
after_scan: each layer reads the pools and returns its latents, all scattered after the
scan. XLA:CPU copies the whole pool twice a step with the second (the step's cost grows
with the pool); the TPU compiler copies it with the first (k3 v5p-128, 1,024 x 32K decode:
366.8 GB a chip a step against 260.3; docs/pod-scale.md). Both give the same logits and
pools."""


def pool_write_for(platform: str) -> str:
  """The pool write placement a program compiled for `platform` gets (POOL_WRITES)."""
  return "after_scan" if platform == "tpu" else "in_layer"


def _write_latents(e: PagedMLACache, latents, pos) -> PagedMLACache:
  """The stacked pools of a scanned MLA layer with every unit's new latents [R, B, T, X]
  written at their pages (the positions pos + [0, T) of each sequence)."""
  c_new, r_new = latents
  reps, _, t = c_new.shape[:3]
  table = e.page_table[0]                                              # [B, M], same per unit
  b = table.shape[0]
  q_pos = jnp.broadcast_to(jnp.asarray(pos, jnp.int32), (b,))[:, None] + jnp.arange(t)[None]
  page, off = page_slots(table, q_pos, e.c_kv.shape[-2])
  # Every index named (unit too), so each update is one contiguous row of X: with the unit
  # axis left as a window ([:, page, off]) the TPU compiler relaid out the whole stacked
  # pool around the scatter, twice a step (k3, 1,024 x 32K: 2 x 23.7 GB per chip).
  unit = jnp.broadcast_to(jnp.arange(reps)[:, None, None], (reps,) + page.shape)
  page, off = (jnp.broadcast_to(a, unit.shape) for a in (page, off))
  return PagedMLACache(c_kv=e.c_kv.at[unit, page, off].set(c_new.astype(e.c_kv.dtype)),
                       k_r=rope_pages.write(e.k_r, (unit, page), off, r_new),
                       page_table=e.page_table)


def _in_place(e, one_token: bool) -> bool:
  return (one_token and isinstance(e, KDAState) and e.active is not None
          and e.window is None)


def _unit_entry(e, i, one_token: bool):
  """A scanned layer's cache entry at unit i. A KDA layer's in a serving decode step (one
  token, active rows marked) keeps its whole stacked state, which the decode kernel updates
  in place at `unit` (sliced out and written back, the state took two more passes a layer:
  k3 v5p-128, 1,024 x 32K ~27 GB a chip a step); the windows are sliced."""
  if _in_place(e, one_token):
    return replace(jax.tree.map(lambda a: a[i], replace(e, state=None)), state=e.state, unit=i)
  return jax.tree.map(lambda a: a[i], e)


def _put_unit(e, u, i, one_token: bool):
  """The stacked entry e with unit i's new entry u written back (see _unit_entry)."""
  put = lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), i, 0)
  if _in_place(e, one_token):
    return replace(jax.tree.map(put, replace(e, state=None), replace(u, state=None, unit=None)),
                   state=u.state)
  return jax.tree.map(put, e, u)


class K3Model(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, init: Init):
    self.cfg = cfg
    dt, pdt = jnp_dtype(cfg.dtype), jnp_dtype(cfg.param_dtype)
    plan = stack.plan_of(cfg)
    layer = lambda s: DecoderLayer(cfg, s.mixer, s.ffn, init=init)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, init=init, dtype=dt, param_dtype=pdt)
    self.prefix = nnx.List([layer(s) for s in plan.group("prefix")])
    self.units = nnx.data(None)
    if plan.repeats:
      self.units = nnx.data(_stacked_units(cfg, [(s.mixer, s.ffn) for s in plan.unit],
                                           plan.repeats, init))
    self.suffix = nnx.List([layer(s) for s in plan.group("suffix")])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, axis_name="embed")
    if cfg.attn_res.enabled:
      self.final_query = attn_res.PseudoQuery(cfg.d_model)
    self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, init=init, dtype=dt, param_dtype=pdt)
    # Built last, so a text model's initial values do not depend on whether it has a tower.
    if cfg.vision is not None:
      self.vision = VisionEncoder(cfg, init=init)

  @property
  def plan(self) -> stack.StackPlan:
    return stack.plan_of(self.cfg)

  # ----- caches ---------------------------------------------------------------
  def init_cache(self, batch: int, max_len: int) -> ModelCache:
    if max_len > self.cfg.max_seq_len:
      raise ConfigError(f"cache length {max_len} exceeds max_seq_len={self.cfg.max_seq_len}")
    plan = self.plan
    # (a unit layer's init_cache reads only its config: the stacked module serves)
    return plan.build_cache(jnp.zeros((), jnp.int32),
                            lambda s: plan.module(self, s).init_cache(batch, max_len))

  def init_paged_cache(self, batch: int, num_pages: int, page_size: int) -> ModelCache:
    """The serving cache: per-sequence KDA states ([B, ...] as in init_cache) and, for each
    MLA layer, a pool of `num_pages` latent pages of `page_size` tokens shared by all
    sequences (layers/mla.py). Before a call, each MLA entry gets its page table [B, M] and
    `pos` becomes a per-sequence [B] position (k3_jax/serve/kv_pages.py does both)."""
    plan = self.plan
    return plan.build_cache(
        jnp.zeros((batch,), jnp.int32),
        lambda s: plan.module(self, s).init_paged_cache(batch, num_pages, page_size))

  # ----- forward --------------------------------------------------------------
  def _run_units(self, x, segment_ids, caches, pos, remat, train, par, pool_write):
    # Packed routed experts (serving) stay out of the scanned inputs: each layer gets its
    # whole stack and the layer index (mx_gmm.StackedLayer), which the MXFP4 kernel reads in
    # place; a scan slice feeding a Pallas call would be copied out, every layer, every step.
    graphdef, stacks, state = nnx.split(self.units, _held_whole(par), ...)
    plan = self.plan
    reps = plan.repeats
    first_layers = plan.prefix + plan.period * jnp.arange(reps)

    # Per-sequence caches (KDA states, contiguous MLA latents) ride in the carry and are
    # written back in place (dynamic_update_index), so a decode step updates the donated
    # buffers instead of building a second stacked copy as scan outputs (at 128K context
    # that copy is GBs per chip). Paged MLA pools (serving), pool_write "in_layer": they
    # ride in the carry whole; each layer scatters its new latents into the stacked pools
    # at its unit's index, then reads its sequences' pages there in place (layers/mla.py
    # _paged); never sliced out, never read before a later write (on XLA:CPU a pool read by
    # the loop then written after it was copied whole, twice, every step). "after_scan":
    # the pools stay out of the carry, each layer reads them in place and returns its new
    # latents, scattered after the loop (the TPU compiler keeps that in place; POOL_WRITES).
    if pool_write not in POOL_WRITES:
      raise ValueError(f"pool_write={pool_write!r}: expected one of {', '.join(POOL_WRITES)}")
    after = pool_write == "after_scan"
    one_token = (x["partial"] if isinstance(x, dict) else x).shape[-2] == 1   # (attn_res)
    paged = tuple(isinstance(e, PagedMLACache) for e in caches or ())
    carried = None if caches is None else tuple(
        (None if after else (e.c_kv, e.k_r)) if p else e for e, p in zip(caches, paged))

    def body(carry, xs):
      x, all_c = carry
      st, first, i = xs
      c = None
      if caches is not None:
        c = tuple((PagedMLACache(e.c_kv, e.k_r, e.page_table[i], unit=i, deferred=True,
                                 window=e.window)
                   if after else PagedMLACache(a_c[0], a_c[1], e.page_table[i], unit=i,
                                               window=e.window))
                  if p else _unit_entry(a_c, i, one_token)
                  for e, a_c, p in zip(caches, all_c, paged))
      layer = jax.tree.map(lambda w: mx_gmm.StackedLayer(w, i), stacks,
                           is_leaf=lambda w: isinstance(w, mx_gmm.MXArray))
      x, c, aux = nnx.merge(graphdef, layer, st)(x, segment_ids, c, pos, first, train,
                                          layer_remat="block" if remat == "layer" else "none",
                                          par=par)
      latents = None
      if caches is not None:
        all_c = tuple((None if after else (u_c.c_kv, u_c.k_r)) if p
                      else _put_unit(a_c, u_c, i, one_token)
                      for a_c, u_c, p in zip(all_c, c, paged))
        if after:
          latents = tuple((u.c_kv, u.k_r) if p else None for u, p in zip(c, paged))
      return (x, all_c), (aux, latents)

    # "block": the scan keeps each unit's input and recomputes the unit in the backward
    # pass; "layer": the same, and within that recomputation each layer is rematerialised
    # again, so one layer's intermediates (not the unit's) are live at a time
    if remat != "none":
      body = jax.checkpoint(body, policy=_remat_policy(remat))
    (x, carried), (aux, latents) = jax.lax.scan(body, (x, carried),
                                                (state, first_layers, jnp.arange(reps)))
    if caches is not None:
      caches = tuple((_write_latents(e, lat, pos) if after
                      else PagedMLACache(c[0], c[1], e.page_table)) if p else c
                     for e, c, lat, p in zip(caches, carried, latents or (None,) * len(caches),
                                             paged))
    return x, caches, aux

  def embed_inputs(self, tokens: jax.Array, images: dict | None = None,
                   image_features: jax.Array | None = None) -> jax.Array:
    """Token embeddings [B, T, D]; with `images` (the packed dict of k3_jax/ops/vision.py) the
    image placeholders' embeddings are replaced, in order, by the projected image features.
    image_features [M, D]: features the tower already computed (`self.vision(images)`), for
    a prompt prefilled in pieces: the piece's placeholders take them in order."""
    if (images is not None or image_features is not None) and self.cfg.vision is None:
      raise ConfigError(f"{self.cfg.name} has no vision tower (ModelConfig.vision is None); "
                        "use configs.get_multimodal for a model that takes images")
    if images is not None and image_features is not None:
      raise ValueError("give images or image_features, not both")
    x = self.embed(tokens)
    if images is not None:
      image_features = self.vision(images)                           # [M, D]
    if image_features is None:
      return x
    return scatter_features(x, tokens, image_features, self.cfg.vision.image_token_id)

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               cache: ModelCache | None = None, remat: str = "none", train: bool = False,
               images: dict | None = None, image_features: jax.Array | None = None,
               last_only: bool = False, par: Parallel = SINGLE,
               pool_write: str | None = None):
    """tokens [B, T] -> (logits [B, T, vocab] f32, new cache or None, aux).

    par: how the program is parallelised (k3_jax/partitioning.py; built for a mesh by
    sharding.install.parallel_for); the default SINGLE is the single-device program.

    last_only: the logits of the last position alone ([B, 1, vocab]): a prefill needs no
    others (at T = 1M the whole [T, vocab] f32 logits would be 671 GB).

    images: packed image patches (k3_jax/ops/vision.py) whose features replace the image
    placeholder tokens of `tokens`, in order; None (text only) runs exactly as before.
    image_features [M, D]: or the projected features themselves (see embed_inputs).

    pool_write: where a scanned MLA layer writes its latents into a paged cache's pools
    (POOL_WRITES); None = pool_write_for(par.platform), the program's target.

    aux: 'expert_load' [n_moe_layers, E] (tokens per expert), 'max_logit' [n_mla_layers, H],
    and with train=True 'new_bias' [n_moe_layers, E] (for `set_router_biases`). MoE layers
    are listed in `moe_layers()` order.
    """
    b, t = tokens.shape
    limit = self.cfg.max_seq_len
    if t > limit:
      raise ConfigError(f"sequence length {t} exceeds max_seq_len={limit}")
    pos = cache.pos if cache is not None else 0
    with jax.named_scope("embed"):
      x = par.constrain(self.embed_inputs(tokens, images, image_features),
                        ("batch", "seq", "embed"))
    if self.cfg.attn_res.enabled:
      with jax.named_scope("attn_res"):
        x = attn_res.init_stream(x, self.cfg.num_layers, self.cfg.attn_res.block_size)
    new_caches = {}
    auxes = []                  # per slot (stack.py's slot order), each with a leading rows axis
    plan = self.plan

    def run_list(group, x):
      caches = []
      for spec, layer in plan.modules(self, plan.group(group)):
        # the unscanned layers are rematerialised one by one under any remat
        with jax.named_scope(f"layer_{spec.index}"):
          x, c, aux = call_layer(layer, remat, x, segment_ids,
                                 None if cache is None else getattr(cache, group)[spec.position],
                                 pos, spec.index, train, par)
        caches.append(c)
        auxes.append(jax.tree.map(lambda a: a[None], aux))
      new_caches[group] = tuple(caches)
      return x

    x = run_list("prefix", x)
    if self.units is not None:
      with jax.named_scope("units"):
        x, new_caches["units"], unit_aux = self._run_units(
            x, segment_ids, None if cache is None else cache.units, pos, remat, train, par,
            pool_write or pool_write_for(par.platform))
      auxes.extend(unit_aux)    # one aux per layer of the unit, each with a leading [R] axis
    x = run_list("suffix", x)
    new_cache = None if cache is None else ModelCache(
        pos=pos + t, prefix=new_caches["prefix"], units=new_caches.get("units"),
        suffix=new_caches["suffix"])
    if last_only:     # the stream's [.., T, D] arrays (or x) at the last position
      x = jax.tree.map(lambda a: a[..., -1:, :] if a.ndim >= 3 else a, x)
    if self.cfg.attn_res.enabled:
      x = self.final_query(x, self.cfg.norm_eps)
    with jax.named_scope("lm_head"):
      logits = par.by_output(self.lm_head(self.final_norm(x)), grouped=False)
    aux = {k: jnp.concatenate([a[k] for a in auxes if k in a], axis=0)
           for k in ("expert_load", "max_logit", "new_bias") if any(k in a for a in auxes)}
    return logits, new_cache, aux

  # ----- router biases ------------------------------------------------------------
  def moe_layers(self) -> list[tuple[MoE, int]]:
    """(MoE module, rows) in aux order (the plan's MoE slots: a scanned layer's bias is
    stacked over `repeats` rows)."""
    return [(layer.ffn, spec.rows) for spec, layer in self.plan.modules(
        self, self.plan.moe_slots())]

  def set_router_biases(self, new_bias: jax.Array) -> None:
    """Writes aux['new_bias'] [n_moe_layers, E] back into the layers' bias state."""
    row = 0
    for moe, rows in self.moe_layers():
      value = new_bias[row:row + rows]
      moe.bias[...] = value if moe.bias[...].ndim == 2 else value[0]
      row += rows


# ----- construction and entry points --------------------------------------------

def create_model(cfg: ModelConfig, seed: int = 0, mode: str = "host") -> K3Model:
  """A freshly initialised model (drawn on the host by default; layers/init.py: the "jax"
  mode, traced, gives the same values)."""
  return K3Model(cfg, init=Init(seed, mode))


def abstract_model(cfg: ModelConfig) -> K3Model:
  """The model with ShapeDtypeStructs instead of arrays: no allocation, any size."""
  return nnx.eval_shape(lambda: create_model(cfg, mode="abstract"))


def check_tokens(tokens, cfg: ModelConfig) -> np.ndarray:
  """Host-side input validation, before any compute: ids in [0, vocab), length <= max."""
  arr = np.asarray(tokens)
  if arr.ndim not in (1, 2):
    raise UserError(f"tokens must have shape [T] or [B, T], got {arr.shape}")
  if not np.issubdtype(arr.dtype, np.integer):
    raise UserError(f"tokens must be integers, got dtype {arr.dtype}")
  if arr.shape[-1] > cfg.max_seq_len:
    raise UserError(f"sequence of {arr.shape[-1]} tokens exceeds max_seq_len={cfg.max_seq_len}")
  if arr.size and (arr.min() < 0 or arr.max() >= cfg.vocab_size):
    bad = arr[(arr < 0) | (arr >= cfg.vocab_size)].ravel()[:5].tolist()
    raise UserError(f"token ids outside the vocabulary [0, {cfg.vocab_size}): {bad}")
  return arr


def forward(model: K3Model, tokens, segment_ids=None, remat: str = "none",
            par: Parallel = SINGLE) -> jax.Array:
  return model(tokens, segment_ids, remat=remat, par=par)[0]


def prefill(model: K3Model, tokens: jax.Array, max_len: int,
            images: dict | None = None, last_only: bool = False,
            par: Parallel = SINGLE) -> tuple[jax.Array, ModelCache]:
  """tokens [B, T] -> (logits [B, T, vocab], cache ready for decoding at position T).
  images: packed images whose features replace the prompt's placeholders. last_only: the
  last position's logits alone ([B, 1, vocab]), all that generating needs. par: the
  parallel setup (K3Model.__call__)."""
  cache = model.init_cache(tokens.shape[0], max_len)
  logits, cache, _ = model(tokens, cache=cache, images=images, last_only=last_only, par=par)
  return logits, cache


def decode_step(model: K3Model, cache: ModelCache, token: jax.Array,
                par: Parallel = SINGLE) -> tuple[jax.Array, ModelCache]:
  """token [B] -> (logits [B, vocab], cache advanced by one)."""
  logits, cache, _ = model(token[:, None], cache=cache, par=par)
  return logits[:, 0], cache


def vision_param_counts(cfg: ModelConfig) -> dict:
  """Parameters of the vision tower and projector alone (abstract: nothing allocated)."""
  if cfg.vision is None:
    return {}
  enc = nnx.eval_shape(lambda: VisionEncoder(cfg, init=Init(0, "abstract")))
  parts = {name: sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(mod, nnx.Param)))
           for name, mod in (("tower", enc.tower), ("projector", enc.projector))}
  return {"vision_params": sum(parts.values()), "vision_by_module": parts}


def _is_routed_expert(axes) -> bool:
  return "experts" in axes and "expert_mlp" in axes


def param_counts(cfg: ModelConfig) -> dict:
  """Total and activated parameters, from the abstract model (the code that builds it)."""
  model = abstract_model(cfg)
  total = routed = lookup = vision = 0
  groups: dict[str, int] = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    n = math.prod(var.shape)
    if str(path[0]) == "vision":       # the tower and projector, reported on their own
      vision += n
      part = f"vision.{path[1]}"
      groups[part] = groups.get(part, 0) + n
      continue
    total += n
    axes = tuple(var.get_metadata().get("logical_axes", ()))
    if _is_routed_expert(axes):
      routed += n
    elif axes == ("vocab", "embed"):   # the input embedding is a row lookup, not compute
      lookup += n
    top = str(path[0])
    groups[top] = groups.get(top, 0) + n
  # Activated per token: every parameter a token's forward pass multiplies with: the
  # routed experts in proportion top_k / num_experts, the input embedding table not at all
  # (the convention behind K3's "104B activated").
  active = total - lookup - routed + routed * cfg.moe.top_k / cfg.moe.num_experts
  out = {"total_params": int(total), "active_params": int(round(active)),
         "routed_expert_params": int(routed), "by_module": groups}
  if cfg.vision is not None:
    # total_params / active_params stay the language model's (as released figures count it)
    out["vision_params"] = int(vision)
  return out
