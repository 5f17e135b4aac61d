"""Bounded caches: one small LRU for every cache that a new shape or argument grows.

A long-running process (a server that sees many shapes) must hold its memory flat, so the
eager kernels' jitted programs and the fused mode's programs and output shapes live in ``LRU``s.
Each reads its limit from a ``torchtpu.config`` setting when it inserts (so a changed setting
applies at once; 0 means no limit) and counts what it drops in ``torchtpu.metrics``
(``evictions``, by cache name).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterator

from torchtpu import metrics
from torchtpu.config import config


class LRU:
    """A dict-like cache of at most ``config.<setting>`` entries; the least recently used go first.

    ``get`` (the hot path: one per eager op) takes no lock; it is safe against a concurrent
    insertion because each ``OrderedDict`` call is atomic. Insertions and evictions take a lock.
    Values must not be None (``get`` returns None for a miss).
    """

    __slots__ = ("name", "setting", "_data", "_lock")

    def __init__(self, name: str, setting: str):
        getattr(config, setting)  # a clear error now for a misspelt setting
        self.name = name
        self.setting = setting
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, default=None):
        data = self._data
        value = data.get(key)
        if value is None:
            return default
        try:
            data.move_to_end(key)
        except (KeyError, RuntimeError):  # evicted by another thread meanwhile: still a valid value
            pass
        return value

    def __getitem__(self, key):
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key, value) -> None:
        limit = getattr(config, self.setting)
        data = self._data
        evicted = 0
        with self._lock:
            data[key] = value
            data.move_to_end(key)
            if limit > 0:
                while len(data) > limit:
                    data.popitem(last=False)
                    evicted += 1
        if evicted:
            metrics.count_eviction(self.name, evicted)

    def setdefault(self, key, value):
        found = self.get(key)
        if found is None:
            self[key] = found = value
        return found

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator:
        return iter(list(self._data))

    def keys(self) -> list:
        return list(self._data.keys())

    def values(self) -> list:
        return list(self._data.values())

    def items(self) -> list[tuple[Any, Any]]:
        return list(self._data.items())

    def pop(self, key, *default):
        with self._lock:
            return self._data.pop(key, *default)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    @property
    def limit(self) -> int:
        """The current limit (0: none)."""
        return getattr(config, self.setting)

    def __repr__(self) -> str:
        return f"LRU({self.name!r}, {len(self._data)} of {self.limit or 'unlimited'})"
