import numpy as np, jax, jax.numpy as jnp, configs, time
from k3_jax.model import create_model, param_counts
from k3_jax.data import images as im
cfg = configs.get_multimodal("k3_tiny"); v = cfg.vision
rng = np.random.default_rng(0)
a = im.to_patches(rng.integers(0,255,(56,84,3),dtype=np.uint8), v, resize=False)
b = im.to_patches(rng.integers(0,255,(28,56,3),dtype=np.uint8), v, resize=False)
enc = lambda s: list(s.encode())
ids = enc("hi ") + im.image_token_ids(a[1], v, enc) + im.image_token_ids(b[1], v, enc) + enc(" ok")
packed = im.pack_images([a,b], v)
print({k: x.shape for k,x in packed.items()}, len(ids))
m = create_model(cfg)
t=time.time()
logits, _, _ = m(jnp.asarray([ids]), images={k: jnp.asarray(x) for k,x in packed.items()})
print(logits.shape, time.time()-t)
print(param_counts(configs.get_multimodal("k3")))
print(param_counts(configs.get("k3"))["total_params"])
