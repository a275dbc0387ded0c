"""Ahead-of-time compilation of the real steps for a TPU target, from any machine.

A job-level module: it composes the train step (k3_jax/train.py) or the serving steps
(k3_jax/serve/steps.py prefill_step / decode_step, the engine's own, over its paged cache)
with the mesh (sharding/) and pod/'s AOT helpers
(devices of a TPU topology, `aot.compile_report`). Neither sharding/ nor pod/ imports train
or serve; this module does the composing, so the command line only parses flags and prints
the report.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax import step_costs, train
from k3_jax.cache import MLACache, ModelCache
from k3_jax.config import (EXPERT_FORMATS, ConfigError, ModelConfig, TrainConfig,
                           validate, validate_train)
from k3_jax.execution import DEFAULT_KERNELS, ExecConfig, Kernels, PodLayout
from k3_jax.layers.linear import SMALL_ROWS
from k3_jax.model import create_model, param_counts
from k3_jax.ops.mx_gmm import EXPERT_WEIGHTS
from k3_jax.serve import kv_pages as kv
from k3_jax.serve.pack import pack_routed_experts
from k3_jax.stack import map_cache
from pod import aot
from pod.topology import Target, resolve_target, target_devices
from sharding import arrays
from k3_jax.partitioning import token_groups
from sharding.install import parallel_for
from sharding.mesh import make_mesh, parse_mesh, validate_mesh
from sharding.rules import RULES, tree_shardings

STEPS = ("train", "prefill", "decode", "verify", "init")

# The flags a preset's PodLayout fills in when they are not given: every execution setting
# (its run) and the operating point.
EXEC_FLAGS = tuple(f.name for f in dataclasses.fields(ExecConfig))
SHAPE_FLAGS = ("global_batch", "seq_len", "cache_len", "expert_format")
LAYOUT_FLAGS = EXEC_FLAGS + SHAPE_FLAGS


def pod_layout(layouts, target: Target, step: str) -> PodLayout | None:
  """The layout among `layouts` (a preset's PodLayouts) for `step` on `target` (the same
  chip grid and slice count, however the topology is spelled), or None. The init step
  takes the train step's layout: it creates the state the train step is sharded for; the
  verify step the decode's, whose cache it reads."""
  want = {"init": "train", "verify": "decode"}.get(step, step)
  for lay in layouts:
    t = resolve_target(lay.topology)
    if (lay.step == want and t.topology == target.topology
        and t.num_slices == target.num_slices):
      return lay
  if target.num_slices > 1:            # no layout of its own: the one-slice layout, N times
    one = pod_layout(layouts, dataclasses.replace(target, num_slices=1), step)
    if one is not None:
      return multi_slice_layout(one, target.num_slices)
  return None


def multi_slice_layout(layout: PodLayout, slices: int) -> PodLayout:
  """A one-slice layout on `slices` slices: every slice holds what one slice held (the same
  axes inside it, the same tokens per chip) and the data axis spans the slices (x slices),
  so only data parallelism crosses DCN; the global batch grows with it."""
  mesh = dict(part.split(":") for part in layout.run.mesh.split(",") if part)
  data = int(mesh.pop("data", 1)) * slices
  spec = ",".join([f"data:{data}", *(f"{a}:{n}" for a, n in mesh.items())])
  return dataclasses.replace(layout, topology=f"{slices}*{layout.topology}",
                             run=dataclasses.replace(layout.run, mesh=spec),
                             global_batch=(layout.global_batch or 0) * slices)


def apply_pod_layout(layout: PodLayout | None, run: ExecConfig, given: dict) -> dict:
  """Fill what the command line left unset from the preset's layout. `run`: the preset's
  execution config (used where it has no layout); `given`: LAYOUT_FLAGS -> the flag's value,
  or None where it was not given (an explicit flag always wins). -> compile_step's keyword
  arguments: run (the layout's, else `run`, with the given flags put in), global_batch,
  seq_len, cache_len, expert_format."""
  unknown = set(given) - set(LAYOUT_FLAGS)
  if unknown:
    raise ValueError(f"not layout flags: {sorted(unknown)}")
  run = (layout.run if layout is not None else run).given(
      **{f: given.get(f) for f in EXEC_FLAGS})
  lay = {f: getattr(layout, f) for f in SHAPE_FLAGS} if layout is not None else {}
  pick = lambda f, default: (given[f] if given.get(f) is not None
                             else lay.get(f) or default)
  return {"run": run, "global_batch": pick("global_batch", None),
          "seq_len": pick("seq_len", None), "cache_len": pick("cache_len", None),
          "expert_format": pick("expert_format", "dense")}


def compile_step(cfg: ModelConfig, tc: TrainConfig, target: Target, step: str,
                 run: ExecConfig = ExecConfig(), global_batch: int | None = None,
                 seq_len: int | None = None, cache_len: int | None = None,
                 expert_format: str = "dense", page_split: str = "auto",
                 draft_tokens: int = 4) -> dict:
  """Lower and compile the real `step` of `cfg` for `target` with abstract inputs (nothing
  is allocated); returns pod.aot.compile_report's per-chip memory report plus what was
  compiled. run: the execution settings (mesh, remat, grad_accum, kernels; a decode that
  exchanges tokens between expert shards and has no capacity gets `decode_ep_capacity`).
  global_batch / seq_len default to tc's; cache_len (prefill / decode) to seq_len. page_split (decode): how the paged cache's pages lie over the
  mesh, "column" (by length), "slot" (by sequence) or "auto" (`decode_page_split`).
  step="verify": the speculative decoding's verify step (serve/verify.py) of every slot and
  `draft_tokens` drafts each, over the decode's paged cache: one step emits 1 to
  draft_tokens + 1 tokens a slot, so its step time against the decode's is the number of
  tokens a step must keep to pay for itself."""
  if step not in STEPS:
    raise ConfigError(f"step={step!r}: expected one of {', '.join(STEPS)}")
  if expert_format not in EXPERT_FORMATS:
    raise ConfigError(f"expert_format={expert_format!r}: expected one of "
                      f"{', '.join(EXPERT_FORMATS)}")
  mesh = make_mesh(parse_mesh(run.mesh), target_devices(target))
  batch = global_batch or tc.batch_size
  seq = seq_len or tc.seq_len
  if step == "init":                     # no batch: the parameters' shardings alone
    validate_mesh(cfg, mesh)
    return init_report(cfg, tc, target, mesh, run)
  # Training splits its batch evenly over the batch axes; a serving step may take fewer
  # sequences than those axes (one 1M-token prompt, 8 long decodes): the batch is then
  # repeated there and the cache length split over them (rules "cache_seq").
  decoding = step in ("decode", "verify")
  validate_mesh(cfg, mesh, batch if step == "train" else None,
                None if decoding else seq, grad_accum=run.grad_accum)
  report = {"config": cfg.name, "step": step, "topology": target.topology,
            "target": target.name, "num_slices": target.num_slices, "chips": target.chips,
            "mesh": {k: int(v) for k, v in mesh.shape.items()}, "global_batch": batch,
            "seq_len": seq, "ep_capacity": run.ep_capacity or None,
            "gmm": "ragged_dot" if run.gmm == "auto" else run.gmm}     # auto, for a TPU
  if step == "train":
    tc = validate_train(dataclasses.replace(tc, batch_size=batch, seq_len=seq), cfg)
    fn, args = train_program(cfg, tc, mesh, run)
    report.update(remat=run.remat, grad_accum=run.grad_accum, optimizer=tc.optimizer)
    _, rep = aot.compile_report(fn, args, target.chip_hbm_bytes, target.generation,
                                model_flops(cfg, step, batch * seq, target.chips),
                                scope_of=step_costs.scope_of)
    add_train_parts(rep, cfg, run, batch * seq, seq, target.chips)
    return {**report, **_with_rates(rep, batch * seq, target.chips)}
  length = cache_len or seq
  if step == "prefill" and length < seq:
    raise ConfigError(f"cache_len={length} is shorter than the prefill's seq_len={seq}")
  if decoding and length > cfg.max_seq_len:
    raise ConfigError(f"cache_len={length} exceeds max_seq_len={cfg.max_seq_len}")
  if step == "verify" and draft_tokens < 1:
    raise ConfigError(f"draft_tokens={draft_tokens}: must be at least 1")
  rows = batch * (draft_tokens + 1) if step == "verify" else batch   # tokens the model runs
  if decoding:
    page_split = decode_page_split(batch, mesh, page_split)
    exchange = expert_exchange(rows, mesh)
    if exchange == "all_to_all":                 # the exchange's bounds, unless given
      if not run.ep_capacity:
        run = dataclasses.replace(run, ep_capacity=decode_ep_capacity(rows, mesh, cfg))
        report["ep_capacity"] = run.ep_capacity
      if not run.ep_recv_capacity:
        run = dataclasses.replace(run, ep_recv_capacity=decode_ep_recv_capacity(rows, mesh,
                                                                                cfg))
      report["ep_recv_capacity"] = run.ep_recv_capacity
    report.update(page_split=page_split, expert_exchange=exchange,
                  weight_split="output" if page_split == "slot" else "model",
                  token_groups=token_groups(rows, mesh) if page_split == "slot" else 1)
  fn, args = _serving_program(cfg, mesh, step, batch, seq, length, expert_format, page_split,
                              draft_tokens, run.kernels)
  report.update(cache_len=length, expert_format=expert_format,
                step_function=(f"k3_jax.serve.verify.verify_step ({draft_tokens} drafts a slot, "
                               "the engine's paged cache)" if step == "verify" else
                               f"k3_jax.serve.steps.{step}_step (the engine's, paged cache)"))
  if step == "verify":
    report["draft_tokens"] = draft_tokens
  tokens = batch if decoding else batch * seq     # verify: the one token a slot it always keeps
  # (a TPU decode attends over the pages with the Pallas kernel, whose cost estimate counts
  # every column; the plain-JAX page loop of other backends has a data-dependent trip count)
  _, rep = aot.compile_report(fn, args, target.chip_hbm_bytes, target.generation,
                              model_flops(cfg, step, rows if decoding else tokens,
                                          target.chips))
  if step == "decode" and rep.get("roofline"):
    r = rep["roofline"]
    weights = served_weight_bytes(cfg, expert_format)
    low = decode_min_bytes(cfg, weights, batch, length) / target.chips
    r["analytic_min_bytes_per_chip"] = low
    r["hbm_bytes_vs_min"] = r["hbm_bytes_per_chip"] / low
    routed = expert_reads_at_min_routing(cfg, r, batch, mesh, weights.routed)
    if routed:
      r["at_min_routing"] = routed
      routed["hbm_bytes_vs_min"] = routed["hbm_bytes_per_chip"] / low
  rep = _with_rates(rep, tokens, target.chips)
  r = rep.get("roofline") or {}
  if step == "decode" and r.get("step_time_s") and target.generation == "v5p" \
      and target.chips == NODE_CHIPS:
    r["target_tokens_per_s"] = NODE_TARGET_TOKENS_S
    r["vs_target"] = r["tokens_per_s"] / NODE_TARGET_TOKENS_S
    if "at_min_routing" in r:
      r["at_min_routing"]["vs_target"] = r["at_min_routing"]["tokens_per_s"] / NODE_TARGET_TOKENS_S
  return {**report, **rep}


def decode_page_split(batch: int, mesh, given: str = "auto") -> str:
  """The decode layout rule for the paged cache (an explicit "column" / "slot" wins):
  a batch the page shards divide is split by sequence ("slot": each chip holds and attends
  its own sequences' pages whole, nothing combined across chips); a smaller or ragged batch
  by length ("column": every chip holds a stripe of every sequence's pages, decode context
  parallelism, the partials combined per layer). KDA states follow the batch on their own:
  split by sequence where the batch fills the mesh, on K where it does not
  (kv_pages.paged_cache_shardings)."""
  from sharding.paged import PAGE_SPLITS
  if given not in ("auto", *PAGE_SPLITS):
    raise ConfigError(f"page_split={given!r}: expected auto or one of {', '.join(PAGE_SPLITS)}")
  shards = kv.page_shards(mesh)
  if given != "auto":
    if given == "slot" and batch % shards:
      raise ConfigError(f"page_split=slot needs a batch divisible by the {shards} page "
                        f"shards; got {batch}")
    return given
  return "slot" if shards > 1 and batch % shards == 0 else "column"


def weights_by_output(params, mesh, rows: int | None = None, groups: int = 1):
  """Shardings of the served parameters for a decode whose batch fills the mesh: a weight
  whose model dimension ("embed") is an input (not its last dimension) is split on its last
  (output) dimension instead, over the same mesh axes, where that divides; the others
  (outputs of the model dimension, vectors, the routed experts) as the default rule has
  them. With an input model dimension split (the default) and the batch split over the
  same axes, the partitioner gathers each such weight whole on every chip, every step
  (k3, 1,024 x 32K: ~270 GB per chip); split on its output the tokens travel instead (an
  all-gather of [B, D] in, an all-to-all of the [B, F / n] result). A weight that outputs
  the model dimension keeps it split (split on an input, the partitioner gathered those
  whole too). The router [D, E] is split on E like the others (the model constrains its
  scores, the MoE latent projection's and the LM head's outputs to match:
  Parallel.by_output). MLA's latent up-projection kv_b [R, H, n + v] (absorbed into each
  sequence's queries and outputs) is held whole on every chip: split on R, the partitioner
  gathered it whole every layer anyway, with zero-filled buffers and copies (k3 64 x 1M:
  ~2 GB a chip a step, where reading it whole is 0.6 GB; 25 MB a layer of memory). MLA's
  query up-projection q_b [(layers,) Q, H, n + p] moves its split from its low-rank input Q
  to its last dimension, where that divides (the model gathers the small [B, Q] input and
  sends the output back by sequence: Parallel.by_output, by_batch): split on Q, every MLA
  layer all-reduced its [B, H, n + p] partial sums (k3 1,024 x 32K: ~2.5 GB a chip a step).
  KDA's low-rank up-projections [(layers,) r, H, K] (whole by the default rule: every chip
  read each, 3 MB a layer) are split on K (layers/kda.py gathers their small inputs).
  rows: the tokens of a step; at most SMALL_ROWS (layers/linear.py few_rows) kv_b keeps
  the default split on R instead (layers/mla.py moves the few queries to it). The
  embedding table [V, D] is split on V: on D (under 128 lanes a chip) the TPU compiler
  holds each chip's [V, D / n] transposed and copied it whole to row-major for every
  step's lookup (k3 v5p-128: 73 MB a chip a step); on V a lookup reads its rows where they
  lie and the [B, D] rows are summed over the chips. groups: the decode's token groups a
  (`partitioning.token_groups`, the model's Parallel alike): above 1, every weight split
  on its output here (the LM head and the embedding table aside), and every weight that
  outputs the model dimension on it, is split over the n / a devices of a group of the
  mesh viewed as [a, n / a] (`partitioning.grouped_mesh`) and repeated over the a groups:
  each device reads a / n of it and its group's tokens; MLA's kv_b goes on its heads
  there (where the group's devices divide them: layers/mla.py absorbs per head)."""
  from jax.sharding import NamedSharding, PartitionSpec
  from k3_jax.partitioning import GROUP_AXES, grouped_heads, grouped_mesh
  from sharding.rules import logical_to_spec
  default = tree_shardings(params, mesh)
  view = grouped_mesh(mesh, groups) if groups > 1 else None

  def grouped(x, sh, res):
    """res, or the same split over a group's devices (groups > 1, see above)."""
    if view is None or not isinstance(x, nnx.Variable) or not hasattr(x.get_raw_value(),
                                                                       "shape"):
      return res
    axes = tuple(x.get_metadata().get("logical_axes") or ())
    if len(axes) != len(x.shape) or len([a for a in axes if a != "layers"]) < 2 \
        or axes[-2:] in (("embed", "vocab"), ("vocab", "embed")):     # vectors, LM head, table
      return res
    spec = list(res.spec) + [None] * (len(axes) - len(res.spec))
    moved = res is not sh and spec[-1] is not None and all(e is None for e in spec[:-1])
    kept = res is sh and axes[-1] == "embed" and spec[-1] is not None and all(
        e is None for e in spec[:-1])
    if not (moved or kept) or x.shape[-1] % view.shape[GROUP_AXES[1]]:
      return res
    spec = [None] * len(axes)
    heads = moved and axes[-2:] == ("heads", "head_dim") and grouped_heads(x.shape[-2], view)
    spec[-2 if heads else -1] = GROUP_AXES[1]        # [.., H, K]: on H where it divides
    return NamedSharding(view, PartitionSpec(*spec))
  keep = {"embed", "layers", "experts", "expert_embed", "expert_mlp", None}

  def one(x, sh):
    if not isinstance(x, nnx.Variable) or not hasattr(x.get_raw_value(), "shape"):
      return sh
    axes = x.get_metadata().get("logical_axes")
    if axes is None or len(axes) != len(x.shape) or len(axes) < 2:
      return sh
    if "kv_lora" in axes and "heads" in axes:    # MLA's kv_b [(layers,) R, H, n + v]: whole
      few = rows is not None and rows <= SMALL_ROWS      # (few rows: on R, layers/mla.py;
      if view is not None and grouped_heads(x.shape[-2], view):   # token groups: on H)
        return NamedSharding(view, PartitionSpec(*([None] * (len(axes) - 2)), GROUP_AXES[1],
                                                 None))
      return sh if few else NamedSharding(mesh, PartitionSpec())
    if "q_lora" in axes and "heads" in axes:     # MLA's q_b [(layers,) Q, H, n + p]: output
      spec = list(sh.spec) + [None] * (len(axes) - len(sh.spec))
      d, last = axes.index("q_lora"), len(axes) - 1
      on = spec[d] if isinstance(spec[d], tuple) else (spec[d],)
      if spec[d] is not None and spec[last] is None and not x.shape[last] % math.prod(
          mesh.shape[a] for a in on):
        spec[last], spec[d] = spec[d], None
        return NamedSharding(mesh, PartitionSpec(*spec))
      return sh
    if tuple(axes) == ("vocab", "embed"):        # the embedding table [V, D]: split on V
      on = logical_to_spec((x.shape[-1],), ("embed",), mesh)[0]
      n = math.prod(mesh.shape[a] for a in (on if isinstance(on, tuple) else (on,))) if on else 0
      return sh if not n or x.shape[0] % n else NamedSharding(mesh, PartitionSpec(on, None))
    if tuple(axes[-3:]) == ("rank", "heads", "head_dim"):             # KDA's f_up (g_up)
      on = logical_to_spec((x.shape[-1],), ("embed",), mesh)[0]
      return sh if on is None else NamedSharding(
          mesh, PartitionSpec(*([None] * (len(axes) - 1)), on))
    router = axes[-1] == "experts" and "experts" not in axes[:-1]     # [(layers,) D, E]
    if "experts" in axes and not router:                               # the routed experts
      return sh
    spec = list(logical_to_spec(tuple(x.shape), tuple(axes), mesh))
    split = [d for d, name in enumerate(axes) if name == "embed" and spec[d] is not None]
    last = len(axes) - 1
    if (not split or split[0] == last or (axes[last] in keep and not router)
        or spec[last] is not None):
      return sh
    mesh_axes = spec[split[0]] if isinstance(spec[split[0]], tuple) else (spec[split[0]],)
    if x.shape[last] % math.prod(mesh.shape[a] for a in mesh_axes):
      return sh
    spec[last], spec[split[0]] = spec[split[0]], None
    return NamedSharding(mesh, PartitionSpec(*spec))
  return jax.tree.map(lambda x, sh: grouped(x, sh, one(x, sh)), params, default,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


# The decode's expert exchange drops a (source, destination) chunk's pairs past its
# capacity with at most this probability (per chunk per layer, Poisson load).
DROP_TAIL = 1e-6


def decode_ep_capacity(batch: int, mesh, cfg: ModelConfig, tail: float = DROP_TAIL) -> float:
  """The capacity factor of a decode whose expert axis splits the tokens (all-to-all).

  Dropless, a chunk must hold n min(k, E_l) rows (n tokens a chip), and every buffer of
  the exchange and the expert FFN is P times that: at k3's 1,024 x 32K, 14,336 rows a
  layer where 256 arrive on average (~400 GB per chip a step in those buffers). The
  rows a source sends one destination are about Poisson with mean n k / P under balanced
  routing; the factor is the least c whose chunk of ceil(c n k / P) rows overflows with
  probability below `tail`, e.g. n = 16, k = 16, P = 64: mean 4, 16 rows, c = 4."""
  from sharding import expert
  ex = expert.expert_axes(mesh)
  p = math.prod(mesh.shape[a] for a in ex)
  shards = math.prod(mesh.shape[a] for a in expert.token_axes(mesh, batch))
  mean = batch / shards * cfg.moe.top_k / p
  return poisson_bound(mean, tail) / mean


def decode_ep_recv_capacity(batch: int, mesh, cfg: ModelConfig, tail: float = DROP_TAIL) -> float:
  """The receive bound r of the same decode (Kernels.ep_recv_capacity): a device receives
  the sum of P chunks, about Poisson with mean n k under balanced routing; r is the least
  factor whose ceil(r n k) rows overflow with probability below `tail` per device and
  layer (k3 on expert:64: 1,024 sequences, mean 256, 336 rows where P chunks hold 1,088;
  64 sequences, mean 16, 38 rows where P chunks hold 320)."""
  from sharding import expert
  shards = math.prod(mesh.shape[a] for a in expert.token_axes(mesh, batch))
  mean = batch / shards * cfg.moe.top_k
  return poisson_bound(mean, tail) / mean


def poisson_bound(mean: float, tail: float) -> int:
  """The least integer c with P(Poisson(mean) > c) < tail (summed in log space: no
  underflow at large means)."""
  cap, cdf = 0, 0.0
  while True:
    cdf += math.exp(cap * math.log(mean) - mean - math.lgamma(cap + 1))
    if 1.0 - cdf < tail:
      return cap
    cap += 1


def expert_exchange(batch: int, mesh) -> str:
  """Which expert-parallel path a decode of `batch` tokens takes (sharding/expert.py):
  "all_to_all" when the expert axis splits the tokens, "replicated" (each chip its own
  experts' pairs of every token, one all-reduce) when it cannot; "none" without one."""
  from sharding import expert
  ex = expert.expert_axes(mesh)
  if not ex:
    return "none"
  return "all_to_all" if any(a in expert.token_axes(mesh, batch) for a in ex) else "replicated"


# The serving target of the seed: a 64-chip v5p node decoding K3 at 8,700 tokens/s.
NODE_CHIPS, NODE_TARGET_TOKENS_S = 64, 8700.0


def expert_reads_at_min_routing(cfg: ModelConfig, r: dict, batch: int, mesh,
                                routed_bytes: float) -> dict | None:
  """The decode roofline with the routed experts read as the analytic minimum assumes.

  The MXFP4 expert kernel (pallas_kernels/mxfp4_gmm.py) fetches the packed weights of the
  experts that have rows in a call, and no other; which ones is data, so its static cost
  estimate counts every local expert of the call. The minimum (decode_min_bytes) assumes
  the batch's batch x top_k picks fall on distinct experts, spread evenly over the expert
  shards: min(E_l, batch k E_l / E) of a shard's E_l experts per MoE layer. This is the
  same step with the kernels' weight reads at that count (everything else as compiled), so
  step and minimum compare like with like. routed_bytes: all routed experts' weights as
  served (served_weight_bytes). None without MXFP4 expert kernels."""
  calls = (r.get("pallas_kernels") or {}).get("mxfp4_gmm")
  if not calls or not r.get("chip"):
    return None
  m = cfg.moe
  shards = math.prod(mesh.shape[a] for a in RULES["experts"] if a in mesh.shape)
  local = m.num_experts / shards
  touched = min(local, batch * m.top_k * local / m.num_experts)
  layers = calls["count"] / 3                                   # gate, up, down a layer
  saved = (local - touched) * routed_bytes / m.num_experts      # one expert, every layer
  hbm = r["hbm_bytes_per_chip"] - saved
  secs = {**r["seconds"], "hbm": hbm / r["chip"]["hbm_bytes_s"]}
  step = max(secs.values())
  return {"experts_per_shard": local, "experts_read_per_shard": touched,
          "moe_layers": layers, "hbm_bytes_per_chip": hbm, "seconds": secs,
          "step_time_s": step, "bound": max(secs, key=secs.get),
          "tokens_per_s": batch / step}


class WeightBytes(NamedTuple):
  """Bytes of the served parameters: all of them, the routed experts', the embedding
  table's."""
  total: float
  routed: float
  table: float


def served_weight_bytes(cfg: ModelConfig, expert_format: str) -> WeightBytes:
  """The parameters as served (`serving_params`), by the parts a decode reads differently."""
  _, params, _ = serving_params(cfg, expert_format)
  total = routed = table = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    n = leaf.size * leaf.dtype.itemsize
    total += n
    if any(x in EXPERT_WEIGHTS for x in names):
      routed += n
    elif names[:2] == ["embed", "table"]:
      table += n
  return WeightBytes(total, routed, table)


def decode_min_bytes(cfg: ModelConfig, weights: WeightBytes, batch: int, length: int) -> float:
  """The least a decode step must read, over all chips: every weight but the routed
  experts and the embedding table (which gives only `batch` rows), the routed experts a
  batch of `batch` tokens can touch (min(E, batch * top_k) of E per MoE layer), and the
  cache (every MLA latent of `length` positions, every KDA state) of `batch` sequences."""
  total, routed, table = weights
  touched = min(1.0, batch * cfg.moe.top_k / cfg.moe.num_experts)
  cache = jax.eval_shape(lambda: create_model(cfg, mode="abstract").init_cache(batch, length))
  cache_bytes = arrays.tree_bytes(cache)
  rows = table / cfg.vocab_size * batch
  return total - routed - table + rows + routed * touched + cache_bytes


def model_flops(cfg: ModelConfig, step: str, tokens: int, chips: int) -> float:
  """Useful FLOPs per chip of one step, for the MFU: 2 per activated parameter per token
  forward, 6 with the backward pass (attention's own FLOPs left out, as MFU usually does)."""
  per_token = (6 if step == "train" else 2) * param_counts(cfg)["active_params"]
  return per_token * tokens / chips


def _with_rates(rep: dict, tokens: int, chips: int) -> dict:
  """The roofline's tokens per second (the whole program, and per chip) at its step time."""
  r = rep.get("roofline")
  if r and r.get("step_time_s"):
    r["tokens_per_step"] = tokens
    r["tokens_per_s"] = tokens / r["step_time_s"]
    r["tokens_per_s_per_chip"] = tokens / r["step_time_s"] / chips
  return rep


def init_report(cfg: ModelConfig, tc: TrainConfig, target: Target, mesh,
                run: ExecConfig = ExecConfig()) -> dict:
  """Compile the sharded initialisation (train.sharded_init: seed -> train state, created
  in its shardings) for `target`; the report adds what the state's shards should take per
  chip, from the abstract state and its shardings (expected_*_bytes: parameters + the
  model's other variables, optimizer state, and their sum), beside the compiler's numbers
  (its outputs are the state)."""
  steps = train.build_steps(cfg, tc, mesh, run)
  per_chip = lambda part: arrays.shard_bytes(steps.abstract_state[part],
                                          steps.state_shardings[part])
  params = per_chip("params") + per_chip("rest") + per_chip("step")
  opt = per_chip("opt_state")
  report = {"config": cfg.name, "step": "init", "topology": target.topology,
            "target": target.name, "num_slices": target.num_slices, "chips": target.chips,
            "mesh": {k: int(v) for k, v in mesh.shape.items()}, "optimizer": tc.optimizer,
            "state_bytes": arrays.tree_bytes(steps.abstract_state),
            "expected_params_bytes_per_chip": params,
            "expected_opt_state_bytes_per_chip": opt,
            "expected_state_bytes_per_chip": params + opt}
  _, rep = aot.compile_report(steps.init_sharded,
                              (jax.ShapeDtypeStruct((), jnp.int32),), target.chip_hbm_bytes)
  return {**report, **rep}


def decode_lines(rep: dict) -> str:
  """A decode step's bytes against the analytic minimum and its tokens/s against the node
  target (printed under aot.format_report's)."""
  r = rep.get("roofline") or {}
  if "analytic_min_bytes_per_chip" not in r or "tokens_per_s" not in r:
    return ""
  gb = lambda b: f"{b / 1e9:.2f} GB"
  target = (f" (the target for a {NODE_CHIPS}-chip v5p node: {r['target_tokens_per_s']:,.0f}, "
            f"{r['vs_target']:.4f}x)" if "target_tokens_per_s" in r else "")
  lines = [f"decode        reads {gb(r['hbm_bytes_per_chip'])} per chip a step, "
           f"{r['hbm_bytes_vs_min']:.1f}x the analytic minimum "
           f"({gb(r['analytic_min_bytes_per_chip'])}); {r['tokens_per_s']:,.1f} tokens/s"
           + target]
  m = r.get("at_min_routing")
  if m:
    lines.append(f"              with the expert kernels reading {m['experts_read_per_shard']:.2f}"
                 f" of {m['experts_per_shard']:.0f} local experts (the minimum's routing): "
                 f"{gb(m['hbm_bytes_per_chip'])}, {m['hbm_bytes_vs_min']:.1f}x, "
                 f"{m['tokens_per_s']:,.1f} tokens/s")
  return "\n".join(lines)


def init_lines(rep: dict) -> str:
  """The init step's expected-vs-compiled line (printed under aot.format_report's)."""
  def size(b):
    return f"{b / 2**30:.3f} GiB" if b >= 2**28 else f"{b / 2**20:.3f} MiB"
  out = rep.get("output_bytes")
  return (f"expected/chip {size(rep['expected_state_bytes_per_chip'])} (from the abstract "
          f"state and its shardings: {size(rep['expected_params_bytes_per_chip'])} "
          f"parameters + {size(rep['expected_opt_state_bytes_per_chip'])} "
          f"{rep['optimizer']} state; the whole state {size(rep['state_bytes'])}); "
          f"compiled outputs {size(out) if out is not None else 'unknown'}")


def add_train_parts(rep: dict, cfg: ModelConfig, run: ExecConfig, tokens: int, seq: int,
                    chips: int) -> None:
  """The train step's roofline by part of the model (k3_jax/step_costs.py): `parts`, each
  part's counted FLOPs, HBM and wire bytes per chip (and per phase: forward, backward,
  remat's recompute, the optimizer's update) beside `analytic_flops`, its useful count."""
  r = rep.get("roofline")
  if not r or "scopes" not in r:
    return
  r["parts"] = step_costs.by_part(r.pop("scopes"))
  r["analytic_flops"] = step_costs.analytic_flops(cfg, tokens, seq, chips, run.remat,
                                                  run.kda_chunk_size)
  if r.get("model_flops_per_chip"):
    r["flops_vs_useful"] = r["flops_per_chip"] / r["model_flops_per_chip"]


def train_lines(rep: dict) -> str:
  """The train step's per-part table (printed under aot.format_report's)."""
  r = rep.get("roofline") or {}
  if "parts" not in r:
    return ""
  return "parts (per chip)\n" + step_costs.format_parts(r["parts"], r["analytic_flops"],
                                                        r.get("model_flops_per_chip"))


def train_program(cfg: ModelConfig, tc: TrainConfig, mesh, run: ExecConfig = ExecConfig()):
  """(jitted train step, abstract sharded args) of `cfg` on `mesh` at tc's batch x seq_len,
  run as `run` says: the state and a batch as ShapeDtypeStructs carrying their shardings
  (nothing allocated)."""
  steps = train.build_steps(cfg, tc, mesh, run)
  state = arrays.with_shardings(steps.abstract_state, steps.state_shardings)
  shape = (tc.batch_size, tc.seq_len)
  tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=steps.batch_sharding)
  mask = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=steps.batch_sharding)
  return steps.train, (state, {"inputs": tokens, "targets": tokens, "segment_ids": tokens,
                               "loss_mask": mask})


def _serving_program(cfg: ModelConfig, mesh, step: str, batch: int, seq: int, length: int,
                     expert_format: str, page_split: str = "column", draft_tokens: int = 4,
                     kernels: Kernels = DEFAULT_KERNELS):
  """(jitted fn, abstract sharded args) of the engine's prefill, decode or verify step
  (serve/steps.py, serve/verify.py) over its paged cache: parameters in their served
  format, the cache donated."""
  graphdef, params, rest = serving_params(cfg, expert_format)
  p_sh, r_sh = tree_shardings(params, mesh), tree_shardings(rest, mesh)
  decoding = step in ("decode", "verify")
  rows = batch * (1 + draft_tokens if step == "verify" else 1)
  groups = token_groups(rows, mesh) if decoding and page_split == "slot" else 1
  if decoding and page_split == "slot":     # the batch fills the mesh
    p_sh = weights_by_output(params, mesh, rows, groups)
  p_args = (arrays.with_shardings(params, p_sh), arrays.with_shardings(rest, r_sh))
  if decoding:
    return _paged_decode_program(cfg, mesh, graphdef,
                                 parallel_for(mesh, page_split, kernels, groups),
                                 p_args, (p_sh, r_sh), batch, length, page_split,
                                 draft_tokens if step == "verify" else 0)
  return _paged_prefill_program(cfg, mesh, graphdef, parallel_for(mesh, kernels=kernels),
                                p_args, (p_sh, r_sh), batch, seq, length)


def _paged_cache(cfg: ModelConfig, mesh, slots: int, pages: int):
  """The engine's paged cache of `slots` slots and `pages` pages, abstract, and its
  shardings (kv_pages.paged_cache_shardings)."""
  from k3_jax.serve.kv_pages import PAGE
  cache = jax.eval_shape(lambda: create_model(cfg, mode="abstract").init_paged_cache(
      slots, pages, PAGE))
  return cache, kv.paged_cache_shardings(cache, mesh)


def _paged_prefill_program(cfg: ModelConfig, mesh, graphdef, par, p_args, p_shardings,
                           rows: int, piece: int, length: int):
  """(jitted serve.steps.prefill_step, abstract sharded args): the engine's prefill call
  (Runner.prefill) of `rows` prompt pieces of `piece` tokens each, one per slot of a pool
  of `rows` slots, at any position whose piece ends by `length` (page-table width
  ceil(length / 512), the columns striped over the page axis's shards with the null page,
  kv_pages.pool_pages); -> each row's last logits [rows, V] and the cache, donated."""
  from k3_jax.serve import steps
  from k3_jax.serve.kv_pages import PAGE
  per_slot = -(-length // PAGE)
  cache, c_sh = _paged_cache(cfg, mesh, rows, kv.pool_pages(rows, per_slot, 0,
                                                             kv.page_shards(mesh)))
  b = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  i32 = jnp.int32
  # slots, tokens, pos, tables, valid (Runner.prefill's arrays), split on the rows
  call = (b((rows,), i32), b((rows, piece), i32), b((rows,), i32), b((rows, per_slot), i32),
          b((rows,), jnp.bool_))
  in_sh = arrays.batch_shardings(call, mesh, 0)
  logits_sh = arrays.batch_shardings(b((rows, cfg.vocab_size), jnp.float32), mesh, 0)
  fn = jax.jit(steps.bind(steps.prefill_step, graphdef, par),
               in_shardings=(*p_shardings, c_sh, *in_sh), out_shardings=(logits_sh, c_sh),
               donate_argnums=(2,))
  return fn, (*p_args, arrays.with_shardings(cache, c_sh),
              *(arrays.with_shardings(a, s) for a, s in zip(call, in_sh)))


def _paged_decode_program(cfg: ModelConfig, mesh, graphdef, par, p_args, p_shardings,
                          batch: int, length: int, page_split: str = "column",
                          draft_tokens: int = 0):
  """(jitted serve.steps.decode_step, abstract sharded args): the engine's decode over its
  paged cache (every slot at up to `length` tokens: ceil(length / 512) pages each, striped
  over the page axis's shards with the null page, kv_pages.pool_pages; with
  page_split="slot" each shard holds its own slots' pages and one spare, the null page on
  shard 0), with the per-slot sampling inputs (a logit bias row per slot) and the cache and
  counts donated. draft_tokens > 0: serve.verify.verify_step instead, every slot with that
  many drafts (its sampled outputs' shardings left to the compiler)."""
  from k3_jax.serve import steps
  from k3_jax.serve.kv_pages import PAGE
  per_slot = -(-length // PAGE)
  shards = kv.page_shards(mesh)
  pages = (shards * (batch // shards * per_slot + 1) if page_split == "slot"
           else kv.pool_pages(batch, per_slot, 0, shards))
  cache, c_sh = _paged_cache(cfg, mesh, batch, pages)
  b = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  i32, f32 = jnp.int32, jnp.float32
  sampling = steps.Sampling(b((batch,), i32), b((batch,), i32), b((batch,), f32),
                            b((batch,), f32), b((batch,), f32), b((batch,), f32),
                            b((batch, cfg.vocab_size), f32))
  counts = b((batch, cfg.vocab_size), i32)
  n_sh = arrays.batch_shardings(counts, mesh, 0)
  if draft_tokens:
    from k3_jax.serve.verify import VerifyBatch, verify_step
    vbatch = VerifyBatch(b((batch,), i32), b((batch, draft_tokens), i32), b((batch,), i32),
                         b((batch,), i32), b((batch, per_slot), i32), b((batch,), jnp.bool_),
                         sampling)
    v_sh = arrays.batch_shardings(vbatch, mesh, 0)
    fn = jax.jit(steps.bind(verify_step, graphdef, par),
                 in_shardings=(*p_shardings, c_sh, n_sh, v_sh),
                 out_shardings=(None, None, c_sh, n_sh),    # cache and counts in place
                 donate_argnums=(2, 3))
    return fn, (*p_args, arrays.with_shardings(cache, c_sh),
                arrays.with_shardings(counts, n_sh), arrays.with_shardings(vbatch, v_sh))
  dbatch = steps.DecodeBatch(b((batch,), i32), b((batch,), i32), b((batch, per_slot), i32),
                             b((batch,), jnp.bool_), sampling, b((batch,), i32),
                             b((batch,), jnp.bool_))
  d_sh = arrays.batch_shardings(dbatch, mesh, 0)
  out_sh = arrays.batch_shardings(jax.eval_shape(
      lambda: steps.Sampled(*(jnp.zeros(s, d) for s, d in (
          ((batch,), i32), ((batch,), f32), ((batch, steps.TOP_K), i32),
          ((batch, steps.TOP_K), f32), ((batch, cfg.vocab_size), f32))))), mesh, 0)
  fn = jax.jit(steps.bind(steps.decode_step, graphdef, par),
               in_shardings=(*p_shardings, c_sh, n_sh, d_sh), out_shardings=(out_sh, c_sh, n_sh),
               donate_argnums=(2, 3))
  return fn, (*p_args, arrays.with_shardings(cache, c_sh), arrays.with_shardings(counts, n_sh),
              arrays.with_shardings(dbatch, d_sh))


def cache_shardings(cache: ModelCache, mesh) -> ModelCache:
  """Shardings of a contiguous ModelCache: each entry on its batch axis (stack.py), MLA
  latents [(R,) B, S, X] with S over the axes the batch leaves unused; pos replicated."""
  return map_cache(
      lambda e, axis: arrays.batch_shardings(
          e, mesh, axis, axis + MLACache.SEQ_AXIS if isinstance(e, MLACache) else None),
      cache, pos=arrays.batch_shardings(cache.pos, mesh, None))


def serving_params(cfg: ModelConfig, expert_format: str = "dense"):
  """(graphdef, abstract params, abstract rest) of the model as served: "mxfp4" packs the
  routed experts to MXFP4 MXArrays (k3_jax.serve.pack), "dense" keeps the param dtype."""
  out = {}

  def f():
    model = create_model(cfg, mode="abstract")
    if expert_format == "mxfp4":
      pack_routed_experts(model)
    g, params, rest = train.split_model(model)
    out["graphdef"] = g
    return params, rest

  params, rest = jax.eval_shape(f)
  return out["graphdef"], params, rest
