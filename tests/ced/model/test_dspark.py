"""DSpark, the release's `mtp.*` drafter: names and shapes as released, the official forward's properties, the loader,
and the target network unchanged by the hook that feeds it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from ced.formats.checkpoint import CheckpointFiles, load_checkpoint
from ced.formats.config_file import CheckpointError, load_config_and_extras
from ced.formats.drafter_files import dspark_spec_of, load_dspark
from ced.formats.release_format import Storage, storage_of
from ced.model.config import ConfigError
from ced.model.dspark import DSpark, DSparkSpec
from ced.model.network import init_weights
from tests.tiny import TensorReads, tiny_config, tiny_network

OFFICIAL_CONFIG = Path(__file__).parents[1] / "formats" / "data" / "deepseek_v41_flash_inference_config.json"


def _drafter(cfg, spec=None, seed=0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    d = DSpark(cfg, spec or DSparkSpec.scaled(cfg))
    init_weights(d)
    return d.eval()


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    cfg = tiny_config()
    torch.manual_seed(1)
    net = tiny_network(cfg)
    drafter = _drafter(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.window_size + 12))
    with torch.no_grad():
        out = net(tokens, targets=drafter.spec.target_layers)
    return cfg, net, drafter, out


# ---------------------------------------------------------------------------------------------- the release's layout
def _official_dir(tmp_path: Path) -> Path:
    shutil.copy(OFFICIAL_CONFIG, tmp_path / "config.json")
    return tmp_path


def test_the_official_config_describes_the_release_drafter(tmp_path: Path) -> None:
    cfg, spec = dspark_spec_of(_official_dir(tmp_path))
    assert spec == DSparkSpec(n_stages=3, block_size=5, noise_token_id=128799, target_layers=(37, 38, 39),
                              markov_rank=256, n_routed_experts=128, n_activated_experts=3)
    with torch.device("meta"):
        params = DSpark(cfg, spec).state_dict()
    # the release's atlas counts 2,401 `mtp.*` tensors: parameters plus one scale per fp8 / packed fp4 weight
    scales = sum(storage_of(n) in (Storage.FP8_BLOCKS, Storage.FP4_PACKED) for n in params)
    assert len(params) + scales == 2401
    assert params["mtp.0.main_proj.weight"].shape == (5120, 3 * 5120)
    assert (params["mtp.2.markov_head.embed.weight"].shape == params["mtp.2.markov_head.head.weight"].shape
            == (129280, 256))
    assert params["mtp.2.confidence_head.proj.weight"].shape == (1, 5120 + 256)
    assert params["mtp.1.ffn.gate.weight"].shape == (128, 5120) and "mtp.1.ffn.experts.127.w2.weight" in params
    assert not any(".compressor." in n or ".indexer." in n or ".engram." in n for n in params)
    assert not any(n.startswith(("mtp.1.main", "mtp.0.markov", "mtp.1.norm")) for n in params)


def test_the_release_writer_writes_exactly_the_drafter_tensors() -> None:
    from build_engines.formats.release_writer import ReleaseShape, dspark_tensors, release_shaped_config

    cfg, extras = release_shaped_config(ReleaseShape(dim=64, experts=8, inter=32, dspark_experts=4, engram_vocab=200),
                                        vocab_size=300, compressed_vocab=250)
    written = dspark_tensors(cfg, extras)
    with torch.device("meta"):
        ours = DSpark(cfg, DSparkSpec.from_release(cfg, extras.not_run)).state_dict()
    assert set(written) == set(ours)
    assert {n: tuple(t.shape) for n, t in written.items()} == {n: tuple(t.shape) for n, t in ours.items()}


def test_bad_specs_are_refused_by_key() -> None:
    cfg = tiny_config()
    spec = DSparkSpec.scaled(cfg)
    for change, key in (({"target_layers": (7, 8)}, "dspark_target_layer_ids"),
                        ({"target_layers": (6, 5)}, "dspark_target_layer_ids"),
                        ({"noise_token_id": cfg.vocab_size}, "dspark_noise_token_id"),
                        ({"n_activated_experts": 9}, "dspark_n_activated_experts"),
                        ({"block_size": 0}, "dspark_block_size")):
        with pytest.raises(ConfigError, match=key):
            DSpark(cfg, dataclasses.replace(spec, **change))


def test_a_config_without_a_drafter_is_refused(tmp_path: Path) -> None:
    data = json.loads(OFFICIAL_CONFIG.read_text())
    data["dspark_block_size"] = 0
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="no DSpark"):
        dspark_spec_of(tmp_path)


# ---------------------------------------------------------------------------------------------- the forward
@torch.no_grad()
def test_the_block_is_the_last_token_then_noise(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, net, drafter, out = tiny
    last = torch.tensor([5, 7])
    draft = drafter(out.target_hidden, last, net.embed, net.head)
    noise = drafter.spec.noise_token_id
    assert draft.block.tolist() == [[5] + [noise] * 4, [7] + [noise] * 4]
    assert (draft.tokens.shape == (2, 5) and draft.confidence.shape == (2, 5)
            and draft.logits.shape == (2, 5, cfg.vocab_size))
    assert draft.logits.dtype == draft.confidence.dtype == torch.float32 and torch.isfinite(draft.logits).all()


@torch.no_grad()
def test_attention_reads_only_the_window_and_the_block(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, net, drafter, out = tiny
    hidden, W = out.target_hidden, cfg.window_size
    old = hidden.shape[1] - W  # rows before the newest W are out of every block query's window
    last = torch.tensor([3, 4])
    base = drafter(hidden, last, net.embed, net.head)
    outside = hidden.clone()
    outside[:, :old] = torch.randn_like(outside[:, :old])
    assert torch.equal(drafter(outside, last, net.embed, net.head).logits, base.logits)
    assert torch.equal(drafter(hidden[:, old:], last, net.embed, net.head, start=old).logits, base.logits)
    inside = hidden.clone()
    inside[:, old] += 1.0  # the oldest row of the window
    assert not torch.equal(drafter(inside, last, net.embed, net.head).logits, base.logits)
    # no causal mask inside the block: the first position reads the noise positions after it
    other = DSpark(cfg, dataclasses.replace(drafter.spec, noise_token_id=17))
    other.load_state_dict(drafter.state_dict())
    assert not torch.allclose(other.eval()(hidden, last, net.embed, net.head).logits[:, 0], base.logits[:, 0])


@torch.no_grad()
def test_drafts_are_greedy_markov_biased_and_deterministic(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, net, drafter, out = tiny
    last = torch.tensor([11, 12])
    a = drafter(out.target_hidden, last, net.embed, net.head)
    b = drafter(out.target_hidden, last, net.embed, net.head)
    assert (torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
            and torch.equal(a.confidence, b.confidence))
    assert torch.equal(a.tokens, a.logits.argmax(-1))
    markov = drafter.mtp[-1].markov_head
    previous = torch.cat((last.unsqueeze(1), a.tokens[:, :-1]), 1)
    # forcing a different draft i-1 moves logits i by exactly the Markov bias difference and nothing else
    forced = a.tokens.clone()
    forced[:, 1] = (forced[:, 1] + 1) % cfg.vocab_size
    f = drafter(out.target_hidden, last, net.embed, net.head, forced=forced)
    assert torch.equal(f.tokens, forced)
    for i in (0, 1, 3, 4):
        assert torch.equal(f.logits[:, i], a.logits[:, i]), i
    moved = markov(forced[:, 1])[0] - markov(previous[:, 2])[0]
    torch.testing.assert_close(f.logits[:, 2] - a.logits[:, 2], moved, rtol=1e-5, atol=1e-5)
    assert (not torch.equal(f.confidence[:, 2], a.confidence[:, 2])
            and torch.equal(f.confidence[:, 3], a.confidence[:, 3]))
    g1 = torch.Generator().manual_seed(4)
    g2 = torch.Generator().manual_seed(4)
    s1 = drafter(out.target_hidden, last, net.embed, net.head, temperature=1.0, generator=g1)
    s2 = drafter(out.target_hidden, last, net.embed, net.head, temperature=1.0, generator=g2)
    assert torch.equal(s1.tokens, s2.tokens)


@torch.no_grad()
def test_confidence_is_the_raw_linear_score(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, net, drafter, out = tiny
    last = torch.tensor([1, 2])
    base = drafter(out.target_hidden, last, net.embed, net.head)
    doubled = _drafter(cfg)
    doubled.load_state_dict(drafter.state_dict())
    doubled.mtp[-1].confidence_head.proj.weight.mul_(-2.0)  # exact in floating point: no sigmoid, no clamp
    assert torch.equal(doubled(out.target_hidden, last, net.embed, net.head).confidence, -2.0 * base.confidence)


# ---------------------------------------------------------------------------------------------- the hook
@torch.no_grad()
def test_the_hook_leaves_the_target_bitwise_unchanged(tiny) -> None:  # type: ignore[no-untyped-def]
    cfg, net, drafter, out = tiny
    tokens = torch.randint(0, cfg.vocab_size, (2, 40))
    plain = net(tokens, trace=True)
    hooked = net(tokens, trace=True, targets=(2, 5, 7))
    assert plain.target_hidden is None
    assert torch.equal(plain.logits, hooked.logits)
    assert all(torch.equal(a, b) for a, b in zip(plain.hidden, hooked.hidden))
    assert all(torch.equal(a.kv, b.kv) and torch.equal(a.pos, b.pos)
               for a, b in zip(plain.state.windows.values(), hooked.state.windows.values()))
    # each target's input is the previous block's output streams (no Engram here), averaged over the copies
    want = torch.cat([plain.hidden[l - 1].mean(2) for l in (2, 5, 7)], -1)
    assert torch.equal(hooked.target_hidden, want)
    first = net(tokens[:, :25], targets=(2, 5, 7))
    second = net(tokens[:, 25:], first.state, targets=(2, 5, 7))
    torch.testing.assert_close(torch.cat((first.target_hidden, second.target_hidden), 1), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="target layers"):
        net(tokens, targets=(cfg.n_layers,))


# ---------------------------------------------------------------------------------------------- loading
@pytest.fixture(scope="module")
def release_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from build_engines.formats.release_writer import ReleaseShape, write_release_shaped

    shape = ReleaseShape(dim=64, experts=8, inter=32, dspark_experts=4, engram_vocab=200, shards=3)
    return write_release_shaped(tmp_path_factory.mktemp("release-shaped-dspark"), shape, force=True)


@torch.no_grad()
def test_the_release_shaped_drafter_loads_reading_only_mtp(release_shaped: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    reads = TensorReads(monkeypatch)
    drafter = load_dspark(release_shaped)
    files = CheckpointFiles(release_shaped)
    stored = {n for n in files.names() if n.startswith("mtp.")}
    assert set(reads.names) == stored  # every mtp tensor (and scale), nothing else
    assert set(drafter.state_dict()) == {n for n in stored if not n.endswith(".scale")}
    reads.names.clear()
    load_checkpoint(release_shaped, role="decoder")
    assert reads.names and not any(n.startswith("mtp.") for n in reads.names)


@torch.no_grad()
def test_the_release_shaped_drafter_drafts_in_fp32_and_bf16(release_shaped: Path) -> None:
    net = load_checkpoint(release_shaped)
    drafter = load_dspark(release_shaped)
    cfg, spec = net.cfg, drafter.spec
    assert spec.target_layers == (37, 38, 39) and spec.n_routed_experts == 4 and cfg.runtime_fake_quant
    tokens = torch.randint(0, cfg.vocab_size, (1, 24))
    out = net(tokens, targets=spec.target_layers)
    last = out.logits[:, -1].argmax(-1)
    draft = drafter(out.target_hidden, last, net.embed, net.head)
    assert torch.isfinite(draft.logits).all() and torch.isfinite(draft.confidence).all()
    net16, drafter16 = (load_checkpoint(release_shaped, dtype=torch.bfloat16),
                        load_dspark(release_shaped, dtype=torch.bfloat16))
    draft16 = drafter16(out.target_hidden.bfloat16(), last, net16.embed, net16.head)
    assert draft16.logits.dtype == torch.float32 and torch.isfinite(draft16.logits).all()
    cosine = torch.nn.functional.cosine_similarity(draft16.logits.flatten(), draft.logits.flatten(), dim=0)
    assert cosine > 0.99, f"bf16 draft logits drift from fp32: cosine {float(cosine):.4f}"


def test_a_missing_or_unknown_mtp_tensor_is_refused_by_name(release_shaped: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(release_shaped, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["mtp.2.confidence_head.proj.weight"]
    tensors = load_file(str(copy / shard))
    tensors["mtp.1.markov_head.embed.weight"] = tensors.pop("mtp.2.confidence_head.proj.weight")
    save_file(tensors, str(copy / shard))
    index["weight_map"]["mtp.1.markov_head.embed.weight"] = index["weight_map"].pop("mtp.2.confidence_head.proj.weight")
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing DSpark tensors \['mtp.2.confidence_head.proj.weight'\].*"
                                              r"unexpected mtp.\* tensors \['mtp.1.markov_head.embed.weight'\]"):
        load_dspark(copy)
    assert load_config_and_extras(copy)[1] is not None
