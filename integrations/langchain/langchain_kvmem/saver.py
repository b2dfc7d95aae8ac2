"""``KVMemSaver``: a LangGraph checkpointer whose threads live in kvmem's catalog database.

A checkpoint is a row of the thread index (thread, namespace, id, parent, metadata) in the
database ``Memory(path)`` or ``catalog_url`` names (SQLite under the kvmem directory by default,
PostgreSQL when several machines share threads), so every process on that database sees every
committed checkpoint at once. Its channel values are kvmem blobs (CRC32C over every byte), each
stored once under the content hash of its serialized bytes: a channel whose version did not move
since the parent checkpoint points at the parent's blob, and a fork, a copied thread, or any equal
value shares it. A value that is a list (a thread's ``messages``) is stored element by element
instead: each element serialized on its own, with its CRC32C, under a key that hashes the key of
the element before it with its own bytes, so a list is named by its last element's key and a list
that extends another (the next step's ``messages``, a fork's) stores only its new elements. A
thread of *n* messages stores each once, not *n* times. Pending writes are blobs too. See
:mod:`langchain_kvmem._checkpoint_rows` for the tables.

Why rows and not kvmem entries: tier entries are a cache that capacity evicts; a checkpoint is
primary data, never evicted (as agent chains, :mod:`kvmem.agent.chain`, and ``KVMemStore`` items).
Every write is one transaction that also keeps its rows recoverable outside the database
(``Database.keep_row``): a catalog rebuilt after damage restores them. A checkpoint whose ``put``
returned survives a ``kill -9`` of its writer.

Serialization is LangGraph's own serde (``JsonPlusSerializer``, pickle fallback off). Nothing read
back is ever unpickled: a serde with ``pickle_fallback=True`` is refused, and a stored value typed
``pickle`` raises :class:`CheckpointCorrupt` instead of loading.

Integrity: every body, channel value, list element and write is checked (its kvmem blob's CRC32C and
length, or an element's CRC32C, and a value's content hash against the key its checkpoint names, or
each element's key hashed again from its parent's key and its bytes) before anything of it is returned;
list elements checked once (or written by this saver) are kept in memory by key and not read again
(:mod:`langchain_kvmem._verified`: a key names one content). A checkpoint that fails a check is never
returned, nor a tuple built around it: ``get_tuple`` and ``list`` raise :class:`CheckpointCorrupt`,
naming the thread, namespace and checkpoint. They do not fall back to an older checkpoint on their own:
that would resume the graph from an earlier step without anyone asking. ``list(config, before=...)`` past the
bad one, or ``get_tuple`` with an older ``checkpoint_id``, still reads every intact checkpoint (time travel).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any
from uuid import UUID

import crc32c
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

import kvmem
from kvmem.errors import ConfigError, IntegrityError
from langchain_kvmem._checkpoint_rows import (
    Blob,
    CheckpointRows,
    Element,
    ListValue,
    NewCheckpoint,
    StoredCheckpoint,
    Value,
    all_but_latest,
    everything_of,
    of_runs,
)
from langchain_kvmem._verified import VerifiedElements

__all__ = ["CheckpointCorrupt", "KVMemSaver"]

Fail = Callable[[str], "CheckpointCorrupt"]  # makes the error naming the checkpoint being read
_DOMAIN = "kvmem/langgraph/value"  # folded into each value's content hash
_ELEMENT_DOMAIN = b"kvmem/langgraph/element\0"  # begins each list element's hash
_FIRST = bytes(32)  # the parent a list's first element hashes
_PAGE = 64  # checkpoints read per round trip by list()
_STRATEGIES = ("keep_latest", "delete")


class CheckpointCorrupt(IntegrityError):
    """A stored checkpoint (its body, a channel value or a pending write) failed its check; nothing of it is returned.

    Attributes:
        thread_id, checkpoint_ns, checkpoint_id: the checkpoint.
    """

    def __init__(self, message: str, thread_id: str, checkpoint_ns: str, checkpoint_id: str) -> None:
        super().__init__(
            f"thread {thread_id!r} namespace {checkpoint_ns!r} checkpoint {checkpoint_id}: {message}; "
            "older checkpoints stay readable (list(config, before=...) or an older checkpoint_id)"
        )
        self.thread_id, self.checkpoint_ns, self.checkpoint_id = thread_id, checkpoint_ns, checkpoint_id


class KVMemSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer (``graph.compile(checkpointer=...)``) over a :class:`kvmem.Memory` (see the module
    docstring).

    Sync and async in one class: the async methods run the sync ones in a worker thread, so database work
    never blocks the event loop.

    Args:
        memory: whose catalog database holds the threads (default: :func:`kvmem.default_memory`).
        serde: LangGraph serializer (default: ``JsonPlusSerializer(pickle_fallback=False)``).
        compression: kvmem codec of the stored blobs (default ``"lz4"``; ``"none"`` stores them as serialized).
        element_cache_bytes: list elements kept in memory once checked (bytes of their serialized data; default
            32 MiB, 0 keeps none): a read takes those from memory and reads from the database, and checks, only
            the others (a thread's new messages). Elements are immutable and named by their content's hash, so a
            kept one is the one stored (:mod:`langchain_kvmem._verified`).

    Raises:
        ConfigError: a serde that falls back to pickle, a bad ``compression``, or a negative
            ``element_cache_bytes``.
    """

    def __init__(
        self,
        memory: kvmem.Memory | None = None,
        *,
        serde: SerializerProtocol | None = None,
        compression: str = "lz4",
        element_cache_bytes: int = 32 * 2**20,
    ) -> None:
        super().__init__(serde=serde if serde is not None else JsonPlusSerializer(pickle_fallback=False))
        for part in (serde, getattr(serde, "serde", None)):  # EncryptedSerializer wraps another
            if getattr(part, "pickle_fallback", False):
                raise ConfigError(
                    f"serde={serde!r} falls back to pickle: KVMemSaver never unpickles what it reads back; "
                    "pass JsonPlusSerializer(pickle_fallback=False) or leave serde unset"
                )
        self.memory = memory if memory is not None else kvmem.default_memory()
        try:
            self.memory.compress(b"", compression)
        except kvmem.KVMemError as exc:
            raise ConfigError(f"compression={compression!r}: {exc}") from None
        self.compression = compression
        if isinstance(element_cache_bytes, bool) or not isinstance(element_cache_bytes, int) or element_cache_bytes < 0:
            raise ConfigError(
                f"element_cache_bytes={element_cache_bytes!r}: expected an int >= 0 (bytes; 0 keeps none)"
            )
        self._verified = VerifiedElements(element_cache_bytes)
        self._rows = CheckpointRows(self.memory.database)

    # -- reads ------------------------------------------------------------------------------------
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (its newest when it names no ``checkpoint_id``), or ``None``.

        Raises:
            CheckpointCorrupt: that checkpoint failed a check (see the module docstring).
            ConfigError: ``config`` names no thread.
        """
        thread_id, checkpoint_ns = _thread(config), _namespace(config)
        stored = self._rows.one(thread_id, checkpoint_ns, get_checkpoint_id(config), self._verified.missing)
        return None if stored is None else self._tuple(stored)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first: of ``config``'s thread (every thread for ``None``), of its ``checkpoint_ns``
        when it names one (else of every namespace), whose metadata equals ``filter`` on each of its keys,
        older than ``before``'s checkpoint, at most ``limit``.

        Raises:
            CheckpointCorrupt: when the iteration reaches a checkpoint that failed a check.
        """
        conf = (config or {}).get("configurable") or {}
        index = self._rows.index(
            _thread(config) if config else None,
            _namespace(config) if "checkpoint_ns" in conf else None,
            get_checkpoint_id(config) if config else None,
            get_checkpoint_id(before) if before else None,
        )
        matched = (row.id for row in index if not filter or all(row.metadata.get(k) == v for k, v in filter.items()))
        ids = list(islice(matched, limit)) if limit is not None else list(matched)
        for start in range(0, len(ids), _PAGE):
            for stored in self._rows.load(ids[start : start + _PAGE], self._verified.missing):
                yield self._tuple(stored)

    # -- writes -----------------------------------------------------------------------------------
    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store ``checkpoint`` as the child of ``config``'s checkpoint; the config that names it.

        Channels in ``new_versions`` are serialized and stored (once per distinct value; a list's elements
        that extend a stored list, once per distinct prefix); the others point at the parent's value when
        the parent holds them at the same version.
        """
        thread_id, checkpoint_ns = _thread(config), _namespace(config)
        values = checkpoint["channel_values"]
        meta = get_serializable_checkpoint_metadata(config, metadata)
        body = {
            "checkpoint": self._typed({k: v for k, v in checkpoint.items() if k != "channel_values"}),
            "metadata": self._typed(meta),
        }
        versions = {ch: json.dumps(v) for ch, v in checkpoint["channel_versions"].items()}
        fresh = {ch: self._value(values[ch]) for ch in new_versions if ch in values and ch in versions}
        run_id = meta.get("run_id")
        self._rows.put(
            NewCheckpoint(
                thread_id,
                checkpoint_ns,
                checkpoint["id"],
                get_checkpoint_id(config),
                None if run_id is None else str(run_id),
                _json_safe(meta),
                self.memory.compress(body, self.compression),
                versions,
            ),
            fresh,
            lambda ch: self._value(values[ch]) if ch in values else None,
        )
        self._verified.add(e for value in fresh.values() if isinstance(value, ListValue) for e in value.elements)
        return {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns, "checkpoint_id": checkpoint["id"]}
        }

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """Store the writes of task ``task_id`` to ``config``'s checkpoint (its pending writes).

        Raises:
            ConfigError: ``config`` names no thread or no ``checkpoint_id``.
        """
        thread_id, checkpoint_ns = _thread(config), _namespace(config)
        checkpoint_id = get_checkpoint_id(config)
        if not isinstance(checkpoint_id, str):
            raise ConfigError(
                f"config['configurable']['checkpoint_id'] is {checkpoint_id!r}: put_writes needs the id of the "
                "checkpoint the writes belong to"
            )
        rows = [
            {
                "task_id": task_id,
                "idx": WRITES_IDX_MAP.get(channel, idx),
                "channel": channel,
                "task_path": task_path,
                "body": self._seal(value),
            }
            for idx, (channel, value) in enumerate(writes)
        ]
        self._rows.put_writes(thread_id, checkpoint_ns, checkpoint_id, rows)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of ``thread_id``, in every namespace (none: nothing happens)."""
        self._rows.delete(*everything_of([_thread_value(thread_id)]))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints whose metadata names one of ``run_ids``, with their writes."""
        if run_ids:
            self._rows.delete(of_runs([str(r) for r in run_ids]))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of ``source_thread_id`` to ``target_thread_id`` (values are shared)."""
        self._rows.copy_thread(_thread_value(source_thread_id), _thread_value(target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: keep only the newest checkpoint of each namespace of ``thread_ids`` (with its writes);
        ``delete``: delete the threads.

        NOTE: ``keep_latest`` keeps each kept checkpoint whole (every channel value), but the ancestors
        a beta ``DeltaChannel`` rebuilds its value from go: do not prune threads of graphs that use one.

        Raises:
            ConfigError: another ``strategy``.
        """
        if strategy not in _STRATEGIES:
            raise ConfigError(f"strategy={strategy!r}: accepted {', '.join(map(repr, _STRATEGIES))}")
        threads = [_thread_value(t) for t in thread_ids]
        if not threads:
            return
        if strategy == "delete":
            self._rows.delete(*everything_of(threads))
        else:
            self._rows.delete(all_but_latest(threads))

    def get_next_version(self, current: str | None, channel: None) -> str:
        """The version after ``current``: zero-padded (it sorts as text), with a random suffix as LangGraph's own
        savers make it, so the versions two forks give one channel differ."""
        number = 0 if current is None else current if isinstance(current, int) else int(str(current).split(".")[0])
        return f"{number + 1:032}.{random.random():016}"

    # -- async ------------------------------------------------------------------------------------
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`get_tuple` in a worker thread."""
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """:meth:`list`, each step in a worker thread."""
        found = self.list(config, filter=filter, before=before, limit=limit)
        while (item := await asyncio.to_thread(next, found, None)) is not None:
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """:meth:`put` in a worker thread."""
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """:meth:`put_writes` in a worker thread."""
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """:meth:`delete_thread` in a worker thread."""
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """:meth:`delete_for_runs` in a worker thread."""
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """:meth:`copy_thread` in a worker thread."""
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """:meth:`prune` in a worker thread."""
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)

    def __repr__(self) -> str:
        return f"KVMemSaver(path={self.memory.config.path!r}, compression={self.compression!r})"

    # -- blobs ------------------------------------------------------------------------------------
    def _typed(self, value: Any) -> dict[str, Any]:
        kind, data = self.serde.dumps_typed(value)
        return {"type": kind, "data": data}

    def _seal(self, value: Any) -> bytes:
        """``value`` serialized, as a kvmem blob."""
        return self.memory.compress(self._typed(value), self.compression)

    def _value(self, value: Any) -> Value:
        """``value`` as stored: a list (not empty) element by element, anything else as a blob keyed by the
        content hash of its serialized bytes."""
        if type(value) is list and value:
            return self._list(value)
        typed = self._typed(value)
        key = kvmem.content_hash(typed["data"], _DOMAIN, typed["type"])
        return Blob(key, self.memory.compress(typed, self.compression))

    def _list(self, value: list[Any]) -> ListValue:
        """The elements of ``value``, serialized each, each keyed by the hash of its parent's key and its bytes."""
        stored: list[Element] = []
        parent = None
        for item in value:
            kind, data = self.serde.dumps_typed(item)
            key = _element_key(parent, kind, data)
            stored.append(Element(key, parent, kind, crc32c.crc32c(data), data))
            parent = key
        return ListValue(tuple(stored))

    def _tuple(self, stored: StoredCheckpoint) -> CheckpointTuple:
        """``stored`` checked and deserialized.

        Raises:
            CheckpointCorrupt: any part of it failed a check.
        """

        def fail(what: str) -> CheckpointCorrupt:
            return CheckpointCorrupt(what, stored.thread_id, stored.checkpoint_ns, stored.checkpoint_id)

        body = _open(stored.body, fail, "its body")
        if not isinstance(body, dict) or set(body) != {"checkpoint", "metadata"}:
            raise fail("its body is not a checkpoint")
        checkpoint: Checkpoint = self._loads(body["checkpoint"], fail, "its body")
        values = {}
        for channel, (key, blob) in stored.channels.items():
            what = f"the value of channel {channel!r} (blob {key[:12]}…)"
            if blob is None:  # a list (its last element's key), or a value gone
                if self._verified.missing(key) is not None and key not in stored.elements:
                    raise fail(f"{what} is missing")
                values[channel] = self._elements(key, stored.elements, fail, f"channel {channel!r}")
                continue
            typed = _open(blob, fail, what)
            if not _is_typed(typed) or kvmem.content_hash(typed["data"], _DOMAIN, typed["type"]) != key:
                raise fail(f"{what} was altered: its content no longer hashes to its key")
            values[channel] = self._loads(typed, fail, what)
        writes = [
            (task_id, channel, self._loads(_open(blob, fail, f"a write of task {task_id}"), fail, "a write"))
            for task_id, channel, blob in stored.writes
        ]
        ids = {"thread_id": stored.thread_id, "checkpoint_ns": stored.checkpoint_ns}
        return CheckpointTuple(
            config={"configurable": {**ids, "checkpoint_id": stored.checkpoint_id}},
            checkpoint={**checkpoint, "channel_values": values},
            metadata=self._loads(body["metadata"], fail, "its metadata"),
            parent_config=None
            if stored.parent_id is None
            else {"configurable": {**ids, "checkpoint_id": stored.parent_id}},
            pending_writes=writes,
        )

    def _elements(self, last: str, rows: Mapping[str, Element], fail: Fail, what: str) -> list[Any]:
        """The list whose last element is ``last``: its elements kept in memory (checked before), the others
        from ``rows`` (read with the checkpoint), checked (then kept); deserialized."""
        chain: list[Element] = []
        checked: list[Element] = []
        key: str | None = last
        while key is not None:
            kept, key = self._verified.chain(key)
            chain += kept
            if key is None:
                break
            element = rows.get(key)
            where = f"{what}'s element {len(chain) + 1} from the end ({key[:12]}…)"
            if element is None:
                raise fail(f"{where} is missing")
            if crc32c.crc32c(element.data) != element.crc:
                raise fail(f"{where} failed its check (CRC32C)")
            if _element_key(element.parent, element.type, element.data) != key:
                raise fail(f"{where} was altered: its content no longer hashes to its key")
            chain.append(element)
            checked.append(element)
            key = element.parent
        self._verified.add(reversed(checked))
        return [self._loads({"type": e.type, "data": e.data}, fail, what) for e in reversed(chain)]

    def _loads(self, typed: object, fail: Fail, what: str) -> Any:
        """A checked ``{"type", "data"}`` deserialized by the serde; never unpickled."""
        if not _is_typed(typed):
            raise fail(f"{what} is not a serialized value")
        assert isinstance(typed, dict)
        if typed["type"].split("+")[0] == "pickle":
            raise fail(f"{what} is pickled: KVMemSaver never unpickles what it reads back")
        return self.serde.loads_typed((typed["type"], typed["data"]))


def _open(blob: bytes, fail: Fail, what: str) -> Any:
    """The value of a kvmem blob, its CRC checked."""
    try:
        return kvmem.Memory.decompress(blob)
    except IntegrityError as exc:
        raise fail(f"{what} failed its check ({exc})") from None


def _element_key(parent: str | None, kind: str, data: bytes) -> str:
    """The key of a list element: sha256 over its parent's key (none: zeros), its type and its data."""
    try:
        before = _FIRST if parent is None else bytes.fromhex(parent)
    except ValueError:  # a parent read back that is no key: hashes to no key
        before = parent.encode()
    kind_bytes = kind.encode()
    return hashlib.sha256(
        b"".join((_ELEMENT_DOMAIN, before, len(kind_bytes).to_bytes(4, "little"), kind_bytes, data))
    ).hexdigest()


def _is_typed(value: object) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"type", "data"}
        and isinstance(value["type"], str)
        and isinstance(value["data"], bytes)
    )


def _thread_value(thread_id: object) -> str:
    """A thread id as stored: a str (ints and UUIDs as their text).

    Raises:
        ConfigError: any other type.
    """
    if isinstance(thread_id, str):
        return thread_id
    if isinstance(thread_id, (int, UUID)) and not isinstance(thread_id, bool):
        return str(thread_id)
    raise ConfigError(f"thread_id={thread_id!r}: expected a str (an int or UUID is taken as its text)")


def _thread(config: RunnableConfig | None) -> str:
    conf = (config or {}).get("configurable") or {}
    if conf.get("thread_id") is None:
        raise ConfigError(
            f"config {config!r:.200} names no thread: KVMemSaver needs {{'configurable': {{'thread_id': ...}}}}"
        )
    return _thread_value(conf["thread_id"])


def _namespace(config: RunnableConfig | None) -> str:
    namespace = ((config or {}).get("configurable") or {}).get("checkpoint_ns") or ""
    if not isinstance(namespace, str):
        raise ConfigError(f"checkpoint_ns={namespace!r}: expected a str ('' for the root graph)")
    return namespace


def _json_safe(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``metadata`` whose values are plain JSON (what ``list(filter=)`` compares)."""
    safe = {}
    for key, value in metadata.items():
        try:
            safe[key] = json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            continue
    return safe
