"""Decode steps shared by sequences that arrived at different times (continuous batching).

Requests prefill one at a time (batch 1), then join a running decode batch between two decode blocks: their
states are stacked along the batch axis (KV caches padded to one capacity), each sequence at its own position
(`GatedAttention` takes one position a sequence), and each block's tokens go to each row's queue. A row leaves
at a stop id, at its token budget or when cancelled. Rows share a block only with rows of the same sampling
settings (a block's sampler is static and its temperature one number). A sampled row's tokens then depend on
the rows it decodes with (one PRNG key a block); a greedy row's do not, up to rounding (a batch may run other
kernels than one row does).

Source: the iteration-level scheduling of Orca (Yu et al., OSDI 2022), at the granularity of a decode block.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridlm.engine.sampling import BlockSampler, block_carry
from hybridlm.state import KVCache, LayerState

# Rows are padded up to one of these counts, so that a handful of programs serve every batch.
BATCH_SIZES = (1, 2, 4, 8, 16)


def pad_capacity(states: list[LayerState], capacity: int) -> list[LayerState]:
    """The states with every KV cache zero-padded along its positions to `capacity` tokens.

    Raises:
      ValueError: a cache already longer than `capacity`.
    """
    out = []
    for s in states:
        if isinstance(s, KVCache) and s.capacity != capacity:
            if s.capacity > capacity:
                raise ValueError(f"a KV cache of {s.capacity} tokens does not fit a capacity of {capacity}")
            pad = ((0, 0), (0, capacity - s.capacity), (0, 0), (0, 0))
            s = KVCache(key=jnp.pad(s.key, pad), value=jnp.pad(s.value, pad))
        out.append(s)
    return out


def stack_rows(rows: Sequence[list[LayerState]], capacity: int) -> list[LayerState]:
    """One batch of states from several sequences' states (each of batch 1 or more): concatenated along the
    batch axis, KV caches padded to `capacity` tokens first."""
    padded = [pad_capacity(r, capacity) for r in rows]
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=0), *padded)


def take_row(states: list[LayerState], i: int) -> list[LayerState]:
    """Row i of batched states, as states of batch 1."""
    return jax.tree_util.tree_map(lambda a: a[i : i + 1], states)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What rows decoding in one block must share: the static sampler, the temperature and top_p, the stop
    ids."""

    sampler: BlockSampler
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]


class BatchRow:
    """One sequence in a `DecodeBatcher`. Iterating it yields its new tokens as numpy int32 [n] blocks, the
    block with a stop id ending there; `cancel()` makes it leave at the next block boundary and ends the
    iteration. A failure of the batch's decode is raised by the iteration."""

    def __init__(
        self, states, position: int, token: jax.Array, remaining: int, settings: Settings, seed: int
    ):
        self.states, self.position, self.token = states, position, token
        self.remaining, self.settings, self.seed = remaining, settings, seed
        self.stopped = False  # produced a stop id
        self.cancelled = False
        self._blocks: queue.SimpleQueue = queue.SimpleQueue()

    @property
    def leaving(self) -> bool:
        return self.cancelled or self.stopped or self.remaining <= 0

    def cancel(self) -> None:
        self.cancelled = True
        self._blocks.put(None)

    def __iter__(self) -> Iterator[np.ndarray]:
        while (block := self._blocks.get()) is not None:
            if isinstance(block, BaseException):
                raise block
            yield block

    def _push(self, tokens: np.ndarray) -> None:
        """Hands a block to the reader (cut at the row's budget and first stop id); ends it when leaving."""
        tokens = tokens[: max(self.remaining, 0)]
        hit = np.flatnonzero(np.isin(tokens, self.settings.stop_ids))
        if hit.size:
            tokens, self.stopped = tokens[: int(hit[0]) + 1], True
        self.remaining -= tokens.size
        if self.cancelled:
            return
        if tokens.size:
            self._blocks.put(tokens)
        if self.leaving:
            self._blocks.put(None)

    def _fail(self, error: BaseException) -> None:
        if not self.cancelled:
            self._blocks.put(error)


class _Group:
    """The rows of one `Settings`, stacked into one batch between blocks."""

    def __init__(self, settings: Settings, seed: int):
        self.settings = settings
        self.key = jax.random.key(seed)
        self.rows: list[BatchRow] = []
        self.pending: list[BatchRow] = []
        self.batch = None  # (tokens [size], states, positions np [size]) of self.rows, padded to a batch size

    def run_block(self, runner, max_rows: int) -> int:
        """Restacks the rows if any leave or join, then runs one decode block for them and hands out its
        tokens; returns the rows it decoded."""
        if self.pending or any(r.leaving for r in self.rows):
            self._restack(max_rows)
        if not self.rows:
            return 0
        tokens, states, positions = self.batch
        s = self.settings
        block = s.sampler.block
        steps = min(block, max(r.remaining for r in self.rows))
        finished = np.arange(positions.size) >= len(self.rows)  # padding rows: already finished
        carry = block_carry(self.key, finished, s.stop_ids, s.temperature, s.top_p)
        out, count, tokens, states, _, carry = runner.decode_block(
            s.sampler, tokens, states, positions, carry, steps
        )
        self.key = carry[0]
        count = int(count)
        self.batch = (tokens, states, positions + count)
        out = np.asarray(out)[:, :count]
        for i, row in enumerate(self.rows):
            row.position += count
            row._push(out[i])
        return len(self.rows)

    def _restack(self, max_rows: int) -> None:
        if self.batch is not None:  # the staying rows' states back out of the batch
            tokens, states, _ = self.batch
            for i, row in enumerate(self.rows):
                if not row.leaving:
                    row.states, row.token = take_row(states, i), tokens[i : i + 1]
        staying = [r for r in self.rows if not r.leaving]
        joining = [r for r in self.pending if not r.cancelled]
        room = max(max_rows - len(staying), 0)
        self.rows, self.pending = staying + joining[:room], joining[room:]
        self.batch = None
        if not self.rows:
            return
        n = len(self.rows)
        size = next((b for b in BATCH_SIZES if b >= n), n)
        block = self.settings.sampler.block
        need = max(r.position + r.remaining + block for r in self.rows)  # room for a whole last block
        held = max((s.capacity for r in self.rows for s in r.states if isinstance(s, KVCache)), default=0)
        capacity = max(held, 1 << (need - 1).bit_length())
        padding = [self.rows[0]] * (size - n)  # copies of the first row, finished from the start
        rows = self.rows + padding
        self.batch = (
            jnp.concatenate([r.token for r in rows]),
            stack_rows([r.states for r in rows], capacity),
            np.array([r.position for r in rows], np.int32),
        )
        for r in self.rows:
            r.states = r.token = None  # held by the batch now


class DecodeBatcher:
    """Runs the decode blocks of every joined sequence on one thread, rows of equal settings in one batch.

    Args:
      runner: a `LayerwiseRunner` or `OffloadedRunner` (its `decode_block` takes one position a row).
      lock: held around each block: the lock that guards every other use of the runner (prefills), which is
        not safe from two threads at once.
      block: decode steps a block (`generate`'s DECODE_BLOCK by default).
      max_rows: rows a batch holds; more wait for a row to leave.
    """

    def __init__(self, runner, lock: threading.Lock, *, block: int = 16, max_rows: int = BATCH_SIZES[-1]):
        if not 1 <= max_rows <= BATCH_SIZES[-1]:
            raise ValueError(f"max_rows={max_rows} must lie in [1, {BATCH_SIZES[-1]}]")
        self.runner, self.lock, self.block, self.max_rows = runner, lock, block, max_rows
        self._joining: list[BatchRow] = []
        self._groups: dict[Settings, _Group] = {}
        self.blocks = 0  # decode blocks run
        self.peak_rows = 0  # the most rows one block decoded
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def join(
        self,
        states: list[LayerState],
        position: int,
        token: jax.Array,
        remaining: int,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        stop_ids: Sequence[int],
        seed: int = 0,
    ) -> BatchRow:
        """Adds a prefilled sequence of batch 1: its states hold positions [0, position), `token` [1] int32 is
        its last sampled token (not yet fed), `remaining` the tokens it may still produce (>= 1).

        Raises:
          ValueError: states of another batch than 1, remaining < 1, or sampling settings out of range.
          RuntimeError: the batcher is closed.
        """
        if np.shape(token) != (1,):
            raise ValueError(f"a row joins with one token, shape (1,), got {np.shape(token)}")
        if remaining < 1:
            raise ValueError(f"remaining={remaining} must be >= 1")
        sampler = BlockSampler.of(self.block, temperature, top_k, top_p)
        settings = Settings(
            sampler, float(temperature), float(top_p), tuple(int(t) for t in stop_ids) or (-1,)
        )
        row = BatchRow(states, position, jnp.asarray(token, jnp.int32), remaining, settings, seed)
        with self._wake:
            if self._closed:
                raise RuntimeError("the decode batcher is closed")
            self._joining.append(row)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hybridlm-batch", daemon=True)
                self._thread.start()
            self._wake.notify()
        return row

    def rows(self) -> int:
        """Rows decoding or waiting to (not those that have ended and leave at the next block)."""
        with self._wake:
            waiting = len(self._joining)
        groups = list(self._groups.values())
        return waiting + sum(sum(not r.leaving for r in g.rows) + len(g.pending) for g in groups)

    def close(self, timeout: float | None = None) -> None:
        """Stops the thread after the block in flight; rows still decoding end with a RuntimeError."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._closed or self._joining or self._groups):
                    self._wake.wait()
                if self._closed:
                    break
                joining, self._joining = self._joining, []
            for row in joining:
                group = self._groups.get(row.settings)
                if group is None:
                    group = self._groups[row.settings] = _Group(row.settings, row.seed)
                group.pending.append(row)
            for settings, group in list(self._groups.items()):
                try:
                    with self.lock:
                        rows = group.run_block(self.runner, self.max_rows)
                    self.blocks += rows > 0
                    self.peak_rows = max(self.peak_rows, rows)
                except Exception as e:  # noqa: BLE001  (handed to the rows' readers)
                    for row in group.rows + group.pending:
                        row._fail(e)
                    group.rows, group.pending = [], []
                if not (group.rows or group.pending):
                    del self._groups[settings]
        error = RuntimeError("the decode batcher was closed")
        for row in self._joining + [r for g in self._groups.values() for r in g.rows + g.pending]:
            row._fail(error)
