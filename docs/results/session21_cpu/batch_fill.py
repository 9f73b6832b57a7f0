"""Session 21 (CPU): how much of a length-sorted training batch is padding, by batch size and sort window.

One epoch's plan (`TrainData.plan_epoch`, seed 0, epoch 0) over a prepared folder, padded as on CUDA (to a multiple
of 8): real tokens / padded tokens, and the real tokens per batch.
    PYTHONPATH=src python docs/results/session21_cpu/batch_fill.py DATA_DIR [MAX_LENGTH]
"""
import sys

import numpy as np

import eagle3.training.dataset as ds

data = ds.TrainData(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2048)
lengths = data.lengths
print(f"{len(data.trainable_ids)} trainable samples, {int(lengths[data.trainable_ids].sum())} tokens, "
      f"median length {int(np.median(lengths[data.trainable_ids]))}")
for window in (1024, 4096, 16384, 10**9):
    ds.SORT_WINDOW_ROWS = window
    for bt in (32768, 65536):
        plan = data.plan_epoch(0, 0, batch_tokens=bt)
        real = padded = 0
        for batch in plan:
            n = [int(lengths[r[0]]) for r in batch]
            real += sum(n)
            padded += len(n) * (-(-max(n) // 8) * 8)
        print(f"window {window if window < 10**9 else 'all':>6} rows, batch_tokens {bt}: {len(plan)} batches, "
              f"fill {real / padded:.3f}, real tokens per batch {real / len(plan):,.0f}")
