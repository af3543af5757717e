"""One benchmark run of a run config: the trainer's own setup and jitted step, timed.

  result = run_benchmark(load_config('small'), steps=20, warmup=3)

What is measured, in this order (all in one process):
  1. peak FLOP/s per device: the vendor table on GPU/TPU (`report.peak_flops_per_device`)
     and a matmul probe on every platform (CPU: `report.matmul_probe_flops`, the MFU
     denominator; GPU: a bf16 (8192^3) product);
  2. setup + state exactly as the trainer builds them (`gem_jax.train.setup`) and the input
     (`input`): 'host' (the default): a pool of `pool` host batches of the config's source,
     put on the devices before timing and cycled (data is not timed; the TorchRec peer
     does the same on the same arrays); 'device': the warm-up steps still read the
     source's first batches (so `warmup_losses` stay comparable across backends,
     `loss_check`), and every timed step draws a fresh batch on the device
     (`gem_jax.data.device_synthetic`, jitted, in the step's shardings, step number as
     key): its generation is inside the timing, one extra dispatch queued before the
     step (no host work, no transfer); `input_ms_median` is the generator alone and
     `input_compile_s` its compile (JSON fields `input`, `pool`: host batches cycled);
  3. compile time: cold (empty persistent cache) and warm (in-memory caches cleared,
     the same program loaded from the now-primed persistent cache);
  4. `warmup` untimed steps, then `steps` steps timed one by one (median/min/max),
     then the same number dispatched back to back (pipelined examples/s);
  5. optionally the dense part alone: `step.dense_grads` + the dense optimizer on
     fixed embeddings (no lookup, no exchange, no sparse update), for dense MFU
     (its batches from the same input, generation timed with it under 'device');
  6. optionally the MFU ceiling of the dense part's matmul shapes: every dot of its
     traced program timed alone (`gem_jax.bench.matmul_ceiling`).

MFU = analytic train FLOPs per example (`gem_jax.flops`, 3 x forward) x examples/s
/ (devices x peak). Memory: the compiled step's `memory_analysis()` (arguments +
outputs - aliased + temporaries) and, where the device reports it, its peak bytes.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import math
import os
import platform
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax import hostmem
from gem_jax import embedding as emb_lib
from gem_jax.bench import matmul_ceiling
from gem_jax.bench import timing
from gem_jax.bench import trace_summary
from gem_jax.data import device_synthetic
from gem_jax.data import pipeline
from gem_jax.train import report
from gem_jax.train import setup as setup_lib
from gem_jax.train import step as step_lib

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- configs --

def config_path(name: str) -> str:
  """'small' -> <repo>/configs/small.py; a path ending in .py is returned as is."""
  if name.endswith(".py"):
    return os.path.abspath(name)
  return os.path.join(_REPO, "configs", f"{name}.py")


def load_config(name: str, overrides: dict[str, Any] | None = None):
  """`get_config()` of configs/NAME.py with dotted overrides {'data.batch_size': 1024}."""
  path = config_path(name)
  spec = importlib.util.spec_from_file_location(f"gem_jax_bench_config_{os.path.basename(path)[:-3]}",
                                                path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  config = mod.get_config()
  config.lock()  # an override of an undeclared field (configs/base.py) is an error, as on the CLI
  config.model.overrides.unlock()  # the one open block: GEMConfig fields (checked by get_config)
  for key, value in (overrides or {}).items():
    parts = key.split(".")
    node = config
    try:
      for p in parts[:-1]:
        node = node[p]
      node[parts[-1]] = value
    except (AttributeError, KeyError):
      raise ValueError(f"config {name}: unknown field {key!r} (configs/base.py declares "
                       "every field)") from None
  config.unlock()
  return config


def fit_mesh(config, num_devices: int):
  """Uses the config's mesh if it fits `num_devices`, else (1, num_devices)."""
  try:
    from gem_jax.parallel.mesh import resolve_mesh_shape  # pylint: disable=import-outside-toplevel
    shape = resolve_mesh_shape(tuple(config.mesh), num_devices)
    if math.prod(shape) == num_devices:
      return config
  except ValueError:
    pass
  config.mesh = (1, num_devices)
  return config


# ------------------------------------------------------------------ probes --

def probe_again(peak: dict[str, Any], dtype: str) -> dict[str, Any]:
  """CPU: `peak` with the probe measured again (after the timed steps) and the higher of the
  two as the peak. Other work on the cores can only slow a probe, never speed it (one run
  read 170 GFLOP/s at start-up where the same cores gave 305-335 alone), and an under-read
  peak overstates the MFU. Accelerators: `peak` unchanged (a vendor table)."""
  if jax.devices()[0].platform != "cpu":
    return peak
  end = _cpu_probe(dtype)
  best = max(end, peak["probe_flops_start"])
  return {**peak, "peak_flops_per_device": best, "probe_flops_per_device": best,
          "probe_flops_end": end}


def gpu_matmul_probe(dtype=jnp.bfloat16, n: int = 8192, repeats: int = 10) -> float:
  """Measured FLOP/s of an (n, n) @ (n, n) product on the default device, best of `repeats`."""
  return report.matmul_probe_flops(jnp.dtype(dtype).name, n=n, repeats=repeats,
                                   devices=tuple(jax.local_devices()[:1]))


def _cpu_probe(dtype: str) -> float:
  """A fresh (uncached) CPU matmul probe over the local CPU devices, best of 20."""
  return report.matmul_probe_flops.__wrapped__(report.cpu_probe_dtype(dtype))


def peaks(dtype: str) -> dict[str, Any]:
  """The MFU peak per device (and where it comes from) plus the measured matmul probe."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    probe = _cpu_probe(dtype)
    return {"peak_flops_per_device": probe, "peak_source": "cpu matmul probe (same run)",
            "probe_flops_per_device": probe, "probe_flops_start": probe}
  table = report.peak_flops_per_device(dev, dtype)
  probe_dtype = jnp.bfloat16 if "float8" in str(dtype) else jnp.dtype(dtype)
  probe = gpu_matmul_probe(probe_dtype)
  return {"peak_flops_per_device": table or probe,
          "peak_source": "vendor table" if table else "matmul probe (device unknown)",
          "probe_flops_per_device": probe}


# ----------------------------------------------------------------- batches --

def device_batches(s: setup_lib.Setup, config, n: int) -> list[dict]:
  """`n` training batches of the config's source, on the mesh in the trainer's shardings."""
  it = s.train_src.batches(config.data.batch_size, seed=config.seed, repeat=True)
  put = setup_lib.device_putter(s.plan, s.mesh)
  return [put(host) for host in pipeline.take(it, n)]


def device_input(s: setup_lib.Setup, config, like: dict):
  """The device-side generator of `config`'s global batches, a drop-in for `like`.

  `like` is a host batch on the mesh (`device_batches`): the generator takes its
  shardings (so the compiled step accepts its batches) and must match its
  structure, shapes and dtypes (else ValueError naming the leaves).
  """
  gen = device_synthetic.device_batch_fn(
      s.spec, config.data.batch_size, jax.tree.map(lambda x: x.sharding, like), plan=s.plan,
      seed=config.seed, weights=tuple(like.get("weights", {})))
  diff = device_synthetic.differences(jax.eval_shape(gen, 0), like)
  if diff:
    raise ValueError("device input does not match the source's batches: " + "; ".join(diff))
  return gen


def memory_figures(compiled) -> dict[str, float]:
  """Bytes per device of the compiled program (XLA's memory analysis)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every backend implements it
    m = None
  if m is None:
    return {}
  m = m[0] if isinstance(m, (list, tuple)) else m
  arg, out = m.argument_size_in_bytes, m.output_size_in_bytes
  alias, temp = m.alias_size_in_bytes, m.temp_size_in_bytes
  return {"mem_argument_bytes": arg, "mem_output_bytes": out, "mem_alias_bytes": alias,
          "mem_temp_bytes": temp, "mem_peak_bytes_compiled": arg + out - alias + temp}


def device_memory_peak() -> float | None:
  stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
  return None if not stats else stats.get("peak_bytes_in_use")


# -------------------------------------------------------------- dense part --

def dense_step_fn(s: setup_lib.Setup):
  """(params, opt_state, emb, batch) -> (params, opt_state, loss): the dense half of the step.

  The same `step.dense_grads` and dense optimizer as `train_step`, on fixed
  embeddings: no lookup, no exchange, no sparse update.
  """
  cfg = s.step_cfg

  def fn(params, opt_state, model_state, emb, batch):
    dense = {k: v for k, v in batch.items() if k not in ("ids", "weights")}
    loss, g, _ = step_lib.dense_grads(params, emb, dense, model_state, cfg.graphdef, cfg.spec,
                                      cfg.grad_accum)
    updates, opt_state = cfg.tx.update(g, opt_state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, loss
  return jax.jit(fn, donate_argnums=(0, 1))


def _matmul_ceiling(s, state, batch, step_flops_per_device, peak) -> dict[str, Any]:
  """MFU ceiling of the dense part: its jaxpr's dots, each timed alone (per device).

  On a mesh the traced dots are global shapes (the ceiling of one device running the
  whole batch), so it is only defined for one device.
  """
  if s.mesh.size != 1:
    raise ValueError(f"matmul ceiling: one device only, the mesh has {s.mesh.size}")
  emb = emb_lib.lookup(s.plan, state.emb, batch["ids"], batch.get("weights"))
  jaxpr = jax.make_jaxpr(dense_step_fn(s))(state.params, state.opt_state, state.model_state,
                                           emb, batch)
  c = matmul_ceiling.ceiling(matmul_ceiling.collect_dots(jaxpr), step_flops_per_device, peak)
  top = [{"shape": t.shape.describe(), "count": t.count, "ms_total": 1e3 * t.total_s,
          "gflops_per_s": t.flops_per_s / 1e9} for t in c["timings"][:10]]
  dots = [dict(t.shape.as_dict(), count=t.count, ms=1e3 * t.seconds) for t in c["timings"]]
  return {"matmul_count": c["dot_count"], "matmul_shapes": c["dot_shapes"],
          "matmul_ms": c["dot_ms"], "matmul_flops_per_step": c["dot_flops"],
          "matmul_efficiency": c["dot_efficiency"], "dense_mfu_ceiling": c["mfu_ceiling"],
          "matmul_top": top, "matmul_dots": dots}


# --------------------------------------------------------------------- run --

INPUTS = ("host", "device")


@dataclasses.dataclass
class BenchOptions:
  steps: int = 20
  warmup: int = 3
  pool: int = 4                    # host batches cycled ('host' input)
  input: str = "host"              # host | device (see the module docstring)
  cache_dir: str | None = None     # None: a fresh temporary directory (cold = truly cold)
  warm_compile: bool = True
  dense_part: bool = True
  dump_hlo: str | None = None      # write the optimized HLO text of the step here
  matmul_ceiling: bool = False     # time the dense part's dots alone (bound on dense MFU)
  trace_dir: str | None = None     # jax.profiler trace of `trace_steps` more steps, summarised
  trace_steps: int = 3


def run_benchmark(config, opts: BenchOptions = BenchOptions(), name: str = "") -> dict[str, Any]:
  """Benchmarks `config`'s train step on the visible devices; returns one flat result dict."""
  cache = opts.cache_dir or tempfile.mkdtemp(prefix="gem_jax_bench_cache_")
  report.enable_compilation_cache(cache)
  load_before = timing.loadavg()
  peak = peaks(config.model.dtype if not config.model.fp8 else "float8")

  if opts.input not in INPUTS:
    raise ValueError(f"input {opts.input!r}: expected one of {INPUTS}")
  t_start = time.perf_counter()

  def progress(what):   # stderr, so a run cut short by a time limit shows where it was
    print(f"[bench {time.perf_counter() - t_start:7.1f}s] {what}", file=sys.stderr, flush=True)

  s = setup_lib.setup(config)
  state = setup_lib.init_state(s, config.seed)
  progress("state initialised")
  on_device = opts.input == "device"
  # device input: host batches only for the warm-up steps (the loss check's reference)
  batches = device_batches(s, config, max(1, min(opts.pool, opts.warmup)) if on_device
                           else opts.pool)
  batch_sh = jax.tree.map(lambda x: x.sharding, batches[0])
  gen = device_input(s, config, batches[0]) if on_device else None
  jitted = step_lib.jit_train_step(s.step_cfg, s.shardings, batch_sh)
  progress("input ready; compiling the step")
  compiled, cold = report.timed_compile(jitted, state, batches[0])
  progress(f"compiled (lower {cold.lower_s:.1f} s, compile {cold.compile_s:.1f} s)")
  warm = None
  if opts.warm_compile:
    jax.clear_caches()
    _, warm = report.timed_compile(
        step_lib.jit_train_step(s.step_cfg, s.shardings, batch_sh), state, batches[0])
  if opts.dump_hlo:
    os.makedirs(os.path.dirname(os.path.abspath(opts.dump_hlo)), exist_ok=True)
    with open(opts.dump_hlo, "w", encoding="utf-8") as f:
      f.write(compiled.as_text())
  gen_compile_s = None
  if gen is not None:   # after the warm compile, whose clear_caches() would drop it
    t0 = time.perf_counter()
    jax.block_until_ready(gen(2**31 - 1))    # compile + first run (a key never timed)
    gen_compile_s = time.perf_counter() - t0

  n = len(batches)
  losses = []

  def batch_at(i, key):
    """Pool batch i (host input, warm-up) or the device batch of step number `key`."""
    return batches[i % n] if gen is None or key is None else gen(key)

  def one(i, key=None):
    nonlocal state
    state, metrics = compiled(state, batch_at(i, key))
    return state, metrics

  warmup_losses = []  # steps 1..warmup from init on batches 0.. (compared across backends)
  for i in range(opts.warmup):
    out = one(i)
    warmup_losses.append(float(jax.block_until_ready(out)[1]["train_loss"]))
  losses.append(warmup_losses[0] if warmup_losses else float("nan"))
  progress(f"warm-up losses {warmup_losses}; timing {opts.steps} steps")
  w, k = opts.warmup, opts.steps   # device input keys: timed w.., pipelined w+k.., alone w+2k..
  meter = timing.CpuMeter()
  times = timing.time_steps(lambda i: one(w + i, w + i), k, jax.block_until_ready)
  contention = meter.stop()
  peak = probe_again(peak, config.model.dtype if not config.model.fp8 else "float8")
  t0 = time.perf_counter()
  for i in range(k):
    out = one(i, w + k + i)
  jax.block_until_ready(out)
  pipelined = time.perf_counter() - t0
  losses.append(float(out[1]["train_loss"]))
  input_ms = None   # the generator alone, one blocked call per key
  if gen is not None:
    input_ms = 1e3 * float(np.median(timing.time_steps(lambda i: gen(w + 2 * k + i), k,
                                                       jax.block_until_ready)))

  b = config.data.batch_size
  n_dev = s.mesh.size
  stats = timing.StepStats(tuple(times), b)
  flops = setup_lib.train_flops_per_example(config.model, s.spec, s.feature_dims)
  result: dict[str, Any] = {
      "name": name, "config": name, "framework": "gem_jax",
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
      "devices": n_dev, "mesh": list(s.mesh.devices.shape), "batch_size": b,
      "model": config.model.name, "preset": config.model.preset, "dtype": config.model.dtype,
      "fp8": bool(config.model.fp8), "warmup_steps": opts.warmup,
      "input": opts.input, "pool": n if gen is None else None,
      "input_compile_s": gen_compile_s,
      "input_ms_median": input_ms,
      **stats.as_dict(),
      "examples_per_s_pipelined": opts.steps * b / pipelined,
      "compile_cold_s": cold.lower_s + cold.compile_s, "lower_s": cold.lower_s,
      "xla_compile_cold_s": cold.compile_s,
      "compile_warm_s": None if warm is None else warm.lower_s + warm.compile_s,
      "xla_compile_warm_s": None if warm is None else warm.compile_s,
      "train_flops_per_example": flops,
      "xla_flops_per_example": setup_lib.xla_flops_per_example(compiled, b),
      **peak,
      "embedding_exchange_bytes_per_step": int(sum(s.plan.exchange_bytes().values())),
      "embedding_sharding": dict(s.plan.sharding),
      **memory_figures(compiled),
      "device_peak_bytes": device_memory_peak(),
      "loss_first": losses[0], "loss_last": losses[-1], "warmup_losses": warmup_losses,
      "loadavg_before": load_before, **contention,
      "jax": jax.__version__, "python": platform.python_version(),
  }
  eps = stats.examples_per_s
  result["tflops_per_device"] = flops * eps / n_dev / 1e12
  result["mfu"] = report.mfu(flops, eps, n_dev, peak["peak_flops_per_device"])
  if config.model.fp8 and jax.default_backend() != "cpu":  # also against the bf16 peak
    result["mfu_vs_bf16_peak"] = report.mfu(flops, eps, n_dev,
                                            report.peak_flops_per_device(None, "bfloat16"))

  if opts.trace_dir:   # after the timing, so the profiler's overhead is in no figure
    with trace_summary.capture(opts.trace_dir):
      for i in range(opts.trace_steps):
        out = one(i, w + 4 * k + i)   # keys past the dense part's
      jax.block_until_ready(out)
    ops = trace_summary.summarize(opts.trace_dir, opts.trace_steps)
    result["trace_top"] = ops[:15]
    result["trace_by_kind"] = trace_summary.by_kind(ops)
    result["trace_busy_ms_per_step"] = sum(r["ms_per_step"] for r in ops)
  if opts.dense_part:
    result.update(_dense_part(s, config, state, batch_at, opts, flops, n_dev,
                              peak["peak_flops_per_device"]))
    result["dense_share_of_step"] = result["dense_step_ms_median"] / result["step_ms_median"]
  if opts.matmul_ceiling:
    result.update(_matmul_ceiling(s, state, batches[0], flops * config.data.batch_size / n_dev,
                                  peak["peak_flops_per_device"]))
  result["peak_rss_mb"] = timing.peak_rss_mb()
  result["host_huge_pages"] = hostmem.huge_pages_requested()
  result["anon_huge_pages_mb"] = hostmem.anon_huge_pages_mb()
  return result


def _dense_part(s, config, state, batch_at, opts, flops, n_dev, peak) -> dict[str, Any]:
  """Times the dense half alone on the embeddings of the first batch (`batch_at(i, key)`:
  the run's input, the device batches under keys after the step's)."""
  first = batch_at(0, None)
  emb = emb_lib.lookup(s.plan, state.emb, first["ids"], first.get("weights"))
  emb = jax.block_until_ready(emb)
  fn = dense_step_fn(s)
  params = jax.tree.map(lambda x: x.copy(), state.params)
  opt_state = jax.tree.map(lambda x: x.copy(), state.opt_state)
  carry = [params, opt_state]
  key0 = opts.warmup + 3 * opts.steps   # past the main run's device keys

  def one(i, key):
    batch = batch_at(i, key0 + key)
    carry[0], carry[1], loss = fn(carry[0], carry[1], state.model_state, emb, batch)
    return loss

  for i in range(opts.warmup):
    jax.block_until_ready(one(i, i))
  times = timing.time_steps(lambda i: one(i, opts.warmup + i), opts.steps, jax.block_until_ready)
  st = timing.StepStats(tuple(times), config.data.batch_size)
  return {"dense_step_ms_median": 1e3 * st.median_s,
          "dense_examples_per_s": st.examples_per_s,
          "dense_mfu": report.mfu(flops, st.examples_per_s, n_dev, peak)}
