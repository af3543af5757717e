"""Data files that change under a running reader: removed, truncated, replaced.

Each case: a reader takes a few batches (the "checkpoint" is its state), the file is
damaged, reading on raises InputFileError naming the file and what changed, and no
batch read after the damage differs from an undamaged run's; with the file put back,
a new reader resumed from the state yields exactly the undamaged run's batches.
Text files (plain and gzip, gem_jax/data/files.py) and the columnar reader
(gem_jax/data/parquet.py).
"""
import os
import re
import shutil

import numpy as np
import pytest
from data_fixtures import synth_data  # noqa: F401  pylint: disable=unused-import

from gem_jax.data import pipeline
from gem_jax.data.files import InputFileError
from gem_jax.data.parquet import ParquetSource
from test_data_pipeline import ToySource, values, write
from test_parquet import assert_same_rows, criteo_ds, rows_of  # noqa: F401

TAKEN, LIMIT = 3, 80   # batches before the fault; batches read at most after it


@pytest.fixture
def text_files(tmp_path):
  """Four files (one gzip) of 60 rows each: values 0..239."""
  return [write(tmp_path / "a.txt", range(0, 60)),
          write(tmp_path / "b.txt.gz", range(60, 120), gz=True),
          write(tmp_path / "c.txt", range(120, 180)),
          write(tmp_path / "d.txt", range(180, 240))]


def _damage(path, how, tmp_path):
  """Applies `how` to `path`; returns the regex the error must match after the path."""
  if how == "truncate":
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
    return r"changed while it was being read: size \d+ -> \d+ bytes \(truncated\)"
  if how == "delete":
    os.remove(path)
    return r"disappeared while it was being read"
  if how == "replace":   # another file moved over it (same rows, one value changed)
    new = tmp_path / "new"
    data = open(path, "rb").read()
    new.write_bytes(data[:-3] + b"99\n" if not path.endswith(".gz") else data + data)
    os.replace(new, path)
    return r"changed while it was being read: .*(size|modified)"
  if how == "rewrite":   # same size, rewritten in place: only the mtime tells
    st = os.stat(path)
    with open(path, "r+b") as f:
      f.write(f.read(1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return r"changed while it was being read: modified .* -> .*UTC"
  raise ValueError(how)


def _run_into_fault(it, n):
  """Batches of `it` until InputFileError (at most n); (batches, the error)."""
  got = []
  with pytest.raises(InputFileError) as err:
    for _ in range(n):
      got.append(next(it))
  return got, err.value


@pytest.mark.parametrize("how", ["truncate", "delete", "replace", "rewrite"])
@pytest.mark.parametrize("victim", [2, 1], ids=["plain", "gzip"])
def test_text_file_fault_is_named_and_resume_is_exact(text_files, tmp_path, how, victim):
  kw = dict(shuffle_buffer=8)      # blocks of 8 rows: the files are reopened every block
  ref = pipeline.take(ToySource(text_files, **kw).batches(4, seed=0), TAKEN + LIMIT)
  it = ToySource(text_files, **kw).batches(4, seed=0)
  assert values(pipeline.take(it, TAKEN)) == values(ref[:TAKEN])
  state = it.state()                 # what a checkpoint after step TAKEN holds
  path = text_files[victim]
  backup = open(path, "rb").read()
  pattern = _damage(path, how, tmp_path)
  got, err = _run_into_fault(it, LIMIT)
  assert re.search(re.escape(f"input file {path} ") + pattern, str(err)), str(err)
  assert "resumes from its last checkpoint" in str(err)
  assert values(got) == values(ref[TAKEN:TAKEN + len(got)])   # nothing read after it
  it.close()
  with open(path, "wb") as f:        # fixed: the file is back as it was
    f.write(backup)
  resumed = pipeline.take(ToySource(text_files, **kw).batches(4, seed=0, state=state), LIMIT)
  assert values(resumed) == values(ref[TAKEN:])


def test_text_file_fault_reaches_the_trainer_through_the_prefetcher(text_files):
  it = ToySource(text_files, shuffle_buffer=8).batches(4, seed=0)
  with pipeline.Prefetcher(it, size=2) as pf:
    next(pf)
    os.remove(text_files[3])
    with pytest.raises(InputFileError, match=re.escape(text_files[3]) + " disappeared"):
      for _ in range(LIMIT):
        next(pf)


@pytest.fixture
def dataset(tmp_path, criteo_ds):  # noqa: F811
  """A private copy of the converted synthetic Criteo train split (4 files)."""
  out = str(tmp_path / "train")
  shutil.copytree(criteo_ds, out)
  return out


@pytest.mark.parametrize("how", ["truncate", "delete", "replace"])
@pytest.mark.parametrize("workers", [0, 2])
def test_parquet_file_fault_is_named_and_resume_is_exact(dataset, tmp_path, how, workers):
  kw = dict(lanes=16, workers=workers, shuffle_buffer=0)
  ref = pipeline.take(ParquetSource(dataset, **kw).batches(64), 25)
  it = ParquetSource(dataset, **kw).batches(64)
  pipeline.take(it, TAKEN)
  state = it.state()
  files = sorted(f for f in os.listdir(dataset) if f.endswith(".parquet"))
  path = os.path.join(dataset, files[-1])
  backup = tmp_path / "backup"
  shutil.copy2(path, backup)
  if how == "replace":               # another file of the dataset moved over it
    shutil.copy(os.path.join(dataset, files[0]), tmp_path / "other")
    os.replace(tmp_path / "other", path)
    pattern = r"changed while it was being read: .*modified"
  else:
    pattern = _damage(path, how, tmp_path)
  got, err = _run_into_fault(it, 25)
  assert re.search(re.escape(f"input file {path} ") + pattern, str(err)), str(err)
  assert_same_rows(rows_of(got), rows_of(ref[TAKEN:TAKEN + len(got)])) if got else None
  it.close()
  shutil.copy2(backup, path)         # fixed
  resumed = pipeline.take(ParquetSource(dataset, **kw).batches(64, state=state), 25 - TAKEN)
  assert_same_rows(rows_of(resumed), rows_of(ref[TAKEN:]))
  assert np.array_equal(resumed[-1]["labels"], ref[-1]["labels"])


# ------------------------------------------------------- through the trainer --

@pytest.mark.slow  # three trainer runs (DLRM tiny on Criteo-format files): minutes on 2 cores
def test_trainer_stops_naming_the_file_and_resumes_exactly(tmp_path, synth_data,  # noqa: F811
                                                          monkeypatch):
  """Both train files truncated after the checkpoint at step 4: the run stops with
  InputFileError naming one; with the files restored, the restart resumes from its last
  checkpoint and its losses equal an uninterrupted run's bit for bit."""
  from gem_jax.bench.runner import load_config  # pylint: disable=import-outside-toplevel
  from gem_jax.train import checkpoint, loop, report  # pylint: disable=import-outside-toplevel
  data = tmp_path / "data"
  data.mkdir()
  days = []
  for f in synth_data.criteo["days"]:           # 2 gzip files of 1500 rows
    shutil.copy2(f, data)
    days.append(str(data / os.path.basename(f)))
  config = load_config("criteo", {
      "data.train": ",".join(days), "data.eval": synth_data.criteo["dev"],
      "data.shuffle_buffer": 256, "model.name": "dlrm", "model.preset": "tiny",
      "train.steps": 16, "train.eval_every": 16, "train.log_every": 1,
      "train.checkpoint_every": 4, "optim.warmup_steps": 0,
      "train.compile_cache": str(tmp_path / "cache"), "train.early_stop_patience": 0})

  def losses(workdir):
    rows = [r for r in report.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if "train_loss" in r]
    return {r["step"]: r["train_loss"] for r in rows}   # the last value of each step

  loop.train_and_evaluate(config, str(tmp_path / "ref"))
  ref = losses(tmp_path / "ref")
  assert sorted(ref) == list(range(1, 17))

  backups = {p: open(p, "rb").read() for p in days}
  orig = checkpoint.CheckpointManager.save

  def save(self, step, *a, **kw):
    out = orig(self, step, *a, **kw)
    if step == 4:
      for p, b in backups.items():
        with open(p, "r+b") as f:
          f.truncate(len(b) // 2)
    return out

  monkeypatch.setattr(checkpoint.CheckpointManager, "save", save)
  run = str(tmp_path / "run")
  names = "|".join(re.escape(p) for p in days)
  with pytest.raises(InputFileError, match=f"input file ({names}) changed .*truncated"):
    loop.train_and_evaluate(config, run)
  monkeypatch.setattr(checkpoint.CheckpointManager, "save", orig)
  for p, b in backups.items():
    with open(p, "wb") as f:
      f.write(b)
  out = loop.train_and_evaluate(config, run)
  assert out["step"] == 16
  assert losses(run) == ref
  steps = [r["step"] for r in report.read_jsonl(os.path.join(run, "metrics.jsonl"))
           if "train_loss" in r]
  assert steps.count(1) == steps.count(4) == 1 and steps.count(16) == 1   # resumed, not rerun
