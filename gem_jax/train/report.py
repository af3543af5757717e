"""Run reporting: metric files, progress, throughput/MFU, compile cache and time, profiling.

- `MetricWriter`: one JSON line per `write(step, metrics)` in WORKDIR/metrics.jsonl
  and TensorBoard scalars in WORKDIR/tb (tensorboardX); process 0 only.
- `Progress`: a tqdm bar with ETA on a terminal, plain lines otherwise (stderr).
- `peak_flops_per_device`: dense peak of a device from a table of vendor numbers
  (GPU/TPU), or measured by `matmul_probe_flops` on CPU; `mfu` and `throughput`.
- `enable_compilation_cache`: JAX's persistent compilation cache (on by default),
  `timed_compile`: lowering and compile time of a jitted function, apart from
  step time.
- `Profiler`: a `jax.profiler` trace of chosen steps written into the workdir
  (TensorBoard/XProf and Perfetto); `step_annotation` names each step so the
  same run also reads under Nsight Systems.
- `IdCollisions`: per table, the share of distinct raw ids of the trained batches
  that the id policy merged onto a row shared with another id.
"""
from __future__ import annotations

import collections
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------- metric files --


def _scalar(v: Any) -> float | int | str | None:
  """A JSON-friendly scalar: ints stay ints, numeric arrays of size 1 become floats."""
  if isinstance(v, (bool, str)) or v is None:
    return v
  if isinstance(v, (int, np.integer)):
    return int(v)
  try:
    return float(np.asarray(jax.device_get(v)).reshape(()))
  except (TypeError, ValueError):
    return str(v)


class MetricWriter:
  """Appends `{"step": s, **metrics}` lines to WORKDIR/metrics.jsonl and TensorBoard scalars.

  Only process 0 writes (`enabled=None` decides by `jax.process_index()`).
  Values may be Python/NumPy/JAX scalars; strings go to the JSONL only.
  Non-finite floats are written as NaN/Infinity (Python's json reads them back).
  """

  def __init__(self, workdir: str, *, enabled: bool | None = None,
               tensorboard: bool = True, filename: str = "metrics.jsonl"):
    self.enabled = jax.process_index() == 0 if enabled is None else bool(enabled)
    self.path = os.path.join(workdir, filename)
    self._file = None
    self._tb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._tb = SummaryWriter(logdir=os.path.join(workdir, "tb"), flush_secs=10)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": int(step)}
    row.update({k: _scalar(v) for k, v in metrics.items()})
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, int(step))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def read_jsonl(path: str) -> list[dict]:
  """The rows of a metrics.jsonl file (a truncated last line, e.g. after a crash, is skipped)."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          continue
  return rows


# -------------------------------------------------------------------- progress --


def _hms(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  s = int(round(seconds))
  return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


PROGRESS_KEYS = ("train_loss", "eval_auc", "examples_per_s", "mfu")


class Progress:
  """Progress of `total` steps with ETA: tqdm on a TTY, plain lines otherwise.

  Args:
    total: last step.
    initial: the step the run starts (or resumes) from.
    keys: metrics shown (those present in each `update`).
    stream: where to write (default stderr, so stdout stays machine-readable).
    tty: force the bar on/off (default: `stream.isatty()`).
    enabled: default process 0 only.
  """

  def __init__(self, total: int, initial: int = 0, *,
               keys: Sequence[str] = PROGRESS_KEYS,
               stream=None, tty: bool | None = None, enabled: bool | None = None):
    self.total, self.initial, self.keys = int(total), int(initial), tuple(keys)
    self.stream = sys.stderr if stream is None else stream
    self.enabled = jax.process_index() == 0 if enabled is None else bool(enabled)
    self.tty = (hasattr(self.stream, "isatty") and self.stream.isatty()) if tty is None else tty
    self._t0 = time.perf_counter()
    self._bar = None
    self._shown: dict[str, float] = {}
    if self.enabled and self.tty:
      from tqdm import tqdm  # pylint: disable=import-outside-toplevel
      self._bar = tqdm(total=self.total, initial=self.initial, file=self.stream,
                       dynamic_ncols=True, unit="step")

  def eta_s(self, step: int) -> float:
    """Seconds left at the mean rate of the steps done by this process."""
    done = step - self.initial
    if done <= 0:
      return float("nan")
    return (time.perf_counter() - self._t0) / done * max(self.total - step, 0)

  def format(self, step: int, metrics: Mapping[str, Any]) -> str:
    """The plain-text line for `step`, e.g. 'step 10/100 (10%) train_loss=0.51 ... ETA 0:01:30'."""
    shown = " ".join(f"{k}={_fmt(metrics[k])}" for k in self.keys if k in metrics)
    pct = 100.0 * step / max(self.total, 1)
    elapsed = time.perf_counter() - self._t0
    return (f"step {step}/{self.total} ({pct:.0f}%) {shown} | "
            f"elapsed {_hms(elapsed)} ETA {_hms(self.eta_s(step))}").replace("  ", " ")

  def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
    if not self.enabled:
      return
    metrics = {k: _scalar(v) for k, v in (metrics or {}).items() if k in self.keys}
    self._shown.update(metrics)
    if self._bar is not None:
      self._bar.set_postfix({k: _fmt(v) for k, v in self._shown.items()}, refresh=False)
      self._bar.update(step - self._bar.n)
    else:
      print(self.format(step, self._shown), file=self.stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def _fmt(v: Any) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


# ------------------------------------------------------------- peaks and MFU --

# Dense (no sparsity) bf16 tensor peaks per device in TFLOP/s, from vendor data
# sheets. Matched against `device.device_kind` in order (first hit wins).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("gb200", 2500.0),
    ("b200", 2250.0),
    ("b100", 1750.0),
    ("h100 pcie", 756.0),
    ("h100", 989.0),     # SXM
    ("h200", 989.0),
    ("h800", 989.0),
    ("h20", 148.0),
    ("gh200", 989.0),
    ("a100", 312.0),
    ("a800", 312.0),
    ("l40s", 362.0),
    ("l4", 121.0),
    ("a10g", 70.0),
    ("v100", 125.0),     # fp16 tensor cores (no bf16)
    ("tpu v6 lite", 918.0), ("tpu v6e", 918.0),
    ("tpu v5 lite", 197.0), ("tpu v5e", 197.0),
    ("tpu v5p", 459.0), ("tpu v5", 459.0),
    ("tpu v4", 275.0),
    ("tpu v3", 123.0),
)

# Peak relative to bf16 by compute dtype on GPUs: fp8 doubles it, fp32 matmuls
# run as TF32 (half). TPUs compute fp32 matmuls in bf16 passes: the bf16 peak.
_GPU_DTYPE_FACTOR = {"bfloat16": 1.0, "float16": 1.0, "float32": 0.5, "float8": 2.0}


def _dtype_name(dtype: Any) -> str:
  name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
  return "float8" if name.startswith("float8") else name


def cpu_probe_dtype(dtype: Any) -> str:
  """The dtype whose CPU matmul probe is the peak for `dtype`: bf16/fp16 their own, every
  other (fp32, fp8, which CPU emulates) fp32."""
  name = _dtype_name(dtype)
  return name if name in ("bfloat16", "float16") else "float32"


def peak_flops_per_device(device: Any = None, dtype: Any = "bfloat16") -> float | None:
  """Peak FLOP/s of one device for dense matmuls in `dtype`.

  GPUs/TPUs: from `PEAK_BF16_TFLOPS` (scaled for fp8/fp32 on GPUs); None when
  the device is unknown. CPU: measured once per process by
  `matmul_probe_flops(dtype)` over all CPU devices (cached; fp32 for dtypes
  other than bf16/fp16).
  """
  device = jax.devices()[0] if device is None else device
  name = _dtype_name(dtype)
  if device.platform == "cpu":
    return matmul_probe_flops(cpu_probe_dtype(dtype))
  kind = device.device_kind.lower()
  for key, tflops in PEAK_BF16_TFLOPS:
    if key in kind:
      factor = _GPU_DTYPE_FACTOR.get(name, 1.0) if device.platform == "gpu" else 1.0
      return tflops * 1e12 * factor
  return None


@functools.lru_cache(maxsize=None)
def matmul_probe_flops(dtype: str = "float32", n: int = 1024, repeats: int = 20,
                       devices=None) -> float:
  """Measured matmul FLOP/s per device, all `devices` busy at once.

  Runs one (n, n) @ (n, n) product on every device concurrently (a batched
  matmul sharded over the devices), so that simulated devices sharing the
  same cores each get their fair share: per-device peak = 2 n^3 D / t / D,
  best of `repeats` timed runs after a warm-up (20: a best of 5 once read 170 GFLOP/s
  where the same cores give 300-335, and an under-read peak overstates the MFU). Default devices: the local
  CPU devices (the MFU denominator on CPU); GPUs: e.g. one device, n = 8192, bf16.
  Cached per arguments, so `devices` must be a tuple.
  """
  devices = list(devices) if devices is not None else jax.local_devices(backend="cpu")
  d = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("d",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  dt = jnp.dtype(dtype)
  a = jax.device_put(jnp.ones((d, n, n), dt), sh)
  b = jax.device_put(jnp.ones((d, n, n), dt) * 0.5, sh)
  # fp32 accumulation, as every gem_jax matmul (bf16 x bf16 -> bf16 would be upcast
  # to an fp32 matmul by XLA:CPU and measure the fp32 peak instead)
  f = jax.jit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y, preferred_element_type=jnp.float32),
              out_shardings=sh)
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2.0 * n ** 3 / best


def mfu(flops_per_example: float, examples_per_s: float, n_devices: int,
        peak_flops: float | None) -> float:
  """Model FLOPs utilisation = flops_per_example * examples_per_s / (n_devices * peak)."""
  if not peak_flops or not flops_per_example:
    return float("nan")
  return flops_per_example * examples_per_s / (n_devices * peak_flops)


def throughput(examples: int, seconds: float, steps: int, flops_per_example: float | None,
               n_devices: int, peak_flops: float | None) -> dict[str, float]:
  """Throughput metrics of `steps` steps that processed `examples` in `seconds`.

  Returns examples_per_s, examples_per_s_per_device, step_time_s,
  tflops_per_device (analytic FLOPs / time) and mfu.
  """
  eps = examples / seconds if seconds > 0 else float("nan")
  fpe = flops_per_example or float("nan")
  return {
      "examples_per_s": eps,
      "examples_per_s_per_device": eps / n_devices,
      "step_time_s": seconds / max(steps, 1),
      "tflops_per_device": fpe * eps / n_devices / 1e12,
      "mfu": mfu(flops_per_example or 0.0, eps, n_devices, peak_flops),
  }


class IdCollisions:
  """Id-policy collisions of the batches trained since the last `metrics()` call.

  `add({table: (ids, rows)})` per prepared batch (the prefetch thread, from
  `embedding.table_collisions`: distinct raw ids, distinct rows they land on),
  `consume()` once per trained batch (in order: the prefetcher runs ahead), then
  `metrics()`: id_merged/<table> = 1 - sum rows / sum ids over those batches, and
  id_merged over all tables pooled. Counts are per batch (per process's slice).
  """

  def __init__(self):
    self._pending = collections.deque()   # thread-safe append / popleft
    self._sum: dict[str, list[int]] = {}

  def add(self, counts: Mapping[str, tuple[int, int]]) -> None:
    self._pending.append(dict(counts))

  def consume(self) -> None:
    if not self._pending:
      return
    for t, (ids, rows) in self._pending.popleft().items():
      acc = self._sum.setdefault(t, [0, 0])
      acc[0] += ids
      acc[1] += rows

  def metrics(self) -> dict[str, float]:
    out = {f"id_merged/{t}": 1.0 - r / i for t, (i, r) in self._sum.items() if i}
    ids, rows = sum(v[0] for v in self._sum.values()), sum(v[1] for v in self._sum.values())
    if ids:
      out["id_merged"] = 1.0 - rows / ids
    self._sum = {}
    return out


def quiet_library_logs() -> None:
  """Drops Orbax's per-save INFO lines from the absl log (warnings still show)."""
  import logging as pylogging  # pylint: disable=import-outside-toplevel
  from absl import logging  # pylint: disable=import-outside-toplevel

  class _Filter(pylogging.Filter):
    def filter(self, record):
      return record.levelno >= pylogging.WARNING or "orbax" not in record.pathname
  logging.get_absl_handler().addFilter(_Filter())


# ----------------------------------------------------------- compilation time --

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "gem_jax", "xla")


def enable_compilation_cache(cache_dir: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache; returns its directory (None if off).

  `cache_dir`: None or '' -> $GEM_JAX_COMPILE_CACHE or ~/.cache/gem_jax/xla;
  'off' -> disabled. Every compiled program is cached (no minimum compile time
  or size), so a second start of the same run skips XLA compilation. Call
  before the first compilation of the process.
  """
  if cache_dir is None or cache_dir == "":
    cache_dir = os.environ.get("GEM_JAX_COMPILE_CACHE", DEFAULT_CACHE_DIR)
  if str(cache_dir).lower() in ("off", "none", "false", "0"):
    return None
  cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return cache_dir


class CompileTiming(NamedTuple):
  lower_s: float
  compile_s: float


def timed_compile(jitted: Callable, *args, **kwargs) -> tuple[Any, CompileTiming]:
  """`jitted.lower(*args, **kwargs).compile()` and the seconds spent in each phase.

  With the persistent cache on, a second start's `compile_s` is the cache load
  time (typically a small fraction of the first).
  """
  t0 = time.perf_counter()
  lowered = jitted.lower(*args, **kwargs)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return compiled, CompileTiming(lower_s=t1 - t0, compile_s=t2 - t1)


# -------------------------------------------------------------------- profiler --


def step_annotation(step: int, name: str = "train"):
  """Context manager naming one step in profiles (XProf/Perfetto and NVTX under Nsight)."""
  return jax.profiler.StepTraceAnnotation(name, step_num=int(step))


def parse_steps(spec: Any) -> tuple[int, int] | None:
  """Profile range [start, stop) from '', None, 'A,B', 'A:B', 'A' (one step) or (A, B)."""
  if spec is None or spec == "" or spec == () or spec == []:
    return None
  if isinstance(spec, str):
    parts = [p for p in spec.replace(":", ",").split(",") if p.strip()]
    spec = [int(p) for p in parts]
  elif isinstance(spec, (int, np.integer)):
    spec = [int(spec)]
  spec = [int(s) for s in spec]
  if len(spec) == 1:
    spec = [spec[0], spec[0] + 1]
  if len(spec) != 2 or not 0 <= spec[0] < spec[1]:
    raise ValueError(f"profile steps must be 'START,STOP' with 0 <= START < STOP, got {spec}")
  return spec[0], spec[1]


class Profiler:
  """Captures a `jax.profiler` trace of steps [start, stop) into WORKDIR/plugins/profile.

  Call `maybe_start(step)` before running step `step` and `maybe_stop(step)`
  after it with the number of steps completed (and optionally arrays to wait
  for, so the trace holds the whole device work). View with
  `tensorboard --logdir WORKDIR` (Profile tab) or load the `*.trace.json.gz`
  in https://ui.perfetto.dev. Disabled when `steps` is empty.
  """

  def __init__(self, workdir: str, steps: Any, *, enabled: bool | None = None):
    self.range = parse_steps(steps)
    self.workdir = workdir
    self.enabled = (jax.process_index() == 0 if enabled is None else enabled) and self.range
    self.active = False
    self.done = False

  def starts_at(self, step: int) -> bool:
    """Whether `maybe_start(step)` will start the trace."""
    return bool(self.enabled and not self.active and not self.done
                and self.range[0] <= step < self.range[1])

  def maybe_start(self, step: int) -> bool:
    """Starts tracing when `step` is in range (once); returns whether it started now."""
    if not self.starts_at(step):
      return False
    os.makedirs(self.workdir, exist_ok=True)
    jax.profiler.start_trace(self.workdir, create_perfetto_trace=True)
    self.active = True
    return True

  def maybe_stop(self, steps_done: int, *block_on: Any) -> bool:
    """Stops tracing once `steps_done >= stop`; returns whether it stopped now."""
    if not self.active or steps_done < self.range[1]:
      return False
    if block_on:
      jax.block_until_ready(block_on)
    jax.profiler.stop_trace()
    self.active, self.done = False, True
    return True

  def close(self) -> None:
    """Stops a trace still running (e.g. the run ended inside the range)."""
    if self.active:
      jax.profiler.stop_trace()
      self.active, self.done = False, True
