"""Benchmark suite: JSON fields of a real run, the peer's command and data, the network model."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from gem_jax.bench import matmul_ceiling as mc
from gem_jax.bench import network, peer, peer_data, report_table, timing

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


# ------------------------------------------------------------ benchmark.py run --

@pytest.fixture(scope="module")
def bench_rows():
  """One real run of scripts/benchmark.py (1 CPU device, few steps) on a shrunken dlrm_peer."""
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--config", "dlrm_peer",
         "--devices", "1", "--json", "--steps", "3", "--warmup", "1", "--pool", "2",
         "--matmul-ceiling",
         "--set", "data.rows=1000", "--set", "data.batch_size=64", "--set", "data.pool=2",
         "--set", "model.overrides.bottom_mlp=(16,)", "--set", "model.overrides.top_mlp=(16,)"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")], p.stderr


def test_benchmark_json_fields_are_sane(bench_rows):
  rows, table = bench_rows
  assert len(rows) == 1
  r = rows[0]
  assert r["framework"] == "gem_jax" and r["devices"] == 1 and r["mesh"] == [1, 1]
  assert r["batch_size"] == 64 and r["steps"] == 3
  assert 0 < r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
  assert r["examples_per_s"] == pytest.approx(64 / (r["step_ms_median"] / 1e3), rel=1e-9)
  assert r["compile_cold_s"] > 0 and r["compile_warm_s"] > 0
  # dot DLRM, 8 tables, d=64, bottom 13-16-64, top 100-16-1: 3 x forward FLOPs by hand.
  fwd = 2 * (13 * 16 + 16 * 64) + 2 * 9 * 9 * 64 + 2 * (100 * 16 + 16 * 1)
  assert r["train_flops_per_example"] == 3 * fwd
  assert r["xla_flops_per_example"] > 0
  assert r["peak_flops_per_device"] > 1e8 and r["peak_source"].startswith("cpu matmul probe")
  # probed before and after the timed steps, the peak the higher of the two
  assert r["peak_flops_per_device"] == max(r["probe_flops_start"], r["probe_flops_end"])
  assert "probe TFLOP/s start / end" in table
  assert r["mfu"] == pytest.approx(r["tflops_per_device"] * 1e12 / r["peak_flops_per_device"])
  assert r["embedding_exchange_bytes_per_step"] == 0  # one device: nothing leaves it
  assert r["mem_peak_bytes_compiled"] >= 8 * 1000 * 64 * 4  # the tables are arguments
  assert np.isfinite(r["loss_first"]) and np.isfinite(r["loss_last"])
  assert r["loadavg_1m"] >= 0 and r["dense_step_ms_median"] > 0
  assert "examples/s (median step)" in table and "MFU" in table
  # the dense part's dots timed alone (a ceiling in a quiet run; both timed, so not compared)
  assert r["matmul_count"] >= 3 * 4 and r["matmul_flops_per_step"] > 0
  assert r["dense_mfu_ceiling"] > 0 and r["dense_mfu"] > 0
  assert len(r["matmul_top"]) == min(10, r["matmul_shapes"]) and "dense MFU ceiling" in table


def test_matmul_ceiling_refuses_a_mesh():
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--config", "dlrm_peer",
         "--devices", "2", "--matmul-ceiling", "--no-hugepages"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
  assert p.returncode != 0 and "use --devices 1, not 2" in p.stderr


def test_bench_embedding_freeze_modes_agree():
  """--freeze-by drop select: the two ways of keeping frozen rows train the same tables
  (same losses after the same steps), side by side in one run."""
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_embedding.py"), "--rows", "4000",
         "--tables", "2", "--mesh", "1", "2", "--batch", "64", "--steps", "3", "--warmup", "1",
         "--freeze", "1", "--freeze-by", "drop", "select", "--json", "--no-hugepages"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  drop, select = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  assert (drop["freeze_by"], select["freeze_by"]) == ("drop", "select")
  assert drop["frozen_tables"] == 1 and drop["loss"] == select["loss"] and drop["loss"] > 0


def test_bench_embedding_reports_the_managed_regime():
  """The id stream decides what a managed step does, and each run says which: a population
  that fits the table is served by hits after the first steps, a fresh unbounded stream
  keeps inserting (counters of the last step, summed over the tables)."""
  base = [sys.executable, os.path.join(ROOT, "scripts", "bench_embedding.py"), "--rows", "8000",
          "--tables", "2", "--mesh", "1", "2", "--batch", "64", "--steps", "2", "--warmup", "2",
          "--sharding", "row_wise", "--id-policy", "managed", "--id-stream", "fresh", "--json",
          "--no-hugepages"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  got = {}
  for population in ("0", "40"):
    p = subprocess.run(base + ["--id-population", population], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    assert r["id_stream"] == "fresh" and r["id_population"] == int(population)
    got[population] = r
  steady, fresh = got["40"], got["0"]
  assert steady["mc_hits_share"] == 1.0 and steady["mc_inserts_share"] == 0.0
  assert steady["mc_ids_per_table"] <= 40
  assert fresh["mc_inserts_share"] > 0.3 and fresh["mc_hits_share"] < 0.7


# ------------------------------------------------------------------- the peer --

def test_peer_data_is_deterministic_and_seeded():
  a = peer_data.PeerData(num_tables=3, rows=500, pooling=2, seed=4).pool(16, 2)
  b = peer_data.PeerData(num_tables=3, rows=500, pooling=2, seed=4).pool(16, 2)
  c = peer_data.PeerData(num_tables=3, rows=500, pooling=2, seed=5).pool(16, 2)
  for x, y in zip(a, b):
    for u, v in zip(x, y):
      np.testing.assert_array_equal(u, v)
  assert not np.array_equal(a[0].ids, c[0].ids)
  assert not np.array_equal(a[0].ids, a[1].ids)  # the pool's batches are distinct
  d, ids, y = a[0]
  assert (d.shape, d.dtype) == ((16, 13), np.float32)
  assert (ids.shape, ids.dtype) == ((3, 16, 2), np.int64)
  assert (y.shape, y.dtype) == ((16,), np.float32)


def test_peer_data_statistics():
  """Label rate 0.25, ids in range, P(rank k) ~ (k+1)^-alpha, ranks permuted, dense log1p counts."""
  rows, alpha, n = 1000, 1.05, 200_000
  dense, ids, labels = peer_data.PeerData(num_tables=2, rows=rows, alpha=alpha, seed=0,
                                          permute=False).pool(n, 1)[0]
  assert abs(labels.mean() - 0.25) < 0.005 and set(np.unique(labels)) == {0.0, 1.0}
  assert ids.min() >= 0 and ids.max() < rows
  freq = np.bincount(ids[0, :, 0], minlength=rows) / n                # (rows,)
  p = np.arange(1, rows + 1) ** -alpha
  p /= p.sum()
  np.testing.assert_allclose(freq[:10], p[:10], rtol=0.03)           # the head by hand
  assert freq[0] / freq[1] == pytest.approx(2 ** alpha, rel=0.03)    # Zipf skew
  np.testing.assert_allclose(peer_data.ZipfTable(rows, alpha, permute=False).probs(), p,
                             rtol=1e-9)  # diff of a cumsum
  # dense = log1p(floor(lognormal(1, 1.5))): non-negative, log1p of integers
  assert dense.min() >= 0 and np.allclose(np.expm1(dense), np.round(np.expm1(dense)), atol=1e-3)
  # permuted: the hottest row of each table is perm[0], a different row per table
  _, pids, _ = peer_data.PeerData(num_tables=2, rows=rows, seed=0).pool(20_000, 1)[0]
  tables = peer_data.make_tables(2, rows, alpha, seed=0)
  hot = [np.bincount(pids[t, :, 0], minlength=rows).argmax() for t in range(2)]
  assert hot == [tables[0].perm[0], tables[1].perm[0]] and hot[0] != hot[1]


def test_peer_data_imports_no_jax_or_torch():
  """bench.py imports it from a plain checkout, in a venv without jax (or gem_jax installed)."""
  root = os.path.abspath(ROOT)
  code = (f"import sys; sys.path.insert(0, {root!r}); from gem_jax.bench import peer_data; "
          "peer_data.PeerData(2, 10).pool(4, 1); "
          f"assert peer_data.__file__.startswith({root!r}), peer_data.__file__; "
          "bad = [m for m in ('jax', 'torch', 'flax', 'gem_jax.data') if m in sys.modules]; "
          "assert not bad, bad")
  p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                     timeout=120, check=False, cwd="/")
  assert p.returncode == 0, p.stderr[-2000:]


def test_peer_data_rejects_bad_sizes():
  with pytest.raises(ValueError, match="rows >= 1"):
    peer_data.ZipfTable(0, 1.05, permute=False)
  with pytest.raises(ValueError, match="batch_size >= 1"):
    peer_data.PeerData(2, 10).pool(0, 1)


def test_peer_source_gives_peer_datas_exact_arrays():
  src = peer.PeerSource(num_tables=3, rows=500, pool=2, seed=4, pooling=2)
  got = [next(iter(src.batches(16))), src.pool(16)[1]]
  want = peer_data.PeerData(num_tables=3, rows=500, pooling=2, seed=4).pool(16, 2)
  for b, (dense, ids, labels) in zip(got, want):
    np.testing.assert_array_equal(b["dense"], dense)
    for i in range(3):
      np.testing.assert_array_equal(b["ids"][f"f{i}"], ids[i])
    np.testing.assert_array_equal(b["labels"][:, 0], labels)
    assert b["label_mask"].shape == (16, 1) and b["label_mask"].min() == 1.0
  assert src.spec.sparse[0].bag == 2 and src.spec.n_dense == 13


SHARED_PEER = os.path.join(ROOT, "..", "shared", "peers", "torchrec_bench.py")


@pytest.mark.skipif(not os.path.exists(SHARED_PEER), reason="no ../shared/peers (optional "
                    "independent cross-check of peer_data)")
def test_peer_data_matches_the_independent_peer():
  """Cross-check only: ../shared/peers' generator, written separately, gives the same arrays."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("_shared_torchrec_bench", SHARED_PEER)
  tb = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tb)
  rng = np.random.default_rng(8)
  samplers = tb.make_samplers(3, 700, 1.05, 7)
  for got in peer_data.PeerData(3, 700, 2, 1.05, 7).pool(32, 2):
    for a, b in zip(got, tb.synthetic_batch(samplers, 32, 2, rng)):
      np.testing.assert_array_equal(a, b)


def _flags(cmd):
  return dict(zip(cmd[2::2], cmd[3::2]))


def test_peer_command_matches_the_config():
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import dcn_peer  # pylint: disable=import-outside-toplevel
  import dlrm_peer  # pylint: disable=import-outside-toplevel
  cfg = dlrm_peer.get_config()
  cmd = peer.peer_command_from_config(cfg, steps=20, warmup=5, python="/venv/bin/python")
  assert cmd[0] == "/venv/bin/python"
  assert cmd[1] == os.path.abspath(os.path.join(ROOT, "benchmarks", "torchrec", "bench.py"))
  assert os.path.exists(cmd[1])
  assert _flags(cmd) == {
      "--interaction": "dot", "--batch-size": "4096", "--steps": "20", "--warmup": "5",
      "--num-tables": "8", "--rows": "100000", "--dim": "64", "--pooling": "1",
      "--alpha": "1.05", "--bottom-mlp": "512,256", "--top-mlp": "512,256",
      "--optimizer": "sgd", "--lr": "0.1", "--threads": "2", "--seed": "0",
      "--batch-pool": "32", "--autocast": "bf16"}  # dlrm_peer computes in bf16
  cfg.model.dtype = "float32"
  assert _flags(peer.peer_command_from_config(cfg, steps=20, warmup=5))["--autocast"] == "off"
  forced = peer.peer_command_from_config(cfg, steps=20, warmup=5, autocast="bf16",
                                         script="/x/torchrec_bench.py")
  assert forced[1] == "/x/torchrec_bench.py" and _flags(forced)["--autocast"] == "bf16"
  dargs = _flags(peer.peer_command_from_config(dcn_peer.get_config(), steps=20, warmup=5))
  assert dargs["--interaction"] == "dcn" and dargs["--dcn-layers"] == "3"
  assert dargs["--dcn-rank"] == "512" and dargs["--autocast"] == "bf16"
  with pytest.raises(ValueError, match="autocast"):
    peer.peer_command(autocast="fp16")


def test_peer_command_flags_are_the_scripts_flags():
  """Every flag peer_command emits is one benchmarks/torchrec/bench.py parses (no torch needed)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("_trbench", peer.PEER_SCRIPT)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)  # imports only numpy and peer_data at module level
  a = bench.parse_args(peer.peer_command(interaction="dcn", autocast="bf16", rows=77)[2:])
  assert (a.interaction, a.autocast, a.rows, a.dcn_rank, a.batch_pool) == ("dcn", "bf16", 77,
                                                                          512, 32)


def _peer_matmul_module():
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("_trmatmul", peer.PEER_MATMUL_SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)  # torch is imported only in main()
  return mod


@pytest.mark.parametrize("lhs,rhs,dims", [
    ((6, 5), (5, 4), (((1,), (0,)), ((), ()))),            # x @ w
    ((6, 5), (6, 4), (((0,), (0,)), ((), ()))),            # x^T g: contract the rows
    ((6, 5), (4, 5), (((1,), (1,)), ((), ()))),            # g w^T
    ((3, 6, 5), (3, 5, 4), (((2,), (1,)), ((0,), (0,)))),  # batched
    ((6, 3, 5), (5, 3, 4), (((2,), (0,)), ((1,), (1,)))),  # batch axis in the middle
])
def test_peer_matmul_einsum_is_the_dot_general(lhs, rhs, dims):
  """The peer times each traced dot as an einsum: the same contraction, same output layout."""
  from jax import lax  # pylint: disable=import-outside-toplevel
  k1, k2 = jax.random.split(jax.random.key(1))
  a, b = jax.random.normal(k1, lhs), jax.random.normal(k2, rhs)
  d = mc.DotShape(lhs, rhs, "float32", "float32", dims, None).as_dict()
  spec = _peer_matmul_module().einsum_spec(len(d["lhs"]), len(d["rhs"]), d["contract"],
                                            d["batch"])
  np.testing.assert_allclose(np.einsum(spec, np.asarray(a), np.asarray(b)),
                             lax.dot_general(a, b, dims), rtol=1e-5, atol=1e-5)
  assert d["flops"] == 2 * np.prod(lax.dot_general(a, b, dims).shape) * lhs[dims[0][0][0]]
  with pytest.raises(ValueError, match="differ in length"):
    _peer_matmul_module().einsum_spec(2, 2, [[1], []], [[], []])


def test_peer_dot_times_keeps_the_order_and_totals(monkeypatch, tmp_path):
  """The peer's per-dot times come back in order; totals count only dots both sides timed."""
  fake = tmp_path / "matmul.py"  # stands in for benchmarks/torchrec/matmul.py: ms = lhs[0]
  fake.write_text("import json, sys\n"
                  "d = json.load(open(sys.argv[1]))\n"
                  "print(json.dumps({'dots': [dict(x, ms=None if x['dtype'] is None else "
                  "float(x['lhs'][0])) for x in d]}))\n")
  monkeypatch.setattr(peer, "PEER_MATMUL_SCRIPT", str(fake))
  dots = [dict(mc.DotShape((m, 8), (8, 4), dt, dt, (((1,), (0,)), ((), ())), None).as_dict(),
               count=c, ms=ms)
          for m, dt, c, ms in ((2, "bfloat16", 3, 1.0), (5, "float32", 1, 4.0),
                               (7, "float32", 2, 1.0))]
  dots[2]["dtype"] = None  # mixed operands: the peer has no like for it
  got = peer.peer_dot_times(dots, python=sys.executable)
  assert got == [2.0, 5.0, None]
  m = peer.matmul_side_by_side(dots, got)
  assert m["gem_jax_dot_ms"] == pytest.approx(3 * 1.0 + 4.0)
  assert m["torch_dot_ms"] == pytest.approx(3 * 2.0 + 5.0)
  assert m["ratio"] == pytest.approx(7.0 / 11.0) and m["untimed_by_peer"] == 1
  assert [r["count"] for r in m["rows"]] == [1, 3, 2]  # by gem_jax ms per step: 4, 3, 2
  assert "dots alone, ms per step: gem_jax (XLA) 7.00, torch 11.00, ratio 0.64" in (
      report_table.format_matmul_side_by_side(m))


def test_peer_python_env_override(monkeypatch):
  monkeypatch.setenv("GEM_JAX_TORCHREC_PYTHON", "/custom/python")
  assert peer.peer_command()[0] == "/custom/python"
  monkeypatch.delenv("GEM_JAX_TORCHREC_PYTHON")
  assert peer.peer_command()[0] == os.path.expanduser(
      "~/.cache/gem_jax/torchrec-venv/bin/python")


def test_run_peer_without_venv_says_how_to_make_it():
  with pytest.raises(FileNotFoundError, match="bash benchmarks/torchrec/setup.sh"):
    peer.run_peer(peer.peer_command(python="/nonexistent/python"))
  with pytest.raises(FileNotFoundError, match="bash benchmarks/torchrec/setup.sh"):
    peer.run_peer(peer.peer_command(python=sys.executable, script="/nonexistent/bench.py"))


def test_parse_peer_output_takes_the_last_json_line():
  out = 'log line\n{"examples_per_s": 1.0}\nmore\n{"examples_per_s": 2.5, "x": [1]}\n'
  assert peer.parse_peer_output(out) == {"examples_per_s": 2.5, "x": [1]}
  with pytest.raises(ValueError):
    peer.parse_peer_output("no json here")


TORCHREC_PY = peer.peer_python()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHREC_PY), reason=f"no TorchRec venv at {TORCHREC_PY} "
                    "(bash benchmarks/torchrec/setup.sh, or set GEM_JAX_TORCHREC_PYTHON)")
@pytest.mark.parametrize("interaction,autocast", [("dot", "off"), ("dcn", "bf16")])
def test_torchrec_bench_runs(interaction, autocast):
  """benchmarks/torchrec/bench.py for a few steps: its JSON, and the loss falls."""
  cmd = peer.peer_command(interaction=interaction, autocast=autocast, batch_size=256, steps=6,
                          warmup=2, num_tables=3, rows=2000, dim=16, bottom_mlp=(32,),
                          top_mlp=(32,), dcn_layers=2, dcn_rank=8, pool=4)
  r = peer.run_peer(cmd, timeout_s=600)
  assert r["framework"] == "torchrec" and r["interaction"] == interaction
  assert r["autocast"] == autocast and r["emb_impl"] in ("fused", "ebc")
  assert r["torch"].startswith("2.13.0") and r["torchrec"] == "1.8.0" and r["threads"] == 2
  assert r["steps"] == 6 and r["batch_size"] == 256 and len(r["losses"]) == 8
  assert r["examples_per_s"] == pytest.approx(256 / (r["step_ms_median"] / 1e3), rel=1e-3)
  assert r["own_busy_cores"] > 0 and r["other_busy_cores"] is not None
  assert np.all(np.isfinite(r["losses"]))
  assert min(r["losses"][-4:]) < r["loss_first"]  # 8 steps on 4 cycled batches: it learns


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHREC_PY), reason=f"no TorchRec venv at {TORCHREC_PY} "
                    "(bash benchmarks/torchrec/setup.sh, or set GEM_JAX_TORCHREC_PYTHON)")
def test_peer_matmul_times_real_dots():
  """benchmarks/torchrec/matmul.py in the venv: a time per dot, bigger dots take longer."""
  def dot(m, dt):
    return mc.DotShape((m, 256), (256, 256), dt, dt, (((1,), (0,)), ((), ())), None).as_dict()
  ms = peer.peer_dot_times([dot(64, "float32"), dot(4096, "float32"), dot(512, "bfloat16")])
  assert all(t > 0 for t in ms) and ms[1] > ms[0]


# ----------------------------------------------------------- timing / tables --

def test_step_stats():
  s = timing.StepStats((0.3, 0.1, 0.2, 0.5), batch_size=100)
  assert (s.median_s, s.min_s, s.max_s) == (0.25, 0.1, 0.5)
  assert s.examples_per_s == 400.0


def test_side_by_side_ratio():
  rows = [{"framework": "gem_jax", "examples_per_s": 90.0, "repeat": 0, "name": "x"},
          {"framework": "torchrec", "examples_per_s": 60.0, "repeat": 0},
          {"framework": "gem_jax", "examples_per_s": 150.0, "repeat": 1, "name": "x"},
          {"framework": "torchrec", "examples_per_s": 50.0, "repeat": 1},
          {"framework": "gem_jax", "examples_per_s": 100.0, "repeat": 2, "name": "x"},
          {"framework": "torchrec", "examples_per_s": 80.0, "repeat": 2}]
  s = report_table.side_by_side(rows)
  assert s["gem_jax_examples_per_s"] == 100.0 and s["torchrec_examples_per_s"] == 60.0
  assert s["ratio"] == pytest.approx(100 / 60)
  assert s["pair_ratios"] == pytest.approx([1.5, 3.0, 1.25])
  assert s["pair_ratio_median"] == pytest.approx(1.5)


# -------------------------------------------------------------- network model --

NET = network.Network(intra_bw=400e9, inter_bw=50e9, intra_lat=2e-6, inter_lat=10e-6,
                      gpus_per_node=8)


def test_collective_times_by_hand():
  # 8 GPUs in a node, 1.6 GB all-gather: 7/8 * 1.6e9 / 400e9 = 3.5 ms, + 7 x 2 us.
  assert NET.all_gather(1.6e9, 8) == pytest.approx(3.5e-3 + 14e-6)
  # 16 GPUs cross nodes: 15/16 * 1.6e9 / 50e9 = 30 ms, + 15 x 10 us.
  assert NET.all_gather(1.6e9, 16) == pytest.approx(30e-3 + 150e-6)
  assert NET.all_reduce(1.6e9, 16) == pytest.approx(2 * (30e-3 + 150e-6))
  assert NET.all_gather(1e9, 1) == 0.0


def test_step_terms_by_hand():
  vol = network.StepVolumes(emb_a2a=4e8, emb_sync=2e8, emb_sync_rows=1e9,
                            dense_params=1e9, param_bytes=2, grad_bytes=4)
  t = network.step_terms(vol, NET, replicas=4, shards=8)
  # a2a: 0.4 GB / 400 GB/s = 1 ms + 3 x 7 hops x 2 us
  assert t["emb_a2a"] == pytest.approx(1e-3 + 42e-6)
  # 2 all-gathers of 2 GB over 8: 2 x (7/8 x 2e9 / 400e9 + 14 us)
  assert t["hsdp_all_gather"] == pytest.approx(2 * (4.375e-3 + 14e-6))
  assert t["hsdp_reduce_scatter"] == pytest.approx(7 / 8 * 4e9 / 400e9 + 14e-6)
  # replicas: 4 devices strided over 4 nodes -> IB; all-reduce of 4 GB / 8 = 0.5 GB
  assert t["replica_all_reduce"] == pytest.approx(2 * (3 / 4 * 0.5e9 / 50e9 + 3 * 10e-6))
  assert t["emb_sync"] == pytest.approx(2e8 / 50e9 + 6 * 10e-6)      # 2 (R - 1) hops
  assert t["emb_sync_rows"] == pytest.approx(1e9 / 50e9 + 6 * 10e-6)  # ids + grads: 2 (R - 1)
  # measured: 2.5 bytes per parameter gathered per step (e.g. bf16, once + some remat)
  measured = dataclasses.replace(vol, gather_bytes=2.5)
  t2 = network.step_terms(measured, NET, replicas=4, shards=8)
  assert t2["hsdp_all_gather"] == pytest.approx(7 / 8 * 2.5e9 / 400e9 + 14e-6)
  assert t2["hsdp_reduce_scatter"] == t["hsdp_reduce_scatter"]
  # grad_accum=2: the shard reduction twice (8 B), the cross-replica one once (4 B)
  accum = dataclasses.replace(vol, grad_bytes=8, replica_grad_bytes=4)
  t3 = network.step_terms(accum, NET, replicas=4, shards=8)
  assert t3["hsdp_reduce_scatter"] == pytest.approx(7 / 8 * 8e9 / 400e9 + 14e-6)
  assert t3["replica_all_reduce"] == t["replica_all_reduce"]


def test_project_overlap_and_limit():
  terms = {"emb_a2a": 0.01, "hsdp_all_gather": 0.02, "hsdp_reduce_scatter": 0.01,
           "replica_all_reduce": 0.03, "emb_sync": 0.5, "emb_sync_rows": 0.005}
  p = network.project(0.1, terms)
  assert p["step_s_no_overlap"] == pytest.approx(0.1 + 0.01 + 0.56)
  assert p["step_s_overlap"] == pytest.approx(0.56 + 0.01)
  assert p["limit"] == "emb_sync"
  q = network.project(0.1, terms, emb_sync="rows")
  assert q["step_s_overlap"] == pytest.approx(0.1 + 0.01)
  assert q["limit"] == "compute"  # a2a is 10 % of compute: not above the threshold
  assert network.mfu(1e9, 1000.0, 8, 1e12) == pytest.approx(1e12 / 8e12)
  assert network.mesh_for(4, 8) == (1, 4) and network.mesh_for(64, 8) == (8, 8)
  assert network.device_counts(8, 64) == [8, 16, 32, 64]


def test_project_scale_runs():
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "project_scale.py"), "--config", "tiny",
         "--max-devices", "32", "--json", "--device-mfu", "0.5", "--peak", "1e12"]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  assert [r["devices"] for r in rows] == [8, 16, 32]
  r8 = rows[0]
  assert r8["mesh"] == [1, 8] and r8["replica_all_reduce_s"] == 0.0
  # one replica: only replicated tables sync (over the 8 shards); more replicas sync more.
  assert 0.0 <= r8["emb_sync_s"] < rows[1]["emb_sync_s"] < rows[2]["emb_sync_s"]
  for r in rows:
    assert r["plan_overlap_step_s"] <= r["plan_no_overlap_step_s"]
    assert 0 < r["plan_overlap_mfu"] <= 0.5 + 1e-9
  assert "GPUs" in p.stderr


def test_loss_check_compare_and_bench_lines(tmp_path):
  from gem_jax.bench import loss_check  # pylint: disable=import-outside-toplevel
  ref = {"label": "cpu", "losses": [0.70, 0.65, 0.61]}
  res = loss_check.compare(ref, {"label": "gpu", "losses": [0.71, 0.64, 0.60]}, atol=0.02)
  assert res["ok"] and res["steps"] == 3 and res["max_abs_diff"] == pytest.approx(0.01)
  assert not loss_check.compare(ref, {"losses": [0.70, 0.70, 0.61]}, atol=0.02)["ok"]
  path = tmp_path / "bench.jsonl"
  path.write_text(json.dumps({"framework": "gem_jax", "backend": "gpu", "dtype": "bfloat16",
                              "fp8": True, "warmup_losses": [0.7, 0.6, 0.5]}) + "\n"
                  + json.dumps({"framework": "torchrec", "examples_per_s": 1.0}) + "\n")
  runs = loss_check.load_runs(str(path))
  assert runs == [{"label": "gpu bfloat16 fp8", "losses": [0.7, 0.6, 0.5], "fp8": True,
                   "config": None}]


def test_loss_check_compares_only_the_reference_config(tmp_path, capsys):
  from gem_jax.bench import loss_check  # pylint: disable=import-outside-toplevel
  ref = tmp_path / "cpu.json"
  ref.write_text(json.dumps({"label": "cpu", "config": "medium", "losses": [0.70, 0.65]}))
  bench = tmp_path / "bench.jsonl"
  line = {"framework": "gem_jax", "backend": "gpu", "dtype": "bfloat16", "fp8": False}
  bench.write_text(json.dumps({**line, "config": "medium", "warmup_losses": [0.70, 0.66]}) + "\n"
                   + json.dumps({**line, "config": "gem_xl", "warmup_losses": [0.9, 0.9]}))
  assert loss_check.main(["--compare", str(ref), str(bench), "--atol", "0.02"]) == 0
  out = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
  assert len(out) == 1 and out[0]["ok"]   # gem_xl's losses are not checked against medium's
