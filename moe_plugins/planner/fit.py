"""Fit the time model's constants to the published rows: ``python -m moe_plugins.planner.fit``
prints the fitted constants next to the ones in the code (:data:`moe_plugins.planner.
transport_time.FITTED`) and the residual on every published row; ``--check`` exits 1 when the
code's constants are not the fit rounded to the digits the code keeps.

What is fitted, from :data:`moe_plugins.planner.calibration.FITTED_ROWS` on the ``h800-cx7``
preset (the published set-up), minimizing the sum of squared relative residuals (predicted /
published - 1) of the model's busiest-rank time:

1. the low-latency rows (EP 8, 16, 32): ``ll_fixed_us``, ``ll_nvlink_efficiency``,
   ``ll_rdma_efficiency``;
2. with those, rounded, the normal-mode rows (EP 8 intranode, EP 16 and 32 internode):
   ``normal_nvlink_efficiency``, ``normal_rdma_efficiency``. ``normal_fixed_us`` is not fitted
   (two low-latency fixed costs, see :class:`FittedConstants`).

The model is evaluated as the plan evaluates it (:func:`moe_plugins.planner.all_to_all.
plan_all_to_all`, the rows counted once per published row, timed under each trial set of
constants); the minimizer is a plain Nelder-Mead simplex, deterministic, with no dependency
beyond the standard library."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Optional, Sequence

from moe_plugins.layout import ParallelLayout
from moe_plugins.planner.all_to_all import AllToAllPlan, plan_all_to_all
from moe_plugins.planner.calibration import (CALIBRATION_MODEL, CALIBRATION_QUANT, CHECK_ROWS,
                                             FITTED_ROWS, PublishedRow, published_us, residuals)
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.planner.presets import LINK_PRESETS
from moe_plugins.planner.transport_time import FITTED, FittedConstants
from moe_plugins.registry import get_backend

__all__ = ["LOW_LATENCY_FIELDS", "NORMAL_FIELDS", "DIGITS", "fit", "rounded", "main"]

LOW_LATENCY_FIELDS = ("ll_fixed_us", "ll_nvlink_efficiency", "ll_rdma_efficiency")
NORMAL_FIELDS = ("normal_nvlink_efficiency", "normal_rdma_efficiency")
#: Decimal places the code keeps of each fitted constant.
DIGITS = {"ll_fixed_us": 1, "ll_nvlink_efficiency": 3, "ll_rdma_efficiency": 3,
          "normal_nvlink_efficiency": 3, "normal_rdma_efficiency": 3}


def _row_plan(row: PublishedRow, link: LinkModel) -> AllToAllPlan:
    layout = ParallelLayout(row.ep, 1, True)
    return plan_all_to_all(CALIBRATION_MODEL, layout, [row.tokens] * row.ep,
                           get_backend(row.backend), CALIBRATION_QUANT, link,
                           max_tokens=row.tokens)


def _objective(rows: Sequence[PublishedRow], link: LinkModel, base: FittedConstants,
               fields: Sequence[str]) -> Callable[[Sequence[float]], float]:
    """Sum of squared relative residuals over ``rows`` with ``fields`` of ``base`` set to the
    trial values."""
    planned = [(_row_plan(r, link), r.phase == "dispatch", published_us(r, link.gpus_per_node))
               for r in rows]

    def f(x: Sequence[float]) -> float:
        if min(x) <= 0:
            return float("inf")
        c = dataclasses.replace(base, **dict(zip(fields, x)))
        total = 0.0
        for plan, dispatch, pub in planned:
            disp, comb = plan.times(c)
            total += ((disp if dispatch else comb) / pub - 1) ** 2
        return total
    return f


def _nelder_mead(f: Callable[[Sequence[float]], float], x0: Sequence[float],
                 iterations: int = 4000, tolerance: float = 1e-12) -> list[float]:
    """The minimum of ``f`` from ``x0`` (standard reflection / expansion / contraction /
    shrink coefficients; initial steps of 5% of each coordinate)."""
    n = len(x0)
    simplex = [list(x0)] + [[v * (1.05 if i == j else 1.0) for j, v in enumerate(x0)]
                            for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        size = max(abs(a - b) / max(abs(b), 1e-12) for p in simplex[1:]
                   for a, b in zip(p, simplex[0]))
        if size < tolerance:
            break
        centre = [sum(p[i] for p in simplex[:-1]) / n for i in range(n)]
        worst = simplex[-1]

        def toward(t: float) -> list[float]:
            return [c + t * (c - w) for c, w in zip(centre, worst)]

        r = toward(1.0)
        fr = f(r)
        if fr < values[0]:
            e = toward(2.0)
            fe = f(e)
            simplex[-1], values[-1] = (e, fe) if fe < fr else (r, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = r, fr
        else:
            k = toward(-0.5)
            fk = f(k)
            if fk < values[-1]:
                simplex[-1], values[-1] = k, fk
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, p)]
                                    for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def rounded(c: FittedConstants) -> FittedConstants:
    """``c`` with each fitted constant rounded to :data:`DIGITS`, and the normal mode's fixed
    cost two low-latency ones."""
    r = dataclasses.replace(c, **{k: round(getattr(c, k), d) for k, d in DIGITS.items()})
    return dataclasses.replace(r, normal_fixed_us=2 * r.ll_fixed_us)


def fit(rows: Sequence[PublishedRow] = FITTED_ROWS,
        link: LinkModel = LINK_PRESETS["h800-cx7"],
        start: FittedConstants = FittedConstants(ll_fixed_us=30.0, ll_nvlink_efficiency=0.8,
                                                 ll_rdma_efficiency=0.8,
                                                 normal_nvlink_efficiency=0.8,
                                                 normal_rdma_efficiency=0.8,
                                                 normal_fixed_us=60.0)
        ) -> tuple[FittedConstants, FittedConstants]:
    """(the low-latency stage's raw constants, the whole fit rounded to :data:`DIGITS`): the
    module doc's two stages on ``rows`` (published low-latency and normal-mode rows)."""
    low = [r for r in rows if r.backend == "deepep_ll"]
    normal = [r for r in rows if r.backend != "deepep_ll"]
    x = _nelder_mead(_objective(low, link, start, LOW_LATENCY_FIELDS),
                     [getattr(start, k) for k in LOW_LATENCY_FIELDS])
    raw = dataclasses.replace(start, **dict(zip(LOW_LATENCY_FIELDS, x)))
    base = rounded(raw)
    y = _nelder_mead(_objective(normal, link, base, NORMAL_FIELDS),
                     [getattr(start, k) for k in NORMAL_FIELDS])
    raw = dataclasses.replace(raw, **dict(zip(NORMAL_FIELDS, y)))
    return raw, rounded(dataclasses.replace(base, **dict(zip(NORMAL_FIELDS, y))))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_plugins.planner.fit",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when the code's constants differ from the rounded fit")
    args = ap.parse_args(argv)
    raw, fitted = fit()
    print(f"{'constant':<26} {'fitted':>10} {'rounded':>9} {'in the code':>12}")
    for k in DIGITS:
        print(f"{k:<26} {getattr(raw, k):>10.5f} {getattr(fitted, k):>9g} "
              f"{getattr(FITTED, k):>12g}")
    print(f"{'normal_fixed_us':<26} {'(assumed)':>10} {fitted.normal_fixed_us:>9g} "
          f"{FITTED.normal_fixed_us:>12g}")
    for title, rows in (("fitted rows", FITTED_ROWS), ("rows not fitted", CHECK_ROWS)):
        print(f"\n{title} (h800-cx7, the code's constants):")
        for row, pub, pred, res in residuals(rows):
            print(f"  {row.label:<34} published {f'{row.value:g} {row.unit}':>8} = "
                  f"{pub:5.0f} us, predicted {pred:5.0f} us, {res * 100:+5.1f}%")
    same = fitted == FITTED
    print("\nthe code's constants " + ("are" if same else "are NOT") + " the rounded fit")
    return 1 if args.check and not same else 0


if __name__ == "__main__":
    sys.exit(main())
