"""Rank functions of the peer-loss tests (tests/runner/test_peer_loss.py): an EP 4 layer on the
emulated low-latency libraries (tests/emulation, with the store fabric: puts and spin-waits
that read the library's mask as each begins, as the kernels do) under ``on_peer_loss``; one
rank SIGKILLs or SIGSTOPs itself inside its experts of one call (its dispatch received, its
combine not sent: mid-call). The libraries' kernel timeout is LIBRARY_TIMEOUT_S (DeepEP as
built with it, NIXL EP's ``timeout_ms``): a survivor's wait already spinning on the lost peer
ends there, whatever the host masks meanwhile.

Every rank reports (``report_result``) each call it made: its seed, and its error's type (the
outputs come back in the rank function's value). The victim writes the wall-clock time of its
fault to the store first, so each survivor can say how long after the death its first correct
call ended.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_plugins.config import MoEConfig
from moe_plugins.faults import LayerBrokenError
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.overlap import OverlapConfig
from moe_plugins.placement import ExpertPlacement
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.launch import report_result, report_step
from moe_plugins.runner.layer import MoELayer
from moe_plugins.runner.model import MoEWeights
from moe_plugins.survival import ExpertsLostError, PeerLossOptions, PeerLostError
from moe_plugins.survival.errors import RankEvictedError
from tests.backends.low_latency_ranks import make_options, vendor_module
from tests.emulation import installed
from tests.emulation._ll_fabric import FABRIC_ENV
from tests.runner.watchdog_ranks import deepep_build

CFG = MoEConfig(hidden=2048, num_experts=8, num_topk=2, intermediate=32, shared_intermediate=64,
                dtype=torch.bfloat16)
TOKENS = 6
VICTIM = 3
FAULT_CALL = 3  # the victim's fault happens inside this call (1-based)
LIBRARY_TIMEOUT_S = 6.0  # the kernels' wait for a peer: above detect_s (2 s), as it must be
_STORE_PREFIX = "peer_loss_test/"


def redundant_placement(world: int = 4) -> ExpertPlacement:
    """8 logical experts, 2 replicas each on different ranks: rank r holds 2r, 2r+1 and the
    next rank's two (so rank 3's experts 6, 7 live on rank 2 too, and 0, 1 on rank 0)."""
    n = CFG.num_experts
    per = n // world
    p2l = [e % n for r in range(world) for e in range(per * r, per * r + 2 * per)]
    return ExpertPlacement.eplb(p2l, world, n)


def seed_of(rank: int, call: int) -> int:
    """The input seed of ``rank``'s call number ``call`` (1-based): distinct per rank."""
    return 1000 * rank + call


def _store() -> "dist.Store":
    return dist.PrefixStore(_STORE_PREFIX, dist.distributed_c10d._get_default_store())


def _fault_inside(layer: MoELayer, fault: str, store: "dist.Store") -> None:
    """Make this rank ``fault`` ("kill": SIGKILL, "stop": SIGSTOP) inside its experts of call
    FAULT_CALL: its dispatch received, its combine not sent."""
    experts, calls = layer.experts, [0]
    apply = experts.apply

    def faulting(prep: Any) -> Any:
        calls[0] += 1
        if calls[0] == FAULT_CALL:
            store.set("victim_pid", str(os.getpid()))
            store.set("died_at", repr(time.time()))
            report_step(f"{fault} inside call {FAULT_CALL}")
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return apply(prep)

    experts.apply = faulting  # type: ignore[method-assign]


def survive(rank: int, world: int, backend: str, fault: str, redundant: bool = True,
            degraded: bool = False, calls_after: int = 5, detect_s: float = 2.0,
            call_timeout_s: Optional[float] = None,
            library_timeout_s: float = LIBRARY_TIMEOUT_S) -> dict:
    """One EP ``world`` layer under ``on_peer_loss``; rank VICTIM faults (``fault``: kill, stop)
    inside call FAULT_CALL. A survivor calls until its faulted call raises, then
    ``calls_after`` more; with ``fault == "stop"`` rank 0 continues the victim (SIGCONT) after
    two of them and every survivor waits for the victim's own error before the rest."""
    os.environ[FABRIC_ENV] = "store"
    store = _store()
    placement = redundant_placement(world) if redundant else None
    with installed(vendor_module(backend), deep_ep_build=_build(backend, library_timeout_s)):
        ctx = cached_dist_context(ParallelLayout(world, 1, True))
        layer = MoELayer(MoEWeights.random(CFG, 0), ctx, get_backend(backend), None,
                         QuantSpec(), OverlapConfig(overlap=False), max_tokens_per_rank=TOKENS,
                         backend_options=make_options(
                             backend, **_library_options(backend, library_timeout_s)),
                         placement=placement, call_timeout_s=call_timeout_s,
                         on_peer_loss=PeerLossOptions(detect_s=detect_s, beat_s=detect_s / 8,
                                                      degraded=degraded, group_timeout_s=20.0))
        try:
            if rank == VICTIM:
                _fault_inside(layer, fault, store)
                return _victim(layer, rank, store)
            return _survivor(layer, rank, fault, calls_after, store)
        finally:
            layer.destroy()


def _build(backend: str, timeout_s: float) -> Optional[dict]:
    """DeepEP's build record with kernel timeout ``timeout_s`` (scripts/deepep/build.sh's
    timeout option)."""
    return deepep_build(timeout_s) if backend.startswith("deepep") else None


def _library_options(backend: str, timeout_s: float) -> dict:
    """DeepEP's mask buffer; NIXL EP's kernel timeout ``timeout_s``."""
    if backend.startswith("deepep"):
        return {"enable_shrink": True}
    return {"timeout_ms": int(timeout_s * 1000)}


def _call(layer: MoELayer, rank: int, call: int) -> dict:
    """One call: its seed and output, or its error's type and text."""
    x = demo_inputs(CFG, TOKENS, 0, seed_of(rank, call))
    try:
        out = layer(x)
    except (PeerLostError, ExpertsLostError, RankEvictedError, LayerBrokenError) as e:
        row = dict(call=call, seed=seed_of(rank, call), error=type(e).__name__, text=str(e),
                   lost_ranks=getattr(e, "lost_ranks", None),
                   lost_experts=getattr(e, "lost_experts", None), retryable=getattr(
                       e, "retryable", None), ended_at=time.time())
    else:
        row = dict(call=call, seed=seed_of(rank, call), out=out, ended_at=time.time())
    report_result({k: v for k, v in row.items() if k != "out"})  # no tensor: a dead rank
    return row                                                     # cannot hand one over


def _victim(layer: MoELayer, rank: int, store: "dist.Store") -> dict:
    rows = []
    for call in range(1, FAULT_CALL + 1):
        rows.append(_call(layer, rank, call))
    # a stopped victim continued: its faulted call ended; so does every later call
    rows.append(_call(layer, rank, FAULT_CALL + 1))
    store.set("victim_ended", rows[FAULT_CALL - 1].get("error", "returned"))
    return dict(rows=rows)


def _survivor(layer: MoELayer, rank: int, fault: str, calls_after: int,
              store: "dist.Store") -> dict:
    rows, call = [], 0
    while True:
        call += 1
        rows.append(_call(layer, rank, call))
        if "error" in rows[-1] or call > FAULT_CALL + 2:
            break
    if rows[-1].get("error") == "ExpertsLostError":  # stopped: every later call refused too
        rows.append(_call(layer, rank, call + 1))
    if rows[-1].get("error") != "PeerLostError":
        return dict(rows=rows)
    for i in range(calls_after):
        if fault == "stop" and i == 2:
            _wake_victim(rank, store)
        call += 1
        rows.append(_call(layer, rank, call))
    died_at = float(store.get("died_at").decode())
    first_ok = next((r for r in rows[len(rows) - calls_after:] if "out" in r), None)
    return dict(rows=rows, died_at=died_at,
                death_to_first_correct_s=None if first_ok is None else
                round(first_ok["ended_at"] - died_at, 3),
                decisions=layer._survival.watch.decisions if layer._survival else [])


def _wake_victim(rank: int, store: "dist.Store") -> None:
    """Rank 0 continues the stopped victim; every survivor waits (bounded) for its error."""
    if rank == 0:
        os.kill(int(store.get("victim_pid").decode()), signal.SIGCONT)
    end = time.monotonic() + 30
    while not store.check(["victim_ended"]):
        if time.monotonic() > end:
            raise TimeoutError("the continued victim did not end its faulted call in 30 s")
        time.sleep(0.05)


def refused(rank: int, world: int, backend: str, options: dict,
            call_timeout_s: Optional[float] = None) -> str:
    """Build a layer with ``on_peer_loss`` on ``backend`` (``options``: its backend options);
    the error's type and text (or "built")."""
    with installed(*(() if backend == "torch" else (vendor_module(backend),))):
        ctx = cached_dist_context(ParallelLayout(world, 1, True))
        try:
            layer = MoELayer(MoEWeights.random(CFG, 0), ctx, get_backend(backend), None,
                             QuantSpec(), OverlapConfig(overlap=False), max_tokens_per_rank=4,
                             backend_options=make_options(backend, **options)
                             if backend != "torch" else None,
                             call_timeout_s=call_timeout_s, on_peer_loss=PeerLossOptions())
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        layer.destroy()
        return "built"


def late_recovery(rank: int, world: int, late_s: float) -> dict:
    """The watch alone, on ``world`` gloo ranks: the last rank SIGKILLs itself; once the
    survivors decided it lost, rank 0 recovers at once while every other survivor keeps a call
    in flight ``late_s`` longer (its faulted call still spinning on the dead peer, as a GPU
    kernel does until the library's timeout) before it recovers. Rank 0's host-group rendezvous
    waits for them meanwhile, a blocking operation on the job's store: its heartbeat must go on
    (else its peers, whose calls are in flight, take it for lost). Returns what each survivor's
    watch decided."""
    from moe_plugins.survival.peer_watch import peer_watch_for
    watch = peer_watch_for(None, detect_s=1.0, beat_s=0.1, group_timeout_s=30.0)
    dist.barrier()
    if rank == world - 1:
        time.sleep(0.3)  # every survivor has seen a beat of this rank
        os.kill(os.getpid(), signal.SIGKILL)
    watch.calls_in_flight += 1
    end = time.monotonic() + 20
    while watch.epoch == 0:  # the decision about the killed rank
        if time.monotonic() > end:
            raise TimeoutError("no decision 20 s after a peer's death")
        time.sleep(0.02)
    if rank != 0:
        time.sleep(late_s)
    watch.calls_in_flight -= 1
    watch.recover("late_recovery")
    dist.barrier(group=watch.host_group)
    time.sleep(2 * watch.detect_s)  # any later decision would be taken by now
    return dict(lost=watch.lost, evicted=watch.evicted,
                decisions=[d["lost"] for d in watch.decisions])
