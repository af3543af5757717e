"""When a run stops: train.epochs -> steps from the train rows, early stopping on the
eval log loss with the best checkpoint kept, the summary's `best` next to the last
eval, and the warning when the eval log loss is worse than the base rate's.

The runs are the logistic-regression model (`model.name='lr'`, seconds to compile)
through configs/criteo.py on the planted Criteo-format files of tests/data_fixtures.py:
an 800-row file planned for 30 passes with a constant learning rate (it overfits;
measured: eval log loss 0.579 at step 28, 0.637 at step 35, where patience 1 stops
it), 8 steps with huge learning rates (eval log loss ~2e4 against the base rate's
0.669), and one sane pass over the 3,000 rows of the two gzip 'day' files (0.549).
About 35 s on 2 cores.
"""
import gzip
import json
import logging
import math
import os

import pytest
from data_fixtures import CriteoGen, synth_data, write_lines  # noqa: F401

from gem_jax import hostmem
from gem_jax.bench import runner
from gem_jax.data import files
from gem_jax.data import registry
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import evaluate as eval_lib
from gem_jax.train import loop
from gem_jax.train import metrics as metrics_lib
from gem_jax.train import report
from gem_jax.train import setup as setup_lib
from gem_jax.train import validate

WARNING = "worse than the base rate's"


# ----------------------------------------------------------------- row counts --

def test_count_lines_plain_gzip_header_and_no_final_newline(tmp_path):
  lines = [f"{i}\tx" for i in range(1000)]
  plain = write_lines(str(tmp_path / "a.tsv"), lines)
  gz = write_lines(str(tmp_path / "a.tsv.gz"), lines, gz=True)
  no_eol = write_lines(str(tmp_path / "b.tsv"), lines, final_eol=False)
  crlf = write_lines(str(tmp_path / "c.tsv"), lines, eol=b"\r\n")
  header = write_lines(str(tmp_path / "h.csv.gz"), ["id,click"] + lines, gz=True)
  assert [files.count_lines(p) for p in (plain, gz, no_eol, crlf)] == [1000] * 4
  is_header = lambda line: line.startswith(b"id,")  # noqa: E731
  assert files.count_lines(header, is_header) == 1000
  assert files.count_lines(header) == 1001
  assert files.count_lines(plain, is_header, block=7) == 1000   # lines across blocks
  with gzip.open(gz, "rb") as f:
    assert f.read().count(b"\n") == 1000


def test_line_sources_report_their_rows(synth_data):  # noqa: F811
  c = runner.load_config("criteo")
  c.data.update(train=os.path.dirname(synth_data.criteo["dev"]) + "/day-*.gz",
                eval=synth_data.criteo["dev"])
  train, ev = registry.make_sources(c.data)
  assert len(train.paths) == 2 and train.num_rows() == 3000 and ev.num_rows() == 400
  a = runner.load_config("avazu")
  a.data.update(train=synth_data.avazu["train"], eval=synth_data.avazu["bad"].path)
  train, bad = registry.make_sources(a.data)
  assert train.num_rows() == 1200                      # the header line is not a row
  # A line count: the bad file's 10 damaged lines and its truncated last line count too.
  assert bad.num_rows() == len(synth_data.avazu["bad"].rows) + 11


def test_movielens_counts_the_examples_of_its_split(synth_data):  # noqa: F811
  c = runner.load_config("movielens")
  mf = synth_data.movielens
  c.data.update(train=mf["ratings"], eval=mf["ratings"], movies=mf["movies"])
  for src in registry.make_sources(c.data):
    n = sum(int(b["label_mask"][:, 0].sum()) for b in src.batches(64, repeat=False))
    assert src.num_rows() == n > 0


def _criteo(train, dev, **train_over):
  c = runner.load_config("criteo")
  c.data.update(train=train, eval=dev, batch_size=256)
  c.train.update(**train_over)
  return c


def _steps(c):
  validate.check_config(c, 8)
  return setup_lib.resolve_steps(c, setup_lib.sources(c)[0])


def test_epochs_resolve_steps_from_the_file_rows(synth_data, caplog):  # noqa: F811
  days = os.path.dirname(synth_data.criteo["dev"]) + "/day-*.gz"      # 2 gzip files, 3,000 rows
  dev = synth_data.criteo["dev"]
  with caplog.at_level(logging.INFO):
    assert _steps(_criteo(days, dev)) == math.ceil(3000 / 256) == 12   # the config: one pass
  assert "1 epoch of ~3,000 rows = 12 steps of 256" in caplog.text
  assert _steps(_criteo(days, dev, epochs=2.5)) == math.ceil(7500 / 256)
  assert _steps(_criteo(days, dev, epochs=0.01)) == 1
  assert _steps(_criteo(synth_data.criteo["train"], dev)) == math.ceil(1600 / 256)
  assert _steps(_criteo(days, dev, steps=5)) == 5                      # steps > 0 wins


def test_generated_rows_from_train_examples_and_a_source_that_cannot_tell():
  c = runner.load_config("tiny")
  c.train.update(steps=0, epochs=2.0)
  c.data.train_examples = 1000
  assert _steps(c) == math.ceil(2000 / c.data.batch_size)
  c.data.train_examples = None                                         # endless
  with pytest.raises(validate.ConfigError,
                     match=r"^config.train.epochs=2 needs the train rows, but .* cannot count"):
    _steps(c)


def test_best_direction_from_the_metric_name():
  assert metrics_lib.metric_mode("eval_auc") == "max"
  assert metrics_lib.metric_mode("eval_auc/click/domain_1") == "max"
  for name in ("eval_logloss", "eval_logloss/click", "eval_ne", "train_loss", "eval_loss"):
    assert metrics_lib.metric_mode(name) == "min", name
  with pytest.raises(ValueError, match="eval_calibration"):
    metrics_lib.metric_mode("eval_calibration")


# ---------------------------------------------------------------------- runs --

def _lr_run(train, dev, workdir, cache, *, lr, emb_lr, batch=64, **train_over):
  c = runner.load_config("criteo")
  c.data.update(train=train, eval=dev, batch_size=batch, eval_batch_size=256,
                vocab_size=1 << 12)
  c.model.update(name="lr", preset="tiny")
  c.embedding.lr = emb_lr
  c.optim.update(lr=lr, warmup_steps=0, decay="constant")
  c.train.update(log_every=4, compile_cache=str(cache), **train_over)
  return c, loop.train_and_evaluate(c, str(workdir))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module")
def overfit(synth_data, tmp_path_factory, cache):  # noqa: F811
  """800 rows, 30 passes planned (375 steps of 64), an eval every 7 steps, patience 1;
  checkpoints only at the end, so the best one is there because early stopping saves it."""
  tmp = tmp_path_factory.mktemp("overfit")
  train = write_lines(str(tmp / "small.tsv"), [r.line() for r in CriteoGen(0).rows(800, 11)])
  c, out = _lr_run(train, synth_data.criteo["dev"], tmp / "run", cache, lr=0.01, emb_lr=0.05,
                   epochs=30.0, eval_every=7, checkpoint_every=1000, early_stop_patience=1)
  return c, out, tmp / "run"


def test_early_stop_on_an_overfitting_run(overfit):
  _, out, _ = overfit
  best = out["best"]
  assert out["stopped_early"] is True and out["stopped_early_step"] == out["step"]
  assert out["step"] < math.ceil(30 * 800 / 64) and out["step"] % 7 == 0
  assert best["step"] == out["step"] - 7                     # patience 1: the next eval stops
  assert best["eval_logloss"] < out["eval_logloss"]           # best < last
  assert set(best) >= {"step", "eval_auc", "eval_logloss", "eval_ne", "worse_than_base_rate"}
  assert out["eval_logloss"] == out["eval_logloss/click"]     # the last eval's keys as before
  json.dumps(out)                                             # the final line


def test_train_rows_carry_host_memory(overfit):
  """Every train row logs the host's RSS and malloc figures (hostmem.host_memory_mb)."""
  _, _, workdir = overfit
  rows = [r for r in report.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if "train_loss" in r]
  assert rows and all(r["host_rss_mb"] > 50 for r in rows)
  if hostmem._libc_mallinfo2() is not None:  # glibc
    assert all(r["host_heap_used_mb"] > 10 and r["host_heap_free_mb"] >= 0 for r in rows)


def test_best_checkpoint_is_kept_and_restorable(overfit):
  c, out, workdir = overfit
  best = out["best"]
  with ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None,
                                  best_metric=c.train.best_metric) as ckpt:
    assert ckpt.best_step() == best["step"] and out["step"] in ckpt.all_steps()
  again = eval_lib.evaluate_checkpoint(c, str(workdir), step=best["step"])
  assert again["step"] == best["step"]
  assert again["eval_logloss"] == pytest.approx(best["eval_logloss"], rel=1e-5)


def test_a_run_that_stopped_early_stays_stopped(overfit):
  c, out, workdir = overfit
  again = loop.train_and_evaluate(c, str(workdir))          # resumes: nothing left to train
  assert again["step"] == out["step"] and again["stopped_early"] is True
  assert again["best"] == out["best"]
  assert again["eval_logloss"] == pytest.approx(out["eval_logloss"], rel=1e-5)


def test_base_rate_warning_on_a_bad_model(synth_data, tmp_path, cache, caplog):  # noqa: F811
  with caplog.at_level(logging.WARNING):
    _, out = _lr_run(synth_data.criteo["train"], synth_data.criteo["dev"], tmp_path / "run",
                     cache, lr=10.0, emb_lr=100.0, steps=8, eval_every=8)
  assert out["worse_than_base_rate"] is True
  assert out["eval_logloss"] > out["eval_base_rate_logloss"]
  # The base rate's log loss: H(p) of the dev rows' click rate.
  p = sum(r.label for r in synth_data.criteo["dev_rows"]) / 400
  assert out["eval_base_rate_logloss"] == pytest.approx(
      -p * math.log(p) - (1 - p) * math.log(1 - p), rel=1e-6)
  assert WARNING in caplog.text and "click" in caplog.text


def test_no_base_rate_warning_on_a_sane_pass(synth_data, tmp_path, cache, caplog):  # noqa: F811
  days = os.path.dirname(synth_data.criteo["dev"]) + "/day-*.gz"
  with caplog.at_level(logging.INFO):
    _, out = _lr_run(days, synth_data.criteo["dev"], tmp_path / "run", cache, lr=0.01,
                     emb_lr=0.1, batch=256, eval_every=4)    # the config's epochs=1
  assert out["step"] == 12 and out["stopped_early"] is False   # one pass of 3,000 rows
  assert out["worse_than_base_rate"] is False
  assert out["eval_logloss"] < out["eval_base_rate_logloss"]
  assert out["best"]["eval_logloss"] <= out["eval_logloss"]
  assert WARNING not in caplog.text
