"""Swapping the drafter of a running server (`POST /admin/drafter`): a live uvicorn server on 127.0.0.1 serving
stories260K (fp32, CPU) with a drafter written by `eagle3 init-drafter`, the real `openai` client for requests and
`httpx` for the admin calls.

Covers: 16 concurrent greedy clients while the drafter is swapped five times between two folders and rolled back
once (no errors, every answer equal to plain decoding), the admin token (401, and 404 without one), candidates
refused with a 400 (another target's, other aux layers, no folder) or a 409 (failed probe, nothing to roll back
to) while serving continues, GET's state, the version label in /metrics, and the fast rows taking the new
drafter's weights in place (or decoding plain where its shapes differ).
Run: pytest tests/test_swap.py
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from eagle3.cli import main  # noqa: E402
from eagle3.config import ConfigError, DraftShape  # noqa: E402
from eagle3.decoding.drafters import Eagle3BatchDrafter  # noqa: E402
from eagle3.decoding.engine import SpeculativeEngine  # noqa: E402
from eagle3.decoding.proposers import NoDraftProposer  # noqa: E402
from eagle3.formats import save_drafter  # noqa: E402
from eagle3.runtime import drafter_for, encode_prompt, eos_token_ids, init_drafter  # noqa: E402
from eagle3.serving.app import create_app  # noqa: E402
from eagle3.serving.cli import fast_rows  # noqa: E402
from eagle3.serving.config import ServeConfig  # noqa: E402
from eagle3.serving.policy import SpecPolicy  # noqa: E402
from eagle3.serving.server import ServerThread, build_scheduler  # noqa: E402
from eagle3.target import Target  # noqa: E402

MODEL = "stories260k"
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ["Once upon a time", "Lily", "The end.", "Tom had a red ball. He", "One day", "Sam and his mom",
           "The little dog", "Mia found a shiny"]
LENGTHS = (8, 13, 24)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, stories260k, tiny_target):
    """Drafter folders: `a` and `b` for stories260K (seeds 0 and 1), `other` for another target, `aux` reading
    other layers than `a` and `b`."""
    root = tmp_path_factory.mktemp("drafters")
    out = {name: root / name for name in ("a", "b", "other", "aux")}
    for name, seed in (("a", 0), ("b", 1)):
        assert main(["init-drafter", "--target", MODEL, "--out", str(out[name]), "--draft-vocab-size", "full",
                     "--seed", str(seed)]) == 0
    save_drafter(init_drafter(tiny_target("llama")), out["other"], format="speculators")
    save_drafter(init_drafter(stories260k[0], aux_layer_ids=[0, 1, 3]), out["aux"], format="speculators")
    return out


@pytest.fixture(scope="module")
def ref(stories260k):
    """Plain greedy answers (bs=1, no drafts) for every prompt and length."""
    model, tok = stories260k
    engine = SpeculativeEngine(Target(model, []), NoDraftProposer(), tok)
    eos = eos_token_ids(model, tok)
    answers = {(p, n): engine.generate(encode_prompt(tok, prompt=p), max_new_tokens=n, eos_token_ids=eos)
               for p in PROMPTS for n in LENGTHS}
    engine.target.close()
    return answers


def start(stories260k, drafter_dir, admin_token: str | None = TOKEN, rows: bool = False,
          measure: bool = False) -> ServerThread:
    """A started server on a private copy of the model, drafting with the drafter in `drafter_dir`; `rows`: with
    fast rows (on the CPU); `measure`: with the speed gates."""
    model, tok = stories260k
    model = copy.deepcopy(model)
    d = drafter_for(model, drafter_dir)
    shape = DraftShape(3, 2, 6)
    # no speed gate: rows keep drafting with a random drafter, so every cycle verifies real trees
    policy = SpecPolicy(shape, token_budget=64, measure=measure)
    cfg = ServeConfig(model_name=MODEL, admin_token=admin_token, max_batch_size=16)
    fr = fast_rows("on", model, d, policy, cfg, "cpu") if rows else None
    sched = build_scheduler(Target(model, d.config.aux_layer_ids), tok, eos_token_ids(model, tok),
                            Eagle3BatchDrafter(d), policy, cfg, rows=fr)
    sched.loaded.path = str(drafter_dir)
    return ServerThread(create_app(sched), shutdown_timeout=10).start()


@pytest.fixture(scope="module")
def server(stories260k, folders, ref):
    srv = start(stories260k, folders["a"])
    yield srv
    srv.stop()


def admin(srv, method: str, route: str = "", headers=AUTH, **kw) -> httpx.Response:
    return httpx.request(method, srv.url + "/admin/drafter" + route, headers=headers, timeout=60, **kw)


def metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics", timeout=10).text


def complete(srv, prompt: str, n: int, c=None) -> str:
    c = c or openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0).choices[0].text


def test_state_before_any_swap(server, folders):
    r = admin(server, "GET")
    assert r.status_code == 200
    body = r.json()
    assert (body["version"], body["path"], body["previous"]) == ("v1", str(folders["a"]), None)
    assert abs(body["loaded_at"] - time.time()) < 600
    r = admin(server, "POST", "/rollback")
    assert r.status_code == 409 and r.json()["error"]["code"] == "nothing_to_roll_back"
    assert 'eagle3_drafter_version{version="v1"} 1' in metrics(server)


def test_admin_routes_want_the_token(server, stories260k, folders):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method, route in (("GET", ""), ("POST", ""), ("POST", "/rollback")):
            r = admin(server, method, route, headers=headers, json={"path": str(folders["b"])})
            assert r.status_code == 401, (headers, method, route)
            assert r.headers["www-authenticate"] == "Bearer"
    assert admin(server, "GET").json()["version"] == "v1"  # nothing swapped
    plain = start(stories260k, folders["a"], admin_token=None)
    try:
        for method, route in (("GET", ""), ("POST", ""), ("POST", "/rollback")):
            assert admin(plain, method, route, json={"path": str(folders["b"])}).status_code == 404
    finally:
        plain.stop()


def test_bad_candidates_are_refused_and_serving_continues(server, stories260k, folders, ref):
    with pytest.raises(ConfigError) as loader:
        drafter_for(stories260k[0], folders["other"])
    r = admin(server, "POST", json={"path": str(folders["other"])})
    assert r.status_code == 400 and r.json()["error"]["message"] == str(loader.value)
    r = admin(server, "POST", json={"path": str(folders["aux"])})
    assert r.status_code == 400 and r.json()["error"]["code"] == "aux_layers_differ"
    assert "[0, 1, 3]" in r.json()["error"]["message"] and "restart" in r.json()["error"]["message"]
    r = admin(server, "POST", json={"path": str(folders["a"] / "missing")})
    assert r.status_code == 400 and "config.json" in r.json()["error"]["message"]
    for body in ({}, {"path": 3}, {"path": str(folders["b"]), "x": 1}):
        assert admin(server, "POST", json=body).status_code == 400
    assert admin(server, "POST", content=b"not json").status_code == 400
    # a candidate whose greedy tokens differ from the target's own is a 409 (here: a probe reference made wrong)
    sched = server.app.state.scheduler
    wrong = [(t + 1) % 512 for t in ref[(PROMPTS[0], 13)].token_ids]
    sched._probe_plain = (encode_prompt(stories260k[1], prompt=PROMPTS[0]), wrong)
    try:
        r = admin(server, "POST", json={"path": str(folders["b"])})
    finally:
        sched._probe_plain = None
    assert r.status_code == 409 and r.json()["error"]["code"] == "probe_mismatch"
    assert admin(server, "GET").json()["version"] == "v1"
    assert complete(server, PROMPTS[0], 24) == ref[(PROMPTS[0], 24)].text


def test_swaps_under_load_keep_every_answer(server, folders, ref, caplog):
    """16 greedy clients loop over the prompts while the drafter changes 6 times: no errors, every answer plain
    decoding's; rows decoding at a swap finish without drafting, later ones draft with the new drafter."""
    caplog.set_level(logging.INFO, logger="eagle3.serving")
    sched = server.app.state.scheduler
    done = threading.Event()
    jobs = [(PROMPTS[i % len(PROMPTS)], LENGTHS[i % len(LENGTHS)]) for i in range(16)]

    def client(job) -> list[tuple[str, int, str]]:
        prompt, n = job
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answers = []
        while not done.is_set() or len(answers) < 2:
            answers.append((prompt, n, complete(server, prompt, n, c)))
        return answers

    steps = [("b", "v2"), ("a", "v3"), ("b", "v4"), (None, "v3"), ("b", "v5"), ("a", "v6")]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client, job) for job in jobs]
        try:
            for name, version in steps:
                deadline = time.monotonic() + 10
                while sched.running < 4 and time.monotonic() < deadline:  # swap while rows are decoding
                    time.sleep(0.01)
                r = admin(server, "POST", "/rollback") if name is None else \
                    admin(server, "POST", json={"path": str(folders[name])})
                assert r.status_code == 200, r.text
                assert r.json()["version"] == version
                time.sleep(0.2)
        finally:
            done.set()
        answers = [a for f in futures for a in f.result(timeout=120)]
    assert len(answers) >= 32
    in_flight = [int(m.split(";")[1].split()[0]) for m in caplog.messages if "finish without drafting" in m]
    assert len(in_flight) == len(steps) and max(in_flight) > 0
    for prompt, n, text in answers:
        assert text == ref[(prompt, n)].text, (prompt, n)
    body = admin(server, "GET").json()
    assert (body["version"], body["path"]) == ("v6", str(folders["a"]))
    assert (body["previous"]["version"], body["previous"]["path"]) == ("v5", str(folders["b"]))
    assert sched.drafter_version == "v6"
    text = metrics(server)
    assert 'eagle3_drafter_version{version="v6"} 1' in text and 'version="v5"' not in text
    drafted = sched.metrics.get("eagle3_draft_tokens_total")
    assert complete(server, PROMPTS[1], 24) == ref[(PROMPTS[1], 24)].text
    assert sched.metrics.get("eagle3_draft_tokens_total") > drafted  # the new drafter drafts for new rows


def test_fast_rows_take_the_new_drafter_in_place(stories260k, folders, ref):
    """A swap to a drafter of the same shapes writes its weights into the fast rows' own tensors: they keep
    drafting (speculative cycles after the swap, for a lone request and for several), with the new weights; a
    rollback brings the old weights back (the swap left the old drafter its own copy). A drafter of other shapes
    (a smaller draft vocabulary) leaves them decoding plain. Every answer stays plain decoding's."""
    from eagle3.fast.drafter import WEIGHTS, FastDrafter

    def same(fd: FastDrafter, ref: FastDrafter) -> bool:
        return all(torch.equal(getattr(fd, n), getattr(ref, n)) for n in WEIGHTS if getattr(ref, n) is not None)

    model, _ = stories260k
    small = folders["a"].parent / "small"
    if not small.exists():
        assert main(["init-drafter", "--target", MODEL, "--out", str(small), "--draft-vocab-size", "256"]) == 0
    want = {name: FastDrafter(drafter_for(copy.deepcopy(model), folders[name])) for name in ("a", "b")}
    srv = start(stories260k, folders["a"], rows=True)  # no gate: the rows draft in every cycle
    try:
        sched = srv.app.state.scheduler
        rows_d = sched.fast_rows.d
        wqkv = rows_d.wqkv.data_ptr()
        assert complete(srv, PROMPTS[3], 13) == ref[(PROMPTS[3], 13)].text

        def serve_four() -> None:
            spec_cycles = sched.fast_rows.spec_cycles
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda p: complete(srv, p, 24), PROMPTS[:4]))
            assert got == [ref[(p, 24)].text for p in PROMPTS[:4]]
            return sched.fast_rows.spec_cycles - spec_cycles

        r = admin(srv, "POST", json={"path": str(folders["b"])})
        assert r.status_code == 200 and r.json()["version"] == "v2"
        assert sched._batches[0].spec
        assert sched.fast_rows.d is rows_d and rows_d.wqkv.data_ptr() == wqkv  # the same tensors
        assert same(rows_d, want["b"])
        spec_cycles = sched.fast_rows.spec_cycles
        assert complete(srv, PROMPTS[3], 13) == ref[(PROMPTS[3], 13)].text  # alone: one fast row, drafting
        assert sched.fast_rows.spec_cycles > spec_cycles
        assert serve_four() > 0

        r = admin(srv, "POST", "/rollback")
        assert r.status_code == 200 and r.json()["version"] == "v1"
        assert same(rows_d, want["a"])
        assert serve_four() > 0

        r = admin(srv, "POST", json={"path": str(small)})
        assert r.status_code == 200
        assert not sched._batches[0].spec  # other shapes: plain from now on
        assert complete(srv, PROMPTS[3], 13) == ref[(PROMPTS[3], 13)].text
        assert serve_four() == 0
    finally:
        srv.stop()
