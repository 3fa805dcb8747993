"""Per-session state of the engine steps, kept as numpy arrays, and how a batch of sessions becomes step inputs.

A row is one session. The encoder side keeps the window rings of layers 0..E and every global-KV store with its
index keys (and the ratio-2 compressor's unpaired token); the decoder side keeps layer E's mirror, the last W
hand-over rows (for bounded replay) and the active adapter's rings. Stores grow by doubling; a batch pads every
row's store to one length (`StepLayout.padded_entries`), and a single row is passed without a copy.

Everything here is engine-independent: the torch, onnxruntime and TensorRT runtimes all take the dicts that
`*_inputs` build and return the dicts that `absorb_*` read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .arena import ArenaField, StepArena
from .layout import StepLayout

F32 = np.float32


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
    out = np.zeros((len(arrays), length) + arrays[0].shape[1:], F32)
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

    @classmethod
    def empty(cls, layout: StepLayout) -> "EncoderRow":
        cfg = layout.cfg
        D, Di = cfg.head_dim, cfg.index_head_dim
        rings = np.zeros((len(layout.encoder_ring_layers), cfg.window_size, D), F32)
        kv = {s: np.zeros((0, D), F32) for s in layout.sources}
        index_k = {s: np.zeros((0, Di), F32) for s in layout.sources}
        pending = {s: np.zeros((2, D), F32) for s in layout.sources if layout.ratio[s] == 2}
        return cls(0, rings, kv, index_k, pending)

    def used(self, layout: StepLayout, source: int) -> int:
        return self.position // layout.ratio[source]

    def nbytes(self) -> int:
        return self.rings.nbytes + sum(a.nbytes for d in (self.kv, self.index_k, self.pending) for a in d.values())

    def clone(self) -> "EncoderRow":
        return copy.deepcopy(self)


def encoder_inputs(layout: StepLayout, rows: list[EncoderRow], tokens: np.ndarray, arena: StepArena | None = None) -> dict[str, np.ndarray]:
    """Inputs of one encoder step: `tokens` (B, S) for `rows` (every row advances by S). With an `arena`, a batch
    keeps its stacked state between steps (see `arena.py`); the inputs are the same either way."""
    S = tokens.shape[1]
    feed = {
        "tokens": np.ascontiguousarray(tokens, np.int64),
        "start": np.asarray([r.position for r in rows], np.int64),
    }
    lengths = {s: layout.padded_entries(max(r.used(layout, s) for r in rows) + layout.new_entries(s, S)) for s in layout.sources}
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
        fields.append(ArenaField(f"index_k_{s}", lambda r, s=s: r.index_k[s], lambda r, a, s=s: r.index_k.__setitem__(s, a), length))
        if layout.ratio[s] == 2:
            fields.append(ArenaField(f"pending_{s}", lambda r, s=s: r.pending[s], lambda r, a, s=s: r.pending.__setitem__(s, a)))
    return fields


def absorb_encoder(layout: StepLayout, rows: list[EncoderRow], out: dict[str, np.ndarray], steps: int) -> None:
    """Write one step's outputs into the rows' state (new ring rows, new entries, pending token) and advance them."""
    for b, r in enumerate(rows):
        _write_ring(r.rings, out["ring_rows"][b], r.position)
        for s in layout.sources:
            used = r.used(layout, s)
            if layout.ratio[s] == 1:
                new_kv, new_ik, count = out["global_kv"][b], out["index_k"][b], steps
            else:
                new_kv, new_ik = out[f"new_kv_{s}"][b], out[f"new_index_k_{s}"][b]
                count = (r.position % 2 + steps) // 2
                r.pending[s][...] = out[f"new_pending_{s}"][b]  # in place: the row's array may be an arena view
            r.kv[s] = _grow(r.kv[s], used + count)
            r.index_k[s] = _grow(r.index_k[s], used + count)
            r.kv[s][used:used + count] = new_kv[:count]
            r.index_k[s][used:used + count] = new_ik[:count]
        r.position += steps


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
        rings = np.zeros((len(layout.decoder_ring_layers), cfg.window_size, cfg.head_dim), F32)
        return cls(0, np.zeros((0, cfg.head_dim), F32), np.zeros((0, cfg.index_head_dim), F32), recent, rings, 0)

    def absorb(self, layout: StepLayout, handover: dict[str, np.ndarray]) -> None:
        """Append hand-over rows (S, …) of positions position.. : mirror entries and the replay window."""
        S = handover["global_kv"].shape[0]
        self.kv, self.index_k = _grow(self.kv, self.position + S), _grow(self.index_k, self.position + S)
        self.kv[self.position:self.position + S] = handover["global_kv"]
        self.index_k[self.position:self.position + S] = handover["index_k"]
        W = layout.cfg.window_size
        keep = min(W, S)  # a ring like the window rings: no copy of the other W - 1 rows per decode step
        slots = np.arange(self.position + S - keep, self.position + S) % W
        for f in HANDOVER_FIELDS:
            self.recent[f][slots] = handover[f][S - keep:]
        self.position += S

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
                   slots: list[int], arena: StepArena | None = None) -> dict[str, np.ndarray]:
    """Inputs of one decoder step (LoRA bank excluded: the runtime binds it).

    `handover` None means a bounded replay of each row's last W rows on empty rings. Replays of different lengths
    share a batch: shorter rows are padded at the front with inert rows (zero streams, no top-k) at positions before
    their first real row, and `ring_start` (the first real row) makes them invisible, so the real rows compute
    exactly what they would alone. Otherwise each row's new rows (already absorbed into its mirror) run on its rings;
    with an `arena`, a batch of such decode steps keeps its stacked rings and mirror between steps (`arena.py`).
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
        "lora_slot": np.asarray(slots, np.int64),
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


def absorb_decoder(rows: list[DecoderRow], out: dict[str, np.ndarray], feed: dict[str, np.ndarray], replay: bool, slots: list[int]) -> None:
    """Write the step's ring rows into each row's rings (a replay starts them afresh) and record the adapter slot."""
    for b, r in enumerate(rows):
        start = int(feed["start"][b])
        if replay:
            r.rings = np.zeros_like(r.rings)
            r.ring_start = int(feed["ring_start"][b])
            real = r.position - r.ring_start  # the padding rows' latents are never read (before ring_start)
            _write_ring(r.rings, out["ring_rows"][b][:, -real:], r.ring_start)
        else:
            _write_ring(r.rings, out["ring_rows"][b], start)
        r.slot = slots[b]
