"""Tests of the text KV prefix cache (``kvmem.kv``) on tiny real transformers models."""
