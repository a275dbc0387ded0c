"""The project as a package: pyproject.toml agrees with requirements.txt and
requirements-test.txt, every import is pinned by the file its code is installed with, `pip
install .` gives importable packages and the `k3` script, and no module edits sys.path."""

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", re.sub(r"\[.*\]", "", name)).lower()


def _pins(lines) -> dict[str, str]:
  out = {}
  for line in lines:
    line = line.split("#")[0].strip()
    if line and not line.startswith("-"):
      name, version = line.split("==")
      out[_norm(name)] = version.strip()
  return out


def _file_pins(name: str) -> dict[str, str]:
  return _pins((ROOT / name).read_text().splitlines())


def test_pyproject_pins_equal_requirements():
  """requirements.txt is the package's dependencies; requirements-test.txt is those (through
  `-r requirements.txt`) plus the `test` and `bench` extras, so the README's first command
  installs only what the commands need and its second what the tests need."""
  project = PYPROJECT["project"]
  extras = project["optional-dependencies"]
  assert set(extras) == {"test", "bench"}
  assert _pins(project["dependencies"]) == _file_pins("requirements.txt")
  assert "-r requirements.txt" in (ROOT / "requirements-test.txt").read_text().splitlines()
  assert _pins([*extras["test"], *extras["bench"]]) == _file_pins("requirements-test.txt")
  assert not set(_file_pins("requirements.txt")) & set(_file_pins("requirements-test.txt"))


def _imports(paths) -> dict[str, str]:
  """Top-level module -> one file importing it (imports inside functions too)."""
  out = {}
  for base in paths:
    for p in sorted([base] if base.is_file() else base.rglob("*.py")):
      for n in ast.walk(ast.parse(p.read_text())):
        if isinstance(n, ast.Import):
          names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
          names = [n.module]
        else:
          continue
        for m in names:
          out.setdefault(m.split(".")[0], str(p.relative_to(ROOT)))
  return out


def test_every_import_is_pinned_where_its_code_is_installed():
  """A third-party module imported by the package is pinned in requirements.txt; one imported
  only by tests or benchmarks, in requirements-test.txt. Each directly, not through another
  package's dependencies (jsonschema once came only with whatever a machine had)."""
  local = ({p.stem for p in ROOT.rglob("*.py") if ".git" not in p.parts}
           | {p.name for p in ROOT.iterdir() if p.is_dir()} | {"__future__"})
  owners = metadata.packages_distributions()
  runtime, tests = _file_pins("requirements.txt"), _file_pins("requirements-test.txt")
  package = _imports([ROOT / d for d in ("k3_jax", "configs", "sharding", "pod", "pallas_kernels")]
                     + [ROOT / "main.py"])
  rest = _imports([ROOT / "tests", ROOT / "benchmarks"])
  missing = []
  for mods, pinned in ((package, runtime), (rest, {**runtime, **tests})):
    for m, where in mods.items():
      if m in local or m in sys.stdlib_module_names:
        continue
      dists = {_norm(d) for d in owners.get(m, [])}
      assert dists, f"{m} (imported by {where}) is not installed: pin it"
      if not dists & set(pinned):
        missing.append(f"{m} ({where}; from {sorted(dists)})")
  assert missing == [], "imported but not pinned where the code is installed: " + ", ".join(missing)


def test_every_top_level_package_is_shipped():
  packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"benchmarks"}
  assert packages == {"k3_jax", "configs", "sharding", "pod", "pallas_kernels"}
  include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
  assert packages <= set(include) and "k3_jax.*" in include
  assert PYPROJECT["project"]["scripts"]["k3"] == "main:run"


def test_no_module_edits_sys_path():
  offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if ".git" not in p.parts and "sys.path.insert" in p.read_text()
               and p.name != "test_package.py"]
  assert offenders == []


def test_pip_install_target_imports_and_runs_k3(tmp_path):
  """`pip install .` (no deps, no network: the installed setuptools builds it) into a plain
  folder; from elsewhere, the packages import from there and the `k3` script answers."""
  src, target = tmp_path / "src", tmp_path / "site"
  # A copy of what the package is built from (setuptools writes build/ beside its source).
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "main.py"):
    shutil.copy(ROOT / name, src / name)
  for name in ("k3_jax", "configs", "sharding", "pod", "pallas_kernels"):
    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
  r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                      "--no-build-isolation", "--target", str(target), str(src)],
                     capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  env = dict(os.environ, PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
  code = ("import k3_jax, configs, sharding, pod, pallas_kernels, main; "
          "print(main.__file__, configs.__file__)")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     cwd=tmp_path, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert all(p.startswith(str(target)) for p in r.stdout.split())
  r = subprocess.run([str(target / "bin" / "k3"), "--help"], capture_output=True, text=True,
                     env=env, cwd=tmp_path, timeout=120)
  assert r.returncode == 0 and "generate" in r.stdout and "compile" in r.stdout
