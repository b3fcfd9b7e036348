"""The seam between a node's runtime and the code that computes its block: the BlockEngine protocol.

The node (service.py, runtime.py, decode.py, decode_batch.py) speaks numpy arrays: what arrives off the
wire (wire/arrays.py) and what goes back. An engine turns them into the block's outputs:

    forward(x, position)               (B, T, D) -> (B, T, D)                  a classifier's hop; a decoder's
                                                                               whole sequence from position 0
    forward_tokens(x, position, mask)  (B, T, D), (B, T) codes -> (N_active, D)  a text hop with a token mask
    new_cache()                        an empty KV cache for one generation stream (decoders)
    decode(x, caches)                  (B, T, D), one cache per row -> (B, T, D); the caches grow by T
    append_kv(x, caches)               keys and values only (CALM fill, kv_only)

All in float32 (`compute_dtype`), called on the node's one compute thread. Two engines:
torch_engine.TorchEngine (CPU or CUDA, torch's modules from models/) and numpy_engine.NumpyEngine (CPU,
models/lean/, no torch imported). engines/__init__.py picks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..settings import ENGINES

__all__ = ["ENGINES", "BlockEngine", "EngineCache", "EngineError"]


class EngineError(ValueError):
    """The engine asked for cannot run here (not installed, or not on this device): the message says
    which flag to change."""


class EngineCache(Protocol):
    """A stream's KV cache as the node's stream table sees it (node/streams.Cache); only the engine
    that made it reads its tensors."""

    @property
    def length(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def capacity_after(self, length: int) -> int: ...
    def truncate(self, n: int) -> None: ...


class BlockEngine(Protocol):
    name: str  # "torch" or "numpy": in the ready line and the Info reply's device
    device: str  # where it computes: "cpu", "cuda:0"
    decoder: bool  # a decoder block (generation): decode, append_kv and new_cache serve its streams
    nbytes: int  # the block's weights, as held by the engine
    kv_bytes_per_token: int  # keys and values of one token of cache capacity (decoders; 0 otherwise)

    def forward(self, x: np.ndarray, position: int) -> np.ndarray: ...
    def forward_tokens(self, x: np.ndarray, position: int, mask: np.ndarray) -> np.ndarray: ...
    def new_cache(self) -> EngineCache: ...
    def decode(self, x: np.ndarray, caches: Sequence[EngineCache]) -> np.ndarray: ...
    def append_kv(self, x: np.ndarray, caches: Sequence[EngineCache]) -> None: ...
    def close(self) -> None: ...
