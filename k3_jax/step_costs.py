"""The train step's costs by part of the model: the compiled program's FLOPs, HBM bytes and
collective bytes per named scope, beside analytic counts of what each part must compute.

The model names its parts with `jax.named_scope` (embed, mixer/kda, mixer/mla, their
attention cores, moe/router, moe/routed_experts, ffn, lm_head, ...; train.py adds loss and
optimizer). JAX writes the scopes, and the transforms around them, into each instruction's
op_name metadata, which the compiled HLO keeps; `scope_of` maps an op_name to a part and
a phase:

- phase: `forward`; `backward` (under `transpose(...)`); `recompute` (the forward that
  remat runs again inside the backward: `rematted_computation`); `update` (optimizer).
- part: the innermost known scope (SCOPES, first match from the inside out).

`pod.roofline.program_costs(text, scope_of=scope_of)` then adds up every FLOP, HBM
byte and wire byte by (part, phase); `analytic_flops` gives the useful count per part.
"""

from __future__ import annotations

from k3_jax.config import ModelConfig

# (part, path fragment), tried in order against the op_name: the first fragment found wins,
# so inner scopes come before the scopes that contain them.
SCOPES = (
    ("optimizer", "/optimizer"),
    ("loss", "/loss"),
    ("moe_router", "/moe/router"),
    ("moe_experts", "/moe/routed_experts"),          # split below: matmuls vs the exchange
    ("moe_latent", "/moe/latent_"),
    ("moe_shared", "/moe/shared_experts"),
    ("moe_balance", "/moe/balance"),
    ("mla_attention_core", "/mla/attention"),
    ("kda_core", "/kda/chunk"),
    ("kda_conv", "/kda/conv"),
    ("mla_projections", "/mla"),
    ("kda_projections", "/kda"),
    ("dense_ffn", "/ffn"),
    ("norms_mixer", "/mixer"),
    ("embed", "/embed"),
    ("lm_head", "/lm_head"),
    ("attn_res", "attn_res"),
)
MATMULS = ("dot", "convolution", "custom-call")


def scope_of(name: str, opcode: str = "") -> str:
  """'part:phase' of an instruction from its op_name (see the module docstring). In the
  routed experts, matmuls are `moe_experts` and everything else (sorting, gathers,
  all-to-alls, scatter) `moe_dispatch_combine`."""
  if "/optimizer" in name:
    return "optimizer:update"
  phase = ("recompute" if "rematted_computation" in name else
           "backward" if "transpose(" in name else "forward")
  part = "other"
  path = name.replace("(", "/").replace(")", "/")     # jvp(lm_head) -> jvp/lm_head/
  for p, frag in SCOPES:
    if frag in path:
      part = p
      break
  if part == "moe_experts" and opcode not in MATMULS:
    part = "moe_dispatch_combine"
  return f"{part}:{phase}"


def by_part(scopes: dict) -> dict:
  """{part: {field: total, 'phases': {phase: fields}}} from Costs.scopes ('part:phase')."""
  out: dict = {}
  for key, fields in scopes.items():
    part, _, phase = key.partition(":")
    p = out.setdefault(part, {"flops": 0.0, "hbm_bytes": 0.0, "wire_bytes": 0.0,
                              "phases": {}})
    for f, v in fields.items():
      p[f] += v
    p["phases"][phase] = dict(fields)
  return dict(sorted(out.items(), key=lambda kv: -kv[1]["flops"]))


def analytic_flops(cfg: ModelConfig, tokens: int, seq_len: int, chips: int,
                   remat: str = "none", kda_chunk: int = 0) -> dict:
  """Useful FLOPs per chip of a train step by part: 2 per weight per token forward, x3 with
  the backward (x4 with remat's second forward, block or layer), the routed experts at
  top_k of num_experts, attention cores at the causal half of seq_len (KDA's at chunks of
  `kda_chunk`, 0: the TPU kernels' 64). Newton-Schulz and other optimizer work are not
  useful FLOPs (0 here)."""
  c = cfg
  d = c.d_model
  passes = 4 if remat in ("block", "layer") else 3
  n_mla = len(c.mla_layers)
  n_dense = len(c.dense_layers)
  n_kda = c.num_layers - n_mla
  n_moe = c.num_layers - n_dense
  m, k, e = c.mla, c.kda, c.moe
  hq = m.qk_nope_head_dim + m.qk_rope_head_dim
  mla_w = ((d * m.q_lora_rank + m.q_lora_rank * m.num_heads * hq) if m.q_lora_rank
           else d * m.num_heads * hq)
  mla_w += d * (m.kv_lora_rank + m.qk_rope_head_dim)
  mla_w += m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
  mla_w += m.num_heads * m.v_head_dim * d * (2 if m.output_gate else 1)  # o_proj (+ gate)
  kda_w = d * k.num_heads * k.head_dim * 5        # q, k, v, output gate, o_proj
  latent = e.latent_dim or d
  per = lambda weights, n_layers: 2.0 * weights * n_layers * tokens / chips
  out = {
      "embed": 0.0,
      "lm_head": per(d * c.vocab_size, 1) * 3,
      "mla_projections": per(mla_w, n_mla) * passes,
      "kda_projections": per(kda_w, n_kda) * passes,
      "dense_ffn": per(3 * d * c.dense_intermediate, n_dense) * passes,
      "moe_router": per(d * e.num_experts, n_moe) * passes,
      "moe_latent": per(2 * d * latent, n_moe) * passes if e.latent_dim else 0.0,
      "moe_shared": per(3 * d * e.expert_intermediate * e.num_shared_experts, n_moe) * passes,
      "moe_experts": per(3 * latent * e.expert_intermediate * e.top_k, n_moe) * passes,
      # causal attention: q.k and p.v over half the positions on average
      "mla_attention_core": (2.0 * 2 * m.num_heads * hq * seq_len / 2 * n_mla * tokens
                             / chips * passes),
      # the chunked delta rule: about 4 matmuls of [chunk, head_dim] x [head_dim, head_dim]
      # per chunk and head, and the intra-chunk [chunk, chunk] products
      "kda_core": (2.0 * k.num_heads * (4 * k.head_dim * k.head_dim
                                        + 2 * (kda_chunk or 64) * k.head_dim)
                   * n_kda * tokens / chips * passes),
  }
  return out


def format_parts(parts: dict, analytic: dict, useful: float | None = None) -> str:
  """A table: per part, counted TFLOP (forward / backward / recompute), analytic, ratio,
  HBM GB, wire GB (per chip)."""
  t = lambda x: f"{x / 1e12:10.2f}"
  lines = [f"{'part':22s} {'TFLOP/chip':>10s} {'fwd':>9s} {'bwd':>9s} {'remat':>9s} "
           f"{'analytic':>10s} {'x':>6s} {'HBM GB':>8s} {'wire GB':>8s}"]
  for name, p in parts.items():
    ph = p["phases"]
    f = lambda k: ph.get(k, {}).get("flops", 0.0) / 1e12
    a = analytic.get(name)
    ratio = f"{p['flops'] / a:6.1f}" if a else "     -"
    lines.append(f"{name:22s} {t(p['flops'])} {f('forward'):9.2f} {f('backward'):9.2f} "
                 f"{f('recompute'):9.2f} {t(a) if a is not None else ' ' * 10} {ratio} "
                 f"{p['hbm_bytes'] / 1e9:8.1f} {p['wire_bytes'] / 1e9:8.2f}")
  total = sum(p["flops"] for p in parts.values())
  lines.append(f"{'total':22s} {t(total)}" + (f"   useful (6 N tokens / chips) {t(useful)}, "
                                               f"{total / useful:.2f}x" if useful else ""))
  return "\n".join(lines)


__all__ = ["SCOPES", "scope_of", "by_part", "analytic_flops", "format_parts"]
