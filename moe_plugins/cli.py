"""``moe-plugins`` command line: list backends, run the CPU demo, plan a layout (the CLI only
formats)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
import sys
from dataclasses import asdict
import signal
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

import torch

if TYPE_CHECKING:
    from moe_plugins.planner.plan import Estimate, LayerPlan

__all__ = ["main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _cmd_list(args: argparse.Namespace) -> int:
    from moe_plugins.registry import registered_backends

    rows = []
    for name, spec in sorted(registered_backends().items()):
        reason = spec.unavailable_reason()
        ep_dp, dp, tp, sp = spec.ep_dp_tp_support
        rows.append(dict(name=name, usable=reason is None, reason=reason, ep_dp=ep_dp, dp=dp,
                         tp=tp, sp=sp, placements=spec.capabilities.placements,
                         quants=sorted(q.value for q in spec.quants),
                         distribution=spec.distribution))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    yn = {True: "yes", False: "no"}
    print(f"{'backend':<28} {'usable':<6} {'ep_dp':<5} {'dp':<3} {'tp':<3} {'sp':<3} "
          f"{'placements':<10} {'quants':<32} reason")
    for r in rows:
        print(f"{r['name']:<28} {yn[r['usable']]:<6} {yn[r['ep_dp']]:<5} {yn[r['dp']]:<3} "
              f"{yn[r['tp']]:<3} {yn[r['sp']]:<3} {'any' if r['placements'] else 'linear':<10} "
              f"{','.join(r['quants']):<32} {r['reason'] or ''}")
    return 0


def _int_at_least(low: int) -> "Callable[[str], int]":
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


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (inf, nan, 0 and negatives are refused)."""
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def _nonnegative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def _token_counts(text: str) -> list[int]:
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


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """An argparse type: a logging level name, any case."""
    if text.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_LOG_LEVELS)} (any case), "
                                         f"got {text!r}")
    return text.upper()


# A value such as "-1,2,3" or "-inf" (no option of ours looks like one): argparse would take it
# for an unknown option and report the flag before it as missing its value.
_NEGATIVE_VALUE = re.compile(r"^-(?:\d[\d,.e+-]*|\.\d[\d.e+-]*|inf(?:inity)?|nan)$", re.I)


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 2 (no usage block, no traceback)."""

    def error(self, message: str) -> "NoReturn":
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _parse_optional(self, arg_string: str) -> Any:
        if _NEGATIVE_VALUE.match(arg_string):
            return None  # a value: the flag's type then says what is wrong with it
        return super()._parse_optional(arg_string)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """Layout and shape flags shared by ``demo`` and ``plan``."""
    pos, nonneg = _int_at_least(1), _int_at_least(0)
    p.add_argument("--ranks", type=pos, default=4, help="EP group size = dp x tp (default 4)")
    p.add_argument("--tp", type=pos, default=1, help="attention TP size inside the EP group")
    p.add_argument("--ep", action="store_true", help="expert parallel (required when dp > 1)")
    p.add_argument("--tokens", type=nonneg, default=8, help="tokens per DP group")
    p.add_argument("--hidden", type=pos, default=256)
    p.add_argument("--experts", type=pos, default=8)
    p.add_argument("--topk", type=pos, default=2)
    p.add_argument("--intermediate", type=pos, default=64, help="routed expert intermediate size")
    p.add_argument("--shared-intermediate", type=nonneg, default=128, help="0: no shared expert")
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
    from moe_plugins.runner.demo import demo_preflight, run_demo
    from moe_plugins.runner.launch import RankPool
    from moe_plugins.runner.model import MoEConfig
    from moe_plugins.quant import QuantScheme, QuantSpec

    layout = layout_from_args(args)
    cfg = MoEConfig(hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                    intermediate=args.intermediate, shared_intermediate=args.shared_intermediate,
                    dtype=_DTYPES[args.dtype], renormalize=not args.no_renormalize)
    quant = QuantSpec(QuantScheme(args.quant), args.defer_input_quant)
    quant.check_hidden(cfg.hidden)
    # every user error before ranks start (the call bound's included: once, exit status 2)
    bound = demo_preflight(layout, cfg, args.backend, quant, args.call_timeout_s)
    with RankPool(layout.world_size, args.timeout) as pool:
        rows = run_demo(pool, layout, cfg, args.backend, args.tokens, quant, iters=args.iters,
                        call_timeout_s=bound)
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print(f"layout {layout.describe()} backend={args.backend} tokens/DP group={args.tokens} "
              f"hidden={cfg.hidden} experts={cfg.num_experts} topk={cfg.num_topk} "
              f"routing={'renormalized' if cfg.renormalize else 'softmax (not renormalized)'} "
              f"dtype={args.dtype} quant={args.quant}{' (deferred)' if args.defer_input_quant else ''}")
        print(f"{'strategy':<24} {'max_abs_err':>11} {'ok':>3} {'TP coll':>7} {'TP bytes':>9} "
              f"{'pairs/rank':<16} {'dispatch bytes/rank':<28} {'ms/layer':>8}")
        for r in rows:
            name = r.strategy + ("*" if r.default else "")
            print(f"{name:<24} {r.max_abs_err:>11.2e} {'yes' if r.ok else 'NO':>3} "
                  f"{r.tp_collectives:>7} {r.tp_collective_bytes:>9} "
                  f"{str(r.dispatched_pairs):<16} {str(r.dispatched_bytes):<28} {r.ms_per_layer:>8.2f}")
        for r in rows:
            if r.modes:  # backends that pick their transport per call (deepep_auto)
                print(f"{r.strategy}: calls per transport mode on rank 0: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(r.modes.items())))
        print("* = the strategy this layout uses by default; shared-expert overlap is off on "
              "CPU ranks (no CUDA side stream): the shared expert runs inline")
    return 0 if all(r.ok for r in rows) else 1


# -- plan ------------------------------------------------------------------------------------
_SHAPE_FLAGS = ("hidden", "experts", "topk", "intermediate", "shared_intermediate", "dtype")


def _plan_inputs(args: argparse.Namespace) -> tuple:
    """(ModelSpec, layout, QuantSpec, LinkModel) from the flags: an explicit shape flag overrides
    the --model-config value, which overrides demo's default."""
    from moe_plugins.planner.link_model import LinkModel
    from moe_plugins.runner.model import MoEConfig
    from moe_plugins.planner.model_config import ModelSpec, load_model_config
    from moe_plugins.quant import QuantScheme, QuantSpec

    if args.dp is not None:
        if args.ranks is not None and args.ranks != args.dp * args.tp:
            raise ValueError(f"--ranks {args.ranks} contradicts --dp {args.dp} x --tp {args.tp}; "
                             "give --dp or --ranks, not both")
        args.ranks = args.dp * args.tp
    elif args.ranks is None:
        args.ranks = args.shape_defaults["ranks"]
    layout = layout_from_args(args)
    base = load_model_config(args.model_config) if args.model_config else None
    cfg = base.moe if base else None
    given = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    if cfg is None:
        d = args.shape_defaults
        cfg = MoEConfig(hidden=d["hidden"], num_experts=d["experts"], num_topk=d["topk"],
                        intermediate=d["intermediate"], shared_intermediate=d["shared_intermediate"],
                        dtype=_DTYPES[d["dtype"]])
    fields = {"hidden": "hidden", "experts": "num_experts", "topk": "num_topk",
              "intermediate": "intermediate", "shared_intermediate": "shared_intermediate"}
    over = {fields[k]: v for k, v in given.items() if k in fields}
    if "dtype" in given:
        over["dtype"] = _DTYPES[given["dtype"]]
    cfg = dataclasses.replace(cfg, **over)
    layers = args.layers if args.layers is not None else (base.num_moe_layers if base else 1)
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    sp_attention = args.sp_attention or (base.sp_attention if base else "reduce_scatter")
    model = ModelSpec(cfg, layers, base.name if base else "flags", sp_attention)
    quant = QuantSpec(QuantScheme(args.quant), args.defer_input_quant)
    link = LinkModel(args.nvlink_gbps, args.nvlink_us, args.rdma_gbps, args.rdma_us,
                     args.gpus_per_node)
    return model, layout, quant, link


def _est(e: "Estimate", fmt: str = "{:.1f}") -> str:
    """An Estimate as 'v' (exact) or 'expected [min..max]'."""
    if e.is_exact:
        return str(e.min)
    return f"{fmt.format(e.expected)} [{e.min}..{e.max}]"


def _size(num_bytes: float, unit: tuple[str, int]) -> str:
    return f"{num_bytes / unit[1]:.2f}" if unit[1] > 1 else f"{num_bytes:.0f}"


def _est_bytes(e: "Estimate") -> str:
    """Bytes of an Estimate in one unit: 'v unit' (exact) or 'expected [min..max] unit'."""
    unit = next(u for u in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                if e.max >= u[1] or u[1] == 1)
    if e.is_exact:
        return f"{_size(e.min, unit)} {unit[0]}"
    return f"{_size(e.expected, unit)} [{_size(e.min, unit)}..{_size(e.max, unit)}] {unit[0]}"


def _collective_detail(rk: tuple, name: str) -> list[dict]:
    """Per collective of ``RankPlan.<name>``: kind, bytes and wire bytes per rank, link, time."""
    first = getattr(rk[0], name)
    return [{"kind": c.kind, "bytes": [getattr(r, name)[i].bytes for r in rk],
             "wire_bytes": [getattr(r, name)[i].wire_bytes for r in rk], "link": c.link,
             "time_us": max(getattr(r, name)[i].time_us for r in rk)}
            for i, c in enumerate(first)]


def _plan_json(plan: "LayerPlan") -> list[dict]:
    rows = []
    for sp in plan.strategies:
        rk = sp.ranks

        def per(name: str, rk: tuple = rk) -> list[dict]:
            return [getattr(r, name).as_dict() for r in rk]

        rows.append({
            "strategy": sp.strategy.value, "recommended": sp.recommended, "default": sp.default,
            "reason": sp.reason,
            "layout": plan.layout.describe(), "backend": plan.backend,
            "quant": plan.quant.scheme.value, "defer_input_quant": plan.quant.defer_input_quant,
            "model": plan.model.name, "num_moe_layers": plan.model.num_moe_layers,
            "tokens_per_dp_group": list(plan.num_tokens), "dispatches": sp.dispatches,
            "rows_per_pair": plan.wire.per_pair,
            "dispatched_tokens": [r.owned for r in rk],
            "dispatched_pairs": [r.pairs for r in rk],
            "dispatched_rows": per("rows"),
            "dispatched_bytes": [r.dispatch_bytes.as_dict() for r in rk],
            "dispatch_act_bytes": per("act_bytes"), "dispatch_sf_bytes": per("sf_bytes"),
            "dispatch_meta_bytes": per("meta_bytes"),
            "recv_pairs": per("recv_pairs"), "recv_rows": per("recv_rows"),
            "recv_dispatch_bytes": [r.recv_dispatch_bytes.as_dict() for r in rk],
            "recv_sf_bytes": per("recv_sf_bytes"),
            "combine_bytes": per("combine_bytes"), "recv_combine_bytes": per("recv_combine_bytes"),
            # the MoE block's TP collectives: the same integer as `moe-plugins demo --json`
            "tp_collectives": sp.num_tp_collectives,
            "tp_collective_detail": _collective_detail(rk, "tp_collectives"),
            "tp_collective_bytes": [r.tp_collective_bytes for r in rk],
            # the whole decoder layer: the attention's reduction, then the MoE block's
            "sp_attention": plan.model.sp_attention,
            "decoder_tp_collectives": sp.num_decoder_tp_collectives,
            "decoder_tp_collective_detail": _collective_detail(rk, "decoder_collectives"),
            "decoder_tp_bytes": [r.decoder_tp_bytes for r in rk],
            "decoder_tp_wire_bytes": [r.decoder_tp_wire_bytes for r in rk],
            "wire_hidden": plan.wire.wire_hidden,
            "shared_weight_bytes": [r.shared_weight_bytes for r in rk],
            "expert_weight_bytes": [r.expert_weight_bytes for r in rk],
            "time_us": {"dispatch": sp.time.dispatch_us, "combine": sp.time.combine_us,
                        "tp": sp.time.tp_us, "attention": sp.time.attention_us,
                        "total": sp.time.total_us},
            "time_ms_all_layers": sp.time.total_us * plan.model.num_moe_layers / 1e3,
        })
    return rows


def _plan_table(plan: "LayerPlan", per_rank: bool) -> None:
    from moe_plugins.planner.plan import Estimate, expected_ranks_hit

    m, lay, w, ln = plan.model.moe, plan.layout, plan.wire, plan.link
    q = plan.quant.scheme.value + (" (deferred)" if plan.quant.defer_input_quant else "")
    print(f"model {plan.model.name}: hidden={m.hidden} experts={m.num_experts} topk={m.num_topk} "
          f"intermediate={m.intermediate} shared_intermediate={m.shared_intermediate}"
          f"{' (gated)' if m.shared_gate and m.has_shared_expert else ''} "
          f"dtype={str(m.dtype).replace('torch.', '')} moe_layers={plan.model.num_moe_layers}")
    print(f"layout {lay.describe()} ({lay.world_size} ranks, {ln.gpus_per_node} GPUs/node) "
          f"backend={plan.backend} quant={q} tokens/DP group="
          + (f"{plan.num_tokens[0]}" if len(set(plan.num_tokens)) == 1 else str(list(plan.num_tokens))))
    padded = f" (hidden padded to {w.wire_hidden})" if w.wire_hidden != m.hidden else ""
    print(f"wire per row{padded}: act {w.act_bytes} B, x_sf {w.sf_bytes} B, meta {w.meta_bytes} B; "
          f"combine {w.combine_bytes} B; "
          + ("one row per (token, expert) pair" if w.per_pair else
             "one row per (token, destination rank)"))
    if plan.placement is not None:
        print(f"expert placement: {plan.placement.describe()}"
              + ("; uniform-routing rows assume no redundant copies, pass a measured routing"
                 if plan.placement.num_redundant and not plan.routing_given else ""))
    print(f"link model: NVLink {ln.nvlink_gbps:g} GB/s + {ln.nvlink_latency_us:g} us, "
          f"RDMA {ln.rdma_gbps:g} GB/s + {ln.rdma_latency_us:g} us; communication only")
    if not w.per_pair and not plan.routing_given and any(s.dispatches for s in plan.strategies):
        hit = float(expected_ranks_hit(m.num_experts, m.num_topk, lay.ep_size))
        print(f"rows depend on routing: expected under uniform routing [exact min..max]; "
              f"a token reaches {hit:.2f} of {lay.ep_size} ranks on average")
    print("busiest rank per column:")
    print(f"{'strategy':<24} {'decoder TP collectives':<36} {'TP bytes':>11} {'pairs':>6} "
          f"{'rows sent':<20} {'dispatch sent':<26} {'x_sf sent':<26} {'combine sent':<26} "
          f"{'shared W':>10} {'us/layer':>9} {'ms/fwd':>8}")

    def busiest(sp, name: str):
        return max((getattr(r, name) for r in sp.ranks), key=lambda e: (e.expected, e.max))

    for sp in plan.strategies:
        rk = sp.ranks
        colls = "+".join(c.kind for c in rk[0].decoder_collectives) or "-"
        print(f"{sp.strategy.value + ('*' if sp.recommended else ''):<24} {colls:<36} "
              f"{_est_bytes(Estimate.exact(max(r.decoder_tp_bytes for r in rk))):>11} "
              f"{max(r.pairs for r in rk):>6} "
              f"{_est(busiest(sp, 'rows')):<20} {_est_bytes(busiest(sp, 'dispatch_bytes')):<26} "
              f"{_est_bytes(busiest(sp, 'sf_bytes')):<26} "
              f"{_est_bytes(busiest(sp, 'combine_bytes')):<26} "
              f"{_est_bytes(Estimate.exact(max(r.shared_weight_bytes for r in rk))):>10} "
              f"{sp.time.total_us:>9.1f} {sp.time.total_us * plan.model.num_moe_layers / 1e3:>8.3f}")
        if per_rank:
            for r in rk:
                print(f"    rank {r.rank} (dp {r.dp_rank}, tp {r.tp_rank}): tokens {r.owned} "
                      f"pairs {r.pairs} rows {_est(r.rows)} act {_est(r.act_bytes)} "
                      f"x_sf {_est(r.sf_bytes)} meta {_est(r.meta_bytes)} | recv rows "
                      f"{_est(r.recv_rows)} recv pairs {_est(r.recv_pairs)} | combine sent "
                      f"{_est(r.combine_bytes)} recv {_est(r.recv_combine_bytes)} | TP "
                      + (", ".join(f"{c.kind} {c.bytes} B" for c in r.decoder_collectives)
                         or "-")
                      + f" | shared W {r.shared_weight_bytes} B, experts W {r.expert_weight_bytes} B")
    print(f"per decoder layer: the attention's TP reduction (under SP: "
          f"{plan.model.sp_attention}) + the MoE block's; TP bytes: contributed by the busiest "
          f"rank; us/layer: dispatch + combine + TP collectives; ms/fwd: x "
          f"{plan.model.num_moe_layers} MoE layers")
    default = plan.default.strategy.value
    print(f"* = recommended; a layer left to itself runs {default}")
    for sp in plan.strategies:
        print(("* " if sp.recommended else "  ") + f"{sp.strategy.value}: {sp.reason}")


def _expert_placement(args: argparse.Namespace, model: Any, layout: Any) -> Any:
    """--expert-placement and --redundant-experts -> an ExpertPlacement (None: linear, or EP
    off). EPLB's copies: logical experts 0..N-1 once more, after the linear slots."""
    from moe_plugins.placement import ExpertPlacement

    e = model.moe.num_experts
    if not layout.ep:
        if args.expert_placement != "linear" or args.redundant_experts:
            raise ValueError("--expert-placement / --redundant-experts need expert parallelism "
                             "(--ep)")
        return None
    if args.redundant_experts:
        if args.expert_placement != "linear":
            raise ValueError("--redundant-experts builds EPLB's placement; leave "
                             "--expert-placement at linear")
        n = args.redundant_experts
        return ExpertPlacement.eplb(list(range(e)) + [i % e for i in range(n)], layout.ep_size, e)
    if args.expert_placement == "round_robin":
        return ExpertPlacement.round_robin(e, layout.ep_size)
    return None


def _plan_tokens(args: argparse.Namespace, dp: int) -> "int | list[int]":
    """--tokens (one count for every DP group) or --tokens-per-dp (one per DP group), not both."""
    if args.tokens_per_dp is None:
        return args.tokens if args.tokens is not None else args.shape_defaults["tokens"]
    given = ",".join(map(str, args.tokens_per_dp))
    if args.tokens is not None:
        raise ValueError(f"--tokens {args.tokens} and --tokens-per-dp {given} both set the "
                         "tokens of each DP group; give --tokens (the same count for every DP "
                         "group) or --tokens-per-dp (one count per DP group), not both")
    if len(args.tokens_per_dp) != dp:
        raise ValueError(f"--tokens-per-dp {given} gives {len(args.tokens_per_dp)} counts, the "
                         f"layout has {dp} DP groups; give one count per DP group")
    return list(args.tokens_per_dp)


def _cmd_plan(args: argparse.Namespace) -> int:
    from moe_plugins.overlap import OverlapConfig
    from moe_plugins.planner.plan import plan_layer
    from moe_plugins.registry import get_backend
    from moe_plugins.strategy import SharedPlacement

    model, layout, quant, link = _plan_inputs(args)
    tokens = _plan_tokens(args, layout.dp)
    budget = None
    if args.shared_expert_budget_gb is not None:
        budget_bytes = args.shared_expert_budget_gb * 2**30
        if not math.isfinite(budget_bytes):
            raise ValueError(f"--shared-expert-budget-gb {args.shared_expert_budget_gb:g} is too "
                             "large to count in bytes; leave the flag out for no limit")
        budget = int(budget_bytes)
    plan = plan_layer(model, layout, tokens, get_backend(args.backend), quant, link=link,
                      shared_placement=SharedPlacement(args.shared_placement),
                      single_collective=OverlapConfig.from_env().single_collective,
                      shared_expert_budget_bytes=budget,
                      placement=_expert_placement(args, model, layout))
    if args.json:
        for row in _plan_json(plan):
            print(json.dumps(row))
    else:
        _plan_table(plan, args.per_rank)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe-plugins", description=__doc__)
    p.add_argument("--log-level", type=_log_level, default="WARNING", metavar="LEVEL",
                   help=f"one of {', '.join(_LOG_LEVELS)} (any case; default WARNING)")
    sub = p.add_subparsers(dest="cmd", required=True)
    lst = sub.add_parser("list", help="registered backends, capabilities, usable here or why not")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(fn=_cmd_list)
    demo = sub.add_parser("demo", help="run a MoE layer on CPU ranks under every strategy")
    add_layout_args(demo)
    demo.add_argument("--iters", type=_int_at_least(1), default=3, help="timed calls per strategy")
    demo.add_argument("--no-renormalize", action="store_true",
                      help="softmax top-k weights as they are (Qwen2-MoE's default), not "
                      "renormalized to sum to 1")
    demo.add_argument("--timeout", type=_positive_float, default=None,
                      help="seconds a collective may wait for its peers (default "
                      "$MOE_PLUGINS_TIMEOUT_S, else 300)")
    demo.add_argument("--call-timeout-s", type=_nonnegative_float, default=None, metavar="S",
                      help="bound on each layer call: a call not complete within S seconds "
                      "ends its rank (moe_plugins.watchdog; default "
                      "$MOE_PLUGINS_CALL_TIMEOUT_S, else off; 0: off)")
    demo.add_argument("--json", action="store_true", help="one JSON object per strategy and line")
    demo.set_defaults(fn=_cmd_demo)
    plan = sub.add_parser("plan", help="analytic per-rank traffic, TP collectives, weights and "
                          "time of every applicable strategy, with the recommended one")
    add_layout_args(plan)
    shape_defaults = {k: plan.get_default(k) for k in ("ranks", "tokens") + _SHAPE_FLAGS}
    plan.set_defaults(fn=_cmd_plan, shape_defaults=shape_defaults,
                      **{k: None for k in shape_defaults})
    plan.add_argument("--dp", type=_int_at_least(1),
                      help="DP size (instead of --ranks: ranks = dp x tp)")
    plan.add_argument("--model-config", metavar="CONFIG_JSON",
                      help="Hugging Face config.json (DeepSeek-V2/V3 or Qwen2/3-MoE); shape flags "
                      "given as well override its values")
    plan.add_argument("--tokens-per-dp", type=_token_counts, metavar="N0,N1,...",
                      help="tokens of each DP group (instead of --tokens, not with it: for "
                      "uneven DP groups)")
    plan.add_argument("--expert-placement", default="linear", choices=["linear", "round_robin"],
                      help="where the routed experts are (vLLM's --expert-placement-strategy)")
    plan.add_argument("--redundant-experts", type=_int_at_least(0), default=0, metavar="N",
                      help="EPLB: N redundant expert copies (a multiple of the EP size)")
    plan.add_argument("--layers", type=_int_at_least(1), help="MoE layers (default: from --model-config, else 1)")
    plan.add_argument("--shared-placement", default="tp_sharded",
                      choices=["tp_sharded", "replicated"],
                      help="how the shared expert's weights sit on TP ranks (the default "
                      "strategy a layer picks)")
    plan.add_argument("--shared-expert-budget-gb", type=_nonnegative_float, metavar="GIB",
                      help="GiB per rank the shared experts of all MoE layers may take: SP "
                      "(replicated shared experts) is recommended only when they fit (default: "
                      "no limit)")
    plan.add_argument("--sp-attention", choices=["reduce_scatter", "all_reduce"],
                      help="the attention's TP reduction under SP (default: from "
                      "--model-config's family, DeepSeek reduce_scatter, Qwen all_reduce; else "
                      "reduce_scatter)")
    plan.add_argument("--nvlink-gbps", type=_positive_float, default=450.0,
                      help="NVLink GB/s per GPU and direction (H100/H200 NVLink4: 450)")
    plan.add_argument("--nvlink-us", type=_nonnegative_float, default=3.0,
                      help="NVLink latency per message")
    plan.add_argument("--rdma-gbps", type=_positive_float, default=50.0,
                      help="RDMA GB/s per GPU (one 400 Gb/s NIC per GPU: 50)")
    plan.add_argument("--rdma-us", type=_nonnegative_float, default=5.0,
                      help="RDMA latency per message")
    plan.add_argument("--gpus-per-node", type=_int_at_least(1), default=8)
    plan.add_argument("--per-rank", action="store_true", help="table: a line per rank as well")
    plan.add_argument("--json", action="store_true", help="one JSON object per strategy and line")
    return p


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through `with RankPool(...)`, which ends the ranks (they also die with
    # this process if it is killed outright: RankPool sets their parent-death signal).
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done (demo: every strategy matched the reference), 1 a demo mismatch or
    a rank failed, 2 bad arguments or configuration (one line on stderr, never a traceback)."""
    from moe_plugins.runner.launch import RankError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return args.fn(args)
    except RankError as e:
        print(f"moe-plugins: error: {e.summary}", file=sys.stderr)
        logging.getLogger(__name__).debug("remote traceback:\n%s", e.remote_traceback)
        return 1
    except (ValueError, TypeError, ImportError) as e:
        print(f"moe-plugins: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
