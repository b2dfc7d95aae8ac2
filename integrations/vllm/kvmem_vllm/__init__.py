"""kvmem as vLLM's KV connector: ``kv_connector="KVMemConnector", kv_connector_module_path="kvmem_vllm"``."""

from kvmem_vllm.connector import KVMemConnector

__all__ = ["KVMemConnector"]
