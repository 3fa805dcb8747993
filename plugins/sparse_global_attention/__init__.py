"""Sparse global-KV attention: each query reads its window (local table) and its top-k global entries plus a sink."""

from plugins.sparse_global_attention.op import sparse_global_attention

__all__ = ["sparse_global_attention"]
