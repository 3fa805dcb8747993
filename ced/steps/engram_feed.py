"""Engram's host side for the engine steps: hash each step's tokens and gather their table rows on the host, so the
encoder graph takes the rows as an input (`engram_rows_<layer>`) and the tables never enter an engine or a device.

Why this split works: an Engram hash id depends on token ids alone (the tokens and the row's last max_ngram - 1 ids),
so the host can compute it before the step runs, and the table is only ever indexed. The release's two tables are
~196 B parameters (~203 GB as fp8 rows + scales); a token needs (max_ngram - 1) * n_heads rows per Engram layer
(24 at the release's shape), read from memory-mapped shards: only the pages of those rows are touched.

The rows reach the graph as fp32 after the same dequantization the loader applies to the whole table (fp8 e4m3 codes
times the ue8m0 scale of their 32-wide block, exact in fp32), so a gathered row equals the loaded parameter's row bit
for bit and the step computes what the reference network computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ced.formats.checkpoint import CheckpointFiles, StoredTensor, directory_token_map
from ced.formats.config_file import CheckpointError
from ced.model.engram import NO_TOKEN, EngramHasher, placeholder_token_map
from ced.model.quant_formats import dequantize_fp8_blocks
from ced.steps.layout import StepLayout

ENGRAM_SCALE_BLOCK = (1, 32)  # the release's fp8 table rows: one ue8m0 scale per 32 values of a row
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E8M0": torch.float8_e8m0fnu}


def table_name(layer: int) -> str:
    return f"layers.{layer}.engram.embed.weight"


class RowTable(Protocol):
    """One Engram layer's table, read by rows."""

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """ids (...) int64 -> (..., head_dim) float32."""

    def stored_bytes_per_row(self) -> int:
        """Bytes read from host memory for one row (its scales included)."""


def _mapped(stored: StoredTensor) -> np.memmap:
    if stored.dtype not in _NUMPY:
        raise CheckpointError(f"Engram table {stored.name!r} is stored as {stored.dtype}; "
                              "expected F8_E4M3 (+ scale), BF16 or F32")
    return np.memmap(stored.shard, dtype=_NUMPY[stored.dtype], mode="r", offset=stored.offset, shape=stored.shape)


class MappedTable:
    """A table as the checkpoint stores it, memory-mapped from its shard (nothing read until a row is gathered)."""

    def __init__(self, weight: StoredTensor, scale: StoredTensor | None) -> None:
        if len(weight.shape) != 2:
            raise CheckpointError(f"Engram table {weight.name!r} has shape {list(weight.shape)}, "
                                  "expected [rows, head_dim]")
        if (weight.dtype == "F8_E4M3") != (scale is not None):
            raise CheckpointError(f"Engram table {weight.name!r} is {weight.dtype} "
                                  f"{'without' if scale is None else 'with'} a scale tensor; "
                                  "fp8 rows, and only they, carry one")
        self.name, self.dtype = weight.name, weight.dtype
        self._weight = _mapped(weight)
        self._scale = _mapped(scale) if scale is not None else None
        self._row_bytes = (weight.nbytes // weight.shape[0]
                           + (scale.nbytes // scale.shape[0] if scale is not None else 0))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        flat = ids.reshape(-1)
        weight = torch.from_numpy(np.ascontiguousarray(self._weight[flat])).view(_TORCH[self.dtype])
        if self._scale is None:
            values = weight.float()
        else:
            scale = torch.from_numpy(np.ascontiguousarray(self._scale[flat])).view(torch.float8_e8m0fnu)
            values = dequantize_fp8_blocks(weight, scale, block=ENGRAM_SCALE_BLOCK)
        return values.numpy().reshape(ids.shape + (values.shape[-1],))

    def stored_bytes_per_row(self) -> int:
        return self._row_bytes


class ArrayTable:
    """A table already in memory as floats (a network's parameter): for tests and the in-process reference."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = np.asarray(values, np.float32)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.values[ids]

    def stored_bytes_per_row(self) -> int:
        return self.values.shape[1] * 4


class EngramFeed:
    """Hash ids and gathered rows of a step's tokens, given each row's last max_ngram - 1 token ids (`NO_TOKEN` where
    the session had none); the engine steps' `engram_rows_<layer>` inputs."""

    def __init__(self, layout: StepLayout, token_map: torch.Tensor, tables: dict[int, RowTable]) -> None:
        cfg = layout.cfg
        if set(tables) != set(layout.engram_layers):
            raise ValueError(f"Engram tables given for layers {sorted(tables)}, "
                             f"the config has {list(layout.engram_layers)}")
        self.layout, self.tables = layout, tables
        self.hasher = EngramHasher(cfg)
        self.hasher.set_token_map(token_map)

    @classmethod
    def open(cls, model_dir: str | Path, layout: StepLayout) -> "EngramFeed | None":
        """The feed of a checkpoint directory (tables memory-mapped from its shards; the token map from its
        tokenizer.json, else the placeholder map, as `load_checkpoint` installs them); None without Engram."""
        cfg = layout.cfg
        if not layout.engram_layers:
            return None
        files = CheckpointFiles(model_dir)
        tables: dict[int, RowTable] = {}
        for layer in layout.engram_layers:
            name = table_name(layer)
            if name not in files:
                raise CheckpointError(f"{model_dir}: the config has Engram at layer {layer} "
                                      f"but the checkpoint has no {name!r}")
            scale = files.tensors.get(files.scale_name(name))
            tables[layer] = MappedTable(files.tensors[name], scale)
        token_map = directory_token_map(cfg, Path(model_dir))
        return cls(layout, placeholder_token_map(cfg) if token_map is None else token_map, tables)

    @classmethod
    def of_network(cls, layout: StepLayout, engine: torch.nn.Module) -> "EngramFeed | None":
        """The feed of an in-memory network or encoder component (its tables and token map); None without Engram."""
        if not layout.engram_layers:
            return None
        tables: dict[int, RowTable] = {
            l: ArrayTable(engine.layers[str(l)].engram.embed.weight.detach().float().cpu().numpy())  # type: ignore[index, union-attr]
            for l in layout.engram_layers}
        return cls(layout, engine.engram_token_map, tables)  # type: ignore[arg-type]

    def hash_ids(self, tokens: np.ndarray, recent: np.ndarray) -> np.ndarray:
        """tokens (B, S), recent (B, K) token ids (NO_TOKEN: none) -> (B, S, n_layers, n_cols) table rows."""
        token_map = self.hasher.token_map
        recent_t = torch.from_numpy(np.asarray(recent, np.int64))
        history = torch.where(recent_t < 0, NO_TOKEN, token_map[recent_t.clamp(min=0)])
        ids, _ = self.hasher(torch.from_numpy(np.asarray(tokens, np.int64)), history)
        return ids.numpy()

    def inputs(self, tokens: np.ndarray, recent: np.ndarray) -> dict[str, np.ndarray]:
        ids = self.hash_ids(tokens, recent)
        return {f"engram_rows_{l}": self.tables[l].rows(ids[:, :, i]) for i, l in enumerate(self.layout.engram_layers)}

    def bytes_per_token(self) -> dict[str, int]:
        """Per token: bytes read from the host tables (stored rows and scales), and fp32 bytes fed to the engine."""
        cols, width = self.layout.engram_cols, self.layout.cfg.engram_head_dim
        return {"read": sum(cols * t.stored_bytes_per_row() for t in self.tables.values()),
                "fed": len(self.tables) * cols * width * 4}
