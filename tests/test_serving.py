"""`eagle3 serve` over real HTTP with the real `openai` client: a live uvicorn server on 127.0.0.1 (free port)
serving stories260K with a random EAGLE-3 drafter, speculation on.

Covers OpenAI semantics (chat and completions, streaming SSE ending in [DONE], usage, finish_reason, stop,
seed), every 400 case, a client disconnecting mid-stream, 64 concurrent clients whose greedy answers all
equal the single-request engine's, and graceful shutdown. One chat test on SmolLM2 is marked slow.
Run: pytest tests/test_serving.py
"""

from __future__ import annotations

import copy
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from eagle3.config import DraftShape, SamplingConfig  # noqa: E402
from eagle3.decoding.drafters import Eagle3BatchDrafter  # noqa: E402
from eagle3.decoding.engine import SpeculativeEngine  # noqa: E402
from eagle3.decoding.proposers import NoDraftProposer  # noqa: E402
from eagle3.defaults import native_bf16  # noqa: E402
from eagle3.runtime import encode_prompt, eos_token_ids, init_drafter  # noqa: E402
from eagle3.serving.app import create_app  # noqa: E402
from eagle3.serving.cli import fast_rows  # noqa: E402
from eagle3.serving.config import ServeConfig  # noqa: E402
from eagle3.serving.policy import SpecPolicy  # noqa: E402
from eagle3.serving.server import ServerThread, build_scheduler  # noqa: E402
from eagle3.target import Target  # noqa: E402

MODEL = "stories260k"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = ["Once upon a time", "Lily", "The end.", "Tom had a red ball. He", "One day", "Sam and his mom",
           "The little dog", "Mia found a shiny"]


def make_server(model, tok, spec: bool = True, rows: bool = False, **config) -> ServerThread:
    """A started server on a private copy of `model` (its Target hooks must not touch the shared fixture);
    `rows`: requests decode on `FastRows` (else on the HF rows)."""
    model = copy.deepcopy(model)
    drafter, aux, policy, d = None, [], None, None
    shape = DraftShape(3, 2, 6)
    if spec:
        d = init_drafter(model, seed=0)
        drafter, aux = Eagle3BatchDrafter(d), d.config.aux_layer_ids
        # a random drafter: its trees are verified in every cycle the speed gate lets speculate
        policy = SpecPolicy(shape, token_budget=64)
    cfg = ServeConfig(model_name=MODEL, chat_template=TEMPLATE, **config)
    fr = fast_rows("on", model, d, policy or SpecPolicy(largest=None), cfg, "cpu") if rows else None
    sched = build_scheduler(Target(model, aux), tok, eos_token_ids(model, tok), drafter, policy, cfg, rows=fr)
    return ServerThread(create_app(sched), shutdown_timeout=cfg.shutdown_timeout).start()


class Reference:
    """Greedy answers of the bs=1 engine without drafts (`eagle3 generate --draft none`), cached."""

    def __init__(self, model, tok):
        self.tok = tok
        self.engine = SpeculativeEngine(Target(model, []), NoDraftProposer(), tok)
        self.eos = eos_token_ids(model, tok)
        self.cache: dict = {}
        self.lock = threading.Lock()

    def ids(self, prompt: str | None = None, messages: list | None = None) -> list[int]:
        if messages is not None:
            text = self.tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                                add_generation_prompt=True)
            return self.tok(text, add_special_tokens=False)["input_ids"]
        return encode_prompt(self.tok, prompt=prompt)

    def __call__(self, max_tokens: int, prompt: str | None = None, messages: list | None = None, stop=()):
        key = (prompt, json.dumps(messages), max_tokens, tuple(stop))
        with self.lock:
            if key not in self.cache:
                self.cache[key] = self.engine.generate(self.ids(prompt, messages), max_new_tokens=max_tokens,
                                                       eos_token_ids=self.eos, stop_strings=stop)
            return self.cache[key]


@pytest.fixture(scope="module")
def ref(stories260k):
    model, tok = stories260k
    r = Reference(model, tok)
    for p in PROMPTS:  # fill the cache before any server thread runs the model
        for n in (8, 13, 24):
            r(n, prompt=p)
    yield r
    r.engine.target.close()


@pytest.fixture(scope="module")
def server(stories260k, ref):
    srv = make_server(*stories260k)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(server, line_prefix: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(line_prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- OpenAI semantics ------------------------------------------------------------------------
def test_completion_matches_single_request_greedy(client, ref):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    want = ref(24, prompt=PROMPTS[0])
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.object == "text_completion" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.ids(PROMPTS[0])), 24)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_sampled_lone_requests_on_fast_rows_match_the_hf_rows(stories260k):
    """Sampled requests one at a time: each decodes alone as one fast row, and its text is the one the HF rows
    give for the same settings and seed (the same position-keyed draws); every traced cycle ran on the fast rows
    with one row, and their gate measures sampled cycles in a bucket of their own."""
    jobs = [(PROMPTS[i], 20, (0.7, 1.0, 1.3)[i % 3], (1.0, 0.9)[i % 2], (0, 12)[i % 4 == 1], 40 + i) for i in range(6)]
    answers = {}
    for rows in (False, True):
        srv = make_server(*stories260k, rows=rows)
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            answers[rows] = [c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=temperature,
                                                  top_p=top_p, seed=seed, extra_body={"top_k": top_k}).choices[0].text
                             for prompt, n, temperature, top_p, top_k, seed in jobs]  # one at a time
            if rows:
                sched = srv.app.state.scheduler
                # the last cycle's answer can reach the client before that cycle is traced: wait for the trace
                deadline = time.monotonic() + 5
                while (len(sched.cycle_trace()["ms"]) != metric(srv, "eagle3_verify_steps_total")
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
                trace = sched.cycle_trace()
                assert set(trace["path"]) == {"rows"} and set(trace["rows"]) == {1}
                assert len(trace["ms"]) == metric(srv, "eagle3_verify_steps_total")
                assert set(sched.gate_snapshots()["rows"]) == {"b1_q4_sampled"}
        finally:
            srv.stop()
    assert answers[True] == answers[False]
    assert len(set(answers[True])) > 3  # the settings and seeds do vary the answers


def test_fast_rows_server_answers_like_the_reference(stories260k, ref):
    """Greedy and sampled requests on `FastRows`, 64 concurrent clients streamed and not: every greedy answer
    equals the bs=1 reference, speculative cycles ran, and a client that leaves mid-stream frees its row."""
    srv = make_server(*stories260k, rows=True, max_batch_size=16)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        jobs = [(PROMPTS[i % len(PROMPTS)], (1, 8, 13, 24)[i % 4], i % 3 == 0, 0.0 if i % 5 else 0.8)
                for i in range(64)]  # max_tokens 1: done at its prefill

        def one(job):
            prompt, n, stream, temperature = job
            if stream:
                chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=temperature,
                                                   stream=True))
                return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=temperature)
            return r.choices[0].text, r.choices[0].finish_reason

        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, jobs, timeout=120))
        for (prompt, n, _, temperature), (text, finish) in zip(jobs, results, strict=True):
            if temperature == 0:
                want = ref(n, prompt=prompt)
                assert (text, finish) == (want.text, want.finish_reason), (prompt, n)
        sched = srv.app.state.scheduler
        assert sched.fast_rows.spec_cycles > 0 and sched.fast_rows.cycles > sched.fast_rows.spec_cycles
        assert sched.fast_rows.n == 0 and sched.running == 0
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r1, \
                httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r2:
            next(r1.iter_lines())
            next(r2.iter_lines())  # two requests decoding on the fast rows
        assert wait_idle(srv)
        assert sched.fast_rows.n == 0
    finally:
        srv.stop()


def test_sampled_requests_on_fast_rows_match_the_hf_rows(stories260k):
    """Seeded sampled requests (temperature, top_p, top_k), 12 at once, answer the same text on `FastRows` as on
    the HF rows (both draw the position-keyed tokens, so batching and speculation change nothing), and on
    the rows server every cycle was a fast-rows cycle."""
    jobs = [(PROMPTS[i % len(PROMPTS)], 20, (0.6, 0.9, 1.2)[i % 3], (1.0, 0.8)[i % 2], (0, 20)[i % 4 == 0], 100 + i)
            for i in range(12)]
    answers = {}
    for rows in (False, True):
        srv = make_server(*stories260k, rows=rows, max_batch_size=16)
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

            def one(job, c=c):
                prompt, n, temperature, top_p, top_k, seed = job
                r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=temperature,
                                         top_p=top_p, seed=seed, extra_body={"top_k": top_k})
                return r.choices[0].text

            with ThreadPoolExecutor(len(jobs)) as pool:
                answers[rows] = list(pool.map(one, jobs, timeout=120))
            if rows:
                sched = srv.app.state.scheduler
                assert sched.fast_rows.cycles > 0
                assert metric(srv, "eagle3_verify_steps_total") == sched.fast_rows.cycles  # no generic cycle
        finally:
            srv.stop()
    assert answers[True] == answers[False]
    assert len(set(answers[True])) > 6  # the settings and seeds do vary the answers


def test_completion_stream(client, ref):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref(24, prompt=PROMPTS[1]).text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_chat_and_chat_stream(client, ref):
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]
    want = ref(13, messages=messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=13, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(ref.ids(messages=messages))
    parts = [{"role": "developer", "content": "Tell a story."},
             {"role": "user", "content": [{"type": "text", "text": "Once upon "}, {"type": "text", "text": "a time"}]}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=parts, max_tokens=13, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text  # developer == system
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[len("data: "):])["object"] == "text_completion"


def test_stop_strings(client, ref):
    full = ref(24, prompt=PROMPTS[0]).text  # ", there was a little girl named Lily. ..."
    stop = "girl"
    want = ref(24, prompt=PROMPTS[0], stop=(stop,))
    assert want.finish_reason == "stop" and stop not in want.text
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop")
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stop=["zzz", stop], stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == want.text and chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client, ref):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=24, temperature=0.9,
                                         top_p=0.95, seed=seed).choices[0].text

    a, b, c = sample(11), sample(11), sample(12)
    assert a == b
    assert a != c
    # one sampler: the engine behind `eagle3 generate` gives the same text for the same request and seed
    with ref.lock:
        cli = ref.engine.generate(ref.ids(PROMPTS[4]), max_new_tokens=24, eos_token_ids=ref.eos,
                                  sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=11))
    assert cli.text == a


def test_models_health_metrics(client, server):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)  # something to count
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("eagle3_requests_total", "eagle3_generation_tokens_total", "eagle3_tau_bucket",
                 "eagle3_acceptance_rate", "eagle3_queue_depth", "eagle3_batch_size_bucket",
                 "eagle3_request_latency_seconds_bucket", "eagle3_time_to_first_token_seconds_count"):
        assert name in text, name
    assert metric(server, "eagle3_spec_row_steps_total") > 0  # speculation really ran
    families = {f.name: f for f in text_string_to_metric_families(text)}  # a Prometheus parser reads it all
    assert families["eagle3_requests"].type == "counter" and families["eagle3_tau"].type == "histogram"
    rates = [s.value for s in families["eagle3_acceptance_rate"].samples]
    assert rates and all(0 <= r <= 1 for r in rates)
    tried = {s.labels["position"]: s.value for s in families["eagle3_draft_position_tried"].samples
             if s.name.endswith("_total")}
    assert tried["1"] >= max(tried.values())  # every row that drafted tried position 1


# -- 400s ------------------------------------------------------------------------------------
BAD = {
    "unknown field": ({"foo": 1}, "foo"),
    "mistyped temperature": ({"temperature": "hot"}, "temperature"),
    "mistyped max_tokens": ({"max_tokens": 2.5}, "max_tokens"),
    "mistyped stream": ({"stream": "yes"}, "stream"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"max_tokens": -3}, "max_tokens"),
    "temperature too high": ({"temperature": 2.5}, "temperature"),
    "temperature negative": ({"temperature": -0.1}, "temperature"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    "n 2": ({"n": 2}, "n"),
    "prompt too long": ({"prompt": "Once upon a time " * 200}, "prompt"),
    "completion too long": ({"max_tokens": 600}, "max_tokens"),
    "stop not strings": ({"stop": [1, 2]}, "stop"),
    "several prompts": ({"prompt": ["a", "b"]}, "prompt"),
    "token id out of range": ({"prompt": [1, 99999]}, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_completion_400(server, case):
    extra, param = BAD[case]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_chat_400_with_openai_client(client):
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [
        (dict(messages=[]), "messages"),
        (dict(messages=msgs, n=2), "n"),
        (dict(messages=msgs, max_tokens=0), "max_tokens"),
        (dict(messages=msgs, temperature=3.0), "temperature"),
        (dict(messages=[{"role": "user", "content": "Once upon a time " * 200}]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "Hi"}]), "messages[0].role"),
        (dict(messages=[{"role": "user"}]), "messages[0].content"),
        (dict(messages=msgs, extra_body={"bogus": True}), "bogus"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, **kwargs)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, kwargs
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=msgs)


def test_malformed_json_and_unknown_route(server):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(server.url + "/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


# -- disconnects, load, shutdown --------------------------------------------------------------------
def wait_idle(server, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/health", timeout=10).json()["running"] == 0:
            return True
        time.sleep(0.02)
    return False


def test_disconnect_mid_stream_frees_the_slot(server):
    cancelled = metric(server, 'eagle3_requests_total{endpoint="completions",finish_reason="cancelled"}')
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert httpx.get(server.url + "/health", timeout=10).json()["running"] == 1
    assert wait_idle(server)
    assert time.monotonic() - t0 < 3.0  # 480 tokens take longer: the row was freed, not finished
    assert metric(server, 'eagle3_requests_total{endpoint="completions",finish_reason="cancelled"}') == cancelled + 1
    # a non-streaming client that gives up frees its slot too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    assert wait_idle(server)
    assert metric(server, 'eagle3_requests_total{endpoint="completions",finish_reason="cancelled"}') == cancelled + 2


def test_streamed_chunks_are_not_held_back_by_nagle(server):
    """The in-process server's connections have TCP_NODELAY. Without it every streamed chunk after the first
    waited for the client's delayed ACK (40 ms on Linux), a floor under each time to first token measured."""
    import socket
    from urllib.parse import urlsplit

    # An idle connection stays open (until uvicorn's keep-alive timeout) however fast the model answers, so it can
    # be found in uvicorn's set of connections; a streamed answer may finish and close first.
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=5) as client_sock:

        def ours(conn) -> socket.socket | None:
            """conn's socket if it is our idle connection; the server thread may close others meanwhile."""
            try:
                sock = conn.transport.get_extra_info("socket")
                return sock if sock.getpeername() == client_sock.getsockname() else None
            except OSError:  # closed between listing and asking: not ours
                return None

        deadline, socks = time.monotonic() + 5, []
        while not socks and time.monotonic() < deadline:
            socks = [s for c in list(server.server.server_state.connections) if (s := ours(c)) is not None]
            time.sleep(0.005)
        assert len(socks) == 1 and socks[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_64_concurrent_clients(client, ref):
    jobs = [(PROMPTS[i % len(PROMPTS)], (8, 13, 24)[i % 3], i % 2 == 0) for i in range(64)]

    def one(job):
        prompt, n, stream = job
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                    stream=True))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, jobs, timeout=120))  # any error or 5xx raises here
    for (prompt, n, _), (text, finish) in zip(jobs, results, strict=True):
        want = ref(n, prompt=prompt)
        assert (text, finish) == (want.text, want.finish_reason), (prompt, n)


@pytest.mark.parametrize("where", ["batch", "fast-rows"])
def test_graceful_shutdown_finishes_in_flight_requests(stories260k, where):
    srv = make_server(*stories260k, spec=False, rows=where == "fast-rows", shutdown_timeout=20.0)
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0, "stream": True}
    got: list[str] = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got.append(next(lines))
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        time.sleep(0.1)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(srv.url + "/health", timeout=2)
        got += [line for line in lines if line]
    stopper.join(30)
    assert not stopper.is_alive()
    assert got[-1] == "data: [DONE]"
    assert json.loads(got[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_smollm2_chat(smollm2):
    model, tok = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    engine = SpeculativeEngine(Target(model, []), NoDraftProposer(), tok)
    want = engine.generate(encode_prompt(tok, chat=messages), max_new_tokens=16, eos_token_ids=eos_token_ids(model, tok))
    engine.target.close()
    model = copy.deepcopy(model)
    d = init_drafter(model, draft_vocab_size=4096, seed=0)
    sched = build_scheduler(Target(model, d.config.aux_layer_ids), tok, eos_token_ids(model, tok),
                            Eagle3BatchDrafter(d), SpecPolicy(token_budget=32),
                            ServeConfig(model_name="smollm2"))
    with ServerThread(create_app(sched)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason
        chunks = list(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                                stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text


def test_auto_on_off_choice():
    """An auto/on/off option (`--fast-rows`, `FastOptions.graph_prefill`): auto is on for CUDA only; anything
    else is refused."""
    from eagle3.config import ConfigError, on_for_device

    assert [on_for_device(c, d) for c, d in (("auto", "cuda:1"), ("auto", "cpu"), ("on", "cpu"),
                                                ("off", "cuda"))] == [True, False, True, False]
    with pytest.raises(ConfigError, match="auto, on or off"):
        on_for_device(True, "cuda")


def test_serve_cli_loads_a_saved_drafter(stories260k, tmp_path, caplog):
    """`eagle3 serve` flags -> a working server: drafter from disk, chat template file, ngram and plain modes, with
    and without the fast rows."""
    import argparse

    from eagle3.config import ConfigError
    from eagle3.formats import save_drafter
    from eagle3.serving.cli import add_serve_parser, describe, load_server

    model, _tok = stories260k
    save_drafter(init_drafter(copy.deepcopy(model), seed=0), tmp_path / "drafter")
    (tmp_path / "chat.jinja").write_text(TEMPLATE, encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    for extra, drafter_name in ((["--drafter", str(tmp_path / "drafter"), "--tree", "3,2,6"], "eagle3"),
                                (["--draft", "ngram", "--chain", "3"], "per-row"),
                                (["--no-spec"], None),
                                (["--drafter", str(tmp_path / "drafter"), "--fast-rows", "on",
                                  "--fast-rows-len", "256"], "eagle3"),
                                (["--no-spec", "--fast-rows", "on", "--fast-rows-len", "256"], None)):
        args = parser.parse_args(["serve", "--target", MODEL, "--device", "cpu", "--chat-template",
                                  str(tmp_path / "chat.jinja"), *extra])
        assert args.func.__name__ == "cmd_serve"
        caplog.clear()
        sched, app = load_server(args)
        assert "no effect" not in caplog.text
        assert (sched.drafter.name if sched.drafter else None) == drafter_name
        assert sched.policy.enabled == (drafter_name is not None)
        # auto: the fast rows wherever `eagle3 generate` takes the fast engine (a CPU with native bf16), unless
        # n-grams draft (on the HF rows: the fast rows draft with EAGLE-3 drafters only)
        rows = "--fast-rows" in extra or (native_bf16("cpu") and drafter_name != "per-row")
        assert (sched.fast_rows is not None) == rows
        line = describe(sched)
        assert "fast lane" not in line and "cpu" in line
        assert (f"fast rows on ({sched.fast_rows.seq_len} slots each)" if rows else "fast rows off") in line
        if rows:
            assert sched.fast_rows.seq_len == (256 if "--fast-rows-len" in extra else 512 + 128)  # the model's length
            assert (sched.fast_rows.d is not None) == (drafter_name == "eagle3")
        assert ("plain batched decoding" in line) == (drafter_name is None)
        with ServerThread(app) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0)
            assert r.usage.completion_tokens == 6
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--target", MODEL, "--tree", "3,2,6", "--chain", "3"])
    with pytest.raises(ConfigError, match="--draft ngram drafts on the HF rows"):
        load_server(parser.parse_args(["serve", "--target", MODEL, "--device", "cpu", "--draft", "ngram",
                                       "--fast-rows", "on"]))
