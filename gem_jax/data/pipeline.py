"""Input pipeline: shuffling, sharding by process, exact resume, prefetch, global arrays.

Every file reader is a stream of *records* (raw lines, or already-built
examples for stateful readers) with a JSON position (`tell`/`seek`). On top of
it, for any reader:

  records --ShuffleBuffer--> shuffled records --BatchIterator--> host batches
          (block shuffle,     (global batch of B records; this process decodes
           seed, epoch)        rows [p*b, (p+1)*b), b = B // P, and collates them)

* Shuffling is a block shuffle: the stream is cut into blocks of `buffer_size`
  records and each block is emitted in the permutation drawn from
  `np.random.default_rng((seed, epoch, block))`. Its state is a replayable
  description -- the stream position of the block start, the block number and
  how many records of the block were taken -- so resuming re-reads one block
  and continues at exactly the next record. Files are also visited in a
  per-epoch seeded order.
* Sharding by process: all processes walk the same global record order and cut
  the same global batches; each decodes only its own slice. Batch composition
  does not depend on parse results (a bad row keeps its slot as a padding row
  with `label_mask = 0`), so processes stay aligned and every process emits the
  same number of batches, also at the end of an eval pass.
* The iterator state (`BatchIterator.state()`) is JSON: epoch, shuffle state,
  bad-row counts. `Prefetcher.state()` is the state after the last batch handed
  out, not after the read-ahead, so it can go straight into a checkpoint.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from gem_jax.data.badrows import BadRow, BadRowCounter, NoDataError

NO_SHUFFLE_BLOCK = 1024  # records per block when not shuffling (bounds resume re-reads)


class RecordStream(Protocol):
  """A source's records in file order, for one epoch."""

  def tell(self) -> dict: ...
  def seek(self, pos: dict) -> None: ...
  def __next__(self) -> Any: ...
  def close(self) -> None: ...


class ShuffleBuffer:
  """Block shuffle of a record stream, deterministic for (seed, epoch), exactly resumable.

  Args:
    stream: the epoch's record stream (positioned at its start unless `state`).
    size: records per block; <= 1 means no shuffling (blocks of NO_SHUFFLE_BLOCK
      records in file order).
    seed, epoch: select the permutations.
    state: a previous `state()` to resume from.
  """

  def __init__(self, stream: RecordStream, size: int, seed: int, epoch: int,
               state: dict | None = None):
    self.stream = stream
    self.shuffle = size > 1
    self.size = size if self.shuffle else NO_SHUFFLE_BLOCK
    self.seed, self.epoch = int(seed), int(epoch)
    if state is None:
      state = {"pos": stream.tell(), "block": 0, "taken": 0}
    self._pos, self._block_no, self._taken = dict(state["pos"]), state["block"], state["taken"]
    self._block: list | None = None
    self._next_pos: dict | None = None

  def state(self) -> dict:
    return {"pos": self._pos, "block": self._block_no, "taken": self._taken}

  def _load(self) -> None:
    self.stream.seek(self._pos)
    block = []
    for rec in self.stream:
      block.append(rec)
      if len(block) == self.size:
        break
    self._next_pos = self.stream.tell()
    if self.shuffle:
      rng = np.random.default_rng((self.seed, self.epoch, self._block_no))
      block = [block[i] for i in rng.permutation(len(block))]
    self._block = block

  def __iter__(self):
    return self

  def __next__(self):
    if self._block is None:
      self._load()
    while self._taken >= len(self._block):
      if len(self._block) < self.size:   # short block: the stream is exhausted
        raise StopIteration
      self._pos, self._block_no, self._taken = self._next_pos, self._block_no + 1, 0
      self._load()
    rec = self._block[self._taken]
    self._taken += 1
    return rec


class BatchIterator:
  """Host batches of one process from a `StreamingSource` (see gem_jax/data/source.py).

  Yields this process's `batch_size // process_count` rows of each global batch
  of `batch_size` records. With `repeat=False` it stops after one pass and pads
  the last batch with `label_mask = 0` rows; with `repeat=True` epochs follow
  each other (batches may span two epochs).
  """

  def __init__(self, source, batch_size: int, *, process_index: int = 0,
               process_count: int = 1, seed: int = 0, repeat: bool = True,
               shuffle_buffer: int = 0, bad_row_limit: float = 0.01,
               bad_row_min_rows: int = 1000, state: dict | None = None):
    if batch_size <= 0 or batch_size % process_count:
      raise ValueError(
          f"global batch_size {batch_size} must be a positive multiple of "
          f"process_count {process_count}")
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    self.source = source
    self.global_batch_size = int(batch_size)
    self.local_batch_size = batch_size // process_count
    self.process_index, self.process_count = process_index, process_count
    self.seed, self.repeat, self.shuffle_buffer = int(seed), bool(repeat), int(shuffle_buffer)
    self.counter = BadRowCounter(bad_row_limit, min_rows=bad_row_min_rows)
    self._epoch, self._epoch_records, self._done = 0, 0, False
    shuffle_state = None
    if state is not None:
      for k in ("seed", "shuffle_buffer"):
        if state[k] != getattr(self, k):
          raise ValueError(
              f"cannot resume: iterator state has {k}={state[k]} but this iterator "
              f"has {k}={getattr(self, k)} (the record order would differ)")
      self._epoch, self._epoch_records = state["epoch"], state["epoch_records"]
      self._done = state["done"]
      self.counter.restore(state["bad_rows"])
      shuffle_state = state["shuffle"]
    self._open_epoch(shuffle_state)

  def _open_epoch(self, shuffle_state=None) -> None:
    stream = self.source.open_stream(self._epoch, self.seed)
    self._shuffle = ShuffleBuffer(stream, self.shuffle_buffer, self.seed, self._epoch,
                                  shuffle_state)

  def state(self) -> dict:
    """JSON-serialisable position after the last batch returned."""
    return {"epoch": self._epoch, "epoch_records": self._epoch_records,
            "shuffle": self._shuffle.state(), "done": self._done,
            "seed": self.seed, "shuffle_buffer": self.shuffle_buffer,
            "bad_rows": self.counter.state()}

  def __iter__(self):
    return self

  def _next_records(self) -> tuple[list, bool]:
    """The next global batch of records, and whether a pass ended inside it."""
    records, pass_ended = [], False
    while len(records) < self.global_batch_size:
      try:
        records.append(next(self._shuffle))
        self._epoch_records += 1
      except StopIteration:
        self._shuffle.stream.close()
        if self._epoch_records == 0:
          raise NoDataError(f"{self.source.describe()}: a full pass produced no rows")
        pass_ended = True
        if not self.repeat:
          self._done = True
          break
        self._epoch, self._epoch_records = self._epoch + 1, 0
        self._open_epoch()
    return records, pass_ended

  def __next__(self) -> dict:
    if self._done:
      raise StopIteration
    records, pass_ended = self._next_records()
    if not records:
      self.counter.check(end_of_pass=True)
      raise StopIteration
    b = self.local_batch_size
    mine = records[self.process_index * b:(self.process_index + 1) * b]
    examples = []
    for rec in mine:
      try:
        examples.append(self.source.decode(rec))
        self.counter.good()
      except BadRow as e:
        self.counter.report(self.source.where(rec), str(e))
        examples.append(None)
    self.counter.check(end_of_pass=pass_ended)
    examples += [None] * (b - len(examples))
    return self.source.collate(examples)

  def close(self) -> None:
    self._shuffle.stream.close()


class Prefetcher:
  """Runs `put_fn(next(iterator))` in a background thread, `size` batches ahead.

  `state()` is the iterator state right after the last batch handed out by
  `__next__` (the read-ahead is not counted), so a checkpoint taken after step
  n resumes at batch n + 1. Exceptions of the iterator or `put_fn` are raised
  in the consumer. Use as a context manager or call `close()`.
  """

  _END = object()

  def __init__(self, iterator, put_fn: Callable | None = None, size: int = 2):
    self._it = iterator
    self._put = put_fn or (lambda x: x)
    self._state = iterator.state()
    self._q: queue.Queue = queue.Queue(maxsize=max(1, size))
    self._stop = threading.Event()
    self._finished = False
    self._thread = threading.Thread(target=self._run, daemon=True, name="Prefetcher")
    self._thread.start()

  def _offer(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._q.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        try:
          batch = next(self._it)
        except StopIteration:
          self._offer((self._END, None))
          return
        st = self._it.state()
        if not self._offer((self._put(batch), st)):
          return
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
      self._offer((e, None))

  def state(self) -> dict:
    return self._state

  def __iter__(self):
    return self

  def __next__(self):
    if self._finished:
      raise StopIteration
    item, st = self._q.get()
    if item is self._END:
      self._finished = True
      raise StopIteration
    if isinstance(item, BaseException):
      self._finished = True
      raise item
    self._state = st
    return item

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=10)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """The batch axis split over every mesh axis (('replica', 'shard'))."""
  return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def global_batch(local_batch, shardings):
  """Assembles global jax Arrays from this process's rows of every batch leaf.

  Args:
    local_batch: a (nested) dict of numpy arrays with leading axis b = B / P.
    shardings: one `jax.sharding.Sharding` for every leaf, or a pytree prefix of
      `local_batch` with one per subtree.
  Returns:
    The same structure of global arrays with leading axis B.
  """
  def make(sharding, x):
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: make(shardings, x), local_batch)
  return jax.tree.map(make, shardings, local_batch)


def take(iterator: Iterator, n: int) -> list:
  """The next `n` items (fewer if the iterator ends)."""
  out = []
  for _ in range(n):
    try:
      out.append(next(iterator))
    except StopIteration:
      break
  return out
