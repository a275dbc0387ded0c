"""The serving package's shape, kept: the engine and the server stay short loops over their
parts (planner, runner, output stage, KV manager; engine client and one handler per
endpoint), and no function in serve/ grows past a screen. Parsing only: no import."""

import ast
import pathlib

SERVE = pathlib.Path(__file__).resolve().parents[2] / "k3_jax" / "serve"
MAX_MODULE_LINES = {"engine.py": 400, "server.py": 400}
MAX_FUNCTION_LINES = 80


def test_engine_and_server_stay_short():
  for name, limit in MAX_MODULE_LINES.items():
    n = len((SERVE / name).read_text().splitlines())
    assert n < limit, f"serve/{name} has {n} lines; keep it under {limit} (move a part out)"


def test_no_function_over_a_screen():
  long = []
  for path in sorted(SERVE.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1
        if n > MAX_FUNCTION_LINES:
          long.append(f"serve/{path.name}:{node.lineno} {node.name} ({n} lines)")
  assert not long, long
