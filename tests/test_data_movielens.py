"""MovieLens sequences on the shared ratings: counts, no look-ahead, genres, split, resume."""
import bisect
import collections
import csv
import json
import os

import numpy as np
import pytest

from gem_jax.data import pipeline
from gem_jax.data.movielens import MovieLensSource, split_timestamp_at
from gem_jax.data.spec import validate_batch

L = 20


@pytest.fixture(scope="module")
def files(real_data_dir):
  return (os.path.join(real_data_dir, "movielens_latest_small_2016_ratings.csv"),
          os.path.join(real_data_dir, "movielens_latest_small_2016_movies.csv"))


@pytest.fixture(scope="module")
def truth(files):
  """Per (user, item): rating, time, and the user's earlier events, from the csv module."""
  with open(files[0], newline="") as f:
    rows = [(int(u), int(m), float(r), int(t)) for u, m, r, t in list(csv.reader(f))[1:]]
  by_user = collections.defaultdict(list)
  for n, (u, m, r, t) in enumerate(rows):
    by_user[u].append((t, n, m, r))
  ts = np.array([r[3] for r in rows])
  split = int(np.sort(ts)[int(0.75 * len(ts))])     # an arbitrary split inside the data
  events = {}
  for u, evs in by_user.items():
    evs.sort()                                        # by (time, line)
    times = [e[0] for e in evs]
    for t, n, m, r in evs:
      h = bisect.bisect_left(times, t)                # events strictly before t
      events[(u, m)] = (r, t, [e[2] for e in evs[:h][::-1][:L]], h)
  with open(files[1], newline="") as f:
    genres = {int(r[0]): r[2].split("|") for r in list(csv.reader(f))[1:]}
  return rows, split, events, genres


def source(files, split, ts, **kw):
  return MovieLensSource(files[0], files[1], split=split, split_timestamp=ts, max_len=L, **kw)


def examples(batches):
  """(user, item, label, hist list, dt list, genre list) of valid rows."""
  out = []
  for b in batches:
    h = b["seq"]["history"]
    for i in np.flatnonzero(b["label_mask"][:, 0]):
      n = h["len"][i]
      out.append((int(b["ids"]["user"][i, 0]), int(b["ids"]["item"][i, 0]),
                  b["labels"][i, 0], b["ids"]["hist_item"][i, :n].tolist(),
                  h["dt"][i, :n].tolist(), b["ids"]["genre"][i].tolist()))
  return out


@pytest.fixture(scope="module")
def passes(files, truth):
  split = truth[1]
  return {s: examples(source(files, s, split).batches(4096, repeat=False))
          for s in ("train", "eval")}


def test_counts_and_split(passes, truth):
  rows, split = truth[0], truth[1]
  assert len(passes["train"]) == sum(r[3] < split for r in rows)
  assert len(passes["eval"]) == sum(r[3] >= split for r in rows)
  assert len(passes["train"]) + len(passes["eval"]) == len(rows) == 100004
  for s, cond in (("train", lambda t: t < split), ("eval", lambda t: t >= split)):
    assert sum(e[2] for e in passes[s]) == sum(r[2] >= 4 and cond(r[3]) for r in rows)


def test_histories_only_see_the_past(passes, truth):
  events, genres = truth[2], truth[3]
  names = sorted({g for gs in genres.values() for g in gs} - {"(no genres listed)"})
  for s in ("train", "eval"):
    for u, m, label, hist, dt, gids in passes[s][::37]:
      r, t, want_hist, n_before = events[(u, m)]
      assert label == float(r >= 4)
      assert hist == want_hist and len(hist) == min(L, n_before)
      assert all(d > 0 for d in dt)                       # strictly earlier events only
      assert dt == sorted(dt)                             # most recent first
      assert [names[g] for g in gids if g >= 0] == [
          g for g in genres[m] if g != "(no genres listed)"][:10]


def test_spec_and_layout(files, truth):
  src = source(files, "train", truth[1])
  b = next(src.batches(64))
  validate_batch(src.spec, b, "movielens")
  h = b["seq"]["history"]
  assert h["len"][0] == 0 and (b["ids"]["hist_item"][0] == -1).all()   # user's first event
  assert ((h["action"] > 0).sum(1) == h["len"]).all()
  assert h["action"].max() <= 10


def test_auto_split_is_the_quantile_hour(files, truth):
  ts = np.array([r[3] for r in truth[0]])
  t = split_timestamp_at([files[0]], 0.8)
  assert t % 3600 == 0
  assert (ts < t).mean() >= 0.8 > (ts < t - 3600).mean()


def test_same_order_and_resume_mid_user(files, truth):
  src = source(files, "train", truth[1], shuffle_buffer=3000)
  ref = examples(pipeline.take(src.batches(500, seed=9), 12))
  assert examples(pipeline.take(src.batches(500, seed=9), 12)) == ref
  it = src.batches(500, seed=9)
  head = examples(pipeline.take(it, 7))
  tail = examples(pipeline.take(src.batches(500, seed=9, state=json.loads(json.dumps(it.state()))), 5))
  assert head + tail == ref
  plain = source(files, "eval", truth[1])                  # no shuffle; cut inside a user
  ref = examples(pipeline.take(plain.batches(333, repeat=False), 6))
  it = plain.batches(333, repeat=False)
  head = examples(pipeline.take(it, 1))
  assert it.state()["shuffle"]["pos"]["k"] == 0 and it.state()["shuffle"]["taken"] == 333
  assert head + examples(pipeline.take(plain.batches(333, repeat=False, state=it.state()), 5)) == ref


def test_ungrouped_users_are_an_error(tmp_path):
  p = tmp_path / "ratings.csv"
  p.write_text("userId,movieId,rating,timestamp\n1,10,4.0,100\n2,11,3.0,50\n1,12,5.0,200\n")
  src = MovieLensSource(str(p), split="train", split_timestamp=10 ** 10)
  with pytest.raises(ValueError, match=r"ratings.csv:4: user 1 appears again"):
    list(src.batches(2, repeat=False))
