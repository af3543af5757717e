"""Latency and throughput of a loaded artifact (scripts/bench_serving.py).

  row = bench(predict, batch_size, seconds)   {'batch', 'p50_ms', 'p99_ms', 'rows_per_s', ...}

Each call is what a server pays per request: `predict(batch)` of a host (numpy) batch,
i.e. the id policy, the host-to-device copy, the exported function and the copy back.
Requests are random rows in the manifest's shapes (`random_batch`), a fresh batch for
every call drawn ahead of the timing; the first calls (compilation) are not timed.
"""
from __future__ import annotations

import time

import numpy as np


def random_batch(manifest: dict, rows: int, seed: int = 0) -> dict:
  """`rows` random rows in the shapes and id ranges the manifest lists (loader fields)."""
  rng = np.random.default_rng(seed)
  spec = manifest["spec"]
  out: dict = {"ids": {}, "seq": {}}
  if spec["n_dense"]:
    out["dense"] = rng.normal(size=(rows, spec["n_dense"])).astype(np.float32)
  for name, f in manifest["features"].items():
    t = manifest["tables"][f["table"]]
    high = 1 << 40 if t["id_policy"] == "hash" else t["rows"]
    out["ids"][name] = rng.integers(0, high, (rows, f["bag"]))
  for s in spec["sequences"]:
    L = s["max_len"]
    out["seq"][s["name"]] = {
        "len": rng.integers(0, L + 1, rows).astype(np.int32),
        "action": rng.integers(0, s["num_actions"], (rows, L)).astype(np.int32),
        "surface": rng.integers(0, s["num_surfaces"], (rows, L)).astype(np.int32),
        "dt": rng.uniform(0, 1e5, (rows, L)).astype(np.float32)}
  out["domain"] = rng.integers(0, max(spec["num_domains"], 1), rows).astype(np.int32)
  return out


def bench(predict, batch_size: int, seconds: float = 2.0, min_calls: int = 5,
          warmup: int = 2, pool: int = 4) -> dict:
  """Times `predict(batch)` for `seconds` (at least `min_calls` calls) on random batches."""
  batches = [random_batch(predict.manifest, batch_size, seed) for seed in range(pool)]
  for i in range(warmup):
    predict(batches[i % pool])
  times, t_end, i = [], time.perf_counter() + seconds, 0
  while len(times) < min_calls or time.perf_counter() < t_end:
    t0 = time.perf_counter()
    predict(batches[i % pool])
    times.append(time.perf_counter() - t0)
    i += 1
  t = np.asarray(times) * 1e3
  return {"batch": int(batch_size), "calls": len(times),
          "p50_ms": round(float(np.percentile(t, 50)), 4),
          "p99_ms": round(float(np.percentile(t, 99)), 4),
          "mean_ms": round(float(t.mean()), 4),
          "rows_per_s": round(batch_size / float(t.mean() / 1e3), 1)}


def memory(manifest: dict) -> dict:
  """{'table_bytes', 'table_dtype'} of an artifact (its stored tables)."""
  return {"table_dtype": manifest["table_dtype"],
          "table_bytes": sum(t["bytes"] for t in manifest["tables"].values())}
