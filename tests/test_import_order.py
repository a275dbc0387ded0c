"""The dependency order of DESIGN.md, enforced: every import of every project module (those
inside functions too) must point down the table below, and no import chain may close a
circle between modules.

Parsing only (ast): nothing is imported, so the test takes well under a second.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Project code the order covers (tests/ and benchmarks/ may import anything).
SOURCES = ("main.py", "k3_jax", "sharding", "pod", "configs", "pallas_kernels")

# Groups of modules, by path prefix (first match wins, so specific prefixes come first).
GROUPS = (
    ("cli", ("main.py",)),
    ("jobs", ("k3_jax/train.py", "k3_jax/train_state.py", "k3_jax/captions.py", "k3_jax/serve/",
              "k3_jax/checkpoint/", "k3_jax/compile.py", "k3_jax/frontier.py", "k3_jax/step_costs.py",
              "k3_jax/info.py", "k3_jax/faults.py", "k3_jax/goodput.py",
              "k3_jax/profiling.py", "k3_jax/summaries.py")),
    ("sharding", ("sharding/",)),
    ("pod", ("pod/",)),
    ("model", ("k3_jax/model.py",)),
    ("data", ("k3_jax/data/",)),
    ("optim", ("k3_jax/optim/",)),
    ("layers", ("k3_jax/layers/", "k3_jax/vision/")),
    ("ops", ("k3_jax/ops/", "pallas_kernels/")),
    ("base", ("k3_jax/config.py", "k3_jax/execution.py", "k3_jax/partitioning.py",
              "k3_jax/__init__.py", "k3_jax/stack.py", "k3_jax/cache.py", "configs/")),
)

# Which groups each group may import (besides its own). DESIGN.md:
#   main.py -> jobs (train, serve/, checkpoint/, compile) -> sharding/ -> model -> layers
#   (and vision/) -> ops + pallas_kernels -> config, partitioning, configs/;
#   data/ and optim/ sit beside the model and import only config/ops/partitioning;
#   sharding/ builds partitioning.Parallel values and imports only ops/partitioning/config;
#   pod/ (topologies, multi-host start-up, AOT compile reports, the roofline) sits beside
#   sharding/, knows devices and compiled programs only, and imports only config.
BELOW = {
    "cli": {"jobs", "sharding", "pod", "model", "data", "optim", "layers", "ops", "base"},
    "jobs": {"sharding", "pod", "model", "data", "optim", "layers", "ops", "base"},
    "sharding": {"ops", "base"},
    "pod": {"base"},
    "model": {"layers", "ops", "base"},
    "data": {"ops", "base"},
    "optim": {"ops", "base"},
    "layers": {"ops", "base"},
    "ops": {"base"},
    "base": set(),
}


@functools.lru_cache(maxsize=None)
def parse(path: str) -> ast.Module:
  return ast.parse((ROOT / path).read_text(), filename=path)


def project_files() -> list[str]:
  out = []
  for src in SOURCES:
    p = ROOT / src
    files = [p] if p.is_file() else sorted(p.rglob("*.py"))
    out += [f.relative_to(ROOT).as_posix() for f in files]
  return out


def group_of(path: str) -> str:
  for name, prefixes in GROUPS:
    if any(path == p or (p.endswith("/") and path.startswith(p)) for p in prefixes):
      return name
  raise AssertionError(f"{path} is in no group of the import order; add it to GROUPS")


def module_file(dotted: str, files: set[str]) -> str | None:
  """The project file of module `dotted` (a module or a package's __init__), else None."""
  base = dotted.replace(".", "/")
  for cand in (base + ".py", base + "/__init__.py"):
    if cand in files:
      return cand
  return None


def imports_of(path: str, files: set[str]) -> set[str]:
  """Project files `path` imports, anywhere in it. `from a.b import c` counts as an import
  of module a.b.c when that is a module, else of a.b (the module the name comes from)."""
  tree = parse(path)
  package = path.rsplit("/", 1)[0].replace("/", ".") if "/" in path else ""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:                                   # relative: from the file's package
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        mod = ".".join([p for p in parts if p] + ([mod] if mod else []))
      targets = []
      for a in node.names:
        sub = module_file(f"{mod}.{a.name}", files)
        targets.append(f"{mod}.{a.name}" if sub else mod)
    else:
      continue
    for t in targets:
      f = module_file(t, files)
      if f is not None and f != path:
        out.add(f)
  return out


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, frozenset[str]]:
  files = project_files()
  fset = set(files)
  return {f: frozenset(imports_of(f, fset)) for f in files}


def upward_edges(graph) -> list[str]:
  bad = []
  for a, targets in sorted(graph.items()):
    ga = group_of(a)
    for b in sorted(targets):
      gb = group_of(b)
      if gb != ga and gb not in BELOW[ga]:
        bad.append(f"{a} -> {b}   ({ga} may not import {gb})")
  return bad


def cycles(graph) -> list[list[str]]:
  """Module-level import cycles (strongly connected components of > 1 file), each sorted."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):                                        # Tarjan's SCC (graph is small)
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_every_import_points_down_the_declared_order():
  graph = import_graph()
  assert len(graph) > 40 and sum(map(len, graph.values())) > 80   # the walk saw the tree
  bad = upward_edges(graph)
  assert not bad, "imports against DESIGN.md's order:\n  " + "\n  ".join(bad)


def test_no_import_cycles():
  found = cycles(import_graph())
  assert not found, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def private_imports(path: str) -> list[str]:
  """`from <project module> import _name` in `path`: a private name used across modules."""
  tree = parse(path)
  roots = {s.split("/")[0].removesuffix(".py") for s in SOURCES}
  return [f"{path}: from {n.module} import {a.name}" for n in ast.walk(tree)
          if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in roots
          for a in n.names if a.name.startswith("_")]


def test_checkpoint_never_imports_training():
  """checkpoint/ builds train states (import, sharded loading) from train_state.py and
  writes the run's train config itself; it never imports train.py (the steps and the loop),
  directly or through another module."""
  graph = import_graph()
  seen, todo = set(), [f for f in graph if f.startswith("k3_jax/checkpoint/")]
  while todo:
    f = todo.pop()
    if f not in seen:
      seen.add(f)
      todo += graph.get(f, ())
  assert "k3_jax/train.py" not in seen, "checkpoint/ reaches k3_jax/train.py"


def test_no_private_names_cross_modules():
  """Kernels and parallel ops share what they need through public names (e.g.
  k3_jax/ops/kda/common.py), never another module's private helpers."""
  bad = [line for f in project_files() for line in private_imports(f)]
  assert not bad, "private names imported across modules:\n  " + "\n  ".join(bad)


def test_the_checker_sees_violations():
  """The checks themselves: a made-up upward edge (ops -> model, even inside a function) and
  a made-up circle are both reported, with the file pair."""
  files = {"k3_jax/ops/x.py", "k3_jax/model.py", "k3_jax/layers/y.py"}
  src = "def f():\n  from k3_jax import model\n"
  tree_targets = set()
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.ImportFrom):
      for a in node.names:
        tree_targets.add(module_file(f"{node.module}.{a.name}", files))
  graph = {"k3_jax/ops/x.py": tree_targets, "k3_jax/model.py": {"k3_jax/layers/y.py"},
           "k3_jax/layers/y.py": {"k3_jax/ops/x.py"}}
  assert upward_edges(graph) == [
      "k3_jax/ops/x.py -> k3_jax/model.py   (ops may not import model)"]
  assert cycles(graph) == [sorted(graph)]
