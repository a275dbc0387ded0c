"""The Kimi-Linear-48B-A3B layout (docs/architecture.md section 11): `model_type` kimi_linear.

Tensor names, `model.layers.{i}.` with i 0-based (linear weights [out, in]):
  KDA   self_attn.{q,k,v}_proj, {q,k,v}_conv1d [H*K, 1, W], f_a_proj [K, d], f_b_proj
        [H*K, K], b_proj [H, d], g_a_proj, g_b_proj, A_log [1, 1, H, 1], dt_bias [H*K],
        o_norm [K], o_proj [d, H*V]
  MLA   self_attn.q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa,
        kv_a_layernorm, kv_b_proj [H*(nope+v), kv_lora], o_proj
  FFN   mlp.{gate,up,down}_proj (dense; transformers' own save_pretrained writes them under
        block_sparse_moe., which the importer also reads), block_sparse_moe.gate.weight [E, d],
        gate.e_score_correction_bias [E], experts.{e}.w1 (gate) / w3 (up) / w2 (down),
        shared_experts.{gate,up,down}_proj
  norms input_layernorm, post_attention_layernorm; model.embed_tokens, model.norm, lm_head

config.json: the release's fields (`linear_attn_config` with 1-based layer lists,
`first_k_dense_replace`); the transformers dialect (`layer_types`, `mlp_layer_types`) is
read too.
"""

from __future__ import annotations

import dataclasses

from k3_jax import stack
from k3_jax.checkpoint.layouts.common import Builder, dense_prefix
from k3_jax.checkpoint.layouts.entry import LayoutError
from k3_jax.config import (AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                           validate)

MODEL_TYPE = "kimi_linear"
PREFIX = ""
# transformers builds the MLA latent norms with its RMSNorm default eps, not rms_norm_eps
# (docs/architecture.md section 11); the importer follows the reference implementation.
HF_LATENT_NORM_EPS = 1e-6


def check_expressible(cfg: ModelConfig) -> None:
  k, m, e = cfg.kda, cfg.mla, cfg.moe
  rules = [
      (cfg.activation == "swiglu", "activation", cfg.activation, "Kimi Linear uses SwiGLU"),
      (k.decay == "softplus", "kda.decay", k.decay, "Kimi Linear uses the softplus decay"),
      (k.gate_rank == k.head_dim, "kda.gate_rank", k.gate_rank,
       f"the release's output gate is low rank with rank = head_dim ({k.head_dim})"),
      ((k.decay_rank or k.head_dim) == k.head_dim, "kda.decay_rank", k.decay_rank,
       f"the release's decay projection has rank = head_dim ({k.head_dim})"),
      (not m.output_gate, "mla.output_gate", m.output_gate, "Kimi Linear MLA has no output gate"),
      (e.latent_dim == 0, "moe.latent_dim", e.latent_dim, "Kimi Linear MoE is not latent"),
      (e.num_shared_experts > 0, "moe.num_shared_experts", e.num_shared_experts,
       "the release always has shared experts"),
      (not cfg.attn_res.enabled, "attn_res.enabled", True, "Kimi Linear has no AttnRes"),
  ]
  for ok, name, value, why in rules:
    if not ok:
      raise LayoutError(f"the kimi_linear layout cannot express {name}={value!r}: {why}")
  dense_prefix(cfg)


def add_kda(b: Builder, name: str, base: tuple, idx: tuple, lowrank_gate: bool) -> None:
  """The KDA tensors both layouts share (the output gate is low-rank in Kimi Linear)."""
  h, k = b.cfg.kda.num_heads, b.cfg.kda.head_dim
  for p in ("q", "k", "v"):
    b.add(f"{name}{p}_proj.weight", base + (f"{p}_proj", "w"), idx)
    b.add(f"{name}{p}_conv1d.weight", base + (f"{p}_conv",), idx, "conv")
  b.add(f"{name}f_a_proj.weight", base + ("f_down", "w"), idx)
  b.add(f"{name}f_b_proj.weight", base + ("f_up", "w"), idx)
  b.add(f"{name}b_proj.weight", base + ("b_proj", "w"), idx)
  if lowrank_gate:
    b.add(f"{name}g_a_proj.weight", base + ("g_down", "w"), idx)
    b.add(f"{name}g_b_proj.weight", base + ("g_up", "w"), idx)
  else:
    b.add(f"{name}g_proj.weight", base + ("g_proj", "w"), idx)
  b.add(f"{name}A_log", base + ("a_log",), idx, "reshape", disk_shape=(1, 1, h, 1))
  b.add(f"{name}dt_bias", base + ("dt_bias",), idx, "reshape", disk_shape=(h * k,))
  b.add(f"{name}o_norm.weight", base + ("o_norm",), idx, "reshape")
  b.add(f"{name}o_proj.weight", base + ("o_proj", "w"), idx, n_in=2)


def add_layer(b: Builder, n: str, base: tuple, idx: tuple, mixer: str, ffn: str,
              lowrank_gate: bool, moe_name: str) -> str | None:
  """The tensors of layer `n` both layouts name alike: the two sublayer norms, the mixer
  (KDA or MLA), and the dense FFN or the MoE router and its bias. Returns the MoE's name
  prefix (the layout adds its experts), or None for a dense layer."""
  b.add(n + "input_layernorm.weight", base + ("mixer_norm", "weight"), idx, "reshape")
  b.add(n + "post_attention_layernorm.weight", base + ("ffn_norm", "weight"), idx, "reshape")
  mix = base + ("mixer",)
  if mixer == "kda":
    add_kda(b, n + "self_attn.", mix, idx, lowrank_gate=lowrank_gate)
  else:
    add_mla(b, n + "self_attn.", mix, idx)
  f = base + ("ffn",)
  if ffn == "dense":
    add_gated_ffn(b, n + "mlp.", f, idx)
    return None
  moe = n + moe_name
  b.add(moe + "gate.weight", f + ("router",), idx)
  b.add(moe + "gate.e_score_correction_bias", f + ("bias",), idx, "reshape")
  return moe


def add_mla(b: Builder, name: str, base: tuple, idx: tuple) -> None:
  m = b.cfg.mla
  if m.q_lora_rank:
    b.add(f"{name}q_a_proj.weight", base + ("q_a", "w"), idx)
    b.add(f"{name}q_a_layernorm.weight", base + ("q_norm", "weight"), idx, "reshape")
    b.add(f"{name}q_b_proj.weight", base + ("q_b", "w"), idx)
  else:
    b.add(f"{name}q_proj.weight", base + ("q_proj", "w"), idx)
  b.add(f"{name}kv_a_proj_with_mqa.weight", base + ("kv_a", "w"), idx)
  b.add(f"{name}kv_a_layernorm.weight", base + ("kv_norm", "weight"), idx, "reshape")
  b.add(f"{name}kv_b_proj.weight", base + ("kv_b", "w"), idx)
  if m.output_gate:
    b.add(f"{name}g_proj.weight", base + ("g_proj", "w"), idx)
  b.add(f"{name}o_proj.weight", base + ("o_proj", "w"), idx, n_in=2)


def add_gated_ffn(b: Builder, name: str, base: tuple, idx: tuple) -> None:
  for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
    b.add(f"{name}{theirs}.weight", base + (ours, "w"), idx)


def entries(cfg: ModelConfig, prefix: str = PREFIX):
  check_expressible(cfg)
  # each variable in its own dtype (lossless): BF16 parameters as BF16, the FP32 ones (the
  # router, its bias, A_log, dt_bias, and everything of an FP32 model) as F32
  b = Builder(cfg, None)
  b.add(f"{prefix}model.embed_tokens.weight", ("embed", "table"), (), "reshape")
  for spec in stack.plan_of(cfg).layers:
    i, mixer, ffn, base, idx = spec.index, spec.mixer, spec.ffn, spec.path, spec.lead
    f = base + ("ffn",)
    moe = add_layer(b, f"{prefix}model.layers.{i}.", base, idx, mixer, ffn, lowrank_gate=True,
                    moe_name="block_sparse_moe.")
    if moe is not None:
      for e in range(cfg.moe.num_experts):
        ex = f"{moe}experts.{e}."
        b.add(ex + "w1.weight", f + ("w_gate",), idx + (e,))
        b.add(ex + "w2.weight", f + ("w_down",), idx + (e,))
        b.add(ex + "w3.weight", f + ("w_up",), idx + (e,))
      add_gated_ffn(b, moe + "shared_experts.", f + ("shared",), idx)
  b.add(f"{prefix}model.norm.weight", ("final_norm", "weight"), (), "reshape")
  b.add(f"{prefix}lm_head.weight", ("lm_head", "w"), ())
  return b.entries


# Names transformers 5.x's save_pretrained writes that differ from the release.
def dialect_aliases(name: str) -> list[str]:
  """Other names the tensor `name` (release spelling) may carry on disk."""
  if ".mlp." in name:
    return [name.replace(".mlp.", ".block_sparse_moe.")]
  return []


# ----- config.json ---------------------------------------------------------------------

def _maybe(v: int):
  return None if v < 0 else v


def config_to_hf(cfg: ModelConfig) -> dict:
  check_expressible(cfg)
  k, m, e = cfg.kda, cfg.mla, cfg.moe
  kda_layers = [i + 1 for i in range(cfg.num_layers) if i + 1 not in cfg.mla_layers]
  return {
      "architectures": ["KimiLinearForCausalLM"],
      "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.dense_intermediate,
      "moe_intermediate_size": e.expert_intermediate,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_heads,
      "q_lora_rank": m.q_lora_rank or None,
      "kv_lora_rank": m.kv_lora_rank,
      "qk_nope_head_dim": m.qk_nope_head_dim,
      "qk_rope_head_dim": m.qk_rope_head_dim,
      "v_head_dim": m.v_head_dim,
      "num_experts": e.num_experts,
      "num_experts_per_token": e.top_k,
      "num_shared_experts": e.num_shared_experts,
      "routed_scaling_factor": e.routed_scaling_factor,
      "moe_renormalize": True,
      "num_expert_group": e.n_group,
      "topk_group": e.topk_group,
      "first_k_dense_replace": dense_prefix(cfg),
      "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps,
      "model_max_length": cfg.max_seq_len,
      "bos_token_id": _maybe(cfg.bos_id),
      "eos_token_id": _maybe(cfg.eos_id),
      "pad_token_id": _maybe(cfg.pad_id),
      "tie_word_embeddings": False,
      "torch_dtype": cfg.param_dtype,
      "linear_attn_config": {
          "num_heads": k.num_heads, "head_dim": k.head_dim,
          "short_conv_kernel_size": k.conv_size,
          "kda_layers": kda_layers, "full_attn_layers": list(cfg.mla_layers)},
  }


def _get(hf: dict, *names, default=None):
  for n in names:
    if n in hf and hf[n] is not None:
      return hf[n]
  return default


def _layers_from_hf(hf: dict, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(mla_layers, dense_layers), 1-based, from either dialect."""
  lac = hf.get("linear_attn_config") or {}
  if "full_attn_layers" in lac:
    mla = tuple(int(i) for i in lac["full_attn_layers"])
  elif hf.get("layer_types"):
    mla = tuple(i + 1 for i, t in enumerate(hf["layer_types"]) if t == "full_attention")
  else:
    raise LayoutError("config.json gives neither linear_attn_config.full_attn_layers nor "
                      "layer_types: which layers are MLA is unknown")
  if hf.get("mlp_layer_types"):
    dense = tuple(i + 1 for i, t in enumerate(hf["mlp_layer_types"]) if t == "dense")
  else:
    dense = tuple(range(1, int(hf.get("first_k_dense_replace", 1)) + 1))
  return mla, dense


def config_from_hf(hf: dict, name: str = "kimi_linear") -> ModelConfig:
  if hf.get("model_type") != MODEL_TYPE:
    raise LayoutError(f"model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r}")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise LayoutError(f"config.json hidden_act={act!r}: the kimi_linear layout supports silu")
  lac = hf.get("linear_attn_config") or {}
  n = int(hf["num_hidden_layers"])
  mla_layers, dense_layers = _layers_from_hf(hf, n)
  kh = int(_get(lac, "num_heads", default=_get(hf, "linear_num_heads", default=32)))
  kd = int(_get(lac, "head_dim", default=_get(hf, "linear_head_dim", default=128)))
  kw = int(_get(lac, "short_conv_kernel_size", default=_get(hf, "linear_conv_kernel_dim",
                                                            default=4)))
  dt = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
  dt = dt if dt in ("float32", "bfloat16") else "bfloat16"
  heads = int(hf.get("num_attention_heads", 32))
  if int(hf.get("num_key_value_heads") or heads) != heads:
    raise LayoutError("config.json num_key_value_heads != num_attention_heads: MLA has no "
                      "grouped KV heads here")
  if not hf.get("moe_renormalize", hf.get("norm_topk_prob", True)):
    raise LayoutError("config.json moe_renormalize=false: this project always renormalizes "
                      "the top-k router weights")
  n_experts = int(_get(hf, "num_experts", "num_local_experts", default=256))
  cfg = ModelConfig(
      name=name,
      vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), num_layers=n,
      mla_layers=mla_layers, dense_layers=dense_layers,
      dense_intermediate=int(hf.get("intermediate_size", 9216)),
      activation="swiglu", norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
      max_seq_len=int(_get(hf, "model_max_length", "max_position_embeddings", default=1 << 20)),
      dtype=dt, param_dtype=dt,
      bos_id=int(_get(hf, "bos_token_id", default=-1)),
      eos_id=int(_eos(hf)), pad_id=int(_get(hf, "pad_token_id", default=-1)),
      kda=KDAConfig(num_heads=kh, head_dim=kd, conv_size=kw, decay="softplus",
                    gate_rank=kd, decay_rank=kd),
      mla=MLAConfig(num_heads=heads, q_lora_rank=int(hf.get("q_lora_rank") or 0),
                    kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
                    qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
                    qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
                    v_head_dim=int(hf.get("v_head_dim", 128)), output_gate=False,
                    latent_norm_eps=HF_LATENT_NORM_EPS),
      moe=MoEConfig(num_experts=n_experts,
                    top_k=int(_get(hf, "num_experts_per_token", "num_experts_per_tok",
                                   default=8)),
                    num_shared_experts=int(_get(hf, "num_shared_experts", "n_shared_experts",
                                                default=1)),
                    expert_intermediate=int(hf.get("moe_intermediate_size", 1024)),
                    latent_dim=0,
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                    n_group=int(_get(hf, "num_expert_group", "n_group", default=1)),
                    topk_group=int(_get(hf, "topk_group", default=1)),
                    balance="sign"),
      attn_res=AttnResConfig(enabled=False),
  )
  return validate(cfg)


def _eos(hf: dict) -> int:
  eos = hf.get("eos_token_id")
  if isinstance(eos, list):
    eos = eos[0] if eos else None
  return -1 if eos is None else eos
