"""Closed-loop streaming HTTP clients for serving benchmarks, runnable in a process of their own.

`drive(url, bodies, concurrency, chat, timeout)` sends `bodies` (OpenAI request bodies with `stream: true`) to
`url` from `concurrency` clients, each sending its next request when the previous one ends, and returns one
result per request (`index` in `bodies`, `ttft`, `latency`, `tokens`, `text`, `error`) and the wall time. `drive_in_process` is the same call
made from a plain function, so that a `ProcessPoolExecutor` can run it away from the server: with clients and
server in one Python process, 64 clients parsing server-sent events take the interpreter lock from the
scheduler thread and the benchmark measures its own client.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

__all__ = ["drive", "drive_in_process", "one_request"]


async def one_request(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> dict:
    """One streaming request: time to the first content chunk, to the last chunk, the usage count and the text."""
    t0 = time.perf_counter()
    ttft, tokens, error, text = None, 0, None, []
    async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                error = msg["error"]["message"]
                continue
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            for ch in msg.get("choices", []):
                piece = ch.get("delta", {}).get("content") if chat else ch.get("text")
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece or "")
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "tokens": tokens, "text": "".join(text),
            "error": error}


async def drive(url: str, bodies: list[dict], concurrency: int, chat: bool, timeout: float) -> tuple[list, float]:
    """`concurrency` closed-loop clients over `bodies`; returns (results, wall seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, b in enumerate(bodies):
        queue.put_nowait((i, b))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker():
            while not queue.empty():
                i, body = queue.get_nowait()
                try:
                    results.append({"index": i, **await one_request(client, url, body, chat)})
                except httpx.HTTPError as e:
                    results.append({"index": i, "error": f"{type(e).__name__}: {e}"})

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return results, time.perf_counter() - t0


def drive_in_process(url: str, bodies: list[dict], concurrency: int, chat: bool, timeout: float) -> tuple[list, float]:
    """`drive` from synchronous code (the target of a process pool)."""
    return asyncio.run(drive(url, bodies, concurrency, chat, timeout))
