"""scripts/bench_input.py end to end on tiny data: every measurement in its JSON line, the
P = 1/2/4 batches bit-identical, bytes per process within 10 % of 1/P."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_bench_input_tiny(tmp_path):
  # 20,480 rows in row groups of 320 (rows // 64): 64 groups of equal size, so the lanes of
  # every process count start on group boundaries and no group is read twice.
  out_file = tmp_path / "bench.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  out = subprocess.run(
      [sys.executable, "scripts/bench_input.py", "--rows", "20480", "--repeat", "1",
       "--batch-size", "256", "--step-batch", "256", "--steps", "4", "--warmup", "2",
       "--vocab", "1000", "--workers", "2", "--workdir", str(tmp_path / "work"),
       "--out", str(out_file)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
  assert len(lines) == 1
  res = json.loads(lines[0])
  assert json.loads(out_file.read_text().splitlines()[-1]) == res
  assert res["rows"] == 20480 and res["row_group_rows"] == 320 and res["row_groups"] == 64
  assert res["cpu_count"] >= 1 and res["loadavg"] is not None

  rates = [res["text"], res["convert"], res["convert_1core"], res["convert_workers"],
           *(res["reader"][f"{o}_w{w}"] for o in ("shuffled", "file_order") for w in (1, 2, 4))]
  for r in rates:
    assert r["rows"] == 20480 and r["rows_per_s"] > 0, r
  assert res["convert_workers"]["workers"] == 2
  assert res["reader_vs_text"] > 0

  st = res["step"]
  for k in ("reader_step_ms", "device_step_ms", "pool_step_ms", "device_gen_ms", "ratio",
            "ratio_vs_pool", "waited_fraction", "starved_fraction"):
    assert st[k] >= 0, (k, st)
  assert st["reader_step_ms"] > 0 and st["device_step_ms"] > 0 and st["finite"]
  assert st["config"] == "dlrm_peer" and st["tables"] == 26

  bpp = res["bytes_per_process"]
  assert sorted(bpp) == ["1", "2", "4"]
  for p, v in bpp.items():
    assert v["identical"] and v["batches"] == 20480 // 256, (p, v)
    assert len(v["shares"]) == int(p) and abs(sum(v["shares"]) - 1) < 1e-3
    assert v["max_dev"] <= 0.10, (p, v)
  assert res["checks"]["batches_identical_p124"]
  assert set(res["targets"]) == {"convert_1core_rows_per_s", "reader_rows_per_s",
                                 "reader_vs_text", "bytes_max_dev", "step_ratio"}
  assert res["targets"]["bytes_max_dev"]["holds"]
  assert "(e) bytes read per process" in out.stderr
