"""The OpenAI-compatible HTTP app (FastAPI): request validation, tokenization, SSE streaming, errors.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics; with an admin
token (`ServeConfig.admin_token`), GET and POST /admin/drafter and POST /admin/drafter/rollback (drafter swaps, see
`Scheduler.swap_drafter`), which want `Authorization: Bearer TOKEN`.
Chat requests with `tools` are rendered and their answers read for tool calls by `tools.py`.
Decoding happens in the `Scheduler` thread; each request gets an asyncio queue its events are posted to
through a `_Mailbox` (one `loop.call_soon_threadsafe` wake-up per burst of events, not one per event). A client that disconnects (a stream it stops reading, or a request it
abandons) is cancelled, and its batch row is freed at the next cycle boundary. On shutdown the lifespan
stops the scheduler: in-flight requests finish, or are cancelled after `ServeConfig.shutdown_timeout`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle3.runtime import encode_prompt
from eagle3.serving import protocol as P
from eagle3.serving import tools as T
from eagle3.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from eagle3.serving.protocol import RequestError
from eagle3.serving.requests import Event, GenParams, RequestHandle, SchedulerUnavailable
from eagle3.serving.scheduler import Scheduler, SwapRefused

__all__ = ["create_app"]

log = logging.getLogger("eagle3.serving")


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _Mailbox:
    """Events from the scheduler thread into the event loop's queues. A decode cycle emits one event per running
    row; waking the loop for each (a self-pipe write and a loop iteration apiece) was host time the scheduler
    thread and the loop contend for. Posts that find the mailbox non-empty ride on the wake-up already sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Event]] = []

    def post(self, queue: asyncio.Queue, ev: Event) -> None:
        """Raises RuntimeError when the loop is closed (nobody is listening any more)."""
        if self.loop.is_closed():
            raise RuntimeError("event loop is closed")
        with self._lock:
            wake = not self._items
            self._items.append((queue, ev))
        if wake:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, ev in items:
            queue.put_nowait(ev)


def create_app(scheduler: Scheduler) -> FastAPI:
    """An app serving `scheduler`'s model; the scheduler starts and stops with the app's lifespan."""
    cfg = scheduler.config
    tok = scheduler.tokenizer
    metrics = scheduler.metrics
    tcfg = scheduler.target.config
    max_len = cfg.max_model_len or int(getattr(tcfg, "max_position_embeddings", 0) or 2048)
    vocab = scheduler.target.vocab_size
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        yield
        await run_in_threadpool(scheduler.stop, cfg.shutdown_timeout)

    app = FastAPI(title="eagle3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.max_model_len = max_len

    def error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
              code: str | None = None) -> JSONResponse:
        metrics.inc("eagle3_request_errors_total", status=str(status))
        return JSONResponse(P.error_body(message, type, param, code), status_code=status)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, e: RequestError):
        return error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, e: Exception):
        log.exception("unhandled error")
        return error(500, f"internal server error: {type(e).__name__}: {e}", "server_error")

    # -- helpers -----------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name != cfg.model_name:
            raise RequestError(f"The model `{name}` does not exist. This server serves `{cfg.model_name}`.",
                               param="model", code="model_not_found", status=404)

    def encode_chat(req: P.ChatRequest) -> tuple[list[int], T.ToolCalls | None]:
        """The prompt's token ids, and how to read tool calls from the answer (None: the request offers none)."""
        if not cfg.chat_template and not getattr(tok, "chat_template", None):
            raise RequestError(
                f"The model `{cfg.model_name}` has no chat template. Use /v1/completions, or start the server "
                "with --chat-template FILE.", param="messages", code="no_chat_template")
        with scheduler.tokenizer_lock:
            try:
                text, calls = T.render(tok, req.messages, req.tools, req.tool_choice, req.tool_function,
                                       req.parallel_tool_calls, cfg.chat_template)
            except TemplateError as e:  # the template refuses the conversation (roles, ids, ...)
                raise RequestError(f"The chat template cannot render these messages: {e}", param="messages",
                                   code="invalid_value") from None
            # the template writes its own BOS, if any
            return tok(text, add_special_tokens=False)["input_ids"], calls

    def encode_text(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"Invalid 'prompt': token id {bad[0]} is outside the vocabulary [0, {vocab}).",
                                   param="prompt", code="invalid_value")
            return list(prompt)
        with scheduler.tokenizer_lock:
            return encode_prompt(tok, prompt=prompt)

    def gen_params(req: P.ChatRequest | P.CompletionRequest, ids: list[int], endpoint: str) -> GenParams:
        n = len(ids)
        what = "messages" if endpoint == "chat" else "prompt"
        if n >= max_len:
            raise RequestError(f"This model's maximum context length is {max_len} tokens. However, your {what} "
                               f"resulted in {n} tokens. Please reduce the length of the {what}.",
                               param=what, code="context_length_exceeded")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(cfg.default_max_tokens, max_len - n)
        elif n + max_tokens > max_len:
            raise RequestError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                               f"{n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the completion). "
                               f"Please reduce the length of the {what} or completion.",
                               param="max_tokens", code="context_length_exceeded")
        return GenParams(prompt_ids=ids, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                         top_k=req.top_k, seed=req.seed, stop=tuple(req.stop), stream=req.stream, endpoint=endpoint,
                         record=getattr(req, "store", True), grammar=getattr(req, "grammar", None))

    mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}  # one per loop serving this app

    def submit(params: GenParams) -> tuple[RequestHandle, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        mailbox = mailboxes.get(loop) or mailboxes.setdefault(loop, _Mailbox(loop))
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            try:
                mailbox.post(queue, ev)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                handle.cancelled = True

        handle = RequestHandle(params, sink)
        try:
            scheduler.submit(handle)
        except SchedulerUnavailable as e:
            raise RequestError(str(e), status=e.status, type="server_unavailable", code="server_unavailable") from None
        return handle, queue

    async def wait_done(request: Request, handle: RequestHandle, queue: asyncio.Queue) -> Event | None:
        """The final event of a non-streaming request, or None if the client went away first."""

        async def disconnected() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(disconnected())
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return None
                ev = getter.result()
                if ev.kind != "delta":
                    return ev
        finally:
            watcher.cancel()
            if not handle.finished:
                scheduler.cancel(handle)

    async def run(request: Request, req, ids: list[int], endpoint: str,
                  calls: T.ToolCalls | None = None) -> Response:
        params = gen_params(req, ids, endpoint)
        if calls is not None and calls.grammar is not None:  # a forced tool call, constrained
            params = replace(params, grammar=calls.grammar)
        handle, queue = submit(params)
        rid = P.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        model = cfg.model_name
        if not params.stream:
            ev = await wait_done(request, handle, queue)
            if ev is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            if ev.kind == "error":
                return error(ev.status, ev.text, "server_error" if ev.status == 500 else "server_unavailable")
            if calls is not None:
                content, tool_calls = calls.parse(ev.text)
                scheduler.metrics.inc("eagle3_tool_call_parse_errors_total", calls.errors)
                finish = "tool_calls" if tool_calls else ev.finish_reason
                return JSONResponse(P.chat_response(rid, model, content, finish, ev.prompt_tokens,
                                                    ev.completion_tokens, tool_calls))
            make = P.chat_response if endpoint == "chat" else P.completion_response
            return JSONResponse(make(rid, model, ev.text, ev.finish_reason, ev.prompt_tokens, ev.completion_tokens))

        t0 = int(time.time())

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if endpoint == "chat":
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                return P.chat_chunk(rid, model, t0, delta, finish)
            return P.completion_chunk(rid, model, t0, text or "", finish)

        reader = calls.stream() if calls is not None else None  # text into content and tool-call deltas

        async def events():
            try:
                if endpoint == "chat":
                    yield _sse(chunk(None, role=True))
                while True:
                    ev = await queue.get()
                    if ev.kind == "delta" and reader is None:
                        yield _sse(chunk(ev.text))
                    elif ev.kind == "delta":
                        for delta in reader.feed(ev.text):
                            yield _sse(P.chat_chunk(rid, model, t0, delta))
                    elif ev.kind == "done":
                        finish = ev.finish_reason
                        if reader is not None:
                            for delta in reader.finish():
                                yield _sse(P.chat_chunk(rid, model, t0, delta))
                            scheduler.metrics.inc("eagle3_tool_call_parse_errors_total", reader.errors)
                            finish = "tool_calls" if reader.calls else finish
                        yield _sse(chunk(None, finish))
                        if req.include_usage:
                            last = chunk(None)
                            last["choices"] = []
                            last["usage"] = P.usage(ev.prompt_tokens, ev.completion_tokens)
                            yield _sse(last)
                        yield _sse("[DONE]")
                        return
                    else:
                        yield _sse(P.error_body(ev.text, "server_error" if ev.status == 500 else "server_unavailable"))
                        yield _sse("[DONE]")
                        return
            finally:  # also runs when the client disconnects and Starlette cancels the stream
                if not handle.finished:
                    scheduler.cancel(handle)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes ------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = P.parse_chat(await request.body(), cfg.max_stop_strings)
        check_model(req.model)
        ids, calls = encode_chat(req)
        return await run(request, req, ids, "chat", calls)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse_completion(await request.body(), cfg.max_stop_strings)
        check_model(req.model)
        return await run(request, req, encode_text(req.prompt), "completions")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": created,
                                            "owned_by": "eagle3", "max_model_len": max_len}]}

    @app.get("/health")
    async def health() -> Response:
        if not scheduler.alive:
            return error(503, "the scheduler is not running (starting, shutting down, or failed)",
                         "server_unavailable")
        return JSONResponse({"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    if cfg.admin_token is not None:  # without one the /admin routes do not exist (404)
        _add_admin_routes(app, scheduler, error)
    return app


def _add_admin_routes(app: FastAPI, scheduler: Scheduler, error) -> None:
    """GET /admin/drafter (the drafter new requests get, and the one a rollback returns to), POST /admin/drafter
    {"path": DIR} (swap to the drafter saved there), POST /admin/drafter/rollback; each answers with GET's body."""
    token = scheduler.config.admin_token.encode()

    def refused(request: Request) -> Response | None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token):
            return None
        response = error(401, "the /admin routes want the server's admin token: Authorization: Bearer TOKEN",
                         "authentication_error", code="invalid_admin_token")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def state() -> JSONResponse:
        previous = scheduler.previous
        return JSONResponse({**scheduler.loaded.describe(),
                             "previous": previous.describe() if previous is not None else None})

    async def switch(call, *args) -> Response:
        try:
            await run_in_threadpool(call, *args)
        except SwapRefused as e:
            kind = "server_unavailable" if e.status == 503 else "invalid_request_error"
            return error(e.status, str(e), kind, code=e.code)
        return state()

    @app.get("/admin/drafter")
    async def drafter_state(request: Request) -> Response:
        return refused(request) or state()

    @app.post("/admin/drafter")
    async def drafter_swap(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not (isinstance(body, dict) and set(body) == {"path"} and isinstance(body["path"], str) and body["path"]):
            return error(400, 'expected a JSON object {"path": DIR}, DIR a drafter checkpoint folder on the server',
                         param="path", code="invalid_value")
        return await switch(scheduler.swap_drafter, body["path"])

    @app.post("/admin/drafter/rollback")
    async def drafter_rollback(request: Request) -> Response:
        return refused(request) or await switch(scheduler.rollback_drafter)
