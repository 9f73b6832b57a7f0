"""`EndpointBackend`: regeneration through any OpenAI-compatible `/v1/chat/completions` server (vLLM, SGLang,
`eagle3 serve`), with retries, tool calls sent and read back, and a fallback to tools as prompt text."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eagle3.config import ConfigError
from eagle3.serving.tools import hermes_messages
from eagle3.training.backends import Generation, Message, Prompt

log = logging.getLogger("eagle3")

RETRYABLE_STATUS = {408, 409, 425, 429}
FATAL_STATUS = {401, 403, 404, 405}


class EndpointError(RuntimeError):
    """A request to the endpoint failed; `status` is the HTTP status (None for network errors)."""

    def __init__(self, message: str, status: int | None = None, fatal: bool = False):
        super().__init__(message)
        self.status = status
        self.fatal = fatal  # the endpoint or credentials are wrong: no later request can succeed


def _chat_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class EndpointBackend:
    """An OpenAI-compatible `/v1/chat/completions` server, `concurrency` requests in flight.

    Run the server without a reasoning parser so that thinking text stays in `content` as the target
    wrote it; a separate `reasoning_content` is kept beside the answer in the output.
    """

    def __init__(
        self,
        endpoint: str,
        model: str,
        *,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        api_key: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        extra_body: dict[str, Any] | None = None,
        takes_tools: bool = True,
    ):
        if concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1 (got {concurrency})")
        if max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0 (got {max_retries})")
        self.url = _chat_url(endpoint)
        self.model = model
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.api_key = api_key
        self.chat_template_kwargs = chat_template_kwargs
        self.extra_body = dict(extra_body or {})
        # a `Prompt`'s tools go in the request and calls come back as `message.tool_calls` (the server renders
        # them with the target's template); False: the caller writes them into the messages (Hermes layout)
        self.takes_tools = takes_tools
        self._tools_refused = False  # the server answered a request with tools with a 400 (`chat`)

    def describe(self) -> str:
        return f"endpoint {self.url} model {self.model!r} concurrency {self.concurrency}"

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def check(self) -> None:
        """Fail early, with what to do, if the server is unreachable or does not serve `model`."""
        models_url = self.url[: -len("/chat/completions")] + "/models"
        request = urllib.request.Request(models_url, headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout_s, 30.0)) as resp:
                listing = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise ConfigError(f"HTTP {exc.code} from {models_url}: check the API key") from exc
            return  # some servers have no /models; the first request will tell
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            raise ConfigError(
                f"cannot reach {models_url} ({getattr(exc, 'reason', exc)}); start the server "
                "(e.g. `vllm serve MODEL`) or fix the endpoint URL"
            ) from exc
        except json.JSONDecodeError:
            return
        served = (
            [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
            if isinstance(listing, dict)
            else []
        )
        if served and self.model not in served:
            raise ConfigError(
                f"model {self.model!r} is not served at {models_url}; served: {served}. Pass one of these."
            )

    def _client_error(self, status: int, body: str) -> EndpointError:
        try:
            detail = json.loads(body)
            detail = detail.get("error", detail) if isinstance(detail, dict) else detail
            detail = detail.get("message", detail) if isinstance(detail, dict) else detail
        except json.JSONDecodeError:
            detail = body
        hint = {
            401: "check the API key",
            403: "check the API key",
            404: "check the endpoint URL (an OpenAI-compatible server, /v1/chat/completions) and the model name",
            405: "check the endpoint URL (an OpenAI-compatible server, /v1/chat/completions)",
        }.get(
            status,
            "the server rejected this request; check the model name and that max_new_tokens fits its context",
        )
        return EndpointError(
            f"HTTP {status} from {self.url}: {str(detail)[:500]} ({hint})", status, status in FATAL_STATUS
        )

    def _post(self, payload: dict[str, Any], stop: threading.Event | None) -> dict[str, Any]:
        data = json.dumps(payload).encode("utf-8")
        last, delay = "", 0.0
        for attempt in range(self.max_retries + 1):
            if attempt:
                if stop is not None and stop.wait(delay):
                    raise EndpointError("stopped while waiting to retry")
                if stop is None:
                    time.sleep(delay)
            delay = min(self.backoff_s * 2**attempt, 60.0)
            request = urllib.request.Request(self.url, data=data, headers=self._headers(), method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as exc:
                body = exc.read()[:2000].decode("utf-8", "replace")
                if exc.code < 500 and exc.code not in RETRYABLE_STATUS:
                    raise self._client_error(exc.code, body) from exc
                last = f"HTTP {exc.code}: {body[:300]}"
                retry_after = exc.headers.get("Retry-After") if exc.headers else None
                if retry_after and retry_after.isdigit():
                    delay = min(float(retry_after), 60.0)
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                continue
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                last = f"response is not JSON: {raw[:200]!r}"
        raise EndpointError(f"{self.url} failed {self.max_retries + 1} times; last error: {last}")

    def chat(
        self,
        messages: list[Message],
        temperature: float,
        max_new_tokens: int,
        stop: threading.Event | None = None,
    ) -> Generation:
        """One completion; raises EndpointError on a 4xx or when retries run out (a context overflow is returned)."""
        tools = messages.tools if isinstance(messages, Prompt) else []
        if tools and self._tools_refused:  # this server takes no tools: they go into the prompt as text
            return self.chat(hermes_messages([dict(m) for m in messages], tools), temperature, max_new_tokens, stop)
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": _openai_messages(messages),
            "temperature": temperature,
            "max_tokens": max_new_tokens,
            "stream": False,
            **self.extra_body,
        }
        if tools:
            payload["tools"] = tools
        if self.chat_template_kwargs:
            payload["chat_template_kwargs"] = self.chat_template_kwargs
        try:
            body = self._post(payload, stop)
        except EndpointError as exc:
            # vLLM: "maximum context length is N tokens"; SGLang: "longer than the model's context length"
            if exc.status == 400 and "context length" in str(exc).lower():
                return Generation(finish_reason="prompt_too_long", error=str(exc))
            if exc.status == 400 and tools:  # a server without tool calling (vLLM without a tool-call parser)
                if not self._tools_refused:
                    self._tools_refused = True
                    log.warning("%s refused a request with tools (%s); tools go into the prompt as text (the "
                                "Hermes layout) from now on", self.url, str(exc)[:200])
                return self.chat(hermes_messages([dict(m) for m in messages], tools), temperature,
                                 max_new_tokens, stop)
            raise
        try:
            choice = body["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError) as exc:
            raise EndpointError(f"unexpected response from {self.url}: {str(body)[:300]}") from exc
        usage = body.get("usage") or {}
        num_tokens = int(usage.get("completion_tokens") or 0)
        try:
            calls = _read_calls(message.get("tool_calls")) if isinstance(messages, Prompt) else None
        except ValueError as exc:
            return Generation(num_tokens=num_tokens, finish_reason="error", error=f"{exc}: {str(message)[:300]}")
        return Generation(
            text=message.get("content") or "",
            num_tokens=num_tokens,
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
            reasoning=message.get("reasoning_content") or message.get("reasoning") or None,
            tool_calls=calls,
        )

    def generate(
        self, prompts: list[list[Message]], temperature: float, max_new_tokens: int, batch_size: int = 0
    ) -> list[Generation]:
        """`chat` for each prompt on `concurrency` threads; failures come back as error Generations."""

        def one(messages: list[Message]) -> Generation:
            try:
                return self.chat(messages, temperature, max_new_tokens)
            except EndpointError as exc:
                return Generation(finish_reason="error", error=str(exc))

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(one, prompts))


def _openai_messages(messages: list[Message]) -> list[dict]:
    """Messages as a request carries them: a call's arguments as a JSON string."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                   if isinstance(c["function"]["arguments"], str)
                                   else json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                for c in m["tool_calls"]]}
        out.append(dict(m))
    return out


def _read_calls(raw: Any) -> list[dict]:
    """A server's `message.tool_calls` in the rows' shape (arguments as objects); ValueError if malformed."""
    calls = []
    for j, c in enumerate(raw or []):
        function = c.get("function") if isinstance(c, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call without a function name")
        args = function.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ValueError("tool call arguments are not JSON") from None
        if not isinstance(args, dict):
            raise ValueError("tool call arguments are not a JSON object")
        calls.append({"id": c.get("id") or f"call_{j}", "type": "function",
                      "function": {"name": function["name"], "arguments": args}})
    return calls
