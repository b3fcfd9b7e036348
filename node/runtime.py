"""One block on one device, run off the event loop, with load accounting."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from layerswarm.models.checkpoint import Manifest, load_block


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


class BlockRuntime:
    """Runs one verified block. A single worker thread serialises compute: concurrent requests queue
    here instead of thrashing the cores, and `in_flight` counts both queued and running."""

    EWMA_ALPHA = 0.2

    def __init__(self, model_dir: str, index: int, manifest: Manifest, device: torch.device) -> None:
        self.block = load_block(model_dir, index, manifest).to(device)
        self.manifest = manifest
        self.index = index
        self.device = device
        self.dtype = torch.float32
        self.in_flight = 0
        self.served = 0
        self.ewma_ms = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"block{index}")

    async def forward(self, x: torch.Tensor, position: int) -> tuple[torch.Tensor, float]:
        self.in_flight += 1
        try:
            loop = asyncio.get_running_loop()
            out, ms = await loop.run_in_executor(self._pool, self._compute, x, position)
        finally:
            self.in_flight -= 1
        self.served += 1
        self.ewma_ms = ms if self.served == 1 else (1 - self.EWMA_ALPHA) * self.ewma_ms + self.EWMA_ALPHA * ms
        return out, ms

    @torch.inference_mode()
    def _compute(self, x: torch.Tensor, position: int) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        out = self.block(x.to(self.device, self.dtype), position)
        out = out.cpu()
        return out, (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
