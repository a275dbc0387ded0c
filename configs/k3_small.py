"""The default training job: every K3 component at a size that trains on 2 CPU cores.

Byte-level vocabulary (256), 13 layers = 3 scanned-size blocks of [KDA, KDA, KDA, MLA] + a
final MLA, a dense SiTU-GLU first layer, Stable LatentMoE everywhere else.
"""

from k3_jax.config import (AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                           TrainConfig)


def get_config() -> ModelConfig:
  return ModelConfig(
      name="k3_small",
      vocab_size=256,
      d_model=256,
      num_layers=13,
      mla_layers=(4, 8, 12, 13),
      dense_layers=(1,),
      dense_intermediate=768,
      activation="situ",
      max_seq_len=4096,
      dtype="float32",
      param_dtype="float32",
      eos_id=0,
      kda=KDAConfig(num_heads=4, head_dim=64, conv_size=4, decay="lower_bound", g_min=-5.0,
                    chunk_size=64),
      mla=MLAConfig(num_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64,
                    qk_rope_head_dim=32, v_head_dim=64, output_gate=True),
      moe=MoEConfig(num_experts=16, top_k=2, num_shared_experts=1, expert_intermediate=256,
                    latent_dim=128, routed_scaling_factor=1.0),
      attn_res=AttnResConfig(enabled=False, block_size=4),  # switched on with the AttnRes issue
  )


def get_train_config() -> TrainConfig:
  return TrainConfig(steps=300, batch_size=8, seq_len=256, learning_rate=3e-3,
                     eval_every=100, eval_batches=4, checkpoint_every=100, log_every=10)
