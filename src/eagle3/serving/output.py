"""The scheduler's output side: incremental detokenization, stop strings, streamed deltas and the events that
finish a request (`OutputMixin`, methods of `Scheduler`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from eagle3.serving.requests import Event, RequestHandle, _Row

log = logging.getLogger("eagle3.serving")


def _stock_decode(tokenizer) -> bool:
    """True when `tokenizer.decode` is transformers' own fast-tokenizer decode (no subclass override)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    cls = type(tokenizer)
    return all(getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name, None) for name in ("decode", "_decode"))


def _find_stop(text: str, stops: Sequence[str]) -> int:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else -1


class OutputMixin:
    """`Scheduler` methods that turn a row's new tokens into text, stream it, and finish the request."""

    def _stable_text(self, row: _Row) -> str:
        """The text of `row.out` so far, up to its last complete character, decoding only the newest tokens: the
        window from the previous read point is decoded with and without the new tokens and the difference is
        appended (both decodes start at the same token, so a tokenizer that drops a leading space does so in
        both; the offsets of vLLM's incremental detokenizer, vllm/transformers_utils/detokenizer_utils.py).
        A full decode per cycle costs O(length) per row, which at 64 streamed rows was host time per cycle."""
        out = row.out
        before = self._text(out[row.prefix_at : row.read_at])
        now = self._text(out[row.prefix_at :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            row.text += now[len(before) :]
            row.prefix_at, row.read_at = row.read_at, len(out)
        return row.text

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # token-level use (tests): no text, no stop strings
            return ""
        with self.tokenizer_lock:
            if self._backend is not None:
                return self._backend.decode(ids, skip_special_tokens=True)
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, row: _Row, new_tokens: list[int]) -> bool:
        """Append tokens until one finishes the request; stream text; True when the request is done."""
        p = row.handle.params
        finish, text, before = None, None, len(row.out)
        for tok in new_tokens:
            row.out.append(tok)
            text = None
            if tok in self.eos:
                finish = "stop"
                break
            if p.stop:
                text = self._text(row.out)
                if _find_stop(text, p.stop) >= 0:
                    finish = "stop"
                    break
            if len(row.out) >= p.max_tokens:
                finish = "length"
                break
        row.root = row.out[-1]
        self.metrics.inc("eagle3_generation_tokens_total", len(row.out) - before)
        if finish is None:
            # stream every `stream_interval` tokens (the first chunk at once): fewer, larger chunks cost less host
            # time per token at high concurrency (vLLM's and SGLang's `stream_interval`, in tokens as there)
            if p.stream and (row.sent == 0 or len(row.out) - row.streamed >= self.config.stream_interval):
                if text is None:
                    text = self._stable_text(row) if self._incremental else self._text(row.out)
                self._stream(row, text, final=False)
            return False
        text = self._text(row.out) if text is None else text
        cut = _find_stop(text, p.stop)
        if cut >= 0:
            text = text[:cut]
        if p.stream:
            self._stream(row, text, final=True)
        self._finish(row, finish, text)
        return True

    def _stream(self, row: _Row, text: str, final: bool) -> None:
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character
            for s in row.handle.params.stop:  # hold back a suffix that could start a stop string
                for j in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:j]):
                        end -= j
                        break
        if end > row.sent:
            self._send(row.handle, Event("delta", text=text[row.sent : end]))
            row.sent, row.streamed = end, len(row.out)

    def _finish(self, row: _Row, reason: str, text: str) -> None:
        h = row.handle
        h.finished = True
        self.metrics.inc("eagle3_requests_total", endpoint=h.params.endpoint, finish_reason=reason)
        self.metrics.observe("eagle3_request_latency_seconds", time.perf_counter() - h.arrival)
        if self.recorder is not None and h.params.record:  # before the answer: a client that has it finds it recorded
            p = h.params
            version = h.drafter_version or self.drafter_version  # the drafter it was admitted under
            self.recorder.add({"request_id": h.id, "model": self.config.model_name, "drafter": version,
                               "prompt_ids": list(p.prompt_ids), "completion_ids": list(row.out),
                               "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                               "finish_reason": reason, "cycles": row.cycles, "accepted": row.accepted})
        self._send(h, Event("done", text=text, finish_reason=reason, prompt_tokens=len(h.params.prompt_ids),
                            completion_tokens=len(row.out), token_ids=list(row.out)))

    def _send(self, handle: RequestHandle, event: Event) -> None:
        try:
            handle.sink(event)
        except Exception:  # a broken sink (client side gone) must not stop the batch
            log.exception("could not deliver an event for request %s", handle.id)
            handle.cancelled = True

    def _send_error(self, handle: RequestHandle, message: str, status: int) -> None:
        if handle.finished:
            return
        handle.finished = True
        self.metrics.inc("eagle3_requests_total", endpoint=handle.params.endpoint, finish_reason="error")
        self._send(handle, Event("error", text=message, status=status))
