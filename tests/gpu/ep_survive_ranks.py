"""Rank function of the EP matrix's peer-loss jobs (``survive/<backend>/<fault>/ep4``,
tests/gpu/ep_matrix.py): EP 4 ranks sharing the device, ``MoELayer(on_peer_loss=...)`` on
deepep_ll (``enable_shrink``) or nixl_ep, 8 logical experts with 2 replicas each on different
ranks; rank 3 SIGKILLs or SIGSTOPs itself inside its experts of call 3 (the stopped one is
continued by rank 0 after two of the survivors' later calls). Every survivor reports one row:
passed when its faulted call raised the retryable ``PeerLostError`` naming rank 3 and each of
its next ``calls_after`` calls equalled the single-process reference (computed before the first
call, so the ranks stay in step), with the seconds from the death to its first correct call
and the library's kernel timeout, which bounds it (a survivor's wait already spinning on the
dead peer ends there: DeepEP as built, ``DEEPEP_TIMEOUT_S`` of scripts/deepep/build.sh; NIXL EP
with ``timeout_ms`` NIXL_TIMEOUT_MS here). On CPU it runs on the emulated libraries with the
store fabric (tests/emulation/_ll_fabric.py).
"""
from __future__ import annotations

import os
import time
from typing import Any

from moe_plugins.quant import QuantSpec
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.model import MoEWeights
from moe_plugins.runner.reference import reference_moe
from moe_plugins.survival import PeerLossOptions, PeerLostError
from moe_plugins.survival.errors import RankEvictedError
from tests.gpu.ep_harness import result, step
from tests.gpu.ep_ranks import _Layers, _forward, backend_options, compare, vendor
from tests.runner.peer_loss_ranks import (CFG, FAULT_CALL, TOKENS, VICTIM, _fault_inside,
                                          _library_options, _store, _wake_victim,
                                          redundant_placement, seed_of)


NIXL_TIMEOUT_MS = 10_000  # NIXL EP's kernel timeout in these jobs (its default: 30 s)


def survive_job(rank: int, world: int, backend: str, device: str, fault: str,
                calls_after: int = 20, detect_s: float = 3.0) -> None:
    """See the module doc; reports one row (case ``survive-<fault>``) per rank."""
    if device.startswith("cpu"):
        os.environ["MOE_EMU_LL_FABRIC"] = "store"
    row = dict(backend=backend, case=f"survive-{fault}", quant="bf16", tp=1, max_rel_err=None)
    store = _store()
    weights = MoEWeights.random(CFG, 0)
    total = FAULT_CALL + calls_after
    step(f"{backend}: references of {total} calls")
    refs = {c: reference_moe(demo_inputs(CFG, TOKENS, 0, seed_of(rank, c)), weights)
            for c in range(1, total + 1)}
    with vendor(backend, device):
        layers = _Layers(backend, world, device)
        try:
            opts = _library_options(backend, NIXL_TIMEOUT_MS / 1000)  # DeepEP's: as built
            layer = layers.build(CFG, weights, 1, None, QuantSpec(),
                                 placement=redundant_placement(world),
                                 options=backend_options(backend, world, device, **opts),
                                 on_peer_loss=PeerLossOptions(detect_s=detect_s))
            if rank == VICTIM:
                _fault_inside(layer, fault, store)
                if fault == "kill":  # its row first: it dies inside call FAULT_CALL
                    result(dict(row, status="passed",
                                detail=f"victim: SIGKILLed inside call {FAULT_CALL}"))
            row["library_timeout_s"] = layer.pf.library_timeout_s
            outcomes = _calls(layer, layers.dev, rank, fault, refs, store)
        finally:
            layers.destroy()
    result(dict(row, **_judge(rank, outcomes, store)))


def _calls(layer: Any, dev: Any, rank: int, fault: str, refs: dict, store: Any) -> list:
    """(call, "ok" | error type, max relative error or None, time.time() at its end)."""
    out: list[tuple[int, str, Any, float]] = []
    faulted_at = None
    for call in sorted(refs):
        if fault == "stop" and faulted_at is not None and call == faulted_at + 3 \
                and rank != VICTIM:
            _wake_victim(rank, store)
        step(f"call {call}")
        x = demo_inputs(CFG, TOKENS, 0, seed_of(rank, call))
        try:
            got = _forward(layer, x, dev)
        except (PeerLostError, RankEvictedError) as e:
            out.append((call, type(e).__name__, None, time.time()))
            if rank == VICTIM:
                store.set("victim_ended", type(e).__name__)
                return out
            faulted_at = call
            continue
        ok, _, rel = compare(got, refs[call], CFG.dtype)
        out.append((call, "ok" if ok else "WRONG", rel, time.time()))
    return out


def _judge(rank: int, outcomes: list, store: Any) -> dict:
    """A survivor passes when call FAULT_CALL raised PeerLostError and every other call was
    right; the victim (stopped, then continued) when its faulted call raised RankEvictedError."""
    kinds = [o[1] for o in outcomes]
    if rank == VICTIM:
        ok = kinds[-1] == "RankEvictedError"
        return dict(status="passed" if ok else "failed",
                    detail=f"victim, continued: calls ended {kinds}")
    expected = ["ok"] * (FAULT_CALL - 1) + ["PeerLostError"] + \
        ["ok"] * (len(outcomes) - FAULT_CALL)
    died_at = float(store.get("died_at").decode()) if store.check(["died_at"]) else None
    first = next((o for o in outcomes[FAULT_CALL:] if o[1] == "ok"), None)
    took = None if died_at is None or first is None else round(first[3] - died_at, 3)
    rels = [o[2] for o in outcomes if o[2] is not None]
    return dict(status="passed" if kinds == expected and len(outcomes) > FAULT_CALL else "failed",
                max_rel_err=max(rels) if rels else None,
                death_to_first_correct_s=took,
                detail=f"faulted call {kinds[FAULT_CALL - 1] if len(kinds) >= FAULT_CALL else '-'}"
                       f", {len(outcomes) - FAULT_CALL} later calls "
                       f"{'right' if kinds == expected else kinds}; death to first correct "
                       f"call {took} s")
