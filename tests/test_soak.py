"""scripts/soak.py at a small scale: ~1 minute of `tiny` with checkpoints and evals.

Too short to measure a leak or a drift (the 30-minute soak does that); it checks
that the harness samples the trainer, that retention holds the checkpoint
directories at keep + 1 (the best), that the restart resumes and finds every
program in the persistent compilation cache (no growth), and that the summary
has every figure the long run reports.

Slow: two starts of the trainer (one compiling) plus a minute of training.
"""
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import soak  # noqa: E402  pylint: disable=wrong-import-position
from gem_jax import hostmem  # noqa: E402  pylint: disable=wrong-import-position

@pytest.mark.slow  # minutes of real training runs
def test_soak_short(tmp_path):
  out = soak.main(["--minutes", "1", "--warmup-min", "0.3", "--sample-s", "2",
                   "--checkpoint-every", "5", "--eval-every", "20", "--keep", "2",
                   "--workdir", str(tmp_path)])
  print(out)
  assert out["rc"] == 0 and out["samples_after_warmup"] >= 5 and out["evals"] >= 1
  assert 0 < out["max_checkpoint_dirs"] <= out["checkpoint_dirs_allowed"] == 3
  assert out["checkpoint_dirs_after_restart"] <= 3
  assert out["restart_rc"] == 0 and out["restart_resumed"]
  assert out["cache_growth_on_restart_bytes"] == 0
  for k in ("rss_slope_mb_per_h", "step_time_drift", "step_time_s_first", "step_time_s_last"):
    assert math.isfinite(out[k]), k
  assert set(out) >= {"pass", "failed", "cache_growth_after_warmup_bytes", "load_avg"}
  if sys.platform.startswith("linux"):
    own = "jemalloc" if hostmem.jemalloc_library() else "glibc"   # the trainer's default: auto
    assert out["allocator"] == own   # the trainer's own, no --malloc or --preload


def test_trainer_env_preloads_a_named_malloc(tmp_path, monkeypatch):
  monkeypatch.setenv("LD_PRELOAD", "/elsewhere/libx.so")
  monkeypatch.setenv("MALLOC_CONF", "narenas:1")
  env = soak.trainer_env()
  assert "LD_PRELOAD" not in env and "MALLOC_CONF" not in env   # the harness's own: not inherited
  assert soak.trainer_env(malloc="glibc")["GEM_JAX_MALLOC"] == "glibc"
  lib = tmp_path / "libjemalloc.so.2"
  lib.write_bytes(b"")
  assert soak.trainer_env(preload=str(lib))["LD_PRELOAD"] == str(lib)
  with pytest.raises(SystemExit, match="no-such.so: no such file"):
    soak.trainer_env(preload=str(tmp_path / "no-such.so"))


def test_analysis_of_a_synthetic_leak():
  """A 20 MB/h RSS ramp and a 10 % step-time rise fail; a flat run passes."""
  def run(mb_per_h, rise):
    samples = [{"t": t, "rss_mb": 500 + mb_per_h * t / 3600, "ckpts": 3, "cache_bytes": 7,
                "step": t}
               for t in range(0, 3600, 10)]
    rows = [(t, t, 0.1 * (1 + rise * t / 3600)) for t in range(0, 3600, 5)]
    out = soak.analyse(samples, rows, warmup_s=300, keep=2)
    return out, soak.verdict(out)
  out, v = run(20.0, 0.1)
  assert out["rss_slope_mb_per_h"] == pytest.approx(20.0, rel=1e-6)
  assert v["failed"] == ["rss_slope", "step_time_drift"]
  out, v = run(0.0, 0.0)
  assert out["rss_slope_mb_per_h"] == 0 and out["step_time_drift"] == 0 and v["pass"]
