"""LangChain and LangGraph integrations for kvmem.

- :class:`KVMemStore`: a LangGraph ``BaseStore`` (long-term memory) in kvmem's catalog database; semantic search
  with kvmem's embedder (:class:`KVMemEmbeddings`), exact cosine over the searched namespaces' vectors;
- :class:`KVMemCache`: a LangChain LLM cache, exact by prompt and model, optionally semantic;
- :class:`KVMemSaver`: a LangGraph checkpointer (short-term memory: every step of every thread), its values
  CRC-checked kvmem blobs stored once each, its thread index in kvmem's catalog database;
- :class:`ChatTransformersKV`: a chat model over a local transformers causal LM whose prompts are prefilled
  through kvmem's ``PrefixCache`` (each agent step computes only what the step before did not);
- :class:`KVMemByteStore`: a LangChain ``ByteStore`` (e.g. for ``CacheBackedEmbeddings``);
- :class:`KVMemChatMessageHistory`: a legacy chat-history shim over kvmem agent sessions.
"""

from langchain_kvmem._chat_format import UnsupportedMessage
from langchain_kvmem.bytestore import KVMemByteStore
from langchain_kvmem.cache import KVMemCache
from langchain_kvmem.chat import ChatTransformersKV
from langchain_kvmem.history import KVMemChatMessageHistory
from langchain_kvmem.saver import CheckpointCorrupt, KVMemSaver
from langchain_kvmem.store import KVMemEmbeddings, KVMemStore

__all__ = [
    "ChatTransformersKV",
    "CheckpointCorrupt",
    "KVMemByteStore",
    "KVMemCache",
    "KVMemChatMessageHistory",
    "KVMemEmbeddings",
    "KVMemSaver",
    "KVMemStore",
    "UnsupportedMessage",
]
