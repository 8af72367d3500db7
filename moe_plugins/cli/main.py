"""``moe-plugins`` command line: list backends, run the CPU demo, plan a layout, print the stack
table (the CLI only formats)."""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import asdict
from pathlib import Path
import signal
from typing import TYPE_CHECKING, Any, Iterable, NoReturn, Sequence

from moe_plugins.cli.args import (DTYPES, add_layout_args, call_bound_seconds, int_at_least,
                                  layout_from_args, positive_float)
from moe_plugins.cli.plan import add_plan_parser

if TYPE_CHECKING:
    from moe_plugins.registry import BackendSpec

__all__ = ["main", "backends_markdown"]


def _cmd_list(args: argparse.Namespace) -> int:
    from moe_plugins.registry import registered_backends

    rows = []
    for name, spec in sorted(registered_backends().items()):
        reason = spec.unavailable_reason()
        ep_dp, dp, tp, sp = spec.ep_dp_tp_support
        # what each required package that can say is installed (DeepEP: its line and commit)
        found = {p.module: text for p in spec.required if (text := p.found()[0]) is not None}
        rows.append(dict(name=name, usable=reason is None, reason=reason, ep_dp=ep_dp, dp=dp,
                         tp=tp, sp=sp, placements=spec.capabilities.placements,
                         quants=sorted(q.value for q in spec.quants),
                         distribution=spec.distribution, found=found))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if args.markdown:
        print(backends_markdown(registered_backends().values()))
        return 0
    yn = {True: "yes", False: "no"}
    print(f"{'backend':<28} {'usable':<6} {'ep_dp':<5} {'dp':<3} {'tp':<3} {'sp':<3} "
          f"{'placements':<10} {'quants':<32} reason / found")
    for r in rows:
        found = "; ".join(f"found {m}: {text}" for m, text in r["found"].items())
        note = "; ".join(t for t in (r["reason"], found) if t)
        print(f"{r['name']:<28} {yn[r['usable']]:<6} {yn[r['ep_dp']]:<5} {yn[r['dp']]:<3} "
              f"{yn[r['tp']]:<3} {yn[r['sp']]:<3} {'any' if r['placements'] else 'linear':<10} "
              f"{','.join(r['quants']):<32} {note}")
    from moe_plugins.vllm.version import vllm_status

    print(f"vLLM: {vllm_status()}")
    return 0


def _needs(spec: "BackendSpec") -> str:
    """What a backend needs, from its spec: GPU, activation dtypes, packages and their installs."""
    parts = ["a CUDA GPU"] if spec.needs_cuda else []
    if spec.dtypes is not None:
        parts.append(", ".join(sorted(str(d).replace("torch.", "") for d in spec.dtypes))
                     + " activations")
    parts += [f"`{p.module}`: {p.install}" for p in spec.required]
    return "; ".join(parts) or "torch only"


def _layouts(spec: "BackendSpec") -> str:
    """The capability matrix of a backend as a few words (the fields of ``Capabilities``)."""
    c = spec.capabilities
    parts = [name for name, on in (("EP over DP", c.ep_dp and c.dp), ("TP inside EP", c.tp),
                                   ("SP", c.sp), ("row-scatter", c.row_scatter)) if on]
    parts.append(f"{c.activation_format.name} format")
    if spec.ep_sizes is not None:
        parts.append("EP " + ", ".join(map(str, sorted(spec.ep_sizes))))
    parts.append("any expert placement" if c.placements else "linear expert placement only")
    parts += [what for what, on in (("receive hooks", c.recv_hook),
                                    ("micro-batches (DBO)", c.micro_batch),
                                    ("rank masking", c.rank_masking)) if on]
    return ", ".join(parts)


def backends_markdown(specs: "Iterable[BackendSpec]") -> str:
    """The which-backend table of README.md (``moe-plugins list --markdown``), one row per spec.

    Every cell comes from the spec: ``use_for``, what it needs (GPU, dtypes, required packages
    and how to install them), the capability matrix, the quantizations it puts on the wire and
    its place in ``auto`` selection (highest priority first, ties by name). No cell depends on
    the machine it runs on, so the table is the same everywhere."""
    ordered = sorted(specs, key=lambda s: (-s.priority, s.name))
    lines = ["| backend | pick it for | needs | layouts | wire quants | auto order |",
             "|---|---|---|---|---|---|"]
    for i, spec in enumerate(ordered, 1):
        cells = (f"`{spec.name}`", spec.use_for or spec.description, _needs(spec),
                 _layouts(spec), ", ".join(sorted(q.value for q in spec.quants)), str(i))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


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


def _cmd_demo(args: argparse.Namespace) -> int:
    from moe_plugins.runner.demo import demo_preflight, run_demo
    from moe_plugins.runner.launch import RankPool
    from moe_plugins.config import MoEConfig
    from moe_plugins.quant import QuantScheme, QuantSpec

    layout = layout_from_args(args)
    cfg = MoEConfig(hidden=args.hidden, num_experts=args.experts, num_topk=args.topk,
                    intermediate=args.intermediate, shared_intermediate=args.shared_intermediate,
                    dtype=DTYPES[args.dtype], renormalize=not args.no_renormalize)
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



def _cmd_stack(args: argparse.Namespace) -> int:
    from moe_plugins.stack.versions import stack_markdown

    print(stack_markdown(args.root))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe-plugins", description=__doc__)
    p.add_argument("--log-level", type=_log_level, default="WARNING", metavar="LEVEL",
                   help=f"one of {', '.join(_LOG_LEVELS)} (any case; default WARNING)")
    sub = p.add_subparsers(dest="cmd", required=True)
    lst = sub.add_parser("list", help="registered backends, capabilities, usable here or why not")
    fmt = lst.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one object per backend, with usable/reason")
    fmt.add_argument("--markdown", action="store_true",
                     help="the which-backend table of README.md (the same on every machine)")
    lst.set_defaults(fn=_cmd_list)
    demo = sub.add_parser("demo", help="run a MoE layer on CPU ranks under every strategy")
    add_layout_args(demo)
    demo.add_argument("--iters", type=int_at_least(1), default=3, help="timed calls per strategy")
    demo.add_argument("--no-renormalize", action="store_true",
                      help="softmax top-k weights as they are (Qwen2-MoE's default), not "
                      "renormalized to sum to 1")
    demo.add_argument("--timeout", type=positive_float, default=None,
                      help="seconds a collective may wait for its peers (default "
                      "$MOE_PLUGINS_TIMEOUT_S, else 300)")
    demo.add_argument("--call-timeout-s", type=call_bound_seconds, default=None, metavar="S",
                      help="bound on each layer call: a call not complete within S seconds "
                      "ends its rank (moe_plugins.callbound.watchdog; default "
                      "$MOE_PLUGINS_CALL_TIMEOUT_S, else off; 0: off; else at least 0.5)")
    demo.add_argument("--json", action="store_true", help="one JSON object per strategy and line")
    demo.set_defaults(fn=_cmd_demo)
    stack = sub.add_parser("stack", help="the stack table of docs/stack.md: vLLM, DeepEP, "
                           "flashinfer, nixl, torch: supported, install, what ran on a GPU")
    stack.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                       help="the checkout whose GPU test record (tests/gpu/results) to read "
                       "(default: the one this moe_plugins is in)")
    stack.set_defaults(fn=_cmd_stack)
    add_plan_parser(sub)
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
    except RankError as e:  # a rank raised, died (RankDiedError) or hung (RankTimeoutError)
        # one line, whatever the ranks' messages hold; the remote traceback only when asked for
        line = " ".join(f"{e.summary}. {e.fix}".split())
        debug = logging.getLogger(__name__).isEnabledFor(logging.DEBUG)
        more = ("" if debug or not e.remote_traceback
                else " (--log-level DEBUG shows its remote traceback)")
        print(f"moe-plugins: error: {line}{more}", file=sys.stderr)
        logging.getLogger(__name__).debug("remote traceback:\n%s", e.remote_traceback)
        return 1
    except (ValueError, TypeError, ImportError) as e:
        print(f"moe-plugins: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
