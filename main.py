"""K3 in JAX: one command line.

  python main.py train     [--config=k3_small] [--steps=N] [--workdir=runs/default] ...
  python main.py generate  --workdir=runs/default --prompt="def " [--temperature=0.8 --top_p=0.95]
  python main.py info      --config=k3 [--json] [--quant=mxfp4] [--optimizer]
  python main.py compile   --config=k3 --topology=v5p-4096 --mesh=fsdp:256,expert:8
                           [--step=train|prefill|decode] [--global_batch=N --seq_len=N] [--json]

`python main.py <command> --help` lists every flag.
"""

from __future__ import annotations

import glob
import os
import sys


def _quiet_platform() -> None:
  """Without a TPU attached, run on the CPU and keep libtpu's discovery warnings away."""
  if "JAX_PLATFORMS" not in os.environ and not (glob.glob("/dev/accel*") or
                                                glob.glob("/dev/vfio/[0-9]*")):
    os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


_quiet_platform()

from absl import app, flags  # noqa: E402

COMMANDS = ("train", "generate", "info", "compile")

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "k3_small", "model preset: k3, k3_small, k3_tiny, kimi_linear_48b")
flags.DEFINE_multi_string("override", [], "config override field=value, e.g. kda.num_heads=4 "
                          "(repeatable)")
flags.DEFINE_string("workdir", "runs/default", "where checkpoints and metrics.jsonl go")
flags.DEFINE_integer("steps", None, "training steps (default: the preset's)")
flags.DEFINE_integer("batch_size", None, "global batch size in sequences")
flags.DEFINE_integer("seq_len", None, "training sequence length")
flags.DEFINE_integer("grad_accum", None, "micro-batches per step")
flags.DEFINE_float("learning_rate", None, "peak AdamW learning rate (the whole model with "
                   "--optimizer=adamw; the non-matrix parameters with --optimizer=muon)")
flags.DEFINE_float("muon_lr", None, "peak Muon learning rate (matrix parameters, "
                   "--optimizer=muon)")
flags.DEFINE_string("optimizer", None, "train: muon (Per-Head Muon + AdamW) | adamw; default: "
                    "the preset's. info: --optimizer alone (or =muon|adamw) prints every "
                    "parameter's optimizer group and batch axes")
flags.DEFINE_string("remat", None, "none | block (recompute each scanned unit) | layer "
                    "(block, and each layer on its own within it) | dots (keep matmuls)")
flags.DEFINE_integer("eval_every", None, "evaluate every N steps")
flags.DEFINE_integer("checkpoint_every", None, "checkpoint every N steps")
flags.DEFINE_integer("seed", None, "random seed (init and data order)")
flags.DEFINE_string("dataset", None, "stdlib (default) | mqar | shapes (synthetic "
                    "images + captions; attaches the preset's vision tower) | path to "
                    ".txt/.jsonl/folder")
flags.DEFINE_string("tokenizer", None, "byte (default) | path to a tiktoken BPE file")
flags.DEFINE_string("mesh", "", "mesh axes, e.g. data:2,fsdp:4 (default: fsdp over all devices)")
flags.DEFINE_boolean("json", False, "info: print one JSON object")
flags.DEFINE_enum("quant", "none", ["none", "mxfp4"],
                  "info: also report serving weight bytes with routed experts packed MXFP4 "
                  "(the rest BF16); generate: run the routed experts from packed MXFP4 weights "
                  "(converted from the checkpoint at load; activations MXFP8 as in QAT); compile "
                  "decode/prefill: the routed-expert weight format")
flags.DEFINE_string("prompt", "", "generate: the prompt text")
flags.DEFINE_multi_string("image", [], "generate: an image file placed before the prompt "
                          "(repeatable; needs a model trained with images, e.g. "
                          "--dataset=shapes)")
flags.DEFINE_integer("caption_eval_images", 192, "train --dataset=shapes: held-out images "
                     "captioned greedily after training to measure accuracy (0: skip)")
flags.DEFINE_integer("max_new_tokens", 200, "generate: tokens to sample")
flags.DEFINE_float("temperature", 0.0, "generate: 0 = greedy")
flags.DEFINE_float("top_p", 1.0, "generate: nucleus sampling mass")
# multi-host (train): auto-detected on a TPU pod; these set it explicitly
flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0 "
                    "(default: auto-detected on TPU pods)")
flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
flags.DEFINE_integer("process_id", None, "multi-host: this process's index")
# compile: ahead-of-time compilation for a TPU target, from any machine
flags.DEFINE_string("topology", None, "compile: Cloud TPU name (v5p-4096, v5e-256, v6e-256) "
                    "or explicit topology (v5p:8x16x16); 'N*NAME' for N slices")
flags.DEFINE_integer("slices", 1, "compile: number of slices of --topology (data axis spans "
                     "them)")
flags.DEFINE_enum("step", "train", ["train", "prefill", "decode"], "compile: which step")
flags.DEFINE_integer("global_batch", None, "compile: global batch in sequences (default: "
                     "--batch_size or the preset's)")
flags.DEFINE_integer("cache_len", None, "compile prefill/decode: cache length in tokens "
                     "(default: --seq_len)")
flags.DEFINE_enum("gmm", "ragged_dot", ["ragged_dot", "tiled"], "compile: MoE grouped matmul "
                  "lowered for the target (ragged_dot on TPU)")
flags.DEFINE_float("ep_capacity", None, "compile/train: expert-parallel capacity factor c "
                   "(rows per source-destination bounded at c*n*k/P; default dropless)")


def _model_config(vision: bool = False):
  """The preset (with its vision tower attached when `vision`), then the overrides."""
  import configs
  from k3_jax.config import apply_overrides, validate
  base = configs.get_multimodal(FLAGS.config) if vision else configs.get(FLAGS.config)
  return validate(apply_overrides(base, FLAGS.override))


def _train_config(cfg):
  import dataclasses
  import configs
  from k3_jax.config import validate_train
  tc = configs.get_train(FLAGS.config)
  names = ("steps", "batch_size", "seq_len", "grad_accum", "learning_rate", "muon_lr",
           "optimizer", "remat", "eval_every", "checkpoint_every", "seed", "dataset", "tokenizer")
  given = {n: getattr(FLAGS, n) for n in names if getattr(FLAGS, n) is not None}
  if given.get("optimizer") == _PRESET_OPTIMIZER:
    del given["optimizer"]
  return validate_train(dataclasses.replace(tc, **given), cfg)


_PRESET_OPTIMIZER = "preset"      # what a bare --optimizer becomes (see _bare_optimizer_flag)


def cmd_info() -> None:
  import json
  from k3_jax.model import param_counts
  cfg = _model_config()
  if FLAGS.optimizer is not None:
    _optimizer_table(cfg)
    return
  counts = param_counts(cfg)
  from k3_jax.config import ConfigError
  from k3_jax.model import vision_param_counts
  try:                                # the preset's vision tower, reported on its own
    counts.update(vision_param_counts(_model_config(vision=True)))
  except ConfigError:                 # this preset has no tower
    pass
  prefix, reps, period = cfg.stack_plan()
  kinds = cfg.layer_kinds()
  pattern = "".join(("K" if m == "kda" else "M") + ("d" if f == "dense" else "")
                    for m, f in kinds)
  out = {"config": cfg.name, "layers": cfg.num_layers,
         "kda_layers": sum(m == "kda" for m, _ in kinds),
         "mla_layers": [i + 1 for i, (m, _) in enumerate(kinds) if m == "mla"],
         "layer_pattern": pattern,
         "scan": {"unscanned_prefix": prefix, "repeats": reps, "period": period,
                  "unscanned_suffix": cfg.num_layers - prefix - reps * period},
         **counts}
  if FLAGS.quant == "mxfp4":
    from k3_jax.quant import serving_weight_bytes
    out["serving_mxfp4"] = serving_weight_bytes(cfg)
  if FLAGS.json:
    print(json.dumps(out))
    return
  print(f"config        {cfg.name}")
  print(f"layers        {cfg.num_layers}: {out['kda_layers']} KDA, {len(out['mla_layers'])} MLA "
        f"(MLA at {', '.join(map(str, out['mla_layers']))})")
  print(f"pattern       {pattern}   (K = KDA, M = MLA, d = dense FFN; others MoE)")
  print(f"scan          {prefix} unscanned + {reps} x {period} scanned + "
        f"{out['scan']['unscanned_suffix']} unscanned")
  print(f"total params  {_human(counts['total_params'])} ({counts['total_params']:,})")
  print(f"active params {_human(counts['active_params'])} ({counts['active_params']:,}) per token")
  print(f"routed expert params {_human(counts['routed_expert_params'])}")
  for k, v in counts["by_module"].items():
    print(f"  {k:<12} {_human(v)}")
  if "vision_params" in counts:
    print(f"vision params {_human(counts['vision_params'])} ({counts['vision_params']:,}), "
          f"not in the totals above: " + ", ".join(
              f"{k} {_human(v)}" for k, v in counts["vision_by_module"].items()))
  if "serving_mxfp4" in out:
    sb = out["serving_mxfp4"]
    print(f"serving bytes {_bytes(sb['total_bytes'])} ({sb['total_bytes']:,}): routed experts "
          f"MXFP4 ({sb['bits_per_routed_weight']:.2f} bits/weight), the rest BF16; all-BF16 "
          f"{_bytes(sb['bf16_total_bytes'])}")
    for k, v in sb["by_part"].items():
      print(f"  {k:<14} {_bytes(v)}")


def _optimizer_table(cfg) -> None:
  """Every parameter's optimizer group and batch axes, from the abstract model (nothing is
  allocated, so it works for k3)."""
  import json
  import math
  from flax import nnx
  from k3_jax.model import abstract_model
  from k3_jax.optim.muon import ADAMW, GROUPS, param_groups
  tc = _train_config(cfg)
  from k3_jax.config import ConfigError
  try:                                # with the preset's vision tower, if it has one
    cfg = _model_config(vision=True)
  except ConfigError:
    pass
  rows = param_groups(nnx.state(abstract_model(cfg), nnx.Param))
  if tc.optimizer == "adamw":
    rows = [(n, s, type(g)(ADAMW)) for n, s, g in rows]
  if FLAGS.json:
    print(json.dumps({"config": cfg.name, "optimizer": tc.optimizer, "params": [
        {"path": n, "shape": list(s), "group": g.group, "batch_axes": list(g.batch_axes)}
        for n, s, g in rows]}))
    return
  width = max(len(n) for n, _, _ in rows)
  print(f"{cfg.name}, optimizer {tc.optimizer} (muon_lr {tc.muon_lr:g}, AdamW lr "
        f"{tc.learning_rate:g}, weight decay {tc.weight_decay:g}, QK-Clip tau "
        f"{tc.qk_clip_tau:g})")
  print(f"{'parameter':<{width}}  {'shape':<22} {'group':<16} batch axes")
  for n, s, g in rows:
    print(f"{n:<{width}}  {str(list(s)):<22} {g.group:<16} {', '.join(g.batch_axes) or '-'}")
  total = sum(math.prod(s) for _, s, _ in rows)
  for grp in GROUPS:
    sel = [s for _, s, g in rows if g.group == grp]
    if sel:
      count = sum(math.prod(s) for s in sel)
      print(f"  {grp:<16} {len(sel):>4} tensors  {_human(count):>8} params "
            f"({100 * count / total:.1f}%)")


def _human(n: float) -> str:
  for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= div:
      return f"{n / div:.2f}{unit}"
  return str(int(n))


def _bytes(n: float) -> str:
  for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if n >= div:
      return f"{n / div:.2f} {unit}"
  return f"{int(n)} B"


def cmd_train() -> None:
  import dataclasses
  import json
  import jax
  from k3_jax import train
  from k3_jax.checkpoint.manager import CheckpointManager
  from k3_jax.data import pipeline, sources, tokenizers
  from sharding.mesh import make_mesh, parse_mesh, validate_mesh

  from sharding.distributed import maybe_initialize
  maybe_initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  shapes_run = FLAGS.dataset == "shapes"
  cfg = _model_config(vision=shapes_run)      # the tower only when the data has images
  tc = _train_config(cfg)
  mesh = make_mesh(parse_mesh(FLAGS.mesh))
  validate_mesh(cfg, mesh, tc.batch_size, tc.seq_len)
  ckpt = CheckpointManager(FLAGS.workdir, cfg, keep=tc.keep_checkpoints)  # refuses a mismatch
  pidx, pcount = jax.process_index(), jax.process_count()
  if tc.batch_size % pcount:
    raise ValueError(f"batch_size={tc.batch_size} must be divisible by {pcount} processes")
  per_host = tc.batch_size // pcount
  if shapes_run:
    from k3_jax.data import shapes
    tok = tokenizers.get_tokenizer(tc.tokenizer)
    train_iter = shapes.ShapesIterator(per_host, tc.seq_len, cfg.vision, tok, seed=tc.seed,
                                       process_index=pidx)
    evals = shapes.eval_batches(per_host, tc.seq_len, cfg.vision, tok, tc.eval_batches,
                                seed=tc.seed)
  elif tc.dataset == "mqar":
    from k3_jax.data import mqar
    train_iter = mqar.mqar_dataset(per_host, tc.seq_len, cfg.vocab_size, num_kv_pairs=8,
                                   seed=tc.seed, process_index=pidx)
    eval_it = mqar.mqar_dataset(per_host, tc.seq_len, cfg.vocab_size, num_kv_pairs=8,
                                seed=tc.seed + 10_000, process_index=pidx)
    evals = [next(eval_it) for _ in range(tc.eval_batches)]
  else:
    tok = tokenizers.get_tokenizer(tc.tokenizer)
    if tok.vocab_size > cfg.vocab_size:
      raise ValueError(f"tokenizer vocabulary {tok.vocab_size} exceeds the model's "
                       f"vocab_size={cfg.vocab_size}")
    if tc.dataset == "stdlib":
      train_docs, eval_docs = sources.stdlib_documents("train"), sources.stdlib_documents("eval")
    else:
      docs = sources.text_documents(tc.dataset)
      n_eval = max(1, len(docs) // 50) if len(docs) > 1 else 0
      train_docs, eval_docs = docs[n_eval:], docs[:n_eval]
    train_iter = pipeline.make_dataset(train_docs, tok, tc.seq_len, per_host, seed=tc.seed,
                                       process_index=pidx, process_count=pcount)
    evals = (pipeline.eval_batches(eval_docs, tok, tc.seq_len, per_host, tc.eval_batches,
                                   process_index=pidx, process_count=pcount)
             if eval_docs else [])
  os.makedirs(FLAGS.workdir, exist_ok=True)
  if pidx == 0:                       # one writer; every host writes its checkpoint shards
    with open(os.path.join(FLAGS.workdir, "train_config.json"), "w") as f:
      json.dump(dataclasses.asdict(tc), f, indent=1)
  from sharding import expert
  with expert.capacity_factor(FLAGS.ep_capacity):    # traced inside: the first step compiles
    result = train.run(cfg, tc, FLAGS.workdir, mesh, train_iter, evals, ckpt=ckpt)
  print(f"done: step {result.get('step')} loss {result.get('loss', float('nan')):.4f} "
        f"eval_loss {result.get('eval_loss', float('nan')):.4f} in "
        f"{result.get('wall_time', 0):.0f}s; checkpoints and metrics.jsonl in {FLAGS.workdir}")
  if shapes_run and FLAGS.caption_eval_images > 0:
    _caption_eval(cfg, tc, mesh, ckpt, tok)


def _caption_eval(cfg, tc, mesh, ckpt, tok) -> None:
  """Greedy captions of held-out shapes images from the last checkpoint, scored."""
  import json
  from k3_jax import train
  from k3_jax.serve.multimodal import caption_accuracy
  steps = train.build_steps(cfg, tc, mesh)
  state, _ = ckpt.restore(steps.abstract_state, steps.state_shardings)
  res = caption_accuracy(cfg, steps.graphdef, state["params"], state["rest"], tok,
                         num_images=FLAGS.caption_eval_images, seed=tc.seed)
  with open(os.path.join(FLAGS.workdir, "caption_eval.json"), "w") as f:
    json.dump(res, f, indent=1)
  acc, chance = res["accuracy"], res["chance"]
  print(f"greedy captions of {res['num_images']} held-out images: " + ", ".join(
      f"{k} {100 * acc[k]:.1f}% (chance {100 * chance[k]:.1f}%)" for k in acc))
  for ex in res["examples"][:4]:
    print(f"  {ex['label']!r} -> {ex['generated']!r}")


def cmd_generate() -> None:
  import jax
  from k3_jax import train
  from k3_jax.checkpoint.manager import CheckpointManager, saved_config
  from k3_jax.data import tokenizers
  from k3_jax.config import TrainConfig
  from k3_jax.serve.engine import Engine
  from sharding.mesh import make_mesh

  cfg = saved_config(FLAGS.workdir)
  if cfg is None:
    raise FileNotFoundError(f"no checkpoints in {FLAGS.workdir}: train first "
                            f"(python main.py train --workdir={FLAGS.workdir})")
  tc = TrainConfig()
  saved_tc = os.path.join(FLAGS.workdir, "train_config.json")
  if os.path.exists(saved_tc):     # the optimizer decides the shape of the saved state
    import json
    with open(saved_tc) as f:
      tc = TrainConfig(optimizer=json.load(f).get("optimizer", tc.optimizer))
  ckpt = CheckpointManager(FLAGS.workdir, cfg)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"{FLAGS.workdir} has a config but no completed checkpoint")
  mesh = make_mesh(devices=jax.devices()[:1])
  steps = train.build_steps(cfg, tc, mesh)
  state, _ = ckpt.restore(steps.abstract_state, steps.state_shardings)
  tok = tokenizers.get_tokenizer(FLAGS.tokenizer or "byte")
  graphdef, params, rest = steps.graphdef, state["params"], state["rest"]
  if FLAGS.quant == "mxfp4":
    from k3_jax.quant import pack_state
    graphdef, params, rest = pack_state(graphdef, params, rest)
  engine = Engine(cfg, graphdef, params, rest)
  ids = tok.encode(FLAGS.prompt)
  stream = tok.stream_decoder()
  sys.stdout.write(FLAGS.prompt)
  sys.stdout.flush()
  stop = () if tok.eos_id is None else (tok.eos_id,)
  if FLAGS.image:
    from k3_jax.serve.multimodal import generate_with_images
    tokens = generate_with_images(engine, tok, FLAGS.prompt, FLAGS.image, FLAGS.max_new_tokens,
                                  FLAGS.temperature, FLAGS.top_p, seed=FLAGS.seed or 0,
                                  stop_ids=stop)
  else:
    tokens = engine.generate(ids, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_p,
                             seed=FLAGS.seed or 0, stop_ids=stop)
  for tid in tokens:
    if tid in stop:
      break
    sys.stdout.write(stream.add(tid))
    sys.stdout.flush()
  sys.stdout.write(stream.flush() + "\n")


def cmd_compile() -> None:
  """Ahead-of-time compile one step for a TPU target and report per-chip memory."""
  import json
  from sharding import aot
  from sharding.topology import resolve_target
  if not FLAGS.topology:
    raise ValueError("compile needs --topology, e.g. --topology=v5p-128 or v5p:4x4x4")
  target = resolve_target(FLAGS.topology, FLAGS.slices)
  cfg = _model_config()
  rep = compile_step(cfg, target, FLAGS.step, FLAGS.mesh, FLAGS.global_batch, FLAGS.seq_len,
                     cache_len=FLAGS.cache_len, gmm=FLAGS.gmm, quant=FLAGS.quant,
                     ep_capacity=FLAGS.ep_capacity)
  if FLAGS.json:
    print(json.dumps(rep))
    return
  print(f"{cfg.name} {rep['step']} step on {target.name} ({target.topology}"
        f"{f' x {target.num_slices} slices' if target.num_slices > 1 else ''}, "
        f"{target.chips} chips), mesh {rep['mesh']}, batch {rep['global_batch']} x "
        f"{rep['seq_len']} tokens" + (f", cache {rep['cache_len']}" if rep.get('cache_len')
                                      else "") + (f", remat {rep['remat']}" if rep.get('remat')
                                                  else ""))
  print(aot.format_report(rep))


def compile_step(cfg, target, step: str, mesh_spec: str, global_batch=None, seq_len=None,
                 cache_len=None, gmm: str = "ragged_dot", quant: str = "none",
                 ep_capacity: float | None = None) -> dict:
  """Lower and compile the real `step` of `cfg` for `target` with abstract inputs; the report
  of sharding.aot.compile_report plus what was compiled. Composes train/model (the step)
  with sharding (devices, mesh, AOT) -- sharding never imports train or serve."""
  import dataclasses
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3_jax import train
  from k3_jax.config import ConfigError
  from k3_jax.model import create_model, decode_step, prefill
  from k3_jax.ops.moe import use_gmm
  from sharding import aot, expert
  from sharding.mesh import make_mesh, parse_mesh, validate_mesh
  from sharding.rules import activation_rules, tree_shardings
  from sharding.topology import target_devices

  mesh = make_mesh(parse_mesh(mesh_spec), target_devices(target))
  tc = _train_config(cfg)
  batch = global_batch or tc.batch_size
  seq = seq_len or tc.seq_len
  validate_mesh(cfg, mesh, batch, seq if step != "decode" else None)
  report = {"config": cfg.name, "step": step, "topology": target.topology,
            "target": target.name, "num_slices": target.num_slices, "chips": target.chips,
            "mesh": {k: int(v) for k, v in mesh.shape.items()}, "global_batch": batch,
            "seq_len": seq, "ep_capacity": ep_capacity}
  with use_gmm(gmm), expert.capacity_factor(ep_capacity):
    if step == "train":
      tc = dataclasses.replace(tc, batch_size=batch, seq_len=seq)
      steps = train.build_steps(cfg, tc, mesh)
      state = aot.with_shardings(steps.abstract_state, steps.state_shardings)
      tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=steps.batch_sharding)
      mask = jax.ShapeDtypeStruct((batch, seq), jnp.float32, sharding=steps.batch_sharding)
      args = (state, {"inputs": tokens, "targets": tokens, "segment_ids": tokens,
                      "loss_mask": mask})
      report.update(remat=tc.remat, grad_accum=tc.grad_accum, optimizer=tc.optimizer)
      _, rep = aot.compile_report(steps.train, args, target.chip_hbm_bytes)
      return {**report, **rep}
    # serving steps: parameters in their stored format, caches sharded on the batch
    length = cache_len or seq
    if step == "decode" and length > cfg.max_seq_len:
      raise ConfigError(f"cache_len={length} exceeds max_seq_len={cfg.max_seq_len}")
    graphdef, params, rest = _serving_params(cfg, quant)
    p_sh, r_sh = tree_shardings(params, mesh), tree_shardings(rest, mesh)
    cache = jax.eval_shape(lambda: create_model(cfg, mode="abstract").init_cache(batch, length))
    cache_dim = lambda path: (None if path[0].key == "pos" else
                              1 if path[0].key == "units" else 0)
    c_sh = aot.batch_shardings(cache, mesh, cache_dim)
    report.update(cache_len=length, quant=quant)
    if step == "decode":
      def run(params, rest, cache, token):
        with activation_rules(mesh):
          return decode_step(nnx.merge(graphdef, params, rest), cache, token)
      tok = jax.ShapeDtypeStruct((batch,), jnp.int32)
      tok_sh = aot.batch_shardings(tok, mesh, 0)
      fn = jax.jit(run, in_shardings=(p_sh, r_sh, c_sh, tok_sh),
                   out_shardings=(aot.batch_shardings(
                       jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32), mesh, 0),
                       c_sh), donate_argnums=(2,))
      args = (aot.with_shardings(params, p_sh), aot.with_shardings(rest, r_sh),
              aot.with_shardings(cache, c_sh), jax.ShapeDtypeStruct(tok.shape, tok.dtype,
                                                                     sharding=tok_sh))
    else:
      def run(params, rest, tokens):
        with activation_rules(mesh):
          logits, cache = prefill(nnx.merge(graphdef, params, rest), tokens, length)
        return logits[:, -1], cache          # the next-token logits and the filled cache
      toks = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
      t_sh = aot.batch_shardings(toks, mesh, 0)
      fn = jax.jit(run, in_shardings=(p_sh, r_sh, t_sh),
                   out_shardings=(aot.batch_shardings(
                       jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32), mesh, 0),
                       c_sh))
      args = (aot.with_shardings(params, p_sh), aot.with_shardings(rest, r_sh),
              jax.ShapeDtypeStruct(toks.shape, toks.dtype, sharding=t_sh))
    _, rep = aot.compile_report(fn, args, target.chip_hbm_bytes)
    return {**report, **rep}


def _serving_params(cfg, quant: str):
  """(graphdef, abstract params, abstract rest) of the model as served: quant="mxfp4" packs
  the routed experts to MXFP4 MXArrays (k3_jax.quant), "none" keeps the param dtype."""
  import jax
  from k3_jax import train
  from k3_jax.model import create_model
  from k3_jax.quant import pack_routed_experts
  out = {}

  def f():
    model = create_model(cfg, mode="abstract")
    if quant == "mxfp4":
      pack_routed_experts(model)
    g, params, rest = train.split_model(model)
    out["graphdef"] = g
    return params, rest

  params, rest = jax.eval_shape(f)
  return out["graphdef"], params, rest


def main(argv) -> None:
  from absl import logging
  logging.set_verbosity(logging.WARNING)   # Orbax logs every save step at INFO
  if len(argv) < 2 or argv[1] not in COMMANDS:
    got = argv[1] if len(argv) > 1 else "nothing"
    raise app.UsageError(f"expected a command, one of {', '.join(COMMANDS)}; got {got}")
  if len(argv) > 2:
    raise app.UsageError(f"unexpected arguments {argv[2:]}: flags take the form --name=value")
  from k3_jax.config import ConfigError
  from k3_jax.checkpoint.manager import CheckpointMismatch
  try:
    {"train": cmd_train, "generate": cmd_generate, "info": cmd_info,
     "compile": cmd_compile}[argv[1]]()
  except (ConfigError, CheckpointMismatch, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _bare_optimizer_flag(argv):
  """`info --optimizer` (no value) means the preset's optimizer; absl needs a value."""
  argv = [f"--optimizer={_PRESET_OPTIMIZER}" if a == "--optimizer" else a for a in argv]
  return flags.FLAGS(argv)


if __name__ == "__main__":
  app.run(main, flags_parser=_bare_optimizer_flag)
