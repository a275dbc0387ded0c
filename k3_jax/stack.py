"""The one plan of the layer stack: where every decoder layer lives, and the walkers over
parameters, caches and aux rows that follow it.

`ModelConfig.stack_plan()` picks the layout: `prefix` unscanned leading layers, `repeats`
identical units of `period` layers whose variables are stacked on a leading [R] axis and run
under one `jax.lax.scan`, then the unscanned rest (the suffix). `StackPlan` spells that out
per layer (`LayerSpec`) so no other module computes it:

    group      module path               rows     lead index   cache batch axis
    prefix     ("prefix", i)             1        ()           0
    units      ("units", "layers", j)    repeats  (r,)         1 (after the [R] axis)
    suffix     ("suffix", i)             1        ()           0

Slot order: one DecoderLayer module per slot, prefix layers, the unit's layers, then suffix
layers: the order of the model's module lists, of its cache groups (k3_jax/cache.py) and of
its aux rows (a unit layer's slot contributes `repeats` rows, one per unit).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator

import jax
import jax.numpy as jnp

from k3_jax.cache import ModelCache
from k3_jax.config import ModelConfig

GROUPS = ("prefix", "units", "suffix")
MIXERS = ("kda", "mla")
FFNS = ("dense", "moe")


def batch_axis(group: str) -> int:
  """The batch axis of a cache entry of `group` (scanned entries lead with [R])."""
  return 1 if group == "units" else 0


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One decoder layer. index: 0-based depth; mixer "kda" | "mla"; ffn "dense" | "moe";
  group "prefix" | "units" | "suffix"; position: its index in the group's module list (in
  the unit: which of its `period` layers); row: the unit repeat holding it (0 unscanned);
  rows: how many rows its module's variables (and aux) hold: `repeats` in the unit, else 1."""
  index: int
  mixer: str
  ffn: str
  group: str
  position: int
  row: int = 0
  rows: int = 1

  @property
  def scanned(self) -> bool:
    return self.group == "units"

  @property
  def path(self) -> tuple:
    """Path of its DecoderLayer from the model (as in nnx state paths)."""
    return ("units", "layers", self.position) if self.scanned else (self.group, self.position)

  @property
  def lead(self) -> tuple[int, ...]:
    """Leading index of its values in its module's variables: (row,) when stacked."""
    return (self.row,) if self.scanned else ()

  @property
  def batch_axis(self) -> int:
    return batch_axis(self.group)


@dataclasses.dataclass(frozen=True)
class StackPlan:
  prefix: int
  repeats: int
  period: int
  layers: tuple[LayerSpec, ...]            # every layer, in depth order

  @property
  def slots(self) -> tuple[LayerSpec, ...]:
    """One spec per DecoderLayer module (row 0 of the unit's), in slot order."""
    return tuple(l for l in self.layers if l.row == 0)

  def group(self, name: str) -> tuple[LayerSpec, ...]:
    if name not in GROUPS:
      raise ValueError(f"no layer group {name!r}; groups are {GROUPS}")
    return tuple(l for l in self.slots if l.group == name)

  @property
  def unit(self) -> tuple[LayerSpec, ...]:
    return self.group("units")

  # ----- aux rows -------------------------------------------------------------------
  def moe_slots(self) -> tuple[LayerSpec, ...]:
    """MoE slots in aux order ('expert_load', 'new_bias' rows: `rows` each)."""
    return tuple(s for s in self.slots if s.ffn == "moe")

  def mla_slots(self) -> tuple[LayerSpec, ...]:
    """MLA slots in aux order ('max_logit' rows: `rows` each)."""
    return tuple(s for s in self.slots if s.mixer == "mla")

  @property
  def moe_rows(self) -> int:
    return sum(s.rows for s in self.moe_slots())

  @property
  def mla_rows(self) -> int:
    return sum(s.rows for s in self.mla_slots())

  def row_spans(self, slots) -> Iterator[tuple[LayerSpec, int, int]]:
    """(spec, first row, rows) of each slot of `slots`, rows counted in their order."""
    row = 0
    for s in slots:
      yield s, row, s.rows
      row += s.rows

  # ----- modules ----------------------------------------------------------------------
  def module(self, model, spec: LayerSpec):
    """The DecoderLayer of `spec` in `model` (a K3Model); a unit layer's module holds all
    `repeats` rows."""
    node = model
    for key in spec.path:
      node = node[key] if isinstance(key, int) else getattr(node, key)
    return node

  def modules(self, model, slots=None) -> list[tuple[LayerSpec, object]]:
    """(spec, DecoderLayer) of each slot (default all), in slot order."""
    return [(s, self.module(model, s)) for s in (self.slots if slots is None else slots)]

  # ----- caches -----------------------------------------------------------------------
  def build_cache(self, pos, make: Callable[[LayerSpec], object]) -> ModelCache:
    """A ModelCache from `make(slot spec)` -> one layer's entry ([B, ...]); a unit slot's
    entry is broadcast to [R, B, ...]."""
    rows = lambda s, e: e if not s.scanned else jax.tree.map(
        lambda a: jnp.broadcast_to(a, (self.repeats,) + a.shape), e)
    entries = {g: tuple(rows(s, make(s)) for s in self.group(g)) for g in GROUPS}
    return ModelCache(pos=pos, prefix=entries["prefix"],
                      units=entries["units"] if self.repeats else None,
                      suffix=entries["suffix"])

  def cache_entries(self, cache: ModelCache) -> list[tuple[LayerSpec, object]]:
    """(slot spec, entry) of every entry of `cache`, in slot order."""
    out = []
    for g in GROUPS:
      entries = getattr(cache, g) or ()
      specs = self.group(g)
      if len(entries) != len(specs):
        raise ValueError(f"cache group {g!r} has {len(entries)} entries, the plan "
                         f"{len(specs)} layers")
      out += list(zip(specs, entries))
    return out


def cache_groups(cache: ModelCache) -> Iterator[tuple[str, tuple]]:
  """(group, entries) of the groups `cache` has, in slot order."""
  for g in GROUPS:
    entries = getattr(cache, g)
    if entries is not None:
      yield g, entries


def map_cache(fn, cache: ModelCache, *others: ModelCache, pos=dataclasses.MISSING) -> ModelCache:
  """A ModelCache of fn(entry, *other caches' entries, axis=its batch axis) for every entry
  of `cache` (None entries stay None); pos is cache's unless given."""
  out = {g: tuple(None if e is None else fn(e, *(getattr(o, g)[i] for o in others),
                                            axis=batch_axis(g))
                  for i, e in enumerate(entries))
         for g, entries in cache_groups(cache)}
  return ModelCache(pos=cache.pos if pos is dataclasses.MISSING else pos,
                    prefix=out.get("prefix", ()), units=out.get("units"),
                    suffix=out.get("suffix", ()))


def cache_leaves(cache: ModelCache) -> list:
  """The entries of `cache` in slot order (None for the ones a view left out)."""
  return [e for _, entries in cache_groups(cache) for e in entries]


@functools.lru_cache(maxsize=32)
def plan_of(cfg: ModelConfig) -> StackPlan:
  """The layer stack of `cfg` (cached per config)."""
  kinds = cfg.layer_kinds()
  prefix, reps, period = cfg.stack_plan()
  end = prefix + reps * period
  layers = []
  for i, (mixer, ffn) in enumerate(kinds):
    assert mixer in MIXERS and ffn in FFNS, (mixer, ffn)
    if i < prefix:
      layers.append(LayerSpec(i, mixer, ffn, "prefix", i))
    elif i < end:
      r, j = divmod(i - prefix, period)
      layers.append(LayerSpec(i, mixer, ffn, "units", j, row=r, rows=reps))
    else:
      layers.append(LayerSpec(i, mixer, ffn, "suffix", i - end))
  return StackPlan(prefix, reps, period, tuple(layers))


__all__ = ["GROUPS", "MIXERS", "FFNS", "LayerSpec", "StackPlan", "plan_of", "batch_axis",
           "cache_groups", "map_cache", "cache_leaves"]
