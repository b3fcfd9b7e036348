"""A hop's inputs, every token's, as they were sent: what rebuilds that hop's cache on another node.

    rows      (L, D) in the storage dtype (the wire's float dtype, float32 for int8): token j's state
    put(r, x) keep the first r rows, then x's: a step appends, a rewind rewrites from the first bad row

Kept in what the node decoded (codec.as_sent), so a replay sends exactly what the first node received,
and a check re-executes exactly that. Buffers grow by doubling, like a node's KV cache.
"""

from __future__ import annotations

import torch

from layerswarm.wire import codec

INITIAL_ROWS = 16


def storage_dtype(wire: torch.dtype) -> torch.dtype:
    """fp32, fp16 and bf16 values round-trip through their own dtype; int8's dequantized ones need float32."""
    return torch.float32 if wire == torch.int8 else wire


class RowLog:
    def __init__(self, dim: int, wire: torch.dtype) -> None:
        self.dim = dim
        self.wire = wire
        self.length = 0
        self._buffer = torch.empty(0, dim, dtype=storage_dtype(wire))

    def put(self, row: int, x: torch.Tensor) -> torch.Tensor:
        """Keep rows [0, row), then x (1, T, D) float32 as the receiver decodes it; returns that (1, T, D)."""
        if not 0 <= row <= self.length:
            raise ValueError(f"cannot write row {row} of a log of {self.length} rows")
        sent = codec.as_sent(x, self.wire)
        needed = row + sent.shape[1]
        if needed > self._buffer.shape[0]:
            capacity = max(INITIAL_ROWS, self._buffer.shape[0])
            while capacity < needed:
                capacity *= 2
            grown = torch.empty(capacity, self.dim, dtype=self._buffer.dtype)
            grown[:row] = self._buffer[:row]
            self._buffer = grown
        self._buffer[row:needed] = sent[0].to(self._buffer.dtype)
        self.length = needed
        return sent

    def rows(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """(1, end - start, D) float32: rows [start, end) (end None: all held)."""
        end = self.length if end is None else end
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"rows [{start}, {end}) of a log of {self.length} rows")
        return self._buffer[start:end].to(torch.float32, copy=True)[None]  # a copy: later puts rewrite the buffer

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes
