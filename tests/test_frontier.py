"""compile --sweep (k3_jax/frontier.py) and the decode layout rules of k3_jax/compile.py,
without compiling: the grid syntax, the per-point layout (page split, expert exchange and
its capacity, weights by output dimension), the frontier, the table and the plot. The
compiled sweep is tested slow (tests/test_compile.py)."""

import math

import jax

import configs
import pytest

from k3_jax import compile as comp
from k3_jax import frontier
from k3_jax.config import ConfigError
from sharding.mesh import make_mesh, parse_mesh


def test_parse_sweep_accepts_k_and_m_suffixes():
  g = frontier.parse_sweep("batch:8,64,256,1024;cache_len:8K,32k,128K,1M")
  assert g == {"batch": [8, 64, 256, 1024], "cache_len": [8192, 32768, 131072, 1048576]}
  assert frontier.points({"batch": [8, 16]}, None, 64) == [(8, 64), (16, 64)]
  for bad, msg in (("batch:8;batch:16", "twice"), ("seq:8", "AXIS"), ("batch:8X", "suffix"),
                   ("batch:0", "positive"), ("", "empty")):
    with pytest.raises(ConfigError, match=msg):
      frontier.parse_sweep(bad)
  with pytest.raises(ConfigError, match="cache_len"):
    frontier.points({"batch": [8]}, None, None)
  assert frontier.parse_sweep("batch:64;cache_len:32K;piece:16K")["piece"] == [16384]
  with pytest.raises(ConfigError, match="prefill"):               # piece: prefill only
    frontier.run_sweep(None, None, None, "decode", {}, {"batch": [8], "piece": [512]})
  p = {"step": "prefill", "batch": 64, "cache_len": 32768, "piece": 16384, "fits": True,
       "gib_per_chip": 80.0, "mesh": "expert:64", "hbm_bytes_per_chip": 1e12, "bound": "flops",
       "step_time_s": 2.0, "tokens_per_s": 524288.0, "mfu": 0.5, "ttft_s": 4.0}
  assert "(16K a step)" in frontier.point_line(p) and "TTFT 4,000 ms" in frontier.point_line(p)


def test_decode_layout_rule():
  mesh = make_mesh(parse_mesh("expert:8"))
  cfg = comp.validate(configs.get("k3_tiny"))
  # pages by sequence when the page shards divide the batch, by length otherwise
  assert comp.decode_page_split(16, mesh) == "slot"
  assert comp.decode_page_split(4, mesh) == "column"
  assert comp.decode_page_split(16, mesh, "column") == "column"        # explicit wins
  with pytest.raises(ConfigError, match="divisible"):
    comp.decode_page_split(4, mesh, "slot")
  assert comp.expert_exchange(16, mesh) == "all_to_all"
  assert comp.expert_exchange(4, mesh) == "replicated"
  # the capacity: the least chunk whose Poisson overflow is below DROP_TAIL
  c = comp.decode_ep_capacity(16, mesh, cfg)
  mean = 16 / 8 * cfg.moe.top_k / 8
  cap = round(c * mean)
  tail = lambda n: 1 - sum(math.exp(-mean) * mean ** i / math.factorial(i) for i in range(n + 1))
  assert tail(cap) < comp.DROP_TAIL <= tail(cap - 1)


def test_weights_by_output_moves_the_model_dimension():
  mesh = make_mesh(parse_mesh("expert:8"))
  cfg = comp.validate(configs.get("k3_tiny"))
  _, params, _ = comp.serving_params(cfg)
  default = comp.tree_shardings(params, mesh)
  moved = comp.weights_by_output(params, mesh)
  flat = lambda t: dict(jax.tree_util.tree_leaves_with_path(t))
  d, m = flat(default), flat(moved)
  whole = [k for k in d if "kv_b" in jax.tree_util.keystr(k)]
  assert whole and all(not any(m[k].spec) for k in whole)   # MLA's kv_b: on every chip
  q_b = [k for k in d if "q_b" in jax.tree_util.keystr(k)]  # MLA's q_b: n + p = 12 stays on Q
  assert q_b and all(m[k].spec == d[k].spec for k in q_b)
  f_up = [k for k in d if "f_up" in jax.tree_util.keystr(k)]   # whole -> on K (below)
  changed = [k for k in d if d[k].spec != m[k].spec and k not in whole + f_up]
  assert changed                                    # the dense projections moved
  for k in changed:                                 # the same axis, on another dimension
    assert "expert" in tuple(d[k].spec) and "expert" in tuple(m[k].spec)
    assert tuple(d[k].spec).index("expert") != tuple(m[k].spec).index("expert")
  experts = [k for k in d if "w_gate" in jax.tree_util.keystr(k)]
  assert experts and all(d[k].spec == m[k].spec for k in experts)   # routed experts stay
  table = [k for k in d if "'embed'" in jax.tree_util.keystr(k)]  # the embedding table:
  assert table and all(tuple(m[k].spec) == ("expert", None) for k in table)    # D -> V


def test_weights_by_output_moves_q_b_off_its_low_rank_input():
  """MLA's q_b [Q, H, n + p] is split on its last dimension where that divides (no [B, H,
  n + p] partial sums all-reduced per layer), on Q where it does not."""
  from k3_jax.config import apply_overrides
  mesh = make_mesh(parse_mesh("expert:8"))
  cfg = comp.validate(apply_overrides(configs.get("k3_tiny"), ["mla.qk_rope_head_dim=8"]))
  _, params, _ = comp.serving_params(cfg)
  flat = lambda t: dict(jax.tree_util.tree_leaves_with_path(t))
  d = flat(comp.tree_shardings(params, mesh))
  m = flat(comp.weights_by_output(params, mesh))
  q_b = [k for k in d if "q_b" in jax.tree_util.keystr(k)]
  assert q_b and all(tuple(d[k].spec)[-3] == "expert" for k in q_b)          # on Q
  assert all(tuple(m[k].spec)[-1] == "expert" and "expert" not in tuple(m[k].spec)[:-1]
             for k in q_b)                                                  # on n + p


def test_weights_by_output_splits_kda_f_up_and_few_rows_keep_mla_kv_b_on_r():
  """KDA's decay up-projection f_up [r, H, K] (whole by the default rule) is split on K;
  MLA's kv_b is whole on every chip, but keeps the default split on R for a step of at
  most SMALL_ROWS tokens (layers/mla.py moves the few queries to it)."""
  from k3_jax.layers.linear import SMALL_ROWS
  mesh = make_mesh(parse_mesh("expert:8"))
  cfg = comp.validate(configs.get("k3_tiny"))
  _, params, _ = comp.serving_params(cfg)
  flat = lambda t: dict(jax.tree_util.tree_leaves_with_path(t))
  default = flat(comp.tree_shardings(params, mesh))
  for rows, few in ((None, False), (SMALL_ROWS + 1, False), (SMALL_ROWS, True)):
    moved = flat(comp.weights_by_output(params, mesh, rows))
    f_up = [v.spec for k, v in moved.items() if "f_up" in jax.tree_util.keystr(k)]
    assert f_up and all(tuple(s)[-1:] == ("expert",) and "expert" not in tuple(s)[:-1]
                        for s in f_up), (rows, f_up)
    kv_b = [k for k in moved if "kv_b" in jax.tree_util.keystr(k)]
    assert kv_b and all((moved[k].spec == default[k].spec) if few else not any(moved[k].spec)
                        for k in kv_b)


def test_frontier_table_and_plot(tmp_path):
  def pt(batch, length, step_s, fits=True):
    return {"step": "decode", "batch": batch, "cache_len": length, "fits": fits,
            "gib_per_chip": 50.0, "hbm_bytes_per_chip": 4e10, "hbm_vs_min": 1.2,
            "bound": "hbm", "step_time_s": step_s, "tokens_per_s": batch / step_s,
            "page_split": "slot", "expert_exchange": "all_to_all", "mesh": "expert:64"}
  pts = [pt(8, 32768, 0.010), pt(64, 32768, 0.012), pt(256, 32768, 0.030),
         pt(128, 32768, 0.040),                     # beaten by 256: more tok/s, less TPOT
         pt(8, 1 << 20, 0.020),
         {"step": "decode", "batch": 1024, "cache_len": 1 << 20, "fits": False,
          "gib_per_chip": 500.0, "skipped": "too big"}]
  front = frontier.frontier(pts)
  assert [(p["batch"], p["cache_len"]) for p in front] == [(8, 32768), (64, 32768),
                                                           (256, 32768), (8, 1 << 20)]
  table = frontier.markdown_table(pts)
  assert table.count("\n") == len(pts) + 1 and "too big" in table and "1M" in table
  assert "skipped" not in frontier.point_line(pts[0]) and "not compiled" in frontier.point_line(pts[-1])
  frontier.plot(pts, str(tmp_path / "f.png"), "test")
  assert (tmp_path / "f.png").stat().st_size > 1000


def test_prefill_program_is_the_engines_step_over_its_paged_cache():
  """compile --step=prefill lowers serve/steps.py prefill_step as Runner.prefill calls it
  (slots, tokens [rows, piece], positions, page tables [rows, pages], valid) over the
  engine's paged cache (kv_pages.pool_pages' pages, donated), not model.prefill."""
  from k3_jax.serve import kv_pages as kv
  cfg = comp.validate(configs.get("k3_tiny"))
  mesh = make_mesh(parse_mesh("expert:4"), jax.devices()[:4])
  fn, args = comp._serving_program(cfg, mesh, "prefill", 2, 256, 1024, "dense")
  slots, tokens, pos, tables, valid = args[3:]
  assert tokens.shape == (2, 256) and tables.shape == (2, 1024 // kv.PAGE)
  assert slots.shape == pos.shape == valid.shape == (2,)
  pools = [e.c_kv for e in jax.tree.leaves(
      args[2], is_leaf=lambda e: type(e).__name__ == "PagedMLACache")
           if type(e).__name__ == "PagedMLACache"]
  assert pools and all(p.shape[-3] == kv.pool_pages(2, 2, 0, 4) for p in pools)
  assert fn.__name__ == "prefill_step"
  logits, cache = jax.eval_shape(fn, *args)
  assert logits.shape == (2, cfg.vocab_size)                       # each row's last logits
  assert jax.tree.structure(cache) == jax.tree.structure(args[2])  # the cache, in place


def test_staged_gather_equals_the_whole_constraint_and_is_two_all_gathers():
  """partitioning.staged_gather (Parallel.gathered in the node decode's layout): an array
  split by rows over expert:8, or on its last dimension, gathered whole by two all-gathers
  (over 2 then 4 devices; 4 then 2 at 8 rows a device) is the array itself, and its program holds two all-gathers and no
  all-reduce; an unsplit array is left whole; all_gather_in_stages (the same inside a
  shard_map, by axis_index_groups) equals jax.lax.all_gather, stacked or tiled."""
  import re

  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from k3_jax.partitioning import all_gather_in_stages, staged_gather
  mesh = make_mesh(parse_mesh("expert:8"))
  x = jnp.arange(16 * 24, dtype=jnp.float32).reshape(16, 24)
  for spec, a in ((P("expert", None), x), (P(None, "expert"), x),   # 2 rows a device: 4 x 2
                  (P("expert", None), jnp.tile(x, (4, 1)))):       # 8: 2 x 4 (_stages)
    xs = jax.device_put(a, NamedSharding(mesh, spec))
    f = jax.jit(lambda a, spec=spec: staged_gather(a * 2, mesh, spec))
    out = f(xs)
    assert out.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(a))
    hlo = f.lower(xs).compile().as_text()
    assert len(re.findall(r"= \S+ all-gather(?:-start)?\(", hlo)) == 2
    assert "all-reduce(" not in hlo
  out = jax.jit(lambda a: staged_gather(a, mesh, P()))(x)          # nothing split: whole
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
  for tiled in (False, True):     # inside a shard_map: all_gather_in_stages = all_gather
    staged, plain = (jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("expert"),
                                           out_specs=P("expert"), check_vma=False))
                     for g in (lambda v: all_gather_in_stages(v, "expert", 8, tiled=tiled),
                               lambda v: jax.lax.all_gather(v, "expert", tiled=tiled)))
    np.testing.assert_array_equal(np.asarray(staged(x)), np.asarray(plain(x)))


def test_token_groups_rule_gather_and_weights():
  """The node decode's token groups (partitioning.token_groups): 2 from TOKEN_GROUP_ROWS
  rows a device on a one-axis mesh, else 1; group_gather gathers an array split by rows,
  or by group and on its last dimension (Parallel.by_output's layout), within each group of
  the [2, 4] view, by one all-gather and no all-reduce; weights_by_output(groups=2) puts
  the by-output weights (and those that output the model dimension) on a group's 4
  devices, [H, K] outputs on H where 4 divides the heads, and leaves the LM head, the
  embedding table and the vectors as with one group."""
  import re

  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from k3_jax.config import apply_overrides
  from k3_jax.partitioning import (GROUP_AXES, TOKEN_GROUP_ROWS, group_gather, grouped_mesh,
                                   token_groups)
  mesh = make_mesh(parse_mesh("expert:8"))
  assert token_groups(TOKEN_GROUP_ROWS * 8, mesh) == 2
  assert token_groups(TOKEN_GROUP_ROWS * 8 - 8, mesh) == 1
  assert token_groups(1024, make_mesh(parse_mesh("expert:4,fsdp:2"))) == 1
  view = grouped_mesh(mesh, 2)
  x = jnp.arange(16 * 24, dtype=jnp.float32).reshape(16, 24)
  tg, og = GROUP_AXES
  for src, axes in ((NamedSharding(mesh, P("expert", None)), ("batch", None)),
                    (NamedSharding(view, P(tg, og)), (None, "embed"))):
    xs = jax.device_put(x, src)
    spec = P("expert", None) if axes[0] == "batch" else P(None, "expert")
    f = jax.jit(lambda a, spec=spec, axes=axes: group_gather(a * 2, view, spec, axes))
    out = f(xs)
    assert tuple(out.sharding.spec)[:1] == (tg,) and not any(tuple(out.sharding.spec)[1:])
    for shard in out.addressable_shards:            # each device: its group's rows, whole
      np.testing.assert_array_equal(np.asarray(shard.data), 2 * np.asarray(x)[shard.index])
      assert shard.data.shape == (8, 24)
    hlo = f.lower(xs).compile().as_text()
    assert len(re.findall(r"= \S+ all-gather(?:-start)?\(", hlo)) == 1
    assert "all-reduce(" not in hlo
  cfg = comp.validate(apply_overrides(configs.get("k3_tiny"),
                                      ["kda.num_heads=4", "mla.num_heads=4",
                                       "mla.qk_rope_head_dim=8"]))
  _, params, _ = comp.serving_params(cfg)
  flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(t)}
  one, two = flat(comp.weights_by_output(params, mesh)), flat(comp.weights_by_output(
      params, mesh, 128, 2))
  grouped = {k for k, s in two.items() if s.mesh.axis_names == GROUP_AXES}
  for name in ("q_proj", "o_proj", "f_up", "router", "shared']['down", "q_b"):
    assert any(name in k for k in grouped), name
  for k in grouped:
    assert tuple(two[k].spec).count(og) == 1 and tg not in tuple(two[k].spec)
    if re.search(r"\['(q_proj|k_proj|v_proj|g_proj|f_up|q_b)'\]", k):
      assert tuple(two[k].spec)[-2:] == (og, None), k         # on H: 4 heads over 4
  for k in set(two) - grouped:        # the LM head, the table, vectors, kv_b, experts
    assert two[k] == one[k], k
  assert not any("lm_head" in k or "norm" in k for k in grouped)
