"""Orbax / in-memory model state  <->  Hugging Face safetensors directories.

Export: model state -> config.json in the release's format of the model family +
model-0000i-of-0000n.safetensors shards + model.safetensors.index.json. Every check (the
layout can express the model, shapes, the output directory) runs before a byte is written;
the files go to a temporary directory that is renamed into place when complete, so an
existing directory is replaced only with --force and only by a complete export.

Import: such a directory (either kimi_linear dialect, or kimi_k3) -> ModelConfig + model
state, after checking that exactly the expected tensors are present with the expected shapes
and dtypes; then an Orbax checkpoint `train` resumes from and `generate` loads.

Both stream tensor by tensor (safetensors_io): an export from Orbax reads one row (a layer's
slice, an expert's matrix) at a time (OrbaxVariables), an import writes one at a time
(streaming.LazyArray); neither holds the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import time

import numpy as np
from flax import nnx

from k3_jax.checkpoint import layouts
from k3_jax.checkpoint import safetensors_io as stio
from k3_jax.checkpoint.layouts import entry as E
from k3_jax.checkpoint.layouts.entry import LayoutError
from k3_jax.checkpoint.streaming import release_freed_memory
from k3_jax.config import ModelConfig, UserError

DEFAULT_MAX_SHARD = "5GB"


# ----- the layout of a config --------------------------------------------------------------

def layout_entries(cfg: ModelConfig, expert_format: str = "auto"):
  """(layout module, entries) for exporting `cfg`."""
  lay = layouts.for_config(cfg)
  kw = {"expert_format": expert_format} if lay is layouts.kimi_k3 else {}
  return lay, lay.entries(cfg, **kw), lay.config_to_hf(cfg, **kw)


def plan(cfg: ModelConfig, max_shard_size="5GB", expert_format: str = "auto") -> dict:
  """What an export writes, from the abstract model (no allocation): tensors with their
  files, the shard plan, total bytes."""
  lay, entries, hf_config = layout_entries(cfg, expert_format)
  tensors = [t for e in entries for t in e.tensors]
  shards = stio.plan_shards(tensors, stio.parse_size(max_shard_size))
  files = {t.name: stio.shard_name(i, len(shards)) for i, s in enumerate(shards) for t in s}
  return {
      "layout": lay.MODEL_TYPE, "config": hf_config,
      "num_tensors": len(tensors), "total_bytes": sum(t.nbytes for t in tensors),
      "num_shards": len(shards),
      "shards": [{"file": stio.shard_name(i, len(shards)), "num_tensors": len(s),
                  "bytes": sum(t.nbytes for t in s)} for i, s in enumerate(shards)],
      "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                   "file": files[t.name]} for t in tensors],
      "_entries": entries, "_shards": shards,
  }


# ----- model state <-> flat dict -------------------------------------------------------------

def flat_state(model) -> dict[tuple, np.ndarray]:
  """path -> host array of every variable (parameters and router biases)."""
  return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def model_from_flat(cfg: ModelConfig, flat: dict):
  """A K3Model holding the values of `flat` (path -> array)."""
  import jax.numpy as jnp
  from k3_jax.model import abstract_model
  graphdef, state = nnx.split(abstract_model(cfg))
  pairs = []
  for p, v in nnx.to_flat_state(state):
    p = tuple(p)
    if p not in flat:
      raise LayoutError(f"no value for model variable {'/'.join(map(str, p))}")
    pairs.append((p, v.replace(jnp.asarray(flat[p]))))
  return nnx.merge(graphdef, nnx.from_flat_state(pairs))


# ----- export -------------------------------------------------------------------------------

def _prepare_out_dir(out_dir: str, force: bool) -> str:
  if os.path.exists(out_dir) and not force:
    raise FileExistsError(f"{out_dir} exists; refusing to overwrite it (pass --force)")
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.abspath(out_dir) + f".tmp-{os.getpid()}"
  if os.path.exists(tmp):
    shutil.rmtree(tmp)
  os.makedirs(tmp)
  return tmp


def _finish_out_dir(tmp: str, out_dir: str) -> None:
  if os.path.exists(out_dir):
    old = os.path.abspath(out_dir) + f".old-{os.getpid()}"
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old)
  else:
    os.replace(tmp, out_dir)


def _row_source(source):
  """row(path, idx) -> variable[idx] from a dict path -> array, a callable path -> array, or
  an object with .read(path, idx) (a streamed source: rows read from disk one at a time);
  and whole(path) -> the full variable, or None for a streamed source."""
  if hasattr(source, "read"):
    return source.read, None
  whole = (lambda p: source[p]) if isinstance(source, dict) else source
  return (lambda p, idx: np.asarray(whole(p))[idx] if idx else np.asarray(whole(p))), whole


def export_state(cfg: ModelConfig, get_value, out_dir: str, max_shard_size="5GB",
                 force: bool = False, expert_format: str = "auto",
                 metadata: dict | None = None, tokenizer=None) -> dict:
  """Writes a Hugging Face directory. get_value: a dict path -> array, a callable
  path -> that variable's full host array, or a streamed source with .read(path, idx) ->
  variable[idx] (OrbaxVariables): then only one entry's row (a layer's slice, an expert's
  matrix) is held at a time. tokenizer (data/tokenizers.Tokenizer): written beside the
  weights in the form transformers' AutoTokenizer loads (tokenizers.save_hf_tokenizer);
  generation_config.json is always written (generation_config). Returns the plan plus
  timing."""
  row, whole = _row_source(get_value)
  p = plan(cfg, max_shard_size, expert_format)
  entries, shards = p.pop("_entries"), p.pop("_shards")
  by_tensor = {t.name: (e, i) for e in entries for i, t in enumerate(e.tensors)}
  tmp = _prepare_out_dir(out_dir, force)
  t0 = time.time()
  cache: dict = {}

  def produce(t):
    e, i = by_tensor[t.name]
    if e.kind == "mxfp4" and whole is not None:   # in memory: quantize the whole stacked
      mx = cache.setdefault("mx", {})   # variable once (vectorised); a layer's w1/w2/w3
      if e.path not in mx:              # interleave: keep the last three
        if len(mx) >= 3:
          mx.pop(next(iter(mx)))
        mx[e.path] = E.pack_mxfp4_stacked(whole(e.path))
      codes, scales = mx[e.path]
      return np.ascontiguousarray((codes if i == 0 else scales)[e.index].T)
    if cache.get("entry") is not e:     # (streamed MXFP4: packed expert by expert, the same
      cache["entry"] = cache["arrays"] = None   # bytes as the stacked packing)
      cache["arrays"] = E.to_disk(e, row(e.path, e.index))
      cache["entry"] = e
    return cache["arrays"][i]

  try:
    meta = {"format": "pt", "producer": "k3_jax"}
    for i, s in enumerate(shards):
      stio.write_shard(os.path.join(tmp, stio.shard_name(i, len(shards))), s, produce, meta)
      release_freed_memory()          # the shard's converted tensors, back to the OS
    stio.write_index(tmp, shards, metadata)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(p["config"], f, indent=2, sort_keys=True)
      f.write("\n")
    if tokenizer is not None:
      from k3_jax.data.tokenizers import check_covers, save_hf_tokenizer
      try:
        check_covers(tokenizer, cfg.vocab_size)
      except ValueError as e:              # a vocabulary the tokenizer does not fit: the
        p["tokenizer_skipped"] = str(e)    # weights are still exported, without it
        tokenizer = None
      else:
        p["tokenizer_files"] = save_hf_tokenizer(tokenizer, tmp)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      json.dump(generation_config(cfg, tokenizer), f, indent=2)
      f.write("\n")
    _finish_out_dir(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  p["seconds"] = time.time() - t0
  p["out_dir"] = out_dir
  return p


def generation_config(cfg: ModelConfig, tokenizer=None) -> dict:
  """generation_config.json: the ids generation stops at. A K3 chat tokenizer (one with
  `<|end_of_msg|>`) stops at the end of a message first, then its EOS (docs/architecture.md
  section 9); otherwise the tokenizer's EOS, else the model config's eos_id."""
  special = getattr(tokenizer, "special_tokens", None) or {}
  eos = []
  if "<|end_of_msg|>" in special:
    eos.append(special["<|end_of_msg|>"])
  if tokenizer is not None and tokenizer.eos_id is not None:
    eos.append(tokenizer.eos_id)
  elif cfg.eos_id >= 0:
    eos.append(cfg.eos_id)
  out = {"_from_model_config": False, "transformers_version": "5.23.0"}
  if tokenizer is not None and tokenizer.bos_id is not None:
    out["bos_token_id"] = tokenizer.bos_id
  if eos:
    out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
  if tokenizer is not None and tokenizer.pad_id is not None:
    out["pad_token_id"] = tokenizer.pad_id
  return out


def export_model(model, out_dir: str, **kw) -> dict:
  return export_state(model.cfg, flat_state(model), out_dir, **kw)


# ----- import -------------------------------------------------------------------------------

def read_hf_config(hf_dir: str) -> tuple[object, ModelConfig, dict]:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{hf_dir} has no config.json")
  with open(path) as f:
    hf = json.load(f)
  lay = layouts.by_model_type(hf.get("model_type"))
  return lay, lay.config_from_hf(hf), hf


def import_entries(hf_dir: str, reader: stio.Reader | None = None):
  """(cfg, entries, reader, names): the entries to read, each tensor name resolved to the
  spelling found on disk, after checking nothing is missing, extra, or of the wrong shape or
  dtype."""
  lay, cfg, hf = read_hf_config(hf_dir)
  reader = reader or stio.Reader(hf_dir)
  on_disk = set(reader.names())
  kw = {}
  if lay is layouts.kimi_k3:
    has_packed = any(n.endswith(".weight_packed") for n in on_disk)
    kw["expert_format"] = "mxfp4" if has_packed else "dense"
  entries = lay.entries(cfg, **kw)
  resolved: dict[str, str] = {}
  problems: list[str] = []
  for e in entries:
    for t in e.tensors:
      name = next((n for n in [t.name] + lay.dialect_aliases(t.name) if n in on_disk), None)
      if name is None:
        problems.append(f"missing tensor {t.name}")
        continue
      resolved[t.name] = name
      shape, dtype = reader.info(name)
      a_log_ok = (t.name.endswith("A_log") and np.prod(shape) >= np.prod(t.shape))
      if tuple(shape) != tuple(t.shape) and not a_log_ok:
        problems.append(f"tensor {name} has shape {list(shape)}, expected {list(t.shape)}")
      if e.kind == "mxfp4" and dtype != "U8":
        problems.append(f"tensor {name} has dtype {dtype}, expected U8")
      elif e.kind != "mxfp4" and dtype not in ("F32", "BF16", "F16"):
        problems.append(f"tensor {name} has dtype {dtype}, expected a float type")
  extra = sorted(on_disk - set(resolved.values()))
  problems += [f"unexpected tensor {n} (not part of the {lay.MODEL_TYPE} layout for this "
               f"config)" for n in extra]
  if problems:
    more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
    raise LayoutError(f"{hf_dir}: " + "; ".join(problems[:10]) + more)
  return cfg, entries, reader, resolved


class HFVariables:
  """The model variables of a Hugging Face directory, read part by part through the layout's
  entries: `read(path, idx)` gives one leading row of a variable (one stacked layer's, one
  routed expert's matrix; the whole variable when it has no leading index), optionally only
  the `trailing` slices of it. An AttnRes norm gain stored on disk is folded in (in FP32).
  Checks (import_entries) run on construction: nothing missing, extra or misshapen."""

  def __init__(self, hf_dir: str):
    from k3_jax.checkpoint.layouts.common import variable_shapes
    self.cfg, entries, self.reader, self._names = import_entries(hf_dir)
    self.shapes = variable_shapes(self.cfg)            # path -> (shape, dtype)
    self._rows: dict[tuple, dict[tuple, E.Entry]] = {}
    self._gains: dict[tuple, dict[tuple, E.Entry]] = {}
    for e in entries:
      (self._gains if e.kind == "gain" else self._rows).setdefault(e.path, {})[e.index] = e
    missing = [p for p in self.shapes if p not in self._rows]
    if missing:
      self.reader.close()
      raise LayoutError("the layout left model variables unset: " +
                        ", ".join("/".join(map(str, p)) for p in missing[:5]))

  def lead(self, path: tuple) -> int:
    """How many leading axes of the variable index its rows (0: one row, the variable)."""
    return len(next(iter(self._rows[path])))

  def _get_slice(self, name: str):
    return self.reader.get_slice(self._names.get(name, name))

  def _read(self, e, shape, dtype, trailing):
    if trailing is None:
      return E.from_disk(e, [self.reader.get(self._names[t.name]) for t in e.tensors], shape,
                         dtype)
    return E.read_slice(e, self._get_slice, shape, dtype, trailing)

  def read(self, path: tuple, idx: tuple = (), trailing: tuple | None = None) -> np.ndarray:
    """variable[idx] (idx: ints over its leading axes), or just [idx][trailing]."""
    shape, dtype = self.shapes[path]
    idx = tuple(int(i) for i in idx)
    rest = shape[len(idx):]
    v = self._read(self._rows[path][idx], rest, dtype, trailing)
    g = self._gains.get(path, {}).get(idx)
    if g is not None:
      v = (v.astype(np.float32) * self._read(g, rest, np.float32, trailing)).astype(dtype)
    return v

  def read_variable(self, path: tuple) -> np.ndarray:
    shape, dtype = self.shapes[path]
    lead = self.lead(path)
    out = np.empty(shape, np.dtype(dtype))
    for idx in itertools.product(*(range(n) for n in shape[:lead])):
      out[idx] = self.read(path, idx)
    return out

  def close(self) -> None:
    self.reader.close()


def load_flat(hf_dir: str) -> tuple[ModelConfig, dict]:
  """(cfg, path -> host array) of a Hugging Face directory, read tensor by tensor."""
  src = HFVariables(hf_dir)
  try:
    return src.cfg, {p: src.read_variable(p) for p in src.shapes}
  finally:
    src.close()


def load_model(hf_dir: str):
  """(cfg, K3Model) from a Hugging Face directory."""
  cfg, flat = load_flat(hf_dir)
  return cfg, model_from_flat(cfg, flat)


# ----- Orbax workdirs -----------------------------------------------------------------------

class OrbaxVariables:
  """The model variables of an Orbax checkpoint (parameters and balancing biases of `step`
  or the newest good one, with the fallback of restore_params), read row by row with
  tensorstore: `read(path, idx)` -> variable[idx], never the whole checkpoint."""

  def __init__(self, workdir: str, step: int | None = None, log=print):
    from k3_jax.checkpoint.manager import CheckpointManager, saved_config
    self.cfg = saved_config(workdir)
    if self.cfg is None:
      raise FileNotFoundError(f"no checkpoints in {workdir}")
    mgr = CheckpointManager(workdir, self.cfg, read_only=True)
    try:
      self.step, self._stored = mgr.stored_params(step, log)
    finally:
      mgr.close()

  def _keys(self, path: tuple) -> tuple:
    for part in ("params", "rest"):
      keys = (part, *map(str, path), "value")
      if keys in self._stored:
        return keys
    raise LayoutError(f"the checkpoint holds no model variable {'/'.join(map(str, path))}")

  def read(self, path: tuple, idx: tuple = ()) -> np.ndarray:
    return self._stored.read(self._keys(path), idx)


def expert_format_note(cfg: ModelConfig, expert_format: str = "auto") -> str | None:
  """The line `convert` prints when an export packs the routed experts in MXFP4 (lossy)
  without being asked to (expert_format auto); None otherwise."""
  lay = layouts.for_config(cfg)
  if expert_format != "auto" or lay is not layouts.kimi_k3:
    return None
  if lay.resolve_expert_format(cfg, expert_format) != "mxfp4":
    return None
  return ("the export packs the routed experts in MXFP4 (4.25 bits per weight, lossy: the "
          "exported model differs from the checkpoint); --expert_format=dense keeps them exact")


def export_workdir(workdir: str, out_dir: str, step: int | None = None, log=None,
                   **kw) -> dict:
  """Orbax checkpoint -> Hugging Face directory, streamed: each output tensor is read from
  the checkpoint (one layer's slice, one expert's matrix) when its shard is written, so host
  memory holds about one row and one shard's buffers, never the model."""
  from k3_jax.checkpoint.inference import trained_tokenizer
  from k3_jax.data.tokenizers import get_tokenizer
  src = OrbaxVariables(workdir, step)
  layout_entries(src.cfg, kw.get("expert_format", "auto"))   # fail before touching out_dir
  if "tokenizer" not in kw:                    # the run's tokenizer goes with its weights
    kw["tokenizer"] = get_tokenizer(trained_tokenizer(workdir))   # (missing: a clear error)
  note = expert_format_note(src.cfg, kw.get("expert_format", "auto"))
  if note and log:
    log(note)
  out = export_state(src.cfg, src, out_dir, metadata={"source_step": src.step}, **kw)
  out["step"] = src.step
  return out


def streamed_train_state(src: HFVariables, tc) -> dict:
  """The step-0 train state of `src`'s model ({"step", "params", "rest", "opt_state"}, the
  structure train_state.abstract_state gives) with every leaf a streaming.LazyArray: parameters
  and balancing biases read row by row from the safetensors files when written, the fresh
  optimizer state as its init gives it (streaming.constant_leaves: the moments as constant
  fills). Nothing is read or allocated here."""
  import jax
  from k3_jax import train_state
  from k3_jax.checkpoint import streaming
  optimizer = train_state.make_optimizer(tc)
  _, abstract = train_state.abstract_state(src.cfg, tc, optimizer)

  def lazy_variables(part):
    pairs = []
    for path, var in nnx.to_flat_state(part):
      path = tuple(path)
      shape, dtype = src.shapes[path]
      pairs.append((path, var.replace(streaming.LazyArray(
          shape, dtype, lambda idx, path=path: src.read(path, idx), rows=src.lead(path)))))
    return nnx.from_flat_state(pairs)

  opt_state = jax.tree.unflatten(jax.tree.structure(abstract["opt_state"]),
                                 streaming.constant_leaves(optimizer.init, abstract["params"]))
  return {"step": streaming.constant((), np.int32, 0), "params": lazy_variables(
      abstract["params"]), "rest": lazy_variables(abstract["rest"]), "opt_state": opt_state}


def import_to_workdir(hf_dir: str, workdir: str, force: bool = False,
                      optimizer: str = "adamw", batch_bytes: int | None = None) -> dict:
  """Writes an Orbax checkpoint (step 0, fresh optimizer state) that `train` resumes from and
  `generate` loads. Streams: each variable is read from the safetensors files and written
  one leading row (a layer's slice, an expert's matrix) at a time, the optimizer moments as
  constant fills, so host memory holds about one row (plus the mapped pages of at most two
  shards), never the model. batch_bytes: rows per tensorstore commit (default
  streaming.BATCH_BYTES)."""
  from k3_jax.checkpoint.manager import CheckpointManager
  from k3_jax.checkpoint.resume import save_train_config
  from k3_jax.config import TrainConfig
  ck = os.path.join(workdir, "checkpoints")
  if os.path.exists(ck) and os.listdir(ck) and not force:
    raise FileExistsError(f"{workdir} already holds checkpoints; refusing to overwrite them "
                          f"(pass --force, or choose another workdir)")
  t0 = time.time()
  src = HFVariables(hf_dir)                    # every check before anything is written
  try:
    from k3_jax.data.tokenizers import has_tokenizer   # the directory's own tokenizer
    tc = TrainConfig(optimizer=optimizer, tokenizer=hf_dir if has_tokenizer(hf_dir) else "byte")
    state = streamed_train_state(src, tc)
    if os.path.exists(ck) and force:
      shutil.rmtree(ck)
    mgr = CheckpointManager(workdir, src.cfg)
    mgr.save_streamed(0, state, {}, batch_bytes=batch_bytes)
    mgr.wait()
    mgr.close()
    save_train_config(workdir, tc)
  finally:
    src.close()
  return {"workdir": workdir, "config": src.cfg.name, "seconds": time.time() - t0}


# ----- the `convert` command ----------------------------------------------------------------

def source_kind(src: str) -> str:
  """"hf" (config.json + safetensors), "orbax" (a workdir with checkpoints), else an error."""
  if not os.path.exists(src):
    raise FileNotFoundError(f"--from={src}: no such file or directory")
  if not os.path.isdir(src):
    raise UserError(f"--from={src}: is a file; expected an Orbax workdir or a Hugging Face "
                    f"directory")
  if os.path.exists(os.path.join(src, "config.json")) and any(
      p.endswith(".safetensors") for p in os.listdir(src)):
    return "hf"
  if os.path.exists(os.path.join(src, "checkpoints", "model_config.json")):
    return "orbax"
  raise FileNotFoundError(f"{src} holds neither a Hugging Face checkpoint (config.json + "
                          f".safetensors) nor Orbax checkpoints (checkpoints/model_config.json)")


def run(src: str | None, dst: str | None, *, cfg: ModelConfig | None = None,
        step: int | None = None, max_shard_size="5GB", dry_run: bool = False,
        force: bool = False, expert_format: str = "auto", log=None) -> dict:
  """What `main.py convert` does; returns a JSON-able summary. log: a callable for notes
  (the lossy MXFP4 packing of an export with expert_format auto).

  dry_run with cfg (a preset) or an Orbax src: the export plan from the abstract model.
  Otherwise the direction follows what src holds: Orbax -> HF export, HF -> Orbax import."""
  stio.parse_size(max_shard_size)
  if dry_run and (src is None or source_kind(src) == "orbax"):
    if src is not None:
      from k3_jax.checkpoint.manager import saved_config
      cfg = saved_config(src)
    if cfg is None:
      raise UserError("convert --dry_run needs --from=WORKDIR or --config=PRESET")
    out = plan(cfg, max_shard_size, expert_format)
    out.pop("_entries"), out.pop("_shards")
    note = expert_format_note(cfg, expert_format)
    if note and log:
      log(note)
    return {"direction": "export", "dry_run": True, **out}
  if not src or not dst:
    raise UserError("convert needs --from=SRC and --to=DST (or --dry_run with --config)")
  kind = source_kind(src)
  if kind == "orbax":
    out = export_workdir(src, dst, step, max_shard_size=max_shard_size, force=force,
                         expert_format=expert_format, log=log)
    out.pop("tensors", None)
    gb = out["total_bytes"] / 1e9
    return {"direction": "export", **out, "gb_per_s": gb / max(out["seconds"], 1e-9)}
  if dry_run:
    cfg, entries, reader, _ = import_entries(src)
    reader.close()
    return {"direction": "import", "dry_run": True, "config": dataclasses.asdict(cfg),
            "num_tensors": sum(len(e.tensors) for e in entries)}
  return {"direction": "import", **import_to_workdir(src, dst, force=force)}
