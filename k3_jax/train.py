"""Training: state, the jit-compiled train and eval steps, and the loop.

The state is a plain pytree {'step', 'params', 'rest', 'opt_state'}: `params` are the nnx
Params (what the optimizer updates), `rest` every other variable (e.g. the MoE balancing
bias), both as nnx States that carry their logical axes. The steps are pure functions of
(state, batch), jit-compiled once with explicit shardings and a donated state. The optimizer
and how a fresh or abstract state is made are in train_state.py (checkpoint/ builds states
too and never imports this module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from k3_jax import faults, goodput, profiling
from k3_jax.config import ModelConfig, TrainConfig, validate, validate_train
from k3_jax.execution import ExecConfig, check_batch
from k3_jax.model import create_model
from k3_jax.ops.balance import load_stats
from k3_jax.optim.qk_clip import qk_clip
from k3_jax.partitioning import SINGLE, Parallel
from k3_jax.stack import plan_of
from k3_jax.train_state import (abstract_state, init_state, lr_schedule, make_optimizer,
                                split_model)
from sharding.arrays import all_finite, tree_bytes
from sharding.install import parallel_for
from sharding.rules import logical_to_spec, tree_shardings

BATCH_KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


# ----- state ----------------------------------------------------------------------

def lr_metrics(tc: TrainConfig, step) -> dict:
  """The learning rates applied at `step` (0-based): lr_adamw always (the whole model under
  adamw, the non-matrix parameters under muon), lr_muon under muon (the matrices)."""
  out = {"lr_adamw": lr_schedule(tc)(step)}
  if tc.optimizer == "muon":
    out["lr_muon"] = lr_schedule(tc, tc.muon_lr)(step)
  return out


def sharded_init(cfg: ModelConfig, tc: TrainConfig, optimizer, state_shardings):
  """The sharded initialisation: one jitted program, seed (int32 scalar) -> train state,
  whose outputs are laid out by `state_shardings` (out_shardings). Every parameter is drawn
  inside the program (layers/init.py "jax" mode; stacked layers as one vmapped draw) from
  the counters of its elements, so each device computes its own shard: no full array exists
  on any host or device, and the values do not depend on the mesh. They are bit for bit
  those of the host init (Steps.init).
  The optimizer state is created in the same program.

  On CPU devices the program is compiled at XLA's lowest backend optimisation level: it
  runs once, and LLVM otherwise spends most of its compile time on the threefry loops
  (3x longer; 40 s against 13 s for a 2-layer k3_tiny here)."""
  def init(seed):
    return init_state(cfg, tc, optimizer, mode="jax", seed=seed)[1]
  mesh = jax.tree.leaves(state_shardings)[0].mesh
  cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
  return jax.jit(init, out_shardings=state_shardings,
                 compiler_options={"xla_backend_optimization_level": 0} if cpu else None)


def host_memory_bytes() -> int:
  """Physical memory of this host."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def init_mode(requested: str, abstract, devices) -> str:
  """"host" or "sharded" for TrainConfig.init `requested`. "auto" is "sharded" when the
  devices are not CPUs (any TPU / GPU mesh) or the train state `abstract` (parameters and
  optimizer state) needs more than a quarter of this host's memory; "host" otherwise
  (nothing to compile). Both give the same values (layers/init.py), so the choice is one
  of speed and memory only."""
  if requested != "auto":
    return requested
  accelerator = any(d.platform != "cpu" for d in devices)
  too_big = tree_bytes(abstract) > host_memory_bytes() // 4
  return "sharded" if accelerator or too_big else "host"


def fresh_state(steps: "Steps", tc: TrainConfig, log: Callable[[str], None] = print) -> dict:
  """The initial train state of a fresh run, by init_mode(tc.init, ...)."""
  mode = init_mode(tc.init, steps.abstract_state, steps.mesh.devices.flat)
  if mode == "host":
    return steps.init()
  t0 = time.time()
  state = jax.block_until_ready(steps.init_sharded(jnp.int32(tc.seed)))
  log(f"initialised {tree_bytes(state) / 2**20:,.1f} MiB of train state sharded on "
      f"{steps.mesh.size} devices in {time.time() - t0:.1f}s (init={tc.init})")
  return state


# ----- loss and steps --------------------------------------------------------------

def loss_terms(graphdef, params, rest, batch, remat: str = "none", train: bool = False,
               par: Parallel = SINGLE):
  """(sum of masked token cross-entropies, number of target tokens, aux). par: the parallel
  setup the model runs under (k3_jax/partitioning.py; SINGLE = one device)."""
  model = nnx.merge(graphdef, params, rest)
  logits, _, aux = model(batch["inputs"], batch["segment_ids"], remat=remat, train=train,
                         images=batch.get("images"), par=par)
  with jax.named_scope("loss"):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask), aux


def _microbatches(batch: dict, n: int, par: Parallel = SINGLE) -> dict:
  """batch's rows as n micro-batches, (n, rows / n, ...). Each micro-batch keeps the batch's
  layout (rows over the batch axes, the sequence over its axis): left to the partitioner,
  the reshape may put the micro-batch index on the batch axes, and then each micro-batch
  runs on a fraction of the chips."""
  if "images" in batch and n > 1:
    raise ValueError(f"grad_accum={n}: batches with images (packed over the whole batch) "
                     "take grad_accum=1")
  split = lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:])
  if n == 1:
    return jax.tree.map(split, batch)
  return {k: par.constrain(split(x), (None, "batch", "seq")) for k, x in batch.items()}


def train_step(graphdef, optimizer, cfg: ModelConfig, tc: TrainConfig, state: dict,
               batch: dict, *, par: Parallel = SINGLE, grad_shardings=None,
               run: ExecConfig = ExecConfig()):
  """One optimizer step over `batch` (split into run.grad_accum micro-batches, each
  rematerialised as run.remat says), the model run under `par` (SINGLE = one device). grad_shardings: the parameters' shardings (None on
  one device); the accumulated gradients are held in them.

  The MoE balancing biases are updated from this step's router outputs (averaged over
  micro-batches) and take effect from the next step; the optimizer never sees them.
  After the update, QK-Clip (tc.qk_clip_tau > 0) rescales the query/key weights of MLA
  heads whose max logit over the step's micro-batches exceeded tau.
  """

  def loss_fn(params, mb):
    loss_sum, n, aux = loss_terms(graphdef, params, state["rest"], mb, run.remat, train=True,
                                  par=par)
    return loss_sum, (n, aux)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  n_moe, n_mla = plan_of(cfg).moe_rows, plan_of(cfg).mla_rows
  e = cfg.moe.num_experts

  # The accumulation loop's carry is a fresh value to the partitioner; pinned to the
  # parameters' shardings, each micro-batch's gradient is reduce-scattered into its shard
  # as a one-batch step's is. (A guard: the k3 grad_accum refusal, 6.09T of temporaries,
  # was a micro-batch that did not divide over the batch shards, which validate_mesh
  # now refuses; the carry was not measured to lose its layout.)
  like_params = ((lambda t: t) if grad_shardings is None else
                 (lambda t: jax.lax.with_sharding_constraint(t, grad_shardings)))

  def micro(carry, mb):
    g_acc, loss_acc, n_acc, load_acc, bias_acc, logit_acc = carry
    (loss_sum, (n, aux)), g = grad_fn(state["params"], mb)
    g = like_params(g)
    if n_moe:
      load_acc = load_acc + aux["expert_load"]
      bias_acc = bias_acc + aux["new_bias"]
    if n_mla:
      logit_acc = jnp.maximum(logit_acc, aux["max_logit"])
    return (jax.tree.map(jnp.add, g_acc, g), loss_acc + loss_sum, n_acc + n, load_acc,
            bias_acc, logit_acc), None

  zeros = (like_params(jax.tree.map(jnp.zeros_like, state["params"])),
           jnp.zeros((), jnp.float32),
           jnp.zeros((), jnp.float32), jnp.zeros((n_moe, e), jnp.int32),
           jnp.zeros((n_moe, e), jnp.float32),
           jnp.full((n_mla, cfg.mla.num_heads), -jnp.inf, jnp.float32))
  mbs = _microbatches(batch, run.grad_accum, par)
  if run.grad_accum == 1:      # no loop: a simpler program, faster to compile
    carry, _ = micro(zeros, jax.tree.map(lambda x: x[0], mbs))
  else:
    carry, _ = jax.lax.scan(micro, zeros, mbs)
  grads, loss_sum, count, load, bias_sum, max_logit = carry
  # Sums over tokens, then one division: the gradient of the mean over all micro-batches.
  denom = jnp.maximum(count, 1.0)
  # In the parameters' dtype: a float32 denominator would promote BF16 gradients, and with
  # them the optimizer's moments, to float32 (a second copy of the state per chip).
  grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
  with jax.named_scope("optimizer"):     # (the per-scope costs of compile name it)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
  rest = state["rest"]
  clip = n_mla and tc.qk_clip_tau > 0
  if n_moe or clip:
    model = nnx.merge(graphdef, params, rest)
    if n_moe:
      model.set_router_biases(bias_sum / run.grad_accum)
    if clip:
      clipped = qk_clip(model, max_logit, tc.qk_clip_tau)
    _, params, rest = nnx.split(model, nnx.Param, ...)
  loss, grad_norm = loss_sum / denom, optax.global_norm(grads)
  # A non-finite loss, gradient or updated parameter skips the whole update: parameters,
  # optimizer state and balancing biases stay as they were (only the step advances), so a
  # checkpoint never holds a non-finite state. The loop counts skipped steps.
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(params)
  # Each leaf leaves in the dtype it came in, so the donated state is reused in place and
  # the next step finds the same signature (no recompilation at step 2).
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a.astype(b.dtype), b),
                                       new, old)
  new_state = {"step": state["step"] + 1, "params": keep(params, state["params"]),
               "rest": keep(rest, state["rest"]),
               "opt_state": keep(opt_state, state["opt_state"])}
  metrics = {"loss": loss, "grad_norm": grad_norm, "finite": ok,
             "tokens": count, **lr_metrics(tc, state["step"])}
  if n_mla:
    metrics["max_logit"] = max_logit.max()
    if clip:
      metrics["qk_clipped_heads"] = clipped
  if n_moe:
    stats = load_stats(load)                                       # per MoE layer
    metrics.update({"load_max_mean": stats["max_over_mean"].max(),
                    "load_max_mean_avg": stats["max_over_mean"].mean(),
                    "zero_load_experts": stats["num_zero"].max(),
                    "zero_load_experts_avg": stats["num_zero"].astype(jnp.float32).mean()})
  return new_state, metrics


def eval_step(graphdef, state: dict, batch: dict, *, par: Parallel = SINGLE):
  loss_sum, n, _ = loss_terms(graphdef, state["params"], state["rest"], batch, par=par)
  return loss_sum, n


# ----- compiled steps with shardings ------------------------------------------------

@dataclasses.dataclass
class Steps:
  """The jit-compiled steps for one (model, train config, mesh, execution config)."""
  graphdef: Any
  mesh: Mesh
  abstract_state: Any          # ShapeDtypeStructs of the train state (e.g. to restore into)
  state_shardings: Any
  batch_sharding: NamedSharding
  init: Callable               # () -> state: host init, placed into the shardings
  train: Callable
  eval: Callable
  init_sharded: Callable | None = None   # seed -> state, jit into the shardings
  par: Parallel = SINGLE       # the parallel setup train and eval were traced under


def build_steps(cfg: ModelConfig, tc: TrainConfig, mesh: Mesh,
                run: ExecConfig = ExecConfig()) -> Steps:
  """The compiled steps of `cfg` on `mesh`, run as `run` says (remat, grad_accum, kernels;
  its mesh spec is `mesh`'s); cached, so runs that differ only in logging, evaluation or
  checkpoint cadence (or data source) reuse one compilation."""
  return _build_steps(cfg, _step_relevant(tc), mesh, run)


def _step_relevant(tc: TrainConfig) -> TrainConfig:
  """tc with every field declared step=False (k3_jax/config.py `option`) at its default: the
  steps' cache key."""
  return dataclasses.replace(tc, **{f.name: f.default for f in dataclasses.fields(tc)
                                    if not f.metadata["step"]})


@functools.lru_cache(maxsize=8)
def _build_steps(cfg: ModelConfig, tc: TrainConfig, mesh: Mesh, run: ExecConfig) -> Steps:
  optimizer = make_optimizer(tc, mesh)
  graphdef, abstract = abstract_state(cfg, tc, optimizer)
  state_sh = tree_shardings(abstract, mesh)
  # Rows over the batch's mesh axes (and the sequence over its axis), per the rules table.
  batch_sh = NamedSharding(mesh, logical_to_spec((tc.batch_size, tc.seq_len), ("batch", "seq"),
                                                 mesh))
  if cfg.vision is not None:       # multimodal batches: the packed images are replicated
    batch_sh = multimodal_batch_sharding(batch_sh, mesh)

  # The steps are built per mesh and kernels (this cache's key) and close over their parallel
  # setup, so a step traced for one mesh is never reused for another.
  par = parallel_for(mesh, kernels=run.kernels)

  def init():
    _, params, rest = split_model(create_model(cfg, seed=tc.seed))
    params = jax.device_put(params, state_sh["params"])
    rest = jax.device_put(rest, state_sh["rest"])
    opt_state = jax.jit(optimizer.init, out_shardings=state_sh["opt_state"])(params)
    return {"step": jax.device_put(jnp.zeros((), jnp.int32), state_sh["step"]),
            "params": params, "rest": rest, "opt_state": opt_state}

  train = jax.jit(functools.partial(train_step, graphdef, optimizer, cfg, tc, par=par,
                                    grad_shardings=state_sh["params"], run=run),
                  in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                  donate_argnums=(0,))
  evaluate = jax.jit(functools.partial(eval_step, graphdef, par=par),
                     in_shardings=(state_sh, batch_sh))
  return Steps(graphdef, mesh, abstract, state_sh, batch_sh, init, train, evaluate,
               init_sharded=sharded_init(cfg, tc, optimizer, state_sh), par=par)


def multimodal_batch_sharding(text_sharding: NamedSharding, mesh: Mesh) -> dict:
  """Shardings of a batch with packed images (k3_jax/data/shapes.py): the text keys as
  text-only batches, the images' arrays replicated (the tower sees every image)."""
  from jax.sharding import PartitionSpec
  return {**{k: text_sharding for k in BATCH_KEYS},
          "images": NamedSharding(mesh, PartitionSpec())}


def put_batch(batch: dict, sharding: NamedSharding | dict) -> dict:
  """This process's rows of the global batch -> global arrays. With one process the rows
  are the whole batch; on a multi-host job each process passes its own slice (the data
  pipeline shards by process) and the global batch is their concatenation in process order."""
  if isinstance(sharding, dict):   # with images
    if jax.process_count() > 1:
      raise NotImplementedError("batches with images are single-process for now")
    return {k: jax.device_put(jax.tree.map(np.asarray, batch[k]), sh)
            for k, sh in sharding.items()}
  if jax.process_count() == 1:
    return {k: jax.device_put(np.asarray(batch[k]), sharding) for k in BATCH_KEYS}
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(batch[k]))
          for k in BATCH_KEYS}


# ----- the loop -----------------------------------------------------------------------

class MetricsWriter:
  """metrics.jsonl: one strict-JSON line per logged step (non-finite values as null, named
  in "nonfinite"); `resume_at(step)` drops lines past the step a run resumes from, so a
  resumed run never repeats a step. With `tensorboard` (a directory) the scalars also go
  there as TensorBoard event files (k3_jax/summaries.py)."""

  def __init__(self, path: str, tensorboard: str | None = None):
    self.path = path
    self.tensorboard = None
    if tensorboard is not None and not jax.process_index():
      from k3_jax.summaries import TensorBoardWriter
      self.tensorboard = TensorBoardWriter(tensorboard)

  def write(self, record: dict) -> None:
    if jax.process_index():       # multi-host: the primary writes
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(faults.json_record(record), allow_nan=False) + "\n")
    if self.tensorboard is not None:
      self.tensorboard.write(record)

  def close(self) -> None:
    if self.tensorboard is not None:
      self.tensorboard.close()

  def resume_at(self, step: int) -> int:
    """Drops the lines past `step`; returns how many kept lines are skipped (non-finite)
    steps, the run's `skipped_steps` so far (each skipped step is always logged)."""
    if self.tensorboard is not None:
      self.tensorboard.resume_at(step)
    if jax.process_index() or not os.path.exists(self.path):
      return 0
    with open(self.path) as f:
      lines = f.readlines()
    kept, skipped = [], 0
    for line in lines:
      try:
        rec = json.loads(line)
      except ValueError:          # a line cut short by a kill: dropped
        continue
      if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
        kept.append(json.dumps(faults.json_record(rec), allow_nan=False) + "\n")
        skipped += rec.get("skipped") is True
    if kept != lines:
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        f.writelines(kept)
      os.replace(tmp, self.path)
    return skipped


def evaluate(steps: Steps, state, batches) -> float:
  total, count = 0.0, 0.0
  for b in batches:
    s, n = steps.eval(state, put_batch(b, steps.batch_sharding))
    total, count = total + float(s), count + float(n)
  return total / max(count, 1.0)


def run(cfg: ModelConfig, tc: TrainConfig, workdir: str, mesh: Mesh,
        train_iter, eval_batches: list, ckpt=None, log: Callable[[str], None] = print,
        stop_after: int | None = None, max_bad_steps: int = 3,
        restore_step: int | None = None, init_state: Callable | None = None,
        stop: faults.StopRequest | None = None,
        profile_steps: tuple[int, int] | None = None,
        run: ExecConfig = ExecConfig()) -> dict:
  """Trains for tc.steps steps (resuming from `ckpt` if it holds a checkpoint).

  stop_after: leave the loop after this step (as an interruption would; the schedule is
  still that of tc.steps), checkpointing there.
  max_bad_steps: stop (faults.Diverged) after this many consecutive steps whose loss,
  gradient norm or update was not finite; the jit step skips such updates.
  restore_step: resume from this checkpoint step instead of the newest good one.
  SIGTERM / SIGINT: the step in flight finishes, is checkpointed (and the save waited for),
  and the loop returns with record["interrupted"] = the signal's name.
  stop: a StopRequest the caller entered earlier (the CLI job installs it first thing, so a
  signal during setup or compilation is deferred to the first step boundary); default: one
  installed here.

  train_iter: iterator of numpy batches with get_state()/set_state() (saved in checkpoints).
  ckpt: a k3_jax.checkpoint.manager.CheckpointManager or None.
  init_state: steps -> the initial train state when there is no checkpoint to resume
  (default: a fresh init; `train --init_from` passes released weights loaded sharded).
  profile_steps: (A, B): a jax.profiler trace of steps A..B under <workdir>/profile
  (k3_jax/profiling.py).
  run: how the steps run (remat, grad_accum, kernels; k3_jax/execution.py).
  Every metrics line carries the goodput fields of k3_jax/goodput.py (cumulative time in
  compile, data, steps, eval, checkpoint, init; wall_time; goodput), and the run ends
  with a one-line goodput summary.
  Returns the last logged metrics (with eval_loss).
  """
  validate(cfg)
  validate_train(tc, cfg)
  check_batch(run, tc.batch_size)
  bad = faults.BadSteps(max_bad_steps)
  os.makedirs(workdir, exist_ok=True)
  steps = build_steps(cfg, tc, mesh, run)
  t0 = time.time()
  clock = goodput.Goodput()
  trace = profiling.StepTrace(profile_steps, os.path.join(workdir, "profile"), log)
  state = None
  init_mark = clock.mark()
  if ckpt is not None:
    restored = ckpt.restore_for_training(steps.abstract_state, steps.state_shardings,
                                         step=restore_step, log=log)
    if restored is not None:
      state, data_state = restored
      if data_state is not None:
        train_iter.set_state(data_state)
      log(f"resumed from step {int(state['step'])} in {workdir}")
  if state is None:
    state = fresh_state(steps, tc, log) if init_state is None else init_state(steps)
  start = int(state["step"])
  clock.charge("init", init_mark)
  writer = MetricsWriter(os.path.join(workdir, "metrics.jsonl"),
                         tensorboard=os.path.join(workdir, "tensorboard"))
  bad.total = writer.resume_at(start)         # skipped_steps carries across resumes
  tokens_per_step = tc.batch_size * tc.seq_len
  last: dict = {"step": start}
  window_t, window_steps = time.time(), 0
  log(f"training {cfg.name}: {tc.steps} steps, batch {tc.batch_size} x {tc.seq_len} tokens, "
      f"mesh {dict(mesh.shape)}")
  end = tc.steps if stop_after is None else min(stop_after, tc.steps)
  saved = start if ckpt is not None and start > 0 else None
  try:
    with contextlib.nullcontext(stop) if stop is not None else faults.StopRequest(log) as stop:
      for step in range(start, end):
        trace.before(step + 1)
        with clock.span("data"):
          batch = put_batch(next(train_iter), steps.batch_sharding)
        with clock.span("step"):
          state, metrics = steps.train(state, batch)
          finite = bool(metrics["finite"])    # one scalar per step: the skip decision
        trace.after(step + 1)
        window_steps += 1
        done = step + 1
        bad.update(done, finite)
        is_eval = done % tc.eval_every == 0 or done == tc.steps
        if done % tc.log_every == 0 or is_eval or done == start + 1 or not finite:
          metrics = jax.device_get(metrics)
          now = time.time()
          step_time = (now - window_t) / window_steps
          record = {"step": done, "loss": float(metrics["loss"]),
                    "grad_norm": float(metrics["grad_norm"]),
                    "step_time": step_time, "tokens_per_sec": tokens_per_step / step_time}
          for key in ("lr_adamw", "lr_muon", "load_max_mean", "load_max_mean_avg",
                      "zero_load_experts", "zero_load_experts_avg", "max_logit",
                      "qk_clipped_heads"):
            if key in metrics:
              record[key] = float(metrics[key])
          if not finite:
            record["skipped"] = True
          if bad.total:
            record["skipped_steps"] = bad.total
          window_t, window_steps = now, 0
          if is_eval and eval_batches:
            with clock.span("eval"):
              record["eval_loss"] = evaluate(steps, state, eval_batches)
          record.update(clock.fields())
          writer.write(record)
          last = record
          log(_progress_line(record, tc.steps, time.time() - t0))
        if not finite:
          log(f"step {done}: non-finite loss, gradient norm or update; the update was "
              f"skipped ({bad.in_a_row} in a row, stop at {bad.max_in_a_row})")
        if bad.exhausted:
          note = ""
          if ckpt is not None:
            ckpt.wait()
            if saved is not None and saved == bad.first_bad - 1:
              # Finite, but its very next step diverged: not a state to resume from.
              ckpt.set_aside([saved], "diverged", log)
              note = (f"the checkpoint of step {saved} led straight to them and was moved "
                      f"aside; ")
              older = [s_ for s_ in ckpt.all_steps() if s_ < saved]
              saved = older[-1] if older else None
          kept = note + (f"the last checkpoint, step {saved}, holds finite parameters"
                         if saved is not None else "no checkpoint is left to resume from")
          raise faults.Diverged(
              f"training diverged: steps {bad.first_bad}-{done} ({bad.in_a_row} in a row) had "
              f"a non-finite loss, gradient norm or update and were skipped; {kept}. Lower "
              f"--learning_rate (or raise --max_bad_steps) and run again to resume from it.")
        faults.hold_for_signal(done, stop, log)
        cadence = done % tc.checkpoint_every == 0 or done == end
        # No checkpoint inside a streak of skipped steps: a resume repeats them from the
        # last good one (e.g. at a lower learning rate).
        if ckpt is not None and ((cadence and bad.in_a_row == 0) or stop.requested):
          with clock.span("checkpoint"):
            ckpt.save(done, state, train_iter.get_state())
          saved = done
          faults.kill_in_save(done)
        if stop.requested:
          if ckpt is not None:
            with clock.span("checkpoint"):
              ckpt.wait()
            log(f"{stop.requested}: saved step {done} to {ckpt.directory}; run the same "
                f"command to resume")
          else:
            log(f"{stop.requested}: stopped after step {done} (no checkpointing)")
          last = dict(last, interrupted=stop.requested, saved_step=saved)
          break
  finally:
    trace.close()
    writer.close()
    if ckpt is not None:
      with clock.span("checkpoint"):
        ckpt.wait()                  # a save in flight finishes before the process goes on
  last.update(clock.fields())
  last["wall_time"] = time.time() - t0
  log(clock.summary())
  return last


def summary_line(result: dict, workdir: str) -> str:
  """The last line `train` prints."""
  if result.get("interrupted"):
    return (f"stopped by {result['interrupted']} after step {result.get('step')}; checkpoint "
            f"of step {result.get('saved_step')} and metrics.jsonl in {workdir}")
  parts = [f"done: step {result.get('step')}"]
  for key in ("loss", "eval_loss"):
    v = result.get(key)
    if v is not None:
      parts.append(f"{key} {v:.4f}")
  return (" ".join(parts) + f" in {result.get('wall_time', 0):.0f}s; checkpoints and "
          f"metrics.jsonl in {workdir}")


def _progress_line(r: dict, total: int, elapsed: float) -> str:
  parts = [f"step {r['step']:>5}/{total}", f"loss {r['loss']:.4f}"]
  if "eval_loss" in r:
    parts.append(f"eval {r['eval_loss']:.4f}")
  lr = (f"lr muon {r['lr_muon']:.2e} adamw {r['lr_adamw']:.2e}" if "lr_muon" in r
        else f"lr {r['lr_adamw']:.2e}")
  parts += [f"grad {r['grad_norm']:.3f}", lr,
            f"{r['tokens_per_sec']:,.0f} tok/s", f"{elapsed:,.0f}s"]
  if "load_max_mean" in r:
    parts.insert(-2, f"load {r['load_max_mean']:.2f}")
  return " | ".join(parts)


__all__ = ["sharded_init", "init_mode", "fresh_state", "train_step", "eval_step", "build_steps",
           "run", "summary_line", "Steps"]
