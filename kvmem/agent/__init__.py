"""Agent memory: ReAct steps as a persistent, verified hash chain, with per-step KV reuse.

See :class:`AgentSession`. The chain lives in the catalog database (:mod:`kvmem.agent.chain`).
"""

from kvmem.agent.chain import Step
from kvmem.agent.session import AgentSession
from kvmem.errors import SessionConflict, SessionNotFound

__all__ = ["AgentSession", "SessionConflict", "SessionNotFound", "Step"]
