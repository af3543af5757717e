"""Serving: a checkpoint as a self-contained artifact, and the small loader that scores with it.

  export.py    restored model -> artifact (jax.export scoring function, tables, manifest)
  quantize.py  table storage formats: fp32, bf16, int8 row-wise (and their errors)
  loader.py    `load(path)` -> `predict(batch) -> probs`: needs jax and numpy only
  bench.py     latency and rows/s of an artifact (scripts/bench_serving.py)

See docs/serving.md.
"""
from gem_jax.serving.loader import FORMAT_VERSION, Predictor, load, read_manifest

__all__ = ["load", "Predictor", "read_manifest", "FORMAT_VERSION"]
