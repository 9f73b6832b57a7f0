"""Assemble a server from loaded parts, and run it in-process (tests, benchmarks) or in the foreground.

    sched = build_scheduler(target, tokenizer, eos_ids, drafter=Eagle3BatchDrafter(d), policy=..., config=...)
    with ServerThread(create_app(sched)) as srv:     # uvicorn on 127.0.0.1, a free port
        openai.OpenAI(base_url=srv.url + "/v1", api_key="none") ...
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from eagle3.decoding.drafters import BatchDrafter
from eagle3.serving.config import ServeConfig
from eagle3.serving.metrics import Metrics
from eagle3.serving.policy import SpecPolicy
from eagle3.serving.scheduler import Scheduler
from eagle3.target import Target

__all__ = ["ServerThread", "build_scheduler"]

log = logging.getLogger("eagle3.serving")


def build_scheduler(target: Target, tokenizer, eos_token_ids, drafter: BatchDrafter | None = None,
                    policy: SpecPolicy | None = None, config: ServeConfig | None = None,
                    rows=None) -> Scheduler:
    config = config or ServeConfig()
    return Scheduler(target, tokenizer, eos_token_ids, drafter=drafter, policy=policy, config=config,
                     metrics=Metrics(config.model_name), rows=rows)


class ServerThread:
    """uvicorn serving `app` from a background thread; `url` once started. Stop drains like SIGTERM does."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 30.0,
                 log_level: str = "warning"):
        self.app, self.host = app, host
        # IPPROTO_TCP, not the default 0: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP
        # (asyncio.base_events._set_nodelay). Without it, Nagle's algorithm holds each streamed chunk after the
        # first until the client's delayed ACK (40 ms on Linux), a floor on time to first token.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=max(1, int(shutdown_timeout)))
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="eagle3-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url} within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful: stop accepting, let in-flight requests finish (up to the shutdown timeout), then exit."""
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("server thread still alive after %.0f s; forcing exit", timeout)
            self.server.force_exit = True
            self._thread.join(5.0)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
