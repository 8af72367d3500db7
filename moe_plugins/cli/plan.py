"""``moe-plugins plan``: the planner's results as a table or JSON lines (formatting only)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any

from moe_plugins.cli.args import (DTYPES, add_layout_args, int_at_least, layout_from_args,
                                  nonnegative_float, positive_float, token_counts)
from moe_plugins.planner.presets import LINK_PRESETS

if TYPE_CHECKING:
    from moe_plugins.planner.results import LayerPlan
    from moe_plugins.planner.traffic import Estimate

__all__ = ["add_plan_parser"]

_SHAPE_FLAGS = ("hidden", "experts", "topk", "intermediate", "shared_intermediate", "dtype")


def _plan_inputs(args: argparse.Namespace) -> tuple:
    """(ModelSpec, layout, QuantSpec, LinkModel) from the flags: an explicit shape flag overrides
    the --model-config value, which overrides demo's default."""
    from moe_plugins.config import MoEConfig
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
                        dtype=DTYPES[d["dtype"]])
    fields = {"hidden": "hidden", "experts": "num_experts", "topk": "num_topk",
              "intermediate": "intermediate", "shared_intermediate": "shared_intermediate"}
    over = {fields[k]: v for k, v in given.items() if k in fields}
    if "dtype" in given:
        over["dtype"] = DTYPES[given["dtype"]]
    cfg = dataclasses.replace(cfg, **over)
    layers = args.layers if args.layers is not None else (base.num_moe_layers if base else 1)
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    sp_attention = args.sp_attention or (base.sp_attention if base else "reduce_scatter")
    model = ModelSpec(cfg, layers, base.name if base else "flags", sp_attention)
    quant = QuantSpec(QuantScheme(args.quant), args.defer_input_quant)
    return model, layout, quant, _link(args)


# flag -> LinkModel field; a flag given overrides the --link preset (or the default link model)
_LINK_FLAGS = {"nvlink_gbps": "nvlink_gbps", "nvlink_us": "nvlink_latency_us",
               "rdma_gbps": "rdma_gbps", "rdma_us": "rdma_latency_us",
               "gpus_per_node": "gpus_per_node", "ll_nvlink": "ll_nvlink", "sms": "sms"}


def _link(args: argparse.Namespace) -> Any:
    """The LinkModel of --link (default: LinkModel's defaults), with the link flags given."""
    from moe_plugins.planner.link_model import LinkModel
    from moe_plugins.planner.presets import link_preset

    over = {field: getattr(args, flag) for flag, field in _LINK_FLAGS.items()
            if getattr(args, flag) is not None}
    if "ll_nvlink" in over:
        over["ll_nvlink"] = over["ll_nvlink"] == "on"
    return link_preset(args.link, **over) if args.link else LinkModel(**over)


def _link_json(link: Any) -> dict:
    return dataclasses.asdict(link)


def _link_text(ln: Any) -> str:
    return (f"link model {ln.name or '(flags and defaults)'}: NVLink {ln.nvlink_gbps:g} GB/s + "
            f"{ln.nvlink_latency_us:g} us, RDMA {ln.rdma_gbps:g} GB/s + {ln.rdma_latency_us:g} us, "
            f"{ln.gpus_per_node} GPUs/node, low-latency over NVLink {'on' if ln.ll_nvlink else 'off'}"
            f", normal-mode SMs {ln.sms}")


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
    from moe_plugins.planner.transport_time import CALIBRATED

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
            # the busiest rank's all-to-alls, per layer, on the backend's transport
            "dispatch_us": sp.time.dispatch_us, "combine_us": sp.time.combine_us,
            "transport": plan.transport.value,
            "transport_calibrated": plan.transport in CALIBRATED,
            "link": _link_json(plan.link),
            "time_us": {"dispatch": sp.time.dispatch_us, "combine": sp.time.combine_us,
                        "tp": sp.time.tp_us, "attention": sp.time.attention_us,
                        "total": sp.time.total_us},
            "time_ms_all_layers": sp.time.total_us * plan.model.num_moe_layers / 1e3,
        })
    return rows


def _plan_table(plan: "LayerPlan", per_rank: bool) -> None:
    from moe_plugins.planner.traffic import Estimate, expected_ranks_hit
    from moe_plugins.planner.transport_time import CALIBRATED

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
    print(_link_text(ln) + "; communication only")
    print(f"all-to-all time: {plan.transport.value} transport, "
          + ("fitted on DeepEP V1's published H800 rows (docs/planner.md)"
             if plan.transport in CALIBRATED else
             "not calibrated (borrows the fitted families' constants; docs/planner.md)"))
    if not w.per_pair and not plan.routing_given and any(s.dispatches for s in plan.strategies):
        hit = float(expected_ranks_hit(m.num_experts, m.num_topk, lay.ep_size))
        print(f"rows depend on routing: expected under uniform routing [exact min..max]; "
              f"a token reaches {hit:.2f} of {lay.ep_size} ranks on average")
    print("busiest rank per column:")
    print(f"{'strategy':<24} {'decoder TP collectives':<36} {'TP bytes':>11} {'pairs':>6} "
          f"{'rows sent':<20} {'dispatch sent':<26} {'x_sf sent':<26} {'combine sent':<26} "
          f"{'shared W':>10} {'disp us':>8} {'comb us':>8} {'us/layer':>9} {'ms/fwd':>8}")

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
              f"{sp.time.dispatch_us:>8.1f} {sp.time.combine_us:>8.1f} {sp.time.total_us:>9.1f} "
              f"{sp.time.total_us * plan.model.num_moe_layers / 1e3:>8.3f}")
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
          f"rank; disp/comb us: the busiest rank's dispatch / combine; us/layer: dispatch + "
          f"combine + TP collectives; ms/fwd: x "
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
    from moe_plugins.planner.compare import compare_backends
    from moe_plugins.planner.plan import plan_layer
    from moe_plugins.registry import AUTO, get_backend
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
    kw = dict(link=link, shared_placement=SharedPlacement(args.shared_placement),
              single_collective=OverlapConfig.from_env().single_collective,
              shared_expert_budget_bytes=budget, placement=_expert_placement(args, model, layout))
    if args.sweep_tokens is not None:
        return _sweep(args, model, layout, quant, kw)
    comparison = None
    backend = args.backend
    if backend == AUTO:
        comparison = compare_backends(model, layout, tokens, quant, **kw)
        if not comparison[0].usable:
            raise ValueError("no registered backend can serve this layer: " + "; ".join(
                f"{b.backend}: {b.reason}" for b in comparison))
        backend = comparison[0].backend
    plan = plan_layer(model, layout, tokens, get_backend(backend), quant, **kw)
    if args.json:
        for row in _plan_json(plan):
            if comparison is not None:
                row["backend_comparison"] = [_time_json(b) for b in comparison]
            print(json.dumps(row))
    else:
        if comparison is not None:
            _comparison_table(comparison)
        _plan_table(plan, args.per_rank)
    return 0


def _time_json(b: Any) -> dict:
    """One backend's times (``compare_backends``) as JSON."""
    return {"backend": b.backend, "usable": b.usable, "reason": b.reason or None,
            "transport": b.transport.value if b.transport else None,
            "dispatch_us": b.dispatch_us, "combine_us": b.combine_us,
            "total_us": b.total_us if b.usable else None}


def _comparison_table(comparison: list) -> None:
    """--backend auto: every backend's dispatch + combine, the fastest and by how much."""
    from moe_plugins.planner.transport_time import CALIBRATED

    print("backends at these tokens (busiest rank, per MoE layer, the recommended strategy):")
    print(f"{'backend':<28} {'transport':<17} {'dispatch us':>11} {'combine us':>11} "
          f"{'total us':>9}")
    for b in comparison:
        if b.usable:
            note = "" if b.transport in CALIBRATED else "  (transport not calibrated)"
            print(f"{b.backend:<28} {b.transport.value:<17} {b.dispatch_us:>11.1f} "
                  f"{b.combine_us:>11.1f} {b.total_us:>9.1f}{note}")
        else:
            print(f"{b.backend:<28} cannot serve this layer: {b.reason}")
    usable = [b for b in comparison if b.usable]
    best = usable[0]
    if len(usable) > 1:
        nxt = usable[1]
        print(f"fastest: {best.backend}, {nxt.total_us - best.total_us:.1f} us per layer "
              f"({(nxt.total_us / best.total_us - 1) * 100:.0f}%) ahead of {nxt.backend}; its "
              "plan follows")
    else:
        print(f"fastest: {best.backend}, the only backend that can serve this layer")


def _sweep(args: argparse.Namespace, model: Any, layout: Any, quant: Any, kw: dict) -> int:
    """--sweep-tokens: dispatch + combine per backend at each count, and the crossover."""
    from moe_plugins.planner.compare import crossover_backends, sweep_tokens
    from moe_plugins.planner.crossover import mode_crossover
    from moe_plugins.registry import AUTO, get_backend

    if args.tokens is not None or args.tokens_per_dp is not None:
        raise ValueError("--sweep-tokens sets the tokens of every DP group itself; leave out "
                         "--tokens and --tokens-per-dp")
    low, normal = crossover_backends()
    names = None if args.backend == AUTO else list(dict.fromkeys(
        n for n in (args.backend, low, normal) if n is not None))
    counts = args.sweep_tokens
    points = sweep_tokens(model, layout, counts, quant, names, **kw)
    cross = None
    if low is not None and normal is not None:  # what a deepep_auto layer with this link uses
        cross = mode_crossover(model.moe, layout, quant, get_backend(low), get_backend(normal),
                               kw["link"], kw["placement"])
    text = ("no crossover: a low-latency and a normal-mode backend are needed" if cross is None
            else cross.text)
    thresholds = _call_mode_thresholds(model, layout, quant, kw["link"])
    order = sorted({b.backend for b in points[0]})
    if args.json:
        print(json.dumps({
            "layout": layout.describe(), "model": model.name, "quant": quant.scheme.value,
            "link": _link_json(kw["link"]),
            "sweep": [{"tokens_per_dp_group": n, "backends": [_time_json(b) for b in row]}
                      for n, row in zip(counts, points)],
            "crossover": {"low_latency": low, "normal": normal,
                          "tokens_per_dp_group": None if cross is None else cross.tokens,
                          "rows_per_rank": None if cross is None else cross.rows_per_rank,
                          "text": text},
            "thresholds": [{"backend": n, "rows_per_rank": None if t is None else t.rows,
                            "capacity": cap, "text": why} for n, cap, t, why in thresholds]}))
        return 0
    print(f"layout {layout.describe()}, model {model.name}, quant {quant.scheme.value}")
    print(_link_text(kw["link"]))
    print("dispatch + combine us per MoE layer (busiest rank, the recommended strategy); "
          "- : the backend cannot serve the layer")
    print(f"{'tokens/DP group':>15} " + " ".join(f"{n:>28}" for n in order))
    for n, row in zip(counts, points):
        t = {b.backend: b for b in row}
        print(f"{n:>15} " + " ".join(
            f"{t[name].total_us:>28.1f}" if t[name].usable else f"{'-':>28}" for name in order))
    said = set()
    for n, row in zip(counts, points):  # each backend's first refusal, from that count on
        for b in row:
            if not b.usable and b.backend not in said:
                said.add(b.backend)
                print(f"{b.backend}" + (f" from {n} tokens per DP group" if n != counts[0] else "")
                      + f": {b.reason}")
    print(text)
    for name, cap, t, why in thresholds:
        print(f"{name} built with this link: " + (
            f"low-latency up to {t.rows} tokens per rank ({why}), normal mode above"
            if t is not None else why) + f"; capacity {cap}")
    return 0


def _call_mode_thresholds(model: Any, layout: Any, quant: Any, link: Any) -> list[tuple]:
    """(backend, capacity, ModeThreshold or None, why) of every registered backend that picks
    its transport per call: where a layer of it built with ``link`` switches modes, with the
    capacity the plan assumes (the threshold's rows are per rank: tp 1)."""
    from moe_plugins.planner.crossover import low_latency_threshold
    from moe_plugins.registry import registered_backends

    out = []
    for name, spec in sorted(registered_backends().items()):
        modes = spec.call_modes
        if modes is None or not layout.ep:
            continue
        try:
            t = low_latency_threshold(model.moe, layout.ep_size, quant, link, modes,
                                      modes.capacity)
        except ValueError as e:
            out.append((name, modes.capacity, None, f"cannot be priced: {e}"))
            continue
        out.append((name, modes.capacity, t, t.reason))
    return out


def _preset_name(text: str) -> str:
    """An argparse type: a name of :data:`LINK_PRESETS` (the error lists them)."""
    if text not in LINK_PRESETS:
        raise argparse.ArgumentTypeError(f"unknown link preset {text!r}; expected one of "
                                         f"{', '.join(sorted(LINK_PRESETS))}")
    return text


def _sweep_counts(text: str) -> list[int]:
    """An argparse type: comma-separated token counts >= 1, increasing."""
    counts = token_counts(text)
    if any(c < 1 for c in counts) or counts != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"expected increasing token counts >= 1, got {text!r}; "
                                         "e.g. 1,8,64,512,4096")
    return counts


def add_plan_parser(sub: Any) -> None:
    """The ``plan`` subcommand and its flags on ``sub`` (argparse subparsers)."""
    plan = sub.add_parser("plan", help="analytic per-rank traffic, TP collectives, weights and "
                          "time of every applicable strategy, with the recommended one")
    add_layout_args(plan)
    shape_defaults = {k: plan.get_default(k) for k in ("ranks", "tokens") + _SHAPE_FLAGS}
    plan.set_defaults(fn=_cmd_plan, shape_defaults=shape_defaults,
                      **{k: None for k in shape_defaults})
    plan.add_argument("--dp", type=int_at_least(1),
                      help="DP size (instead of --ranks: ranks = dp x tp)")
    plan.add_argument("--model-config", metavar="CONFIG_JSON",
                      help="Hugging Face config.json (DeepSeek-V2/V3 or Qwen2/3-MoE); shape flags "
                      "given as well override its values")
    plan.add_argument("--tokens-per-dp", type=token_counts, metavar="N0,N1,...",
                      help="tokens of each DP group (instead of --tokens, not with it: for "
                      "uneven DP groups)")
    plan.add_argument("--expert-placement", default="linear", choices=["linear", "round_robin"],
                      help="where the routed experts are (vLLM's --expert-placement-strategy)")
    plan.add_argument("--redundant-experts", type=int_at_least(0), default=0, metavar="N",
                      help="EPLB: N redundant expert copies (a multiple of the EP size)")
    plan.add_argument("--layers", type=int_at_least(1), help="MoE layers (default: from --model-config, else 1)")
    plan.add_argument("--shared-placement", default="tp_sharded",
                      choices=["tp_sharded", "replicated"],
                      help="how the shared expert's weights sit on TP ranks (the default "
                      "strategy a layer picks)")
    plan.add_argument("--shared-expert-budget-gb", type=nonnegative_float, metavar="GIB",
                      help="GiB per rank the shared experts of all MoE layers may take: SP "
                      "(replicated shared experts) is recommended only when they fit (default: "
                      "no limit)")
    plan.add_argument("--sp-attention", choices=["reduce_scatter", "all_reduce"],
                      help="the attention's TP reduction under SP (default: from "
                      "--model-config's family, DeepSeek reduce_scatter, Qwen all_reduce; else "
                      "reduce_scatter)")
    plan.add_argument("--link", metavar="PRESET", type=_preset_name,
                      help=f"a named system ({', '.join(sorted(LINK_PRESETS))}; sources in "
                      "docs/planner.md); the link flags below override its values (default: "
                      "H100/H200 HGX links, 8 GPUs per node)")
    plan.add_argument("--nvlink-gbps", type=positive_float,
                      help="NVLink GB/s per GPU and direction (H100/H200 NVLink4: 450)")
    plan.add_argument("--nvlink-us", type=nonnegative_float,
                      help="NVLink latency per message (default 3)")
    plan.add_argument("--rdma-gbps", type=positive_float,
                      help="RDMA GB/s per GPU (one 400 Gb/s NIC per GPU: 50)")
    plan.add_argument("--rdma-us", type=nonnegative_float,
                      help="RDMA latency per message (default 5)")
    plan.add_argument("--gpus-per-node", type=int_at_least(1),
                      help="GPUs per node (NVLink domain), default 8")
    plan.add_argument("--ll-nvlink", choices=["on", "off"],
                      help="low-latency messages to the node's own ranks over NVLink (default "
                      "on, as DeepEP's allow_nvlink_for_low_latency_mode)")
    plan.add_argument("--sms", type=int_at_least(1),
                      help="SMs of DeepEP's normal mode (default 20, DeepEP V1's)")
    plan.add_argument("--sweep-tokens", type=_sweep_counts, metavar="N1,N2,...",
                      help="dispatch + combine per backend at each count of tokens per DP group, "
                      "where the normal mode overtakes the low-latency one, and the threshold a "
                      "deepep_auto layer built with this link switches at")
    plan.add_argument("--per-rank", action="store_true", help="table: a line per rank as well")
    plan.add_argument("--json", action="store_true", help="one JSON object per strategy and line")
