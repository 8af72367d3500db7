"""``moe-plugins`` command line: list backends, run the CPU demo (the CLI only formats)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from typing import Sequence

import torch

__all__ = ["main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _cmd_list(args: argparse.Namespace) -> int:
    from moe_plugins.registry import registered_backends

    rows = []
    for name, spec in sorted(registered_backends().items()):
        reason = spec.unavailable_reason()
        ep_dp, dp, tp, sp = spec.ep_dp_tp_support
        rows.append(dict(name=name, usable=reason is None, reason=reason, ep_dp=ep_dp, dp=dp,
                         tp=tp, sp=sp, quants=sorted(q.value for q in spec.quants),
                         distribution=spec.distribution))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    yn = {True: "yes", False: "no"}
    print(f"{'backend':<28} {'usable':<6} {'ep_dp':<5} {'dp':<3} {'tp':<3} {'sp':<3} "
          f"{'quants':<32} reason")
    for r in rows:
        print(f"{r['name']:<28} {yn[r['usable']]:<6} {yn[r['ep_dp']]:<5} {yn[r['dp']]:<3} "
              f"{yn[r['tp']]:<3} {yn[r['sp']]:<3} {','.join(r['quants']):<32} {r['reason'] or ''}")
    return 0


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """Layout and shape flags shared by ``demo`` and ``plan``."""
    p.add_argument("--ranks", type=int, default=4, help="EP group size = dp x tp (default 4)")
    p.add_argument("--tp", type=int, default=1, help="attention TP size inside the EP group")
    p.add_argument("--ep", action="store_true", help="expert parallel (required when dp > 1)")
    p.add_argument("--tokens", type=int, default=8, help="tokens per DP group")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=64, help="routed expert intermediate size")
    p.add_argument("--shared-intermediate", type=int, default=128, help="0: no shared expert")
    p.add_argument("--backend", default="torch")
    p.add_argument("--quant", default="none", choices=["none", "fp8_block128", "nvfp4"])
    p.add_argument("--defer-input-quant", action="store_true")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))


def layout_from_args(args: argparse.Namespace):
    from moe_plugins.layout import ParallelLayout

    if args.ranks % args.tp:
        raise ValueError(f"--ranks {args.ranks} is not a multiple of --tp {args.tp}; "
                         "the EP group is dp x tp ranks")
    return ParallelLayout(dp=args.ranks // args.tp, tp=args.tp, ep=args.ep)


def _cmd_demo(args: argparse.Namespace) -> int:
    from moe_plugins.demo import run_demo
    from moe_plugins.launch import RankPool
    from moe_plugins.model import MoEConfig
    from moe_plugins.quant import QuantScheme, QuantSpec

    layout = layout_from_args(args)
    cfg = MoEConfig(hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                    intermediate=args.intermediate, shared_intermediate=args.shared_intermediate,
                    dtype=_DTYPES[args.dtype])
    quant = QuantSpec(QuantScheme(args.quant), args.defer_input_quant)
    quant.check_hidden(cfg.hidden)
    with RankPool(layout.world_size) as pool:
        rows = run_demo(pool, layout, cfg, args.backend, args.tokens, quant, iters=args.iters)
    if args.json:
        for r in rows:
            print(json.dumps({k: v for k, v in asdict(r).items() if k not in ("ok",)}))
    else:
        print(f"layout {layout.describe()} backend={args.backend} tokens/DP group={args.tokens} "
              f"hidden={cfg.hidden} experts={cfg.num_experts} topk={cfg.num_topk} "
              f"dtype={args.dtype} quant={args.quant}{' (deferred)' if args.defer_input_quant else ''}")
        print(f"{'strategy':<24} {'max_abs_err':>11} {'ok':>3} {'TP coll':>7} {'TP bytes':>9} "
              f"{'pairs/rank':<16} {'dispatch bytes/rank':<28} {'ms/layer':>8}")
        for r in rows:
            name = r.strategy + ("*" if r.default else "")
            print(f"{name:<24} {r.max_abs_err:>11.2e} {'yes' if r.ok else 'NO':>3} "
                  f"{r.tp_collectives:>7} {r.tp_collective_bytes:>9} "
                  f"{str(r.dispatched_pairs):<16} {str(r.dispatched_bytes):<28} {r.ms_per_layer:>8.2f}")
        print("* = the strategy this layout uses by default; shared-expert overlap is off on "
              "CPU ranks (no CUDA side stream): the shared expert runs inline")
    return 0 if all(r.ok for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-plugins", description=__doc__)
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="cmd", required=True)
    lst = sub.add_parser("list", help="registered backends, capabilities, usable here or why not")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(fn=_cmd_list)
    demo = sub.add_parser("demo", help="run a MoE layer on CPU ranks under every strategy")
    add_layout_args(demo)
    demo.add_argument("--iters", type=int, default=3, help="timed calls per strategy")
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(fn=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (ValueError, TypeError, ImportError) as e:
        print(f"moe-plugins: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
