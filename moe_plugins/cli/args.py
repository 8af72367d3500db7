"""Argument types and the layout flags the ``moe-plugins`` subcommands share."""
from __future__ import annotations

import argparse
import math
from typing import Callable

import torch

from moe_plugins.callbound.settings import parse_seconds

__all__ = ["DTYPES", "int_at_least", "finite_float", "positive_float", "nonnegative_float",
           "call_bound_seconds", "token_counts", "add_layout_args", "layout_from_args"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def int_at_least(low: int) -> "Callable[[str], int]":
    """An argparse type: an int >= ``low`` (the error names the value and the bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (inf, nan, 0 and negatives are refused)."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def call_bound_seconds(text: str) -> float:
    """An argparse type for ``--call-timeout-s``: the call bound's own parser
    (:func:`moe_plugins.callbound.parse_seconds`, as for ``$MOE_PLUGINS_CALL_TIMEOUT_S``);
    0.0 when it is off."""
    try:
        bound = parse_seconds(text, "--call-timeout-s")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return 0.0 if bound is None else bound


def token_counts(text: str) -> list[int]:
    """An argparse type: comma-separated token counts >= 0 (one per DP group)."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer token counts, one per DP group, got {text!r}"
        ) from None
    negative = [c for c in counts if c < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"token counts must be >= 0, got {negative[0]} in "
                                         f"{text!r}")
    return counts


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """Layout and shape flags shared by ``demo`` and ``plan``."""
    pos, nonneg = int_at_least(1), int_at_least(0)
    p.add_argument("--ranks", type=pos, default=4, help="EP group size = dp x tp (default 4)")
    p.add_argument("--tp", type=pos, default=1, help="attention TP size inside the EP group")
    p.add_argument("--ep", action="store_true", help="expert parallel (required when dp > 1)")
    p.add_argument("--tokens", type=nonneg, default=8, help="tokens per DP group")
    p.add_argument("--hidden", type=pos, default=256)
    p.add_argument("--experts", type=pos, default=8)
    p.add_argument("--topk", type=pos, default=2)
    p.add_argument("--intermediate", type=pos, default=64, help="routed expert intermediate size")
    p.add_argument("--shared-intermediate", type=nonneg, default=128, help="0: no shared expert")
    p.add_argument("--backend", default="torch",
                   help="a registered backend (moe-plugins list); plan also takes auto: the "
                   "fastest under its time model")
    p.add_argument("--quant", default="none", choices=["none", "fp8_block128", "nvfp4"])
    p.add_argument("--defer-input-quant", action="store_true")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))


def layout_from_args(args: argparse.Namespace):
    from moe_plugins.layout import ParallelLayout

    if args.ranks % args.tp:
        raise ValueError(f"--ranks {args.ranks} is not a multiple of --tp {args.tp}; "
                         "the EP group is dp x tp ranks")
    return ParallelLayout(dp=args.ranks // args.tp, tp=args.tp, ep=args.ep)
