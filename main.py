"""K3 in JAX: the command line. It parses flags, calls library functions and prints.

  python main.py train     [--config=k3_small] [--steps=N] [--workdir=runs/default] ...
  python main.py generate  --workdir=runs/default --prompt="def " [--temperature=0.7 --top_p=0.9]
  python main.py info      --config=k3 [--json] [--serving_bytes] [--param_groups]
  python main.py compile   --config=k3 --topology=v5p-4096 --mesh=fsdp:256,expert:8
                           [--step=train|prefill|decode] [--global_batch=N --seq_len=N] [--json]
  python main.py convert   --from=SRC --to=DST [--checkpoint_step=N] [--max_shard_size=5GB]
                           [--dry_run] [--force] [--json]
  python main.py serve     --workdir=runs/default [--host=127.0.0.1 --port=8000 --max_batch=8]
  python main.py prepare   --input=corpus.jsonl --output=DIR [--format=arrayrecord|parquet]
                           [--num_shards=8] [--tokenizer=byte] [--force]

`python main.py <command> --help` lists that command's flags. Installed (`pip install .`),
the same CLI is the `k3` script. A new command: write its library function, a `cmd_<name>`
here that calls it and prints, its flags (in a group below), and one COMMANDS entry.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys
from typing import Callable


def _quiet_platform() -> None:
  """Without a TPU attached, run on the CPU and keep libtpu's discovery warnings away."""
  if "JAX_PLATFORMS" not in os.environ and not (glob.glob("/dev/accel*") or
                                                glob.glob("/dev/vfio/[0-9]*")):
    os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


_quiet_platform()

from absl import app, flags  # noqa: E402

from k3_jax.config import (EXPERT_FORMATS, ServeConfig, TrainConfig,  # noqa: E402
                            flag_fields)            # (plain data: no jax import)
from k3_jax.execution import TRAIN_ONLY, ExecConfig  # noqa: E402

FLAGS = flags.FLAGS


def _define_fields(cls, default_none: bool) -> tuple[str, ...]:
  """A flag per field of `cls` (config.option declarations: help, choices; the type from
  the default); default None (the preset's value) when `default_none`, else the field's."""
  for f in flag_fields(cls):
    meta, default = f.metadata, f.default
    value = None if default_none else default
    if meta["choices"]:
      flags.DEFINE_enum(f.name, value, list(meta["choices"]), meta["help"])
    elif isinstance(default, bool):
      flags.DEFINE_boolean(f.name, value, meta["help"])
    elif isinstance(default, int) or (default is None and "int" in str(f.type)):
      flags.DEFINE_integer(f.name, value, meta["help"])
    elif isinstance(default, float):
      flags.DEFINE_float(f.name, value, meta["help"])
    else:
      flags.DEFINE_string(f.name, value, meta["help"])
  return tuple(f.name for f in flag_fields(cls))


# ---- flags, grouped; each command lists the groups / flags it reads (COMMANDS below) ----
# model: which config
flags.DEFINE_string("config", "k3_small", "model preset: k3, k3_small, k3_tiny, kimi_linear_48b")
flags.DEFINE_multi_string("override", [], "config override field=value, e.g. kda.num_heads=4 "
                          "(repeatable)")
# training job (train; compile --step=train reads the ones that shape the step)
flags.DEFINE_string("workdir", "runs/default", "train: where checkpoints, train_config.json and "
                    "metrics.jsonl go; generate: the run to load")
# every TrainConfig field (k3_jax/config.py), None = the preset's value
TRAIN_CONFIG_FLAGS = _define_fields(TrainConfig, default_none=True)
flags.DEFINE_string("profile_steps", None, "A:B: write a jax.profiler trace of steps A..B "
                    "to <workdir>/profile (TensorBoard / Perfetto)")
flags.DEFINE_integer("caption_eval_images", 192, "--dataset=shapes: held-out images captioned "
                     "greedily after training to measure accuracy (0: skip)")
# execution (train, compile, serve): every ExecConfig field (k3_jax/execution.py), None = the
# preset's value (compile: its pod layout's; serve from a checkpoint: the defaults)
EXEC_CONFIG_FLAGS = _define_fields(ExecConfig, default_none=True)
SERVE_EXEC_FLAGS = tuple(n for n in EXEC_CONFIG_FLAGS if n not in TRAIN_ONLY)
# fault handling (train; generate reads --checkpoint_step too)
flags.DEFINE_integer("max_bad_steps", 3, "stop after this many consecutive steps with a "
                     "non-finite loss, gradient norm or update (each is skipped: no update)")
flags.DEFINE_integer("checkpoint_step", None, "restore this checkpoint step instead of the "
                     "newest good one")
flags.DEFINE_string("init_from", None, "start from the weights of a Hugging Face safetensors "
                    "directory (its config.json gives the model; fresh optimizer state)")
# multi-host training: auto-detected on a TPU pod; these set it explicitly
flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0 "
                    "(default: auto-detected on TPU pods)")
flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
flags.DEFINE_integer("process_id", None, "multi-host: this process's index")
# generate
flags.DEFINE_string("prompt", "", "the prompt text")
flags.DEFINE_multi_string("image", [], "an image file placed before the prompt (repeatable; "
                          "needs a model trained with images, e.g. --dataset=shapes)")
flags.DEFINE_integer("max_new_tokens", 200, "tokens to sample")
flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 = greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling: sample from the smallest set of tokens "
                   "whose probability reaches top_p")
flags.DEFINE_float("frequency_penalty", 0.0, "lower each token's logit by this much per time "
                   "it was generated so far (breaks runs of one token, e.g. whitespace)")
flags.DEFINE_float("presence_penalty", 0.0, "lower the logit of every token generated so far "
                   "by this much, once")
flags.DEFINE_enum("expert_format", "auto", ["auto", *EXPERT_FORMATS], "routed-expert weight "
                  "format: dense (as stored) | mxfp4 (packed MXFP4, 4.25 bits; generate converts "
                  "the checkpoint at load, activations MXFP8 as in QAT) | auto (convert: mxfp4 "
                  "for the kimi_k3 layout when the expert widths are multiples of 32; "
                  "generate / compile: dense)")
flags.DEFINE_string("prompt_ids", None, "comma-separated token ids to continue instead of "
                    "--prompt text, e.g. 1,2,3")
flags.DEFINE_string("hf_dir", None, "load the model (config.json + safetensors) from this "
                    "Hugging Face directory, read sharded, instead of --workdir's checkpoints")
# info
flags.DEFINE_boolean("json", False, "print one JSON object (info, convert; generate: the "
                     "prompt and generated token ids and text)")
flags.DEFINE_boolean("serving_bytes", False, "also report the weight bytes served with the "
                     "routed experts packed MXFP4 (the rest BF16)")
flags.DEFINE_boolean("param_groups", False, "print every parameter's optimizer group and batch "
                     "axes (under --optimizer, default the preset's)")
# compile: ahead-of-time compilation for a TPU target, from any machine
flags.DEFINE_string("topology", None, "Cloud TPU name (v5p-4096, v5e-256, v6e-256) or explicit "
                    "topology (v5p:8x16x16); 'N*NAME' for N slices")
flags.DEFINE_integer("num_slices", None, "multi-slice data parallelism: the data axis spans "
                     "this many slices (DCN), every other axis stays inside one. compile: "
                     "slices of --topology (default 1); train: TPU devices must form that "
                     "many (slice_index), CPU devices are split into that many fake slices")
flags.DEFINE_alias("slices", "num_slices")
flags.DEFINE_enum("step", "train", ["train", "prefill", "decode", "verify", "init"],
                  "which step to compile (init: the sharded initialisation of the train "
                  "state; verify: speculative decoding's verify step, "
                  "--num_speculative_tokens drafts a slot)")
flags.DEFINE_integer("global_batch", None, "global batch in sequences (default: "
                     "--batch_size or the preset's)")
flags.DEFINE_integer("cache_len", None, "prefill/decode: cache length in tokens "
                     "(default: --seq_len)")
flags.DEFINE_enum("page_split", "auto", ["auto", "column", "slot"], "compile --step=decode: "
                  "how the paged cache lies over the mesh: column = each sequence's pages "
                  "striped over the chips (by length), slot = each chip its own sequences "
                  "(by sequence), auto = slot when the page shards divide the batch")
flags.DEFINE_string("sweep", None, "compile --step=decode|prefill over a grid of operating "
                    "points, e.g. 'batch:8,64,256,1024;cache_len:8K,32K,128K,1M' (K, M = "
                    "1024, 1024^2); prints each point, the table and the frontier")
flags.DEFINE_string("sweep_out", None, "compile --sweep: append each point (JSON lines) here "
                    "and skip the points already in it")
flags.DEFINE_string("sweep_plot", None, "compile --sweep: write the frontier plot (PNG) here")

# convert: Orbax workdir <-> Hugging Face safetensors
flags.DEFINE_string("from", None, "SRC: an Orbax workdir (export) or a Hugging Face directory "
                    "with config.json + safetensors (import)")
flags.DEFINE_string("to", None, "DST: the Hugging Face directory (export) or the workdir to "
                    "create (import)")
flags.DEFINE_string("max_shard_size", "5GB", "largest safetensors shard (5GB, 500MB, 1GiB)")
flags.DEFINE_boolean("dry_run", False, "list what would be written (from the abstract model; "
                     "with --config alone for a preset); write nothing")
flags.DEFINE_boolean("force", False, "replace an existing output")
# prepare: tokenize a corpus into shards (k3_jax/data/prepare.py)
flags.DEFINE_string("input", None, "prepare: a .txt / .jsonl file, a folder or a glob of them")
flags.DEFINE_string("output", None, "prepare: the directory to write (shards + manifest.json)")
flags.DEFINE_enum("format", "arrayrecord", ["arrayrecord", "parquet"], "prepare: shard format")
flags.DEFINE_integer("num_shards", 8, "prepare: train shards (a multiple of the processes "
                     "that will read them)")
# serve: the OpenAI-compatible server (k3_jax/serve/); every ServeConfig field, its default
SERVE_CONFIG_FLAGS = _define_fields(ServeConfig, default_none=False)
flags.DEFINE_alias("prefix_match_unit", "prefix_match_tokens")   # its former name (deprecated)
flags.DEFINE_string("served_model_name", None, "model id in /v1/models (default: the config "
                    "name)")
flags.DEFINE_boolean("random_weights", False, "serve random weights of --config instead of a "
                     "checkpoint (smoke tests only)")

MODEL_FLAGS = ("config", "override")
MULTIHOST_FLAGS = ("coordinator_address", "num_processes", "process_id")


# ---- helpers that read flags ----

def _model_config(vision: bool = False):
  """The preset (with its vision tower attached when `vision`), then the overrides."""
  import configs
  from k3_jax.config import apply_overrides, validate
  base = configs.get_multimodal(FLAGS.config) if vision else configs.get(FLAGS.config)
  return validate(apply_overrides(base, _model_overrides()))


def _model_overrides() -> list[str]:
  """--override items for the model: those naming a former model field that is an execution
  setting now (kda.backend=...) go to `_exec_given` instead."""
  from k3_jax.execution import split_overrides
  return split_overrides(FLAGS.override)[0]


def _exec_given() -> dict:
  """The execution settings the command line gives, in one place: every ExecConfig flag
  that was given (and an --override of a moved field, e.g. kda.backend=pallas, by its
  ExecConfig name; a flag wins). Each job puts them over its base: the preset's
  (configs.get_exec), compile's pod layout, or a checkpoint's."""
  from k3_jax.execution import apply_run_overrides, split_overrides
  given = {}
  for item in split_overrides(FLAGS.override)[1]:
    name = item.split("=", 1)[0]
    given[name] = getattr(apply_run_overrides(ExecConfig(), [item]), name)
  given.update({n: getattr(FLAGS, n) for n in EXEC_CONFIG_FLAGS if getattr(FLAGS, n) is not None})
  return given


def _vision_model_config():
  """The preset with its vision tower, or None when it has none (info reports it apart)."""
  from k3_jax.config import ConfigError
  try:
    return _model_config(vision=True)
  except ConfigError:
    return None


def _hf_model_config(hf_dir: str):
  """The model config of a Hugging Face directory (its config.json), with --override."""
  from k3_jax.checkpoint.convert import read_hf_config
  from k3_jax.config import apply_overrides, validate
  return validate(apply_overrides(read_hf_config(hf_dir)[1], _model_overrides()))


def _expert_format() -> str:
  """generate / compile: --expert_format with auto = dense (the stored format)."""
  return "dense" if FLAGS.expert_format == "auto" else FLAGS.expert_format


def _preset_exec() -> ExecConfig:
  """The preset's execution settings (configs.get_exec); the defaults for a model read from
  --init_from."""
  import configs
  return ExecConfig() if getattr(FLAGS, "init_from", None) else configs.get_exec(FLAGS.config)


def _train_config(cfg, check: bool = True):
  """The preset's TrainConfig with every train flag that was given (validated unless not
  `check`: compile validates the batch it was given, not the preset's)."""
  import configs
  from k3_jax.config import validate_train
  given = {n: getattr(FLAGS, n) for n in TRAIN_CONFIG_FLAGS if getattr(FLAGS, n) is not None}
  if getattr(FLAGS, "init_from", None) and "tokenizer" not in given:
    from k3_jax.data.tokenizers import has_tokenizer     # the released weights' own tokenizer
    if has_tokenizer(FLAGS.init_from):
      given["tokenizer"] = FLAGS.init_from
  tc = dataclasses.replace(configs.get_train(FLAGS.config), **given)
  return validate_train(tc, cfg) if check else tc


def _check_workdir(path: str, flag: str = "workdir") -> None:
  """A workdir to write: refused when it names a file (before anything is created)."""
  from k3_jax.config import UserError
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f"--{flag}={path}: is a file, not a directory")


def _check_tokenizer(spec: str | None) -> None:
  """--tokenizer names what `tokenizers.get_tokenizer` loads ('byte', a model directory with
  tiktoken.model or tokenizer.json, or a tokenizer file): checked before any model is loaded."""
  from k3_jax.config import UserError
  if not spec or spec == "byte" or os.path.isfile(spec):
    return
  from k3_jax.data.tokenizers import TOKENIZER_FILES, has_tokenizer
  if os.path.isdir(spec):
    if not has_tokenizer(spec):
      raise UserError(f"tokenizer {spec!r}: a directory without {' or '.join(TOKENIZER_FILES)}")
    return
  raise UserError(f"tokenizer {spec!r}: no such file or directory (use 'byte', a model "
                  "directory with tiktoken.model or tokenizer.json, or a tiktoken BPE file)")


def _check_listen(host: str, port: int) -> None:
  """serve: the address resolves and the port can be bound now, before the model loads
  (SO_REUSEADDR as uvicorn binds, so a port in TIME_WAIT passes as it would there)."""
  import socket
  from k3_jax.config import UserError
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except socket.gaierror as e:
    raise UserError(f"--host={host}: cannot resolve it ({e.strerror})") from None
  family, kind, proto, _, addr = infos[0]
  with socket.socket(family, kind, proto) as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      sock.bind(addr)
    except OSError as e:
      why = "already in use" if e.errno == 98 else e.strerror
      raise UserError(f"--port={port}: cannot listen on {host}:{port}: {why} (choose another "
                      f"--port, or stop the process that holds it)") from None


def _check_multihost_flags() -> None:
  """train, serve: all three multi-host flags or none."""
  from k3_jax.config import UserError
  multihost = [FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id]
  if any(v is not None for v in multihost) and any(v is None for v in multihost):
    raise UserError("multi-host: give all of --coordinator_address, --num_processes and "
                    "--process_id, or none of them (auto-detection on a TPU pod)")


def _check_train_flags() -> None:
  """train: the flags that are not TrainConfig fields, before the mesh or data are touched."""
  from k3_jax.config import UserError
  _check_multihost_flags()
  if FLAGS.max_bad_steps < 1:
    raise UserError(f"--max_bad_steps={FLAGS.max_bad_steps}: must be at least 1")
  if FLAGS.caption_eval_images < 0:
    raise UserError(f"--caption_eval_images={FLAGS.caption_eval_images}: must be >= 0 "
                    "(0 skips the caption eval)")
  _check_checkpoint_step()


def _check_checkpoint_step() -> None:
  from k3_jax.config import UserError
  if FLAGS.checkpoint_step is not None and FLAGS.checkpoint_step < 0:
    raise UserError(f"--checkpoint_step={FLAGS.checkpoint_step}: must be >= 0")


def _check_sampling() -> None:
  """generate: the sampling flags, before the checkpoint is read."""
  from k3_jax.config import UserError
  from k3_jax.serve.requests import RequestError, SamplingParams
  names = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
  try:         # the engine's own check (serve/limits.py), without the OpenAI ranges
    SamplingParams(**{n: getattr(FLAGS, n) for n in names}).validate(openai_ranges=False)
  except RequestError as e:         # "name=value must ...", as the flag: "--name=value: ..."
    name, rest = str(e).split("=", 1)
    value, why = rest.split(" ", 1)
    raise UserError(f"--{name}={value}: {why}") from None
  for path in FLAGS.image:
    if not os.path.isfile(path):
      raise UserError(f"--image={path}: no such file")


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


# ---- commands ----

def cmd_train() -> None:
  from k3_jax import faults
  # First thing: from here on SIGTERM / SIGINT request a stop at the next step boundary (one
  # in setup or compilation: after the first step, which is saved), never a bare kill.
  with faults.StopRequest() as stop:
    faults.hold_for_signal(0, stop, print)      # test hook: a signal during setup
    _train_job(stop)


def _train_job(stop) -> None:
  import jax
  from k3_jax import train
  from k3_jax.checkpoint.manager import CheckpointManager
  from k3_jax.checkpoint.resume import check_resume, save_train_config
  from k3_jax.data.datasets import train_data
  from k3_jax.execution import check_batch
  from k3_jax.profiling import parse_steps
  from pod.distributed import maybe_initialize
  from sharding.mesh import make_mesh, parse_mesh, validate_mesh

  _check_workdir(FLAGS.workdir)
  _check_train_flags()
  maybe_initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  shapes_run = FLAGS.dataset == "shapes"     # the tower only when the data has images
  cfg = (_hf_model_config(FLAGS.init_from) if FLAGS.init_from
         else _model_config(vision=shapes_run))
  tc = _train_config(cfg)
  run = _preset_exec().given(**_exec_given())
  check_batch(run, tc.batch_size)
  if shapes_run and cfg.vision is not None:   # the data's own check, before the mesh
    from k3_jax.data import shapes, tokenizers
    shapes.check_seq_len(tc.seq_len, cfg.vision, tokenizers.get_tokenizer(tc.tokenizer))
  profile = parse_steps(FLAGS.profile_steps)
  mesh = make_mesh(parse_mesh(run.mesh), slices=FLAGS.num_slices)
  validate_mesh(cfg, mesh, tc.batch_size, tc.seq_len, grad_accum=run.grad_accum)
  check_resume(FLAGS.workdir, cfg, tc)     # refuses a mismatch before anything is written
  train_iter, evals = train_data(cfg, tc, jax.process_index(), jax.process_count(),
                                 warn=lambda m: print(m, file=sys.stderr))
  # the workdir is written only now, after every check and the data have passed
  ckpt = CheckpointManager(FLAGS.workdir, cfg, keep=tc.keep_checkpoints)
  save_train_config(FLAGS.workdir, tc)
  init_state = None
  if FLAGS.init_from:                 # released weights, each read straight into its shard
    from k3_jax.checkpoint.sharded_load import train_state_from_hf
    init_state = lambda steps: train_state_from_hf(FLAGS.init_from, steps, tc)
  result = train.run(cfg, tc, FLAGS.workdir, mesh, train_iter, evals, ckpt=ckpt,
                     max_bad_steps=FLAGS.max_bad_steps, restore_step=FLAGS.checkpoint_step,
                     init_state=init_state, stop=stop, profile_steps=profile, run=run)
  print(train.summary_line(result, FLAGS.workdir))
  if shapes_run and FLAGS.caption_eval_images > 0 and not result.get("interrupted"):
    from k3_jax.data import tokenizers
    from k3_jax.captions import caption_eval
    caption_eval(FLAGS.workdir, tokenizers.get_tokenizer(tc.tokenizer),
                 FLAGS.caption_eval_images, seed=tc.seed)


def cmd_generate() -> None:
  from k3_jax.config import UserError
  from k3_jax.serve import generate as gen
  from k3_jax.serve import loader
  if not FLAGS.prompt and not FLAGS.prompt_ids and not FLAGS.image:
    raise UserError("--prompt is empty: give the text to continue, e.g. --prompt=\"def \" "
                    "(or token ids with --prompt_ids=1,2,3)")
  if FLAGS.max_new_tokens <= 0:
    raise UserError(f"--max_new_tokens={FLAGS.max_new_tokens}: must be positive")
  if FLAGS.image and FLAGS.prompt_ids:
    raise UserError("--image puts the images before the --prompt text; it cannot be combined "
                    "with --prompt_ids")
  _check_sampling()
  _check_checkpoint_step()
  if FLAGS.prompt_ids:
    gen.parse_token_ids(FLAGS.prompt_ids)     # a UserError naming it, before the load
  _check_tokenizer(FLAGS.tokenizer)
  if FLAGS.hf_dir:                    # released weights, read straight into place
    restored = loader.restore_from_hf(FLAGS.hf_dir, _expert_format(), FLAGS.tokenizer)
  else:
    restored = loader.restore_for_inference(FLAGS.workdir, _expert_format(), FLAGS.tokenizer,
                                            step=FLAGS.checkpoint_step,
                                            log=lambda m: print(m, file=sys.stderr))
  sampling = dict(temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed or 0,
                  frequency_penalty=FLAGS.frequency_penalty,
                  presence_penalty=FLAGS.presence_penalty)
  if FLAGS.prompt_ids or FLAGS.json:
    ids, images = ((gen.parse_token_ids(FLAGS.prompt_ids), None) if FLAGS.prompt_ids
                   else gen.prompt_ids(restored, FLAGS.prompt, FLAGS.image))
    out = list(gen.generate_ids(restored, ids, FLAGS.max_new_tokens, **sampling,
                                token_ids_given=bool(FLAGS.prompt_ids), images=images))
    if FLAGS.json:
      print(json.dumps({"prompt_ids": list(ids), "token_ids": out,
                        "text": gen.decode_or_none(restored.tokenizer, out)}))
    else:
      print(" ".join(map(str, out)))
    return
  pieces = gen.stream_completion(restored, FLAGS.prompt, FLAGS.max_new_tokens, **sampling,
                                 image_paths=FLAGS.image)
  sys.stdout.write(FLAGS.prompt)
  sys.stdout.flush()
  for piece in pieces:
    sys.stdout.write(piece)
    sys.stdout.flush()
  sys.stdout.write("\n")


def cmd_info() -> None:
  cfg = _model_config()
  if FLAGS.param_groups:
    _print_param_groups(cfg)
    return
  from k3_jax.info import model_summary
  out = model_summary(cfg, serving_bytes=FLAGS.serving_bytes, vision_cfg=_vision_model_config())
  if FLAGS.json:
    print(json.dumps(out))
    return
  print(f"config        {cfg.name}")
  print(f"layers        {cfg.num_layers}: {out['kda_layers']} KDA, {len(out['mla_layers'])} MLA "
        f"(MLA at {', '.join(map(str, out['mla_layers']))})")
  print(f"pattern       {out['layer_pattern']}   (K = KDA, M = MLA, d = dense FFN; others MoE)")
  scan = out["scan"]
  print(f"scan          {scan['unscanned_prefix']} unscanned + {scan['repeats']} x "
        f"{scan['period']} scanned + {scan['unscanned_suffix']} unscanned")
  print(f"total params  {_human(out['total_params'])} ({out['total_params']:,})")
  print(f"active params {_human(out['active_params'])} ({out['active_params']:,}) per token")
  print(f"routed expert params {_human(out['routed_expert_params'])}")
  for k, v in out["by_module"].items():
    print(f"  {k:<12} {_human(v)}")
  if "vision_params" in out:
    print(f"vision params {_human(out['vision_params'])} ({out['vision_params']:,}), not in "
          f"the totals above: " + ", ".join(f"{k} {_human(v)}"
                                            for k, v in out["vision_by_module"].items()))
  if "serving_mxfp4" in out:
    sb = out["serving_mxfp4"]
    print(f"serving bytes {_bytes(sb['total_bytes'])} ({sb['total_bytes']:,}): routed experts "
          f"MXFP4 ({sb['bits_per_routed_weight']:.2f} bits/weight), the rest BF16; all-BF16 "
          f"{_bytes(sb['bf16_total_bytes'])}")
    for k, v in sb["by_part"].items():
      print(f"  {k:<14} {_bytes(v)}")


def _print_param_groups(cfg) -> None:
  import math
  from k3_jax.info import optimizer_groups
  from k3_jax.optim.muon import GROUPS
  tc = _train_config(cfg)
  rows = optimizer_groups(_vision_model_config() or cfg, tc.optimizer)   # with any tower
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


def cmd_compile() -> None:
  """Ahead-of-time compile one step for a TPU target and report per-chip memory."""
  import configs
  from k3_jax.compile import SHAPE_FLAGS, apply_pod_layout, compile_step, pod_layout
  from k3_jax.config import ConfigError
  from pod import aot
  from pod.topology import resolve_target
  if not FLAGS.topology:
    raise ConfigError("compile needs --topology, e.g. --topology=v5p-128 or v5p:4x4x4")
  for name in ("global_batch", "cache_len"):
    if getattr(FLAGS, name) is not None and getattr(FLAGS, name) < 1:
      raise ConfigError(f"--{name}={getattr(FLAGS, name)}: must be positive")
  aot.limit_malloc_arenas()        # less host memory for the TPU compiler's threads
  target = resolve_target(FLAGS.topology, 1 if FLAGS.num_slices is None else FLAGS.num_slices)
  cfg = _model_config()
  # The preset's recommended layout for this target and step fills every flag not given.
  layout = pod_layout(configs.get_pod_layouts(FLAGS.config), target, FLAGS.step)
  given = {n: getattr(FLAGS, n) if FLAGS[n].present else None for n in SHAPE_FLAGS}
  if given["expert_format"] is not None:
    given["expert_format"] = _expert_format()
  kw = apply_pod_layout(layout, _preset_exec(), {**given, **_exec_given()})
  tc = _train_config(cfg, check=False)
  if FLAGS.sweep:
    _compile_sweep(cfg, tc, target, kw)
    return
  if FLAGS.step in ("decode", "verify"):
    kw["page_split"] = FLAGS.page_split
  if FLAGS.step == "verify":
    kw["draft_tokens"] = FLAGS.num_speculative_tokens
  rep = compile_step(cfg, tc, target, FLAGS.step, **kw)
  rep["pod_layout"] = (None if layout is None
                       else f"{FLAGS.config}: {layout.topology} {layout.step}")
  if FLAGS.json:
    print(json.dumps(rep))
    return
  print(_compile_header(cfg.name, target, rep, layout is not None))
  print(aot.format_report(rep))
  if rep["step"] == "init":
    from k3_jax.compile import init_lines
    print(init_lines(rep))
  elif rep["step"] == "decode":
    from k3_jax.compile import decode_lines
    print(decode_lines(rep))
  elif rep["step"] == "train":
    from k3_jax.compile import train_lines
    print(train_lines(rep))


def _compile_sweep(cfg, tc, target, kw: dict) -> None:
  """compile --sweep: every point of the grid, then the table, the frontier and the plot."""
  from k3_jax import frontier
  grid = frontier.parse_sweep(FLAGS.sweep)
  log = (lambda line: print(line, file=sys.stderr)) if FLAGS.json else print
  pts = frontier.run_sweep(cfg, tc, target, FLAGS.step, kw, grid, FLAGS.sweep_out,
                           FLAGS.page_split, log=log)
  if FLAGS.sweep_plot:
    frontier.plot(pts, FLAGS.sweep_plot, f"{cfg.name} {FLAGS.step} on {target.name} "
                  f"({target.chips} chips), compile's roofline")
  if FLAGS.json:
    print(json.dumps({"points": pts, "frontier": frontier.frontier(pts)}))
    return
  print(frontier.markdown_table(pts))


def _compile_header(name: str, target, rep: dict, from_layout: bool) -> str:
  """compile's first line: each thing once (the model, the step, the target, the mesh in
  --mesh syntax, the shapes, and whether the preset's pod layout filled flags)."""
  topo = target.topology + (f" x {target.num_slices} slices" if target.num_slices > 1 else "")
  mesh = ",".join(f"{k}:{v}" for k, v in rep["mesh"].items() if v != 1) or "single device"
  what = (f"sharded init (parameters + {rep['optimizer']} optimizer state)"
          if rep["step"] == "init" else f"{rep['step']} step")
  parts = [f"mesh {mesh}"]
  if rep["step"] != "init":
    parts.append(f"batch {rep['global_batch']} x {rep['seq_len']} tokens")
    if rep.get("cache_len"):
      parts.append(f"cache {rep['cache_len']}")
    if rep.get("remat"):
      parts.append(f"remat {rep['remat']}")
  if from_layout:
    parts.append("the preset's pod layout filled the flags not given")
  return f"{name} {what} on {target.name} ({topo}, {target.chips} chips): {', '.join(parts)}"


def cmd_convert() -> None:
  """Orbax workdir <-> Hugging Face safetensors (k3_jax/checkpoint/convert.py)."""
  from k3_jax.checkpoint import convert
  src, dst = FLAGS["from"].value, FLAGS["to"].value
  _check_checkpoint_step()
  # a preset's plan is the release's inventory: with the preset's vision tower when it has
  # one (as `info` reports it), the text model alone otherwise
  cfg = (_vision_model_config() or _model_config()) if (FLAGS.dry_run and not src) else None
  out = convert.run(src, dst, cfg=cfg, step=FLAGS.checkpoint_step,
                    max_shard_size=FLAGS.max_shard_size, dry_run=FLAGS.dry_run,
                    force=FLAGS.force, expert_format=FLAGS.expert_format,
                    log=lambda m: print(f"note: {m}", file=sys.stderr))
  if FLAGS.json:
    print(json.dumps(out))
    return
  if out.get("dry_run") and out["direction"] == "export":
    for t in out["tensors"]:
      print(f"{t['name']:<72} {t['dtype']:<5} {str(t['shape']):<18} {t['file']}")
    print(f"{out['num_tensors']} tensors, {out['total_bytes'] / 1e9:.3f} GB in "
          f"{out['num_shards']} shards ({out['layout']} layout)")
  elif out["direction"] == "export":
    print(f"wrote {out['num_tensors']} tensors ({out['total_bytes'] / 1e9:.3f} GB, "
          f"{out['num_shards']} shards, {out['layout']}) of step {out['step']} to "
          f"{out['out_dir']} in {out['seconds']:.1f}s ({out['gb_per_s']:.3f} GB/s)")
  elif out.get("dry_run"):
    print(f"{src}: {out['num_tensors']} tensors, all present with the expected shapes")
  else:
    print(f"imported {src} into {out['workdir']} (step 0, fresh optimizer state) in "
          f"{out['seconds']:.1f}s")


def cmd_serve() -> None:
  """The OpenAI-compatible server over the batched engine (k3_jax/serve/)."""
  from k3_jax.serve.loader import ServeOptions, run_server
  serve = ServeConfig(**{n: getattr(FLAGS, n) for n in SERVE_CONFIG_FLAGS})
  _check_tokenizer(FLAGS.tokenizer)
  run_given = _exec_given()                      # over the checkpoint's (or preset's) own
  ExecConfig().given(**run_given)                # each value's check, before the model loads
  if run_given.get("mesh"):
    from sharding.mesh import parse_mesh
    parse_mesh(run_given["mesh"])                # its syntax; the devices when it is built
  from pod.distributed import maybe_initialize
  _check_multihost_flags()
  maybe_initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  import jax
  if jax.process_index() == 0:                   # the one process that listens
    _check_listen(serve.host, serve.port)        # before the model loads (seconds, GBs)
  run_server(ServeOptions(
      workdir=None if (FLAGS.random_weights or FLAGS.hf_dir) else FLAGS.workdir,
      hf_dir=FLAGS.hf_dir, config=FLAGS.config if FLAGS.random_weights else None,
      overrides=tuple(FLAGS.override), seed=FLAGS.seed or 0, tokenizer=FLAGS.tokenizer,
      expert_format=_expert_format(), serve=serve, run_given=tuple(run_given.items()),
      model_name=FLAGS.served_model_name))


def cmd_prepare() -> None:
  """Tokenize --input into --format shards under --output (k3_jax/data/prepare.py)."""
  from k3_jax.config import UserError
  from k3_jax.data.prepare import prepare
  if not FLAGS.input or not FLAGS.output:
    raise UserError("prepare needs --input=CORPUS and --output=DIR")
  m = prepare(FLAGS.input, FLAGS.output, tokenizer=FLAGS.tokenizer or "byte",
              fmt=FLAGS.format, num_shards=FLAGS.num_shards, force=FLAGS.force)
  if FLAGS.json:
    print(json.dumps(m))
    return
  print(f"wrote {m['documents']:,} documents, {m['tokens']:,} tokens in {m['num_shards']} "
        f"{m['format']} train shards{' + eval' if 'eval' in m['splits'] else ''} to "
        f"{FLAGS.output} in {m['seconds']:.1f}s (tokenizer {m['tokenizer']['spec']}, "
        f"fingerprint {m['tokenizer']['fingerprint']}); train with --dataset={FLAGS.output}")


@dataclasses.dataclass(frozen=True)
class Command:
  run: Callable[[], None]
  help: str
  flags: tuple[str, ...]


COMMANDS: dict[str, Command] = {
    "train": Command(cmd_train, "train --config for --steps, resuming from the latest "
                     "checkpoint in --workdir",
                     (*MODEL_FLAGS, "workdir", *TRAIN_CONFIG_FLAGS, *EXEC_CONFIG_FLAGS,
                      "num_slices", "max_bad_steps", "checkpoint_step", "init_from",
                      "caption_eval_images", "profile_steps", *MULTIHOST_FLAGS)),
    "generate": Command(cmd_generate, "load the latest checkpoint in --workdir and stream a "
                        "completion of --prompt",
                        ("workdir", "prompt", "max_new_tokens", "temperature", "top_p", "seed",
                         "frequency_penalty", "presence_penalty", "tokenizer",
                         "expert_format", "checkpoint_step", "prompt_ids", "json", "hf_dir",
                         "image")),
    "info": Command(cmd_info, "layer plan and parameter counts (abstract, nothing allocated)",
                    (*MODEL_FLAGS, "json", "serving_bytes", "param_groups", "optimizer")),
    "compile": Command(cmd_compile, "ahead-of-time compile the train / prefill / decode / "
                       "verify step for a TPU target and report per-chip memory",
                       (*MODEL_FLAGS, "topology", "num_slices", "step", *EXEC_CONFIG_FLAGS,
                        "global_batch", "seq_len", "cache_len", "expert_format", "json",
                        "num_speculative_tokens", "batch_size", "optimizer")),
    "convert": Command(cmd_convert, "convert an Orbax workdir to Hugging Face safetensors or "
                       "back (the direction from what --from holds)",
                       (*MODEL_FLAGS, "from", "to", "checkpoint_step", "max_shard_size",
                        "dry_run", "force", "expert_format", "json")),
    "prepare": Command(cmd_prepare, "tokenize a text corpus into ArrayRecord / Parquet shards "
                       "with a manifest, for train --dataset=DIR",
                       ("input", "output", "tokenizer", "format", "num_shards", "force", "json")),
    "serve": Command(cmd_serve, "serve --workdir's model (or --hf_dir's) behind an "
                     "OpenAI-compatible HTTP API with continuous batching and a prefix cache",
                     ("workdir", "hf_dir", "random_weights", *MODEL_FLAGS, "seed", "tokenizer",
                      "expert_format", *SERVE_EXEC_FLAGS, *SERVE_CONFIG_FLAGS, "served_model_name",
                      *MULTIHOST_FLAGS)),
}
_OUR_FLAGS = {name for cmd in COMMANDS.values() for name in cmd.flags}


def command_help(name: str) -> str:
  """The help text of one command: what it does and each of its flags with its default."""
  cmd = COMMANDS[name]
  lines = [f"python main.py {name} [flags]: {cmd.help}", "", "flags:"]
  for f in cmd.flags:
    fl = FLAGS[f]
    default = "" if fl.default in (None, [], "") else f" (default: {fl.default_as_str})"
    lines.append(f"  --{f}: {fl.help}{default}")
  return "\n".join(lines)


def usage() -> str:
  width = max(map(len, COMMANDS))
  return "\n".join(["usage: python main.py <command> [--flag=value ...]", "", "commands:",
                    *(f"  {n:<{width}}  {c.help}" for n, c in COMMANDS.items()), "",
                    "python main.py <command> --help lists the command's flags."])


def _check_flags(command: str) -> None:
  """Refuse flags given that the command does not read (they would be silently ignored)."""
  foreign = sorted(n for n in _OUR_FLAGS - set(COMMANDS[command].flags) if FLAGS[n].present)
  if foreign:
    _usage_error(f"{', '.join('--' + n for n in foreign)}: not a flag of `{command}`",
                 command)


def _usage_error(message: str, command: str | None = None) -> None:
  print(f"error: {message}\n\n{command_help(command) if command else usage()}",
        file=sys.stderr)
  sys.exit(2)


def main(argv) -> None:
  from absl import logging
  from k3_jax.config import UserError
  logging.set_verbosity(logging.WARNING)   # Orbax logs every save step at INFO
  if len(argv) < 2 or argv[1] not in COMMANDS:
    got = argv[1] if len(argv) > 1 else "nothing"
    _usage_error(f"expected a command, one of {', '.join(COMMANDS)}; got {got}")
  if len(argv) > 2:
    _usage_error(f"unexpected arguments {argv[2:]}: flags take the form --name=value", argv[1])
  _check_flags(argv[1])
  from k3_jax.faults import Diverged
  try:
    COMMANDS[argv[1]].run()
  except (UserError, FileNotFoundError, FileExistsError) as e:   # config, input, checkpoint
    # mismatch and refused-overwrite errors
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except Diverged as e:             # a clear stop; the last finite checkpoint is kept
    print(f"error: {e}", file=sys.stderr)
    sys.exit(3)
  except KeyboardInterrupt:         # Ctrl-C outside the training loop's handler
    print("interrupted before training started (or after it ended); nothing was saved",
          file=sys.stderr)
    sys.exit(130)


def _parse(argv):
  """absl flag parsing, with `--help` per command (absl's --helpfull lists every flag)."""
  if any(a in ("--help", "-h", "--helpshort", "-?") for a in argv[1:]):
    cmd = next((a for a in argv[1:] if a in COMMANDS), None)
    print(command_help(cmd) if cmd else usage())
    sys.exit(0)
  try:
    return FLAGS(argv)
  except flags.Error as e:          # e.g. a mistyped flag: one line, exit 2
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def run() -> None:
  """Entry point (the `k3` console script)."""
  app.run(main, flags_parser=_parse)


if __name__ == "__main__":
  run()
