"""Train and prefill tokens/s of this project vs Hugging Face transformers, same model, same run.

  python -m benchmarks.vs_transformers [--steps N] [--batch B] [--seq T] [--prefill-runs N]
                                        [--json out.json] [--set kda_chunk_size=16 ...]

The configuration is issue #17's 15.01M-parameter Kimi-Linear model: vocab 512, d 256,
8 layers [KDA, KDA, KDA, MLA] x 2, a dense first layer of width 1024, KDA 4 heads x 64 with
rank-64 gates, MLA 4 heads (kv_lora 64, nope 32, rope 16, v 32, no query low rank), 16
experts top-4 of width 128 + 1 shared expert. transformers' KimiLinearForCausalLM is built
with random weights (tests/hf_reference.redraw, as in the parity test: scales where every
path matters, uneven routing), saved with save_pretrained and imported here with
k3_jax.checkpoint.convert: both sides start from the same weights.

Training: batch B x T tokens (default 4 x 512), next-token cross-entropy (mean), AdamW
(lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.01; same on both sides), FP32. The two
implementations take steps ALTERNATELY on the same batches (one step of ours, one of
transformers, ...) so a slow or busy moment of the machine hits both; each step's loss is
printed for both so equal work is visible (losses agree to ~1e-5 at step 0 and drift
slowly with float rounding). Step 0 of ours includes compilation and is not timed; step 0
of transformers is likewise a warm-up. tokens/s = B*T / median step time.

Prefill: forward only (no gradients) on the same batch, median of --prefill-runs calls,
again alternating.

Extra --set items are OUR execution settings (k3_jax/execution.py ExecConfig fields, e.g.
--set kda_chunk_size=16 or --set gmm=ragged_dot); they never change the parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from k3_jax.checkpoint import convert  # noqa: E402
from k3_jax.execution import ExecConfig, apply_run_overrides, split_overrides  # noqa: E402
from k3_jax.partitioning import Parallel  # noqa: E402
from tests.hf_reference import kimi_linear_config, redraw  # noqa: E402

VOCAB = 512
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.01


def hf_config():
  return kimi_linear_config(vocab=VOCAB, d=256, dense=1024, expert=128, layers=8, heads=4,
                            kv_lora=64, rope=16, nope=32, v=32, experts=16, top_k=4,
                            kda_heads=4, kda_dim=64, full_attn_layers=[4, 8],
                            tie_word_embeddings=False)


def build_pair(tmpdir, hf_experts="grouped_mm"):
  torch.manual_seed(0)
  hf = transformers.KimiLinearForCausalLM(hf_config())
  redraw(hf)
  hf.save_pretrained(tmpdir)
  if hf_experts != "grouped_mm":
    hf = transformers.KimiLinearForCausalLM.from_pretrained(
        tmpdir, experts_implementation=hf_experts)
  cfg, flat = convert.load_flat(tmpdir)
  ours = convert.model_from_flat(cfg, flat)
  return hf.train(), cfg, ours


def our_steps(ours, par: Parallel):
  graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
  opt = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)

  def loss_fn(p, inputs, targets):
    logits, _, _ = nnx.merge(graphdef, p, rest)(inputs, par=par)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @jax.jit
  def train(p, o, inputs, targets):
    loss, g = jax.value_and_grad(loss_fn)(p, inputs, targets)
    upd, o = opt.update(g, o, p)
    return optax.apply_updates(p, upd), o, loss

  @jax.jit
  def prefill(p, inputs):
    return nnx.merge(graphdef, p, rest)(inputs, par=par)[0]

  return params, opt.init(params), train, prefill


def hf_steps(hf):
  opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)

  def train(inputs, targets):
    opt.zero_grad(set_to_none=True)
    logits = hf(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    opt.step()
    return float(loss.detach())

  def prefill(inputs):
    with torch.no_grad():
      return hf(inputs, use_cache=False).logits

  return train, prefill


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=6, help="train steps per side (first = warm-up)")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--prefill-runs", type=int, default=3)
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="OUR execution setting (an ExecConfig field, e.g. kda_chunk_size=16)")
  ap.add_argument("--hf-experts", default="grouped_mm", choices=("grouped_mm", "eager"),
                  help="transformers' routed-expert implementation (its default: grouped_mm)")
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  if a.steps < 2:
    ap.error("--steps must be >= 2 (the first step is a warm-up)")

  with tempfile.TemporaryDirectory() as d:
    hf, cfg, ours = build_pair(d, a.hf_experts)
  model_over, run_over = split_overrides(a.set)
  if model_over:
    ap.error(f"--set {model_over}: not an execution setting (the model stays transformers')")
  kernels = apply_run_overrides(ExecConfig(), run_over).kernels
  n_params = sum(p.numel() for p in hf.parameters())
  print(f"model: {n_params / 1e6:.2f}M parameters; batch {a.batch} x {a.seq}; "
        f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); ours: kda_chunk_size={kernels.kda_chunk_size} "
        f"gmm={kernels.gmm}")

  rng = np.random.RandomState(0)
  batches = [rng.randint(0, VOCAB, (a.batch, a.seq + 1)) for _ in range(a.steps)]
  p, o, j_train, j_prefill = our_steps(ours, Parallel(kernels=kernels))
  h_train, h_prefill = hf_steps(hf)
  tok = a.batch * a.seq

  t_ours, t_hf = [], []
  print(f"{'step':>4} {'ours loss':>12} {'hf loss':>12} {'ours s':>8} {'hf s':>8}")
  for i, b in enumerate(batches):
    t0 = time.perf_counter()
    p, o, loss = j_train(p, o, jnp.asarray(b[:, :-1]), jnp.asarray(b[:, 1:]))
    loss = float(jax.block_until_ready(loss))
    t1 = time.perf_counter()
    hloss = h_train(torch.tensor(b[:, :-1]), torch.tensor(b[:, 1:]))
    t2 = time.perf_counter()
    if i:
      t_ours.append(t1 - t0)
      t_hf.append(t2 - t1)
    print(f"{i:>4} {loss:>12.6f} {hloss:>12.6f} {t1 - t0:>8.3f} {t2 - t1:>8.3f}"
          + ("  (warm-up)" if i == 0 else ""), flush=True)

  x = batches[0][:, :-1]
  jax.block_until_ready(j_prefill(p, jnp.asarray(x)))
  h_prefill(torch.tensor(x))
  f_ours, f_hf = [], []
  for _ in range(a.prefill_runs):
    t0 = time.perf_counter()
    jax.block_until_ready(j_prefill(p, jnp.asarray(x)))
    t1 = time.perf_counter()
    h_prefill(torch.tensor(x))
    f_ours.append(t1 - t0)
    f_hf.append(time.perf_counter() - t1)

  res = {"params": n_params, "batch": a.batch, "seq": a.seq, "overrides": a.set,
         "train_tok_s": {"ours": tok / statistics.median(t_ours),
                         "transformers": tok / statistics.median(t_hf)},
         "prefill_tok_s": {"ours": tok / statistics.median(f_ours),
                           "transformers": tok / statistics.median(f_hf)}}
  print("\n| pass | this project tok/s | transformers tok/s | ratio |\n|---|---|---|---|")
  for k, name in (("train_tok_s", "train (fwd+bwd+AdamW)"), ("prefill_tok_s", "prefill (fwd)")):
    r = res[k]
    print(f"| {name} | {r['ours']:.0f} | {r['transformers']:.0f} | "
          f"{r['ours'] / r['transformers']:.2f}x |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=2)
  return res


if __name__ == "__main__":
  main()
