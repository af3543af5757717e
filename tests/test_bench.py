"""Benchmark suite: JSON fields of a real run, the peer's command and data, the network model."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gem_jax.bench import network, peer, report_table, timing

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
  assert r["mfu"] == pytest.approx(r["tflops_per_device"] * 1e12 / r["peak_flops_per_device"])
  assert r["embedding_exchange_bytes_per_step"] == 0  # one device: nothing leaves it
  assert r["mem_peak_bytes_compiled"] >= 8 * 1000 * 64 * 4  # the tables are arguments
  assert np.isfinite(r["loss_first"]) and np.isfinite(r["loss_last"])
  assert r["loadavg_1m"] >= 0 and r["dense_step_ms_median"] > 0
  assert "examples/s (median step)" in table and "MFU" in table
  # the dense part's dots timed alone bound its MFU from above
  assert r["matmul_count"] >= 3 * 4 and r["matmul_flops_per_step"] > 0
  assert r["dense_mfu_ceiling"] >= r["dense_mfu"] > 0
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


# ------------------------------------------------------------------- the peer --

def test_peer_command_matches_the_config():
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import dcn_peer  # pylint: disable=import-outside-toplevel
  import dlrm_peer  # pylint: disable=import-outside-toplevel
  cmd = peer.peer_command_from_config(dlrm_peer.get_config(), steps=20, warmup=5,
                                      python="/venv/bin/python")
  assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("torchrec_bench.py")
  args = dict(zip(cmd[2::2], cmd[3::2]))
  assert args == {"--interaction": "dot", "--batch-size": "4096", "--steps": "20",
                  "--warmup": "5", "--num-tables": "8", "--rows": "100000", "--dim": "64",
                  "--pooling": "1", "--bottom-mlp": "512,256", "--top-mlp": "512,256",
                  "--optimizer": "sgd", "--lr": "0.1", "--threads": "2", "--seed": "0",
                  "--batch-pool": "32"}
  dcn = peer.peer_command_from_config(dcn_peer.get_config(), steps=20, warmup=5, python="p")
  dargs = dict(zip(dcn[2::2], dcn[3::2]))
  assert dargs["--interaction"] == "dcn" and dargs["--dcn-layers"] == "3"
  assert dargs["--dcn-rank"] == "512"


def test_run_peer_without_venv_says_how_to_make_it():
  with pytest.raises(FileNotFoundError, match="setup_torchrec.sh"):
    peer.run_peer(peer.peer_command(python="/nonexistent/python"))


def test_parse_peer_output_takes_the_last_json_line():
  out = 'log line\n{"examples_per_s": 1.0}\nmore\n{"examples_per_s": 2.5, "x": [1]}\n'
  assert peer.parse_peer_output(out) == {"examples_per_s": 2.5, "x": [1]}
  with pytest.raises(ValueError):
    peer.parse_peer_output("no json here")


def test_peer_source_gives_the_peers_exact_arrays():
  tb = peer.peer_module()
  src = peer.PeerSource(num_tables=3, rows=500, pool=2, seed=4)
  got = [next(iter(src.batches(16))) for _ in range(1)] + [src.pool(16)[1]]
  samplers = tb.make_samplers(3, 500, 1.05, 4)
  rng = np.random.default_rng(5)
  for b in got:
    dense, ids, labels = tb.synthetic_batch(samplers, 16, 1, rng)
    np.testing.assert_array_equal(b["dense"], dense)
    for i in range(3):
      np.testing.assert_array_equal(b["ids"][f"f{i}"], ids[i])
    np.testing.assert_array_equal(b["labels"][:, 0], labels)
    assert b["label_mask"].shape == (16, 1) and b["label_mask"].min() == 1.0


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
  assert runs == [{"label": "gpu bfloat16 fp8", "losses": [0.7, 0.6, 0.5], "fp8": True}]
