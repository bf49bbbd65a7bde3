"""Prototype of vllm_prove.engine (lives only under /tmp/proto)."""
