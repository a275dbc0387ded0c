"""Loading a Hugging Face checkpoint straight into sharded jax arrays.

Every variable is built with `jax.make_array_from_callback`: the callback receives the
index (a tuple of slices) of one addressable device's shard and reads just that part from
the safetensors files (`safe_open(...).get_slice`, through the layout's Entries: for a
"linear" entry only the rows / columns the shard needs). So each process reads only the
slices its own devices hold, and a 1.56 TB checkpoint never passes through one host.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from k3_jax.checkpoint import convert


def load_sharded(hf_dir: str, shardings: dict, log=None):
  """(cfg, {path: jax.Array}) with each variable placed per `shardings` (path -> Sharding,
  or a callable cfg -> that dict). log: optional list receiving (path, index, bytes) per
  callback, to see what each device's read cost."""
  src = convert.HFVariables(hf_dir)
  reader = src.reader
  if callable(shardings):
    shardings = shardings(src.cfg)
  out = {}
  try:
    for path, (shape, dtype) in src.shapes.items():
      lead = src.lead(path)

      def callback(index, path=path, shape=shape, lead=lead):
        before = reader.bytes_read
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        lead_ranges = [range(*s.indices(n)) for s, n in zip(index[:lead], shape[:lead])]
        trailing = index[lead:]
        parts = [src.read(path, idx, trailing) for idx in itertools.product(*lead_ranges)]
        sub = [len(r) for r in lead_ranges]
        arr = np.stack(parts).reshape(sub + list(parts[0].shape)) if lead else parts[0]
        if log is not None:
          log.append((path, index, reader.bytes_read - before))
        return arr

      out[path] = jax.make_array_from_callback(shape, shardings[path], callback)
  finally:
    src.close()
  return src.cfg, out


def model_shardings(cfg, mesh) -> dict:
  """path -> NamedSharding of every model variable, by its logical axes and sharding/'s rules
  (the placement train and serve use)."""
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec
  from k3_jax.model import abstract_model
  from sharding.rules import named_sharding
  out = {}
  for p, v in nnx.to_flat_state(nnx.state(abstract_model(cfg))):
    axes = v.get_metadata().get("logical_axes")
    out[tuple(p)] = (named_sharding(mesh, v.shape, axes) if axes is not None
                     and len(axes) == len(v.shape) else NamedSharding(mesh, PartitionSpec()))
  return out


def load_model_sharded(hf_dir: str, mesh):
  """(cfg, K3Model) whose variables are sharded over `mesh`, read slice by slice."""
  cfg, flat = load_sharded(hf_dir, lambda c: model_shardings(c, mesh))
  return cfg, convert.model_from_flat(cfg, flat)


def train_state_from_hf(hf_dir: str, steps, tc) -> dict:
  """A step-0 train state (fresh optimizer state) whose parameters come from `hf_dir`, each
  read straight into its shard of steps.mesh (`train --init_from`)."""
  import jax
  import jax.numpy as jnp
  from k3_jax.train_state import make_optimizer, split_model
  cfg, model = load_model_sharded(hf_dir, steps.mesh)
  _, params, rest = split_model(model)
  sh = steps.state_shardings
  params = jax.device_put(params, sh["params"])
  rest = jax.device_put(rest, sh["rest"])
  opt_state = jax.jit(make_optimizer(tc).init, out_shardings=sh["opt_state"])(params)
  return {"step": jax.device_put(jnp.zeros((), jnp.int32), sh["step"]), "params": params,
          "rest": rest, "opt_state": opt_state}
