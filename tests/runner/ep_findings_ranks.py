"""Rank functions of tests/runner/test_ep_findings.py: what the one-GPU EP matrix's fault cases
predict, reproduced on CPU with the emulated libraries."""
from __future__ import annotations

from typing import Any

import torch

from moe_plugins.faults import clear_group_faults
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.overlap import OverlapConfig
from moe_plugins.registry import get_backend
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.runner.layer import MoELayer
from moe_plugins.runner.model import MoEWeights
from moe_plugins.runner.reference import reference_moe
from tests.gpu.ep_ranks import CFG, _without, backend_options, compare, vendor


def library_masks_a_slow_peer(rank: int, world: int, backend: str, victim: int) -> dict:
    """Call 1 with every rank live, then call 2 during which the LIBRARY masks ``victim`` on
    its own, as its kernels do when a peer does not answer in time (DeepEP 567632d with
    ``enable_shrink``, internode_ll.cu dispatch/combine receive: ``if (wait_recv_cost >
    NUM_TIMEOUT_CYCLES) { ... atomicExch(mask_buffer_ptr + src_rank, 1); }``; NIXL EP
    nixl_ep_ll.cu the same with its ``timeout_ms``): in the emulation, the runtime's mask entry is
    set at the start of the call, not through our manager. Returns how call 2 ended on this
    rank: ``raised`` (type, message) or ``returned`` (whether the output is the full reference,
    or the reference without the victim's experts)."""
    options: dict[str, Any] = {"enable_shrink": True} if backend == "deepep_ll" else {}
    with vendor(backend, "cpu"):
        weights = MoEWeights.random(CFG, 0)
        layer = MoELayer(weights, cached_dist_context(ParallelLayout(world, 1, True)),
                         get_backend(backend), None, overlap=OverlapConfig(overlap=False),
                         max_tokens_per_rank=8,
                         backend_options=backend_options(backend, world, "cpu", **options))
        try:
            x = demo_inputs(CFG, 6, rank, 0)
            full = reference_moe(x, weights)
            first_ok = compare(layer(x), full, CFG.dtype)[0]
            assert layer.pf is not None
            runtime = layer.pf.manager.buffer.runtime
            if rank != victim:
                dispatch = runtime.run_dispatch

                def timed_out(*args: Any, **kwargs: Any) -> Any:
                    runtime.active[victim] = False  # the kernel's timeout path, on its own
                    return dispatch(*args, **kwargs)
                runtime.run_dispatch = timed_out
            try:
                out = layer(x)
            except Exception as e:  # noqa: BLE001 - what the caller would see
                return dict(first_ok=first_ok, outcome="raised", type=type(e).__name__,
                            message=str(e))
            return dict(first_ok=first_ok, outcome="returned",
                        full=compare(out, full, CFG.dtype)[0],
                        without_victim=compare(out, reference_moe(
                            x, _without(weights, [victim], world)), CFG.dtype)[0],
                        masked=layer.pf.manager.masked_ranks() if rank != victim else None)
        finally:
            layer.pf.reset_call_state()
            layer.destroy()
            # every rank is past both calls: the pool's group is forgotten for the next test
            clear_group_faults(layer.ctx.ep_group)


def layer_refusal_on_one_rank(rank: int, world: int, victim: int) -> dict:
    """The matrix's refuse fault on the torch backend (the one with a host exchange): call 1
    on every rank; call 2 with an input of the wrong hidden size on ``victim`` (refused by its
    own ``MoELayer`` before anything is sent); call 3 on every rank with good inputs, as a
    caller that handles the error goes on. Returns each call's outcome on this rank: (status,
    error type, seconds) and for call 3 whether the output is the reference."""
    import time

    weights = MoEWeights.random(CFG, 0)
    layer = MoELayer(weights, cached_dist_context(ParallelLayout(world, 1, True)),
                     get_backend("torch"), None, overlap=OverlapConfig(overlap=False),
                     max_tokens_per_rank=8)
    x = demo_inputs(CFG, 6, rank, 0)
    full = reference_moe(x, weights)
    calls: dict[int, Any] = {}
    for call in (1, 2, 3):
        arg = x
        if call == 2 and rank == victim:
            arg = torch.zeros(6, CFG.hidden + 128, dtype=CFG.dtype)
        t0 = time.monotonic()
        try:
            out = layer(arg)
            calls[call] = ("returned", compare(out, full, CFG.dtype)[0],
                           round(time.monotonic() - t0, 2))
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            calls[call] = ("raised", type(e).__name__, round(time.monotonic() - t0, 2))
    layer.destroy()
    return calls
