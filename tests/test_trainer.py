"""`eagle3 train` on CPU with the bundled stories260k target: resume, DDP, a sharded (FSDP) target, offline cache,
batching, config errors.

Run: pytest tests/test_trainer.py -q     (about 30 s on 2 cores; the DDP and FSDP tests start `torchrun` 2x gloo)
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle3.config import ConfigError
from eagle3.models import STORIES260K_DIR, load_target
from eagle3.target import Target
from eagle3.training.checkpoints import CHECKPOINT_DIR, latest_checkpoint
from eagle3.training.config import TrainConfig
from eagle3.training.data import tokenizer_fingerprint
from eagle3.training.dataset import TrainData
from eagle3.training.features import OnlineFeatures
from eagle3.training.prepare import (
    MASK_FILE,
    OFFSETS_FILE,
    REPORT_FILE,
    TOKENS_FILE,
    PrepareReport,
    write_json_atomic,
)
from eagle3.training.schedule import budget_steps
from eagle3.training.step import VAL_LOG_FILE
from eagle3.training.trainer import LOG_FILE, train
from eagle3.training.vocab import build_vocab_mapping, save_token_freq, save_vocab_mapping

V = 512  # stories260k vocabulary
VD = 128


def write_prepared(path: Path, rows: list[tuple[np.ndarray, np.ndarray]], vocab_size: int = V,
                   draft_vocab_size: int = VD, tokenizer_fp: dict | None = None) -> Path:
    """A prepared folder in the `eagle3 prepare` format (see eagle3.training.prepare)."""
    path.mkdir(parents=True, exist_ok=True)
    ids = np.concatenate([r[0] for r in rows]).astype("<i4")
    mask = np.concatenate([r[1] for r in rows]).astype(np.uint8)
    offsets = np.cumsum([0] + [len(r[0]) for r in rows]).astype(np.int64)
    ids.tofile(path / TOKENS_FILE)
    mask.tofile(path / MASK_FILE)
    np.save(path / OFFSETS_FILE, offsets)
    freq = torch.from_numpy(np.bincount(ids[mask.astype(bool)], minlength=vocab_size).astype(np.int64))
    d2t, t2d = build_vocab_mapping(freq, draft_vocab_size)
    save_token_freq(freq, path / "token_freq.safetensors")
    save_vocab_mapping(d2t, t2d, path / "vocab.safetensors")
    if tokenizer_fp is None:
        tokenizer_fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(STORIES260K_DIR)))
    report = PrepareReport(rows_read=len(rows), rows_kept=len(rows), total_tokens=int(offsets[-1]),
                           trainable_tokens=int(mask.sum()), vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
                           tokenizer=tokenizer_fp, max_length=max(len(r[0]) for r in rows))
    write_json_atomic(report.to_dict(), path / REPORT_FILE)
    return path


def random_rows(n: int = 24, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token rows whose first few tokens are 'prompt' (mask 0) and the rest 'assistant' (mask 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(rng.integers(12, 40))
        ids = rng.integers(3, V, size=length)
        ids[0] = 1  # BOS
        mask = np.zeros(length, dtype=np.uint8)
        mask[int(rng.integers(2, 6)) :] = 1
        rows.append((ids, mask))
    return rows


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("data"), random_rows())


def base_cfg(data_dir: Path, out: Path, **kw) -> TrainConfig:
    args = dict(target="stories260k", data=str(data_dir), out=str(out), ttt_steps=3, batch_size=4, max_steps=6,
                lr=1e-3, warmup_steps=2, max_length=64, save_every=3, log_every=1, seed=3, progress=False)
    args.update(kw)
    return TrainConfig(**args)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "drafter" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight_run(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight")
    res = train(base_cfg(data_dir, out))
    assert res.steps == 6
    return out


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


def test_resume_reaches_the_same_weights(data_dir, straight_run, tmp_path):
    out = tmp_path / "resumed"
    first = train(base_cfg(data_dir, out, stop_after=3))
    assert first.steps == 3 and not (out / "drafter").exists()
    assert latest_checkpoint(out).name == "step_00000003"
    # a crash while writing the next checkpoint leaves a hidden temporary directory, which resume ignores
    (out / CHECKPOINT_DIR / ".tmp-step_00000004").mkdir()
    second = train(base_cfg(data_dir, out, resume=True))
    assert second.steps == 6
    assert_same_weights(weights(straight_run), weights(out), atol=0.0)
    steps = [json.loads(x)["step"] for x in (out / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    ckpts = sorted(p.name for p in (out / CHECKPOINT_DIR).iterdir() if not p.name.startswith("."))
    assert ckpts == ["step_00000003", "step_00000006"]  # keep_checkpoints = 2


def test_log_records(straight_run):
    recs = [json.loads(x) for x in (straight_run / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 7))
    r = recs[-1]
    assert len(r["loss_per_step"]) == len(r["acc_per_step"]) == len(r["acc_early_per_step"]) == 3
    assert all(0 <= a <= 1 for a in r["acc_early_per_step"]) and r["early_tokens"] == 128
    assert r["tokens_per_s"] > 0 and r["tokens"] > 0 and 0 <= r["in_draft_vocab"] <= 1
    assert len(r["scored_per_step"]) == 3 and r["scored_per_step"][0] == r["in_draft_vocab"]
    assert recs[0]["lr"] == pytest.approx(1e-3 / 2)  # warmup step 1 of 2
    assert all(np.isfinite(x["loss"]) for x in recs)
    cfg = json.loads((straight_run / "train_config.json").read_text())
    assert cfg["config"]["ttt_steps"] == 3 and cfg["drafter"]["draft_vocab_size"] == VD
    assert cfg["compiled"] is False and cfg["autocast"] is False  # CPU defaults


def test_grad_accum_matches_one_batch(data_dir, straight_run, tmp_path):
    out = tmp_path / "accum"
    train(base_cfg(data_dir, out, grad_accum=3))
    assert_same_weights(weights(straight_run), weights(out), atol=1e-6)


def test_ddp_two_processes_match_one(data_dir, straight_run, tmp_path):
    out = tmp_path / "ddp"
    cfg = base_cfg(data_dir, out)
    script = tmp_path / "run_train.py"
    script.write_text("import json, sys\nfrom eagle3.training.trainer import TrainConfig, train\n"
                      "train(TrainConfig(**json.loads(sys.argv[1])))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         json.dumps(cfg.to_dict())],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_weights(weights(straight_run), weights(out), atol=1e-6)


# A torchrun worker: trains `TrainConfig(**argv[1])`; with argv[2], each rank also writes its share of the
# sharded target there (from inside the worker, right after `shard_target`).
TRAIN_WORKER = '''\
import json, sys
from pathlib import Path

import torch.distributed as dist

from eagle3.training import distributed, trainer

if len(sys.argv) > 2:
    shard = distributed.shard_target

    def spy(model, device, world):
        local, full = shard(model, device, world)
        frozen = not any(p.requires_grad for p in model.parameters())
        Path(sys.argv[2], f"rank{dist.get_rank()}.json").write_text(
            json.dumps({"local": local, "full": full, "frozen": frozen}))
        return local, full

    distributed.shard_target = spy
trainer.train(trainer.TrainConfig(**json.loads(sys.argv[1])))
'''

# A torchrun worker: features of this rank's own rows (different on each rank) from a sharded and an unsharded
# stories260k, written to argv[2]/rank{r}.json as the largest differences.
FEATURES_WORKER = '''\
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3.models import load_target
from eagle3.target import Target, decoder_parts
from eagle3.training.dataset import TrainData
from eagle3.training.features import OnlineFeatures
from eagle3.training.distributed import shard_target

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = TrainData(sys.argv[1], max_length=64)
t2d = data.dataset.vocab_mapping()[1]
ref = load_target("stories260k")[0]
aux_ids = [0, 2, len(decoder_parts(ref)[0])]  # the last one taps the final norm's input (root FSDP unit)
plain = OnlineFeatures(Target(ref, aux_ids), t2d)
before, after = load_target("stories260k")[0], load_target("stories260k")[0]
hooked_first = Target(before, aux_ids)  # hooks registered before sharding ...
counts = shard_target(before, torch.device("cpu"), world)
shard_target(after, torch.device("cpu"), world)
sharded = [OnlineFeatures(hooked_first, t2d), OnlineFeatures(Target(after, aux_ids), t2d)]  # ... and after
rows = [[s] for s in data.trainable_ids[5 * rank : 5 * rank + 5].tolist()]
out = {"local": counts[0], "full": counts[1], "diff": []}
for packed in (False, True):
    batch = data.collate([sum(rows, [])] if packed else rows, packed=packed)
    want = plain(batch)
    for src in sharded:
        got = src(batch)
        assert got.aux.shape == want.aux.shape and got.target_logits.shape == want.target_logits.shape
        out["diff"].append([float((got.aux - want.aux).abs().max()),
                            float((got.target_logits - want.target_logits).abs().max()),
                            int((got.target_argmax != want.target_argmax).sum())])
out["still_sharded"] = all(type(p).__name__ == "DTensor" for p in after.parameters())
out["local_after"] = sum(p.to_local().numel() for p in after.parameters())
Path(sys.argv[2], f"rank{rank}.json").write_text(json.dumps(out))
dist.destroy_process_group()
'''


# gloo's C++ side can abort a worker ("terminate called without an active exception", SIGABRT, no Python
# traceback) in a test that passes when run again: such a crash is run once more
ABORTED = "terminate called without an active exception"


def torchrun2(tmp_path: Path, worker: str, *args: str, timeout: int = 240) -> None:
    """Run `worker` (Python source) in 2 gloo processes under torchrun, like test_ddp_two_processes_match_one.
    On a timeout (ranks stuck in a collective) torchrun gets SIGTERM, on which it stops its workers (they run in
    sessions of their own, so killing torchrun's process group would leave them hanging). A worker that gloo
    aborts (ABORTED) gets one more run; any other failure, or a second abort, fails the test."""
    for attempt in (1, 2):
        log = _torchrun2_once(tmp_path, worker, args, timeout)
        if log is None:
            return
        if attempt == 1 and ABORTED in log:
            warnings.warn(f"a torchrun worker aborted in gloo; running it again\n{log[-1500:]}", stacklevel=2)
            continue
        pytest.fail(f"torchrun failed (attempt {attempt})\n{log[-3000:]}")


def _torchrun2_once(tmp_path: Path, worker: str, args: tuple[str, ...], timeout: int) -> str | None:
    """One torchrun of `worker`: None if it succeeded, else its log."""
    script = tmp_path / f"worker_{abs(hash(worker))}.py"
    script.write_text(worker)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_file = tmp_path / f"{script.stem}.log"
    with open(log_file, "w") as f:  # a file, not a pipe: a worker left over cannot block the read
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
             *args], stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(f"torchrun did not finish in {timeout} s (ranks stuck in a collective?)\n"
                        f"{log_file.read_text()[-3000:]}")
    return None if proc.returncode == 0 else log_file.read_text()


def test_sharded_target_features_equal_unsharded(data_dir, tmp_path):
    torchrun2(tmp_path, FEATURES_WORKER, str(data_dir), str(tmp_path), timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["diff"] == [[0.0, 0.0, 0]] * 4  # aux, draft-vocab logits, argmax; padded and packed batches
        assert r["still_sharded"] and r["local_after"] == r["local"]  # gathered weights freed after forward
    assert sum(r["local"] for r in ranks) == ranks[0]["full"]
    assert all(abs(r["local"] - r["full"] / 2) < 0.05 * r["full"] for r in ranks)


def test_shard_target_two_processes_match_ddp(data_dir, tmp_path):
    # batch_size=3 over 2 ranks with grad_accum=2: rank 0 runs 2 micro-batches, rank 1 (one row) runs 1, so
    # with a sharded target rank 1 must pad with a zero-weight micro-batch or the all-gathers deadlock
    cfgs = {name: base_cfg(data_dir, tmp_path / name, batch_size=3, grad_accum=2, shard_target=name == "sharded")
            for name in ("ddp", "sharded")}
    counts = tmp_path / "counts"
    counts.mkdir()
    torchrun2(tmp_path, TRAIN_WORKER, json.dumps(cfgs["ddp"].to_dict()))
    torchrun2(tmp_path, TRAIN_WORKER, json.dumps(cfgs["sharded"].to_dict()), str(counts), timeout=120)
    assert_same_weights(weights(tmp_path / "ddp"), weights(tmp_path / "sharded"), atol=1e-6)
    logs = {n: [json.loads(x) for x in (tmp_path / n / LOG_FILE).read_text().splitlines()] for n in cfgs}
    assert [r["tokens"] for r in logs["ddp"]] == [r["tokens"] for r in logs["sharded"]]  # padding counts no tokens
    assert [r["loss"] for r in logs["ddp"]] == pytest.approx([r["loss"] for r in logs["sharded"]], abs=1e-6)
    ranks = [json.loads((counts / f"rank{r}.json").read_text()) for r in range(2)]
    full = ranks[0]["full"]
    assert all(r["frozen"] for r in ranks) and sum(r["local"] for r in ranks) == full
    assert all(abs(r["local"] - full / 2) < 0.05 * full for r in ranks)  # each rank holds about half


def test_held_out_samples_are_validated_and_never_trained_on(data_dir, tmp_path):
    """--val-fraction 0.25: 6 of the 24 samples are held out (by the seed alone), never planned for training, and
    scored at every checkpoint; a stopped and resumed run writes the same validation records as an uninterrupted
    one; two processes with a sharded target (every rank runs every held-out batch) match one process."""
    data = TrainData(str(data_dir), 64)
    held = data.hold_out(0.25, seed=3)
    assert len(held) == 6 and len(data.trainable_ids) == 18
    planned = {s for e in range(3) for b in data.plan_epoch(e, 3, batch_rows=4) for r in b for s in r}
    assert planned == set(data.trainable_ids.tolist()) and not planned & set(held.tolist())
    assert np.array_equal(TrainData(str(data_dir), 64).hold_out(0.25, seed=3), held)  # the seed alone decides

    cfg = dict(val_fraction=0.25, batch_size=3)
    one = train(base_cfg(data_dir, tmp_path / "one", **cfg))
    recs = [json.loads(x) for x in (tmp_path / "one" / VAL_LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in recs] == [3, 6] and all(r["samples"] == 6 for r in recs)
    assert len(recs[0]["acc_per_step"]) == 3 and recs[-1]["supervised_tokens"] > 0
    assert one.val == recs[-1]
    train(base_cfg(data_dir, tmp_path / "resumed", stop_after=3, **cfg))
    train(base_cfg(data_dir, tmp_path / "resumed", resume=True, **cfg))
    assert (tmp_path / "resumed" / VAL_LOG_FILE).read_text() == (tmp_path / "one" / VAL_LOG_FILE).read_text()
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "resumed"), atol=0.0)

    two = base_cfg(data_dir, tmp_path / "two", shard_target=True, **cfg)
    torchrun2(tmp_path, TRAIN_WORKER, json.dumps(two.to_dict()), timeout=180)
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"), atol=1e-6)
    recs2 = [json.loads(x) for x in (tmp_path / "two" / VAL_LOG_FILE).read_text().splitlines()]
    assert [r["supervised_tokens"] for r in recs2] == [r["supervised_tokens"] for r in recs]
    assert [r["loss"] for r in recs2] == pytest.approx([r["loss"] for r in recs], abs=1e-5)

    with pytest.raises(ConfigError, match="val_fraction"):
        train(base_cfg(data_dir, tmp_path / "bad", val_fraction=0.5))
    with pytest.raises(ConfigError, match="leaves none"):
        TrainData(str(write_prepared(tmp_path / "tiny", random_rows(1))), 64).hold_out(0.1, seed=0)


def test_shard_target_without_torchrun_has_no_effect_and_refuses_offline(data_dir, tmp_path, caplog):
    from eagle3.cli import main

    out = tmp_path / "one"
    with caplog.at_level("WARNING", logger="eagle3"):
        assert main(["train", "--target", "stories260k", "--data", str(data_dir), "--out", str(out), "--max-steps",
                     "1", "--batch-size", "4", "--max-length", "64", "--ttt-steps", "2", "--shard-target"]) == 0
    assert "--shard-target has no effect" in caplog.text
    assert json.loads((out / "train_config.json").read_text())["config"]["shard_target"] is True
    with pytest.raises(ConfigError, match="features='online' only"):
        train(base_cfg(data_dir, tmp_path / "off", features="offline", feature_cache=str(tmp_path / "c"),
                       shard_target=True))


def test_cuda_training_caps_its_host_threads_unless_omp_num_threads_says():
    from eagle3.training.distributed import CUDA_HOST_THREADS, cuda_host_threads

    assert cuda_host_threads({}, 32) == CUDA_HOST_THREADS == 8
    assert cuda_host_threads({}, CUDA_HOST_THREADS) is None  # already few enough
    assert cuda_host_threads({}, 2) is None
    assert cuda_host_threads({"OMP_NUM_THREADS": "16"}, 32) is None  # the user's choice
    assert cuda_host_threads({"OMP_NUM_THREADS": "1"}, 1) is None  # torchrun's


def test_offline_cache_trains_like_online(data_dir, straight_run, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    out = tmp_path / "offline"
    cfg = base_cfg(data_dir, out, features="offline", feature_cache=str(cache))
    train(cfg)
    assert_same_weights(weights(straight_run), weights(out), atol=1e-6)
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["draft_vocab_size"] == VD and meta["dtype"] == "float32"
    shards = sorted(cache.glob("shard_*.safetensors"))
    assert len(shards) == 1
    one = load_file(str(shards[0]))
    k = next(iter(one)).split(".")[0]
    assert one[f"{k}.logits"].shape[-1] == VD and one[f"{k}.aux"].shape[-1] == 3 * 64  # no full-vocab logits

    # resumable: an existing shard is not rewritten
    stamp = shards[0].stat().st_mtime_ns
    train(base_cfg(data_dir, tmp_path / "offline2", features="offline", feature_cache=str(cache), max_steps=1))
    assert shards[0].stat().st_mtime_ns == stamp

    # a cache made for other inputs is refused
    with pytest.raises(ConfigError, match="different inputs"):
        train(base_cfg(data_dir, tmp_path / "x", features="offline", feature_cache=str(cache), max_length=32))

    # not enough disk: refused before any target forward
    shards[0].unlink()
    real = __import__("shutil").disk_usage

    def tiny(path):
        u = real(path)
        return type(u)(u.total, u.used, 100)

    monkeypatch.setattr("eagle3.training.features.shutil.disk_usage", tiny)
    with pytest.raises(ConfigError, match="needs about"):
        train(base_cfg(data_dir, tmp_path / "y", features="offline", feature_cache=str(cache)))


def test_train_says_how_much_of_its_batches_is_padding(data_dir, tmp_path, capsys):
    train(base_cfg(data_dir, tmp_path / "run", batch_size=None, batch_tokens=256, max_steps=1, save_every=0))
    err = capsys.readouterr().err
    assert re.search(r"eagle3 train: \d+ batches an epoch; \d+\.\d % of their padded tokens are real \(rows "
                     r"length-sorted in windows of --sort-window 16384\)", err), err


def test_packed_training_runs_and_plans_cover_each_sample(data_dir, tmp_path):
    data = TrainData(str(data_dir), max_length=64)
    for packing in (False, True):
        plan = data.plan_epoch(0, seed=1, batch_tokens=128, packing=packing)
        seen = sorted(s for batch in plan for row in batch for s in row)
        assert seen == sorted(data.trainable_ids.tolist())
        for batch in plan:
            b = data.collate(batch, packed=packing)
            assert b.input_ids.numel() <= 128 or len(batch) == 1
            assert all(sum(n for _, _, n in segs) <= 64 for segs in b.segments)
        assert plan == data.plan_epoch(0, seed=1, batch_tokens=128, packing=packing)  # deterministic
        assert plan != data.plan_epoch(1, seed=1, batch_tokens=128, packing=packing)  # reshuffled per epoch
    res = train(base_cfg(data_dir, tmp_path / "packed", packing=True, batch_size=None, batch_tokens=128,
                         max_steps=3, save_every=0, ttt_steps=TrainConfig.ttt_steps))  # the default, 7
    assert res.steps == 3 and np.isfinite(res.final_loss) and len(res.step_accuracy) == 7


def test_wider_sort_windows_pad_less_and_cover_each_sample_once(tmp_path):
    rng = np.random.default_rng(4)
    rows = [(np.r_[1, rng.integers(3, V, size=n - 1)], np.r_[np.zeros(2, np.uint8), np.ones(n - 2, np.uint8)])
            for n in rng.integers(8, 60, size=300)]
    data = TrainData(str(write_prepared(tmp_path / "d", rows)), max_length=64)

    def fill(plan):  # real tokens / padded tokens
        lengths = [[int(data.lengths[r[0]]) for r in batch] for batch in plan]
        return sum(map(sum, lengths)) / sum(len(n) * max(n) for n in lengths)

    fills = []
    for window in (8, 64, 300):
        plan = data.plan_epoch(0, seed=1, batch_tokens=256, sort_window=window)
        assert sorted(s for batch in plan for row in batch for s in row) == sorted(data.trainable_ids.tolist())
        fills.append(fill(plan))
        assert data.real_share(plan) == pytest.approx(fills[-1])
        assert data.real_share(plan, pad_to_multiple=8) <= fills[-1]
    assert fills[0] < fills[1] < fills[2] and fills[2] > 0.95, fills
    with pytest.raises(ConfigError, match="sort_window=0"):
        data.plan_epoch(0, seed=1, batch_tokens=256, sort_window=0)
    with pytest.raises(ConfigError, match="sort_window=0"):
        base_cfg(tmp_path, tmp_path / "out", sort_window=0).validate()


def test_packed_online_features_equal_separate_documents(data_dir):
    data = TrainData(str(data_dir), max_length=64)
    model, _ = load_target("stories260k")
    target = Target(model, [1, 2, 4])
    src = OnlineFeatures(target, torch.ones(V, dtype=torch.bool))
    packed = src(data.collate([[0, 1, 2]], packed=True))
    for s, start, n in data.collate([[0, 1, 2]], packed=True).segments[0]:
        alone = src(data.collate([[s]]))
        torch.testing.assert_close(packed.aux[0, start : start + n], alone.aux[0, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(packed.target_logits[0, start : start + n], alone.target_logits[0, :n],
                                   atol=1e-4, rtol=1e-4)


def test_padded_online_features_equal_each_row_alone(data_dir):
    """Rows of one document each, right-padded to the longest: the feature pass runs plain causal attention (no
    padding mask, so SDPA may take its flash kernel) and every real token gets the features it has alone."""
    data = TrainData(str(data_dir), max_length=64)
    model, _ = load_target("stories260k")
    src = OnlineFeatures(Target(model, [1, 2, 4]), torch.ones(V, dtype=torch.bool))
    rows = sorted(range(len(data)), key=lambda s: int(data.lengths[s]))[:: max(1, len(data) // 4)][:4]
    batch = data.collate([[s] for s in rows])
    assert (batch.doc_ids < 0).any()  # the shorter rows are padded
    feats = src(batch)
    for i, s in enumerate(rows):
        n = int(data.lengths[s])
        alone = src(data.collate([[s]]))
        torch.testing.assert_close(feats.aux[i, :n], alone.aux[0, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats.target_logits[i, :n], alone.target_logits[0, :n], atol=1e-4, rtol=1e-4)


def test_training_lowers_the_loss(data_dir, tmp_path):
    res = train(base_cfg(data_dir, tmp_path / "learn", epochs=8, max_steps=40, lr=3e-3, save_every=0, log_every=5))
    recs = [json.loads(x) for x in (tmp_path / "learn" / LOG_FILE).read_text().splitlines()]
    assert recs[-1]["loss"] < 0.8 * recs[0]["loss"]
    assert res.step_accuracy[0] > recs[0]["acc_per_step"][0]


def test_max_steps_decides_unless_epochs_is_given(data_dir, tmp_path, caplog):
    """--max-steps alone runs that many steps over as many epochs as it needs (HF Trainer's rule; a run must not
    stop after one epoch short of its steps); an explicit --epochs still caps it, with a warning."""
    one_epoch = train(base_cfg(data_dir, tmp_path / "e1", max_steps=None, save_every=0)).steps  # epochs=None: 1
    many = 2 * one_epoch + 1
    assert train(base_cfg(data_dir, tmp_path / "n", max_steps=many, save_every=0)).steps == many
    assert "exceeds" not in caplog.text
    with caplog.at_level(logging.WARNING):
        res = train(base_cfg(data_dir, tmp_path / "c", epochs=1, max_steps=many, save_every=0))
    assert res.steps == one_epoch and f"max_steps={many} exceeds 1 epochs" in caplog.text


def test_tokenizer_mismatch_is_refused(tmp_path):
    fp = {"name_or_path": "other", "vocab_sha256": "0" * 64}
    data = write_prepared(tmp_path / "d", random_rows(4), tokenizer_fp=fp)
    with pytest.raises(ConfigError, match="tokenizer"):
        train(base_cfg(data, tmp_path / "o"))


def test_draft_vocab_larger_than_target_is_refused(tmp_path):
    rows = [(np.concatenate([[1], np.arange(3, 603)]) % 600, np.ones(601, dtype=np.uint8))]
    data = write_prepared(tmp_path / "d", rows, vocab_size=600, draft_vocab_size=550)
    with pytest.raises(ConfigError, match="more than the target's vocabulary"):
        train(base_cfg(data, tmp_path / "o", max_length=1024))


def test_no_trainable_rows_is_refused(tmp_path):
    rows = [(np.arange(1, 20), np.r_[np.ones(2), np.zeros(17)].astype(np.uint8))]  # only x_0, x_1 supervised
    data = write_prepared(tmp_path / "d", rows)
    with pytest.raises(ConfigError, match="no trainable rows"):
        train(base_cfg(data, tmp_path / "o"))


def test_bad_config_values_are_refused(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="feature_cache"):
        train(base_cfg(data_dir, tmp_path / "o", features="offline"))
    with pytest.raises(ConfigError, match="give only one"):
        train(base_cfg(data_dir, tmp_path / "o", batch_tokens=256))
    out = tmp_path / "r"
    train(base_cfg(data_dir, out, stop_after=1))
    with pytest.raises(ConfigError, match="cannot resume"):
        train(base_cfg(data_dir, out, resume=True, seed=4))
    with pytest.raises(ConfigError, match="epochs=1 differ"):  # default epochs=None resolved to 1 epoch here
        train(base_cfg(data_dir, out, resume=True, epochs=3))
    train(base_cfg(data_dir, out, resume=True, epochs=1, stop_after=1))  # the same count, given explicitly
    train(base_cfg(data_dir, out, resume=True, stop_after=1))  # and a checkpoint of --epochs 1 without the flag
    with pytest.raises(ConfigError, match="earlier run"):  # would mix two runs' checkpoints
        train(base_cfg(data_dir, out))


def test_init_from_an_existing_drafter(data_dir, straight_run, tmp_path):
    out = tmp_path / "init"
    train(base_cfg(data_dir, out, init=str(straight_run / "drafter"), max_steps=1, lr=1e-9, save_every=0))
    assert_same_weights(weights(straight_run), weights(out), atol=1e-7)  # started from it, barely moved
    other = write_prepared(tmp_path / "d64", random_rows(), draft_vocab_size=64)
    with pytest.raises(ConfigError, match="draft vocabulary"):
        train(base_cfg(other, tmp_path / "o", init=str(straight_run / "drafter")))


def test_intermediate_size_shapes_a_fresh_drafter_and_is_saved(data_dir, tmp_path):
    from eagle3.cli import main
    from eagle3.formats import load_drafter

    out = tmp_path / "wide"
    assert main(["train", "--target", "stories260k", "--data", str(data_dir), "--out", str(out), "--max-steps", "1",
                 "--batch-size", "4", "--max-length", "64", "--ttt-steps", "2", "--intermediate-size", "96"]) == 0
    for drafter_dir in (out / "drafter", latest_checkpoint(out) / "drafter"):
        d = load_drafter(drafter_dir, device="cpu")
        assert d.config.intermediate_size == 96
        assert tuple(d.layers[0].mlp.up_proj.weight.shape) == (96, 64)
    assert weights(out)["layers.0.mlp.down_proj.weight"].shape == (64, 96)
    cfg = json.loads((out / "train_config.json").read_text())
    assert cfg["config"]["intermediate_size"] == 96
    assert cfg["drafter"]["intermediate_size"] == 96
    # resuming with another MLP width names the shapes instead of failing inside copy_
    with pytest.raises(ConfigError, match="other shapes"):
        train(base_cfg(data_dir, out, resume=True, batch_size=4, ttt_steps=2, max_steps=2, seed=0))


def test_intermediate_size_must_match_init(data_dir, straight_run, tmp_path):
    init = str(straight_run / "drafter")  # the target's MLP width, 172
    with pytest.raises(ConfigError, match="intermediate_size=96 differs from --init's intermediate_size=172"):
        train(base_cfg(data_dir, tmp_path / "o", init=init, intermediate_size=96))
    res = train(base_cfg(data_dir, tmp_path / "same", init=init, intermediate_size=172,
                         max_steps=1, save_every=0))  # the same width is fine
    assert res.steps == 1


def test_resume_accepts_a_checkpoint_from_before_newer_fields(data_dir, tmp_path):
    out = tmp_path / "old"
    train(base_cfg(data_dir, out, stop_after=1))
    state_file = latest_checkpoint(out) / "training_state.pt"
    state = torch.load(state_file, weights_only=True)
    del state["config"]["intermediate_size"]  # an older run's config did not have these
    del state["config"]["val_fraction"]
    del state["config"]["sort_window"]
    del state["config"]["align_top_k"]
    del state["config"]["label_temperature"]
    del state["config"]["step_decay"]
    torch.save(state, state_file)
    # a missing sort_window means the window runs had before it existed, which the default no longer is
    with pytest.raises(ConfigError, match=r"sort_window=1024 differ"):
        train(base_cfg(data_dir, out, resume=True, max_steps=2))
    assert train(base_cfg(data_dir, out, resume=True, max_steps=2, sort_window=1024)).steps == 2
    with pytest.raises(ConfigError, match=r"val_fraction=0\.0"):  # a missing field otherwise means its default
        train(base_cfg(data_dir, out, resume=True, max_steps=3, val_fraction=0.25, sort_window=1024))
    with pytest.raises(ConfigError, match=r"align_top_k=0 differ"):  # the objective may not change on resume
        train(base_cfg(data_dir, out, resume=True, max_steps=3, sort_window=1024, align_top_k=1))
    with pytest.raises(ConfigError, match=r"align_top_k=-1 must be >= 0"):
        base_cfg(data_dir, out, align_top_k=-1).validate()
    with pytest.raises(ConfigError, match=r"label_temperature=1\.0 differ"):  # nor the labels
        train(base_cfg(data_dir, out, resume=True, max_steps=3, sort_window=1024, label_temperature=0.5))
    with pytest.raises(ConfigError, match=r"label_temperature=-1\.0 must be >= 0"):
        base_cfg(data_dir, out, label_temperature=-1.0).validate()
    with pytest.raises(ConfigError, match=r"step_decay=0\.8 differ"):  # nor the steps' weights
        train(base_cfg(data_dir, out, resume=True, max_steps=3, sort_window=1024, step_decay=1.0))
    with pytest.raises(ConfigError, match=r"step_decay=1\.5 must be in \(0, 1\]"):
        base_cfg(data_dir, out, step_decay=1.5).validate()
    res = train(base_cfg(data_dir, tmp_path / "aligned", max_steps=2, align_top_k=1))  # it trains
    aligned = tmp_path / "aligned"
    assert res.steps == 2 and json.loads((aligned / "train_config.json").read_text())["config"]["align_top_k"] == 1
    scored = json.loads((aligned / LOG_FILE).read_text().splitlines()[-1])["scored_per_step"]
    assert scored[-1] < scored[0]  # an untrained drafter rarely guesses right: few rows stay reachable
    hard = tmp_path / "hard"
    assert train(base_cfg(data_dir, hard, max_steps=2, label_temperature=0.0)).steps == 2  # one-hot labels train
    assert json.loads((hard / "train_config.json").read_text())["config"]["label_temperature"] == 0.0


def test_budget_steps_fills_the_time_left_within_the_limits():
    assert budget_steps(23, 100.0, 0.5, upper=1000) == 223
    assert budget_steps(23, 100.0, 0.5, upper=100) == 100  # epochs / max_steps still cap the run
    assert budget_steps(23, 100.2, 0.5, upper=1000) == 223  # to the nearest step: within half a step of the budget
    assert budget_steps(23, -5.0, 0.5, upper=1000) == 23  # over budget already: stop now
    assert budget_steps(0, -5.0, 0.5, upper=1000) == 1  # but one step at least


class FakeClock:
    """Stands in for the trainer's `time` module: optimizer step i (from 1) takes `step_seconds`, or
    `early_seconds` while i <= `early_steps`."""

    def __init__(self, step_seconds: float, early_seconds: float = 0.0, early_steps: int = 0):
        self.now, self.steps = 0.0, 0
        self.step_seconds, self.early_seconds, self.early_steps = step_seconds, early_seconds, early_steps

    def perf_counter(self) -> float:
        return self.now

    def tick(self) -> None:
        self.steps += 1
        self.now += self.early_seconds if self.steps <= self.early_steps else self.step_seconds


def run_with_clock(monkeypatch, clock: FakeClock, cfg: TrainConfig):
    import eagle3.training.trainer as trainer_mod

    real_step = trainer_mod._Trainer._step

    def timed_step(self, rows):
        clock.tick()
        return real_step(self, rows)

    monkeypatch.setattr(trainer_mod, "time", clock)
    monkeypatch.setattr(trainer_mod._Trainer, "_step", timed_step)
    return train(cfg)


def test_time_budget_sizes_the_schedule_and_a_resume_keeps_it(data_dir, tmp_path, monkeypatch, capsys):
    # 24 rows, 4 per step: 6 steps per epoch, 10 epochs allow 60. At 1 s per step a 40 s budget gives 40 steps:
    # after 3 untimed + 20 timed steps, 1 s/step with 23 s spent, and 17 more fit.
    kw = dict(epochs=10, max_steps=None, time_budget=40.0, warmup_steps=None, save_every=10)
    out = tmp_path / "budget"
    res = run_with_clock(monkeypatch, FakeClock(1.0), base_cfg(data_dir, out, **kw))
    assert res.steps == 40 and (out / "drafter").exists()
    assert "1.000 s/step -> 40 steps in all" in capsys.readouterr().err
    recs = [json.loads(x) for x in (out / LOG_FILE).read_text().splitlines()]
    assert recs[-1]["step"] == 40 and recs[-1]["lr"] < 1e-5  # the cosine ran to its end at step 40
    # interrupted and resumed at the same speed: the weights equal the uninterrupted run's (a slower machine:
    # tests/test_time_budget.py)
    out2 = tmp_path / "budget_resumed"
    first = run_with_clock(monkeypatch, FakeClock(1.0), base_cfg(data_dir, out2, stop_after=30, **kw))
    assert first.steps == 30
    second = run_with_clock(monkeypatch, FakeClock(1.0), base_cfg(data_dir, out2, resume=True, **kw))
    assert second.steps == 40
    assert_same_weights(weights(out), weights(out2), atol=0.0)


def test_time_budget_flag_parses_durations():
    from eagle3.cli import build_parser

    p = build_parser()
    args = p.parse_args(["train", "--target", "t", "--data", "d", "--out", "o", "--time-budget", "20m"])
    assert args.time_budget == 1200.0
    with pytest.raises(SystemExit):
        p.parse_args(["train", "--target", "t", "--data", "d", "--out", "o", "--time-budget", "soon"])
    with pytest.raises(ConfigError, match="time_budget"):
        TrainConfig(target="t", data="d", out="o", time_budget=0).validate()


def test_time_budget_under_torchrun_sizes_every_rank_alike(data_dir, tmp_path):
    """With a real clock each rank measures its own speed; the sizing uses the mean over ranks, so both stop at
    the same step (were they to differ, the rank still training would wait in DDP's all-reduce forever)."""
    out = tmp_path / "ddp_budget"
    cfg = base_cfg(data_dir, out, epochs=10, max_steps=None, time_budget=0.5, warmup_steps=None, save_every=0)
    worker = ("import json, sys\nfrom eagle3.training.trainer import TrainConfig, train\n"
              "train(TrainConfig(**json.loads(sys.argv[1])))\n")
    torchrun2(tmp_path, worker, json.dumps(cfg.to_dict()))
    steps = [json.loads(x)["step"] for x in (out / LOG_FILE).read_text().splitlines()]
    assert (out / "drafter").exists() and 1 <= steps[-1] < 60
    printed = (tmp_path / f"worker_{abs(hash(worker))}.log").read_text()
    assert printed.count("eagle3 train: time budget 0.5 s: stopped after") == 1  # rank 0 says it, once
    assert f"stopped after {steps[-1]} steps" in printed


def test_compiled_training_matches_eager(data_dir, straight_run, tmp_path, caplog, capsys):
    """compile=True (the CUDA default) inductor-compiles the target's layers and the drafter's norms and MLP; on
    CPU in fp32 it must train to the eager run's weights up to rounding, and really run compiled."""
    from torch._dynamo.utils import counters

    counters.clear()
    out = tmp_path / "compiled"
    with caplog.at_level("WARNING", logger="eagle3"):
        train(base_cfg(data_dir, out, compile=True))
    assert not [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert "compiling 5 target layers and 5 drafter pieces" in capsys.readouterr().err
    assert counters["stats"]["unique_graphs"] >= 2  # at least a target layer and a drafter piece
    assert_same_weights(weights(straight_run), weights(out), atol=1e-4)
    assert json.loads((out / "train_config.json").read_text())["compiled"] is True


def test_compile_failure_falls_back_to_eager(caplog):
    from eagle3.training.compiled import compile_forward

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    want = layer(x)
    compile_forward(layer, "test layer", backend=broken)
    with caplog.at_level("WARNING", logger="eagle3"):
        got = layer(x)
        again = layer(x)  # eager from now on: no second attempt, no second warning
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    warnings = [r.getMessage() for r in caplog.records if "torch.compile of test layer failed" in r.getMessage()]
    assert len(warnings) == 1 and "running it eagerly" in warnings[0]


def test_aux_layers_choose_the_taps_of_a_fresh_drafter(data_dir, straight_run, tmp_path, capsys):
    """--aux-layers sets the three target layers a fresh drafter reads (saved in its config, used by the target's
    taps); malformed, repeated or out-of-range ids and a mismatch with --init stop at once with a clear error."""
    from eagle3.cli import main
    from eagle3.formats import load_drafter

    common = ["train", "--target", "stories260k", "--data", str(data_dir), "--max-steps", "1", "--batch-size", "4",
              "--max-length", "64", "--ttt-steps", "2"]
    out = tmp_path / "taps"
    assert main([*common, "--out", str(out), "--aux-layers", "1,3,5"]) == 0  # 5 = the last layer's output
    assert load_drafter(out / "drafter", device="cpu").config.aux_layer_ids == [1, 3, 5]
    for bad in ("1,3", "1,x,5", "-1,2,3"):
        with pytest.raises(SystemExit):
            main([*common, "--out", str(tmp_path / "bad"), f"--aux-layers={bad}"])
        assert "three non-negative layer numbers" in capsys.readouterr().err
    for taps, why in (("3,3,4", "distinct and ascending"), ("1,2,6", "out of range"), ("1,3,5", "differ from --init")):
        extra = ["--init", str(straight_run / "drafter")] if why.startswith("differ") else []
        assert main([*common, "--out", str(tmp_path / why[:3]), *extra, "--aux-layers", taps]) == 2
        assert why in capsys.readouterr().err
        assert not (tmp_path / why[:3] / "drafter").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_training_step_never_waits_for_the_device(data_dir, tmp_path, monkeypatch):
    """After the first steps (compilation), a training step queues its work without a host synchronisation of its
    own: batches come from pinned memory, the scored rows are planned on the host, the grad norm stays on the
    device. torch's sync debug mode turns any synchronising call inside the step into an error, except in one
    place that is not ours: transformers' mask preparation reads the position ids to detect packed sequences
    (`masking_utils.find_packed_sequence_indices`, once per target forward, when the host has already collated
    and queued the batch)."""
    from transformers import masking_utils

    from eagle3.training import trainer as trainer_mod

    step = trainer_mod._Trainer._step
    find_packed = masking_utils.find_packed_sequence_indices
    calls = []

    def allowed(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return find_packed(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", allowed)

    def checked(self, rows):
        calls.append(len(calls))
        if len(calls) <= 2:
            return step(self, rows)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(self, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(trainer_mod._Trainer, "_step", checked)
    res = train(base_cfg(data_dir, tmp_path / "cuda", device="cuda", dtype="bfloat16", max_steps=5, log_every=5,
                         save_every=0))
    assert res.steps == 5 and len(calls) == 5
