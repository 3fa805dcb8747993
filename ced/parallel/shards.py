"""Reading one rank's slice of a checkpoint tensor without materialising the whole tensor.

A safetensors tensor is a row-major byte range, so a dim-0 slice is one contiguous sub-range (one positioned read,
straight into the parameter when the dtypes agree) and a dim-1 slice of a 2-D tensor is read in bounded blocks of
rows. We read through `CheckpointFiles`' byte offsets with `os.preadv` rather than `safe_open(...).get_slice`: the
latter memory-maps the shard, and mapped pages stay resident as long as the mapping lives (see `CheckpointFiles.get`),
which would charge a rank for pages of other ranks' slices.

The release's quantized tensors (fp8 32x32 blocks, fp8 per-row blocks, packed fp4) are sliced together with their
`.scale` when the slice boundaries fall on scale blocks (and on packed byte pairs), then dequantized as usual; an
unaligned slice (e.g. a 16-wide expert slice of a 32-block) falls back to reading and dequantizing the whole tensor
and keeping the slice, one tensor in flight.
"""

from __future__ import annotations

import os

import torch

from ced.formats.checkpoint import (
    HEADER_TORCH_DTYPES,
    CheckpointFiles,
    StoredTensor,
    dequantize_one,
    scale_name_of,
)
from ced.formats.config_file import CheckpointError
from ced.parallel.layout import Shard

#: Upper bound of the row block read at once for a column slice (the transient beyond the slice itself).
COLUMN_BLOCK_BYTES = 32 << 20


class SliceReader:
    """Reads parameters' slices from a checkpoint directory and counts the bytes it read from disk."""

    def __init__(self, files: CheckpointFiles) -> None:
        self.files = files
        self.bytes_read = 0

    # ------------------------------------------------------------------ raw byte ranges
    def _pread(self, stored: StoredTensor, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous tensor `out` with the bytes at `offset` past the start of `stored`'s data."""
        buffer = out.detach().reshape(-1).view(torch.uint8)
        n = buffer.numel()
        if n == 0:
            return
        with open(stored.shard, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buffer.numpy()], stored.offset + offset)
        if got != n:
            raise CheckpointError(f"{stored.name}: {stored.shard.name} ends {n - got} bytes before the slice does")
        self.bytes_read += n

    def stored_slice(self, stored: StoredTensor, dim: int | None, start: int, stop: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored tensor (its own dtype) or its [start, stop) along `dim` (0, or 1 of a 2-D tensor)."""
        dtype = HEADER_TORCH_DTYPES.get(stored.dtype)
        if dtype is None:
            raise CheckpointError(f"{stored.name}: stored dtype {stored.dtype} is not one we read")
        shape = stored.shape
        if dim is None:
            start, stop, dim = 0, (shape[0] if shape else 1), 0
        want = tuple(stop - start if d == dim else n for d, n in enumerate(shape)) if shape else ()
        if out is None:
            out = torch.empty(want, dtype=dtype)
        elif tuple(out.shape) != want or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"{stored.name}: cannot read {want} {dtype} into {tuple(out.shape)} {out.dtype}")
        if not shape:
            self._pread(stored, 0, out)
            return out
        row_bytes = stored.nbytes // shape[0] if shape[0] else 0
        if dim == 0:
            self._pread(stored, start * row_bytes, out)
            return out
        if len(shape) != 2 or dim != 1:
            raise ValueError(f"{stored.name}: slicing {len(shape)}-D tensors along dim {dim} is not supported")
        block = max(1, COLUMN_BLOCK_BYTES // max(row_bytes, 1))
        for a in range(0, shape[0], block):
            b = min(a + block, shape[0])
            rows = torch.empty((b - a, shape[1]), dtype=dtype)
            self._pread(stored, a * row_bytes, rows)
            out[a:b] = rows[:, start:stop]
            del rows
        return out

    # ------------------------------------------------------------------ parameters
    def read_into(self, name: str, shard: Shard, shape: tuple[int, ...], target: torch.Tensor) -> None:
        """Fill `target` (a rank's parameter, global shape `shape`) with its shard of checkpoint tensor `name`."""
        files = self.files
        if name not in files:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}")
        stored = files.tensors[name]
        scale = files.tensors.get(scale_name_of(name))
        dim, start, stop = (shard.dim, shard.start, shard.stop) if shard.kind == "split" else (None, 0, 0)
        if scale is None:
            if stored.shape != shape:
                raise CheckpointError(f"tensor {name!r} has shape {stored.shape}, expected {shape}")
            if HEADER_TORCH_DTYPES.get(stored.dtype) == target.dtype and target.is_contiguous():
                self.stored_slice(stored, dim, start, stop, out=target.data)
            else:
                target.copy_(self.stored_slice(stored, dim, start, stop))
            return
        target.copy_(self._quantized(name, stored, scale, shape, dim, start, stop, target.dtype))

    def _quantized(self, name: str, stored: StoredTensor, scale: StoredTensor, shape: tuple[int, ...],
                   dim: int | None, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """A quantized tensor's slice, dequantized: from its aligned stored and scale slices when it can be."""
        if dim is not None and len(shape) == 2 and len(stored.shape) == 2 and len(scale.shape) == 2:
            pack = shape[dim] // stored.shape[dim] if stored.shape[dim] else 1
            block = -(-shape[dim] // scale.shape[dim]) if scale.shape[dim] else 0
            aligned = (pack >= 1 and shape[dim] == pack * stored.shape[dim] and block >= 1
                       and -(-shape[dim] // block) == scale.shape[dim]
                       and start % block == 0 and (stop % block == 0 or stop == shape[dim])
                       and start % pack == 0 and stop % pack == 0)
            if aligned:
                q = self.stored_slice(stored, dim, start // pack, stop // pack)
                s = self.stored_slice(scale, dim, start // block, -(-stop // block))
                return dequantize_one(name, q, s, dtype)
        full = dequantize_one(name, self.stored_slice(stored, None, 0, 0), self.stored_slice(scale, None, 0, 0), dtype)
        if tuple(full.shape) != shape:
            raise CheckpointError(f"tensor {name!r} dequantizes to shape {tuple(full.shape)}, expected {shape}")
        return full if dim is None else full.narrow(dim, start, stop - start).clone()
