"""Kimi-Linear-48B-A3B compatibility config (docs/architecture.md section 1): 49.1B total,
3.1B activated.

Softplus (unbounded) KDA decay, low-rank forget and output gates, MLA without output
gate and without q_lora, SwiGLU, a plain (non-latent) MoE with one shared expert, no AttnRes.
Too large to train on a CPU; it exists so the released weights load (docs/checkpoints.md):

    python main.py info --config=kimi_linear_48b
    python main.py convert --config=kimi_linear_48b --dry_run     # the release's tensor names
    python main.py convert --from=path/to/Kimi-Linear-48B-A3B --to=runs/kimi_linear  # import
    python main.py generate --hf_dir=path/to/Kimi-Linear-48B-A3B --prompt_ids=1,2,3 --json
"""

from k3_jax.config import AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig
from k3_jax.execution import ExecConfig


def get_exec_config() -> ExecConfig:
  """KDA in chunks of 64 (the TPU kernels' tile) on every backend."""
  return ExecConfig(kda_chunk_size=64)


def get_config() -> ModelConfig:
  return ModelConfig(
      name="kimi_linear_48b",
      vocab_size=163_840,
      d_model=2304,
      num_layers=27,
      mla_layers=(4, 8, 12, 16, 20, 24, 27),
      dense_layers=(1,),
      dense_intermediate=9216,
      activation="swiglu",
      max_seq_len=1_048_576,
      dtype="bfloat16",
      param_dtype="bfloat16",
      bos_id=163_584, eos_id=163_586, pad_id=163_839,
      kda=KDAConfig(num_heads=32, head_dim=128, conv_size=4, decay="softplus",
                    gate_rank=128, decay_rank=128),
      mla=MLAConfig(num_heads=32, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, output_gate=False),
      moe=MoEConfig(num_experts=256, top_k=8, num_shared_experts=1, expert_intermediate=1024,
                    latent_dim=0, routed_scaling_factor=2.446, balance="sign"),
      attn_res=AttnResConfig(enabled=False),
  )
