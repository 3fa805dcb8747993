"""The three routers behind one interface (MoL, Contextual MoL, MoL2) on a tiny random network and tokenizer."""

from __future__ import annotations

import random
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from build_engines.routing.baselines import (
    ContextualExample,
    ContextualMoLRouter,
    MoL2Router,
    MoLRouter,
    Router,
    RoutingError,
    parse_choice,
    user_turn_h19,
)
from ced.conversation import Conversation, DecoderSession
from ced.lora import Adapter, AdapterBank, decoder_lora_modules, random_adapter_weights
from ced.model.network import CEDNetwork
from ced.model.state import HandOver
from ced.routing.pointer_head import PointerHead, RouterConfig, pool_h19
from ced.text.tokenizer import ChatTokenizer, Message, train_tokenizer
from tests.tiny import tiny_config, tiny_network

SENTENCES = [
    "chats casually in everyday conversation: small talk, feelings and opinions",
    "uses command-line tools: shell commands with their options and flags",
    "writes, reads and explains Python source code: functions, classes, imports",
    "styles and marks up web pages: CSS rules, selectors, colours and layout",
    "answers questions about the weather, travel plans and the news of the day",
    "translates short sentences between English and French, 1) 2) 3) 4) 5) 6)",
    "hey, how are you doing today? list the files in this folder with ls -la",
    "def add(a, b): return a + b  # a small function; body { color: red; }",
] * 3
OPTIONS = [
    "chats casually in everyday conversation",
    "uses command-line tools and shell commands",
    "writes and explains Python source code",
    "styles web pages with CSS and HTML",
    "answers questions about the weather",
    "translates sentences between languages",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return train_tokenizer(SENTENCES, 300, Path(tmp_path_factory.mktemp("tok")) / "tokenizer.json")


@pytest.fixture(scope="module")
def model(tokenizer: ChatTokenizer) -> tuple[CEDNetwork, object, object, Adapter]:
    torch.manual_seed(1234)
    net = tiny_network(tiny_config(vocab_size=tokenizer.vocab_size))
    enc, dec = net.split()
    enc.eval(), dec.eval()
    AdapterBank(net.cfg, dec).attach(dec)
    mods = decoder_lora_modules(net.cfg, net)
    l0 = Adapter("L0_chat", "adapters/L0_chat", 4, 8.0,
                 random_adapter_weights(mods, 4, std=0.05, generator=torch.Generator().manual_seed(5)), "test")
    return net, enc, dec, l0


def _conversation(model, tokenizer: ChatTokenizer, query: str,  # type: ignore[no-untyped-def]
                  history_turns: int = 2) -> tuple[Conversation, list[int], HandOver]:
    """A conversation with a replayed earlier turn (non-empty adapter rings) and the new user turn encoded."""
    net, enc, dec, l0 = model
    conv = Conversation(enc, dec)
    history = [Message("user" if i % 2 == 0 else "assistant", SENTENCES[i]) for i in range(history_turns)]
    conv.extend(torch.tensor([tokenizer.chat(history, add_generation_prompt=False)]))
    out = conv.replay(l0)
    conv.step(torch.tensor([[int(out.logits[0, -1].argmax())]]))  # a decoded token: rings hold adapter state
    query_ids = tokenizer.turn(Message("user", query), generation_prompt=True)
    handover = conv.extend(torch.tensor([query_ids]))
    return conv, query_ids, handover


def _snapshot(conv: Conversation):  # type: ignore[no-untyped-def]
    """Deep copies of every tensor of the conversation (a fork would share tensors an in-place bug could change)."""
    d = conv.decoder
    snap = DecoderSession.__new__(DecoderSession)
    snap.__dict__.update(d.__dict__)
    snap.sources = d.sources.clone()
    snap.recent = (HandOver(*(getattr(d.recent, f.name).clone() for f in fields(HandOver))) if d.recent is not None
                   else None)
    rings = {k: r.clone() for k, r in d.rings.items()}
    return conv.encoder_state.clone(), snap, rings, d.adapter, conv.position


def _assert_unchanged(conv: Conversation, snap) -> None:  # type: ignore[no-untyped-def]
    enc_state, dec_snap, rings, adapter, position = snap
    assert conv.position == position
    assert conv.encoder_state.equal(enc_state), "the encoder state changed"
    assert conv.decoder.shared_equal(dec_snap), "the decoder's shared state (mirror, rows) changed"
    assert conv.decoder.adapter is adapter
    assert rings.keys() == conv.decoder.rings.keys()
    assert all(torch.equal(r.kv, conv.decoder.rings[k].kv) and torch.equal(r.pos, conv.decoder.rings[k].pos)
               for k, r in rings.items())


def _routers(model, tokenizer: ChatTokenizer) -> list[Router]:  # type: ignore[no-untyped-def]
    net, enc, dec, l0 = model
    return [
        MoLRouter(tokenizer, l0, max_label_tokens=6),
        ContextualMoLRouter(enc, tokenizer, width=16),
        MoL2Router.from_model("/nonexistent", net.embed.weight, tokenizer),
    ]


@pytest.mark.parametrize("n_options", [2, 3, 4, 5, 6])
def test_every_router_picks_a_valid_option_and_leaves_the_conversation_untouched(  # type: ignore[no-untyped-def]
        model, tokenizer: ChatTokenizer, n_options: int) -> None:
    conv, query_ids, _ = _conversation(model, tokenizer, "list the files in this folder with ls -la")
    snap = _snapshot(conv)
    options = random.Random(n_options).sample(OPTIONS, n_options)
    for router in _routers(model, tokenizer):
        first = router.timed(conv, query_ids, options)
        assert 0 <= first.index < n_options and first.seconds > 0, router.name
        assert router.decide(conv, query_ids, options) == first.index, f"{router.name} is not deterministic"
        _assert_unchanged(conv, snap)
    # the conversation continues exactly as if no router had run
    net, enc, dec, l0 = model
    twin, _, _ = _conversation(model, tokenizer, "list the files in this folder with ls -la")
    a, b = conv.replay(l0).logits, twin.replay(l0).logits
    assert torch.equal(a, b)


def test_mol_router_parses_labels_and_falls_back_to_number_logits(model, tokenizer: ChatTokenizer) -> None:  # type: ignore[no-untyped-def]
    assert parse_choice("I pick 7, no: option 2) because", 4) == 1
    assert parse_choice("0 then 12 then 3", 4) == 2
    assert parse_choice("no digits here", 4) is None
    conv, query_ids, _ = _conversation(model, tokenizer, "hey, how are you doing today?")
    router = MoLRouter(tokenizer, model[3])  # default 24-token budget
    index, info = router.decide_info(conv, query_ids, OPTIONS[:4])
    assert 0 <= index < 4 and 0 <= info["label_tokens"] <= 24
    prompt = tokenizer.decode(router.prompt_ids(OPTIONS[:4])[0])
    assert ("1) " + OPTIONS[0] in prompt and "4) " + OPTIONS[3] in prompt
            and prompt.rstrip().endswith("Answer with the number."))
    if not info["parsed"]:  # an untrained adapter rarely writes a number: the fallback must be the number-logit argmax
        fork = conv.fork()
        ids, numbers = router.prompt_ids(OPTIONS[:4])
        fork.extend(torch.tensor([ids]))
        first = fork.replay(model[3]).logits[0, -1]
        assert index == int(first[torch.tensor(numbers)].argmax())


def test_mol2_reads_the_user_turn_h19_and_caches_the_option_side(model, tokenizer: ChatTokenizer) -> None:  # type: ignore[no-untyped-def]
    net = model[0]
    conv, query_ids, handover = _conversation(model, tokenizer, "def add(a, b): return a + b")
    expected = pool_h19(handover.encoder_out)[0]
    assert torch.equal(user_turn_h19(conv, len(query_ids)), expected)
    router = MoL2Router.from_model("/nonexistent", net.embed.weight, tokenizer)
    assert not router.trained
    cached = router.option_side(OPTIONS)
    assert router.option_side(list(OPTIONS)) is cached, "the option side is computed once per option list"
    fresh = router.compute_option_side(OPTIONS)
    for name in ("tokens", "padding", "keys"):
        assert torch.equal(getattr(cached, name), getattr(fresh, name))
    from_conv = router.decide(conv, query_ids, OPTIONS)
    assert (from_conv == router.decide(conv, query_ids, OPTIONS, h19=expected)
            == router.decide(conv, query_ids, OPTIONS, h19=handover.encoder_out))
    assert from_conv == int(router.head.score(expected[None], fresh).argmax())
    with pytest.raises(RoutingError):
        router.decide(conv, query_ids, OPTIONS, h19=torch.zeros(2, 3, 4))


def test_mol2_loads_a_saved_head(model, tokenizer: ChatTokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    net = model[0]
    head = PointerHead(RouterConfig.for_model(net.cfg.dim))
    head.save(tmp_path / "router")
    router = MoL2Router.from_model(tmp_path, net.embed.weight, tokenizer)
    assert router.trained
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), router.head.state_dict().values()))


def test_contextual_features_match_decide_on_a_fresh_conversation(model, tokenizer: ChatTokenizer) -> None:  # type: ignore[no-untyped-def]
    net, enc, dec, l0 = model
    router = ContextualMoLRouter(enc, tokenizer, width=16)
    query_ids = tokenizer.turn(Message("user", "body { color: red; }"), generation_prompt=True)
    conv = Conversation(enc, dec)
    conv.extend(torch.tensor([[tokenizer.bos_id, *query_ids]]))
    ex = router.features(query_ids, OPTIONS[:3], 1)
    torch.testing.assert_close(ex.query, user_turn_h19(conv, len(query_ids)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ex.keys, router.option_keys(conv, OPTIONS[:3]), rtol=1e-5, atol=1e-5)


def test_contextual_fit_reduces_the_loss_on_a_separable_set(model, tokenizer: ChatTokenizer) -> None:  # type: ignore[no-untyped-def]
    net, enc, dec, l0 = model
    router = ContextualMoLRouter(enc, tokenizer, width=16, seed=3)
    rng = random.Random(0)
    queries = {0: ["hey, how are you doing today?", "small talk and feelings, how are you"],
               1: ["list the files with ls -la", "shell commands with options and flags"]}
    examples = []
    for _ in range(6):
        for label, texts in queries.items():
            options = [OPTIONS[0], OPTIONS[1]]
            swap = rng.random() < 0.5
            if swap:
                options.reverse()
            examples.append((tokenizer.turn(Message("user", rng.choice(texts)), generation_prompt=True), options,
                             (1 - label) if swap else label))
    data = router.featurize(examples)
    assert all(isinstance(e, ContextualExample) for e in data)
    before = router.loss(data)
    history = router.fit(data, epochs=60, lr=1e-2, batch=4)
    after = router.loss(data)
    assert after < 0.5 * before and history[-1] < history[0]
    accuracy = sum(int(router.head(e.query[None], e.keys).argmax()) == e.answer for e in data) / len(data)
    assert accuracy == 1.0


def test_offline_h19_with_history_equals_the_serving_path(model, tokenizer: ChatTokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Router training features for a later turn (history prefix, one batched pass) are what serving pools from a
    conversation absorbed message by message, so the head trains on the query side it will see."""
    from build_engines.routing.train import extract_h19, query_ids, synthetic_histories

    _, enc, dec, _ = model
    queries = ["list the files in this folder with ls -la", "def add(a, b): return a + b", "body { color: red; }"]
    histories = synthetic_histories(len(queries), SENTENCES, seed=3)
    assert histories != synthetic_histories(len(queries), SENTENCES, seed=4)
    assert histories == synthetic_histories(len(queries), SENTENCES, seed=3)
    offline = extract_h19(enc, tokenizer, queries, tmp_path, "digest", histories=histories)
    fresh = extract_h19(enc, tokenizer, queries, tmp_path, "digest")
    assert len(list(tmp_path.glob("h19_*.npy"))) == 2  # history and first-turn features cached under different keys
    for i, (query, history) in enumerate(zip(queries, histories)):
        conv = Conversation(enc, dec)
        conv.extend(torch.tensor([[tokenizer.bos_id]]))
        for message in history:
            conv.extend(torch.tensor([tokenizer.turn(message)]))
        prefix, turn = query_ids(tokenizer, query, history)
        assert prefix == tokenizer.chat(history, add_generation_prompt=False)
        handover = conv.extend(torch.tensor([turn]))
        served = pool_h19(handover.encoder_out)[0]
        torch.testing.assert_close(torch.from_numpy(offline[i]), served, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(torch.from_numpy(fresh[i]), served, atol=1e-3)  # the history does change H19
