"""`make_sources(config.data)`: `data.kind` -> (train_source, eval_source).

Built-in kinds: synthetic, long_history (both generated), criteo, avazu, movielens,
alimama, adult. Each reader class has `from_config(data_cfg, split)` with split 'train'
(reads `data.train`, shuffles with `data.shuffle_buffer`) or 'eval' (reads `data.eval`,
file order); a generated kind other than synthetic draws its split's rows instead
(long_history: gem_jax/data/long_history_source.py).
Readers are imported lazily, so a run only imports what it uses. Own formats
can be added with `register(kind, factory)` where `factory(data_cfg, split)`
returns a source (see gem_jax/data/source.py).

`data.format` picks the file format of each split: 'text' (the kind's reader),
'parquet' (a dataset converted by scripts/preprocess.py, read by
gem_jax.data.parquet.ParquetSource, checked against `data.kind` and its
options), or 'auto' (default): parquet for a split whose path is a converted
dataset directory, text otherwise.
"""
from __future__ import annotations

import importlib
from typing import Callable

_BUILTIN = {
    "criteo": "gem_jax.data.criteo:CriteoSource",
    "avazu": "gem_jax.data.avazu:AvazuSource",
    "movielens": "gem_jax.data.movielens:MovieLensSource",
    "alimama": "gem_jax.data.alimama:AlimamaSource",
    "adult": "gem_jax.data.adult:AdultSource",
    "long_history": "gem_jax.data.long_history_source:LongHistorySource",  # generated
}
_CUSTOM: dict[str, Callable] = {}


def register(kind: str, factory: Callable) -> None:
  """Adds a data kind: `factory(data_cfg, split)` -> source, split in {'train','eval'}."""
  _CUSTOM[kind] = factory


def kinds() -> list[str]:
  return sorted({"synthetic", *_BUILTIN, *_CUSTOM})


def _load(path: str):
  module, name = path.split(":")
  return getattr(importlib.import_module(module), name)


FORMATS = ("auto", "text", "parquet")


def _columnar(data_cfg, split: str) -> bool:
  fmt = data_cfg.get("format", "auto")
  if fmt not in FORMATS:
    raise ValueError(f"unknown data.format {fmt!r}; known: {list(FORMATS)}")
  if fmt == "auto":
    from gem_jax.data import columnar  # pylint: disable=import-outside-toplevel
    return columnar.is_dataset(data_cfg.get(split, ""))
  return fmt == "parquet"


def make_sources(data_cfg):
  """(train_source, eval_source) for `data_cfg.kind` and `data_cfg.format`."""
  columnar = {split: _columnar(data_cfg, split) for split in ("train", "eval")}
  if any(columnar.values()):
    from gem_jax.data.parquet import ParquetSource  # pylint: disable=import-outside-toplevel
    return tuple(ParquetSource.from_config(data_cfg, split) if columnar[split]
                 else file_source(data_cfg, split) for split in ("train", "eval"))
  return _text_sources(data_cfg)


def _text_sources(data_cfg):
  if data_cfg.kind == "synthetic":
    from gem_jax.data.synthetic import SyntheticSource  # pylint: disable=import-outside-toplevel
    out = SyntheticSource.from_config(data_cfg)
    return out if isinstance(out, tuple) else (out, out)
  return file_source(data_cfg, "train"), file_source(data_cfg, "eval")


def file_source(data_cfg, split: str):
  """The `data.kind` reader of `split` ('train' | 'eval') of the raw files."""
  kind = data_cfg.kind
  if kind in _CUSTOM:
    return _CUSTOM[kind](data_cfg, split)
  if kind in _BUILTIN:
    return _load(_BUILTIN[kind]).from_config(data_cfg, split)
  if kind == "synthetic":
    raise ValueError("data.kind 'synthetic' is generated, not read from files")
  raise ValueError(f"unknown data.kind {kind!r}; known: {kinds()}")
