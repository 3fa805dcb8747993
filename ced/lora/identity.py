"""An adapter's identity: the 31-bit FNV-1a hash of its path, kept free of torch so serving processes that only
name adapters (the registry, preprocess) do not load PyTorch."""

from __future__ import annotations


def adapter_hash(path: str) -> int:
    """31-bit FNV-1a of the adapter path (UTF-8); 0 is reserved for the base model.

    This is the identity that travels as the INT32 `ADAPTER_HASH` tensor from router to decoder.
    """
    h = 0x811C9DC5
    for byte in path.encode("utf-8"):
        h ^= byte
        h = (h * 0x01000193) & 0xFFFFFFFF
    h &= 0x7FFFFFFF
    return h or 1
