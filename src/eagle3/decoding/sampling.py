"""Turn target logits into the distribution we sample from, and sample from it.

`process_logits` applies temperature, then top-k, then top-p (nucleus) filtering, in the order and with
the tie and "keep at least one token" rules of Hugging Face's `TemperatureLogitsWarper`,
`TopKLogitsWarper` and `TopPLogitsWarper` (transformers `src/transformers/generation/logits_process.py`;
order from `GenerationMixin._get_logits_processor`). Speculative verification applies it to the *target*
logits only (drafts are deterministic), so a speculative run samples from exactly the distribution that
plain `model.generate(do_sample=True, ...)` would.
"""

from __future__ import annotations

import torch

__all__ = ["filter_scores", "filter_scores_rows", "process_logits", "sample"]


def filter_scores(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Scores (fp32 logits / temperature, same shape as `logits`) with -inf on the tokens top-k and top-p
    remove: `process_logits` before its softmax (see there for the rules)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: process_logits needs temperature > 0 (0 means greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 disables it)")
    scores = logits.float() / temperature  # [..., V]
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)  # [..., V] ascending
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
        remove_sorted = cum <= (1.0 - top_p)  # [..., V]
        remove_sorted[..., -1] = False  # the most likely token always stays
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)  # [..., V] back in vocab order
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Probabilities (fp32, same shape as `logits`, summing to 1 over the last dim) after filtering.

    `temperature` must be > 0 (temperature 0 is greedy and never reaches here). `top_k=0` and `top_p=1`
    disable the filters. Top-k keeps every token tied with the k-th largest logit (as HF does); top-p
    removes the lowest-probability tokens whose cumulative mass is <= 1 - top_p and always keeps the most
    likely token, so at least one token survives.
    """
    return filter_scores(logits, temperature, top_p, top_k).softmax(dim=-1)


def filter_scores_rows(
    logits: torch.Tensor,  # [R, M, V]: M positions of each of R requests
    temperature: torch.Tensor,  # [R] fp32, > 0 (rows at 0 get arbitrary scores: callers take the argmax)
    top_p: torch.Tensor,  # [R] fp32 in (0, 1]
    top_k: torch.Tensor,  # [R] long, 0 = off
    filters: bool = True,
) -> torch.Tensor:
    """`filter_scores` with each row's own settings, as fixed-shape tensor ops (no host sync, CUDA-graph safe):
    scores [R, M, V] equal to `filter_scores(logits[r], temperature[r], top_p[r], top_k[r])` row by row
    (tests/test_sampling_stats.py). A filter a row turns off leaves its scores untouched, as there.
    `filters=False` skips both filters (and their two sorts over the vocabulary): only for rows that all have
    top_p 1 and top_k 0."""
    r, m, vocab = logits.shape
    scores = logits.float() / temperature.clamp(min=1e-6)[:, None, None]  # [R, M, V]
    if not filters:
        return scores
    desc = torch.sort(scores, dim=-1, descending=True).values  # [R, M, V]
    kth = desc.gather(-1, (top_k - 1).clamp(0, vocab - 1)[:, None, None].expand(r, m, 1))  # [R, M, 1] k-th largest
    use_k = ((top_k > 0) & (top_k < vocab))[:, None, None]  # [R, 1, 1]
    scores = scores.masked_fill(use_k & (scores < kth), float("-inf"))
    sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)  # [R, M, V] ascending
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [R, M, V]
    remove_sorted = cum <= (1.0 - top_p)[:, None, None]  # [R, M, V]
    remove_sorted[..., -1] = False  # the most likely token always stays
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)  # [R, M, V] back in vocab order
    return scores.masked_fill((top_p < 1.0)[:, None, None] & remove, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `probs` [..., V] (long, shape [...]), drawn with `generator`."""
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    ids = torch.multinomial(flat, 1, generator=generator)  # [R, 1]
    return ids.reshape(probs.shape[:-1])
