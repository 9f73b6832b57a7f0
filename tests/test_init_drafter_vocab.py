"""`eagle3 init-drafter` chooses a draft vocabulary by default (from prepared data, else the first 32,000 ids,
capped at the target's), says which, and `train --init` takes such a drafter with its data or refuses clearly."""

from __future__ import annotations

import pytest
import torch

import eagle3.cli as cli
from eagle3.cli import main
from eagle3.formats import read_vocab_mapping
from eagle3.training.vocab import draft_ids_to_target, initial_draft_ids, load_vocab_mapping
from test_trainer import VD, V, random_rows, write_prepared


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_prepared(tmp_path_factory.mktemp("data"), random_rows())


def draft_ids(drafter) -> torch.Tensor:
    d2t, _ = read_vocab_mapping(drafter)
    return draft_ids_to_target(d2t)


def test_a_large_vocabulary_gets_32000_draft_ids_by_default():
    ids, how = initial_draft_ids(262144, None)
    assert torch.equal(ids, torch.arange(32000)) and "first 32000 of 262144" in how
    assert initial_draft_ids(262144, 0)[0] is None  # full
    assert initial_draft_ids(512, None)[0] is None  # capped at the target's vocabulary: the full one


def test_init_drafter_picks_a_draft_vocabulary_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "DEFAULT_DRAFT_VOCAB_SIZE", 100)  # stories260k has 512 ids, fewer than 32,000
    out = tmp_path / "d"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "draft vocabulary: the first 100 of 512 target ids" in err and "--draft-vocab-size" in err
    assert torch.equal(draft_ids(out), torch.arange(100))
    full = tmp_path / "full"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(full), "--draft-vocab-size", "full"]) == 0
    assert "the full vocabulary (512 ids)" in capsys.readouterr().err


def test_init_drafter_takes_the_vocabulary_of_prepared_data(data_dir, tmp_path, capsys):
    d2t, _ = load_vocab_mapping(data_dir / "vocab.safetensors")
    out = tmp_path / "d"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(out), "--data", str(data_dir)]) == 0
    assert f"the {VD} ids of {data_dir}" in capsys.readouterr().err
    assert torch.equal(draft_ids(out), draft_ids_to_target(d2t))
    # a size with data: the most frequent tokens of its token_freq.safetensors
    out64 = tmp_path / "d64"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(out64), "--data", str(data_dir),
                 "--draft-vocab-size", "64"]) == 0
    assert "the 64 most frequent target ids" in capsys.readouterr().err
    assert set(draft_ids(out64).tolist()) <= set(draft_ids_to_target(d2t).tolist())
    # train --init accepts the drafter made from the data
    run = tmp_path / "run"
    assert main(["train", "--target", "stories260k", "--data", str(data_dir), "--out", str(run), "--init", str(out),
                 "--max-steps", "1", "--batch-size", "4", "--max-length", "64", "--ttt-steps", "2"]) == 0


def test_train_init_with_another_vocabulary_is_a_clear_error(data_dir, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(out), "--draft-vocab-size", str(VD)]) == 0
    capsys.readouterr()
    assert main(["train", "--target", "stories260k", "--data", str(data_dir), "--out", str(tmp_path / "run"),
                 "--init", str(out), "--max-steps", "1", "--batch-size", "4", "--max-length", "64"]) == 2
    err = capsys.readouterr().err
    assert "eagle3: error:" in err and "Traceback" not in err and f"eagle3 prepare --vocab-from {out}" in err
    assert f"eagle3 init-drafter --data {data_dir}" in err


@pytest.mark.parametrize("args, message", [
    (["--draft-vocab-size", str(V + 1)], "larger than the target's vocabulary (512 ids)"),
    (["--data", "/nonexistent"], "folder written by `eagle3 prepare`"),
])
def test_bad_draft_vocabularies_are_clear_errors(tmp_path, capsys, args, message):
    assert main(["init-drafter", "--target", "stories260k", "--out", str(tmp_path / "d"), *args]) == 2
    err = capsys.readouterr().err
    assert "eagle3: error:" in err and "Traceback" not in err and message in err


def test_draft_vocab_size_must_be_a_number_or_full(tmp_path):
    with pytest.raises(SystemExit):
        main(["init-drafter", "--target", "stories260k", "--out", str(tmp_path / "d"), "--draft-vocab-size", "lots"])
