"""A roofline of a compiled SPMD program, read from its optimized HLO text.

XLA's `cost_analysis()` on TPU counts a `while` body once, whatever its trip count, so for a
model whose layers run under `lax.scan` it reports the FLOPs and bytes of about one layer
group. This module walks the compiled module itself (`compiled.as_text()`), multiplying each
loop body by its trip count, and adds up per chip:

- FLOPs of every `dot` and `convolution` (inside fusions too);
- HBM bytes: the operands and outputs of every top-level instruction (a fusion counts at its
  boundary, the way XLA's cost model counts it: what it reads and writes in HBM);
- per collective kind (all-gather, reduce-scatter, all-reduce, all-to-all, permute): the
  bytes of the buffers and the bytes each chip puts on the wire (ring algorithms:
  all-gather and reduce-scatter (n-1)/n of the full buffer, all-reduce twice that,
  all-to-all (n-1)/n, a permute its buffer);
- the bytes that cross the data-centre network: on multi-slice TPU programs the compiler
  lowers the cross-slice part of a collective to `send`/`recv` pairs handled by the
  megascale runtime; each send's buffer is counted against the collective it came from.

Pallas kernels are custom calls XLA cannot see into. Each of ours attaches its analytic
cost to its pallas_call (`pl.CostEstimate`: FLOPs and HBM bytes from its static shapes, in
the call's backend config), and the walk adds those, per kernel name, under
`pallas_kernels`. A custom call without an estimate is listed under `not_counted` (its
count and output bytes; its operands and outputs are counted as HBM bytes, its FLOPs not),
and so is a loop whose trip count the text does not determine (counted once).

`roofline()` turns the counts into times at a chip's peak rates (CHIPS, with sources) and
names the bound: step time = the largest of compute, HBM, ICI and DCN time (perfect
overlap, so a lower bound).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

# Peak per-chip rates. Source: the Cloud TPU system-architecture pages (cloud.google.com/tpu/
# docs/v5e, v5p, v6e), read 2026-12: bf16 peak compute, HBM bandwidth, bidirectional ICI
# bandwidth per chip, data-centre network bandwidth per chip (v5p: 50 Gbps per chip; v5e /
# v6e: the per-host NICs, 2 x 100 Gbps and 4 x 200 Gbps, over 8 chips a host).
CHIPS = {
    "v5e": {"bf16_flops": 197e12, "hbm_bytes_s": 819e9, "ici_bytes_s": 400e9,
            "dcn_bytes_s": 200e9 / 8 / 8},
    "v5p": {"bf16_flops": 459e12, "hbm_bytes_s": 2765e9, "ici_bytes_s": 1200e9,
            "dcn_bytes_s": 50e9 / 8},
    "v6e": {"bf16_flops": 918e12, "hbm_bytes_s": 1640e9, "ici_bytes_s": 800e9,
            "dcn_bytes_s": 800e9 / 8 / 8},
}
CHIP_SOURCE = ("Cloud TPU system architecture pages (v5e, v5p, v6e): bf16 peak, HBM bandwidth, "
               "bidirectional ICI per chip, DCN per chip")

# Custom calls XLA cannot see into: Pallas (Mosaic) TPU kernels.
PALLAS_TARGETS = ("tpu_custom_call",)
# Custom calls that only allocate a buffer, reading and writing nothing (`jax.lax.empty` on
# TPU: "AllocateBuffer", values uninitialised): no HBM bytes.
ALLOCATE_TARGETS = ("AllocateBuffer",)

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "permute")
_KIND = {"all-gather": "all-gather", "all-gather-start": "all-gather",
         "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
         "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
         "collective-permute": "permute", "collective-permute-start": "permute",
         "ragged-all-to-all": "all-to-all"}
# Instructions that move no data of their own.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "iota", "all-gather-done", "all-reduce-done",
         "collective-permute-done", "copy-done", "async-done", "send-done", "recv-done",
         "opt-barrier", "while", "call", "conditional", "async-start", "async-update",
         "send", "recv", "domain", "add-dependency"}

_DTYPE_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
                "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2,
                "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "f4e2m1fn": 0.5,
                "f8e8m0fnu": 1, "token": 0}
# An array and its optional layout; the layout may name a memory space:
# 'f32[8,96]{1,0:T(8,128)S(1)}'. Space 0 (no S) is HBM; the TPU compiler's memory-space
# assignment puts buffers it prefetches or keeps on chip in the others (S(1) is VMEM: a
# Pallas kernel's scoped VMEM is memory_space 1), and those reads and writes are not HBM
# traffic.
_ARRAY = re.compile(r"\b([a-z]\w*?)\[([0-9,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")


def _dtype_bytes(dtype: str) -> float:
  if dtype in _DTYPE_BYTES:
    return _DTYPE_BYTES[dtype]
  if dtype.startswith("f8"):
    return 1
  return 0


def _placed_arrays(type_str: str) -> list[tuple[str, tuple[int, ...], bool]]:
  """(dtype, dims, in HBM?) of each array of an HLO type string, in order."""
  out = []
  for dt, dims, layout in _ARRAY.findall(type_str):
    if dt in _DTYPE_BYTES or dt.startswith("f8"):
      space = _SPACE.search(layout or "")
      out.append((dt, tuple(int(d) for d in dims.split(",") if d),
                  space is None or space.group(1) == "0"))
  return out


def _arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, dims) for dt, dims, _ in _placed_arrays(type_str)]


def type_bytes(type_str: str) -> float:
  """Bytes of an HLO type string: an array ('bf16[8,512]{1,0}') or a tuple of them."""
  return sum(_dtype_bytes(dt) * math.prod(dims) for dt, dims in _arrays(type_str))


def _hbm_arrays(type_str: str) -> list[tuple[float, bool]]:
  """(bytes, in HBM?) of each array of an HLO type string, in order."""
  return [(_dtype_bytes(dt) * math.prod(dims), hbm)
          for dt, dims, hbm in _placed_arrays(type_str)]


def hbm_bytes(type_str: str) -> float:
  """Bytes of the arrays of an HLO type string that live in HBM (memory space 0)."""
  return sum(b for b, hbm in _hbm_arrays(type_str) if hbm)


def in_hbm(type_str: str) -> bool:
  """Does (the first array of) this type live in HBM?"""
  arrays = _hbm_arrays(type_str)
  return not arrays or arrays[0][1]


@dataclasses.dataclass
class Instr:
  name: str
  type: str
  op: str
  operands: list[str]
  args: str           # the text inside the instruction's parentheses (a constant's value)
  attrs: str


def _match_paren(s: str, start: int) -> int:
  """Index just past the bracket closing the one at s[start]."""
  depth = 0
  for i in range(start, len(s)):
    c = s[i]
    if c in "({":
      depth += 1
    elif c in ")}":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(s)


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_LHS = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def parse_hlo(text: str) -> tuple[dict[str, dict[str, Instr]], str]:
  """{computation: {instruction name: Instr}} and the entry computation's name."""
  comps: dict[str, dict[str, Instr]] = {}
  entry, cur = "", None
  for line in text.splitlines():
    if cur is None:
      m = _HEADER.match(line)
      if m:
        cur = comps.setdefault(m.group(2), {})
        if m.group(1):
          entry = m.group(2)
      continue
    if line.startswith("}"):
      cur = None
      continue
    m = _LHS.match(line)
    if not m:
      continue
    rest = line[m.end():]
    if rest.startswith("("):
      end = _match_paren(rest, 0)
      typ, rest = rest[:end], rest[end:].lstrip()
    else:
      typ, _, rest = rest.partition(" ")
    op, paren, rest = rest.partition("(")
    if not paren:
      continue
    end = _match_paren("(" + rest, 0) - 1          # just past the closing paren, in rest
    args = rest[:max(end - 1, 0)]
    operands = re.findall(r"%([\w.\-]+)", args)
    cur[m.group(1)] = Instr(m.group(1), typ, op.strip(), operands, args, rest[end:])
  return comps, entry


def _roots(text: str) -> dict[str, str]:
  """{computation: the name of its ROOT instruction}."""
  out, cur = {}, None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m:
      cur = m.group(2)
      continue
    r = re.match(r"^\s*ROOT\s+%?([\w.\-]+)", line)
    if r and cur:
      out[cur] = r.group(1)
  return out


def _attr(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
  return m.group(1) if m else None


def _group_size(attrs: str) -> int:
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
  if m:
    return max(1, len([x for x in m.group(1).split(",") if x]))
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)        # iota form [G,N]<=[...]
  if m:
    return int(m.group(1).split(",")[-1])
  # mesh form: replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: the named axes' product
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return max(1, math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([^']+)'", m.group(2))))
  return 1


def _window(attrs: str, n: int) -> list[dict]:
  """Per spatial dimension: size, pad (lo, hi), stride, lhs / rhs dilation."""
  dims = [{"size": 1, "pad": (0, 0), "stride": 1, "lhs_dilate": 1, "rhs_dilate": 1}
          for _ in range(n)]
  m = re.search(r"window=\{([^}]*)\}", attrs)
  for field in (m.group(1).split() if m else []):
    key, _, val = field.partition("=")
    parts = val.split("x")
    for d, v in zip(dims, parts):
      if key == "pad":
        lo, _, hi = v.partition("_")
        d["pad"] = (int(lo), int(hi or 0))
      elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
        d[key] = int(v)
  return dims


def _conv_flops(lhs, rhs, out, attrs: str) -> float:
  """FLOPs of an HLO convolution, counting only kernel taps that land on real input elements
  (not padding, not the holes of a dilated input): the TPU compiler writes batched matmuls
  as convolutions whose batch dimensions are padded spatial windows, where counting every
  tap would multiply their cost by the window size."""
  m = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", attrs)
  if not m:
    return 0.0
  ll, rl_, ol = m.groups()
  spatial = sorted({c for c in ll if c.isdigit()})
  win = _window(attrs, len(spatial))
  pairs = 1
  for d, w in zip(spatial, win):
    n, o = lhs[ll.index(d)], out[ol.index(d)]
    k_size = rhs[rl_.index(d)]
    total = 0
    outs = np.arange(o) * w["stride"]
    for k in range(k_size):
      x = outs + k * w["rhs_dilate"] - w["pad"][0]        # coordinate in the dilated input
      ok = (x >= 0) & (x % w["lhs_dilate"] == 0) & (x // w["lhs_dilate"] < n)
      total += int(ok.sum())
    pairs *= total
  b = out[ol.index("b")] if "b" in ol else 1
  f = out[ol.index("f")] if "f" in ol else 1
  i = rhs[rl_.index("i")] if "i" in rl_ else 1
  return 2.0 * b * f * i * pairs


@dataclasses.dataclass
class Costs:
  flops: float = 0.0
  hbm_bytes: float = 0.0
  collectives: dict = dataclasses.field(default_factory=dict)   # kind -> {count, bytes, wire_bytes}
  dcn: dict = dataclasses.field(default_factory=dict)           # from-collective -> bytes
  custom_calls: dict = dataclasses.field(default_factory=dict)  # target -> {count, output_bytes}
  kernels: dict = dataclasses.field(default_factory=dict)       # name -> {count, flops, hbm_bytes}
  unknown_trip_loops: int = 0
  scopes: dict = dataclasses.field(default_factory=dict)        # scope -> SCOPE_FIELDS (see scoped)

  def add(self, other: "Costs", times: float = 1.0) -> None:
    self.flops += times * other.flops
    self.hbm_bytes += times * other.hbm_bytes
    for k, v in other.collectives.items():
      mine = self.collectives.setdefault(k, {"count": 0, "bytes": 0.0, "wire_bytes": 0.0})
      for f in mine:
        mine[f] += times * v[f]
    for k, v in other.dcn.items():
      self.dcn[k] = self.dcn.get(k, 0.0) + times * v
    for mine_all, theirs, fields in ((self.custom_calls, other.custom_calls,
                                      ("count", "output_bytes")),
                                     (self.kernels, other.kernels,
                                      ("count", "flops", "hbm_bytes"))):
      for k, v in theirs.items():
        mine = mine_all.setdefault(k, dict.fromkeys(fields, 0.0))
        for f in mine:
          mine[f] += times * v[f]
    self.unknown_trip_loops += other.unknown_trip_loops
    for k, v in other.scopes.items():
      mine = self.scopes.setdefault(k, dict.fromkeys(SCOPE_FIELDS, 0.0))
      for f in SCOPE_FIELDS:
        mine[f] += times * v[f]

  def scoped(self, scope: str, field: str, value: float) -> None:
    """Adds `value` to one field of a named scope's costs (program_costs with scope_of)."""
    if value:
      self.scopes.setdefault(scope, dict.fromkeys(SCOPE_FIELDS, 0.0))[field] += value


_COST_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"?(\d+)"?,\s*"transcendentals":"?(\d+)"?,'
                            r'\s*"bytes_accessed":"?(\d+)"?')


def _kernel_costs(ins: "Instr") -> tuple[str, float, float] | None:
  """(kernel name, FLOPs, HBM bytes) of a Pallas call from the cost estimate its
  pallas_call attached (pl.CostEstimate, in the backend config: the kernel's own analytic
  count from its static shapes; pallas_kernels/ give one for every kernel), or None when it
  has none. The name is the instruction's, which XLA derives from the pallas_call's name."""
  m = _COST_ESTIMATE.search(ins.attrs)
  if m is None:
    return None
  name = re.sub(r"\.\d+$", "", ins.name).lstrip("_") or "pallas_call"
  return name, float(m.group(1)), float(m.group(3))


SCOPE_FIELDS = ("flops", "hbm_bytes", "wire_bytes")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_name(ins: "Instr") -> str:
  """The op_name of an instruction's metadata (JAX's named scopes and transforms, '/'
  separated), or ''."""
  m = _OP_NAME.search(ins.attrs)
  return m.group(1) if m else ""


class _Walker:
  def __init__(self, text: str, hbm_only: bool = True, scope_of=None):
    self.comps, self.entry = parse_hlo(text)
    self.roots = _roots(text)
    self.hbm_only = hbm_only
    self.scope_of = scope_of

  def _scope(self, out: Costs, ins: "Instr", field: str, value: float) -> None:
    if self.scope_of is not None and value:
      out.scoped(self.scope_of(op_name(ins), ins.op), field, value)

  def shape(self, comp: str, name: str) -> list:
    ins = self.comps[comp].get(name)
    return _arrays(ins.type) if ins is not None else []

  def trip_count(self, comp: str, ins: Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if m:
      return int(m.group(1))
    cond = self.comps.get(_attr(ins.attrs, "condition") or "")
    if not cond:
      return None
    root = next((i for i in cond.values() if i.op == "compare"), None)
    if root is None or len(root.operands) != 2:
      return None
    direction = re.search(r"direction=(\w+)", root.attrs)
    a, b = (cond.get(n) for n in root.operands)
    if a is None or b is None:
      return None
    if a.op == "constant":
      a, b = b, a
      flip = {"GT": "LT", "GE": "LE"}
    else:
      flip = {}
    d = direction.group(1) if direction else ""
    d = flip.get(d, d)
    if a.op != "get-tuple-element" or b.op != "constant" or d not in ("LT", "LE"):
      return None
    limit = re.fullmatch(r"\s*(-?\d+)\s*", b.args)
    index = re.search(r"index=(\d+)", a.attrs)
    if not limit or not index:
      return None
    start = 0
    init = self.comps[comp].get(ins.operands[0]) if ins.operands else None
    if init is not None and init.op == "tuple":
      k = int(index.group(1))
      first = self.comps[comp].get(init.operands[k]) if k < len(init.operands) else None
      while first is not None and first.op in ("copy", "bitcast", "copy-done") and first.operands:
        first = self.comps[comp].get(first.operands[0])      # the value a copy chain carries
      if first is None or first.op != "constant":
        return None
      s = re.fullmatch(r"\s*(-?\d+)\s*", first.args)
      if not s:
        return None
      start = int(s.group(1))
    n = int(limit.group(1)) - start + (1 if d == "LE" else 0)
    return max(n, 0)

  @functools.lru_cache(maxsize=None)
  def cost(self, comp: str, fused: bool = False, as_scatter: bool = False) -> Costs:
    out = Costs()
    table = self.comps.get(comp, {})
    for ins in table.values():
      op = ins.op
      if op == "dot":
        lhs = self.shape(comp, ins.operands[0]) if ins.operands else []
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        if lhs and m:
          dims = lhs[0][1]
          k = math.prod(dims[int(i)] for i in m.group(1).split(",") if i)
          f = 2.0 * sum(math.prod(d) for _, d in _arrays(ins.type)) * k
          out.flops += f
          self._scope(out, ins, "flops", f)
      elif op == "convolution" and len(ins.operands) > 1:
        lhs, rhs = self.shape(comp, ins.operands[0]), self.shape(comp, ins.operands[1])
        res = _arrays(ins.type)
        if lhs and rhs and res:
          f = _conv_flops(lhs[0][1], rhs[0][1], res[0][1], ins.attrs)
          out.flops += f
          self._scope(out, ins, "flops", f)
      if op == "while":
        n = self.trip_count(comp, ins)
        if n is None:
          out.unknown_trip_loops += 1
          n = 1
        for key in ("body", "condition"):
          called = _attr(ins.attrs, key)
          if called:
            out.add(self.cost(called), n)
      elif op == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
        names += [x for x in (_attr(ins.attrs, "true_computation"),
                              _attr(ins.attrs, "false_computation")) if x]
        if names:
          out.add(max((self.cost(n) for n in names), key=lambda c: c.flops + c.hbm_bytes))
      elif op in ("call", "async-start", "fusion"):
        called = _attr(ins.attrs, "calls") or _attr(ins.attrs, "to_apply")
        if called:
          out.add(self.cost(called, fused or op == "fusion",
                            as_scatter=called.startswith("all-reduce-scatter")))
      kind = _KIND.get(op)
      if kind is not None:
        if kind == "all-reduce" and as_scatter:
          kind = "reduce-scatter"
        n = _group_size(ins.attrs)
        if kind == "reduce-scatter" and ins.operands:
          size = sum(_dtype_bytes(dt) * math.prod(d) for dt, d in self.shape(comp,
                                                                              ins.operands[0]))
        else:
          size = max((_dtype_bytes(dt) * math.prod(d) for dt, d in _arrays(ins.type)),
                     default=0)
        factor = {"all-reduce": 2 * (n - 1) / n, "permute": 1.0}.get(kind, (n - 1) / n)
        c = out.collectives.setdefault(kind, {"count": 0, "bytes": 0.0, "wire_bytes": 0.0})
        c["count"] += 1
        c["bytes"] += size
        c["wire_bytes"] += size * factor
        self._scope(out, ins, "wire_bytes", size * factor)
      if op == "send" and "xla_megascale" in ins.attrs:
        m = re.search(r'_xla_host_transfer_rendezvous="([a-z\-]+)', ins.attrs)
        src = _KIND.get(m.group(1).rstrip("-"), m.group(1)) if m else "unknown"
        data = _arrays(ins.type)[:1]
        out.dcn[src] = out.dcn.get(src, 0.0) + sum(
            _dtype_bytes(dt) * math.prod(d) for dt, d in data)
      target = re.search(r'custom_call_target="([^"]+)"', ins.attrs) if op == "custom-call" else None
      kernel = None
      if target and target.group(1) in PALLAS_TARGETS:
        kernel = _kernel_costs(ins)
        if kernel is None:
          c = out.custom_calls.setdefault(target.group(1), {"count": 0, "output_bytes": 0.0})
          c["count"] += 1
          c["output_bytes"] += type_bytes(ins.type)
        else:
          name, flops, nbytes = kernel
          c = out.kernels.setdefault(name, {"count": 0, "flops": 0.0, "hbm_bytes": 0.0})
          c["count"] += 1
          c["flops"] += flops
          c["hbm_bytes"] += nbytes
          out.flops += flops
          self._scope(out, ins, "flops", flops)
          if not fused:
            out.hbm_bytes += nbytes
            self._scope(out, ins, "hbm_bytes", nbytes)
      allocates = target is not None and target.group(1) in ALLOCATE_TARGETS
      if not fused and op not in _FREE and kernel is None and not allocates:
        b = self.boundary_bytes(comp, ins)
        out.hbm_bytes += b
        self._scope(out, ins, "hbm_bytes", b)
    return out

  def _sliced_reads(self, body: dict, name: str, users: dict, depth: int = 0) -> float | None:
    """Bytes a fusion reads of its value `name` when every use of it ends in a slice or a
    gather (operand 0), possibly through element-wise relayouts on the way (bitcast, copy,
    convert, a nested loop fusion of it alone): a loop fusion computes only its output's
    elements, so a scanned layer's slice of relaid stacked weights reads that slice, not
    the stack. None when some use reads it whole."""
    us = users.get(name, [])
    if not us or depth > 8:
      return None
    total = 0.0
    for u in us:
      if u.op in ("dynamic-slice", "gather") and u.operands[0] == name:
        total += type_bytes(u.type)
        continue
      loop = u.op == "fusion" and "kind=kLoop" in u.attrs
      got = self._nested_reads(u, name, depth + 1) if loop else None
      through = u.op in ("bitcast", "copy", "convert") or (loop and len(u.operands) == 1)
      if got is None and through:
        got = self._sliced_reads(body, u.name, users, depth + 1)
      if got is None:
        return None
      total += got
    return total

  def _nested_reads(self, fusion: Instr, name: str, depth: int) -> float | None:
    """What a nested loop fusion reads of its operand `name`, when inside it that
    parameter only reaches slices or gathers (the slice of a scanned layer's weights with
    its index, fused into the matmul's operand); None otherwise."""
    body = self.comps.get(_attr(fusion.attrs, "calls") or "")
    if not body:
      return None
    params, users = _params_and_users(body)
    total = 0.0
    for k, o in enumerate(fusion.operands):
      if o != name:
        continue
      got = self._sliced_reads(body, params[k], users, depth) if k in params else None
      if got is None:
        return None
      total += got
    return total

  def boundary_bytes(self, comp: str, ins: Instr) -> float:
    """HBM bytes an instruction reads and writes. Slicing reads only its slice, a gather
    only the rows it gathers (a paged decode reads its pages, not the pool), and an
    in-place dynamic-update-slice or scatter writes only its update (a scanned layer reads
    its own weights, not the whole stack), inside a fusion as on its own. Operands and
    results the compiler placed on chip (a memory space other than 0) cost no HBM bytes."""
    table = self.comps[comp]
    typ = lambda name: table[name].type if name in table else ""
    hbm = hbm_bytes if self.hbm_only else type_bytes
    where = in_hbm if self.hbm_only else (lambda t: True)
    size = lambda name: hbm(typ(name))
    here = lambda name: where(typ(name))
    out_here = where(ins.type)
    if ins.op == "dynamic-slice":
      return type_bytes(ins.type) * (here(ins.operands[0]) + out_here)
    if ins.op == "gather" and len(ins.operands) > 1:
      return type_bytes(ins.type) * (here(ins.operands[0]) + out_here) + size(ins.operands[1])
    if ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
      return size(ins.operands[1]) + type_bytes(typ(ins.operands[1])) * here(ins.operands[0])
    if ins.op == "scatter" and len(ins.operands) == 3:
      return (size(ins.operands[2]) + size(ins.operands[1])
              + type_bytes(typ(ins.operands[2])) * here(ins.operands[0]))
    if ins.op == "copy-start" and self.hbm_only:   # (destination, source, context)
      arrays = _hbm_arrays(ins.type)
      return sum(size(o) for o in ins.operands) + (arrays[0][0] if arrays and arrays[0][1]
                                                   else 0.0)
    called = _attr(ins.attrs, "calls") if ins.op == "fusion" else None
    body = self.comps.get(called or "")
    if not body:
      return hbm(ins.type) + sum(size(o) for o in ins.operands)
    params, users = _params_and_users(body)
    total = 0.0
    for k, o in enumerate(ins.operands):
      if not here(o):
        continue
      p = params.get(k)
      us = users.get(p, []) if p else []
      sliced = self._sliced_reads(body, p, users) if p else None
      if sliced is not None:
        total += sliced
      elif us and all(_in_place(u) and u.operands[0] == p for u in us):
        total += sum(type_bytes(body[_update(u)].type) for u in us if _update(u) in body)
      else:
        total += size(o)
    root = body.get(self.roots.get(called, ""))
    outs = ([body.get(n) for n in root.operands] if root is not None and root.op == "tuple"
            else [root])
    spaces = [h or not self.hbm_only for _, h in _hbm_arrays(ins.type)]
    for j, r in enumerate(outs):
      if r is None or (len(spaces) == len(outs) and not spaces[j]):
        continue
      if _in_place(r) and _update(r) in body:
        total += type_bytes(body[_update(r)].type)
      else:
        total += type_bytes(r.type)
    return total


def _params_and_users(body: dict) -> tuple[dict[int, str], dict[str, list[Instr]]]:
  """A computation's parameters by number, and each value's users."""
  params = {int(i.args): i.name for i in body.values() if i.op == "parameter"
            and i.args.strip().isdigit()}
  users: dict[str, list[Instr]] = {}
  for i in body.values():
    for o in i.operands:
      users.setdefault(o, []).append(i)
  return params, users


def _in_place(ins: Instr) -> bool:
  """An update XLA does in the buffer of its operand 0: a dynamic-update-slice, or a
  scatter of one operand (operand, indices, updates); it touches only the update."""
  return ((ins.op == "dynamic-update-slice" and len(ins.operands) > 1)
          or (ins.op == "scatter" and len(ins.operands) == 3))


def _update(ins: Instr) -> str:
  return ins.operands[1] if ins.op == "dynamic-update-slice" else ins.operands[2]


def program_costs(hlo_text: str, hbm_only: bool = True, scope_of=None) -> Costs:
  """Per-chip costs of a compiled SPMD module's text (see the module docstring).
  hbm_only=False counts on-chip buffers (memory spaces other than 0) as memory traffic
  too, as XLA's own cost analysis does. scope_of(op_name, opcode) -> a scope name: the
  FLOPs, HBM bytes and collective wire bytes are also added up per scope (Costs.scopes),
  each instruction's by its own metadata (a fusion's bytes by the fusion's, the matmuls
  inside it by theirs)."""
  w = _Walker(hlo_text, hbm_only, scope_of)
  return w.cost(w.entry)


def roofline(costs: Costs, generation: str, model_flops: float | None = None) -> dict:
  """Times at `generation`'s peak rates, the dominant bound, the step time (their max) and
  the MFU (model_flops per chip / (step time x peak); without it, the compiled FLOPs')."""
  chip = CHIPS.get(generation)
  ici_wire = sum(c["wire_bytes"] for c in costs.collectives.values())
  dcn = sum(costs.dcn.values())
  out = {"flops_per_chip": costs.flops, "hbm_bytes_per_chip": costs.hbm_bytes,
         "collectives": {k: {f: round(v) if f != "count" else int(v) for f, v in c.items()}
                         for k, c in sorted(costs.collectives.items())},
         "ici_wire_bytes_per_chip": ici_wire, "dcn_bytes_per_chip": dcn,
         "dcn_by_collective": {k: round(v) for k, v in sorted(costs.dcn.items())},
         "pallas_kernels": {k: {"count": int(v["count"]), "flops": v["flops"],
                                "hbm_bytes": v["hbm_bytes"]}
                            for k, v in sorted(costs.kernels.items())},
         "not_counted": {"custom_calls": {k: {"count": int(v["count"]),
                                              "output_bytes": round(v["output_bytes"])}
                                          for k, v in costs.custom_calls.items()},
                         "loops_of_unknown_trip_count": costs.unknown_trip_loops}}
  if chip is None:
    out["note"] = f"no peak rates for {generation} (known: {', '.join(CHIPS)})"
    return out
  times = {"compute": costs.flops / chip["bf16_flops"],
           "hbm": costs.hbm_bytes / chip["hbm_bytes_s"],
           "ici": ici_wire / chip["ici_bytes_s"],
           "dcn": dcn / chip["dcn_bytes_s"]}
  step = max(times.values())
  useful = model_flops if model_flops is not None else costs.flops
  out.update(chip={**chip, "source": CHIP_SOURCE}, seconds=times, step_time_s=step,
             bound=max(times, key=times.get), model_flops_per_chip=model_flops,
             mfu=(useful / (step * chip["bf16_flops"])) if step > 0 else None)
  return out


def format_roofline(r: dict) -> str:
  """A few lines for compile's text report."""
  if "seconds" not in r:
    return f"roofline      {r.get('note', '')}"
  s = r["seconds"]
  ms = lambda t: f"{t * 1e3:.3f} ms"
  lines = [f"roofline      {ms(r['step_time_s'])} per step, {r['bound']}-bound"
           + (f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "")
           + f"  (compute {ms(s['compute'])}, HBM {ms(s['hbm'])}, ICI {ms(s['ici'])}, "
           f"DCN {ms(s['dcn'])})"]
  coll = ", ".join(f"{k} {v['wire_bytes'] / 2**30:.3f} GiB x{v['count']}"
                   for k, v in r["collectives"].items())
  if coll:
    lines.append(f"collectives   per chip on the wire: {coll}")
  if r["dcn_bytes_per_chip"]:
    by = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in r["dcn_by_collective"].items())
    lines.append(f"DCN           {r['dcn_bytes_per_chip'] / 2**20:.2f} MiB per chip ({by})")
  if r.get("pallas_kernels"):
    pk = ", ".join(f"{k} x{v['count']} ({v['flops'] / 1e12:.3f} TFLOP, "
                   f"{v['hbm_bytes'] / 1e9:.2f} GB)" for k, v in r["pallas_kernels"].items())
    lines.append(f"Pallas        from the kernels' cost estimates, per chip: {pk}")
  nc = r["not_counted"]
  if nc["custom_calls"] or nc["loops_of_unknown_trip_count"]:
    cc = ", ".join(f"{k} x{v['count']}" for k, v in nc["custom_calls"].items())
    lines.append(f"not counted   custom calls without a cost estimate: {cc or 'none'}; loops "
                 f"of unknown trip count counted once: {nc['loops_of_unknown_trip_count']}")
  return "\n".join(lines)


__all__ = ["CHIPS", "CHIP_SOURCE", "PALLAS_TARGETS", "COLLECTIVES", "Costs", "parse_hlo", "type_bytes",
           "hbm_bytes", "in_hbm",
           "program_costs", "roofline", "format_roofline"]
