"""MovieLens sequences: exact histories on synthetic ratings, counts on the real copy.

The synthetic files and their truth come from tests/data_fixtures.py.
"""
import bisect
import collections
import json
import math
import os

import numpy as np
import pytest
from data_fixtures import check_bad_rows, synth_data  # noqa: F401

from gem_jax.data import pipeline
from gem_jax.data.movielens import MovieLensSource, load_genres, split_timestamp_at
from gem_jax.data.spec import validate_batch

L = 8


@pytest.fixture(scope="module")
def fx(synth_data):  # noqa: F811
  return synth_data.movielens


def expected(rows, genres, names, split, which):
  """The examples of one split, in reader order: per user (file order), by (time, line)."""
  by_user = collections.defaultdict(list)
  for n, (u, m, r, t) in enumerate(rows):
    by_user[u].append((t, n, m, r))
  out = []
  for u, evs in by_user.items():
    evs.sort()
    times = [e[0] for e in evs]
    for t, _, m, r in evs:
      if (t >= split) != (which == "eval"):
        continue
      h = bisect.bisect_left(times, t)                     # events strictly before t
      hist = evs[:h][::-1][:L]
      out.append((u, m, float(r >= 4), [e[2] for e in hist], [float(t - e[0]) for e in hist],
                  [int(round(2 * e[3])) for e in hist],
                  sorted(names.index(g) for g in genres.get(m, []))))
  return out


def examples(batches):
  out = []
  for b in batches:
    h = b["seq"]["history"]
    for i in np.flatnonzero(b["label_mask"][:, 0]):
      n = h["len"][i]
      out.append((int(b["ids"]["user"][i, 0]), int(b["ids"]["item"][i, 0]), b["labels"][i, 0],
                  b["ids"]["hist_item"][i, :n].tolist(), h["dt"][i, :n].tolist(),
                  h["action"][i, :n].tolist(),
                  [g for g in b["ids"]["genre"][i].tolist() if g >= 0]))
  return out


def source(fx, split, ts, ratings="ratings", **kw):
  return MovieLensSource(fx[ratings], fx["movies"], split=split, split_timestamp=ts, max_len=L,
                         **kw)


@pytest.fixture(scope="module")
def split_ts(fx):
  return int(np.sort([r[3] for r in fx["rows"]])[int(0.7 * len(fx["rows"]))])


def test_genres_from_movies_csv(fx):
  genres, names = load_genres(fx["movies"])
  assert names == fx["genre_names"]
  assert {m: [names[g] for g in gs] for m, gs in genres.items()} == fx["movies_truth"]
  assert load_genres(fx["movies_crlf"]) == (genres, names)         # quoted titles, CRLF


@pytest.mark.parametrize("which", ["train", "eval"])
def test_examples_exact(fx, split_ts, which):
  got = examples(source(fx, which, split_ts).batches(128, repeat=False))
  want = expected(fx["rows"], fx["movies_truth"], fx["genre_names"], split_ts, which)
  assert len(got) == len(want) == sum((r[3] >= split_ts) == (which == "eval") for r in fx["rows"])
  assert got == want
  assert any(not e[6] for e in got)                       # unknown movie / no genres: empty bag
  crlf = examples(source(fx, which, split_ts, "ratings_crlf").batches(128, repeat=False))
  assert crlf == got


def test_spec_and_layout(fx, split_ts):
  src = source(fx, "train", split_ts)
  bs = list(src.batches(64, repeat=False))
  for b in bs:
    validate_batch(src.spec, b, "movielens")
  b = bs[0]
  h = b["seq"]["history"]
  assert h["len"][0] == 0 and (b["ids"]["hist_item"][0] == -1).all()   # user 1's first event
  assert ((h["action"] > 0).sum(1) == h["len"]).all() and h["action"].max() <= 10
  i = int(np.flatnonzero(h["len"] > 0)[0])
  np.testing.assert_allclose(b["dense"][i], [math.log1p(h["len"][i]) / 10,
                                             math.log1p(h["dt"][i, 0] / 3600) / 10], rtol=1e-6)
  assert max(h["len"].max() for b in bs for h in [b["seq"]["history"]]) == L


def test_auto_split_is_the_quantile_hour(fx):
  ts = np.array([r[3] for r in fx["rows"]])
  t = split_timestamp_at([fx["ratings"]], 0.8)
  assert t % 3600 == 0
  assert (ts < t).mean() >= 0.8 > (ts < t - 3600).mean()
  assert MovieLensSource(fx["ratings"], split="eval").split_timestamp == t


def test_bad_rows_exact(fx):
  bad = fx["bad"]
  src = MovieLensSource(bad.path, split="train", split_timestamp=2 ** 40, max_len=L,
                        bad_row_limit=0.1)
  it = src.batches(64, repeat=False)
  got = examples(it)
  assert [(u, m) for u, m, *_ in got] == [
      (u, m) for u, m, _, _ in sorted(bad.rows, key=lambda r: (r[0], r[3]))]
  check_bad_rows(it, bad)


def test_same_order_and_resume_mid_user(fx, split_ts):
  src = source(fx, "train", split_ts, shuffle_buffer=300)
  ref = examples(pipeline.take(src.batches(100, seed=9), 12))
  assert examples(pipeline.take(src.batches(100, seed=9), 12)) == ref
  it = src.batches(100, seed=9)
  head = examples(pipeline.take(it, 7))
  state = json.loads(json.dumps(it.state()))
  assert head + examples(pipeline.take(src.batches(100, seed=9, state=state), 5)) == ref
  plain = source(fx, "eval", split_ts)                     # no shuffle; cut inside a user
  ref = examples(pipeline.take(plain.batches(33, repeat=False), 6))
  it = plain.batches(33, repeat=False)
  head = examples(pipeline.take(it, 1))
  assert head + examples(pipeline.take(plain.batches(33, repeat=False, state=it.state()), 5)) == ref


def test_ungrouped_users_are_an_error(tmp_path):
  p = tmp_path / "ratings.csv"
  p.write_text("userId,movieId,rating,timestamp\n1,10,4.0,100\n2,11,3.0,50\n1,12,5.0,200\n")
  src = MovieLensSource(str(p), split="train", split_timestamp=10 ** 10)
  with pytest.raises(ValueError, match=r"ratings.csv:4: user 1 appears again"):
    list(src.batches(2, repeat=False))


# -- the real ml-latest-small copy: what only it can show -----------------------------------
def test_real_copy_counts_and_no_bad_rows(real_data_dir):
  ratings = os.path.join(real_data_dir, "movielens_latest_small_2016_ratings.csv")
  movies = os.path.join(real_data_dir, "movielens_latest_small_2016_movies.csv")
  genres, names = load_genres(movies)
  assert len(genres) == 9125 and len(names) == 19              # 20 genres, '(no genres...)' dropped
  n, users = 0, set()
  it = MovieLensSource(ratings, movies, split="train", split_timestamp=2 ** 40,
                       max_len=L).batches(8192, repeat=False)
  for b in it:
    m = b["label_mask"][:, 0] > 0
    n += int(m.sum())
    users.update(b["ids"]["user"][m, 0].tolist())
  assert it.state()["bad_rows"]["bad"] == 0
  assert n == 100004 and len(users) == 671
