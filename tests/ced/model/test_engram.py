"""Engram: bucket layout, hashing against a plain Python-int implementation of the release's definition, the token
map, the gate, and how it sits in the network (chunking, turns, engine split, replay, off = the previous network)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from ced.conversation import Conversation
from ced.lora import AdapterBank, decoder_lora_modules, random_adapter_weights, save_adapter
from ced.model.config import CEDConfig, ConfigError, is_prime
from ced.model.engram import (
    Engram,
    EngramHasher,
    EngramLayout,
    compressed_token_map,
    engram_table_rows,
    engram_token_map,
    gather_rows,
    token_key,
)
from ced.model.network import CEDNetwork, EncoderEngine
from ced.model.primitives import quantizes_input
from ced.model.state import SessionState
from tests.ced.model import test_network
from tests.tiny import PROJECT_ROOT, tiny_config, tiny_network

SHAPE = dict(engram_layers=(1, 2), engram_vocab_size=97, engram_max_ngram=4, engram_n_heads=2, engram_head_dim=32)
COMPRESSED = 300  # the tests' token map: id -> id * 7 % 300, so distinct tokens do collide as real normalising does
TOKENIZER_JSON = PROJECT_ROOT / "embedded" / "mol2-small" / "tokenizer.json"


def engram_config(**overrides: object) -> CEDConfig:
    shape = {**SHAPE, **{k: v for k, v in overrides.items() if k in SHAPE}}
    fields = dict(shape, engram_num_embeddings=engram_table_rows(SimpleNamespace(**shape)),
                  engram_compressed_vocab_size=COMPRESSED, engram_pad_id=2)
    fields.update(overrides)
    return tiny_config(**fields)


def token_map(cfg: CEDConfig) -> torch.Tensor:
    return torch.arange(cfg.vocab_size) * 7 % COMPRESSED


def engram_network(cfg: CEDConfig | None = None) -> CEDNetwork:
    net = tiny_network(cfg or engram_config())
    net.set_engram_token_map(token_map(net.cfg))
    return net


# ---------------------------------------------------------------------- an independent implementation of the definition

def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def naive_primes(n_layers: int, vocab: int, max_ngram: int, heads: int) -> list[list[list[int]]]:
    """For each layer, n-gram size, head: the next prime above the previous one (the group starts at vocab - 1) that no
    earlier bucket took."""
    seen: set[int] = set()
    out = []
    for _ in range(n_layers):
        layer = []
        for _ in range(max_ngram - 1):
            group, p = [], vocab - 1
            for _ in range(heads):
                p += 1
                while not _is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                group.append(p)
            layer.append(group)
        out.append(layer)
    return out


def naive_multipliers(layer: int, max_ngram: int, compressed: int) -> list[int]:
    bound = max(1, ((2**63 - 1) // compressed) // 2)
    drawn = np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64)
    return [int(v) * 2 + 1 for v in drawn]


def _wrap64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


def naive_hashes(tokens: list[int], cmap: list[int], cfg: CEDConfig) -> list[list[list[int]]]:
    """[position][engram layer][column] over one whole sequence, with Python ints."""
    K, heads = cfg.engram_max_ngram - 1, cfg.engram_n_heads
    primes = naive_primes(len(cfg.engram_layers), cfg.engram_vocab_size, cfg.engram_max_ngram, heads)
    c, pad = [cmap[t] for t in tokens], cmap[cfg.engram_pad_id]
    out = []
    for t in range(len(c)):
        looks, blocked = [], False
        for back in range(K + 1):
            blocked = blocked or t - back < 0
            looks.append(pad if blocked else c[t - back])
        per_layer = []
        for li, layer in enumerate(cfg.engram_layers):
            mult = naive_multipliers(layer, cfg.engram_max_ngram, cfg.engram_compressed_vocab_size)
            rolling, cols, offset = _wrap64(looks[0] * mult[0]), [], 0
            for n in range(2, K + 2):
                rolling ^= _wrap64(looks[n - 1] * mult[n - 1])
                for h in range(heads):
                    p = primes[li][n - 2][h]
                    cols.append(rolling % p + offset)
                    offset += p
            per_layer.append(cols)
        out.append(per_layer)
    return out


# ---------------------------------------------------------------------- layout

def test_primes_are_distinct_primes_above_the_start_in_order() -> None:
    cfg = engram_config()
    layout = EngramLayout.from_config(cfg)
    primes = [[list(g) for g in layer] for layer in layout.primes]
    assert primes == naive_primes(2, 97, 4, 2)
    flat = [p for layer in primes for g in layer for p in g]
    assert all(_is_prime(p) and p > cfg.engram_vocab_size - 1 for p in flat)
    assert len(set(flat)) == len(flat) == 2 * 3 * 2
    assert all(g == sorted(g) for layer in primes for g in layer), "heads take ascending primes within a group"
    assert primes[0][0] == [97, 101] and primes[0][1] == [103, 107], (
        "each group restarts at the start, skipping taken ones")


def test_primality_test_is_exact() -> None:
    assert [n for n in range(30000) if is_prime(n)] == [n for n in range(30000) if _is_prime(n)]
    carmichael_and_strong_pseudoprimes = [561, 1105, 1729, 2047, 3277, 4033, 25326001, 3215031751, 2152302898747]
    assert not any(is_prime(n) for n in carmichael_and_strong_pseudoprimes)
    assert is_prime(2**61 - 1) and not is_prime((2**31 - 1) * (2**61 - 1))


def test_offsets_and_table_rows() -> None:
    cfg = engram_config()
    layout = EngramLayout.from_config(cfg)
    for i in range(2):
        sizes = layout.flat_primes(i)
        assert layout.offsets(i) == [0] + list(np.cumsum(sizes[:-1]))
        assert layout.rows(i) == sum(sizes) == cfg.engram_num_embeddings[i]
    assert layout.n_cols == 6


def test_release_table_rows() -> None:
    """The release's config.json states its rows; our layout derives them from the other four keys."""
    release = SimpleNamespace(engram_layers=(1, 14), engram_vocab_size=16_000_000, engram_max_ngram=4, engram_n_heads=8)
    assert engram_table_rows(release) == (384006168, 384016682)


# ---------------------------------------------------------------------- hashing

def test_hash_ids_lie_in_their_buckets() -> None:
    cfg = engram_config()
    hasher = EngramHasher(cfg)
    layout = hasher.layout
    tokens = torch.randint(0, cfg.vocab_size, (3, 50))
    ids, _ = hasher(tokens, torch.full((3, 3), -1))
    assert ids.shape == (3, 50, 2, 6) and ids.dtype == torch.int64
    for i in range(2):
        low = torch.tensor(layout.offsets(i))
        high = low + torch.tensor(layout.flat_primes(i))
        assert bool(((ids[:, :, i] >= low) & (ids[:, :, i] < high)).all())
        assert 0 <= int(ids[:, :, i].min()) and int(ids[:, :, i].max()) < layout.rows(i)


# layer 2's ids for FIXED_TOKENS under `token_map`, computed once by `naive_hashes` in another process and pasted: they
# pin the numbers across processes and library versions (numpy's generator included), not only against this file
FIXED_TOKENS = [5, 17, 2, 400, 5, 17, 511, 0]
FIXED_EXPECTED_LAYER_2 = [
    12, 238, 325, 461, 550, 799, 82, 166, 360, 439, 560, 699, 74, 189, 327, 475, 623, 729, 122, 162, 262, 422, 652, 717,
    124, 245, 337, 440, 657, 790, 82, 166, 357, 411, 645, 767, 20, 176, 283, 511, 587, 685, 28, 194, 358, 408, 648, 778,
]


def test_hashes_match_the_independent_implementation_and_fixed_values() -> None:
    cfg = engram_config()
    hasher = EngramHasher(cfg)
    hasher.set_token_map(token_map(cfg))
    tokens = torch.tensor([FIXED_TOKENS])
    ids, history = hasher(tokens, torch.full((1, 3), -1))
    expected = naive_hashes(FIXED_TOKENS, token_map(cfg).tolist(), cfg)
    assert ids[0].tolist() == expected
    assert ids[0, :, 1].flatten().tolist() == FIXED_EXPECTED_LAYER_2
    assert history[0].tolist() == [t * 7 % COMPRESSED for t in FIXED_TOKENS[-3:]]
    again, _ = hasher(tokens, torch.full((1, 3), -1))
    assert torch.equal(again, ids), "deterministic across calls"


def test_early_positions_hash_with_the_pad_id() -> None:
    """Position t < n - 1 has no n-gram of its own: the blocked look-backs are the pad token's compressed id, and a
    history slot holding no token blocks exactly like position < 0."""
    cfg = engram_config()
    hasher = EngramHasher(cfg)
    hasher.set_token_map(token_map(cfg))
    pad = 2 * 7 % COMPRESSED
    first, _ = hasher(torch.tensor([[9]]), torch.full((1, 3), -1))
    as_if_padded = naive_hashes([cfg.engram_pad_id] * 3 + [9], token_map(cfg).tolist(), cfg)[3]
    assert first[0, 0].tolist() == as_if_padded, "position 0 hashes like a token preceded by pad tokens"
    # a blocked look-back is exactly the pad token's compressed id: a history of real pad tokens hashes the same
    after, _ = hasher(torch.tensor([[9]]), torch.tensor([[-1, pad, pad]]))
    assert after[0, 0].tolist() == as_if_padded
    other, _ = hasher(torch.tensor([[9]]), torch.tensor([[5 * 7 % COMPRESSED, -1, 4 * 7 % COMPRESSED]]))
    blocked_from_2 = naive_hashes([cfg.engram_pad_id] * 2 + [4, 9], token_map(cfg).tolist(), cfg)[3]
    assert other[0, 0].tolist() == blocked_from_2, "once blocked, every longer look-back is blocked"


# ---------------------------------------------------------------------- in the network

@torch.no_grad()
def test_chunked_prefill_gives_the_one_pass_hashes_and_logits(seed: int) -> None:
    net = engram_network()
    tokens = torch.randint(0, net.cfg.vocab_size, (2, 14))
    whole = net(tokens)
    full_ids, _ = net.engram_hashes(tokens, net.new_state(2))
    state, ids, logits = net.new_state(2), [], []
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 14)]:
        chunk_ids, _ = net.engram_hashes(tokens[:, a:b], state)
        out = net(tokens[:, a:b], state)
        ids.append(chunk_ids)
        logits.append(out.logits)
        state = out.state
    assert torch.equal(torch.cat(ids, 1), full_ids)
    assert torch.equal(state.engram_history, whole.state.engram_history)
    # the base network is chunk-invariant to float rounding only (GEMM blocking depends on the chunk length)
    torch.testing.assert_close(torch.cat(logits, 1), whole.logits, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_second_turn_hashes_with_the_previous_turn(seed: int) -> None:
    net = engram_network()
    enc, dec = net.split()
    turn1, turn2 = torch.randint(0, net.cfg.vocab_size, (1, 9)), torch.randint(0, net.cfg.vocab_size, (1, 4))
    conv = Conversation(enc, dec)
    conv.new_turn(turn1, None)
    ids, _ = enc.engram_hashes(turn2, conv.encoder_state)
    expected = naive_hashes(turn1[0].tolist() + turn2[0].tolist(), token_map(net.cfg).tolist(), net.cfg)[9:]
    assert ids[0].tolist() == expected
    fresh, _ = enc.engram_hashes(turn2, enc.new_state(1))
    assert not torch.equal(fresh[0, :3], ids[0, :3]), "a fresh session would pad what the previous turn provides"


@torch.no_grad()
def test_encoder_then_decoder_equals_whole_network_bitwise_with_engram(seed: int) -> None:
    net = engram_network()
    assert any(k.startswith("layers.1.engram.") for k in net.split()[0].state_dict())
    test_network.test_encoder_then_decoder_equals_whole_network_bitwise(net)
    enc = net.split()[0]
    tokens = torch.randint(0, net.cfg.vocab_size, (2, 20))
    _, enc_state = enc(tokens, enc.new_state(2))
    assert torch.equal(enc_state.engram_history, net(tokens).state.engram_history)


@torch.no_grad()
def test_replay_under_an_adapter_switch_leaves_the_encoder_state_untouched(seed: int, tmp_path: Path) -> None:
    net = engram_network()
    enc, dec = net.split()
    bank = AdapterBank(net.cfg, dec)
    bank.attach(dec)
    adapters = []
    for name, part in [("a", ".attn."), ("b", ".ffn.")]:
        mods = {k: v for k, v in decoder_lora_modules(net.cfg, dec).items() if part in k}
        adapters.append(bank.load(save_adapter(tmp_path / name, random_adapter_weights(mods, 4, std=0.05), 4, 8.0,
                                               net.cfg.name)))
    conv = Conversation(enc, dec)
    conv.new_turn(torch.randint(0, net.cfg.vocab_size, (1, 30)), adapters[0])
    conv.step(torch.randint(0, net.cfg.vocab_size, (1, 1)))
    before = conv.encoder_state.clone()
    assert before.engram_history is not None
    conv.replay(adapters[1])
    assert conv.encoder_state.equal(before)
    assert torch.equal(conv.encoder_state.engram_history, before.engram_history)


@torch.no_grad()
def test_engram_off_is_the_previous_network(seed: int) -> None:
    """No Engram: no new parameter, module or state; with Engram on but a zero value projection the streams pass
    through exactly, so the logits are bit for bit the Engram-free network's."""
    off = tiny_network()
    assert off.engram_hasher is None and off.engram_token_map is None
    assert not any("engram" in n for n, _ in off.named_modules()) and not any("engram" in k for k in off.state_dict())
    assert off.new_state().engram_history is None and off(torch.tensor([[1, 2]])).state.engram_history is None
    with pytest.raises(ValueError, match="no Engram layers"):
        off.set_engram_token_map(torch.zeros(off.cfg.vocab_size, dtype=torch.long))
    on = engram_network()
    extra = set(on.state_dict()) - set(off.state_dict())
    assert extra and all(k.startswith(("layers.1.engram.", "layers.2.engram.")) for k in extra)
    assert set(off.state_dict()) <= set(on.state_dict())
    on.load_state_dict({**on.state_dict(), **off.state_dict()})
    tokens = torch.randint(0, off.cfg.vocab_size, (1, 40))
    assert not torch.equal(on(tokens).logits, off(tokens).logits), "Engram does act"
    for l in (1, 2):
        on.layers[str(l)].engram.wkv.weight.zero_()
    assert torch.equal(on(tokens).logits, off(tokens).logits)


@torch.no_grad()
def test_rows_from_a_host_table_feed_the_same_math(seed: int) -> None:
    net = engram_network()
    enc = net.split()[0]
    tokens = torch.randint(0, net.cfg.vocab_size, (2, 12))
    state = enc.new_state(2)
    ids, _ = enc.engram_hashes(tokens, state)
    host = {l: enc.layers[str(l)].engram.embed.weight.detach().clone().numpy() for l in (1, 2)}  # stands in for a mmap
    rows = {l: gather_rows(torch.from_numpy(host[l]), ids[:, :, i]) for i, l in enumerate((1, 2))}
    plain, plain_state = enc(tokens, state)
    fed, fed_state = enc(tokens, state, engram_rows=rows)
    assert torch.equal(plain.streams, fed.streams) and fed_state.equal(plain_state)


@torch.no_grad()
def test_gate_is_the_release_formula(seed: int) -> None:
    cfg = engram_config()
    engram = Engram(cfg, 1)
    engram.q_weight.normal_()
    engram.k_weight.normal_()
    engram.wkv.weight.normal_(std=0.05)
    X = torch.randn(2, 3, cfg.hc_mult, cfg.dim)
    rows = torch.randn(2, 3, 6, 32)
    got = engram.mix(X, rows).double()
    x, kv = X.double(), rows.flatten(-2).double() @ engram.wkv.weight.double().t()
    key, value = (kv[..., : cfg.hc_mult * cfg.dim].unflatten(-1, (cfg.hc_mult, cfg.dim)),
                  kv[..., cfg.hc_mult * cfg.dim :])
    w = (engram.q_weight * engram.k_weight).double()
    want = torch.empty_like(x)
    for b in range(2):
        for s in range(3):
            for c in range(cfg.hc_mult):
                xc, kc = x[b, s, c], key[b, s, c]
                rstd = (xc.square().mean() + cfg.norm_eps) ** -0.5 * (kc.square().mean() + cfg.norm_eps) ** -0.5
                dot = float((xc * w[c] * kc).sum() * rstd / cfg.dim**0.5)
                gate = 1 / (1 + np.exp(-np.sign(dot) * max(abs(dot), 1e-6) ** 0.5))
                want[b, s, c] = xc + gate * value[b, s]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, cfg.engram_num_embeddings[0], (2, 3, 6))
    assert torch.equal(engram(X, ids), engram.mix(X, gather_rows(engram.embed.weight, ids)))


@torch.no_grad()
def test_fake_quant_reaches_the_value_projection(seed: int) -> None:
    plain, quant = engram_network(), engram_network(engram_config(runtime_fake_quant=True))
    quant.load_state_dict(plain.state_dict())
    assert quantizes_input(quant.layers["1"].engram.wkv) and not quantizes_input(plain.layers["1"].engram.wkv)
    X = torch.randn(1, 5, 4, plain.cfg.dim)
    ids = torch.randint(0, 100, (1, 5, 6))
    assert not torch.equal(quant.layers["1"].engram(X, ids), plain.layers["1"].engram(X, ids))


def test_a_meta_built_network_keeps_its_hash_constants() -> None:
    """The checkpoint loader builds on the meta device and `to_empty`s: the hash constants must survive that."""
    cfg = engram_config()
    with torch.device("meta"):
        enc = EncoderEngine(cfg)
    enc = enc.to_empty(device="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (1, 9))
    got, _ = enc.engram_hashes(tokens, enc.new_state(1))
    want, _ = EngramHasher(cfg)(tokens, torch.full((1, 3), -1))
    assert torch.equal(got, want)


@torch.no_grad()
def test_state_carries_measures_and_compares_the_history() -> None:
    net = engram_network()
    state = net(torch.randint(0, net.cfg.vocab_size, (2, 7))).state
    assert state.engram_history.shape == (2, 3)
    bare = SessionState(state.position, state.windows, state.sources)
    assert state.nbytes() == bare.nbytes() + 2 * 3 * 8
    copy = state.clone()
    assert copy.equal(state) and copy.engram_history is not state.engram_history
    copy.engram_history[0, 0] += 1
    assert not copy.equal(state) and not bare.equal(state)
    with pytest.raises(ValueError, match=r"engram_history is None, this network needs \(2, 3\)"):
        net(torch.zeros(2, 1, dtype=torch.long), bare)


# ---------------------------------------------------------------------- token map

# Rust's char::is_whitespace (Unicode White_Space), which the tokenizers library strips; Python's str.strip differs
_WHITE_SPACE = (
    set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {chr(c) for c in range(0x2000, 0x200B)})


def naive_key(text: str, raw: str) -> str:
    """The normalisation with Python's unicodedata: NFKC, NFD, drop marks, per-character lowercase, collapse."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch.lower() for ch in s if not unicodedata.category(ch).startswith("M"))
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s != " ":
        while s and s[0] in _WHITE_SPACE:
            s = s[1:]
        while s and s[-1] in _WHITE_SPACE:
            s = s[:-1]
    return s or text


def test_token_map_of_a_tokenizer_agrees_with_unicodedata() -> None:
    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    ids, count = compressed_token_map(tok)
    numbering: dict[str, int] = {}
    naive = [numbering.setdefault(naive_key(tok.decode([i], skip_special_tokens=False), tok.id_to_token(i)),
                                  len(numbering))
             for i in range(tok.get_vocab_size(with_added_tokens=True))]
    assert ids == naive and count == len(numbering) < len(ids)
    partial = [i for i in range(len(ids)) if "\ufffd" in tok.decode([i])]
    assert len({ids[i] for i in partial}) == len(partial) > 1, "partial-byte tokens keep their own ids"


# final sigma (Python's str.lower would give ς), a lone space and lone marks, ligatures, \x1c (Python's str.strip
# would strip it), ideographic space, ß (lowercase already, no case folding), circled digits (NFKC)
CORNERS = ["ΟΔΟΣ", " The", "THE\t\n", " ", "\t", "é", "\u0301", "ﬁ", "İ", "a\x1c", "x\u3000", "ß", "①"]


@pytest.mark.parametrize("text", CORNERS)
def test_normalisation_corners_agree_with_unicodedata(text: str) -> None:
    assert token_key(text, "raw") == naive_key(text, "raw")


def test_token_map_is_checked_against_the_config() -> None:
    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    ids, count = compressed_token_map(tok)
    cfg = engram_config(vocab_size=len(ids) + 8, engram_compressed_vocab_size=count)
    mapped = engram_token_map(cfg, TOKENIZER_JSON.parent)
    assert mapped.shape == (len(ids) + 8,) and mapped[: len(ids)].tolist() == ids
    assert mapped[len(ids):].tolist() == [ids[cfg.engram_pad_id]] * 8, "ids past the tokenizer map to the pad's id"
    net = CEDNetwork(cfg)
    net.set_engram_token_map(mapped)
    assert torch.equal(net.split()[0].engram_token_map, mapped), "the split carries the token map"
    with pytest.raises(ValueError, match=f"has {count} ids but engram_compressed_vocab_size is {count + 1}"):
        engram_token_map(engram_config(vocab_size=len(ids), engram_compressed_vocab_size=count + 1), tok)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 300\)"):
        engram_network().set_engram_token_map(torch.full((512,), 300))


# ---------------------------------------------------------------------- config

@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(engram_layers=(2, 1)), r"engram_layers=\[2, 1\] must be strictly increasing"),
        (dict(engram_layers=(1, 4)), r"engram_layers holds \[4\], not encoder layers 0..3"),
        (dict(engram_num_embeddings=(408, 409)), "gives layer 1 408 table rows, its bucket layout needs"),
        (dict(engram_num_embeddings=(408,)), "engram_num_embeddings has 1 entries, engram_layers has 2"),
        (dict(engram_head_dim=48), "engram_head_dim=48 must be a positive multiple of 32"),
        (dict(engram_n_heads=0), "engram_n_heads=0 must be positive"),
        (dict(engram_max_ngram=1), "engram_max_ngram=1 must be >= 2"),
        (dict(engram_compressed_vocab_size=0), "engram_compressed_vocab_size=0 must lie in 1..vocab_size=512"),
        (dict(engram_pad_id=512), "engram_pad_id=512 is not a token id"),
        (dict(engram_layers=(), engram_num_embeddings=(5,)),
         r"engram_num_embeddings=\[5\] given but engram_layers is empty"),
    ],
)
def test_bad_engram_configs_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engram_config(**overrides)


def test_every_engram_problem_in_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        engram_config(engram_layers=(1, 9), engram_head_dim=40, engram_pad_id=-1)
    assert all(s in str(err.value) for s in ("not encoder layers", "engram_head_dim=40", "engram_pad_id=-1"))
