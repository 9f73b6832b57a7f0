"""`eagle3 serve --served-model-name` and its default (the target as given, or a local path's folder name or .gguf
stem), and `eagle3 serve` on an install without the `serve` extra."""

from __future__ import annotations

import argparse
import sys

import pytest

from eagle3.serving.cli import served_model_name

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def test_default_served_name(tmp_path) -> None:
    """Bundled names and hub ids stay as given; a local folder gives its name, a .gguf file its stem."""
    assert served_model_name("stories260k") == "stories260k"
    assert served_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    folder = tmp_path / "models" / "my-model"
    folder.mkdir(parents=True)
    assert served_model_name(str(folder)) == "my-model"
    assert served_model_name(f"{folder}/") == "my-model"
    gguf = tmp_path / "tiny.Q4_0.gguf"
    gguf.write_bytes(b"")
    assert served_model_name(str(gguf)) == "tiny.Q4_0"


def test_served_name_in_models_and_requests(tmp_path) -> None:
    """A target given as a local path is served under its folder name (not the path), which requests must name;
    `--served-model-name` replaces it."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import httpx

    from eagle3.models import STORIES260K_DIR
    from eagle3.serving.cli import add_serve_parser, load_server
    from eagle3.serving.server import ServerThread

    (tmp_path / "chat.jinja").write_text(TEMPLATE, encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    base = ["serve", "--target", str(STORIES260K_DIR), "--device", "cpu", "--no-spec", "--chat-template",
            str(tmp_path / "chat.jinja")]
    for extra, name in (([], STORIES260K_DIR.name), (["--served-model-name", "tiny"], "tiny")):
        _sched, app = load_server(parser.parse_args(base + extra))
        with ServerThread(app) as srv:
            models = httpx.get(srv.url + "/v1/models", timeout=30).json()
            assert [m["id"] for m in models["data"]] == [name]
            body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
            r = httpx.post(srv.url + "/v1/completions", json={**body, "model": name}, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == name
            r = httpx.post(srv.url + "/v1/completions", json={**body, "model": str(STORIES260K_DIR)}, timeout=60)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_serve_without_the_extra(monkeypatch, capsys) -> None:
    """Without uvicorn (or fastapi), `eagle3 serve` names the extra to install and exits 2, no traceback."""
    from eagle3.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    assert main(["serve", "--target", "stories260k", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "eagle3: error: eagle3 serve needs the serve extra: pip install 'eagle3[serve]'"
