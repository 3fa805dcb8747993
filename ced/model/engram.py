"""Engram: DeepSeek-V4.1's gated n-gram hash lookup, added into the hyper-connection streams before a few encoder
layers.

Three parts, kept apart because they run in different places in serving:

- the *token map* (`compressed_token_map`): every token id -> an id of a smaller space in which tokens that normalise
  alike (case, accents, whitespace) coincide. Built once from the tokenizer; the hashes are over these ids.
- the *hash* (`ngram_hash_ids`, `EngramHasher`): for each position the 2..max_ngram-grams of compressed ids ending
  there, hashed per head into that head's prime-sized bucket range of the layer's table. Integer-only and a function
  of token ids alone, so a host can compute it before a step runs; its only state is the last max_ngram - 1
  compressed ids of the session (`SessionState.engram_history`), which is why the history carries across prefill
  chunks, decode steps and turns.
- the *gate* (`Engram`): the gathered rows are projected to one key per stream copy plus one shared value; each copy
  adds the value scaled by a sigmoid of a normalised key/stream dot product. The row gather is a separate function
  (`gather_rows`) and the math on gathered rows a separate method (`Engram.mix`), so rows read from a host-side
  memory-mapped table feed the same math.

Everything integer here reproduces the release exactly (the primes, the numpy-drawn multipliers, int64 wrapping
products, XOR, modulo); tests/ced/model/test_engram.py checks it against a plain Python-int implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ced.model.config import engram_bucket_primes, engram_table_rows_of
from ced.model.primitives import ActQuantLinear

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ced.model.config import CEDConfig

#: The per-layer RNG seed is this times the layer id (the release's choice; it fixes every multiplier).
MULTIPLIER_SEED_STRIDE = 10007
#: |dot| is floored here before the signed square root, so the gate's slope stays finite at dot = 0.
GATE_FLOOR = 1e-6
#: A history slot holding no token (before position 0). A look-back that reaches one is blocked, and so is every
#: longer look-back of that position; blocked slots hash as the compressed id of `engram_pad_id`.
NO_TOKEN = -1


class EngramShape(Protocol):
    """The four config fields that fix the bucket layout (a `CEDConfig`, or anything carrying them)."""

    engram_layers: tuple[int, ...]
    engram_vocab_size: int
    engram_max_ngram: int
    engram_n_heads: int


def engram_table_rows(cfg: EngramShape) -> tuple[int, ...]:
    """Rows of each engram layer's table (what `engram_num_embeddings` must hold). Accepts any object with the four
    layout fields, so a writer can compute the rows before it builds the (validated) config."""
    return engram_table_rows_of(tuple(cfg.engram_layers), cfg.engram_vocab_size, cfg.engram_max_ngram,
                                cfg.engram_n_heads)


def hash_multipliers(layers: tuple[int, ...], max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    """(n_layers, max_ngram) int64 odd multipliers, one per look-back, from numpy's PCG64 seeded per layer.

    numpy's generator is part of the definition: the same seeds and bound are what make our hashes the release's.
    The bound keeps `compressed id * multiplier` below 2^63, so the products never actually wrap.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(MULTIPLIER_SEED_STRIDE * layer).integers(0, bound, size=max_ngram, dtype=np.int64)
            for layer in layers]
    return np.stack(rows) * 2 + 1


@dataclass(frozen=True)
class EngramLayout:
    """Where every (layer, n-gram size, head) bucket lies: its prime modulus and its first row in the layer's table.

    Columns of a position's hash ids run n-gram size major, head minor: column (n - 2) * n_heads + h.
    """

    layers: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][n - 2][head]

    @classmethod
    def from_config(cls, cfg: "CEDConfig") -> "EngramLayout":
        primes = engram_bucket_primes(tuple(cfg.engram_layers), cfg.engram_vocab_size, cfg.engram_max_ngram,
                                      cfg.engram_n_heads)
        return cls(tuple(cfg.engram_layers), cfg.engram_max_ngram, cfg.engram_n_heads, cfg.engram_head_dim, primes)

    @property
    def n_cols(self) -> int:
        """Hash ids (table rows) per position and layer."""
        return (self.max_ngram - 1) * self.n_heads

    def flat_primes(self, index: int) -> list[int]:
        """The layer's bucket moduli in column order."""
        return [p for per_ngram in self.primes[index] for p in per_ngram]

    def offsets(self, index: int) -> list[int]:
        """First table row of each column's bucket: the buckets lie end to end in column order."""
        sizes = self.flat_primes(index)
        return [sum(sizes[:c]) for c in range(len(sizes))]

    def rows(self, index: int) -> int:
        return sum(self.flat_primes(index))


# ---------------------------------------------------------------------- compressed token map

def _normalizers():  # type: ignore[no-untyped-def]
    """The folding chain (NFKC, NFD, drop combining marks, per-character lowercase, collapse [ \\t\\r\\n] runs) and the
    strip, from the `tokenizers` library the release normalises with: its Unicode tables and its notion of whitespace
    (Rust's `char::is_whitespace`) are the definition, and Python's differ in corners (str.lower's final sigma,
    str.strip's \\x1c-\\x1f)."""
    from tokenizers import Regex, normalizers

    fold = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    ])
    return fold, normalizers.Strip()


def token_key(text: str, raw_token: str, fold=None, strip=None) -> str:  # type: ignore[no-untyped-def]
    """The string a token is merged under: its folded text, stripped unless it is exactly one space (so the lone-space
    token stays itself instead of merging with the empty ones); its raw text when folding leaves nothing (a lone
    combining mark, an empty special token); its raw vocabulary string when its text holds U+FFFD (a partial UTF-8
    byte: there is nothing to normalise, and all such tokens would otherwise collide)."""
    if "\ufffd" in text:
        return raw_token
    if fold is None or strip is None:
        fold, strip = _normalizers()
    folded = fold.normalize_str(text)
    if folded != " ":
        folded = strip.normalize_str(folded)
    return folded or text


def compressed_token_map(tokenizer: "Tokenizer") -> tuple[list[int], int]:
    """(compressed id of every token id, number of compressed ids); ids are numbered in first-seen order.

    Each id is decoded alone by the raw backend (special tokens kept, no clean-up of spaces), as the release's
    training did. Length: the tokenizer's vocabulary including added tokens (what `len(hf_tokenizer)` reports).
    """
    fold, strip = _normalizers()
    numbering: dict[str, int] = {}
    out = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = token_key(text, tokenizer.id_to_token(token_id) or "", fold, strip)
        out.append(numbering.setdefault(key, len(numbering)))
    return out, len(numbering)


def compressed_token_map_from_file(path: str | Path) -> torch.Tensor:
    """The compressed map (int64, one entry per tokenizer id) of a `tokenizer.json`; its max + 1 is the id count."""
    from tokenizers import Tokenizer

    ids, _ = compressed_token_map(Tokenizer.from_file(str(path)))
    return torch.tensor(ids, dtype=torch.int64)


def engram_token_map(cfg: "CEDConfig", tokenizer: "Tokenizer | str | Path") -> torch.Tensor:
    """The network's token map (int64, length cfg.vocab_size) from a `tokenizers.Tokenizer` (or a transformers fast
    tokenizer: its backend is used), a tokenizer.json path or a model directory holding one, checked against the config.

    The id count must equal `engram_compressed_vocab_size`: every multiplier derives from it, so another tokenizer
    would silently rehash every table. Ids past the tokenizer's vocabulary (an embedding padded beyond it, as the
    release's 129,280 rows are) never come out of the tokenizer; they map to the pad token's compressed id.
    """
    if not isinstance(tokenizer, (str, Path)):
        ids, count = compressed_token_map(getattr(tokenizer, "backend_tokenizer", tokenizer))
    else:
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        from tokenizers import Tokenizer

        ids, count = compressed_token_map(Tokenizer.from_file(str(path)))
    if count != cfg.engram_compressed_vocab_size:
        raise ValueError(
            f"the tokenizer's compressed token map has {count} ids but engram_compressed_vocab_size is "
            f"{cfg.engram_compressed_vocab_size}: this is not the tokenizer the Engram tables were trained with"
        )
    if len(ids) > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(ids)} ids, more than the network's vocab_size={cfg.vocab_size}")
    if cfg.engram_pad_id >= len(ids):
        raise ValueError(f"engram_pad_id={cfg.engram_pad_id} is not an id of the tokenizer ({len(ids)} ids)")
    ids = ids + [ids[cfg.engram_pad_id]] * (cfg.vocab_size - len(ids))
    return torch.tensor(ids, dtype=torch.int64)


def placeholder_token_map(cfg: "CEDConfig") -> torch.Tensor:
    """The map a network starts with before a tokenizer's is set: id % engram_compressed_vocab_size (the identity when
    the sizes agree). A deterministic stand-in for random-weight networks and tests; serving a checkpoint must set
    the tokenizer's map (`engram_token_map`), which is not derivable from the config."""
    return torch.arange(cfg.vocab_size, dtype=torch.int64, device="cpu") % cfg.engram_compressed_vocab_size


# ---------------------------------------------------------------------- hashing

def new_engram_history(cfg: "CEDConfig", batch: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh session's history: (batch, max_ngram - 1) slots, all `NO_TOKEN` (nothing before position 0)."""
    return torch.full((batch, cfg.engram_max_ngram - 1), NO_TOKEN, dtype=torch.int64, device=device)


def ngram_hash_ids(
    compressed: torch.Tensor,
    history: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: torch.Tensor | int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash ids of a chunk and the history after it. Pure int64 tensor ops (exportable).

    compressed:  (B, S) compressed ids of the chunk's tokens
    history:     (B, K) the K = max_ngram - 1 compressed ids before the chunk, oldest first, NO_TOKEN where none
    multipliers: (L, max_ngram) per engram layer and look-back (`hash_multipliers`)
    primes:      (L, max_ngram - 1, n_heads) bucket moduli
    offsets:     (L, n_cols) first row of each column's bucket
    pad:         compressed id that fills a blocked look-back
    returns      (B, S, L, n_cols) table rows, and the new (B, K) history

    For position t the look-backs are c[t], c[t-1], .., c[t-max_ngram+1]; the n-gram hash is the XOR of the first n
    products c[t-i] * multiplier[i], taken modulo each head's prime and shifted to that head's bucket.
    """
    K, S = history.shape[1], compressed.shape[1]
    seq = torch.cat((history, compressed.to(history.dtype)), dim=1)  # (B, K + S)
    blocked = torch.zeros_like(compressed, dtype=torch.bool)
    looks = []
    for back in range(K + 1):
        ids = seq[:, K - back : K - back + S]
        blocked = blocked | (ids == NO_TOKEN)  # once a look-back is blocked, the longer ones are too
        looks.append(torch.where(blocked, pad, ids))
    products = torch.stack(looks, dim=-1).unsqueeze(2) * multipliers  # (B, S, L, max_ngram)
    rolling = products[..., 0]
    cols = []
    for n in range(2, K + 2):
        rolling = torch.bitwise_xor(rolling, products[..., n - 1])
        cols.append(rolling.unsqueeze(-1) % primes[:, n - 2])  # (B, S, L, n_heads)
    return torch.cat(cols, dim=-1) + offsets, seq[:, seq.shape[1] - K :]


class EngramHasher(nn.Module):
    """Token ids + history -> every engram layer's hash ids.

    Its constants (the token map, the layout's primes and offsets, the multipliers) are plain CPU tensors, not
    parameters or buffers: checkpoints keep exactly the release's tensor names, and a network built on the meta
    device and then `to_empty`-ed by a loader keeps real constants (a buffer would come back uninitialised). They are
    copied to the tokens' device on first use there.
    """

    def __init__(self, cfg: "CEDConfig") -> None:
        super().__init__()
        self.cfg = cfg
        self.layout = layout = EngramLayout.from_config(cfg)
        cpu = torch.device("cpu")  # explicit, so a `with torch.device("meta")` around the network does not apply
        mult = hash_multipliers(layout.layers, layout.max_ngram, cfg.engram_compressed_vocab_size)
        self._tables = {
            "multipliers": torch.tensor(mult, dtype=torch.int64, device=cpu),
            "primes": torch.tensor(layout.primes, dtype=torch.int64, device=cpu),
            "offsets": torch.tensor([layout.offsets(i) for i in range(len(layout.layers))], dtype=torch.int64,
                                    device=cpu),
        }
        self._token_map = placeholder_token_map(cfg)
        self._placed: tuple[torch.device, tuple[torch.Tensor, ...]] | None = None

    @property
    def token_map(self) -> torch.Tensor:
        return self._token_map

    @property
    def multipliers(self) -> torch.Tensor:
        return self._tables["multipliers"]

    @property
    def primes(self) -> torch.Tensor:
        return self._tables["primes"]

    @property
    def offsets(self) -> torch.Tensor:
        return self._tables["offsets"]

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """Install a tokenizer's map (`engram_token_map`). Ids must stay below engram_compressed_vocab_size: the
        multipliers' bound (no int64 overflow) assumes it."""
        cfg = self.cfg
        if token_map.shape != (cfg.vocab_size,) or token_map.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"the Engram token map must be an int tensor of shape ({cfg.vocab_size},), got "
                             f"{tuple(token_map.shape)} {token_map.dtype}")
        low, high = int(token_map.min()), int(token_map.max())
        if low < 0 or high >= cfg.engram_compressed_vocab_size:
            raise ValueError(f"Engram token map ids must lie in [0, {cfg.engram_compressed_vocab_size}), "
                             f"got [{low}, {high}]")
        self._token_map = token_map.to(device="cpu", dtype=torch.int64).clone()
        self._placed = None

    def constants_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_map, multipliers, primes, offsets) on `device`, copied once per device."""
        if self._placed is None or self._placed[0] != device:
            tensors = (self._token_map, self.multipliers, self.primes, self.offsets)
            self._placed = (device, tuple(t.to(device) for t in tensors))
        return self._placed[1]  # type: ignore[return-value]

    def compress(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.constants_on(tokens.device)[0][tokens.long()]

    def forward(self, tokens: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, S), history (B, K) -> hash ids (B, S, L, n_cols) and the new history."""
        token_map, multipliers, primes, offsets = self.constants_on(tokens.device)
        pad = token_map[self.cfg.engram_pad_id]
        return ngram_hash_ids(token_map[tokens.long()], history.to(tokens.device), multipliers, primes, offsets, pad)


# ---------------------------------------------------------------------- table and gate

def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (..., n_cols) of `table` (rows, head_dim) -> (..., n_cols, head_dim) as float32.

    A plain index, so `table` may be any tensor: the parameter here, or a host-side memory-mapped table (the ids then
    live on the host too); the loader dequantizes the release's fp8 rows before they arrive.
    """
    return F.embedding(ids.to(device=table.device, dtype=torch.int64), table).float()


class EngramTable(nn.Module):
    """A layer's n-gram table as a float parameter named `weight` (the release's `engram.embed.weight`)."""

    def __init__(self, rows: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, head_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.weight, ids)


class Engram(nn.Module):
    """Layer l's Engram: adds a gated n-gram value to each hyper-connection stream copy (parameter names the release's).

    The gate is per (token, copy): how well the copy's stream agrees with the copy's key, after normalising both, so
    a lookup that does not fit the context (a hash collision, an n-gram used otherwise here) is mostly shut out.
    """

    def __init__(self, cfg: "CEDConfig", layer: int) -> None:
        super().__init__()
        layout = EngramLayout.from_config(cfg)
        self.cfg, self.layer = cfg, layer
        self.table_index = layout.layers.index(layer)  # this layer's slice of the hasher's output
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps
        self.embed = EngramTable(cfg.engram_num_embeddings[self.table_index], layout.head_dim)
        # fp8 in the release, so under the runtime fake-quant its input is quantized like every such GEMM's
        self.wkv = ActQuantLinear(layout.n_cols * layout.head_dim, cfg.dim * (cfg.hc_mult + 1), cfg.runtime_fake_quant)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim))

    def forward(self, X: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """X (B, S, hc, dim) streams, hash_ids (B, S, n_cols) this layer's rows -> new streams."""
        return self.mix(X, self.embed(hash_ids))

    def mix(self, X: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The gate on already-gathered rows (B, S, n_cols, head_dim); all arithmetic in fp32 as in the release."""
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # (B, S, (hc + 1) * dim)
        key = kv[..., : self.hc * self.dim].float().unflatten(-1, (self.hc, self.dim))  # (B, S, hc, dim)
        value = kv[..., self.hc * self.dim :].float().unsqueeze(-2)  # (B, S, 1, dim): shared by every copy
        x = X.float()
        # normalised per copy over dim (not jointly over the copies); q_weight and k_weight only act as a product
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.dim**-0.5
        # signed square root (copysign: a dot of +0 opens the gate a little, as the release's kernel does)
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))
        return (x + gate.unsqueeze(-1) * value).to(X.dtype)
