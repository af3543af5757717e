"""Timestamped event logs -> user sequences (MovieLens ratings.csv format).

Input: `ratings.csv` rows `userId,movieId,rating,timestamp` (header line
`userId,...` skipped), gzip or plain, one or many files read in the given order;
optionally `movies.csv` (`movieId,title,genres`, genres `|`-separated).

**Ordering assumption (checked):** each user's rows are contiguous (the file is
grouped by user, as MovieLens ships it: sorted by userId, then movieId). Rows
within a user may be in any order; the reader holds one user's rows at a time
(at most `max_user_events`), sorts them by (timestamp, line) and emits one
example per event. A user id that reappears after another user raises
ValueError naming the line; a user with more than `max_user_events` rows raises
too. Memory: one user's events plus the genre table of movies.csv (a small side
table, loaded whole) plus the set of finished user ids.

Each example is one rating event e of user u at time t:
* label `like` = rating >= like_threshold (4.0);
* ids: `user`, `item` (movieId), `genre` (multi-hot bag of the item's genres,
  ids in sorted genre-name order; '(no genres listed)' and unknown movies give
  an empty bag);
* sequence stream `history`: u's events with timestamp strictly before t (so
  an example never sees itself, a later event or one of the same second), most
  recent first, at most `max_len`: item ids in `hist_item`, action =
  round(2 * rating) (1..10, 0 = padding), surface 0, dt = t - t_event seconds;
* dense: [log1p(history length) / 10, log1p(hours since the previous event) / 10];
* single domain.
Time-based split: examples with t < split_timestamp are 'train', the others
'eval' (histories of eval examples include train-period events). With
`split_timestamp=None` it is the first hour boundary with at least
`split_quantile` of the valid events before it (one extra streaming pass).

Records are `(path, line, example | BadRow)`; the stream position is the line
position of the current user's first row plus the records already taken from
that user, so resuming re-reads one user.
Bad rows: wrong field count, non-integer ids/timestamps, a rating that is not a
number in [0, 10].
"""
from __future__ import annotations

import collections
import csv
import io
import math
from typing import Sequence

import numpy as np

from gem_jax.data import text
from gem_jax.data.badrows import BadRow
from gem_jax.data.files import LineStream, expand_paths, open_binary
from gem_jax.data.source import StreamingSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec

NUM_ACTIONS = 11
NO_GENRE = "(no genres listed)"


def movielens_spec(max_len: int, n_genres: int, max_genres: int,
                   vocab_size: int = 1 << 20) -> DataSpec:
  sparse = (SparseFeatureSpec("user", vocab_size), SparseFeatureSpec("item", vocab_size),
            SparseFeatureSpec("genre", max(n_genres, 1), bag=max_genres),
            SparseFeatureSpec("hist_item", vocab_size))
  stream = SequenceStreamSpec("history", max_len, ("hist_item",), num_actions=NUM_ACTIONS,
                              num_surfaces=1)
  return DataSpec(n_dense=2, sparse=sparse, sequences=(stream,), tasks=("like",))


def load_genres(path: str) -> tuple[dict[int, list[int]], list[str]]:
  """movieId -> genre ids, and the sorted genre names (ids index into them)."""
  with open_binary(path) as f:
    rows = list(csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline="")))
  if not rows or rows[0][:1] != ["movieId"]:
    raise ValueError(f"{path}: expected a movies.csv header 'movieId,title,genres'")
  raw = {}
  for n, r in enumerate(rows[1:], start=2):
    if len(r) != 3:
      raise ValueError(f"{path}:{n}: expected 3 fields, got {len(r)}")
    raw[int(r[0])] = [g for g in r[2].split("|") if g and g != NO_GENRE]
  names = sorted({g for gs in raw.values() for g in gs})
  index = {g: i for i, g in enumerate(names)}
  return {m: [index[g] for g in gs] for m, gs in raw.items()}, names


def parse_rating(line: bytes):
  """-> (user, item, rating, timestamp)."""
  f = text.split_fields(line, b",", 4)
  user, item = text.parse_int(f[0], "userId"), text.parse_int(f[1], "movieId")
  rating = text.parse_float(f[2], "rating")
  if not 0.0 <= rating <= 10.0:
    raise BadRow(f"rating: {rating} not in [0, 10]")
  return user, item, rating, text.parse_int(f[3], "timestamp")


def _is_header(line: bytes) -> bool:
  return line.startswith(b"userId")


def split_timestamp_at(paths: Sequence[str], quantile: float) -> int:
  """First hour boundary T with >= `quantile` of the parseable events before it."""
  hours = collections.Counter()
  for _, _, line in LineStream(paths, _is_header):
    try:
      hours[parse_rating(line)[3] // 3600] += 1
    except BadRow:
      continue
  total, seen = sum(hours.values()), 0
  if not total:
    raise ValueError(f"{paths}: no readable ratings")
  for h in sorted(hours):
    seen += hours[h]
    if seen >= quantile * total:
      return (h + 1) * 3600
  raise AssertionError("unreachable")


class UserEventStream:
  """Records of one split, one user at a time (see module docstring)."""

  def __init__(self, source: "MovieLensSource"):
    self.src = source
    self.lines = LineStream(source.paths, _is_header)
    self._pending = None                  # (pos, record) read ahead: the next user's first row
    self._group_pos = self.lines.tell()
    self._buf: list = []
    self._k = 0
    self._finished_users: set[int] = set()

  def tell(self) -> dict:
    return {"group": dict(self._group_pos), "k": self._k}

  def seek(self, pos: dict) -> None:
    self.lines.seek(pos["group"])
    self._pending, self._finished_users = None, set()
    self._group_pos, self._buf, self._k = dict(pos["group"]), [], 0
    skip = int(pos["k"])
    if skip:
      self._fill()
      self._k = skip

  def close(self) -> None:
    self.lines.close()

  def _read(self):
    if self._pending is not None:
      out, self._pending = self._pending, None
      return out
    pos = self.lines.tell()
    rec = next(self.lines, None)
    return None if rec is None else (pos, rec)

  def _fill(self) -> None:
    """Loads the records of the next user (and the bad rows read with them)."""
    self._buf, self._k = [], 0
    first = self._read()
    if first is None:
      return
    self._group_pos = first[0]
    user, events, bad = None, [], []
    item = first
    while item is not None:
      pos, (path, line, raw) = item
      try:
        u, i, r, t = parse_rating(raw)
      except BadRow as e:
        bad.append((path, line, e))
        item = self._read()
        continue
      if user is None:
        if u in self._finished_users:
          raise ValueError(
              f"{path}:{line}: user {u} appears again after other users; the ratings "
              "must be grouped by user (e.g. sorted by userId, as MovieLens ships them)")
        user = u
      elif u != user:
        self._pending = item
        break
      events.append((t, line, i, r, path))
      if len(events) > self.src.max_user_events:
        raise ValueError(f"{path}:{line}: user {u} has more than max_user_events="
                         f"{self.src.max_user_events} rows")
      item = self._read()
    if user is not None:
      self._finished_users.add(user)
    self._buf = bad + self.src.user_examples(user, events)

  def __iter__(self):
    return self

  def __next__(self):
    while self._k >= len(self._buf):
      self._fill()
      if not self._buf and self._pending is None and self._peek_eof():
        raise StopIteration
    rec = self._buf[self._k]
    self._k += 1
    return rec

  def _peek_eof(self) -> bool:
    nxt = self._read()
    if nxt is None:
      return True
    self._pending = nxt
    return False


class MovieLensSource(StreamingSource):
  """One split of MovieLens-format ratings as sequence examples (see module docstring).

  Args:
    ratings: ratings file(s); comma-separated string or list, globs allowed.
    movies: movies.csv for genres, or '' for none.
    split: 'train' or 'eval'.
    split_timestamp: unix seconds; None -> from `split_quantile`.
    max_len: history length kept (most recent events).
    max_genres: genre bag size.
    like_threshold: rating >= this is a positive.
    max_user_events: the most rows one user may have (memory bound).
    vocab_size: spec vocab hint for user/item ids.
    **kw: StreamingSource options (shuffle_buffer, bad_row_limit, bad_row_min_rows).
  """

  def __init__(self, ratings: str | Sequence[str], movies: str = "", *, split: str = "train",
               split_timestamp: int | None = None, split_quantile: float = 0.8,
               max_len: int = 50, max_genres: int = 10, like_threshold: float = 4.0,
               max_user_events: int = 1_000_000, vocab_size: int = 1 << 20, **kw):
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    self.paths = expand_paths(ratings, what="MovieLens ratings")
    self.genres, self.genre_names = load_genres(
        expand_paths(movies, "MovieLens movies")[0]) if movies else ({}, [])
    super().__init__(movielens_spec(max_len, len(self.genre_names), max_genres, vocab_size),
                     **kw)
    self.split, self.max_len, self.max_genres = split, max_len, max_genres
    self.like_threshold, self.max_user_events = like_threshold, max_user_events
    self.split_timestamp = (split_timestamp_at(self.paths, split_quantile)
                            if split_timestamp is None else int(split_timestamp))

  @classmethod
  def from_config(cls, cfg, split: str) -> "MovieLensSource":
    train = split == "train"
    ts = cfg.get("split_timestamp", 0)
    return cls(cfg.train if train else cfg.eval, cfg.get("movies", ""), split=split,
               split_timestamp=ts or None, split_quantile=cfg.get("split_quantile", 0.8),
               max_len=cfg.get("max_len", 50), max_genres=cfg.get("max_genres", 10),
               like_threshold=cfg.get("like_threshold", 4.0),
               vocab_size=cfg.get("vocab_size", 1 << 20),
               shuffle_buffer=cfg.get("shuffle_buffer", 0) if train else 0,
               bad_row_limit=cfg.get("bad_row_limit", 0.01))

  @property
  def shared_vocab(self) -> dict[str, str]:
    """History items share the candidate item's table."""
    return {"hist_item": "item"}

  def describe(self) -> str:
    return f"MovieLensSource[{self.split}]({', '.join(self.paths)})"

  def num_rows(self) -> int:
    """Examples of this split (readable ratings on its side of the split time): one
    streaming pass over the ratings, counted once and cached."""
    if getattr(self, "_num_rows", None) is None:
      n, want_eval = 0, self.split == "eval"
      for _, _, line in LineStream(self.paths, _is_header):
        try:
          n += (parse_rating(line)[3] >= self.split_timestamp) == want_eval
        except BadRow:
          continue
      self._num_rows = n
    return self._num_rows

  def open_stream(self, epoch: int, seed: int) -> UserEventStream:
    del epoch, seed   # file order is data order here (users must stay contiguous)
    return UserEventStream(self)

  def user_examples(self, user: int, events: list) -> list:
    """Records of this split for one user's events [(t, line, item, rating, path)]."""
    events.sort(key=lambda e: (e[0], e[1]))
    out, h = [], 0                           # events[:h] are strictly before the current one
    want_eval = self.split == "eval"
    for t, line, item, rating, path in events:
      while events[h][0] < t:
        h += 1
      if (t >= self.split_timestamp) != want_eval:
        continue
      hist = events[max(0, h - self.max_len):h][::-1]          # most recent first
      out.append((path, line, (
          float(rating >= self.like_threshold), user, item,
          self.genres.get(item, [])[:self.max_genres],
          [e[2] for e in hist], [int(round(2 * e[3])) for e in hist],
          [float(t - e[0]) for e in hist])))
    return out

  def decode(self, record):
    payload = record[2]
    if isinstance(payload, BadRow):
      raise payload
    return payload

  def where(self, record) -> str:
    return f"{record[0]}:{record[1]}"

  def collate(self, examples: list) -> dict:
    b, L, G = len(examples), self.max_len, self.max_genres
    out = base_batch(b, 2, 1)
    user = np.full((b, 1), -1, np.int64)
    item = np.full((b, 1), -1, np.int64)
    genre = np.full((b, G), -1, np.int64)
    hist = np.full((b, L), -1, np.int64)
    action = np.zeros((b, L), np.int32)
    dt = np.zeros((b, L), np.float32)
    lens = np.zeros((b,), np.int32)
    idx, ex = valid_rows(examples)
    for i, (label, u, it, gs, hi, ac, d) in zip(idx, ex):
      n = len(hi)
      out["labels"][i, 0], out["label_mask"][i, 0] = label, 1.0
      user[i, 0], item[i, 0], lens[i] = u, it, n
      genre[i, :len(gs)] = gs
      hist[i, :n], action[i, :n], dt[i, :n] = hi, ac, d
      gap_h = d[0] / 3600 if n else 0.0
      out["dense"][i] = (math.log1p(n) / 10, math.log1p(gap_h) / 10)
    out["ids"] = {"user": user, "item": item, "genre": genre, "hist_item": hist}
    out["seq"] = {"history": {"len": lens, "action": action,
                              "surface": np.zeros((b, L), np.int32), "dt": dt}}
    return out
