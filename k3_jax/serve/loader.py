"""What a `serve` process starts from: weights (a training workdir's latest checkpoint, or a
freshly initialised preset for smoke tests), the tokenizer, the engine, and the app."""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from k3_jax.config import ModelConfig, apply_overrides, validate


@dataclasses.dataclass(frozen=True)
class ServeOptions:
  workdir: str | None = None          # training workdir: its config and latest checkpoint
  config: str | None = None           # or a preset with random weights (smoke tests only)
  overrides: tuple[str, ...] = ()
  seed: int = 0
  tokenizer: str = "byte"
  quant: str = "none"                 # "mxfp4": routed experts packed to MXFP4
  max_batch: int = 8
  max_len: int | None = None          # tokens per sequence (default the model's max_seq_len)
  prefill_chunk: int = 512
  prefix_cache_bytes: int = 1 << 30
  max_queue: int = 64
  mesh: str = ""                      # e.g. "expert:4" (default: one device)
  model_name: str | None = None       # the id /v1/models reports (default: the config name)
  host: str = "127.0.0.1"
  port: int = 8000


def load_checkpoint(workdir: str):
  """(cfg, graphdef, params, rest) of the latest checkpoint in a training workdir."""
  from k3_jax import train
  from k3_jax.checkpoint.manager import CheckpointManager, saved_config
  from k3_jax.config import TrainConfig
  from sharding.mesh import make_mesh

  cfg = saved_config(workdir)
  if cfg is None:
    raise FileNotFoundError(f"no checkpoints in {workdir}: train first "
                            f"(python main.py train --workdir={workdir})")
  tc = TrainConfig()
  saved_tc = os.path.join(workdir, "train_config.json")
  if os.path.exists(saved_tc):       # the optimizer decides the shape of the saved state
    with open(saved_tc) as f:
      tc = TrainConfig(optimizer=json.load(f).get("optimizer", tc.optimizer))
  ckpt = CheckpointManager(workdir, cfg)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"{workdir} has a config but no completed checkpoint")
  steps = train.build_steps(cfg, tc, make_mesh(devices=jax.devices()[:1]))
  state, _ = ckpt.restore(steps.abstract_state, steps.state_shardings)
  return cfg, steps.graphdef, state["params"], state["rest"]


def random_weights(config: str, overrides=(), seed: int = 0):
  """(cfg, graphdef, params, rest) of a freshly initialised preset."""
  import configs
  from flax import nnx
  from k3_jax.model import create_model
  cfg: ModelConfig = validate(apply_overrides(configs.get(config), list(overrides)))
  return (cfg, *nnx.split(create_model(cfg, seed=seed), nnx.Param, ...))


def build_engine(opts: ServeOptions):
  """(engine, tokenizer, model name) for the options."""
  from k3_jax.data import tokenizers
  from k3_jax.serve.engine import Engine
  if (opts.workdir is None) == (opts.config is None):
    raise ValueError("give exactly one of --workdir (a trained checkpoint) or --config "
                     "(random weights, for smoke tests)")
  if opts.workdir is not None:
    cfg, graphdef, params, rest = load_checkpoint(opts.workdir)
  else:
    cfg, graphdef, params, rest = random_weights(opts.config, opts.overrides, opts.seed)
  if opts.quant == "mxfp4":
    from k3_jax.quant import pack_state
    graphdef, params, rest = pack_state(graphdef, params, rest)
  tok = tokenizers.get_tokenizer(opts.tokenizer)
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(f"tokenizer vocabulary {tok.vocab_size} exceeds the model's "
                     f"vocab_size={cfg.vocab_size}")
  mesh = None
  if opts.mesh:
    from sharding.mesh import make_mesh, parse_mesh
    mesh = make_mesh(parse_mesh(opts.mesh))
  engine = Engine(cfg, graphdef, params, rest, max_batch=opts.max_batch, max_len=opts.max_len,
                  prefill_chunk=opts.prefill_chunk, prefix_cache_bytes=opts.prefix_cache_bytes,
                  max_queue=opts.max_queue, tokenizer=tok, mesh=mesh)
  return engine, tok, opts.model_name or cfg.name


def run_server(opts: ServeOptions) -> None:
  """Builds the engine and serves the OpenAI-compatible API until interrupted."""
  from k3_jax.serve.server import build_app, serve
  if opts.host not in ("127.0.0.1", "localhost", "::1"):
    print(f"warning: serving on {opts.host}: the API has no authentication", flush=True)
  engine, tok, name = build_engine(opts)
  app = build_app(engine, tok, name)
  print(f"serving {name} on http://{opts.host}:{opts.port}/v1 ({opts.max_batch} slots, "
        f"context {engine.max_len})", flush=True)
  serve(app, opts.host, opts.port)


__all__ = ["ServeOptions", "load_checkpoint", "random_weights", "build_engine", "run_server"]
