"""The Kimi K3 release layout (docs/architecture.md section 11): `model_type` kimi_k3,
architectures ["KimiK3ForConditionalGeneration"], the text model under `text_config` and its
tensors under `language_model.`. Beyond the Kimi-Linear names:

  KDA       full-rank output gate g_proj [H*V, d]; A_log, dt_bias, the conv weights and
            o_norm stored in FP32 (A_log written [1, 1, H, 1]; on import any shape with at
            least H entries is accepted and its first H used: reports disagree on 96 / 128)
  MLA       q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
            kv_b_proj, output gate g_proj, o_proj
  AttnRes   self_attention_res_proj.weight [1, d] (pseudo-query), self_attention_res_norm
            .weight [d] (key-norm gain; this model's key norm has none, so it is written as
            ones and folded into the query on import), the same with mlp_res_*, and
            model.output_attn_res_proj / output_attn_res_norm before the final norm
  LatentMoE gate.weight [E, d], gate.e_score_correction_bias [E], routed_expert_down_proj
            [l, d], routed_expert_norm [l], routed_expert_up_proj [d, l], shared_experts.*,
            experts.{e}.w1|w2|w3.weight_packed (uint8 [out, in/2], low nibble = even input
            column) and .weight_scale (uint8 E8M0 [out, in/32]): compressed-tensors MXFP4.

Multimodal configs (ModelConfig.vision, e.g. configs.get_multimodal) add the tower and
projector under `vision_tower.` / `mm_projector.` with the names and transforms of
k3_jax/vision/names.py (layout "k3"), in the parameters' dtype, and `vision_config` in
config.json (VisionConfig's fields, model_type "moonvit_v2").

Experts whose widths are not multiples of 32 (k3_tiny) cannot be MXFP4: with
expert_format="auto" they are stored unquantized as experts.{e}.w1.weight etc. (and no
quantization_config is written); "mxfp4" demands the packed form, "dense" forbids it.
"""

from __future__ import annotations

import dataclasses

from k3_jax import stack
from k3_jax.checkpoint.layouts.common import Builder, dense_prefix
from k3_jax.checkpoint.layouts.entry import LayoutError
from k3_jax.checkpoint.layouts.kimi_linear import add_gated_ffn, add_layer
from k3_jax.config import (AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                           VisionConfig, validate)
from k3_jax.vision.names import vision_entries

MODEL_TYPE = "kimi_k3"
PREFIX = "language_model."
EXPERT_FORMATS = ("auto", "mxfp4", "dense")
VISION_MODEL_TYPE = "moonvit_v2"
FP32_NAMES = ("A_log", "dt_bias", "_conv1d.weight", "o_norm.weight")


def check_expressible(cfg: ModelConfig) -> None:
  k, m, e = cfg.kda, cfg.mla, cfg.moe
  rules = [
      (cfg.activation == "situ", "activation", cfg.activation, "K3 uses SiTU-GLU"),
      (k.decay == "lower_bound", "kda.decay", k.decay, "K3 uses the lower-bounded decay"),
      (k.gate_rank == 0, "kda.gate_rank", k.gate_rank, "K3's KDA output gate is full rank"),
      ((k.decay_rank or k.head_dim) == k.head_dim, "kda.decay_rank", k.decay_rank,
       f"the release's decay projection has rank = head_dim ({k.head_dim})"),
      (m.output_gate, "mla.output_gate", m.output_gate, "K3's MLA has an output gate"),
      (m.q_lora_rank > 0, "mla.q_lora_rank", m.q_lora_rank, "K3's MLA has a query low rank"),
      (e.latent_dim > 0, "moe.latent_dim", e.latent_dim, "K3's MoE is a LatentMoE"),
      (cfg.attn_res.enabled, "attn_res.enabled", False, "K3 has Attention Residuals"),
  ]
  for ok, name, value, why in rules:
    if not ok:
      raise LayoutError(f"the kimi_k3 layout cannot express {name}={value!r}: {why}")
  dense_prefix(cfg)


def resolve_expert_format(cfg: ModelConfig, expert_format: str = "auto") -> str:
  if expert_format not in EXPERT_FORMATS:
    raise LayoutError(f"expert_format={expert_format!r}: expected one of {EXPERT_FORMATS}")
  fits = cfg.moe.latent_dim % 32 == 0 and cfg.moe.expert_intermediate % 32 == 0
  if expert_format == "mxfp4" and not fits:
    raise LayoutError(
        f"routed experts cannot be MXFP4: moe.latent_dim={cfg.moe.latent_dim} and "
        f"moe.expert_intermediate={cfg.moe.expert_intermediate} must be multiples of 32 "
        f"(blocks of 32 along each input axis)")
  if expert_format == "auto":
    return "mxfp4" if fits else "dense"
  return expert_format


def entries(cfg: ModelConfig, expert_format: str = "auto", prefix: str = PREFIX):
  check_expressible(cfg)
  fmt = resolve_expert_format(cfg, expert_format)
  b = Builder(cfg, None)       # each variable in its own dtype, except FP32_NAMES (below)
  d = cfg.d_model
  b.add(f"{prefix}model.embed_tokens.weight", ("embed", "table"), (), "reshape")
  for spec in stack.plan_of(cfg).layers:
    i, mixer, ffn, base, idx = spec.index, spec.mixer, spec.ffn, spec.path, spec.lead
    n = f"{prefix}model.layers.{i}."
    for ours, theirs in (("mixer_query", "self_attention_res"), ("ffn_query", "mlp_res")):
      q = base + (ours, "w")
      b.add(f"{n}{theirs}_proj.weight", q, idx, "reshape", disk_shape=(1, d))
      b.add(f"{n}{theirs}_norm.weight", q, idx, "gain", disk_shape=(d,))
    f = base + ("ffn",)
    moe = add_layer(b, n, base, idx, mixer, ffn, lowrank_gate=False, moe_name="mlp.")
    if moe is not None:
      b.add(moe + "routed_expert_down_proj.weight", f + ("down", "w"), idx)
      b.add(moe + "routed_expert_norm.weight", f + ("norm", "weight"), idx, "reshape")
      b.add(moe + "routed_expert_up_proj.weight", f + ("up", "w"), idx)
      for e in range(cfg.moe.num_experts):
        ex = f"{moe}experts.{e}."
        for w, var in (("w1", "w_gate"), ("w2", "w_down"), ("w3", "w_up")):
          if fmt == "mxfp4":
            b.add(f"{ex}{w}.weight", f + (var,), idx + (e,), "mxfp4")
          else:
            b.add(f"{ex}{w}.weight", f + (var,), idx + (e,))
      if cfg.moe.num_shared_experts:
        add_gated_ffn(b, moe + "shared_experts.", f + ("shared",), idx)
  b.add(f"{prefix}model.output_attn_res_proj.weight", ("final_query", "w"), (), "reshape",
        disk_shape=(1, d))
  b.add(f"{prefix}model.output_attn_res_norm.weight", ("final_query", "w"), (), "gain",
        disk_shape=(d,))
  b.add(f"{prefix}model.norm.weight", ("final_norm", "weight"), (), "reshape")
  b.add(f"{prefix}lm_head.weight", ("lm_head", "w"), ())
  if cfg.vision is not None:        # the tower and projector, names of k3_jax/vision/names.py
    for v in vision_entries(cfg.vision, cfg.d_model, "k3"):
      b.add_named(v, prefix=("vision",))
  # the release keeps these in FP32 whatever the parameter dtype (a lossless upcast)
  out = []
  for e in b.entries:
    if e.kind != "mxfp4" and any(e.tensors[0].name.endswith(s) for s in FP32_NAMES):
      e = dataclasses.replace(e, tensors=tuple(dataclasses.replace(t, dtype="F32")
                                               for t in e.tensors))
    out.append(e)
  return out


def dialect_aliases(name: str) -> list[str]:
  return []


# ----- config.json ---------------------------------------------------------------------

def _maybe(v: int):
  return None if v < 0 else v


def quantization_config() -> dict:
  """compressed-tensors, MXFP4 routed experts only (weight-only, group 32, E8M0 scales)."""
  return {
      "quant_method": "compressed-tensors",
      "format": "mxfp4-pack-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {
          "targets": ["re:.*mlp\\.experts\\.\\d+\\.w[123]$"],
          "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                      "symmetric": True, "dynamic": False, "scale_dtype": "uint8"},
          "input_activations": None, "output_activations": None, "format": "mxfp4-pack-quantized"}},
      "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj",
                 "re:.*routed_expert_.*", "re:vision_tower.*", "re:mm_projector.*"],
  }


def config_to_hf(cfg: ModelConfig, expert_format: str = "auto") -> dict:
  check_expressible(cfg)
  fmt = resolve_expert_format(cfg, expert_format)
  k, m, e = cfg.kda, cfg.mla, cfg.moe
  kda_layers = [i + 1 for i in range(cfg.num_layers) if i + 1 not in cfg.mla_layers]
  text = {
      "model_type": "kimi_k3_text",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.dense_intermediate,
      "moe_intermediate_size": e.expert_intermediate,
      "routed_expert_hidden_size": e.latent_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
      "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
      "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
      "v_head_dim": m.v_head_dim, "mla_use_output_gate": True,
      "mla_latent_norm_eps": m.latent_norm_eps or cfg.norm_eps,
      "num_experts": e.num_experts, "num_experts_per_token": e.top_k,
      "num_shared_experts": e.num_shared_experts,
      "routed_scaling_factor": e.routed_scaling_factor, "moe_renormalize": True,
      "num_expert_group": e.n_group, "topk_group": e.topk_group,
      "latent_moe_use_norm": True,
      "first_k_dense_replace": dense_prefix(cfg),
      "hidden_act": "situ", "activation_situ_beta": cfg.situ_beta1,
      "activation_situ_linear_beta": cfg.situ_beta2,
      "attn_res_block_size": cfg.attn_res.block_size,
      "rms_norm_eps": cfg.norm_eps, "model_max_length": cfg.max_seq_len,
      "bos_token_id": _maybe(cfg.bos_id), "eos_token_id": _maybe(cfg.eos_id),
      "pad_token_id": _maybe(cfg.pad_id), "tie_word_embeddings": False,
      "torch_dtype": cfg.param_dtype,
      "linear_attn_config": {
          "num_heads": k.num_heads, "head_dim": k.head_dim,
          "short_conv_kernel_size": k.conv_size, "gate_lower_bound": k.g_min,
          "use_full_rank_gate": True, "kda_layers": kda_layers,
          "full_attn_layers": list(cfg.mla_layers)},
  }
  out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": MODEL_TYPE,
         "text_config": text, "torch_dtype": cfg.param_dtype}
  if fmt == "mxfp4":
    out["quantization_config"] = quantization_config()
  if cfg.vision is not None:
    out["vision_config"] = {"model_type": VISION_MODEL_TYPE, **dataclasses.asdict(cfg.vision)}
  return out


def vision_from_hf(hf: dict) -> VisionConfig | None:
  """The tower of config.json's `vision_config` (VisionConfig's field names), or None."""
  vc = hf.get("vision_config")
  if vc is None:
    return None
  if not isinstance(vc, dict) or vc.get("model_type") != VISION_MODEL_TYPE:
    raise LayoutError(f"config.json vision_config: expected an object with model_type "
                      f"{VISION_MODEL_TYPE!r}")
  fields = {f.name for f in dataclasses.fields(VisionConfig)}
  unknown = sorted(set(vc) - fields - {"model_type"})
  if unknown:
    raise LayoutError(f"config.json vision_config has unknown fields {unknown}")
  return VisionConfig(**{k: v for k, v in vc.items() if k in fields})


def config_from_hf(hf: dict, name: str = "kimi_k3") -> ModelConfig:
  if hf.get("model_type") != MODEL_TYPE:
    raise LayoutError(f"model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r}")
  t = hf.get("text_config")
  if not isinstance(t, dict):
    raise LayoutError("config.json of kimi_k3 has no text_config object")
  act = t.get("hidden_act", "situ")
  if act != "situ":
    raise LayoutError(f"text_config.hidden_act={act!r}: the kimi_k3 layout supports situ")
  lac = t.get("linear_attn_config") or {}
  if "full_attn_layers" not in lac:
    raise LayoutError("text_config.linear_attn_config.full_attn_layers is missing")
  n = int(t["num_hidden_layers"])
  dt = t.get("torch_dtype") or hf.get("torch_dtype") or "bfloat16"
  dt = dt if dt in ("float32", "bfloat16") else "bfloat16"
  kd = int(lac.get("head_dim", 128))
  cfg = ModelConfig(
      name=name, vocab_size=int(t["vocab_size"]), d_model=int(t["hidden_size"]), num_layers=n,
      mla_layers=tuple(int(i) for i in lac["full_attn_layers"]),
      dense_layers=tuple(range(1, int(t.get("first_k_dense_replace", 1)) + 1)),
      dense_intermediate=int(t["intermediate_size"]), activation="situ",
      situ_beta1=float(t.get("activation_situ_beta", 4.0)),
      situ_beta2=float(t.get("activation_situ_linear_beta", 25.0)),
      norm_eps=float(t.get("rms_norm_eps", 1e-5)),
      max_seq_len=int(t.get("model_max_length", 1 << 20)), dtype=dt, param_dtype=dt,
      bos_id=int(_maybe_get(t, "bos_token_id")), eos_id=int(_maybe_get(t, "eos_token_id")),
      pad_id=int(_maybe_get(t, "pad_token_id")),
      kda=KDAConfig(num_heads=int(lac["num_heads"]), head_dim=kd,
                    conv_size=int(lac.get("short_conv_kernel_size", 4)), decay="lower_bound",
                    g_min=float(lac.get("gate_lower_bound", -5.0)), gate_rank=0,
                    decay_rank=0),
      mla=MLAConfig(num_heads=int(t["num_attention_heads"]), q_lora_rank=int(t["q_lora_rank"]),
                    kv_lora_rank=int(t["kv_lora_rank"]),
                    qk_nope_head_dim=int(t["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(t["qk_rope_head_dim"]),
                    v_head_dim=int(t["v_head_dim"]), output_gate=True,
                    latent_norm_eps=float(t.get("mla_latent_norm_eps", 0.0))),
      moe=MoEConfig(num_experts=int(t["num_experts"]), top_k=int(t["num_experts_per_token"]),
                    num_shared_experts=int(t.get("num_shared_experts", 1)),
                    expert_intermediate=int(t["moe_intermediate_size"]),
                    latent_dim=int(t["routed_expert_hidden_size"]),
                    routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
                    n_group=int(t.get("num_expert_group", 1)),
                    topk_group=int(t.get("topk_group", 1))),
      attn_res=AttnResConfig(enabled=True, block_size=int(t.get("attn_res_block_size", 12))),
      vision=vision_from_hf(hf),
  )
  return validate(cfg)


def _maybe_get(t: dict, key: str) -> int:
  v = t.get(key)
  if isinstance(v, list):
    v = v[0] if v else None
  return -1 if v is None else v
