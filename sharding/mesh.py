"""Device meshes with the named axes (data, fsdp, expert, sequence, tensor)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from k3_jax.config import ConfigError, MeshConfig
from sharding.rules import MESH_AXES


def parse_mesh(spec: str) -> MeshConfig:
  """'fsdp:4,data:2' (missing axes are 1; one axis may be -1 = the rest) -> MeshConfig."""
  kw = {a: 1 for a in MESH_AXES}
  if not spec:
    return MeshConfig()
  for part in spec.split(","):
    if ":" not in part:
      raise ConfigError(f"mesh={spec!r}: expected axis:size pairs like 'data:2,fsdp:4'")
    name, size = part.split(":", 1)
    name = name.strip()
    if name not in MESH_AXES:
      raise ConfigError(f"mesh axis {name!r} is unknown; axes are {', '.join(MESH_AXES)}")
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


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(cfg, len(devices))
  try:
    from jax.experimental import mesh_utils
    arr = mesh_utils.create_device_mesh(shape, devices)
  except Exception:  # non-TPU or an unusual device set: plain row-major order
    arr = np.asarray(devices).reshape(shape)
  return Mesh(arr, MESH_AXES)
