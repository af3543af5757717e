"""Run reporting: JSONL + TensorBoard files, progress lines, peaks/MFU, compile cache, profiler."""
import glob
import gzip
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.train import report


def read_tb_scalars(logdir):
  """{tag: [(step, value)]} from tensorboardX event files (TFRecord framing, no TF needed)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      for v in ev.summary.value:
        out.setdefault(v.tag, []).append((ev.step, v.simple_value))
  return out


def test_metric_writer_jsonl_and_tensorboard(tmp_path):
  w = report.MetricWriter(str(tmp_path), enabled=True)
  w.write(10, {"train_loss": jnp.float32(0.5), "examples_per_s": np.float64(1234.5),
               "auc/click": 0.75, "note": "warmup"})
  w.write(20, {"train_loss": 0.25, "eval_auc": float("nan"), "n": np.int64(3)})
  w.close()
  rows = report.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert rows[0] == {"step": 10, "train_loss": 0.5, "examples_per_s": 1234.5,
                     "auc/click": 0.75, "note": "warmup"}
  assert rows[1]["step"] == 20 and rows[1]["n"] == 3 and np.isnan(rows[1]["eval_auc"])
  tb = read_tb_scalars(str(tmp_path / "tb"))
  assert tb["train_loss"] == [(10, 0.5), (20, 0.25)]
  assert tb["auc/click"] == [(10, 0.75)]
  assert "note" not in tb
  # Appends on resume; a truncated last line (crash mid-write) is skipped.
  w2 = report.MetricWriter(str(tmp_path), enabled=True, tensorboard=False)
  w2.write(30, {"train_loss": 0.125})
  w2.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 40, "train_lo')
  assert [r["step"] for r in report.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [10, 20, 30]


def test_metric_writer_disabled_writes_nothing(tmp_path):
  w = report.MetricWriter(str(tmp_path / "w"), enabled=False)
  w.write(1, {"a": 1.0})
  w.close()
  assert not os.path.exists(tmp_path / "w")


def test_progress_plain_lines_with_eta():
  buf = io.StringIO()
  p = report.Progress(10, initial=2, stream=buf, enabled=True)
  assert p.tty is False
  p._t0 -= 8.0                      # pretend 8 s went into the first 4 steps
  p.update(6, {"train_loss": 0.123456, "mfu": 0.25, "other": 1})
  line = buf.getvalue().strip()
  assert line.startswith("step 6/10 (60%) train_loss=0.1235 mfu=0.25 |")
  assert "other" not in line
  assert line.endswith("ETA 0:00:08")            # 2 s per step, 4 steps left
  p.close()


def test_progress_bar_on_tty():
  buf = io.StringIO()
  p = report.Progress(5, stream=buf, tty=True, enabled=True)
  for s in range(1, 6):
    p.update(s, {"train_loss": 1.0 / s})
  p.close()
  out = buf.getvalue()
  assert "5/5" in out and "train_loss=0.2" in out


@pytest.mark.parametrize("kind,dtype,tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0),
    ("NVIDIA H100 PCIe", "bfloat16", 756.0),
    ("NVIDIA H200", jnp.bfloat16, 989.0),
    ("NVIDIA H200", "float32", 494.5),
    ("NVIDIA H200", jnp.float8_e4m3fn, 1978.0),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
    ("NVIDIA B200", "bfloat16", 2250.0),
])
def test_gpu_peaks(kind, dtype, tflops):
  dev = types.SimpleNamespace(platform="gpu", device_kind=kind)
  assert report.peak_flops_per_device(dev, dtype) == pytest.approx(tflops * 1e12)


def test_tpu_peaks_and_unknown():
  tpu = lambda k: types.SimpleNamespace(platform="tpu", device_kind=k)  # noqa: E731
  assert report.peak_flops_per_device(tpu("TPU v4")) == 275e12
  assert report.peak_flops_per_device(tpu("TPU v5 lite")) == 197e12
  assert report.peak_flops_per_device(tpu("TPU v5p"), "float32") == 459e12
  assert report.peak_flops_per_device(tpu("TPU v6 lite")) == 918e12
  assert report.peak_flops_per_device(types.SimpleNamespace(
      platform="gpu", device_kind="Some Future GPU")) is None


def test_cpu_peak_is_a_measured_probe():
  peak = report.peak_flops_per_device(jax.devices()[0], "float32")
  # 8 simulated devices share this machine's cores: between 0.1 and 1000 GFLOP/s each.
  assert 1e8 < peak < 1e12
  assert report.peak_flops_per_device(jax.devices()[0], "float32") == peak   # cached
  assert report.peak_flops_per_device(jax.devices()[0], jnp.float8_e4m3fn) == peak


def test_mfu_and_throughput():
  assert report.mfu(6e9, 1000.0, 8, 1e12) == pytest.approx(6e12 / 8e12)
  assert np.isnan(report.mfu(6e9, 1000.0, 8, None))
  t = report.throughput(examples=4096, seconds=2.0, steps=4, flops_per_example=1e9,
                        n_devices=8, peak_flops=1e12)
  assert t["examples_per_s"] == 2048.0 and t["examples_per_s_per_device"] == 256.0
  assert t["step_time_s"] == 0.5
  assert t["tflops_per_device"] == pytest.approx(0.256)
  assert t["mfu"] == pytest.approx(0.256)


def test_timed_compile():
  f = jax.jit(lambda x: jnp.sin(x) @ x.T)
  x = jnp.ones((8, 8))
  compiled, timing = report.timed_compile(f, x)
  assert timing.lower_s > 0 and timing.compile_s > 0
  np.testing.assert_allclose(compiled(x), f(x))


_CACHE_PROBE = textwrap.dedent("""
    import sys, time, jax, jax.numpy as jnp
    from gem_jax.train import report
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
    assert report.enable_compilation_cache(sys.argv[1]) is not None
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    _, t = report.timed_compile(f, jnp.ones((64, 64)))
    print(len(hits), t.compile_s)
""")


def test_compilation_cache_second_start_hits(tmp_path):
  cache = str(tmp_path / "cache")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  runs = []
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", _CACHE_PROBE, cache], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    runs.append((int(out[0]), float(out[1])))
  assert runs[0][0] == 0 and runs[1][0] >= 1, runs
  assert os.listdir(cache)
  assert report.enable_compilation_cache("off") is None


def test_parse_steps():
  assert report.parse_steps("") is None and report.parse_steps(None) is None
  assert report.parse_steps("3,5") == (3, 5) == report.parse_steps("3:5")
  assert report.parse_steps((3, 5)) == (3, 5)
  assert report.parse_steps("7") == (7, 8) == report.parse_steps(7)
  with pytest.raises(ValueError):
    report.parse_steps("5,3")


def test_profiler_traces_chosen_steps(tmp_path):
  prof = report.Profiler(str(tmp_path), "2,4", enabled=True)
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((32, 32))
  started, announced = [], []
  for step in range(6):
    announced.append(prof.starts_at(step))
    started.append(prof.maybe_start(step))
    with report.step_annotation(step):
      x = f(x)
    prof.maybe_stop(step + 1, x)
  prof.close()
  assert started == announced == [False, False, True, False, False, False]
  assert prof.done and not prof.active
  assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
  traces = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.trace.json.gz"))
  assert traces
  events = json.loads(gzip.open(traces[0]).read())
  events = events["traceEvents"] if isinstance(events, dict) else events
  steps = {e.get("args", {}).get("step_num") for e in events if e.get("name") == "train"}
  assert steps == {"2", "3"}, steps
