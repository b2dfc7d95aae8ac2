"""``AgentSession``: a ReAct agent's steps as a persistent hash chain, with per-step KV reuse.

Appending moves the session's head by compare-and-swap in the catalog
database: two writers racing on one session never interleave; the loser gets
:class:`~kvmem.errors.SessionConflict` and may resume or fork. With a model
attached, :meth:`AgentSession.prefill` runs the next prompt through a
:class:`~kvmem.kv.PrefixCache`: the prompt is tokenized piece by piece (system
prompt, then each step), so every step's prompt is a token-exact prefix of the
next one and every full chunk before the new step is loaded, not computed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

import torch
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError as SqlIntegrityError

from kvmem.agent.chain import Step, create_session, delete_session, link, make_step, read_chain, sessions, sweep
from kvmem.errors import ConfigError, InvalidKeyError, SessionConflict, SessionNotFound

if TYPE_CHECKING:
    from kvmem.api import Memory
    from kvmem.kv import PrefillResult, PrefixCache

__all__ = ["AgentSession"]

Summarize = Callable[[list[Step]], str]


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise InvalidKeyError(f"session name {name!r:.80}: expected a str of 1 to 256 characters")
    return name


class AgentSession:
    """One agent's steps, stored as a verified hash chain shared by every process on the catalog.

    Args:
        name: the session's name; an existing session is opened, a new one created.
        memory: whose catalog database holds the session (default: the module's default memory).
        system_prompt: the prompt's first part; for an existing session it must match (or be None).
        max_steps: the most steps the context holds; past it the oldest are folded away, down
            to ``max_steps // 2`` (in batches, so the prompt's start, and its cached KV,
            changes once per ``max_steps // 2`` appends, not at every one).
        ttl: seconds a step stays in the context; older ones are folded away at the next append.
        summarize: folded steps -> the text of one summary step that replaces them (default:
            they are dropped).
        clock: seconds since the epoch (tests pass a fake one).

    Raises:
        InvalidKeyError: a bad name.
        ConfigError: bad retention settings, or a system prompt that differs from the stored one.
        IntegrityError: a stored step is missing, corrupt or altered (the message names it).
    """

    def __init__(
        self,
        name: str,
        memory: Memory | None = None,
        *,
        system_prompt: str | None = None,
        max_steps: int | None = None,
        ttl: float | None = None,
        summarize: Summarize | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from kvmem.api import default_memory

        self.name = _check_name(name)
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 2):
            raise ConfigError(f"max_steps={max_steps!r}: expected an int >= 2, or None for no window")
        if ttl is not None and not ttl > 0:
            raise ConfigError(f"ttl={ttl!r}: expected seconds > 0, or None for no expiry")
        self.memory = memory if memory is not None else default_memory()
        self.max_steps, self.ttl, self.summarize, self.clock = max_steps, ttl, summarize, clock
        self._database = self.memory.database
        self._lock = threading.Lock()
        self._prefix: PrefixCache | None = None
        self._tokenizer: Any = None
        self._ids: dict[str, list[int]] = {}  # token ids per prompt piece (step key, or "" for the system)
        if self._row() is None:
            try:
                create_session(self._database, name, None, 0, system_prompt or "", clock())
            except SqlIntegrityError:
                pass  # created by another process meanwhile: opened below
        self._reload(system_prompt)

    @classmethod
    def resume(cls, name: str, memory: Memory | None = None, **options: Any) -> AgentSession:
        """The stored session ``name``, its chain verified step by step.

        Raises:
            SessionNotFound: no session of that name.
            IntegrityError: a stored step is missing, corrupt or altered (the message names it).
        """
        from kvmem.api import default_memory

        mem = memory if memory is not None else default_memory()
        with mem.database.connection() as conn:
            found = conn.execute(select(sessions.c.name).where(sessions.c.name == _check_name(name))).first()
        if found is None:
            raise SessionNotFound(f"no agent session {name!r}; AgentSession({name!r}, ...) creates it")
        return cls(name, mem, **options)

    def _row(self) -> Any:
        with self._database.connection() as conn:
            return conn.execute(select(sessions).where(sessions.c.name == self.name)).first()

    def _reload(self, system_prompt: str | None = None) -> None:
        with self._database.connection() as conn:
            row = conn.execute(select(sessions).where(sessions.c.name == self.name)).first()
            if row is None:
                raise SessionNotFound(f"agent session {self.name!r} was deleted")
            chain = read_chain(conn, row.head, row.length, self.name)
        if system_prompt is not None and system_prompt != row.system:
            raise ConfigError(
                f"session {self.name!r} exists with another system prompt; open it with "
                "system_prompt=None, or fork it under a new name"
            )
        self.system_prompt: str = row.system
        self._steps, self._head = chain, row.head

    # -- reading -------------------------------------------------------------------------
    @property
    def steps(self) -> list[Step]:
        """The steps in order (a copy)."""
        return list(self._steps)

    @property
    def head(self) -> str | None:
        """The last step's key: it names the whole history (None while empty)."""
        return self._head

    def __len__(self) -> int:
        return len(self._steps)

    def context(self) -> str:
        """The prompt text the next model call sees: the system prompt, then every step."""
        return self._system_text() + "".join(step.text() for step in self._steps)

    def _system_text(self) -> str:
        return f"{self.system_prompt}\n\n" if self.system_prompt else ""

    # -- writing -------------------------------------------------------------------------
    def append_step(self, thought: str, action: str = "", observation: str = "") -> Step:
        """Store one step after the current head, then apply the retention settings.

        Raises:
            SessionConflict: another writer appended since this object last saw the head.
            InvalidKeyError: a field that is not a str.
        """
        for field, value in (("thought", thought), ("action", action), ("observation", observation)):
            if not isinstance(value, str):
                raise InvalidKeyError(f"{field} of type {type(value).__name__}: expected a str")
        with self._lock:
            step, body = make_step(len(self._steps), self._head, thought, action, observation, created=self.clock())
            if not link(
                self._database,
                self.name,
                self._head,
                [(step.key, step.parent_key, body)],
                step.key,
                len(self._steps) + 1,
            ):
                raise self._conflict()
            self._steps.append(step)
            self._head = step.key
            self._retain()
        return step

    def _conflict(self) -> SessionConflict:
        return SessionConflict(
            f"session {self.name!r} moved on: another writer changed it after step "
            f"{len(self._steps) - 1}; AgentSession.resume({self.name!r}) continues from its "
            "head, fork() keeps this branch under a new name"
        )

    def _retain(self) -> None:
        """Fold the steps the window or the TTL leave out into a summary (or drop them)."""
        steps = self._steps
        cut = 0
        if self.ttl is not None:
            limit = self.clock() - self.ttl
            while cut < len(steps) and steps[cut].created < limit:
                cut += 1
        if self.max_steps is not None and len(steps) > self.max_steps:
            cut = max(cut, len(steps) - self.max_steps // 2)
        if cut == 0:
            return
        folded, kept = steps[:cut], steps[cut:]
        rows: list[tuple[str, str | None, bytes]] = []
        chain: list[Step] = []
        parent: str | None = None
        if self.summarize is not None:
            step, body = make_step(0, None, self.summarize(folded), "", "", kind="summary", created=self.clock())
            rows.append((step.key, None, body))
            chain.append(step)
            parent = step.key
        for old in kept:  # same content, a new parent: new keys (the chain's start changed)
            step, body = make_step(
                len(chain), parent, old.thought, old.action, old.observation, old.kind, created=old.created
            )
            rows.append((step.key, parent, body))
            chain.append(step)
            parent = step.key
        if not link(self._database, self.name, self._head, rows, parent, len(chain)):
            raise self._conflict()
        self._steps, self._head = chain, parent
        sweep(self._database)

    def fork(self, name: str, at: int | None = None) -> AgentSession:
        """A new session ``name`` sharing steps ``0..at`` (default: all), stored once; the two then diverge.

        Raises:
            ConfigError: ``at`` out of range, or a session ``name`` exists already.
        """
        at = len(self._steps) - 1 if at is None else at
        if isinstance(at, bool) or not isinstance(at, int) or not -1 <= at < len(self._steps):
            raise ConfigError(f"at={at!r}: expected a step index from -1 (no step) to {len(self._steps) - 1}")
        head = self._steps[at].key if at >= 0 else None
        try:
            create_session(self._database, _check_name(name), head, at + 1, self.system_prompt, self.clock())
        except SqlIntegrityError:
            raise ConfigError(f"fork name {name!r}: a session of that name exists; pick another") from None
        return AgentSession(
            name, self.memory, max_steps=self.max_steps, ttl=self.ttl, summarize=self.summarize, clock=self.clock
        )

    def delete(self) -> int:
        """Delete this session; steps another session still reaches stay. How many steps went."""
        delete_session(self._database, self.name)
        self._steps, self._head = [], None
        return sweep(self._database)

    # -- model ---------------------------------------------------------------------------
    def attach(
        self, model: torch.nn.Module, tokenizer: Any, *, block_size: int | None = None, compression: str | None = None
    ) -> None:
        """Prefill through a :class:`~kvmem.kv.PrefixCache` of ``model`` from now on.

        Args:
            model: a transformers causal LM.
            tokenizer: anything with ``encode(text) -> list[int]`` (an HF tokenizer: special
                tokens are not added per piece; its BOS, if any, starts the prompt once).
            block_size: as in :class:`~kvmem.kv.PrefixCache` (default: the memory's, 256 tokens).
                Agent steps are often shorter than 256 tokens, and each prefill recomputes the
                partial chunk after the last full one: 64 reuses more (``benchmarks/bench_agent.py``:
                9.5x at step 20 against 6.0x).
            compression: as in :class:`~kvmem.kv.PrefixCache` (default: the memory's, ``fp16``).
                ``compression="none"`` keeps an fp32 model's KV exact.
        """
        from kvmem.kv import PrefixCache

        self._prefix = PrefixCache(model, self.memory, block_size=block_size, compression=compression)
        self._tokenizer = tokenizer
        self._ids.clear()

    def flush(self) -> None:
        """Wait until the chunks of every prefill so far are stored (they are written in the background)."""
        if self._prefix is not None:
            self._prefix.flush()

    def close(self) -> None:
        """Store pending chunks and stop the attached model's background writer. Idempotent."""
        if self._prefix is not None:
            self._prefix.close()
            self._prefix = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _encode(self, text: str) -> list[int]:
        try:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        except TypeError:  # a plain tokenizer without the HF keyword
            return list(self._tokenizer.encode(text))

    def prompt_ids(self, suffix: str = "") -> torch.Tensor:
        """Token ids of :meth:`context` + ``suffix``, tokenized piece by piece (each step's prompt
        is a prefix of the next one's), ``[n]`` int64.

        Raises:
            ConfigError: no tokenizer attached.
        """
        if self._tokenizer is None:
            raise ConfigError(f"session {self.name!r}: attach(model, tokenizer) first")
        bos = getattr(self._tokenizer, "bos_token_id", None)
        ids: list[int] = [bos] if isinstance(bos, int) else []
        for piece_key, text in [("", self._system_text()), *((s.key, s.text()) for s in self._steps)]:
            piece = self._ids.get(piece_key)
            if piece is None:
                piece = self._ids[piece_key] = self._encode(text)
            ids += piece
        return torch.tensor(ids + (self._encode(suffix) if suffix else []), dtype=torch.long)

    def prefill(self, suffix: str = "") -> PrefillResult:
        """Run the attached model on :meth:`prompt_ids` with every stored chunk of its KV loaded.

        Returns only the last position's logits (what the next token needs); new full
        chunks are stored in the background for the next step.

        Raises:
            ConfigError: no model attached.
        """
        if self._prefix is None:
            raise ConfigError(f"session {self.name!r}: attach(model, tokenizer) first")
        return self._prefix.prefill(self.prompt_ids(suffix), logits_to_keep=1)
