"""The scheduler's waiting queue: sequences not running, most urgent first, with aging.

A waiting sequence's effective priority is `priority + aging_rate * seconds waited`, so every
low-priority request is eventually admitted however many high-priority ones keep arriving. Two
waiting sequences compare the same at any moment (both age at the same rate), so the order is
fixed at push time: by `arrival - priority / aging_rate` (a priority p counts as having arrived
p / aging_rate seconds earlier), then by arrival, then by id. Equal priorities are served first
come, first served. A preempted sequence keeps its arrival, so it goes back near the front.

`load()` may be called from any thread (the executor's admission check); everything else is
called by the engine loop only. Pure Python (no torch).
"""
from __future__ import annotations

import bisect
import threading
from typing import Iterator

from triton_backend.engine.sequence import Sequence

NS_PER_SECOND = 1_000_000_000


def urgency_key(seq: Sequence, aging_rate: float) -> tuple[float, int, int]:
    """Sort key: smaller is admitted sooner and preempted later (`seq.arrival_ns` must be set)."""
    arrival_ns = seq.arrival_ns
    if arrival_ns is None:
        raise ValueError(f"sequence {seq.seq_id}: no arrival time to order it by")
    virtual_arrival = arrival_ns / NS_PER_SECOND - seq.request.priority / aging_rate
    return (virtual_arrival, arrival_ns, seq.seq_id)


class WaitingQueue:
    def __init__(self, aging_rate: float) -> None:
        if not aging_rate > 0:
            raise ValueError(f"priority_aging_rate must be > 0, got {aging_rate!r}")
        self.aging_rate = aging_rate
        self._seqs: list[Sequence] = []
        self._keys: list[tuple[float, int, int]] = []
        self._lock = threading.Lock()
        self._num_tokens = 0  # tokens the waiting sequences will prefill (prompt + generated)

    def key(self, seq: Sequence) -> tuple[float, int, int]:
        return urgency_key(seq, self.aging_rate)

    def push(self, seq: Sequence) -> None:
        key = self.key(seq)
        index = bisect.bisect(self._keys, key)
        with self._lock:
            self._keys.insert(index, key)
            self._seqs.insert(index, seq)
            self._num_tokens += seq.num_tokens

    def peek(self) -> Sequence:
        """The most urgent waiting sequence (the queue must not be empty)."""
        return self._seqs[0]

    def pop(self) -> Sequence:
        with self._lock:
            self._keys.pop(0)
            seq = self._seqs.pop(0)
            self._num_tokens -= seq.num_tokens
        return seq

    def remove(self, seq: Sequence) -> bool:
        """Take `seq` out; False when it is not waiting."""
        for index, waiting in enumerate(self._seqs):
            if waiting is seq:
                with self._lock:
                    del self._keys[index], self._seqs[index]
                    self._num_tokens -= seq.num_tokens
                return True
        return False

    def load(self) -> tuple[int, int]:
        """(waiting sequences, their tokens to prefill), consistent with each other."""
        with self._lock:
            return len(self._seqs), self._num_tokens

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._seqs))

    def __contains__(self, seq: object) -> bool:
        return any(waiting is seq for waiting in self._seqs)
