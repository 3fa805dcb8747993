"""Config presets and the layout checks that refuse inconsistent role assignments."""

from __future__ import annotations

import pytest

from ced.model.config import CEDConfig, ConfigError, get_preset
from tests.tiny import tiny_config


def test_presets_keep_every_role() -> None:
    for name in ("deepseek-v4.1-flash", "mol2-small"):
        cfg = get_preset(name)
        E = cfg.first_decoder_layer
        assert cfg.compress_ratios[:2] == (0, 0), "first layers are SWA only"
        assert cfg.candidate_source_layer == E and cfg.compress_ratios[E] == 1
        assert ([l for l in cfg.kv_source_layers if l < E]
                and all(cfg.compress_ratios[l] == 2 for l in cfg.kv_source_layers if l < E))
        assert [l for l in cfg.index_source_layers if cfg.is_reindex_layer(l)], "decoder re-index layers exist"
        assert any(cfg.index_source_of(l) != l for l in range(E + 1, cfg.n_layers)), "decoder reuse layers exist"
        assert cfg.n_shared_experts >= 1 and cfg.n_routed_experts > cfg.n_activated_experts and cfg.hc_mult > 1


def test_flash_roles_match_release() -> None:
    cfg = get_preset("deepseek-v4.1-flash")
    assert cfg.kv_source_of(23) == 20 and cfg.kv_source_of(7) == 2 and cfg.kv_source_of(19) == 14
    assert cfg.index_source_of(27) == 24 and cfg.index_source_of(21) == 20 and cfg.index_source_of(1) is None
    assert [l for l in range(40) if cfg.owns_index_keys(l)] == [2, 8, 14, 20]


def test_config_round_trip(tmp_path) -> None:
    cfg = tiny_config()
    cfg.save(tmp_path / "c.json")
    assert CEDConfig.load(tmp_path / "c.json") == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(index_source_layers=(4, 6)), "KV source layer 2 is not an index layer"),
        (dict(compress_ratios=(0, 0, 2, 2, 1, 1, 1)), "compress_ratios has 7 entries"),
        (dict(compress_ratios=(0, 0, 2, 1, 1, 1, 1, 1)), "encoder layers may not use compress ratio 1"),
        (dict(kv_source_layers=(1, 4)), "whose compress ratio is 0"),
        (dict(compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1)), "decoder layers 4..7 must all have compress ratio 1"),
        (dict(candidate_source_layer=6), "must be the first decoder layer 4"),
        (dict(n_heads=3), "not divisible by o_groups"),
        (dict(engram_layers=(1,)), "Engram"),
        (dict(compress_ratios=(0, 0, 3, 3, 1, 1, 1, 1)), "compress ratio 3 is not supported"),
    ],
)
def test_inconsistent_layouts_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_unknown_preset_and_keys() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'gpt-5'.*deepseek-v4.1-flash"):
        get_preset("gpt-5")
    with pytest.raises(ConfigError, match=r"unknown config keys \['n_experts'\]"):
        get_preset("mol2-small", n_experts=3)
    with pytest.raises(ConfigError, match=r"missing keys \['dim'"):
        data = tiny_config().to_dict()
        del data["dim"]
        CEDConfig.from_dict(data)
