"""Soak run of the trainer: `tiny` for a long time; do memory, step time and disk stay flat?

  python scripts/soak.py --minutes 30 --workdir /tmp/gem_jax_soak

One process on 8 CPU devices trains `configs/tiny.py` with a checkpoint every
`--checkpoint-every` steps, an evaluation every `--eval-every` steps and
`--keep` recent checkpoints (plus the best by eval AUC). Every `--sample-s`
seconds the harness records the trainer's host RSS (VmRSS in /proc/PID/status),
the number of checkpoint directories and the size of the persistent compilation
cache; step times come from metrics.jsonl (`step_time_s`, one row per
`--log-every` steps: eval and checkpoint time are not in it). Time counts from
the first logged step (start-up is not part of the soak). After `--minutes` it
sends SIGTERM (the trainer saves and exits 0), then starts the trainer twice more,
two checkpoint periods each: both must resume; the first may add the restore
path's programs to the cache (a fresh start never runs them), the second nothing.

Analysis, after `--warmup-min` minutes (first compile, first evaluation, allocator
growth): the least-squares slope of RSS in MB per hour fitted to medians over
`--window-min` windows (the RSS is a sawtooth: see `analyse`), with the slopes
of its anonymous and file-backed parts and of the huge pages in it; step-time drift = median
step time of the last fifth of the post-warm-up rows / median of the first fifth
- 1 (medians over windows: neighbours on shared cores add noise); the most
checkpoint directories seen at once (target <= keep + 1, the best); cache growth
after warm-up and on the second restart (target 0 bytes). The trainer logs its own
malloc figures (heap in use, freed but kept): their slopes tell a leak of live objects
from memory glibc retains; the RSS gained per mapping (/proc/PID/smaps) from the end of the
warm-up to the end tells which memory grows (malloc's main heap, anonymous mappings, files).

Device memory: on the CPU backend the device buffers are host memory and are in
the RSS. Prints one JSON line (the summary, with `pass` and the failed targets).
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import chaos

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gem_jax import hostmem  # noqa: E402  (imports no jax)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RSS_SLOPE_MB_PER_H = 10.0
STEP_DRIFT = 0.05


def rss_mb(pid: int) -> dict | None:
  """VmRSS, RssAnon and RssFile of `pid` in MB (None once it is gone). A leak is
  anonymous memory; file pages (mapped libraries) come and go with the page cache."""
  keys = {"VmRSS:": "rss_mb", "RssAnon:": "anon_mb", "RssFile:": "file_mb"}
  out = {}
  try:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
      for line in f:
        if line.split(maxsplit=1)[0] in keys:
          out[keys[line.split()[0]]] = round(int(line.split()[1]) / 1024, 2)
  except (FileNotFoundError, ProcessLookupError):
    return None
  return out if "rss_mb" in out else None


def dir_bytes(path: str) -> int:
  total = 0
  for d, _, files in os.walk(path):
    for n in files:
      try:
        total += os.path.getsize(os.path.join(d, n))
      except OSError:  # removed while walking
        pass
  return total


def checkpoint_dirs(path: str) -> int:
  try:
    return sum(n.isdigit() for n in os.listdir(path))
  except FileNotFoundError:
    return 0


def step_rows(workdir: str) -> list[tuple[int, float]]:
  """(step, step_time_s) of every train row of metrics.jsonl."""
  return chaos.metric_rows(workdir, "step_time_s")


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
  """Least-squares slope of ys over ts (seconds), per hour."""
  if len(ts) < 2:
    return float("nan")
  mt, my = statistics.fmean(ts), statistics.fmean(ys)
  var = sum((t - mt) ** 2 for t in ts)
  return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var * 3600 if var else 0.0


def trainer_cmd(args, workdir: str, cache: str, stop_at: int = 0) -> list[str]:
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         "--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", workdir,
         "--config.train.steps=100000000", f"--config.train.log_every={args.log_every}",
         f"--config.train.checkpoint_every={args.checkpoint_every}",
         f"--config.train.eval_every={args.eval_every}", "--config.train.eval_batches=2",
         f"--config.train.keep={args.keep}", f"--config.train.compile_cache={cache}"]
  return cmd + ([f"--config.train.stop_at={stop_at}"] if stop_at else [])


def trainer_env(glibc_tunables: str = "", preload: str = "", malloc: str = "") -> dict:
  """The trainer's environment: CPU, 8 devices, GLIBC_TUNABLES as given (empty: the
  trainer's own, malloc huge pages: `hostmem.use_host_malloc`), GEM_JAX_MALLOC = `malloc`
  (empty: the trainer's own choice, auto: jemalloc where found), LD_PRELOAD = `preload` (another
  malloc, e.g. libtcmalloc.so.4; empty: none of the harness's own)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  for k in ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", hostmem.MALLOC):
    env.pop(k, None)
  if malloc:
    env[hostmem.MALLOC] = malloc
  if glibc_tunables:   # named tunables win over the trainer's (gem_jax/hostmem.py)
    env["GLIBC_TUNABLES"] = glibc_tunables
  if preload:
    if not os.path.isfile(preload):
      raise SystemExit(f"--preload {preload}: no such file")
    env["LD_PRELOAD"] = preload
  return env


def window_medians(samples: list[dict], key: str, window_s: float) -> list[tuple[float, float]]:
  """(mid time, median of `key`) of consecutive `window_s` windows of `samples`."""
  out, i = [], 0
  while i < len(samples):
    t_end = samples[i]["t"] + window_s
    win = [s[key] for s in samples[i:] if s["t"] < t_end]
    out.append((samples[i]["t"] + window_s / 2, statistics.median(win)))
    i += len(win)
  return out


def analyse(samples: list[dict], rows: list[tuple[float, int, float]], warmup_s: float,
            keep: int, window_s: float = 300.0) -> dict:
  """The summary of a soak: `samples` (t, rss_mb, ckpts, cache_bytes, step), `rows` (t,
  step, step_time_s), both with t in seconds since the start. The RSS slope is fitted
  to window medians: the trainer's RSS is a sawtooth (garbage freed in bursts every
  few hundred steps), and one burst right after the warm-up would dominate a fit to
  the raw samples."""
  warm = [s for s in samples if s["t"] >= warmup_s]
  warm_rows = [r for r in rows if warmup_s <= r[0] < float("inf")]  # seen by a sample
  wins = window_medians(warm, "rss_mb", window_s)
  full = [w for w in wins if w[0] + window_s / 2 <= warm[-1]["t"] + 1] if warm else []
  wins = full if len(full) >= 2 else wins  # a last, partial window only if needed
  rss_slope = slope_per_hour([t for t, _ in wins], [v for _, v in wins])
  fit_slope = slope_per_hour([s["t"] for s in warm], [s["rss_mb"] for s in warm])
  huge_slope = slope_per_hour([s["t"] for s in warm], [s.get("huge_mb", 0.0) for s in warm])
  n_wins = len(wins)

  def win_slope(key):
    w = window_medians([{**s, key: s.get(key, 0.0)} for s in warm], key, window_s)[:n_wins]
    return slope_per_hour([t for t, _ in w], [v for _, v in w])
  anon_slope, file_slope = win_slope("anon_mb"), win_slope("file_mb")
  per_step = (slope_per_hour([s["step"] for s in warm], [s["rss_mb"] for s in warm]) / 3600
              * 1000 if len(warm) > 1 else float("nan"))
  over = sum(s["ckpts"] > keep + 1 for s in samples)
  n = max(len(warm_rows) // 5, 1)
  first = statistics.median(r[2] for r in warm_rows[:n]) if warm_rows else float("nan")
  last = statistics.median(r[2] for r in warm_rows[-n:]) if warm_rows else float("nan")
  drift = last / first - 1 if warm_rows else float("nan")
  step_slope = slope_per_hour([r[0] for r in warm_rows], [r[2] for r in warm_rows])
  max_ckpts = max((s["ckpts"] for s in samples), default=0)
  cache_growth = (warm[-1]["cache_bytes"] - warm[0]["cache_bytes"]) if warm else 0
  return {
      "samples": len(samples), "samples_after_warmup": len(warm),
      "rss_mb_start": round(warm[0]["rss_mb"], 1) if warm else None,
      "rss_mb_end": round(warm[-1]["rss_mb"], 1) if warm else None,
      "rss_mb_max": round(max(s["rss_mb"] for s in samples), 1) if samples else None,
      "rss_slope_mb_per_h": round(rss_slope, 2),
      "rss_window_medians_mb": [round(v, 1) for _, v in wins], "window_min": window_s / 60,
      "rss_slope_fit_mb_per_h": round(fit_slope, 2),
      "rss_mb_per_1000_steps": round(per_step, 2),
      "huge_pages_mb_end": round(warm[-1].get("huge_mb", 0.0), 1) if warm else None,
      "huge_pages_slope_mb_per_h": round(huge_slope, 2),
      "rss_anon_slope_mb_per_h": round(anon_slope, 2),
      "rss_file_slope_mb_per_h": round(file_slope, 2),
      "rss_anon_mb_end": warm[-1].get("anon_mb") if warm else None,
      "rss_file_mb_end": warm[-1].get("file_mb") if warm else None,
      "step_time_s_first": round(first, 5), "step_time_s_last": round(last, 5),
      "step_time_drift": round(drift, 4),
      "step_time_slope_s_per_h": round(step_slope, 5),
      "steps": rows[-1][1] if rows else 0,
      "max_checkpoint_dirs": max_ckpts, "checkpoint_dirs_allowed": keep + 1,
      "samples_over_allowed_dirs": over,
      "checkpoint_dirs_end": samples[-1]["ckpts"] if samples else 0,
      "cache_growth_after_warmup_bytes": cache_growth,
  }


def heap_summary(workdir: str, row_t: dict, warmup_s: float, window_s: float) -> dict:
  """Slopes (MB/h, over window medians after the warm-up) of the trainer's own malloc
  figures from metrics.jsonl (`hostmem.host_memory_mb`): heap_used growing is live
  allocations (a leak); RSS growing with heap_used flat is memory glibc retains."""
  out = {}
  for key in ("host_heap_used_mb", "host_heap_free_mb"):
    pts = [{"t": row_t[s], key: v} for s, v in chaos.metric_rows(workdir, key)
           if s in row_t and row_t[s] >= warmup_s]
    if len(pts) < 2:
      continue
    wins = window_medians(pts, key, window_s)
    name = key.removeprefix("host_").removesuffix("_mb")
    out[f"{name}_slope_mb_per_h"] = round(slope_per_hour([t for t, _ in wins],
                                                         [v for _, v in wins]), 2)
    out[f"{name}_window_medians_mb"] = [round(v, 1) for _, v in wins]
  return out


def verdict(out: dict) -> dict:
  failed = []
  if not out["rss_slope_mb_per_h"] < RSS_SLOPE_MB_PER_H:
    failed.append("rss_slope")
  if not abs(out["step_time_drift"]) < STEP_DRIFT:
    failed.append("step_time_drift")
  # A new checkpoint is renamed into place before the oldest is deleted: one more
  # directory for a moment is retention working; more, or often, is not.
  if (out["max_checkpoint_dirs"] > out["checkpoint_dirs_allowed"] + 1 or
      out["samples_over_allowed_dirs"] > 0.05 * max(out["samples"], 1) or
      out["checkpoint_dirs_end"] > out["checkpoint_dirs_allowed"]):
    failed.append("checkpoint_dirs")
  if out["cache_growth_after_warmup_bytes"] or out.get("cache_growth_on_restart_bytes"):
    failed.append("compile_cache_growth")
  if not out.get("restart_resumed", True):
    failed.append("restart")
  return {"pass": not failed, "failed": failed}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--minutes", type=float, default=30.0)
  p.add_argument("--warmup-min", type=float, default=0.0, help="default: min(5, minutes / 5)")
  p.add_argument("--sample-s", type=float, default=5.0)
  p.add_argument("--checkpoint-every", type=int, default=10)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--keep", type=int, default=2)
  p.add_argument("--window-min", type=float, default=0.0,
                 help="RSS median windows (default: min(5, minutes / 6))")
  p.add_argument("--workdir", default="", help="default: a temporary directory (removed)")
  p.add_argument("--no-restart", action="store_true", help="skip the restarts at the end")
  p.add_argument("--glibc-tunables", default="",
                 help="GLIBC_TUNABLES for the trainer instead of its own (hugetlb=1), e.g. "
                      "'glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2'")
  p.add_argument("--malloc", choices=["auto", "jemalloc", "glibc"], default="",
                 help="the trainer's GEM_JAX_MALLOC (default: its own, auto: jemalloc where found; "
                      "gem_jax/hostmem.py)")
  p.add_argument("--preload", default="",
                 help="another malloc library for the trainer (LD_PRELOAD), e.g. "
                      "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
  p.add_argument("--samples-out", default="", help="write the raw samples (JSON) here")
  args = p.parse_args(argv)
  warmup_s = 60 * (args.warmup_min or min(5.0, args.minutes / 5))
  window_s = 60 * (args.window_min or min(5.0, args.minutes / 6))
  root = args.workdir or tempfile.mkdtemp(prefix="gem_jax_soak_")
  workdir, cache = os.path.join(root, "run"), os.path.join(root, "xla_cache")
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  log = open(os.path.join(root, "trainer.log"), "w", encoding="utf-8")  # noqa: SIM115
  env = trainer_env(args.glibc_tunables, args.preload, args.malloc)
  proc = subprocess.Popen(trainer_cmd(args, workdir, cache), stdout=subprocess.DEVNULL,
                          stderr=log, env=env, cwd=ROOT)
  t0 = None  # the first logged train row: start-up (imports, compiling) is not the soak
  samples, row_t, seen, malloc = [], {}, 0, "unknown"
  maps = {}   # per-mapping RSS at the end of the warm-up and at the end (where it grows)
  try:
    while proc.poll() is None and (t0 is None or time.monotonic() - t0 < 60 * args.minutes):
      rss = rss_mb(proc.pid)
      rows = step_rows(workdir)
      if t0 is None and rows:
        t0 = time.monotonic()
      t = time.monotonic() - t0 if t0 is not None else 0.0
      for step, _ in rows[seen:]:  # when each row appeared (within one sample period)
        row_t[step] = t
      seen = len(rows)
      if rss is not None and rows:  # trained: the run is past its start-up
        if malloc == "unknown":
          malloc = hostmem.allocator(proc.pid)
        samples.append({"t": round(t, 1), **rss, "huge_mb": round(hostmem.anon_huge_pages_mb(proc.pid), 1),
                        "ckpts": checkpoint_dirs(os.path.join(workdir, "checkpoints")),
                        "cache_bytes": dir_bytes(cache), "step": rows[-1][0]})
        if t >= warmup_s:
          maps["end"] = hostmem.mapping_rss_kb(proc.pid)
          maps.setdefault("warm", maps["end"])
      time.sleep(args.sample_s)
    if proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=600)
  finally:
    if proc.poll() is None:
      proc.kill()
    log.close()
  rows = [(row_t.get(s, float("inf")), s, v) for s, v in step_rows(workdir)]
  out = {"minutes": args.minutes, "warmup_min": round(warmup_s / 60, 2), "rc": rc,
         "checkpoint_every": args.checkpoint_every, "eval_every": args.eval_every,
         "keep": args.keep,
         **analyse(samples, rows, warmup_s, args.keep, window_s),
         **heap_summary(workdir, row_t, warmup_s, window_s),
         "evals": sum(1 for _ in _eval_rows(workdir)),
         "load_avg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
         "glibc_tunables": args.glibc_tunables or "trainer's own", "allocator": malloc,
         "rss_growth_mb_by_mapping": (hostmem.rss_growth_by_mapping(maps["warm"], maps["end"])
                                      if maps.get("warm") and maps.get("end") else {})}
  if rc != 0:
    with open(os.path.join(root, "trainer.log"), encoding="utf-8") as f:
      print(f.read()[-3000:], file=sys.stderr)
  if not args.no_restart:
    out.update(restart(args, workdir, cache, root))
  out.update(verdict(out))
  if rc != 0:
    out["pass"] = False
    out["failed"].append("trainer_exit")
  if args.samples_out:
    with open(args.samples_out, "w", encoding="utf-8") as f:
      json.dump({"samples": samples, "rows": rows}, f)
  print(json.dumps(out), flush=True)
  if not args.workdir:
    shutil.rmtree(root, ignore_errors=True)
  return out


def _eval_rows(workdir: str):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      if '"eval_auc"' in line:
        yield line


def restart(args, workdir: str, cache: str, root: str) -> dict:
  """Two more starts, two checkpoint periods each: both resume; the first may compile
  the restore path's programs (a fresh start has none), the second nothing."""
  ckpts, out = os.path.join(workdir, "checkpoints"), {}
  for i in (1, 2):
    last = max((int(n) for n in os.listdir(ckpts) if n.isdigit()), default=0)
    before, t = dir_bytes(cache), time.monotonic()
    r = subprocess.run(trainer_cmd(args, workdir, cache, last + 2 * args.checkpoint_every),
                       capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env=trainer_env(args.glibc_tunables, args.preload, args.malloc))
    with open(os.path.join(root, f"restart{i}.log"), "w", encoding="utf-8") as f:
      f.write(r.stderr)
    ok = r.returncode == 0 and f"resumed from the checkpoint at step {last}" in r.stderr
    out[f"restart{i}_s"] = round(time.monotonic() - t, 1)
    out[f"restart{i}_cache_growth_bytes"] = dir_bytes(cache) - before
    out["restart_rc"] = out.get("restart_rc") or r.returncode
    out["restart_resumed"] = out.get("restart_resumed", True) and ok
  out["cache_growth_on_restart_bytes"] = out["restart2_cache_growth_bytes"]
  out["checkpoint_dirs_after_restart"] = checkpoint_dirs(ckpts)
  return out


if __name__ == "__main__":
  main()
