"""``KVMemStore``: a LangGraph ``BaseStore`` (long-term memory) in kvmem's catalog database.

An item is one row of ``kvmem_langgraph_items`` (namespace, key, value JSON, created,
updated, expiry, TTL); its vectors are rows of ``kvmem_langgraph_vectors`` (one per
indexed field, float32, L2-normalized). Both tables sit beside kvmem's catalog, in
the database ``Memory(path)`` or ``catalog_url`` names: SQLite under the kvmem
directory by default, PostgreSQL when several machines share it. Every process on
that database sees every committed write at once.

Why rows and not kvmem entries: kvmem entries are content-addressed values that tiers
cache per process and evict under capacity; a store item changes under a fixed
(namespace, key) and must never be evicted (agent chains, :mod:`kvmem.agent.chain`,
make the same choice). The items exist nowhere else, so every write batch also keeps
each item it changed (row and vectors) recoverable outside the database, in the same
transaction (``Database.keep_row``): a catalog rebuilt after damage restores them.

Why scores are computed here and not by :class:`kvmem.semantic.SemanticIndex`: a store
search ranks the items under a namespace *prefix* (many namespaces), after the filter,
max-pooled over several vectors per item, and must see what another process wrote a
moment ago; a ``SemanticIndex`` searches one namespace, nearest-first before any
filter, one vector per key, from an in-memory index read when it opens. Here a search
is one query plus one matrix product over its candidates' vectors: exact cosine, as in
``InMemoryStore``.

Semantics follow ``InMemoryStore``: reads of a batch see the state before its puts;
the last put of a (namespace, key) in a batch wins; a filter-only search returns items
grouped by namespace (in order of the namespace's oldest item), each group in creation
order (an update keeps an item's place, delete and put again moves it last); a query
search ranks items with vectors by cosine, then those without (score ``None``).
Deviations: ``created_at`` survives updates; a put replaces the item's vectors
(``index=False`` leaves none); ``$gt``-style operators on a missing or non-numeric field
exclude the item instead of raising; pages of a query search never repeat unscored
items; a namespace emptied of its oldest item moves (InMemoryStore keeps the order of
first use, even of emptied namespaces); dotted filter keys reach nested fields.
TTL: an expired item is never returned; reads
refresh a TTL (``refresh_ttl``, default ``TTLConfig["refresh_on_read"]``, else True);
expired rows are deleted by every write batch, :meth:`KVMemStore.sweep_ttl`, and the
optional sweeper thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
from langgraph.store.base import (
    BaseStore,
    Embeddings,
    GetOp,
    IndexConfig,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
    ensure_embeddings,
    get_text_at_path,
    tokenize_path,
)
from sqlalchemy import Row, delete, func, or_, select, true, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql.elements import ColumnElement

import kvmem
from kvmem.catalog.schema import langgraph_items as items
from kvmem.catalog.schema import langgraph_vectors as vectors
from kvmem.errors import ConfigError, TierUnavailable
from langchain_kvmem._filters import does_match, matches

if TYPE_CHECKING:
    from kvmem.semantic import Embedder

__all__ = ["KVMemEmbeddings", "KVMemStore"]

log = logging.getLogger(__name__)

_ItemKey = tuple[tuple[str, ...], str]


@dataclass
class _Batch:
    """A batch's ops by kind, with what it needs embedded (the only part that may run on the event loop)."""

    size: int
    gets: list[tuple[int, GetOp]] = field(default_factory=list)
    searches: list[tuple[int, SearchOp]] = field(default_factory=list)
    lists: list[tuple[int, ListNamespacesOp]] = field(default_factory=list)
    puts: dict[_ItemKey, PutOp] = field(default_factory=dict)  # the last put of a key wins
    texts: dict[str, list[tuple[_ItemKey, str]]] = field(default_factory=dict)  # text -> [(item, field)]
    queries: list[str] = field(default_factory=list)


class KVMemEmbeddings(Embeddings):
    """A kvmem :class:`~kvmem.semantic.Embedder` as LangChain ``Embeddings`` (unit vectors).

    Args:
        embedder: e.g. ``kvmem.semantic.SentenceTransformerEmbedder()`` or ``memory.semantic_index().embedder``
            (the latter caches vectors by text hash).
    """

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class KVMemStore(BaseStore):
    """A LangGraph store persisted in kvmem's catalog database (see the module docstring).

    Args:
        memory: whose database holds the items (default: kvmem's default memory).
        index: ``IndexConfig``: ``embed`` (a LangChain ``Embeddings``, a sync or async function
            of a list of texts, or a provider string; default: the memory's own embedder, the
            offline all-MiniLM-L6-v2 unless ``Memory(embedder=)`` says otherwise), ``dims``
            (its vector length; known for the default), ``fields`` to embed (default ``["$"]``,
            the whole value). Without ``index``, ``search(query=...)`` ignores the query.
        ttl: ``TTLConfig``: ``default_ttl`` minutes for puts, ``refresh_on_read``,
            ``sweep_interval_minutes`` for :meth:`start_ttl_sweeper`.

    Raises:
        ConfigError: ``index`` lacks ``dims``.
    """

    supports_ttl: bool = True

    def __init__(
        self, memory: kvmem.Memory | None = None, *, index: IndexConfig | None = None, ttl: TTLConfig | None = None
    ) -> None:
        self.memory = memory if memory is not None else kvmem.default_memory()
        self._database = self.memory.database
        stmt = self._database.insert(items)
        self._upsert = stmt.on_conflict_do_update(
            index_elements=[items.c.namespace, items.c.key],
            set_={name: stmt.excluded[name] for name in ("value", "updated_at", "expires_at", "ttl_minutes")},
        ).returning(items.c.id)
        self.index_config = dict(index) if index else None
        self.embeddings: Embeddings | None = None
        self.dims = 0
        self._fields: list[tuple[str, str | list[str]]] = []
        if self.index_config is not None:
            if self.index_config.get("embed") is None:  # loads the memory's embedder now
                self.index_config["embed"] = KVMemEmbeddings(self.memory.semantic_index().embedder)
                self.index_config.setdefault("dims", self.index_config["embed"].embedder.dim)
            if not self.index_config.get("dims"):
                raise ConfigError(f"index={index!r}: expected 'dims', the length of the vectors of 'embed'")
            self.dims = int(self.index_config["dims"])
            self.embeddings = ensure_embeddings(self.index_config["embed"])
            self._fields = [_path(p) for p in self.index_config.get("fields") or ["$"]]
        self.ttl_config = ttl
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()

    # -- BaseStore ------------------------------------------------------------------
    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops``: reads see the state before the batch's puts; results in the order of ``ops``."""
        batch = self._prepare(ops)
        docs = self.embeddings.embed_documents(list(batch.texts)) if batch.texts and self.embeddings else []
        queries = [self.embeddings.embed_query(q) for q in batch.queries] if self.embeddings else []
        return self._run(batch, docs, queries)

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch` without blocking the loop: embeddings awaited, database work in a worker thread."""
        batch = self._prepare(ops)
        docs: list[list[float]] = []
        queries: list[list[float]] = []
        if self.embeddings is not None:
            if batch.texts:
                docs = await self.embeddings.aembed_documents(list(batch.texts))
            queries = list(await asyncio.gather(*(self.embeddings.aembed_query(q) for q in batch.queries)))
        return await asyncio.to_thread(self._run, batch, docs, queries)

    # -- TTL ----------------------------------------------------------------------------
    def sweep_ttl(self) -> int:
        """Delete expired items (and their vectors) now; how many went."""
        with self._database.transaction() as conn:
            return self._sweep(conn, time.time())

    def start_ttl_sweeper(self, sweep_interval_minutes: float | None = None) -> concurrent.futures.Future[None]:
        """Run :meth:`sweep_ttl` every ``sweep_interval_minutes`` (default: ``ttl["sweep_interval_minutes"]``,
        else 5) in a daemon thread until :meth:`stop_ttl_sweeper`; the future resolves when it stops
        (cancelling it stops it too)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self._sweeper is not None and self._sweeper.is_alive():
            future.add_done_callback(lambda f: self._stop.set() if f.cancelled() else None)
            return future
        minutes = sweep_interval_minutes or (self.ttl_config or {}).get("sweep_interval_minutes") or 5
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(float(minutes) * 60):
                try:
                    swept = self.sweep_ttl()
                except OperationalError as exc:  # the database is away for now; the next round retries
                    log.warning("kvmem store: TTL sweep failed (%s)", exc)
                    continue
                if swept:
                    log.info("kvmem store: swept %d expired items", swept)
            if not future.done():
                future.set_result(None)

        self._sweeper = threading.Thread(target=loop, name="kvmem-store-ttl-sweeper", daemon=True)
        self._sweeper.start()
        future.add_done_callback(lambda f: self._stop.set() if f.cancelled() else None)
        return future

    def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        """Stop the sweeper thread; whether it is stopped (or never ran) within ``timeout`` seconds."""
        if self._sweeper is None or not self._sweeper.is_alive():
            return True
        self._stop.set()
        self._sweeper.join(timeout)
        return not self._sweeper.is_alive()

    def close(self) -> None:
        """Stop the sweeper (the memory, and its database, belong to the caller)."""
        self.stop_ttl_sweeper()

    # -- planning -----------------------------------------------------------------------
    def _prepare(self, ops: Iterable[Op]) -> _Batch:
        ops = list(ops)
        batch = _Batch(size=len(ops))
        for i, op in enumerate(ops):
            if isinstance(op, GetOp):
                _check_labels(op.namespace)
                batch.gets.append((i, op))
            elif isinstance(op, SearchOp):
                _check_labels(op.namespace_prefix)
                batch.searches.append((i, op))
            elif isinstance(op, ListNamespacesOp):
                for condition in op.match_conditions or ():
                    _check_labels(condition.path)
                batch.lists.append((i, op))
            elif isinstance(op, PutOp):
                if not op.namespace:
                    raise InvalidNamespaceError("Namespace cannot be empty.")
                _check_labels(op.namespace)
                batch.puts[(tuple(op.namespace), str(op.key))] = op
            else:
                raise TypeError(f"Unknown operation type: {type(op)}")
        if self.embeddings is not None:
            batch.texts = self._texts(batch.puts)
            batch.queries = list(dict.fromkeys(op.query for _, op in batch.searches if op.query))
        return batch

    def _texts(self, puts: dict[_ItemKey, PutOp]) -> dict[str, list[tuple[_ItemKey, str]]]:
        """Texts to embed, each once, with the (item, field) pairs that use it (fields named as InMemoryStore)."""
        texts: dict[str, list[tuple[_ItemKey, str]]] = {}
        for item_key, op in puts.items():
            if op.value is None or op.index is False:
                continue
            for path, tokens in self._fields if op.index is None else [_path(p) for p in op.index]:
                found = get_text_at_path(op.value, tokens)
                for i, text in enumerate(found):
                    texts.setdefault(text, []).append((item_key, f"{path}.{i}" if len(found) > 1 else path))
        return texts

    def _unit(self, vector: Sequence[float], what: str) -> np.ndarray:
        vec = np.asarray(vector, dtype=np.float32).reshape(-1)
        if vec.shape != (self.dims,):
            raise ValueError(f"embedding of {what} has {vec.shape[0]} floats: index dims is {self.dims}")
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    # -- execution (a worker thread under abatch) ------------------------------------------------
    def _run(self, batch: _Batch, docs: list[list[float]], queries: list[list[float]]) -> list[Result]:
        owned, query_vecs = self._vectors(batch, docs, queries)
        results: list[Result] = [None] * batch.size
        try:
            with self._database.connection() as conn:
                refresh = self._read(conn, batch, query_vecs, results)
            if refresh or batch.puts:
                with self._database.transaction() as conn:  # NOTE: writes first in this transaction: no stale snapshot
                    if refresh:
                        self._refresh(conn, sorted(refresh), time.time())
                    if batch.puts:
                        self._write(conn, batch.puts, owned, time.time())
        except OperationalError as exc:
            raise TierUnavailable(f"kvmem store: database {self._database.shown_url} failed: {exc.orig}") from exc
        return results

    def _vectors(
        self, batch: _Batch, docs: list[list[float]], queries: list[list[float]]
    ) -> tuple[dict[_ItemKey, list[tuple[str, np.ndarray]]], dict[str, np.ndarray]]:
        """The unit vectors of each put item's fields, and of each query."""
        if len(docs) != len(batch.texts) or len(queries) != len(batch.queries):
            raise ValueError(
                f"the embeddings returned {len(docs)} + {len(queries)} vectors for "
                f"{len(batch.texts)} texts + {len(batch.queries)} queries"
            )
        owned: dict[_ItemKey, list[tuple[str, np.ndarray]]] = {}
        for (text, users), vector in zip(batch.texts.items(), docs):
            unit = self._unit(vector, repr(text[:40]))
            for item_key, field_name in users:
                owned.setdefault(item_key, []).append((field_name, unit))
        return owned, {q: self._unit(v, f"query {q[:40]!r}") for q, v in zip(batch.queries, queries)}

    def _read(
        self, conn: Connection, batch: _Batch, query_vecs: dict[str, np.ndarray], results: list[Result]
    ) -> set[int]:
        """Fill ``results`` of the batch's reads; the ids of read items whose TTL is to be refreshed."""
        refresh: set[int] = set()
        now = time.time()
        for i, op in batch.gets:
            row = conn.execute(
                select(*_COLUMNS).where(
                    items.c.namespace == _ns_text(op.namespace), items.c.key == str(op.key), _live(now)
                )
            ).first()
            results[i] = None if row is None else _item(row)
            if row is not None and op.refresh_ttl and row.ttl_minutes is not None:
                refresh.add(row.id)
        for i, op in batch.searches:
            results[i], ids = self._search(conn, op, query_vecs.get(op.query or ""), now)
            if op.refresh_ttl:
                refresh.update(ids)
        for i, op in batch.lists:
            results[i] = _list_namespaces(conn, op, now)
        return refresh

    def _search(
        self, conn: Connection, op: SearchOp, query: np.ndarray | None, now: float
    ) -> tuple[list[SearchItem], list[int]]:
        """A search's page and the ids on it that have a TTL."""
        plain = query is None and not op.filter and min(op.offset, op.limit) >= 0
        stop = op.offset + op.limit if query is None and not plain and min(op.offset, op.limit) >= 0 else None
        found: list[tuple[Row[Any], list[bytes]]] = []
        for row, blobs in _candidates(
            conn, op.namespace_prefix, now, query is not None, (op.limit, op.offset) if plain else None
        ):
            if op.filter and not matches(row.value, op.filter):
                continue
            found.append((row, blobs))
            if stop is not None and len(found) >= stop:
                break  # unranked: the first offset+limit matches are all a page can use
        if plain:
            page = [(row, None) for row, _ in found]
        else:
            page = (_ranked(found, query) if query is not None else [(row, None) for row, _ in found])[
                op.offset : op.offset + op.limit
            ]
        return (
            [_search_item(row, score) for row, score in page],
            [row.id for row, _ in page if row.ttl_minutes is not None],
        )

    def _write(
        self,
        conn: Connection,
        puts: dict[_ItemKey, PutOp],
        owned: dict[_ItemKey, list[tuple[str, np.ndarray]]],
        now: float,
    ) -> None:
        self._sweep(conn, now)  # also makes a put over an expired item a new item (new id, created_at)
        for (namespace, key), op in puts.items():
            where = (items.c.namespace == _ns_text(namespace), items.c.key == key)
            if op.value is None:
                conn.execute(delete(vectors).where(vectors.c.item_id.in_(select(items.c.id).where(*where))))
                conn.execute(delete(items).where(*where))
                self._keep(conn, [(_ns_text(namespace), key)])
                continue
            # created_at is kept by an update (documented as "first created"; InMemoryStore resets it)
            item_id = conn.execute(
                self._upsert,
                {
                    "namespace": _ns_text(namespace),
                    "key": key,
                    "value": dict(op.value),
                    "created_at": now,
                    "updated_at": now,
                    "expires_at": None if op.ttl is None else now + op.ttl * 60,
                    "ttl_minutes": op.ttl,
                },
            ).scalar_one()
            # the vectors describe the value: a put replaces them (index=False: none remain)
            conn.execute(delete(vectors).where(vectors.c.item_id == item_id))
            rows = [
                {"item_id": item_id, "field": name, "vector": vec.astype(np.float32).tobytes()}
                for name, vec in owned.get((namespace, key), [])
            ]
            if rows:
                conn.execute(vectors.insert(), rows)
            self._keep(conn, [(_ns_text(namespace), key)])

    def _refresh(self, conn: Connection, ids: list[int], now: float) -> None:
        """Push the expiry of the live items ``ids`` that have a TTL to ``now`` + their TTL."""
        for start in range(0, len(ids), 500):
            refreshed = conn.execute(
                update(items)
                .where(items.c.id.in_(ids[start : start + 500]), items.c.ttl_minutes.is_not(None), _live(now))
                .values(expires_at=now + items.c.ttl_minutes * 60)
                .returning(items.c.namespace, items.c.key)
            )
            self._keep(conn, [(row.namespace, row.key) for row in refreshed])

    def _sweep(self, conn: Connection, now: float) -> int:
        """Delete the items expired at ``now`` and their vectors; how many went.

        NOTE: a write first (DELETE .. RETURNING, not a SELECT before it): the transaction takes the
        write lock with its first statement, never a read snapshot another writer can make stale.
        """
        gone = conn.execute(
            delete(items).where(items.c.expires_at <= now).returning(items.c.id, items.c.namespace, items.c.key)
        ).all()
        for start in range(0, len(gone), 500):
            conn.execute(delete(vectors).where(vectors.c.item_id.in_([row.id for row in gone[start : start + 500]])))
        self._keep(conn, [(row.namespace, row.key) for row in gone])
        return len(gone)

    def _keep(self, conn: Connection, changed: Sequence[tuple[str, str]]) -> None:
        """Keep the items ``changed`` (namespace text, key) recoverable as ``conn`` sees them now (see the module
        docstring): call it after the change, in its transaction."""
        for namespace, key in changed:
            self._database.keep_row(conn, items, {"namespace": namespace, "key": key})


_COLUMNS = (
    items.c.id,
    items.c.namespace,
    items.c.key,
    items.c.value,
    items.c.created_at,
    items.c.updated_at,
    items.c.ttl_minutes,
)


def _candidates(
    conn: Connection, prefix: tuple[str, ...], now: float, with_vectors: bool, page: tuple[int, int] | None
) -> Iterator[tuple[Row[Any], list[bytes]]]:
    """Live items under ``prefix`` in store order, each with its vector blobs (when asked), streamed.

    Store order: namespaces by their oldest item, then items by id (creation).
    """
    first = func.min(items.c.id).over(partition_by=items.c.namespace)
    cols = (*_COLUMNS, vectors.c.vector) if with_vectors else _COLUMNS
    source = items.outerjoin(vectors, vectors.c.item_id == items.c.id) if with_vectors else items
    stmt = select(*cols).select_from(source).where(_under(prefix), _live(now)).order_by(first, items.c.id)
    if page is not None:
        stmt = stmt.limit(page[0]).offset(page[1])
    current: Row[Any] | None = None
    blobs: list[bytes] = []
    for row in conn.execute(stmt):
        if current is not None and row.id != current.id:
            yield current, blobs
            blobs = []
        current = row
        if with_vectors and row.vector is not None:
            blobs.append(row.vector)
    if current is not None:
        yield current, blobs


def _ranked(found: list[tuple[Row[Any], list[bytes]]], query: np.ndarray) -> list[tuple[Row[Any], float | None]]:
    """Items with vectors by their best cosine (ties in store order), then the others unscored."""
    owners = [i for i, (_, blobs) in enumerate(found) for _ in blobs]
    best = np.full(len(found), -np.inf, dtype=np.float32)
    if owners:
        matrix = np.frombuffer(b"".join(b for _, blobs in found for b in blobs), dtype=np.float32)
        np.maximum.at(best, np.asarray(owners), matrix.reshape(len(owners), -1) @ query)
    scored = sorted(dict.fromkeys(owners), key=lambda i: -float(best[i]))  # stable: ties in store order
    rest = [i for i, (_, blobs) in enumerate(found) if not blobs]
    return [(found[i][0], float(best[i])) for i in scored] + [(found[i][0], None) for i in rest]


def _list_namespaces(conn: Connection, op: ListNamespacesOp, now: float) -> list[tuple[str, ...]]:
    stmt = select(items.c.namespace).distinct().where(_live(now))
    for condition in op.match_conditions or ():
        if condition.match_type == "prefix":  # labels before the first wildcard narrow the query
            head = tuple(
                condition.path[: next((i for i, p in enumerate(condition.path) if p == "*"), len(condition.path))]
            )
            stmt = stmt.where(_under(head))
    namespaces = [_ns_tuple(text) for text in conn.execute(stmt).scalars()]
    namespaces = [ns for ns in namespaces if all(does_match(c, ns) for c in op.match_conditions or ())]
    if op.max_depth is not None:
        namespaces = sorted({ns[: op.max_depth] for ns in namespaces})
    else:
        namespaces = sorted(namespaces)
    return namespaces[op.offset : op.offset + op.limit]


def _live(now: float) -> ColumnElement[bool]:
    return or_(items.c.expires_at.is_(None), items.c.expires_at > now)


def _under(prefix: tuple[str, ...]) -> ColumnElement[bool]:
    """Namespaces equal to ``prefix`` or below it (label-wise: ``("a",)`` never matches ``("ab",)``)."""
    if not prefix:
        return true()
    text = _ns_text(prefix)
    # NOTE: substr, not LIKE: SQLite's LIKE ignores ASCII case, and "_"/"%" would need escaping
    return or_(items.c.namespace == text, func.substr(items.c.namespace, 1, len(text) + 1) == text + ".")


def _ns_text(namespace: Sequence[str]) -> str:
    return ".".join(namespace)


def _ns_tuple(text: str) -> tuple[str, ...]:
    return tuple(text.split(".")) if text else ()


def _check_labels(namespace: Sequence[str]) -> None:
    """The label rules of ``BaseStore`` (also for ops handed to :meth:`KVMemStore.batch` directly).

    NOTE: a "." in a label would let ``("a.b",)`` address ``("a", "b")`` in the joined column.
    """
    for label in namespace:
        if not isinstance(label, str) or not label or "." in label or "\x00" in label:
            raise InvalidNamespaceError(
                f"Invalid namespace label {label!r} in {namespace!r}: labels are non-empty strings without '.' or NUL"
            )


def _path(path: str) -> tuple[str, str | list[str]]:
    return (path, path) if path == "$" else (path, tokenize_path(path))


def _item(row: Row[Any]) -> Item:
    return Item(
        value=row.value,
        key=row.key,
        namespace=_ns_tuple(row.namespace),
        created_at=datetime.fromtimestamp(row.created_at, UTC),
        updated_at=datetime.fromtimestamp(row.updated_at, UTC),
    )


def _search_item(row: Row[Any], score: float | None) -> SearchItem:
    return SearchItem(
        _ns_tuple(row.namespace),
        row.key,
        row.value,
        datetime.fromtimestamp(row.created_at, UTC),
        datetime.fromtimestamp(row.updated_at, UTC),
        score,
    )
