"""Fuzzed inputs for every reader: bad rows are counted, reported and skipped, never a wrong value.

Each case takes the head of a synthetic file (tests/data_fixtures.py), damages
some lines (truncated, garbage bytes, an extra field, a missing field, a line of
random bytes) and checks that the valid rows read from the damaged file equal,
leaf by leaf, the rows read from the same file with those lines deleted; that
the bad rows are counted and reported as `file:line: reason`; and that the 1%
limit stops the run. The exact reasons per reader are in test_data_<reader>.py.
"""
import threading

import numpy as np
import pytest
from data_fixtures import synth_data, valid_leaves as valid_rows  # noqa: F401

from gem_jax.data.adult import AdultSource
from gem_jax.data.alimama import AlimamaSource
from gem_jax.data.avazu import AvazuSource
from gem_jax.data.badrows import BadRowLimitError, NoDataError
from gem_jax.data.criteo import CriteoSource
from gem_jax.data.movielens import MovieLensSource

READERS = {   # name: (factory, synthetic file (data_fixtures), separator, header lines)
    "criteo": (CriteoSource, ("criteo", "dev"), b"\t", 0),
    "avazu": (AvazuSource, ("avazu", "train"), b",", 1),
    "adult": (AdultSource, ("adult", "train"), b",", 0),
    "alimama": (AlimamaSource, ("alimama", "train"), b",", 0),
    "movielens": (lambda p, **kw: MovieLensSource(p, split="train", split_timestamp=2 ** 40, **kw),
                  ("movielens", "ratings"), b",", 1),
}
HEADERS = {"avazu": b"id,click,hour,C1\n", "movielens": b"userId,movieId,rating,timestamp\n"}
N_ROWS = 300


def corrupt(kind, line, sep, rng):
  if kind == "truncated":
    return line[:len(line) // 2]
  if kind == "garbage":
    k = len(line) // 3
    return line[:k] + b"\xff\xfe\x80" + line[k:]
  if kind == "extra_field":
    return line + sep + b"1"
  if kind == "missing_field":
    return line.rsplit(sep, 1)[0]
  if kind == "random_bytes":
    return bytes(b for b in rng.integers(0, 256, 200, dtype=np.uint8).tobytes()
                 if b not in b"\r\n")
  raise ValueError(kind)


KINDS = ("truncated", "garbage", "extra_field", "missing_field", "random_bytes")


def no_hang(fn, seconds=60):
  """Runs fn() in a thread; fails instead of hanging."""
  out = {}

  def target():
    try:
      out["value"] = fn()
    except BaseException as e:  # noqa: BLE001
      out["error"] = e

  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(seconds)
  assert not t.is_alive(), "reader hung"
  if "error" in out:
    raise out["error"]
  return out.get("value")


@pytest.fixture(params=sorted(READERS))
def damaged(request, synth_data, tmp_path):  # noqa: F811
  """(factory, damaged path, clean path, damaged 1-based line numbers)."""
  factory, (fmt, key), sep, header = READERS[request.param]
  name = f"{fmt}_{key}"
  with open(getattr(synth_data, fmt)[key], "rb") as f:
    lines = [f.readline().rstrip(b"\r\n") for _ in range(N_ROWS + header)]
  rng = np.random.default_rng(0)
  bad_idx = sorted(rng.choice(np.arange(header + 1, len(lines)), 2 * len(KINDS), replace=False))
  damaged_lines, clean_lines = list(lines), list(lines)
  for j, i in enumerate(bad_idx):
    damaged_lines[i] = corrupt(KINDS[j % len(KINDS)], lines[i], sep, rng)
  for i in reversed(bad_idx):
    del clean_lines[i]
  bad_path, clean_path = tmp_path / f"bad_{name}", tmp_path / f"clean_{name}"
  bad_path.write_bytes(b"\n".join(damaged_lines) + b"\n")
  clean_path.write_bytes(b"\n".join(clean_lines))            # no final newline: also fine
  return factory, str(bad_path), str(clean_path), [i + 1 for i in bad_idx]


def test_bad_rows_are_skipped_not_misread(damaged, caplog):
  factory, bad, clean, bad_lines = damaged
  it = factory(bad, bad_row_limit=0.05).batches(64, repeat=False)
  got = no_hang(lambda: valid_rows(list(it)))
  want = valid_rows(list(factory(clean).batches(64, repeat=False)))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  n_rows = len(want["/label_mask"])
  assert n_rows == N_ROWS - len(bad_lines)
  st = it.state()["bad_rows"]
  assert st["bad"] == len(bad_lines) and st["rows"] == N_ROWS
  assert st["reports"][0].startswith(f"{bad}:{bad_lines[0]}: ")
  assert f"{bad}:{bad_lines[0]}: " in caplog.text


def test_default_limit_stops_the_run(damaged):
  factory, bad, _, _ = damaged
  with pytest.raises(BadRowLimitError, match=r"10 of 300 rows are bad"):
    no_hang(lambda: list(factory(bad).batches(64, repeat=False)))     # 3.3% > 1%
  src = factory(bad, bad_row_min_rows=50)
  with pytest.raises(BadRowLimitError):                               # stops early, repeat=True
    no_hang(lambda: [next(it) for it in [src.batches(64)] for _ in range(100)])


@pytest.mark.parametrize("name", sorted(READERS))
def test_missing_empty_and_header_only_files(name, tmp_path):
  factory = READERS[name][0]
  with pytest.raises(FileNotFoundError, match="nope"):
    factory(str(tmp_path / "nope.csv"))
  with pytest.raises(FileNotFoundError, match=r"\*\.tsv"):
    factory(str(tmp_path / "*.tsv"))
  (tmp_path / "empty.csv").write_bytes(b"")
  with pytest.raises(ValueError, match="empty"):
    factory(str(tmp_path / "empty.csv"))
  (tmp_path / "blank.csv").write_bytes(HEADERS.get(name, b"") + b"\n \n")
  with pytest.raises(NoDataError):
    no_hang(lambda: next(factory(str(tmp_path / "blank.csv")).batches(8, repeat=True)))


def test_truncated_gzip_is_an_error(synth_data, tmp_path):  # noqa: F811
  with open(synth_data.criteo["dev_gz"], "rb") as f:
    data = f.read()
  p = tmp_path / "cut.tsv.gz"
  p.write_bytes(data[:len(data) // 2])
  with pytest.raises(EOFError):
    no_hang(lambda: list(CriteoSource(str(p)).batches(64, repeat=False)))
