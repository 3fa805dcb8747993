"""The reference engine: the step modules run eagerly by PyTorch, one row at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ced.formats.checkpoint import CheckpointFiles, load_checkpoint
from ced.formats.drafter_files import drafter_spec, load_drafter
from ced.model.config import CEDConfig
from ced.model.dspark import DSpark
from ced.model.network import DecoderEngine, EncoderEngine
from ced.routing.pointer_head import load_router_head
from ced.steps.decoder_step import DecoderStep
from ced.steps.draft_step import DraftMain, DraftStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.lora_grid import lora_grid, row_slots
from ced.steps.parity import torch_runner
from ced.steps.pointer_step import PointerStep
from tritonserver_backend.engines.interface import Arrays, StepEngine

PER_ROW = {"encoder": ("tokens", "start", "rings"),
           "decoder": ("streams", "ffn_pre", "topk", "candidates", "start", "ring_start", "rings", "kv", "index_k",
                       "verify")}
# on checkpoints where last bits flip tokens (`whole_blocks`), every step of up to STEP_TILE positions runs at exactly
# STEP_TILE positions and the decoder's head at exactly HEAD_TILE rows (longer steps at whole multiples), so a decode
# step and any speculative verify block run the same shapes through every kernel (see "Why steps are padded")
STEP_TILE = 8  # a decode step's positions: the fed token and up to core.drafting.MAX_BLOCK = 7 drafts (tested)
HEAD_TILE = 16  # the head's rows: the padded last position, at most STEP_TILE verified ones, the last real one


class TorchEngine(StepEngine):
    backend = "torch"

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self._runners: dict[str, Callable[[Arrays], Arrays]] = {}
        self.layout.drafter = drafter_spec(model_dir)

    def _runner(self, graph: str) -> Callable[[Arrays], Arrays]:
        """Built on first use, so a process that only routes never loads the network."""
        if graph not in self._runners:
            layout = self.layout
            if graph == "pointer":
                head, _ = load_router_head(self.model_dir, self.cfg.dim)
                self._runners[graph] = torch_runner(PointerStep(head).eval(),
                                                    layout.pointer_inputs(self.cfg.dim, head.cfg.width),
                                                    layout.pointer_outputs())
            elif graph == "drafter":
                embed, head = target_embed_and_head(self.model_dir, self.cfg)
                self._runners[graph] = torch_runner(DraftStep(self._drafter(), embed, head).eval(),
                                                    layout.drafter_inputs(), layout.drafter_outputs())
            else:
                net = load_checkpoint(self.model_dir)
                state = net.state_dict()
                if graph == "encoder":
                    step: torch.nn.Module = EncoderStep(EncoderEngine.from_state_dict(self.cfg, state).eval())
                    specs = layout.encoder_inputs(), layout.encoder_outputs()
                else:
                    step = DecoderStep(DecoderEngine.from_state_dict(self.cfg, state).eval(),
                                       DraftMain(self._drafter()) if self.has_drafter else None)
                    specs = layout.decoder_inputs(), layout.decoder_outputs()
                self._runners[graph] = torch_runner(step.eval(), *specs)
        return self._runners[graph]

    def _drafter(self) -> DSpark:
        drafter = load_drafter(self.model_dir)
        assert drafter is not None, "the layout has a drafter spec, so the model directory ships a drafter"
        return drafter

    def encoder(self, feed: Arrays) -> Arrays:
        return run_encoder_rows(self._runner("encoder"), feed, whole_blocks(self.cfg))

    def decoder(self, feed: Arrays) -> Arrays:
        return run_decoder_rows(self._runner("decoder"), feed, self.lora_bank, whole_blocks(self.cfg))

    def pointer(self, feed: Arrays) -> Arrays:
        return _by_row(self._runner("pointer"), feed, batch_inputs={"h19", "option_mask"})

    def drafter(self, feed: Arrays) -> Arrays:
        if not self.has_drafter:
            return super().drafter(feed)
        return _by_row(self._runner("drafter"), feed, batch_inputs=set(feed))


def whole_blocks(cfg: CEDConfig) -> bool:
    """Whether steps run padded to whole tiles (`STEP_TILE` positions, `HEAD_TILE` head rows): where the last bits
    flip greedy tokens, i.e. a checkpoint with the release's runtime fake-quant. Elsewhere (the embedded default) the
    padding would make a one-position step about 1.5x as long (18.2 -> 27.4 ms in process, 1 thread, Dec 7; padding
    to 4 cost 64-token turns 3.68 -> 4.42 s, Dec 6) for last bits that leave its tokens as they are (see "Why steps
    are padded" below)."""
    return cfg.runtime_fake_quant


def run_encoder_rows(run: Callable[[Arrays], Arrays], feed: Arrays, pad: bool = False) -> Arrays:
    """An encoder step, row by row (each row's stores and Engram rows are its own); with `pad` its positions padded
    to whole tiles of `STEP_TILE` (`whole_blocks`)."""
    stores = {k for k in feed if k.startswith(("kv_", "index_k_", "pending_", "engram_rows_"))}
    steps = feed["tokens"].shape[1]
    if not pad or steps % STEP_TILE == 0:
        return _by_row(run, feed, batch_inputs=set(PER_ROW["encoder"]) | stores)
    padded = _whole_tiles(steps, STEP_TILE)
    out = _by_row(run, _pad_encoder_feed(feed, padded), batch_inputs=set(PER_ROW["encoder"]) | stores)
    return {k: _first_positions(k, v, steps) for k, v in out.items()}


def run_decoder_rows(run: Callable[[Arrays], Arrays], feed: Arrays, bank: Arrays, pad: bool = False) -> Arrays:
    """A decoder step, row by row like every step here, each row with its own one-slot LoRA grid over `bank`; with
    `pad` its positions padded to whole tiles of `STEP_TILE` and its head's rows (the last position and the verified
    ones) to whole tiles of `HEAD_TILE` (`whole_blocks`)."""
    slots, steps = row_slots(feed), feed["streams"].shape[1]
    asked = feed["verify"].shape[1]
    if not pad or (steps % STEP_TILE == 0 and (1 + asked) % HEAD_TILE == 0):
        return _by_row(run, {**feed, **bank}, batch_inputs=set(PER_ROW["decoder"]),
                       row_inputs=lambda b: lora_grid([int(slots[b])], steps))
    padded = _whole_tiles(steps, STEP_TILE)
    out = _by_row(run, {**_pad_decoder_feed(feed, padded), **bank}, batch_inputs=set(PER_ROW["decoder"]),
                  row_inputs=lambda b: lora_grid([int(slots[b])], padded))
    # the padded feed verifies the asked positions, then the last real one (whose logits are `logits`), then fill
    return {**{k: _first_positions(k, v, steps) for k, v in out.items()},
            "logits": out["verify_logits"][:, asked], "verify_logits": out["verify_logits"][:, :asked]}


# Why steps are padded: a speculative step verifies a block of positions in one call, and greedy decoding with drafts
# gives the plain tokens only if each position's logits and hand-over rows are the bits a one-position step gives
# (docs/speculative.md, "Rollback that writes nothing it must undo"). On a checkpoint with the release's runtime
# fake-quant (fp8 GEMM inputs, fp4 index keys) one last bit moves a value across a rounding boundary and the logits
# by ~1e-2, enough to change greedy tokens. Which kernel computes an element, and so its last bits, is chosen by the
# tensor's shape, and not only in GEMMs: MKL takes other kernels for 1 and for 2-3 rows than for 4+, and ATen's
# elementwise loops run whole pairs of SIMD vectors and a scalar remainder with other bits for sigmoid, softplus and
# SiLU (pairs of 16 floats with AVX2, of 32 with AVX-512). Padding to a multiple of 4 positions matched only where
# 4 positions fill those vectors: on an AVX-512 CPU ("AMD EPYC", Dec 7) the mHC sigmoid over (positions, 4) ran
# scalar in a one-position step (padded to 4) and vectorised in a 6-position block (padded to 8), and blocks of 5-8
# positions differed; tiling every GEMM into fixed row tiles did not help (measured). So no blocking is matched:
# a step of up to STEP_TILE positions runs at exactly STEP_TILE, inert positions after its real ones, and the
# decoder's head at exactly HEAD_TILE rows, so every decode step and every verify block runs the same shapes through
# every op, and a position's bits follow from its own inputs. Assumed: (1) a CPU kernel's result for an element is
# fixed by the shapes, dtypes, strides and thread count (constant in a process) and that element's own inputs (no
# kernel branches on other rows' values); (2) a position's outputs depend on it and the positions before it only (the
# steps' causal rule), so the padding is inert and dropped. The one shape that may still differ between a block and
# a one-position step at the same position is a global store's length (a power of two from `min_global_entries`,
# doubling at different steps): the columns of the index-score GEMM, which only ranks entries; on the CPU measured,
# its column bits change only below 12 columns, and stores hold at least the top-k size (32+ entries here).
# Held, position by position and bit for bit (logits, hand-over rows, ring rows, draft_main), for blocks of 2-8 at 15
# histories across store doublings, on the AVX-512 CPU with ATen's AVX-512 and AVX2 kernels, MKL's default and AVX2
# paths, 1 and 2 threads; the padding of 4 held with AVX2 kernels only.


def _whole_tiles(rows: int, tile: int) -> int:
    """`rows` rounded up to a multiple of `tile` (at least one tile)."""
    return max(-(-rows // tile), 1) * tile


def _pad_encoder_feed(feed: Arrays, padded: int) -> Arrays:
    """The encoder feed with positions appended up to `padded`: the last token repeated, no Engram rows. The stores
    need no room for their entries: those are never visible to the real positions, which see only earlier ones."""
    B, steps = feed["tokens"].shape
    extra = padded - steps
    out = dict(feed)
    out["tokens"] = np.concatenate((feed["tokens"], np.repeat(feed["tokens"][:, -1:], extra, 1)), 1)
    for k, v in feed.items():
        if k.startswith("engram_rows_"):
            out[k] = np.concatenate((v, np.zeros((B, extra, *v.shape[2:]), v.dtype)), 1)
    return out


def _pad_decoder_feed(feed: Arrays, padded: int) -> Arrays:
    """The decoder feed with hand-over rows appended up to `padded` positions (zero rows, no top-k entries or
    candidate blocks: a replay's padding rows, which compute without NaN), its LoRA grid over them, and `verify`
    extended by the last real position, then by position 0, so that the head reads whole tiles of `HEAD_TILE` rows."""
    B, steps = feed["streams"].shape[:2]
    extra = padded - steps
    out = dict(feed)
    for k, fill in (("streams", 0), ("ffn_pre", 0), ("topk", -1), ("candidates", -1)):
        v = feed[k]
        out[k] = np.concatenate((v, np.full((B, extra, *v.shape[2:]), fill, v.dtype)), 1)
    verify = np.concatenate((feed["verify"], np.full((B, 1), steps - 1, np.int64)), 1)
    fill_rows = _whole_tiles(1 + verify.shape[1], HEAD_TILE) - 1 - verify.shape[1]  # the head reads 1 + verify rows
    out["verify"] = np.concatenate((verify, np.zeros((B, fill_rows), np.int64)), 1)
    return {**out, **lora_grid(row_slots(feed).tolist(), padded)}  # the grid of the padded positions


def _first_positions(name: str, value: np.ndarray, steps: int) -> np.ndarray:
    """A padded step's output cut back to its real positions (`StepLayout`'s output dims: "S" on axis 1, on axis 2
    for `ring_rows`; a ratio-2 source's new entries, "M_<s>", are the first (steps + 1) // 2)."""
    if name == "ring_rows":
        return value[:, :, :steps]
    if name.startswith(("new_kv_", "new_index_k_")):
        return value[:, :(steps + 1) // 2]
    if name in ("logits", "verify_logits"):
        return value
    return value[:, :steps]


def target_embed_and_head(model_dir: Path, cfg: CEDConfig) -> tuple[nn.Embedding, nn.Linear]:
    """The target's embedding and head alone, read from the checkpoint: all the drafter graph needs of the target.
    Why not the whole network: a process that drafts without running the target's layers (the leader of a
    tensor-parallel decoder, whose ranks hold the layers) would otherwise read and hold every layer for nothing."""
    files = CheckpointFiles(model_dir)
    with torch.no_grad():
        embed = nn.Embedding.from_pretrained(files.read_float("embed.weight"), freeze=True)
        head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(files.read_float("head.weight"), requires_grad=False)
    return embed.eval(), head.eval()


def _by_row(run, feed: Arrays, batch_inputs: set[str], row_inputs: Callable[[int], Arrays] | None = None) -> Arrays:  # type: ignore[no-untyped-def]
    """Run each batch row alone and stack the results: PyTorch's CPU kernels are picked by shape (a GEMM's by its row
    count, an elementwise loop's by its element count), so a row's result would otherwise depend on how many other
    rows share the call. `row_inputs(b)` replaces inputs that are not sliced by row (the decoder's LoRA grid) with row
    b's own."""
    rows = next(feed[k] for k in batch_inputs if k in feed).shape[0]
    if rows == 1:
        return run(feed)
    parts = [run({**{k: (v[b:b + 1] if k in batch_inputs else v) for k, v in feed.items()},
                  **(row_inputs(b) if row_inputs else {})})
             for b in range(rows)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
