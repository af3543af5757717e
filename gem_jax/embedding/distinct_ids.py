"""Distinct raw ids on the device, grouped by a lead (the managed tables' deduplication).

Raw 64-bit ids travel as int32 halves (hi, lo) (`managed.split_ids`); `distinct` returns the
distinct ids of a batch grouped by a lead in [0, leads) (the requester's: each id's owner;
the owner's: its local window), each lead's in the order (fp(x), x) of `fingerprint`, which
the managed policy ranks misses by.

One sort of a single uint32 key, lead 2^bits + the top `bits` bits of fp(x) (bits = what the
lead count leaves of 32: 28 for 8 owners, 17 for 19,532 windows per owner, 6 for the 2^25
windows of a 2^28-row shard at probe 8), then each id's distinct index by binary search of
its key (XLA:CPU sorts one operand without calling a comparator: 2,600 ids in 0.13 ms with
the search, 0.9 ms by the 6-operand (lead, fp, hi, lo) sort). Exact: when two different
ids share a key (checked on every id; d distinct ids do with probability ~ d^2 / 2^33
whatever the leads: likely once a device's batch holds tens of thousands), one more
single-key sort splits the tied runs by the next bits of fp, and only if ids still tie
does that device sort by (lead, fp, hi, lo) (a lax.cond each, no collective inside).
Either way each lead's distinct ids come out in (fp(x), x) order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.embedding.layout import NO_ROW

PAD = NO_ROW               # the lead of padding and ids not wanted; last in every order
KEY_PAD = (1 << 32) - 1    # uint32 key of padding (`distinct_keyed`)


def fmix32(h, xp):
  """murmur3's 32-bit finaliser, on uint32 arrays of numpy or jnp (`xp`)."""
  h = h ^ (h >> 16)
  h = h * xp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * xp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def fingerprint(hi, lo, xp=jnp):
  """fp: uint32 hash of ids (hi, lo), independent of `window_of`'s; the order of a window's
  misses is (fp, id)."""
  if xp is jnp:
    u = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)  # noqa: E731
  else:
    u = lambda x: np.asarray(x, np.int32).view(np.uint32)  # noqa: E731
  return fmix32(u(hi) ^ fmix32(u(lo) ^ xp.uint32(0x7F4A7C15), xp), xp)


def distinct_sorted(hi, lo, lead, w):
  """Exact distinct ids by one sort on (lead, fp, hi, lo) (6 operands). hi, lo, lead (M,):
  the ids and their order key (`PAD`: padding), w (M,) their occurrences -> (inv (M,)
  distinct index of each input, d_lead, d_hi, d_lo (M,) per distinct id in (lead, fp, hi,
  lo) order (padding: `PAD`, -1, 0; last), occ (M,) the sum of each one's w)."""
  M = hi.shape[0]
  lead, _, hi, lo, src, w = jax.lax.sort(
      (lead, fingerprint(hi, lo), hi, lo, jnp.arange(M, dtype=jnp.int32), w), num_keys=4)
  new = jnp.concatenate([jnp.ones((1,), bool),
                         (lead[1:] != lead[:-1]) | (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])])
  did = (jnp.cumsum(new) - 1).astype(jnp.int32)                            # (M,) sorted slot's
  d_lead = jnp.full((M,), PAD, jnp.int32).at[did].set(lead)               # (M,) per distinct id
  d_hi = jnp.full((M,), -1, jnp.int32).at[did].set(hi)
  d_lo = jnp.zeros((M,), jnp.int32).at[did].set(lo)
  occ = jax.ops.segment_sum(jnp.where(lead != PAD, w, 0), did, M, indices_are_sorted=True)
  return jnp.zeros((M,), jnp.int32).at[src].set(did), d_lead, d_hi, d_lo, occ


def distinct_keyed(hi, lo, lead, w, key):
  """`distinct_sorted`'s outputs by a single-key sort (the fast path of XLA:CPU's sort: one
  operand, no comparator call) of `key` (M,) uint32, which orders the ids as (lead, fp) do
  (`KEY_PAD`: padding), each input's distinct index by binary search of its key in the
  sorted keys. Also returns `exact`: no two different ids share a key (else the result is
  wrong and the caller refines or sorts instead); then the order within a lead is (fp, id),
  as `distinct_sorted`'s."""
  M = hi.shape[0]
  valid = lead != PAD
  s = jnp.sort(key)
  new = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]])
  inv = (jnp.cumsum(new) - 1).astype(jnp.int32)[jnp.searchsorted(s, key)]  # (M,) distinct index
  hi, lo = jnp.where(valid, hi, -1), jnp.where(valid, lo, 0)
  d_lead = jnp.full((M,), PAD, jnp.int32).at[inv].set(lead)               # (M,) per distinct id
  d_hi = jnp.full((M,), -1, jnp.int32).at[inv].set(hi)
  d_lo = jnp.zeros((M,), jnp.int32).at[inv].set(lo)
  occ = jnp.zeros((M,), jnp.int32).at[inv].add(jnp.where(valid, w, 0))
  exact = jnp.all((d_hi[inv] == hi) & (d_lo[inv] == lo))
  return (inv, d_lead, d_hi, d_lo, occ), exact


def key_bits(leads: int) -> int | None:
  """Fingerprint bits left in a uint32 key under `leads` distinct leads, the largest key
  below the padding (0 to 31; None: the leads alone do not fit)."""
  if leads > KEY_PAD:
    return None
  return (KEY_PAD // max(leads, 1)).bit_length() - 1


def refine_bits(slots: int, bits: int) -> int:
  """Fingerprint bits of the refining key (`distinct`): the next ones after the first
  `bits`, as many as fit beside a run index below `slots` (0: none)."""
  return max(min((KEY_PAD // slots).bit_length() - 1, 32 - bits), 0)


def first_key(fp, lead, valid, bits: int):
  """`distinct`'s first key (M,) uint32: lead 2^bits + the top `bits` bits of fp."""
  top = fp >> (32 - bits) if bits else jnp.zeros_like(fp)
  return jnp.where(valid, (lead.astype(jnp.uint32) << bits) | top, jnp.uint32(KEY_PAD))


def refined_key(fp, runs, valid, bits: int, r: int):
  """`distinct`'s refining key (M,) uint32: each id's run of the first key (`runs`, its
  distinct index there) 2^r + the r bits of fp after the first `bits`."""
  return jnp.where(valid, (runs.astype(jnp.uint32) << r) | ((fp << bits) >> (32 - r)),
                   jnp.uint32(KEY_PAD))


def distinct(g, lead, leads: int, w=None):
  """Distinct ids of g (M, 2) grouped by `lead` (M,) in [0, leads) (`PAD`: padding or not
  wanted), each lead's in (fp, id) order. Returns (inv, d_lead, d_hi, d_lo, occ).

  Single-key sorts (`distinct_keyed`), at most two, one lax.cond each:
    1. key = lead 2^bits + the top `bits` bits of fp (bits: what the leads leave of 32,
       1 for 2^30 leads). Two distinct ids of a lead share it with probability
       2^-bits: d distinct ids in L leads tie with probability ~ d^2 / (2 L 2^bits),
       between d^2 / 2^33 and d^2 / 2^32 (the benchmark's Zipf ids: 8,300 distinct 0-3 %
       of steps, 55,000 63 %), whatever L;
    2. then, if some did: key = (its run in 1.) 2^r + the next r bits of fp, which splits
       the runs of 1. in (fp, id) order too (r: what M runs leave of 32, at most the 32 -
       bits unused): a tie now needs ~bits + r equal bits of fp;
    3. then, if some still do: the 6-operand sort (`distinct_sorted`), exact always.
  Example (bits 2, r 2; ids a, b, c with fp 1011.., 1001.., 0111..): keys 1. [2, 2, 1]
  tie a and b; runs [1, 1, 0] -> keys 2. [1 * 4 + 3, 1 * 4 + 1, 0 * 4 + 3] = [7, 5, 3]:
  c, b, a, the (fp, id) order."""
  M = g.shape[0]
  valid = lead != PAD
  hi, lo = g[:, 0], jnp.where(valid, g[:, 1], 0)
  w = jnp.ones((M,), jnp.int32) if w is None else w
  bits = key_bits(leads)
  if bits is None:
    return distinct_sorted(hi, lo, lead, w)
  fp = fingerprint(hi, lo)                                                # (M,) uint32
  fast, exact = distinct_keyed(hi, lo, lead, w, first_key(fp, lead, valid, bits))
  r = refine_bits(M, bits)

  def refine():   # the runs of the first key split by the next r bits of fp
    if not r:
      return distinct_sorted(hi, lo, lead, w)
    out, exact = distinct_keyed(hi, lo, lead, w, refined_key(fp, fast[0], valid, bits, r))
    return jax.lax.cond(exact, lambda: out, lambda: distinct_sorted(hi, lo, lead, w))
  return jax.lax.cond(exact, lambda: fast, refine)

