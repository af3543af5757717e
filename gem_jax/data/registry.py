"""`make_sources(config.data)`: `data.kind` -> (train_source, eval_source).

Built-in kinds: synthetic, criteo, avazu, movielens, alimama, adult. Each reader
class has `from_config(data_cfg, split)` with split 'train' (reads `data.train`,
shuffles with `data.shuffle_buffer`) or 'eval' (reads `data.eval`, file order).
Readers are imported lazily, so a run only imports what it uses. Own formats
can be added with `register(kind, factory)` where `factory(data_cfg, split)`
returns a source (see gem_jax/data/source.py).
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


def make_sources(data_cfg):
  """(train_source, eval_source) for `data_cfg.kind`."""
  kind = data_cfg.kind
  if kind == "synthetic":
    from gem_jax.data.synthetic import SyntheticSource  # pylint: disable=import-outside-toplevel
    out = SyntheticSource.from_config(data_cfg)
    return out if isinstance(out, tuple) else (out, out)
  if kind in _CUSTOM:
    factory = _CUSTOM[kind]
  elif kind in _BUILTIN:
    factory = _load(_BUILTIN[kind]).from_config
  else:
    raise ValueError(f"unknown data.kind {kind!r}; known: {kinds()}")
  return factory(data_cfg, "train"), factory(data_cfg, "eval")
