"""Argument types of the command line (argparse `type=` functions), shared by its subcommands."""

from __future__ import annotations

import argparse


def duration_seconds(text: str) -> float:
    """'90', '90s', '20m' or '1.5h' -> seconds (argparse type for --time-budget)."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    scale = units.get(t[-1:])
    try:
        value = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: write seconds (1200), or 90s, 20m, 1.5h") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be positive")
    return value


def draft_vocab_size(text: str) -> int:
    """'32000' -> 32000, 'full' or '0' -> 0 (the full vocabulary; argparse type for init-drafter)."""
    t = text.strip().lower()
    if t == "full":
        return 0
    if not t.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of tokens (e.g. 32000), or full")
    return int(t)


def layer_ids(text: str) -> list[int]:
    """'2,15,29' -> [2, 15, 29] (argparse type for --aux-layers; range and order are checked against the target)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give three non-negative layer numbers, low,mid,high (e.g. 2,15,27 for a 30-layer target)")
    return [int(p) for p in parts]
