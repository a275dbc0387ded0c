"""K3 in JAX: one command line.

  python main.py train     [--config=k3_small] [--steps=N] [--workdir=runs/default] ...
  python main.py generate  --workdir=runs/default --prompt="def " [--temperature=0.8 --top_p=0.95]
  python main.py info      --config=k3 [--json] [--quant=mxfp4] [--optimizer]

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

COMMANDS = ("train", "generate", "info")

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
flags.DEFINE_string("remat", None, "none | block | dots")
flags.DEFINE_integer("eval_every", None, "evaluate every N steps")
flags.DEFINE_integer("checkpoint_every", None, "checkpoint every N steps")
flags.DEFINE_integer("seed", None, "random seed (init and data order)")
flags.DEFINE_string("dataset", None, "stdlib (default) | mqar | path to .txt/.jsonl/folder")
flags.DEFINE_string("tokenizer", None, "byte (default) | path to a tiktoken BPE file")
flags.DEFINE_string("mesh", "", "mesh axes, e.g. data:2,fsdp:4 (default: fsdp over all devices)")
flags.DEFINE_boolean("json", False, "info: print one JSON object")
flags.DEFINE_enum("quant", "none", ["none", "mxfp4"],
                  "info: also report serving weight bytes with routed experts packed MXFP4 "
                  "(the rest BF16); generate: run the routed experts from packed MXFP4 weights "
                  "(converted from the checkpoint at load; activations MXFP8 as in QAT)")
flags.DEFINE_string("prompt", "", "generate: the prompt text")
flags.DEFINE_integer("max_new_tokens", 200, "generate: tokens to sample")
flags.DEFINE_float("temperature", 0.0, "generate: 0 = greedy")
flags.DEFINE_float("top_p", 1.0, "generate: nucleus sampling mass")


def _model_config():
  import configs
  from k3_jax.config import apply_overrides, validate
  return validate(apply_overrides(configs.get(FLAGS.config), FLAGS.override))


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
  from sharding.mesh import make_mesh, parse_mesh

  cfg = _model_config()
  tc = _train_config(cfg)
  mesh = make_mesh(parse_mesh(FLAGS.mesh))
  ckpt = CheckpointManager(FLAGS.workdir, cfg, keep=tc.keep_checkpoints)  # refuses a mismatch
  pidx, pcount = jax.process_index(), jax.process_count()
  if tc.batch_size % pcount:
    raise ValueError(f"batch_size={tc.batch_size} must be divisible by {pcount} processes")
  per_host = tc.batch_size // pcount
  if tc.dataset == "mqar":
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
  with open(os.path.join(FLAGS.workdir, "train_config.json"), "w") as f:
    json.dump(dataclasses.asdict(tc), f, indent=1)
  result = train.run(cfg, tc, FLAGS.workdir, mesh, train_iter, evals, ckpt=ckpt)
  print(f"done: step {result.get('step')} loss {result.get('loss', float('nan')):.4f} "
        f"eval_loss {result.get('eval_loss', float('nan')):.4f} in "
        f"{result.get('wall_time', 0):.0f}s; checkpoints and metrics.jsonl in {FLAGS.workdir}")


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
  for tid in engine.generate(ids, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_p,
                             seed=FLAGS.seed or 0, stop_ids=stop):
    if tid in stop:
      break
    sys.stdout.write(stream.add(tid))
    sys.stdout.flush()
  sys.stdout.write(stream.flush() + "\n")


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
    {"train": cmd_train, "generate": cmd_generate, "info": cmd_info}[argv[1]]()
  except (ConfigError, CheckpointMismatch, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _bare_optimizer_flag(argv):
  """`info --optimizer` (no value) means the preset's optimizer; absl needs a value."""
  argv = [f"--optimizer={_PRESET_OPTIMIZER}" if a == "--optimizer" else a for a in argv]
  return flags.FLAGS(argv)


if __name__ == "__main__":
  app.run(main, flags_parser=_bare_optimizer_flag)
