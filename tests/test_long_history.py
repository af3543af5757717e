"""The long-history generator: length distribution, the planted signal, the truncation gap."""
import numpy as np
import pytest

from gem_jax.data.long_history import LongHistory
from gem_jax.data.synthetic import rank_auc


def test_lengths_and_layout():
  g = LongHistory()
  b = g.batch(4000, np.random.default_rng(0))
  n = b["lengths"]
  assert 250 <= np.median(n) <= 340 and n.max() <= g.max_len and (n == 0).any()
  valid = np.arange(g.max_len)[None] < n[:, None]
  assert (b["items"][valid] >= 0).all() and (b["items"][~valid] == -1).all()
  assert (b["dt"][~valid] == 0).all()
  ok = valid[:, 1:] & valid[:, :-1]
  assert (np.diff(b["dt"], axis=1)[ok] >= 0).all()  # older events are not younger (fp32 ages)
  same = g.batch(4000, np.random.default_rng(0))
  np.testing.assert_array_equal(same["items"], b["items"])  # a seed fixes the data


def test_planted_signal_is_far_back():
  g = LongHistory()
  b = g.batch(20000, np.random.default_rng(1))
  hit = (b["items"] == b["candidate"][:, None]) & (b["items"] >= 0)
  np.testing.assert_array_equal(hit.any(1), b["deep_match"] | b["recent_match"])
  np.testing.assert_allclose(b["logit"], g.bias + g.beta * hit.any(1), rtol=1e-6)
  assert not (b["deep_match"] & (b["lengths"] <= g.recent)).any()
  assert b["deep_match"].mean() > 0.25  # a third of the users match only far back
  # The newest 64 events lose most of the AUC the full history gives.
  full = rank_auc(b["logit"], b["label"])
  short = rank_auc(g.short_logit(b), b["label"])
  assert full > 0.78 and short < 0.65, (full, short)


@pytest.mark.slow  # four short trainings: ~3 min on 2 loaded cores
def test_long_history_beats_truncated_by_more_than_the_seed_spread():
  """The planted far-back signal: a target-attention ranker on full histories (up to 2,048
  events, chunked attention above 512 keys) beats the same model on the newest 64 events
  by more than the seed-to-seed spread of either."""
  from gem_jax.bench.long_history import compare
  r = compare(LongHistory(max_len=2048, vocab=10_000))
  margin = min(r["long"]) - max(r["short"])
  spread = max(max(r["long"]) - min(r["long"]), max(r["short"]) - min(r["short"]))
  assert margin > spread and margin > 0.05, r
  assert max(r["short"]) < r["short_oracle_auc"] + 0.03, r  # 64 events cap the short model
