"""Each API key has its own partition of the server's prefix cache: the frontend sends a salt derived from the key
(never the key), so a tenant's second conversation on a shared document takes it from the cache and another tenant's
does not, whatever the timing would tell (the counters show it)."""

from __future__ import annotations

import pytest

from openai_frontend.prefix_cache import cache_salt_of, namespace_of
from tests.openai_frontend.conftest import TENANT_KEYS, server_counter

pytestmark = pytest.mark.slow

DOCUMENT = "\n".join(f"Rule {i}: a card of width {i * 3} rem keeps a padding of {i % 5} rem and a gap of 1 rem."
                     for i in range(40))


def partition_counts(triton) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return (server_counter(triton, "prefix_cache_hits", "partition", "salted"),
            server_counter(triton, "prefix_cache_misses", "partition", "salted"))


def test_a_salt_is_a_digest_of_the_key_and_none_without_keys() -> None:
    salt = cache_salt_of(namespace_of(TENANT_KEYS[0]))
    assert salt and len(salt) == 32 and TENANT_KEYS[0] not in salt and salt != cache_salt_of(namespace_of("other"))
    assert cache_salt_of("") is None


def test_each_api_key_has_its_own_prefix_cache_partition(keyed_frontend, triton) -> None:  # type: ignore[no-untyped-def]
    import openai

    a, b = (openai.OpenAI(base_url=keyed_frontend.base_url, api_key=key, max_retries=0, timeout=120)
            for key in TENANT_KEYS)
    hits, misses = partition_counts(triton)
    try:
        for client, question in ((a, "Which rule has width 9?"), (a, "Which rule has padding 2?"),
                                 (b, "Which rule has width 12?")):
            client.chat.completions.create(model="mol2", max_tokens=2,
                                           messages=[{"role": "user", "content": f"{DOCUMENT}\n{question}"}])
    finally:
        a.close()
        b.close()
    after_hits, after_misses = partition_counts(triton)
    assert after_hits - hits == 1, "tenant A's second conversation should take the document from the cache"
    assert after_misses - misses == 2, "tenant A's first and tenant B's conversation start cold"
