"""The conversation-prefix cache: exact keys (whatever the model id), exclusive claims, the byte budget."""

from __future__ import annotations

from openai_frontend.prefix_cache import Entry, PrefixCache, prefix_key
from openai_frontend.session_cost import SessionCost
from tests.tiny import PROJECT_ROOT


def test_keys_separate_any_change_of_the_messages() -> None:
    conv = (("user", "hi"), ("assistant", "hello"))
    assert prefix_key(conv) == prefix_key(tuple(conv))
    assert prefix_key(conv) != prefix_key((("user", "hi"), ("assistant", "hello ")))
    assert prefix_key(conv) != prefix_key((("system", "hi"), ("assistant", "hello")))


def test_take_claims_a_session_once() -> None:
    cache = PrefixCache(10**9, SessionCost(100, 10.0))
    cache.put("k", Entry("s1", 5))
    assert cache.take("k") == Entry("s1", 5)
    assert cache.take("k") is None, "a second request resending the same prefix must not share the session"
    assert cache.nbytes == 0 and len(cache) == 0


def test_budget_evicts_least_recently_used_by_session_bytes() -> None:
    cost = SessionCost(1000, 10.0)
    cache = PrefixCache(cost.bytes(100) * 2, cost)
    cache.put("a", Entry("sa", 100))
    cache.put("b", Entry("sb", 100))
    assert cache.put("c", Entry("sc", 50)) == [Entry("sa", 100)]
    assert cache.take("a") is None and cache.take("b") is not None
    assert cache.nbytes == cost.bytes(50)


def test_session_cost_of_the_embedded_default_grows_with_tokens() -> None:
    cost = SessionCost.of_model(PROJECT_ROOT / "embedded" / "mol2-small")
    assert cost.fixed > 0 and cost.per_token > 0 and cost.bytes(1000) > cost.bytes(10)
