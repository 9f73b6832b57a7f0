"""Training batches from a prepared folder (`eagle3 prepare`): a deterministic plan per epoch, then padding.

A *plan* is a list of global batches; a batch is a list of rows; a row is a list of sample ids (one sample
when padding, several when packing). The plan depends only on (seed, epoch, batch settings), never on the
number of processes: data-parallel ranks take rows `rank::world` of each global batch, and a resumed run
regenerates the same plan and skips to its saved position.

* length-sorted (default): shuffle, sort by length inside windows of `sort_window` rows (`SORT_WINDOW_ROWS`),
  cut into batches of `batch_rows` rows or of at most `batch_tokens` padded tokens, shuffle the batch order;
* packed: shuffle, then fill rows of `max_length` tokens with whole samples (next fit); documents in one
  row never see each other (`doc_ids` feeds the block-diagonal masks) and positions restart per document.

Samples longer than `max_length` are cut to their first `max_length` tokens (causal, so the features of a
prefix are those of the full sample); samples without a supervised position are left out of every plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eagle3.config import ConfigError
from eagle3.training.prepare import MASK_FILE, TOKENS_FILE, PreparedDataset

# Rows sorted by length together before batches are cut. Wider windows pad less: 16,384 rows fill batches with
# real tokens almost as well as sorting all rows at once. Batches stay random: rows enter windows in shuffled
# order and the batch order is shuffled. Checkpoints that do not record a window used 1,024
# (`LEGACY_SORT_WINDOW_ROWS`).
SORT_WINDOW_ROWS = 16384
LEGACY_SORT_WINDOW_ROWS = 1024
HOLD_OUT_STREAM = 0x5EED0FF  # the held-out set's random stream [seed, this]; epoch plans use [seed, epoch]
MIN_SUPERVISED_INDEX = 2  # loss_mask[i] is used from i = 2 on: row t = i - 2 at step 0 predicts x_i


@dataclass
class Batch:
    """One (micro-)batch, right-padded to T.

    input_ids [B, T] long, loss_mask [B, T] float, doc_ids [B, T] long (-1 on padding),
    position_ids [B, T] long (restart at 0 per document); segments[b] = [(sample, start, length), ...].
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: list[list[tuple[int, int, int]]]
    packed: bool

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens (from the segments: no device read)."""
        return sum(n for segs in self.segments for _, _, n in segs)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The tensors on `device`; `non_blocking` copies from pinned memory (`pin_memory`) without waiting."""
        return Batch(*(x.to(device, non_blocking=non_blocking) for x in
                       (self.input_ids, self.loss_mask, self.doc_ids, self.position_ids)), self.segments, self.packed)

    def pin_memory(self) -> Batch:
        """A copy in page-locked host memory: a copy from pageable memory makes the host wait for the device."""
        return Batch(*(x.pin_memory() for x in (self.input_ids, self.loss_mask, self.doc_ids, self.position_ids)),
                     self.segments, self.packed)


class TrainData:
    """The samples of a prepared folder, cut to `max_length`, with planning and collation."""

    def __init__(self, dataset: PreparedDataset | str, max_length: int):
        if max_length < MIN_SUPERVISED_INDEX + 1:
            raise ConfigError(f"max_length={max_length} must be at least {MIN_SUPERVISED_INDEX + 1} tokens")
        self.dataset = dataset if isinstance(dataset, PreparedDataset) else PreparedDataset(dataset)
        self.max_length = max_length
        self.offsets = self.dataset.offsets  # [N+1]
        self.lengths = np.minimum(np.diff(self.offsets), max_length)  # [N]
        # the documented flat files, memory-mapped (PreparedDataset checked their sizes)
        n_tokens = int(self.offsets[-1])
        if n_tokens == 0:
            raise ConfigError(f"{self.dataset.dir} holds no tokens; nothing to train on (see its report.json)")
        self.tokens = np.memmap(self.dataset.dir / TOKENS_FILE, dtype="<i4", mode="r", shape=(n_tokens,))
        self.loss_mask = np.memmap(self.dataset.dir / MASK_FILE, dtype=np.uint8, mode="r", shape=(n_tokens,))
        mask = self.loss_mask
        self.trainable = np.array(
            [bool(mask[a + MIN_SUPERVISED_INDEX : a + n].any()) for a, n in zip(self.offsets[:-1], self.lengths, strict=True)],
            dtype=bool,
        )  # [N]
        self.trainable_ids = np.flatnonzero(self.trainable)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64 [L], loss mask uint8 [L]) of sample i, cut to max_length."""
        a, n = int(self.offsets[i]), int(self.lengths[i])
        return self.tokens[a : a + n].astype(np.int64), np.asarray(self.loss_mask[a : a + n])

    @property
    def trainable_tokens(self) -> int:
        return int(self.lengths[self.trainable_ids].sum())

    def hold_out(self, fraction: float, seed: int) -> np.ndarray:
        """Take round(fraction · N) of the N trainable samples (at least one) out of training, chosen by `seed`
        alone, and return their ids (sorted): the held-out set for validation. Training plans skip them from then
        on; an offline feature cache still covers them (it follows `trainable`)."""
        n = len(self.trainable_ids)
        k = max(1, round(fraction * n))
        if n - k < 1:
            raise ConfigError(f"val_fraction={fraction} holds out {k} of {n} trainable samples and leaves none to "
                              "train on; lower --val-fraction or prepare more data")
        held = np.sort(np.random.default_rng([seed, HOLD_OUT_STREAM]).choice(self.trainable_ids, k, replace=False))
        self.trainable_ids = np.setdiff1d(self.trainable_ids, held)
        return held

    # -- planning -----------------------------------------------------------------------------------
    def plan_epoch(
        self,
        epoch: int,
        seed: int,
        batch_rows: int | None = None,
        batch_tokens: int | None = None,
        packing: bool = False,
        ids: np.ndarray | None = None,
        sort_window: int = SORT_WINDOW_ROWS,
    ) -> list[list[list[int]]]:
        """Global batches for `epoch` (see the module docstring) over the trainable samples, or over `ids` (the
        held-out set); deterministic in (seed, epoch, settings)."""
        if (batch_rows is None) == (batch_tokens is None):
            raise ConfigError("give exactly one of batch_size (rows) and batch_tokens")
        if batch_rows is not None and batch_rows < 1:
            raise ConfigError(f"batch_size={batch_rows} must be >= 1")
        if sort_window < 1:
            raise ConfigError(f"sort_window={sort_window} must be >= 1 rows")
        if batch_tokens is not None and batch_tokens < self.max_length:
            raise ConfigError(
                f"batch_tokens={batch_tokens} is smaller than max_length={self.max_length}; a batch must hold at "
                "least one full-length row"
            )
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(self.trainable_ids if ids is None else ids)
        if packing:
            rows = self._pack(order)
            per_batch = batch_rows or max(1, batch_tokens // self.max_length)
            return [rows[i : i + per_batch] for i in range(0, len(rows), per_batch)]
        # sort by length (longest first) inside windows, so padding stays small but order stays random
        windows = [order[i : i + sort_window] for i in range(0, len(order), sort_window)]
        order = np.concatenate([w[np.argsort(-self.lengths[w], kind="stable")] for w in windows]) if windows else order
        batches: list[list[list[int]]] = []
        if batch_rows is not None:
            batches = [[[int(s)] for s in order[i : i + batch_rows]] for i in range(0, len(order), batch_rows)]
        else:
            cur: list[list[int]] = []
            longest = 0
            for s in order:
                n = int(self.lengths[s])
                if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
                    batches.append(cur)
                    cur, longest = [], 0
                cur.append([int(s)])
                longest = max(longest, n)
            if cur:
                batches.append(cur)
        perm = rng.permutation(len(batches))
        return [batches[i] for i in perm]

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        rows: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for s in order:
            n = int(self.lengths[s])
            if cur and used + n > self.max_length:
                rows.append(cur)
                cur, used = [], 0
            cur.append(int(s))
            used += n
        if cur:
            rows.append(cur)
        return rows

    def row_lengths(self, rows: list[list[int]]) -> list[int]:
        """Tokens in each row (its samples' lengths summed)."""
        return [int(sum(self.lengths[s] for s in r)) for r in rows]

    @staticmethod
    def padded_length(row_lengths: list[int], pad_to_multiple: int = 1) -> int:
        """The length `collate` pads rows of these lengths to."""
        return -(-max(row_lengths) // pad_to_multiple) * pad_to_multiple

    def real_share(self, plan: list[list[list[int]]], pad_to_multiple: int = 1) -> float:
        """Real tokens / padded tokens of `plan`'s batches, padded as `collate` pads them."""
        real = padded = 0
        for batch in plan:
            lens = self.row_lengths(batch)
            real += sum(lens)
            padded += len(lens) * self.padded_length(lens, pad_to_multiple)
        return real / max(padded, 1)

    # -- collation ----------------------------------------------------------------------------------
    def collate(self, rows: list[list[int]], pad_to_multiple: int = 1, packed: bool = False) -> Batch:
        """Right-padded tensors for `rows` (lists of sample ids)."""
        if not rows:
            raise ValueError("collate needs at least one row")
        t = self.padded_length(self.row_lengths(rows), pad_to_multiple)
        b = len(rows)
        ids = np.zeros((b, t), dtype=np.int64)
        lm = np.zeros((b, t), dtype=np.float32)
        doc = np.full((b, t), -1, dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        segments: list[list[tuple[int, int, int]]] = []
        for i, r in enumerate(rows):
            start, segs = 0, []
            for j, s in enumerate(r):
                x, m = self.sample(s)
                n = len(x)
                ids[i, start : start + n] = x
                lm[i, start : start + n] = m
                doc[i, start : start + n] = j
                pos[i, start : start + n] = np.arange(n)
                segs.append((s, start, n))
                start += n
            segments.append(segs)
        return Batch(torch.from_numpy(ids), torch.from_numpy(lm), torch.from_numpy(doc), torch.from_numpy(pos),
                     segments, packed)

    def step_denominators(self, rows: list[list[int]], steps: int) -> torch.Tensor:
        """N_k over `rows` (see `ttt.step_denominators`) straight from the loss masks, float64 [K]."""
        out = np.zeros(steps, dtype=np.float64)
        for r in rows:
            for s in r:
                _, m = self.sample(s)
                tail = np.cumsum(m[::-1], dtype=np.int64)[::-1]  # tail[i] = sum(m[i:])
                for k in range(steps):
                    i = MIN_SUPERVISED_INDEX + k
                    out[k] += tail[i] if i < len(m) else 0
        return torch.from_numpy(out)


def shard_rows(rows: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This rank's rows of a global batch: rows rank, rank + world, ... (may be empty)."""
    return rows[rank::world]
