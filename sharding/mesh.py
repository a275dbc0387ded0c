"""Device meshes with the named axes (data, fsdp, expert, sequence, tensor).

  parse_mesh("fsdp:256,expert:8")     -> MeshConfig (missing axes 1; one axis may be -1)
  mesh_shape(cfg, num_devices)         -> sizes in MESH_AXES order, -1 resolved
  make_mesh(cfg, devices)              -> jax Mesh in a topology-aware device order
  validate_mesh(model_cfg, mesh, ...)  -> ConfigError naming the field that does not fit

On a TPU slice `make_mesh` orders devices with `mesh_utils.create_device_mesh`, so the
axes that talk most (the innermost: tensor, sequence, expert) map onto ICI rings. Over
several slices (devices carry `slice_index`) the data axis spans the slices (DCN, the
slow links: data parallelism only all-reduces gradients once per step) via
`create_hybrid_device_mesh`; every other axis stays inside a slice.

`make_mesh(cfg, devices, slices=N)` (`--num_slices=N`): TPU devices must carry N
slices; devices without slices (CPU, GPU) are split into N fake slices of consecutive
devices, laid out the same way (the data axis's outer factor is the slice, every other
axis inside one), so the multi-slice program can be run and compared on CPU devices.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from k3_jax.config import ConfigError, MeshConfig, ModelConfig
from sharding.rules import MESH_AXES, RULES


def parse_mesh(spec: str) -> MeshConfig:
  """'fsdp:4,data:2' (missing axes are 1; one axis may be -1 = the rest) -> MeshConfig.
  An empty spec is the default: fsdp over every device."""
  kw = {a: 1 for a in MESH_AXES}
  if not spec:
    return MeshConfig()
  seen = set()
  for part in spec.split(","):
    if ":" not in part:
      raise ConfigError(f"mesh={spec!r}: expected axis:size pairs like 'data:2,fsdp:4'")
    name, size = part.split(":", 1)
    name = name.strip()
    if name not in MESH_AXES:
      raise ConfigError(f"mesh axis {name!r} is unknown; axes are {', '.join(MESH_AXES)}")
    if name in seen:
      raise ConfigError(f"mesh={spec!r}: axis {name!r} is given twice")
    seen.add(name)
    try:
      kw[name] = int(size)
    except ValueError:
      raise ConfigError(f"mesh axis {name}={size!r}: expected an integer") from None
  return MeshConfig(**kw)


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
  sizes = [getattr(cfg, a) for a in MESH_AXES]
  rest = [i for i, s in enumerate(sizes) if s == -1]
  if len(rest) > 1:
    raise ConfigError(f"mesh {cfg}: at most one axis may be -1")
  for a, s in zip(MESH_AXES, sizes):
    if s == 0 or s < -1:
      raise ConfigError(f"mesh axis {a}={s}: must be positive or -1")
  known = math.prod(s for s in sizes if s != -1)
  if rest:
    if num_devices % known:
      raise ConfigError(f"mesh {cfg}: {num_devices} devices are not divisible by the fixed "
                        f"axes' product {known}")
    sizes[rest[0]] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                      f"but {num_devices} are available")
  return tuple(sizes)


def num_slices(devices) -> int:
  """Distinct TPU slices among `devices` (1 for CPU / single-slice devices)."""
  return len({getattr(d, "slice_index", 0) or 0 for d in devices})


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None,
              slices: int | None = None) -> Mesh:
  """The mesh of `cfg` over `devices` (default: all). `slices`: the number of slices the
  devices must form (None: whatever they carry); devices without slices are split into
  that many fake slices of consecutive devices."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(cfg, len(devices))
  found = num_slices(devices)
  if slices is not None and slices < 1:
    raise ConfigError(f"num_slices={slices}: must be >= 1")
  if slices is not None and slices != found:
    if found > 1 or devices[0].platform == "tpu":
      raise ConfigError(f"num_slices={slices}, but the {len(devices)} TPU devices form "
                        f"{found} slice{'s' if found > 1 else ''} (device.slice_index)")
    return Mesh(_fake_slice_order(shape, devices, slices), MESH_AXES)
  if found > 1:
    return Mesh(_multi_slice_order(shape, devices, found), MESH_AXES)
  return Mesh(_single_slice_order(shape, devices), MESH_AXES)


def _single_slice_order(shape, devices) -> np.ndarray:
  if devices[0].platform != "tpu":       # CPU/GPU test meshes: plain row-major order
    return np.asarray(devices).reshape(shape)
  from jax.experimental import mesh_utils
  try:
    return mesh_utils.create_device_mesh(shape, devices)
  except (ValueError, NotImplementedError, AssertionError):
    try:   # a shape that does not tile the physical axes: let axes split them
      return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
      return np.asarray(devices).reshape(shape)


def _slice_shapes(shape, slices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(ici, dcn) mesh shapes: the data axis split into slices x data-per-slice."""
  data = shape[MESH_AXES.index("data")]
  if data % slices:
    raise ConfigError(f"mesh axis data={data}: over {slices} slices the data axis spans "
                      f"the slices, so it must be a multiple of {slices} "
                      f"(e.g. --mesh=data:{slices},fsdp:-1)")
  dcn = tuple(slices if a == "data" else 1 for a in MESH_AXES)
  ici = tuple(s // slices if a == "data" else s for a, s in zip(MESH_AXES, shape))
  return ici, dcn


def _fake_slice_order(shape, devices, slices: int) -> np.ndarray:
  """The hybrid order over devices without slices: consecutive groups of len/slices
  devices are the slices; each is laid out as one slice would be (its own mesh of the
  ici shape) and the slices stacked along the data axis, outermost (data index =
  slice * data-per-slice + index inside the slice), as create_hybrid_device_mesh does."""
  if len(devices) % slices:
    raise ConfigError(f"num_slices={slices} does not divide the {len(devices)} devices")
  ici, _ = _slice_shapes(shape, slices)
  n = len(devices) // slices
  per = [_single_slice_order(ici, devices[i * n:(i + 1) * n]) for i in range(slices)]
  return np.concatenate(per, axis=MESH_AXES.index("data"))


def _multi_slice_order(shape, devices, slices: int) -> np.ndarray:
  ici, dcn = _slice_shapes(shape, slices)
  from jax.experimental import mesh_utils
  try:
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  except (ValueError, NotImplementedError, AssertionError):
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                allow_split_physical_axes=True)


def batch_axes(mesh_sizes: dict) -> tuple[str, ...]:
  """The mesh axes (of size > 1) the global batch is split over, per the rules table."""
  return tuple(a for a in RULES["batch"] if mesh_sizes.get(a, 1) > 1)


def validate_mesh(cfg: ModelConfig, mesh: Mesh | dict, global_batch: int | None = None,
                  seq_len: int | None = None, grad_accum: int = 1) -> None:
  """Checks that `cfg` (and the batch, if given: each of its grad_accum micro-batches)
  divide evenly over the mesh axes that shard them; raises ConfigError naming the field,
  the mesh axis and its size.

  The rules resolver would silently replicate a dimension that does not divide; for the
  dimensions checked here that means every device holding the whole thing (parameters)
  or duplicated work (batch), so it is an error instead.
  """
  sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)

  def need(value: int, field: str, axis: str, why: str) -> None:
    n = sizes.get(axis, 1)
    if n > 1 and value % n:
      raise ConfigError(f"{field}={value} is not divisible by mesh {axis} axis {n} ({why})")

  need(cfg.moe.num_experts, "moe.num_experts", "expert", "experts are split over it")
  need(cfg.kda.num_heads, "kda.num_heads", "tensor", "heads are split over it")
  need(cfg.mla.num_heads, "mla.num_heads", "tensor", "heads are split over it")
  need(cfg.moe.expert_intermediate, "moe.expert_intermediate", "tensor",
       "expert hidden units are split over it")
  need(cfg.dense_intermediate, "dense_intermediate", "tensor", "hidden units are split over it")
  need(cfg.d_model, "d_model", "fsdp", "parameters' model dimension is split over it")
  if cfg.moe.latent_dim:
    need(cfg.moe.latent_dim, "moe.latent_dim", "fsdp", "expert weights are split over it")
  if global_batch is not None:
    axes = batch_axes(sizes)
    n = math.prod(sizes[a] for a in axes)
    if grad_accum > 1 and global_batch % grad_accum:
      raise ConfigError(f"global batch={global_batch} is not divisible by grad_accum="
                        f"{grad_accum} (each micro-batch takes an equal share)")
    rows = global_batch // max(grad_accum, 1)
    if rows % n:
      what = (f"global batch={global_batch}" if grad_accum <= 1 else
              f"micro-batch={rows} (global batch {global_batch} / grad_accum {grad_accum})")
      # At k3 scale a micro-batch left replicated over the expert axis asked the TPU
      # compiler for 6.09T of temporaries, after a 20-minute compile.
      raise ConfigError(f"{what} is not divisible by mesh "
                        f"{'*'.join(f'{a}:{sizes[a]}' for a in axes)} = {n} (every device "
                        f"on those axes takes an equal share of the batch)")
  if seq_len is not None:
    need(seq_len, "seq_len", "sequence", "the sequence is split over it")
