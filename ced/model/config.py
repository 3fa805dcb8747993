"""Configuration of the causal encoder-decoder (CED) network.

One dataclass describes every structural role of DeepSeek-V4.1-Flash: which layers are pure sliding-window,
which write the global (compressed) KV, which own indexer keys, which re-index against the first decoder layer,
and where the encoder ends. Everything else (the network, the engine split, the checkpoint loader, the memory
planner) reads these roles from here instead of special-casing layer numbers, so a small preset that keeps every
role trains on a CPU while the real preset checks shapes against the release.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot describe a valid CED network; the message names the offending key."""


@dataclass(frozen=True)
class CEDConfig:
    """Hyper-parameters and layer roles; names follow the released `inference/config.json` where one exists."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_encoder_layers: int  # layers [0, n_encoder_layers) are the encoder; the next layer is "layer 20"
    n_heads: int
    head_dim: int  # the shared K=V latent width
    rope_head_dim: int  # RoPE acts on the last rope_head_dim channels, interleaved pairs
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]  # per layer: 0 = SWA only, 2 = pooled pairs, 1 = one entry per token
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_original_seq_len: int = 65536  # 0 disables YaRN on the compressed layers
    yarn_factor: float = 16.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    runtime_fake_quant: bool = False  # fp8 window KV / fp4 global KV / fp4 indexer q,k as in V4.1's QAT
    max_seq_len: int = 1 << 20
    # Engram (V4.1's gated n-gram hash lookup, ced/model/engram.py); empty engram_layers turns it off
    engram_layers: tuple[int, ...] = field(default=())  # encoder layers whose streams get an Engram before the block
    engram_vocab_size: int = 0  # every (layer, n-gram size) group searches its head primes upwards from this - 1
    engram_num_embeddings: tuple[int, ...] = ()  # table rows per engram layer: the sum of that layer's primes
    engram_max_ngram: int = 4  # n-grams of sizes 2..engram_max_ngram end at each position
    engram_n_heads: int = 0  # hash heads per n-gram size (each its own prime-sized bucket range)
    engram_head_dim: int = 0  # width of one table row
    engram_pad_id: int = 2  # token id whose compressed id fills a blocked look-back
    engram_compressed_vocab_size: int = 0  # ids of the normalised token map; every hash multiplier derives from it

    # ------------------------------------------------------------------ derived roles
    @property
    def first_decoder_layer(self) -> int:
        """"Layer 20" of the article: first decoder layer, last global-KV source, candidate-pool source."""
        return self.n_encoder_layers

    @property
    def n_hc_mix(self) -> int:
        """Coefficients predicted per hyper-connection: hc pre + hc post + hc x hc mixing matrix."""
        return (2 + self.hc_mult) * self.hc_mult

    def kv_source_of(self, layer: int) -> int | None:
        """The global-KV source whose cache `layer` reads (the nearest source at or above it), None for SWA."""
        if self.compress_ratios[layer] == 0:
            return None
        sources = [s for s in self.kv_source_layers if s <= layer]
        return sources[-1]

    def index_source_of(self, layer: int) -> int | None:
        """The index layer whose top-k selection `layer` uses (itself when it is an index layer)."""
        if self.compress_ratios[layer] == 0:
            return None
        sources = [s for s in self.index_source_layers if s <= layer]
        return sources[-1]

    def owns_index_keys(self, layer: int) -> bool:
        """Only a layer that compresses its own KV can produce index keys (KV sources that are index layers)."""
        return layer in self.kv_source_layers and layer in self.index_source_layers

    def is_reindex_layer(self, layer: int) -> bool:
        """Decoder index layers that score their own queries against the candidate source's keys and pool."""
        return layer in self.index_source_layers and layer > self.candidate_source_layer

    def uses_yarn(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0 and self.yarn_original_seq_len > 0

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        """Refuse layouts the network cannot run, collecting every problem so one error lists them all."""
        problems: list[str] = []
        L, E = self.n_layers, self.n_encoder_layers
        if len(self.compress_ratios) != L:
            problems.append(f"compress_ratios has {len(self.compress_ratios)} entries, n_layers is {L}")
        if not 0 < E < L:
            problems.append(f"n_encoder_layers={E} must lie in (0, n_layers={L})")
        if problems:
            raise ConfigError(f"config {self.name!r}: " + "; ".join(problems))
        for key in ("kv_source_layers", "index_source_layers"):
            layers = getattr(self, key)
            if list(layers) != sorted(set(layers)):
                problems.append(f"{key}={list(layers)} must be strictly increasing")
            for layer in layers:
                if not 0 <= layer < L:
                    problems.append(f"{key} holds layer {layer}, outside 0..{L - 1}")
                elif self.compress_ratios[layer] == 0:
                    problems.append(f"{key} holds layer {layer}, whose compress ratio is 0 (SWA only)")
        for r in set(self.compress_ratios):
            if r not in (0, 1, 2):
                problems.append(f"compress ratio {r} is not supported (0, 1 or 2)")
        for layer in self.kv_source_layers:
            if layer not in self.index_source_layers:
                problems.append(f"KV source layer {layer} is not an index layer (every KV source must be one)")
        for layer, ratio in enumerate(self.compress_ratios):
            if ratio == 0:
                continue
            src = [s for s in self.kv_source_layers if s <= layer]
            if not src:
                problems.append(f"layer {layer} has ratio {ratio} but no KV source at or above it")
            elif self.compress_ratios[src[-1]] != ratio:
                problems.append(
                    f"layer {layer} has ratio {ratio} but reads KV source {src[-1]} of ratio "
                    f"{self.compress_ratios[src[-1]]} (a consumer's ratio must equal its source's)"
                )
            if not [s for s in self.index_source_layers if s <= layer]:
                problems.append(f"layer {layer} has ratio {ratio} but no index layer at or above it")
        for layer in self.index_source_layers:
            if layer not in self.kv_source_layers and layer <= self.candidate_source_layer:
                problems.append(
                    f"index layer {layer} owns no keys and is not after the candidate source "
                    f"{self.candidate_source_layer} (only decoder re-index layers may borrow keys)"
                )
        if 0 < E < L:
            d = self.first_decoder_layer
            if self.candidate_source_layer != d:
                problems.append(f"candidate_source_layer={self.candidate_source_layer} must be the first decoder "
                                f"layer {d}")
            if d not in self.kv_source_layers:
                problems.append(f"the first decoder layer {d} must be a KV source (it writes the decoder's global KV)")
            if any(r != 1 for r in self.compress_ratios[d:]):
                problems.append(f"decoder layers {d}..{L - 1} must all have compress ratio 1, "
                                f"got {list(self.compress_ratios[d:])}")
            if [s for s in self.kv_source_layers if s > d]:
                problems.append("KV sources after the first decoder layer are not supported: "
                                f"{[s for s in self.kv_source_layers if s > d]}")
            if any(r == 1 for r in self.compress_ratios[:E]):
                problems.append("encoder layers may not use compress ratio 1")
        if self.head_dim % 2 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            problems.append(f"rope_head_dim={self.rope_head_dim} must be even and <= head_dim={self.head_dim} (even)")
        if self.rope_head_dim > self.index_head_dim:
            problems.append(f"rope_head_dim={self.rope_head_dim} must be <= index_head_dim={self.index_head_dim}")
        if self.n_heads % self.o_groups:
            problems.append(f"n_heads={self.n_heads} is not divisible by o_groups={self.o_groups}")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            problems.append(f"n_activated_experts={self.n_activated_experts} must lie in "
                            f"1..n_routed_experts={self.n_routed_experts}")
        if (self.window_size < 1 or self.index_topk < 1 or self.candidate_topk_blocks < 1
                or self.candidate_block_size < 1):
            problems.append("window_size, index_topk, candidate_topk_blocks and candidate_block_size must be positive")
        if self.hc_mult < 1:
            problems.append(f"hc_mult={self.hc_mult} must be positive")
        problems += self._engram_problems()
        if problems:
            raise ConfigError(f"config {self.name!r}: " + "; ".join(problems))

    def _engram_problems(self) -> list[str]:
        """Engram's own checks; each names its key and starts with "Engram" so a refusal says which mechanism."""
        if not self.engram_layers:
            if self.engram_num_embeddings:
                return [f"Engram: engram_num_embeddings={list(self.engram_num_embeddings)} given but "
                        "engram_layers is empty"]
            return []
        problems: list[str] = []
        layers, E = self.engram_layers, self.n_encoder_layers
        if list(layers) != sorted(set(layers)):
            problems.append(f"Engram: engram_layers={list(layers)} must be strictly increasing")
        outside = [l for l in layers if not 0 <= l < E]
        if outside:
            problems.append(
                f"Engram: engram_layers holds {outside}, not encoder layers 0..{E - 1} (Engram sits in the shared "
                "encoder, which adapters never touch, so every adapter reads one n-gram lookup)"
            )
        shape_ok = True
        if self.engram_max_ngram < 2:
            problems.append(f"Engram: engram_max_ngram={self.engram_max_ngram} must be >= 2 "
                            "(the smallest n-gram is a 2-gram)")
            shape_ok = False
        if self.engram_n_heads < 1:
            problems.append(f"Engram: engram_n_heads={self.engram_n_heads} must be positive")
            shape_ok = False
        if self.engram_vocab_size < 2:
            problems.append(f"Engram: engram_vocab_size={self.engram_vocab_size} must be >= 2 "
                            "(primes are searched above it - 1)")
            shape_ok = False
        if self.engram_head_dim < 1 or self.engram_head_dim % 32:
            problems.append(
                f"Engram: engram_head_dim={self.engram_head_dim} must be a positive multiple of 32 "
                "(the release stores each table row in fp8 with one ue8m0 scale per 32 values)"
            )
        if not 0 < self.engram_compressed_vocab_size <= self.vocab_size:
            problems.append(
                f"Engram: engram_compressed_vocab_size={self.engram_compressed_vocab_size} must lie in "
                f"1..vocab_size={self.vocab_size}"
            )
        if not 0 <= self.engram_pad_id < self.vocab_size:
            problems.append(f"Engram: engram_pad_id={self.engram_pad_id} is not a token id (0..{self.vocab_size - 1})")
        if len(self.engram_num_embeddings) != len(layers):
            problems.append(
                f"Engram: engram_num_embeddings has {len(self.engram_num_embeddings)} entries, "
                f"engram_layers has {len(layers)}"
            )
        elif shape_ok:
            rows = engram_table_rows_of(layers, self.engram_vocab_size, self.engram_max_ngram, self.engram_n_heads)
            for layer, got, want in zip(layers, self.engram_num_embeddings, rows):
                if got != want:
                    problems.append(
                        f"Engram: engram_num_embeddings gives layer {layer} {got} table rows, its bucket layout needs "
                        f"{want} (the sum of its {(self.engram_max_ngram - 1) * self.engram_n_heads} primes)"
                    )
        return problems

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CEDConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)  # type: ignore[misc]
        if missing:
            raise ConfigError(f"config is missing keys {missing}")
        fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fixed)

    @classmethod
    def load(cls, path: str | Path) -> "CEDConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> "CEDConfig":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------- Engram bucket layout (pure integers)
# It lives here, not in engram.py, because validation needs it and configs are read by processes without torch.


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin: exact for every n < 3.3e24 with these bases (far above any table size)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=64)
def engram_bucket_primes(
    layers: tuple[int, ...], vocab_size: int, max_ngram: int, n_heads: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[layer][n-gram size 2..max_ngram][head] bucket moduli, as the release draws them.

    Every (layer, n-gram size) group starts its search at `vocab_size - 1` and takes, head by head, the next prime
    above the previous one that no earlier group of any layer took: primes are globally distinct, so no two buckets
    of any table share a modulus. Only the number of layers matters, not their ids. Cached: every config
    construction validates against it.
    """
    seen: set[int] = set()
    out = []
    for _ in layers:
        per_ngram = []
        for _ in range(max_ngram - 1):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                heads.append(current)
            per_ngram.append(tuple(heads))
        out.append(tuple(per_ngram))
    return tuple(out)


def engram_table_rows_of(layers: tuple[int, ...], vocab_size: int, max_ngram: int, n_heads: int) -> tuple[int, ...]:
    """Rows of each engram layer's table: its buckets laid end to end."""
    return tuple(sum(sum(g) for g in layer)
                 for layer in engram_bucket_primes(tuple(layers), vocab_size, max_ngram, n_heads))


def _flash() -> CEDConfig:
    """DeepSeek-V4.1-Flash as released (Engram, DSpark and vision left out; see docs/architecture.md)."""
    return CEDConfig(
        name="deepseek-v4.1-flash",
        vocab_size=129280,
        dim=5120,
        n_layers=40,
        n_encoder_layers=20,
        n_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1280,
        o_groups=8,
        o_lora_rank=1024,
        window_size=128,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layers=(2, 8, 14, 20),
        index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=384,
        n_shared_experts=1,
        n_activated_experts=6,
        moe_inter_dim=2304,
        route_scale=1.5,
        swiglu_limit=10.0,
        norm_eps=1e-20,
        hc_mult=4,
        runtime_fake_quant=True,
    )


def _small() -> CEDConfig:
    """Every structural role of V4.1-Flash at a width that trains on a 2-core CPU.

    8 layers: encoder 0-3 (0-1 SWA only, 2 a ratio-2 KV source and index layer, 3 reuses 2), decoder 4-7 (4 is
    "layer 20": ratio-1 KV source, index layer and candidate pool; 5 reuses 4; 6 re-indexes against 4's keys
    inside 4's pool; 7 reuses 6). Window 128 as in the release, so bounded replay has the real length.
    """
    return CEDConfig(
        name="mol2-small",
        vocab_size=8192,
        dim=256,
        n_layers=8,
        n_encoder_layers=4,
        n_heads=4,
        head_dim=64,
        rope_head_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        window_size=128,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(2, 4),
        index_source_layers=(2, 4, 6),
        candidate_source_layer=4,
        candidate_topk_blocks=8,
        candidate_block_size=8,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=32,
        n_routed_experts=4,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_inter_dim=128,
        route_scale=1.5,
        swiglu_limit=10.0,
        yarn_original_seq_len=4096,
        yarn_factor=4.0,
        norm_eps=1e-6,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        runtime_fake_quant=False,
    )


PRESETS = {"deepseek-v4.1-flash": _flash, "mol2-small": _small}


def get_preset(name: str, **overrides: Any) -> CEDConfig:
    """A named preset, optionally with fields replaced (tests shrink widths this way)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    base = PRESETS[name]()
    if not overrides:
        return base
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(CEDConfig)})
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}")
    return base.replace(**overrides)
