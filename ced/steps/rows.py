"""Per-session state of the engine steps, kept as numpy arrays, and how a batch of sessions becomes step inputs.

A row is one session. The encoder side keeps the window rings of layers 0..E and every global-KV store with its
index keys (and the ratio-2 compressor's unpaired token); the decoder side keeps layer E's mirror, the last W
hand-over rows (for bounded replay) and the active adapter's rings. Stores grow by doubling; a batch pads every
row's store to one length (`StepLayout.padded_entries`), and a single row is passed without a copy.

Everything here is engine-independent: the torch, onnxruntime and TensorRT runtimes all take the dicts that
`*_inputs` build and return the dicts that `absorb_*` read.

fp8 KV state (an engine built with `--kv-quant fp8`, `KVStateLayout`): the window rings and the global-KV stores
(and the decoder's mirror) are kept as the fp8 e4m3 bytes the graph reads and writes, in numpy uint8 arrays (a
quarter of the fp32 bytes). Why uint8 and not a float8 dtype: onnxruntime 1.32 refuses ml_dtypes' float8 arrays
("Numpy_type 260 can't be converted to MLDataType") but takes the same bytes as a FLOAT8E4M3FN OrtValue without a
copy and hands fp8 outputs back as uint8 arrays. Index keys, the pending pair and the hand-over rows stay fp32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ced.model.config import CEDConfig
from ced.steps.arena import ArenaField, StepArena
from ced.steps.layout import StepLayout
from ced.steps.lora_grid import lora_grid

if TYPE_CHECKING:
    from ced.steps.engram_feed import EngramFeed

F32 = np.float32
FP8_MAX = 448.0  # largest finite float8 e4m3fn value


def _fp8_table() -> np.ndarray:
    """The value of each non-negative float8 e4m3fn code 0..126 (0x7f is NaN), increasing with the code."""
    codes = np.arange(127)
    exponent, mantissa = codes >> 3, codes & 7
    return np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                    (1 + mantissa / 8) * 2.0 ** (exponent - 7)).astype(np.float64)


_FP8_VALUES = _fp8_table()
_FP8_MIDPOINTS = (_FP8_VALUES[1:] + _FP8_VALUES[:-1]) / 2


def fp8_encode(values: np.ndarray, scale: float) -> np.ndarray:
    """fp32 values already on the fp8 grid of `scale` (what a graph's DequantizeLinear(QuantizeLinear(x)) gives) ->
    their e4m3fn codes as uint8. Exact for such values: value / scale lies within 2^-22 of a code's value, far inside
    the half-step of the format, so the nearest code is the one the graph chose; the sign bit keeps -0.0."""
    v = np.asarray(values, np.float32)
    magnitude = np.abs(v.astype(np.float64) / np.float64(np.float32(scale)))
    codes = np.searchsorted(_FP8_MIDPOINTS, np.minimum(magnitude, FP8_MAX)).astype(np.uint8)
    return codes | (np.signbit(v).astype(np.uint8) << 7)


def fp8_decode(codes: np.ndarray, scale: float) -> np.ndarray:
    """e4m3fn codes (uint8) -> fp32 values times `scale`, as DequantizeLinear computes them (fp32 product)."""
    c = np.asarray(codes, np.uint8)
    magnitude = _FP8_VALUES[np.minimum(c & 0x7F, 126)].astype(np.float32)
    return np.where(c >= 0x80, -magnitude, magnitude) * np.float32(scale)


@dataclass(frozen=True)
class KVFormat:
    """How a `--kv-quant fp8` engine's rows hold their state: rings and global-KV stores as fp8 e4m3 codes (uint8).

    The graphs carry their own per-tensor scales (initializers); the rows need one of them: layer E's store scale,
    because the hand-over's `global_kv` crosses the encoder/decoder boundary in fp32 (the serving contract's
    HANDOVER_GLOBAL_KV is FP32), on that scale's fp8 grid, and both the encoder's store and the decoder's mirror keep
    its codes (`fp8_encode`, exact)."""

    handover_scale: float
    dtype: type = np.uint8


class KVStateLayout(StepLayout):
    """The step layout of an engine whose rows keep fp8 state; `EncoderRow.empty` / `DecoderRow.empty` read it."""

    def __init__(self, cfg: CEDConfig, kv: KVFormat) -> None:
        super().__init__(cfg)
        self.kv = kv


def kv_format(layout: StepLayout) -> KVFormat | None:
    """The fp8 state format of `layout`, None for fp32 state."""
    return layout.kv if isinstance(layout, KVStateLayout) else None


def state_dtype(layout: StepLayout) -> type:
    """dtype of rings and global-KV stores (and the mirror): float32, or uint8 fp8 codes."""
    fmt = kv_format(layout)
    return F32 if fmt is None else fmt.dtype


def _handover_kv(layout: StepLayout, values: np.ndarray) -> np.ndarray:
    """The hand-over's global_kv rows as the stores keep them (fp32 as they are, or their fp8 codes)."""
    fmt = kv_format(layout)
    return values if fmt is None else fp8_encode(values, fmt.handover_scale)


def _grow(a: np.ndarray, needed: int) -> np.ndarray:
    if a.shape[0] >= needed:
        return a
    size = max(needed, 2 * a.shape[0], 16)
    out = np.zeros((size,) + a.shape[1:], a.dtype)
    out[: a.shape[0]] = a
    return out


def _write_ring(ring: np.ndarray, rows: np.ndarray, start: int) -> None:
    """ring (R, W, D) <- rows (R, S, D) of positions start.. at slots position % W (only the last W survive)."""
    W, S = ring.shape[1], rows.shape[1]
    keep = min(W, S)
    slots = (np.arange(start + S - keep, start + S)) % W
    ring[:, slots] = rows[:, S - keep:]


def _stack_padded(arrays: list[np.ndarray], length: int) -> np.ndarray:
    """Rows' arrays (n_i, …) -> (B, length, …); a single long-enough row is a view, not a copy."""
    if len(arrays) == 1 and arrays[0].shape[0] >= length:
        return arrays[0][None, :length]
    out = np.zeros((len(arrays), length) + arrays[0].shape[1:], arrays[0].dtype)
    for i, a in enumerate(arrays):
        n = min(length, a.shape[0])
        out[i, :n] = a[:n]
    return out


@dataclass
class EncoderRow:
    """One session's encoder state at `position` (the next token's position)."""

    position: int
    rings: np.ndarray  # (R_enc, W, D)
    kv: dict[int, np.ndarray]  # source -> (capacity, D); entries [0, used) are valid
    index_k: dict[int, np.ndarray]  # source -> (capacity, Di)
    pending: dict[int, np.ndarray] = field(default_factory=dict)  # ratio-2 source -> (2, D)
    # Engram's n-gram history: the last max_ngram - 1 token ids, oldest first, -1 where the session has none yet
    # (empty without Engram). Raw ids, not compressed ones: the feed compresses them, so a row needs no token map.
    engram_recent: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def empty(cls, layout: StepLayout) -> "EncoderRow":
        cfg = layout.cfg
        D, Di, state = cfg.head_dim, cfg.index_head_dim, state_dtype(layout)
        rings = np.zeros((len(layout.encoder_ring_layers), cfg.window_size, D), state)
        kv = {s: np.zeros((0, D), state) for s in layout.sources}
        index_k = {s: np.zeros((0, Di), F32) for s in layout.sources}
        pending = {s: np.zeros((2, D), F32) for s in layout.sources if layout.ratio[s] == 2}
        return cls(0, rings, kv, index_k, pending, np.full(layout.engram_history, -1, np.int64))

    def used(self, layout: StepLayout, source: int) -> int:
        return self.position // layout.ratio[source]

    def nbytes(self) -> int:
        return self.rings.nbytes + self.engram_recent.nbytes + sum(
            a.nbytes for d in (self.kv, self.index_k, self.pending) for a in d.values())

    def clone(self) -> "EncoderRow":
        return copy.deepcopy(self)


def encoder_inputs(layout: StepLayout, rows: list[EncoderRow], tokens: np.ndarray, arena: StepArena | None = None,
                   engram: "EngramFeed | None" = None) -> dict[str, np.ndarray]:
    """Inputs of one encoder step: `tokens` (B, S) for `rows` (every row advances by S). With an `arena`, a batch
    keeps its stacked state between steps (see `arena.py`); the inputs are the same either way. A config with Engram
    needs the checkpoint's `engram` feed: it hashes the tokens after each row's history and gathers the rows."""
    S = tokens.shape[1]
    feed = {
        "tokens": np.ascontiguousarray(tokens, np.int64),
        "start": np.asarray([r.position for r in rows], np.int64),
    }
    if layout.engram_layers:
        if engram is None:
            raise ValueError(f"config {layout.cfg.name!r} has Engram at layers {list(layout.engram_layers)}: "
                             "its encoder steps need the checkpoint's Engram feed "
                             "(EngramFeed.open / StepEngine.engram)")
        feed.update(engram.inputs(feed["tokens"], np.stack([r.engram_recent for r in rows])))
    lengths = {s: layout.padded_entries(max(r.used(layout, s) for r in rows) + layout.new_entries(s, S))
               for s in layout.sources}
    if arena is not None and len(rows) > 1:
        feed.update(arena.stack(rows, encoder_fields(layout, lengths)))
        return feed
    feed["rings"] = rows[0].rings[None] if len(rows) == 1 else np.stack([r.rings for r in rows])
    for s, length in lengths.items():
        for r in rows:  # room for this step's entries, so a single row's store is passed as it is
            r.kv[s], r.index_k[s] = _grow(r.kv[s], length), _grow(r.index_k[s], length)
        feed[f"kv_{s}"] = _stack_padded([r.kv[s] for r in rows], length)
        feed[f"index_k_{s}"] = _stack_padded([r.index_k[s] for r in rows], length)
        if layout.ratio[s] == 2:
            feed[f"pending_{s}"] = np.stack([r.pending[s] for r in rows])
    return feed


def encoder_fields(layout: StepLayout, lengths: dict[int, int]) -> list[ArenaField]:
    """The encoder state a batched step reads, as arena fields (stores at this step's padded lengths)."""

    def ring_put(r: EncoderRow, a: np.ndarray) -> None:
        r.rings = a

    fields = [ArenaField("rings", lambda r: r.rings, ring_put)]
    for s, length in lengths.items():
        fields.append(ArenaField(f"kv_{s}", lambda r, s=s: r.kv[s], lambda r, a, s=s: r.kv.__setitem__(s, a), length))
        fields.append(ArenaField(f"index_k_{s}", lambda r, s=s: r.index_k[s],
                                 lambda r, a, s=s: r.index_k.__setitem__(s, a), length))
        if layout.ratio[s] == 2:
            fields.append(ArenaField(f"pending_{s}", lambda r, s=s: r.pending[s],
                                     lambda r, a, s=s: r.pending.__setitem__(s, a)))
    return fields


def absorb_encoder(layout: StepLayout, rows: list[EncoderRow], out: dict[str, np.ndarray], steps: int,
                   tokens: np.ndarray | None = None, keep: list[int] | None = None) -> None:
    """Write one step's outputs into the rows' state (new ring rows, new entries, pending token) and advance them.
    With Engram the step's `tokens` (B, S) are needed too: they extend each row's n-gram history.

    `keep` (per row, 0..steps; default all): absorb only the first keep[b] positions of row b, leaving the row
    exactly as a step over those positions alone would: the speculative loop's rollback of a rejected draft block.
    Exact because every output row depends on its own position and the ones before it only (the engines give the
    same bits in chunks as one at a time), and nothing of a later position is written: ring slots of the cut
    positions keep what they held, ratio-2 pooled entries are taken only for complete pairs, the pending pair is the
    last kept token's, and the n-gram history takes the kept tokens."""
    keep = [steps] * len(rows) if keep is None else list(keep)
    if len(keep) != len(rows) or not all(0 <= k <= steps for k in keep):
        raise ValueError(f"keep must give 0..{steps} positions for each of the {len(rows)} rows, got {keep}")
    if layout.engram_layers:
        if tokens is None or np.shape(tokens) != (len(rows), steps):
            raise ValueError(f"config {layout.cfg.name!r} has Engram: absorb_encoder needs the step's tokens "
                             f"({len(rows)}, {steps}) to extend each row's n-gram history, got "
                             f"{None if tokens is None else np.shape(tokens)}")
        k = layout.engram_history
        for b, r in enumerate(rows):
            r.engram_recent = np.concatenate((r.engram_recent, np.asarray(tokens[b, :keep[b]], np.int64)))[-k:]
    for b, r in enumerate(rows):
        kept = keep[b]
        if kept == 0:
            continue
        _write_ring(r.rings, out["ring_rows"][b][:, :kept], r.position)
        for s in layout.sources:
            used = r.used(layout, s)
            if layout.ratio[s] == 1:
                new_kv, new_ik, count = _handover_kv(layout, out["global_kv"][b]), out["index_k"][b], kept
            else:
                new_kv, new_ik = out[f"new_kv_{s}"][b], out[f"new_index_k_{s}"][b]
                count = (r.position % 2 + kept) // 2
                # in place: the row's array may be an arena view
                r.pending[s][...] = out[f"pending_rows_{s}"][b, kept - 1]
            r.kv[s] = _grow(r.kv[s], used + count)
            r.index_k[s] = _grow(r.index_k[s], used + count)
            r.kv[s][used:used + count] = new_kv[:count]
            r.index_k[s][used:used + count] = new_ik[:count]
        r.position += kept


HANDOVER_FIELDS = ("streams", "ffn_pre", "topk", "candidates")  # what a decoder step reads per row
HANDOVER_KEYS = HANDOVER_FIELDS + ("global_kv", "index_k")  # plus what its global-KV mirror absorbs


@dataclass
class DecoderRow:
    """One session's decoder side: layer E's mirror, the last W hand-over rows, the active adapter's rings."""

    position: int  # entries in the mirror = positions absorbed
    kv: np.ndarray  # (capacity, D)
    index_k: np.ndarray  # (capacity, Di)
    recent: dict[str, np.ndarray]  # HANDOVER_FIELDS -> (W, …): the last W hand-over rows at slot position % W
    rings: np.ndarray  # (R_dec, W, D)
    ring_start: int  # first position the rings hold (the last replay's first row)
    slot: int = 0  # adapter slot of the rings (0 = base)

    @classmethod
    def empty(cls, layout: StepLayout) -> "DecoderRow":
        cfg = layout.cfg
        W = cfg.window_size
        recent = {
            "streams": np.zeros((W, cfg.hc_mult, cfg.dim), F32),
            "ffn_pre": np.zeros((W, cfg.hc_mult), F32),
            "topk": np.zeros((W, cfg.index_topk), np.int64),
            "candidates": np.zeros((W, cfg.candidate_topk_blocks), np.int64),
        }
        state = state_dtype(layout)
        rings = np.zeros((len(layout.decoder_ring_layers), cfg.window_size, cfg.head_dim), state)
        return cls(0, np.zeros((0, cfg.head_dim), state), np.zeros((0, cfg.index_head_dim), F32), recent, rings, 0)

    def absorb(self, layout: StepLayout, handover: dict[str, np.ndarray]) -> None:
        """Append hand-over rows (S, …) of positions position.. : mirror entries and the replay window."""
        S = handover["global_kv"].shape[0]
        self.absorb_draft(layout, handover)
        self._remember(layout, handover, self.position - S, S)

    def absorb_draft(self, layout: StepLayout, handover: dict[str, np.ndarray]) -> None:
        """Append hand-over rows of a speculative block to the mirror only (the decoder step reads them there) and
        advance; `settle` then keeps the accepted prefix. The replay window is not touched until then: a rejected
        row written there would overwrite a row of W positions earlier that a later replay needs."""
        S = handover["global_kv"].shape[0]
        self.kv, self.index_k = _grow(self.kv, self.position + S), _grow(self.index_k, self.position + S)
        self.kv[self.position:self.position + S] = _handover_kv(layout, handover["global_kv"])
        self.index_k[self.position:self.position + S] = handover["index_k"]
        self.position += S

    def settle(self, layout: StepLayout, handover: dict[str, np.ndarray], keep: int) -> None:
        """After `absorb_draft(handover)` and the decoder step: keep the first `keep` rows, as if only they had been
        absorbed (`absorb`): the mirror's entries of the rejected rows are cleared, the kept rows enter the window."""
        S = handover["global_kv"].shape[0]
        if not 0 <= keep <= S:
            raise ValueError(f"keep must lie in 0..{S}, got {keep}")
        start = self.position - S
        self.kv[start + keep:start + S] = 0
        self.index_k[start + keep:start + S] = 0
        self._remember(layout, handover, start, keep)
        self.position = start + keep

    def _remember(self, layout: StepLayout, handover: dict[str, np.ndarray], start: int, count: int) -> None:
        """The replay window takes hand-over rows 0..count of positions start.. (only the last W survive: a ring
        like the window rings, no copy of the other W - 1 rows per decode step)."""
        W = layout.cfg.window_size
        kept = min(W, count)
        slots = np.arange(start + count - kept, start + count) % W
        for f in HANDOVER_FIELDS:
            self.recent[f][slots] = handover[f][count - kept:count]

    @property
    def replay_count(self) -> int:
        """Rows a bounded replay runs: the last W positions (fewer early in a session)."""
        return min(self.position, self.recent["streams"].shape[0])

    def replay_rows(self) -> dict[str, np.ndarray]:
        """The last `replay_count` hand-over rows in position order."""
        W = self.recent["streams"].shape[0]
        slots = np.arange(self.position - self.replay_count, self.position) % W
        return {f: a[slots] for f, a in self.recent.items()}

    def nbytes(self) -> int:
        return self.kv.nbytes + self.index_k.nbytes + self.rings.nbytes + sum(a.nbytes for a in self.recent.values())

    def clone(self) -> "DecoderRow":
        return copy.deepcopy(self)


def decoder_inputs(layout: StepLayout, rows: list[DecoderRow], handover: list[dict[str, np.ndarray]] | None,
                   slots: list[int], arena: StepArena | None = None,
                   verify: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Inputs of one decoder step (LoRA bank excluded: the runtime binds it).

    `handover` None means a bounded replay of each row's last W rows on empty rings. Replays of different lengths
    share a batch: shorter rows are padded at the front with inert rows (zero streams, no top-k) at positions before
    their first real row, and `ring_start` (the first real row) makes them invisible, so the real rows compute
    exactly what they would alone. Otherwise each row's new rows (already absorbed into its mirror) run on its rings;
    with an `arena`, a batch of such decode steps keeps its stacked rings and mirror between steps (`arena.py`).
    `verify` (B, K): in-step offsets whose logits the step also returns (`verify_logits`), none by default.
    """
    if handover is None:
        length = replay_length([r.replay_count for r in rows], layout.cfg.window_size)
        rows_in = [_front_padded(r.replay_rows(), length) for r in rows]
        starts = [r.position - length for r in rows]
        ring_starts = [r.position - r.replay_count for r in rows]
    else:
        rows_in = handover
        starts = [r.position - h["streams"].shape[0] for r, h in zip(rows, handover)]
        ring_starts = [r.ring_start for r in rows]
    if len({h["streams"].shape[0] for h in rows_in}) != 1:
        raise ValueError("rows of one decoder step must have the same number of hand-over rows")
    length = layout.padded_entries(max(r.position for r in rows))
    feed = {f: (rows_in[0][f][None] if len(rows) == 1 else np.stack([h[f] for h in rows_in])) for f in HANDOVER_FIELDS}
    feed.update({
        "start": np.asarray(starts, np.int64),
        "ring_start": np.asarray(ring_starts, np.int64),
        **lora_grid(slots, rows_in[0]["streams"].shape[0]),
        "verify": np.zeros((len(rows), 0), np.int64) if verify is None else np.ascontiguousarray(verify, np.int64),
    })
    if handover is not None and arena is not None and len(rows) > 1:
        feed.update(arena.stack(rows, decoder_fields(length)))
        return feed
    for r in rows:
        r.kv, r.index_k = _grow(r.kv, length), _grow(r.index_k, length)
    if handover is None:
        rings = [np.zeros_like(r.rings) for r in rows]
    else:
        rings = [r.rings for r in rows]
    feed.update({
        "rings": rings[0][None] if len(rows) == 1 else np.stack(rings),
        "kv": _stack_padded([r.kv for r in rows], length),
        "index_k": _stack_padded([r.index_k for r in rows], length),
    })
    return feed


def decoder_fields(length: int) -> list[ArenaField]:
    """The decoder state a batched decode step reads, as arena fields (the mirror at this step's padded length)."""

    def put(name: str) -> Callable[[DecoderRow, np.ndarray], None]:
        return lambda r, a: setattr(r, name, a)

    return [ArenaField("rings", lambda r: r.rings, put("rings")),
            ArenaField("kv", lambda r: r.kv, put("kv"), length),
            ArenaField("index_k", lambda r: r.index_k, put("index_k"), length)]


def replay_length(counts: list[int], window: int, step: int = 16) -> int:
    """The S of a batched replay: the longest row's count rounded up to a multiple of `step` (few distinct shapes),
    at most the window; a single row runs at its own length."""
    if len(counts) == 1:
        return counts[0]
    return min(window, -(-max(counts) // step) * step)


def _front_padded(recent: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    n = recent["streams"].shape[0]
    if n == length:
        return recent
    out = {}
    for f, a in recent.items():
        pad = np.full((length - n,) + a.shape[1:], -1 if a.dtype.kind == "i" else 0, a.dtype)
        out[f] = np.concatenate((pad, a))
    return out


def absorb_decoder(rows: list[DecoderRow], out: dict[str, np.ndarray], feed: dict[str, np.ndarray], replay: bool,
                   slots: list[int], keep: list[int] | None = None) -> None:
    """Write the step's ring rows into each row's rings (a replay starts them afresh) and record the adapter slot.
    `keep` (decode steps only): each row's ring takes only its first keep[b] positions (a speculative block cut at
    its first rejected draft; the row's mirror is settled by `DecoderRow.settle`)."""
    if keep is not None and replay:
        raise ValueError("a replay keeps every row; keep applies to decode steps")
    for b, r in enumerate(rows):
        start = int(feed["start"][b])
        if replay:
            r.rings = np.zeros_like(r.rings)
            r.ring_start = int(feed["ring_start"][b])
            real = r.position - r.ring_start  # the padding rows' latents are never read (before ring_start)
            _write_ring(r.rings, out["ring_rows"][b][:, -real:], r.ring_start)
        else:
            _write_ring(r.rings, out["ring_rows"][b] if keep is None else out["ring_rows"][b][:, :keep[b]], start)
        r.slot = slots[b]


Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # one graph (or its module): feed -> outputs
