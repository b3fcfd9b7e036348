"""Sends this coordinator's convictions to the other coordinators as tips (tips.py says what a tip is).

Best effort, never in a request's way: each tip goes to each peer in a task of its own, retried with
backoff on connection errors and 5xx (tenacity), then given up with a warning; a peer that refuses it
(4xx) is logged at once. Tasks are tracked and cancelled at stop; none dies silently.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from .tips import MAC_HEADER, Tip, new_tip, sign

log = logging.getLogger(__name__)
ATTEMPTS = 4  # per peer and tip: about 3.5 s of backoff in all
TIMEOUT_S = 2.0


class PeerDown(Exception):
    """A peer coordinator did not take the tip (connection error or 5xx): worth another try."""


class TipSender:
    def __init__(self, peers: tuple[str, ...], key: bytes, sender: str) -> None:
        self.peers = tuple(p.rstrip("/") for p in peers)
        self.key = key
        self.sender = sender
        self.sent = 0  # tips a peer took (2xx)
        self.failed = 0  # tips given up on or refused
        self._client = httpx.AsyncClient(timeout=TIMEOUT_S)
        self._tasks: set[asyncio.Task[None]] = set()

    def convicted(self, address: str, boot_id: str, reason: str) -> None:
        """Tell every peer; returns at once."""
        tip = new_tip(address, boot_id, reason, self.sender, time.time())
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a conviction outside the event loop (never expected): said, not sent
            log.error("tip about %s not sent: no running event loop", address)
            return
        for peer in self.peers:
            task = asyncio.create_task(self._deliver(peer, tip), name=f"tip {address} -> {peer}")
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.failed += 1
            log.error("sending a tip failed: %s", exc, exc_info=exc)

    async def _deliver(self, peer: str, tip: Tip) -> None:
        body = tip.body()
        headers = {MAC_HEADER: sign(self.key, body), "content-type": "application/json"}
        retrying = AsyncRetrying(
            stop=stop_after_attempt(ATTEMPTS),
            wait=wait_exponential(multiplier=0.5, max=2.0),
            retry=retry_if_exception_type(PeerDown),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    status = await self._post(f"{peer}/v1/swarm/tips", body, headers)
        except PeerDown as exc:
            self.failed += 1
            log.warning("tip about %s not delivered to %s after %d tries: %s", tip.address, peer, ATTEMPTS, exc)
            return
        if status >= 400:
            self.failed += 1
            log.warning("coordinator %s refused our tip about %s (HTTP %d)", peer, tip.address, status)
        else:
            self.sent += 1
            log.info("told coordinator %s that %s was convicted", peer, tip.address)

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        try:
            reply = await self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise PeerDown(f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 500:
            raise PeerDown(f"HTTP {reply.status_code}")
        return reply.status_code

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()
