"""The vision tower (MoonViT-V2, and the K2.5 variant by config) and its projector into the
language model; host-side image handling lives in k3_jax/data/images.py."""
