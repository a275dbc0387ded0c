"""The default training job: every K3 component at a size that trains on 2 CPU cores.

Byte-level vocabulary (256), 9 layers = 2 blocks of [KDA, KDA, KDA, MLA] + a final MLA, a dense SiTU-GLU first layer, Stable LatentMoE everywhere else.
17.5M parameters, 4.2M activated.

    python main.py train                    # = --config=k3_small --workdir=runs/default
    python main.py generate --workdir=runs/default --prompt="def fibonacci(n):" \\
        --temperature=0.5 --top_p=0.9 --frequency_penalty=0.2 --presence_penalty=0.2
    python main.py serve --workdir=runs/default
    python main.py train --config=k3_small --dataset=shapes --steps=240 --batch_size=16 \\
        --seq_len=72 --eval_every=80 --checkpoint_every=80 --workdir=runs/shapes  # with images
"""

from k3_jax.config import (AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                           TrainConfig)


def get_config() -> ModelConfig:
  return ModelConfig(
      name="k3_small",
      vocab_size=256,
      d_model=192,
      num_layers=9,
      mla_layers=(4, 8, 9),
      dense_layers=(1,),
      dense_intermediate=512,
      activation="situ",
      max_seq_len=4096,
      dtype="float32",
      param_dtype="float32",
      eos_id=0,
      kda=KDAConfig(num_heads=3, head_dim=64, conv_size=4, decay="lower_bound", g_min=-5.0),
      mla=MLAConfig(num_heads=3, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=64,
                    qk_rope_head_dim=32, v_head_dim=64, output_gate=True),
      moe=MoEConfig(num_experts=32, top_k=2, num_shared_experts=1, expert_intermediate=192,
                    latent_dim=96, routed_scaling_factor=1.0),
      attn_res=AttnResConfig(enabled=True, block_size=3),
  )


def get_train_config() -> TrainConfig:
  # About 2.6 s per step on 2 CPU cores: 180 steps, compilation and evaluation fit the
  # 10-minute budget of the default job.
  # K3's optimizer: Per-Head Muon on matrices (muon_lr), AdamW on the rest (learning_rate);
  # benchmarks/optim.py compares it with AdamW everywhere.
  return TrainConfig(steps=180, batch_size=8, seq_len=256, optimizer="muon", muon_lr=3e-3,
                     learning_rate=3e-3, eval_every=60, eval_batches=4, checkpoint_every=60,
                     log_every=10)


def get_vision_config():
  """The vision tower attached by configs.get_multimodal (jobs that use images)."""
  from configs import vision
  return vision.small()
