"""Check a drafter config and its draft-vocabulary map (`d2t` / `t2d`) on their own and against a target's config.

`d2t` holds int64 offsets (`target = draft + d2t[draft]`) for the draft vocabulary's ascending target ids; `t2d`
is a bool mask over the target vocabulary marking the same ids. Errors are `ConfigError`s naming the field and
both values; a RoPE or dtype difference from the target only warns.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from eagle3.config import ConfigError, DrafterConfig, _rope_theta
from eagle3.formats.configs import _dtype_name, _text_config

log = logging.getLogger("eagle3.formats")


def check_vocab_mapping(cfg: DrafterConfig, d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> None:
    """Raise ConfigError unless d2t/t2d describe `cfg`'s draft vocabulary (§A.4: offsets, ascending ids)."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if not cfg.uses_draft_vocab:
        if d2t is not None and bool(d2t.ne(0).any()):
            raise ConfigError(
                f"d2t has non-zero offsets but draft_vocab_size == vocab_size == {v} (no reduction)"
            )
        return
    if d2t is None:
        raise ConfigError(
            f"draft_vocab_size={vd} < vocab_size={v} but d2t is missing: the draft-to-target id map is needed "
            "to turn draft tokens into target tokens"
        )
    if tuple(d2t.shape) != (vd,):
        raise ConfigError(f"d2t has shape {tuple(d2t.shape)}, expected ({vd},) = (draft_vocab_size,)")
    ids = torch.arange(vd, device=d2t.device) + d2t.long()  # [Vd] target ids
    if int(ids.min()) < 0 or int(ids.max()) >= v:
        raise ConfigError(
            f"d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], outside [0, {v})"
        )
    if vd > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ConfigError(
            "d2t target ids are not strictly increasing; the draft vocabulary must be sorted by id"
        )
    if t2d is None:
        return
    if tuple(t2d.shape) != (v,):
        raise ConfigError(f"t2d has shape {tuple(t2d.shape)}, expected ({v},) = (vocab_size,)")
    t2d = t2d.bool()
    if int(t2d.sum()) != vd:
        raise ConfigError(f"t2d marks {int(t2d.sum())} target ids, draft_vocab_size is {vd}")
    if not bool(t2d[ids.to(t2d.device)].all()):
        raise ConfigError("t2d and d2t disagree: some target ids reached through d2t are not marked in t2d")


def validate_against_target(
    cfg: DrafterConfig, target_config: Any, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None
) -> None:
    """Raise ConfigError (naming the field and both values) if `cfg` cannot run on `target_config`.

    Checks hidden size, vocabulary, layer count and aux layer ids, and the draft vocabulary map. A RoPE or dtype
    difference only warns: official drafters use θ=10000 whatever the target (reference pitfall 8).
    """
    tc = _text_config(target_config)
    t_hidden = int(tc.hidden_size)
    if t_hidden != cfg.resolved_target_hidden_size:
        raise ConfigError(
            f"hidden size mismatch: target hidden_size={t_hidden}, drafter target_hidden_size="
            f"{cfg.resolved_target_hidden_size}; this drafter was made for another model"
        )
    if int(tc.vocab_size) != cfg.vocab_size:
        raise ConfigError(
            f"vocabulary mismatch: target vocab_size={tc.vocab_size}, drafter vocab_size={cfg.vocab_size}"
        )
    num_layers = int(tc.num_hidden_layers)
    bad = [k for k in cfg.aux_layer_ids if not 0 <= k <= num_layers]
    if bad:
        raise ConfigError(
            f"aux_layer_ids={cfg.aux_layer_ids}: ids {bad} are out of range for a target with num_hidden_layers="
            f"{num_layers} (valid 0..{num_layers})"
        )
    if cfg.target_num_layers != num_layers:
        raise ConfigError(
            f"layer count mismatch: target num_hidden_layers={num_layers}, drafter target_num_layers="
            f"{cfg.target_num_layers}; this drafter was made for another model"
        )
    check_vocab_mapping(cfg, d2t, t2d)
    t_theta = _rope_theta(tc)
    if abs(t_theta - cfg.rope_theta) > 1e-6 * max(1.0, t_theta):
        log.warning(
            "drafter rope_theta=%s differs from target rope_theta=%s; fine if the drafter was trained that way "
            "(official EAGLE-3 drafters use 10000 on purpose)",
            cfg.rope_theta,
            t_theta,
        )
    t_dtype = _dtype_name(getattr(tc, "dtype", None) or getattr(tc, "torch_dtype", None))
    if t_dtype and cfg.torch_dtype and t_dtype != cfg.torch_dtype:
        # nothing to act on: the loaders cast the drafter to the dtype it runs in (the target's)
        log.debug("drafter torch_dtype=%s (as saved) differs from the target's %s; it is cast", cfg.torch_dtype,
                  t_dtype)
