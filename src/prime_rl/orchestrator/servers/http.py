"""The HTTP the orchestrator speaks with the inference servers: one `httpx.AsyncClient` and JSON requests with
retries (docs/design.md §4). The pool (health), the weight control (updates) and the requests for samples all
send through it; which server gets a request, and what is done when one goes down, is theirs.

Connection errors, 5xx and 429 are retried on the same server with exponential backoff; when the retries run out
it raises `ServerDown` (the pool takes the server out and the request goes to another live one). Anything else
(4xx, malformed JSON, no answer within `client.timeout`) raises `InferenceError` naming the URL and the answer.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import httpx

from prime_rl.configs.orchestrator import ClientConfig

if TYPE_CHECKING:
    from prime_rl.orchestrator.servers.concurrency import Limiter

RETRY_STATUS = {429, 500, 502, 503, 504}
BACKOFF = 0.5  # seconds before the first retry; doubles each time


class InferenceError(RuntimeError):
    """An inference server was unreachable or answered something unusable; the message names the URL. `status`:
    the HTTP status of a server's refusal (a 4xx), None for anything else."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerDown(InferenceError):
    """One server failed transiently on every retry; the pool takes it out and tries another."""


class Http:
    """The servers' HTTP client: `request` (JSON, with retries) for what must get through, `client` (the raw
    `httpx.AsyncClient`) for single quick tries (/health probes, /metrics reads, broadcast joins)."""

    def __init__(self, config: ClientConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        headers = {}
        api_key = os.environ.get(config.api_key_var, "") if config.api_key_var else ""
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.AsyncClient(
            timeout=config.timeout,
            headers=headers,
            transport=transport,
            # no cap of its own: each server's slots bound its requests, /metrics and /health reads never wait
            # for one, and servers added mid-run (fleet.py) get connections too
            limits=httpx.Limits(max_connections=None),
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def request(self, method: str, url: str, body: dict | None = None, slots: Limiter | None = None) -> dict:
        """One JSON request with retries on transient failures, each attempt inside `slots` (the server's
        in-flight limit) when given. Raises ServerDown when the retries ran out on transient failures,
        InferenceError otherwise."""
        return (await self.exchange(method, url, body, slots))[0]

    async def exchange(
        self, method: str, url: str, body: dict | None = None, slots: Limiter | None = None
    ) -> tuple[dict, httpx.Headers]:
        """`request`, also returning the response headers."""
        attempts = self.config.max_retries + 1
        problem = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(BACKOFF * 2 ** (attempt - 1))
            try:
                if slots is None:
                    response = await self.client.request(method, url, json=body)
                else:
                    async with slots:
                        response = await self.client.request(method, url, json=body)
            except httpx.TimeoutException as e:
                # A server that took longer than `client.timeout` is not transiently down; retrying would
                # only multiply the wait.
                if not isinstance(e, httpx.ConnectTimeout):
                    raise InferenceError(f"{method} {url}: no answer within {self.config.timeout:.0f}s") from None
                problem = f"connect timeout ({e})"
                continue
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if response.status_code in RETRY_STATUS:
                problem = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                problem = f"{method} {url} failed with HTTP {response.status_code}: {response.text[:500]}"
                raise InferenceError(problem, response.status_code)
            try:
                return response.json(), response.headers
            except ValueError:
                raise InferenceError(f"{method} {url} answered non-JSON: {response.text[:300]!r}") from None
        raise ServerDown(f"{method} {url} failed after {attempts} attempt(s): {problem}")
