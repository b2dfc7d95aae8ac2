"""The list elements ``KVMemSaver`` has checked (or made itself), kept in memory by key.

An element's key hashes its parent's key, its type and its bytes (:func:`langchain_kvmem.saver._element_key`),
so a key always names the same element: one that passed its checks once (CRC32C, its key hashed again) is
that element for as long as it is kept, whatever happens to its row later. A read walks a list from its
last element back through the elements kept here and reads from the database, and checks, only the ones
that are not: a thread's next checkpoint reads its new messages, not its whole history again.

The elements are immutable (frozen, their bytes ``bytes``); nothing decoded is kept, so every read
deserializes its own objects and no caller sees another's changes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from langchain_kvmem._checkpoint_rows import Element

__all__ = ["VerifiedElements"]


class VerifiedElements:
    """Checked elements by key, the least recently used dropped beyond ``capacity`` bytes of element data.

    Args:
        capacity: bytes of element data kept at most (0 keeps none). Thread-safe.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._elements: OrderedDict[str, Element] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._elements)

    def chain(self, last: str) -> tuple[list[Element], str | None]:
        """The elements kept of the list ending at ``last``, from the last back, and the key of the first one
        not kept (``None``: the whole list is here)."""
        with self._lock:
            found, key = self._walk(last)
            for element in reversed(found):  # NOTE: the list's first elements are dropped first (see add)
                self._elements.move_to_end(element.key)
        return found, key

    def missing(self, last: str) -> str | None:
        """The key of the first element of the list ending at ``last`` not kept here, walking back (``None``: none).
        Not a use: what is kept stays in its place."""
        with self._lock:
            return self._walk(last)[1]

    def _walk(self, last: str) -> tuple[list[Element], str | None]:
        """:meth:`chain` without marking anything used (caller holds ``_lock``)."""
        found: list[Element] = []
        key: str | None = last
        while key is not None and (element := self._elements.get(key)) is not None:
            found.append(element)
            key = element.parent
        return found, key

    def add(self, elements: Iterable[Element]) -> None:
        """Keep ``elements`` (checked by the caller, or made by it; a list's in its order), dropping the least
        recently used beyond the capacity.

        NOTE: a list's first elements count as used before its last ones, so they are dropped first: a read
        walks a list back from its last element and reads from the database from the first one missing back.
        """
        if self.capacity <= 0:
            return
        with self._lock:
            for element in elements:
                if element.key in self._elements:
                    self._elements.move_to_end(element.key)
                    continue
                self._elements[element.key] = element
                self._bytes += len(element.data)
            while self._bytes > self.capacity and self._elements:
                _, dropped = self._elements.popitem(last=False)
                self._bytes -= len(dropped.data)
