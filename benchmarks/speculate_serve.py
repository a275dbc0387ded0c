"""Speculative decoding through `serve`, as users run it: the default trained model on an
edit-like workload from its own eval split, with and without prompt lookup, side by side.

  python main.py train                      # the default job: k3_small -> runs/default
  flock /tmp/heavy.lock python -m benchmarks.speculate_serve [--workdir runs/default]

Workload: Python functions from the training data's held-out documents (the stdlib eval
split, data/sources.py), each 300-1,200 bytes; the prompt holds the function, then a
comment asking for it again under a new name and the renamed `def` line; the completion
(--new tokens, greedy, no stop) should restate it: the edit (a rename) is in the prompt,
the rest is the function's own text, which prompt lookup can draft (the default model, 180
steps, does not: its greedy output runs into indentation whitespace; docs/serving.md).

For each mode (`plain`: the server's defaults; `ngram`: plus --speculative=ngram
--num_speculative_tokens=K; `draft`, with --draft_dir: --speculative=draft, a draft
model's workdir) a `python main.py serve --workdir=DIR` process (all up at once) runs the
same requests, batch 1 (one at a time) and batch 8 (8 at once), all of them once to compile
every shape, then timed (--reps times, the modes' runs alternating, the fastest kept):
with max_tokens=new and with max_tokens=1 (prefill and first token), so decode tokens/s =
(new - 1) tokens a request over the difference. The prefix cache is off
(--prefix_cache_bytes=0) so every run prefills alike. The speculation
counters of /metrics give the drafts kept per verified request and step and the tokens a
request gets per verify step. Every ngram completion must equal plain's (greedy).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.serve import start_serve  # noqa: E402
from k3_jax.data.sources import stdlib_named_documents  # noqa: E402


def functions(n: int, lo: int = 300, hi: int = 1200) -> list[tuple[str, str]]:
  """(name, source) of the first n functions of lo..hi bytes in the eval split, by path."""
  out = []
  for _, text in stdlib_named_documents("eval"):
    try:
      tree = ast.parse(text)
    except (SyntaxError, ValueError):
      continue
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
      if (isinstance(node, ast.FunctionDef) and not node.decorator_list
          and not node.name.startswith("__")):
        src = "".join(lines[node.lineno - 1:node.end_lineno])
        if lo <= len(src.encode()) <= hi and src.isascii() and src.startswith(
            " " * node.col_offset + "def "):
          out.append((node.name, src))
          if len(out) == n:
            return out
  return out


def edit_prompt(name: str, src: str) -> str:
  """The function, then the request to restate it renamed, and the renamed def line."""
  indent = src[:len(src) - len(src.lstrip())]
  first = src.splitlines()[0]
  new = f"{name}_v2"
  return (f"{src}\n{indent}# {name}, again, renamed to {new}:\n"
          + re.sub(rf"\bdef {re.escape(name)}\b", f"def {new}", first, count=1) + "\n")


def post(base: str, prompt: str, new: int) -> str:
  import httpx
  model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
  r = httpx.post(f"{base}/v1/completions", timeout=600, json=dict(
      model=model, prompt=prompt, max_tokens=new, temperature=0.0))
  r.raise_for_status()
  return r.json()["choices"][0]["text"]


def run(base, prompts, new, batch):
  """All prompts, `batch` at a time -> (texts, seconds)."""
  from concurrent.futures import ThreadPoolExecutor
  t0 = time.perf_counter()
  with ThreadPoolExecutor(batch) as ex:
    texts = list(ex.map(lambda p: post(base, p, new), prompts))
  return texts, time.perf_counter() - t0


def counters(base) -> dict:
  import httpx
  out = {}
  for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
    m = re.match(r"(k3_spec_\w+?)(_total)? ([0-9.e+]+)$", line)
    if m:
      out[m.group(1)] = float(m.group(3))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default="runs/default")
  ap.add_argument("--k", type=int, default=4, help="--num_speculative_tokens")
  ap.add_argument("--new", type=int, default=128, help="completion tokens a request")
  ap.add_argument("--requests", type=int, default=8)
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--reps", type=int, default=2, help="timed runs a mode (the fastest kept)")
  ap.add_argument("--log_dir", default="/tmp")
  ap.add_argument("--draft_dir", default="",
                  help="a draft model's workdir: adds the mode `draft` (--speculative=draft)")
  ap.add_argument("--modes", default="plain,ngram,draft", help="which of the modes to run")
  args = ap.parse_args()
  workdir = os.path.abspath(args.workdir)
  funcs = functions(args.requests)
  prompts = [edit_prompt(n, s) for n, s in funcs]
  batches = [int(b) for b in args.batches.split(",")]
  print(f"{workdir}: {len(prompts)} functions of the eval split, prompts "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} bytes, {args.new} new tokens "
        f"each, greedy; k = {args.k}", flush=True)
  k = f"--num_speculative_tokens={args.k}"
  modes = {"plain": [], "ngram": ["--speculative=ngram", k],
           "draft": ["--speculative=draft", k,
                     f"--draft_dir={os.path.abspath(args.draft_dir or '.')}"]}
  modes = {m: f for m, f in modes.items() if m in args.modes.split(",")
           and (m != "draft" or args.draft_dir)}
  servers = {}
  try:
    for mode, flags in modes.items():          # all up at once: the runs below alternate
      servers[mode] = start_serve(None, [f"--workdir={workdir}", "--prefix_cache_bytes=0",
                                         *flags],
                                  os.path.join(args.log_dir, f"speculate_serve_{mode}.log"))
    got, texts = {}, {}
    for batch in batches:
      for mode, (_, base, _) in servers.items():
        run(base, prompts, args.new, batch)                  # compiles every shape
        run(base, prompts, 1, batch)
      for rep in range(args.reps):             # alternating, so load drifts hit every mode
        for mode, (_, base, _) in servers.items():
          before = counters(base)
          texts[mode, batch], t_new = run(base, prompts, args.new, batch)
          after = counters(base)
          _, t_one = run(base, prompts, 1, batch)
          spec = {k: after[k] - before.get(k, 0.0) for k in after}
          if (mode, batch) not in got or t_new < got[mode, batch][0]:
            got[mode, batch] = (t_new, t_one, spec)
  finally:
    for proc, _, _ in servers.values():
      proc.terminate()
      proc.wait(60)
  n = len(prompts)
  print(f"{'batch':>5} {'mode':>6} {'tok/s':>8} {'x':>6} {'decode tok/s':>13} {'x':>6} "
        f"{'verify steps':>12} {'kept/req/step':>14} {'tok/req/step':>13} same")
  for batch in batches:
    for mode in modes:
      t_new, t_one, spec = got[mode, batch]
      p_new, p_one, _ = got["plain", batch]
      tps, dps = n * args.new / t_new, n * (args.new - 1) / (t_new - t_one)
      ptps, pdps = n * args.new / p_new, n * (args.new - 1) / (p_new - p_one)
      rows = spec.get("k3_spec_verify_rows", 0.0)
      kept = spec.get("k3_spec_accepted_tokens", 0.0) / rows if rows else 0.0
      same = texts[mode, batch] == texts["plain", batch]
      print(f"{batch:>5} {mode:>6} {tps:>8.1f} {tps / ptps:>6.2f} {dps:>13.1f} "
            f"{dps / pdps:>6.2f} {int(spec.get('k3_spec_verify_steps', 0)):>12} "
            f"{kept:>14.2f} {(kept + 1) if rows else 1.0:>13.2f} {'yes' if same else 'NO'}",
            flush=True)


if __name__ == "__main__":
  main()
