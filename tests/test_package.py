"""The project as a package: pyproject.toml agrees with requirements.txt, `pip install .`
gives importable packages and the `k3` script, and no module edits sys.path."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins(lines) -> dict[str, str]:
  out = {}
  for line in lines:
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      out[re.sub(r"\[.*\]", "", name).lower().replace("_", "-")] = version.strip()
  return out


def test_pyproject_pins_equal_requirements():
  project = PYPROJECT["project"]
  declared = [*project["dependencies"],
              *(d for group in project["optional-dependencies"].values() for d in group)]
  assert _pins(declared) == _pins((ROOT / "requirements.txt").read_text().splitlines())


def test_every_top_level_package_is_shipped():
  packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"benchmarks"}
  assert packages == {"k3_jax", "configs", "sharding", "pallas_kernels"}
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
  for name in ("k3_jax", "configs", "sharding", "pallas_kernels"):
    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
  r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                      "--no-build-isolation", "--target", str(target), str(src)],
                     capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  env = dict(os.environ, PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
  code = ("import k3_jax, configs, sharding, pallas_kernels, main; "
          "print(main.__file__, configs.__file__)")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     cwd=tmp_path, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert all(p.startswith(str(target)) for p in r.stdout.split())
  r = subprocess.run([str(target / "bin" / "k3"), "--help"], capture_output=True, text=True,
                     env=env, cwd=tmp_path, timeout=120)
  assert r.returncode == 0 and "generate" in r.stdout and "compile" in r.stdout
