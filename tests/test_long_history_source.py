"""data.kind 'long_history' (gem_jax/data/long_history_source.py): the batch contract,
determinism, exact resume, process sharding, the Parquet round trip (histories stored
jagged) and config errors. Small max_len: seconds in all."""
import importlib.util
import os

import ml_collections
import numpy as np
import pyarrow.parquet as pq
import pytest

from gem_jax.data import columnar, convert, registry
from gem_jax.data.columnar import DatasetError
from gem_jax.data.long_history import LongHistory
from gem_jax.data.long_history_source import (BLOCK, LongHistorySource, expected_tokens,
                                              pack_rows)
from gem_jax.data.parquet import ParquetSource
from gem_jax.data.spec import validate_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_cfg(**over):
  """configs/base.py's data block, kind long_history, small histories."""
  spec = importlib.util.spec_from_file_location("base", os.path.join(ROOT, "configs", "base.py"))
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  d = base.get_config().data
  d.update(kind="long_history", max_len=96, median=30.0, recent=8, vocab=500)
  d.update(**over)
  return d


def flat(batch):
  return columnar.flatten(batch)


def assert_same(a, b):
  fa, fb = flat(a), flat(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_spec_and_batch_contract():
  train, ev = registry.make_sources(data_cfg(train_examples=0))
  assert isinstance(train, LongHistorySource) and train.num_examples is None
  assert ev.split == "eval" and ev.num_examples == 10_000
  s = train.spec
  assert (s.n_dense, s.num_domains, s.tasks) == (1, 1, ("click",))
  assert [(f.name, f.vocab, f.bag) for f in s.sparse] == [("candidate", 500, 1),
                                                          ("history_item", 500, 1)]
  assert [(q.name, q.max_len, q.item_features) for q in s.sequences] == [
      ("history", 96, ("history_item",))]
  assert [f.name for f in s.pooled_features] == ["candidate"]
  assert train.shared_vocab == {"history_item": "candidate"}
  b = next(train.batches(80))
  validate_batch(s, b, "long_history")
  h, ids = b["seq"]["history"], b["ids"]
  n = h["len"]
  valid = np.arange(96)[None] < n[:, None]
  assert ids["history_item"].dtype == np.int64 and ids["candidate"].shape == (80, 1)
  assert n.dtype == np.int32 and h["dt"].dtype == np.float32
  assert np.all((ids["history_item"] >= 0) == valid) and ids["history_item"].max() < 500
  assert np.all(h["action"] == valid) and not h["surface"].any() and not h["dt"][~valid].any()
  assert np.all(np.diff(h["dt"], axis=1)[valid[:, 1:]] >= 0)   # older events further back
  np.testing.assert_allclose(b["dense"][:, 0], np.log1p(n) / 10, rtol=1e-6)
  assert not b["domain"].any() and np.all(b["label_mask"] == 1)
  # rows are the generator's: block 0 = LongHistory.batch(BLOCK, rng(seed, split, 0, 0))
  raw = train.raw_block(0, 0)
  np.testing.assert_array_equal(n[:BLOCK], raw["lengths"])
  np.testing.assert_array_equal(b["labels"][:BLOCK, 0], raw["label"])
  np.testing.assert_allclose(train.true_logits(b)[:BLOCK, 0], raw["logit"])
  assert n.max() <= 96 and (n > 8).mean() > 0.5


def test_deterministic_and_exact_resume():
  cfg = data_cfg()
  a = LongHistorySource.from_config(cfg, "train").batches(48, seed=3)
  b = LongHistorySource.from_config(cfg, "train").batches(48, seed=3)
  first = [next(a) for _ in range(3)]
  for x in first:
    assert_same(x, next(b))
  state = a.state()
  want = [next(a) for _ in range(2)]
  resumed = LongHistorySource.from_config(cfg, "train").batches(48, seed=3, state=state)
  for x in want:
    assert_same(x, next(resumed))
  other = [next(LongHistorySource.from_config(cfg, s).batches(48, seed=3))
           for s in ("eval",)] + [next(LongHistorySource.from_config(data_cfg(seed=1), "train")
                                       .batches(48, seed=3)),
                                  next(LongHistorySource.from_config(cfg, "train").batches(48))]
  for x in other:   # eval split, another data seed, another stream seed: other rows
    assert not np.array_equal(x["ids"]["history_item"], first[0]["ids"]["history_item"])
  with pytest.raises(ValueError, match="cannot resume"):
    LongHistorySource.from_config(cfg, "train").batches(32, seed=3, state=state)


def test_process_sharding_gives_the_global_batch():
  src = LongHistorySource.from_config(data_cfg(), "train")
  glob = src.batches(48, seed=1)
  procs = [LongHistorySource.from_config(data_cfg(), "train").batches(
      48, process_index=p, process_count=2, seed=1) for p in range(2)]
  for _ in range(4):   # 48-row batches straddle the 64-row blocks
    g = next(glob)
    parts = [flat(next(it)) for it in procs]
    for k, v in flat(g).items():
      np.testing.assert_array_equal(v, np.concatenate([p[k] for p in parts]), err_msg=k)


def test_one_pass_pads_with_label_mask_zero():
  ev = LongHistorySource.from_config(data_cfg(eval_examples=100), "eval")
  batches = list(ev.batches(64, repeat=False))
  assert len(batches) == 2
  assert batches[1]["label_mask"][:36].all() and not batches[1]["label_mask"][36:].any()


def test_oracles():
  src = LongHistorySource(LongHistory(max_len=512, median=120.0, recent=16))
  o = src.oracle_auc(6000)
  assert o["auc"] == o["auc/click"]
  assert o["auc"] > o["short_auc"] + 0.05 and o["short_auc"] > 0.55
  assert src.oracle_auc(6000) == o


def test_pack_rows_formula():
  lens = LongHistory(max_len=1024, p_empty=0.0).lengths(200_000, np.random.default_rng(0))
  assert expected_tokens(1024, 300.0, 1.0, 4) == pytest.approx(lens.mean() + 4, rel=0.03)
  assert pack_rows(8, 1024, 300.0, 1.0) == int(np.ceil(1.6 * 8 * expected_tokens(
      1024, 300.0, 1.0) / 1028))
  assert pack_rows(1, 8192, 300.0, 1.0) == 2


def _convert(tmp_path, cfg):
  out = convert.convert_config(cfg, str(tmp_path), row_group_rows=64, rows_per_file=128)
  assert out["train"]["parser"] == "generated" and out["train"]["rows"] == 200
  return out


def test_parquet_round_trip_is_the_generator_and_jagged(tmp_path):
  cfg = data_cfg(train_examples=200, eval_examples=150)
  meta = _convert(tmp_path, cfg)
  jagged = {leaf["path"] for leaf in meta["train"]["leaves"] if leaf["length"]}
  assert jagged == {"ids/history_item", "seq/history/action", "seq/history/dt",
                    "seq/history/surface"}
  run = data_cfg(train_examples=200, eval_examples=150, lanes=1,
                 train=str(tmp_path / "train"), eval=str(tmp_path / "eval"))
  pq_train, pq_eval = registry.make_sources(run)
  assert isinstance(pq_train, ParquetSource) and isinstance(pq_eval, ParquetSource)
  gen_train, gen_eval = (LongHistorySource.from_config(cfg, s) for s in ("train", "eval"))
  assert pq_train.spec == gen_train.spec and pq_train.shared_vocab == gen_train.shared_vocab
  a, b = pq_train.batches(32), gen_train.batches(32)
  for _ in range(6):   # the first pass's whole batches
    assert_same(next(a), next(b))
  got, want = list(pq_eval.batches(32, repeat=False)), list(gen_eval.batches(32, repeat=False))
  assert len(got) == len(want) == 5
  for x, y in zip(got[:4], want[:4]):
    assert_same(x, y)
  keep = slice(0, 150 - 4 * 32)   # the last batch: its padding rows differ, masked in both
  np.testing.assert_array_equal(got[4]["label_mask"], want[4]["label_mask"])
  for k, v in flat(got[4]).items():
    np.testing.assert_array_equal(v[keep], flat(want[4])[k][keep], err_msg=k)
  # the stored history columns hold the real events only: sum(len) values, not B * max_len
  for split, rows in (("train", 200), ("eval", 150)):
    files = [str(tmp_path / split / f["path"]) for f in meta[split]["files"]]
    lens = np.concatenate([pq.read_table(f, columns=["seq/history/len"])
                           .column(0).to_numpy() for f in files])
    assert len(lens) == rows and (lens == 0).any()
    for col in sorted(jagged):
      values = sum(len(pq.read_table(f, columns=[col]).column(0).combine_chunks().flatten())
                   for f in files)
      assert values == lens.sum() < rows * 96 / 2, col
      stored = 0   # Parquet's own count: one level entry per empty list besides the values
      for f in files:
        md = pq.ParquetFile(f).metadata
        i = [md.schema.column(c).path for c in range(md.num_columns)].index(
            f"{col}.list.element")
        stored += sum(md.row_group(g).column(i).num_values for g in range(md.num_row_groups))
      assert stored == lens.sum() + (lens == 0).sum(), col


def test_parquet_refuses_other_generator_options(tmp_path):
  _convert(tmp_path, data_cfg(train_examples=200, eval_examples=150))
  run = data_cfg(max_len=128, train=str(tmp_path / "train"), eval=str(tmp_path / "eval"))
  with pytest.raises(DatasetError, match=r"data.max_len=96"):
    registry.make_sources(run)


def test_preprocess_needs_train_examples(tmp_path):
  with pytest.raises(ValueError, match=r"set config.data.train_examples"):
    convert.convert_config(data_cfg(), str(tmp_path), splits=("train",))


@pytest.mark.parametrize("field,value,message", [
    ("max_len", 0, r"config.data.max_len=0 must be >= 1"),
    ("median", -3.0, r"config.data.median=-3.0 must be > 0"),
    ("sigma", -1.0, r"config.data.sigma=-1.0 must be >= 0"),
    ("vocab", 2.5, r"config.data.vocab=2.5 must be an integer"),
    ("recent", 200, r"config.data.recent=200 must be in \[0, max_len=96\]"),
    ("p_deep", 1.5, r"config.data.p_deep=1.5 must be in \[0, 1\]"),
    ("p_recent", 0.8, r"config.data.p_recent=0.8 must be in \[0, 1 - p_deep=0.35\]"),
    ("p_empty", "x", r"config.data.p_empty='x' must be a number"),
    ("mean_gap_s", 0.0, r"config.data.mean_gap_s=0.0 must be > 0"),
    ("eval_examples", -5, r"config.data.eval_examples=-5 must be an integer >= 0"),
])
def test_config_errors_name_the_field(field, value, message):
  cfg = ml_collections.ConfigDict({**data_cfg().to_dict(), field: value})  # any type
  with pytest.raises(ValueError, match=message) as e:
    registry.make_sources(cfg)
  assert "\n" not in str(e.value)
