"""The one loader of a model to serve or generate from: weights (a training workdir's newest
good checkpoint, a Hugging Face directory, or a freshly initialised preset for smoke
tests), each read straight into its shard of the mesh, the routed experts packed to MXFP4
when asked, the tokenizer, and the engine over them.

    build_engine / run_server     `serve`: any mesh, multi-host (relay.py), the HTTP app
    restore_for_inference / restore_from_hf   `generate`: one device, one stream (Restored;
                                  serve/generate.py turns its prompts into text)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import jax

from k3_jax.config import (EXPERT_FORMATS, SINGLE_STREAM, ModelConfig, ServeConfig, UserError,
                           apply_overrides, validate)
from k3_jax.execution import ExecConfig, apply_run_overrides, split_overrides

if TYPE_CHECKING:
  from k3_jax.data.tokenizers import Tokenizer
  from k3_jax.serve.engine import Engine


@dataclasses.dataclass(frozen=True)
class ServeOptions:
  workdir: str | None = None          # training workdir: its config and newest good checkpoint
  hf_dir: str | None = None           # or a Hugging Face directory (config.json + safetensors)
  config: str | None = None           # or a preset with random weights (smoke tests only)
  overrides: tuple[str, ...] = ()
  vision: bool = False                # with `config`: attach the preset's vision tower
  seed: int = 0
  tokenizer: str | None = None        # default: the workdir's (train_config.json), else byte
  expert_format: str = "dense"        # "mxfp4": routed experts packed to MXFP4
  serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)   # engine and address
  # the execution settings given ((ExecConfig field, value) pairs, e.g. ("mesh", "expert:4"),
  # default one device), over the source's own (`execution`)
  run_given: tuple[tuple[str, object], ...] = ()
  model_name: str | None = None       # the id /v1/models reports (default: the config name)


def _one_device():
  from sharding.mesh import make_mesh
  return make_mesh(devices=jax.devices()[:1])


def load_checkpoint(workdir: str, step: int | None = None, mesh=None,
                    log: Callable[[str], None] = print):
  """(cfg, graphdef, params, rest) of the newest good checkpoint (or `step`) of a training
  workdir: parameters and balancing biases only, never the optimizer state; each read
  straight into its shard of `mesh` (default: one device). A damaged or non-finite newer
  checkpoint is reported through `log` in one line and skipped
  (k3_jax.checkpoint.inference)."""
  return _checkpoint(workdir, step, mesh, log)[:4]


def _checkpoint(workdir: str, step: int | None, mesh, log):
  """load_checkpoint's tuple and the checkpoint's training step."""
  from k3_jax.checkpoint.inference import load_for_inference
  loaded = load_for_inference(workdir, mesh or _one_device(), step, log)
  return loaded.cfg, loaded.graphdef, loaded.params, loaded.rest, loaded.step


def load_hf(hf_dir: str, mesh=None):
  """(cfg, graphdef, params, rest) of a Hugging Face directory, read slice by slice into the
  shards of `mesh` (default: one device): each host reads its own devices' slices only."""
  from flax import nnx
  from k3_jax.checkpoint.sharded_load import load_model_sharded
  cfg, model = load_model_sharded(hf_dir, mesh or _one_device())
  return (cfg, *nnx.split(model, nnx.Param, ...))


def random_weights(config: str, overrides=(), seed: int = 0, vision: bool = False):
  """(cfg, graphdef, params, rest) of a freshly initialised preset (with its vision tower
  when `vision`)."""
  import configs
  from flax import nnx
  from k3_jax.model import create_model
  base = configs.get_multimodal(config) if vision else configs.get(config)
  cfg: ModelConfig = validate(apply_overrides(base, split_overrides(overrides)[0]))
  return (cfg, *nnx.split(create_model(cfg, seed=seed), nnx.Param, ...))


def check_expert_format(expert_format: str) -> None:
  if expert_format not in EXPERT_FORMATS:
    raise UserError(f"expert_format={expert_format!r}: expected one of "
                    f"{', '.join(EXPERT_FORMATS)}")


def packed(graphdef, params, rest, expert_format: str):
  """(graphdef, params, rest) as served: "mxfp4" packs the routed experts to MXFP4
  (serve/pack.py; the MoE then runs the QAT forward's computation), "dense" keeps them."""
  check_expert_format(expert_format)
  if expert_format == "mxfp4":
    from k3_jax.serve.pack import pack_state
    return pack_state(graphdef, params, rest)
  return graphdef, params, rest


def hf_tokenizer_spec(hf_dir: str) -> str:
  """A Hugging Face directory's own tokenizer (tiktoken.model or tokenizer.json), else byte."""
  from k3_jax.data.tokenizers import has_tokenizer
  return hf_dir if has_tokenizer(hf_dir) else "byte"


def load_checked_tokenizer(spec: str, vocab_size: int, check_byte: bool = True):
  """The tokenizer `spec` names, refused in one line (UserError) when the model's vocabulary
  and it disagree (tokenizers.check_covers). The byte tokenizer is only checked for ids past
  the model's vocabulary (ids it has no byte for decode to placeholders), and not at all
  without check_byte (generate: prompts given as ids, output shown as ids)."""
  from k3_jax.data import tokenizers
  try:
    tok = tokenizers.get_tokenizer(spec)
  except (OSError, ValueError) as e:
    raise UserError(f"tokenizer {spec!r}: {e}") from None
  if spec == "byte" and not check_byte:
    return tok
  try:
    tokenizers.check_covers(tok, vocab_size)
  except ValueError as e:
    if spec != "byte" or tok.vocab_size > vocab_size:
      raise UserError(str(e)) from None
  return tok


def execution(opts: ServeOptions) -> ExecConfig:
  """How the served model runs: the source's own settings (a preset's, with any --override
  of a moved field, for random weights; those an old checkpoint's model config held; else
  the defaults), then those given (opts.run_given)."""
  if opts.config is not None:
    import configs
    base = apply_run_overrides(configs.get_exec(opts.config), split_overrides(opts.overrides)[1])
  elif opts.workdir is not None:
    from k3_jax.checkpoint.manager import saved_execution
    base = ExecConfig(**saved_execution(opts.workdir))
  else:
    base = ExecConfig()
  return base.given(**dict(opts.run_given))


def build_engine(opts: ServeOptions, relay=None):
  """(engine, tokenizer, model name) for the options. relay: this process's step relay in a
  multi-host job (relay.py), which needs a mesh over every host's devices."""
  from k3_jax.checkpoint.inference import trained_tokenizer
  from k3_jax.data import tokenizers
  from k3_jax.serve.engine import Engine
  from k3_jax.serve.host_heap import keep_freed_buffers
  sources = [x for x in (opts.workdir, opts.hf_dir, opts.config) if x is not None]
  if len(sources) != 1:
    raise UserError("give exactly one of --workdir (a trained checkpoint), --hf_dir (a Hugging "
                    "Face directory) or --random_weights with --config (smoke tests)")
  run = execution(opts)
  mesh = None
  if run.mesh:
    from sharding.mesh import make_mesh, parse_mesh
    mesh = make_mesh(parse_mesh(run.mesh))
  elif jax.process_count() > 1:
    raise UserError(f"multi-host serving needs --mesh over all {jax.device_count()} devices of "
                    f"the {jax.process_count()} processes (e.g. --mesh=expert:-1)")
  if opts.workdir is not None:
    cfg, graphdef, params, rest = load_checkpoint(opts.workdir, mesh=mesh)
    tok_spec = trained_tokenizer(opts.workdir, opts.tokenizer)
  elif opts.hf_dir is not None:
    cfg, graphdef, params, rest = load_hf(opts.hf_dir, mesh)
    tok_spec = opts.tokenizer or hf_tokenizer_spec(opts.hf_dir)
  else:
    cfg, graphdef, params, rest = random_weights(opts.config, opts.overrides, opts.seed,
                                                 opts.vision)
    tok_spec = opts.tokenizer or "byte"
  graphdef, params, rest = packed(graphdef, params, rest, opts.expert_format)
  tok = load_checked_tokenizer(tok_spec, cfg.vocab_size)
  if jax.default_backend() == "cpu":
    keep_freed_buffers()              # each step's buffers reused, not page-faulted in again
  engine = Engine(cfg, graphdef, params, rest, opts.serve, tokenizer=tok, mesh=mesh,
                  relay=relay, kernels=run.kernels)
  return engine, tok, opts.model_name or cfg.name


@dataclasses.dataclass
class Restored:
  """A model restored for `generate`: one device, one stream (config.SINGLE_STREAM)."""
  cfg: ModelConfig
  engine: Engine
  tokenizer: Tokenizer
  step: int                          # the checkpoint's training step (0: not trained here)


def restore_for_inference(workdir: str, expert_format: str = "dense",
                          tokenizer: str | None = None, step: int | None = None,
                          log: Callable[[str], None] = print) -> Restored:
  """A good checkpoint of `workdir` (the newest, or `step`; load_checkpoint) on one device,
  its experts as `expert_format` says (packed), ready to generate. tokenizer defaults to the
  one the run trained with (train_config.json), else the byte tokenizer."""
  from k3_jax.checkpoint.inference import trained_tokenizer
  from k3_jax.data import tokenizers
  check_expert_format(expert_format)               # refused before the read
  tok = tokenizers.get_tokenizer(trained_tokenizer(workdir, tokenizer))
  cfg, graphdef, params, rest, good = _checkpoint(workdir, step, None, log)
  run = execution(ServeOptions(workdir=workdir))
  return _restored(cfg, packed(graphdef, params, rest, expert_format), tok, good, run)


def restore_from_hf(hf_dir: str, expert_format: str = "dense",
                    tokenizer: str | None = None) -> Restored:
  """A Hugging Face directory's model (config.json + safetensors) on one device (load_hf),
  ready to generate; the directory's own tokenizer (tiktoken.model or tokenizer.json), else
  byte, unless `tokenizer` names another."""
  check_expert_format(expert_format)
  cfg, graphdef, params, rest = load_hf(hf_dir)
  tok = load_checked_tokenizer(tokenizer or hf_tokenizer_spec(hf_dir), cfg.vocab_size,
                               check_byte=False)
  return _restored(cfg, packed(graphdef, params, rest, expert_format), tok, 0)


def _restored(cfg: ModelConfig, state, tok, step: int,
              run: ExecConfig = ExecConfig()) -> Restored:
  from k3_jax.serve.engine import Engine
  return Restored(cfg, Engine(cfg, *state, SINGLE_STREAM, kernels=run.kernels), tok, step)


def run_server(opts: ServeOptions) -> None:
  """Builds the engine and serves the OpenAI-compatible API until interrupted. In a
  multi-host job (jax.distributed initialised, more than one process) every process builds
  the engine over the global mesh; process 0 serves HTTP once every process is ready, the
  others replay its steps (relay.py) until it stops."""
  from k3_jax.serve import relay as rl
  from k3_jax.serve.server import build_app, serve
  host, port = opts.serve.host, opts.serve.port
  relay = rl.start(opts.serve.peer_timeout)
  if relay is not None and not relay.leader:
    build_engine(opts, relay)
    relay.group.ready()
    print(f"process {jax.process_index()} of {jax.process_count()}: engine ready, replaying "
          "process 0's steps", flush=True)
    status = relay.follow()
    relay.group.stop()
    raise SystemExit(status)
  if host not in ("127.0.0.1", "localhost", "::1"):
    print(f"warning: serving on {host}: the API has no authentication", flush=True)
  engine, tok, name = build_engine(opts, relay)
  if relay is not None:
    relay.group.ready()
    relay.group.wait_ready(lambda m: print(m, flush=True))
  if opts.serve.warmup and relay is not None:
    print("warm-up: skipped in a multi-host job (each shape compiles on first use)", flush=True)
  elif opts.serve.warmup:
    from k3_jax.serve.warmup import warm_up
    print(f"warming up: compiling the steps of 1 to {engine.max_batch} requests at once "
          "(--nowarmup skips it)", flush=True)
    shapes, seconds = warm_up(engine)
    print(f"warm-up: {shapes} step shapes compiled in {seconds:.1f} s", flush=True)
  app = build_app(engine, tok, name)
  hosts = "" if relay is None else f" across {jax.process_count()} processes"
  print(f"serving {name} on http://{host}:{port}/v1 ({engine.max_batch} slots, "
        f"context {engine.max_len}{hosts})", flush=True)
  print(engine.pool_summary, flush=True)
  if relay is None:
    serve(app, host, port)
    return
  status = 0
  try:
    serve(app, host, port)
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else 1
    if status:
      relay.group.settle()        # a lost peer (the likely cause) is named before we go
    raise
  finally:
    try:
      relay.stop(status)
    except Exception as e:          # the coordinator may be gone with the peers
      print(f"could not stop the other processes: {type(e).__name__}: {e}", flush=True)
    relay.group.stop()


__all__ = ["ServeOptions", "load_checkpoint", "load_hf", "random_weights", "check_expert_format", "packed",
           "hf_tokenizer_spec", "load_checked_tokenizer", "build_engine", "Restored",
           "restore_for_inference", "restore_from_hf", "run_server"]
