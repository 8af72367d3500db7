"""The factory vLLM's hook calls for a MoE layer whose ``--all2all-backend`` is ours: plans the
layer, builds the backend on our EP manager (one object per micro-batch under dual-batch
overlap) and wraps it in :class:`moe_plugins.vllm.prepare_finalize.MoEPluginsPrepareAndFinalize`.
Logs one INFO line per layer config.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.interface import (PrepareFinalize)
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import BackendSpec
from moe_plugins.vllm.layer_plan import layer_plan
from moe_plugins.vllm.manager import ep_manager
from moe_plugins.vllm.names import dbo_backend_names
from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize
from moe_plugins.vllm.receive_quant import quant_scheme_of

logger = logging.getLogger(__name__)

__all__ = ["micro_batches", "make_prepare_finalize"]


_LAYERS_LOGGED: set[tuple] = set()


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def micro_batches(spec: BackendSpec) -> int:
    """How many calls of one layer vLLM keeps in flight under the current config: its number of
    micro-batches with dual-batch overlap / micro-batching on, else 1. Raises ValueError when
    they are on and ``spec`` is not micro-batch safe (the config check lets only those through,
    so this is the backstop for configs built around it)."""
    from vllm.config import get_current_vllm_config

    parallel = get_current_vllm_config().parallel_config
    if not getattr(parallel, "use_ubatching", False):
        return 1
    if not spec.capabilities.micro_batch:
        raise ValueError(f"dual-batch overlap / micro-batching is on, but moe-plugins backend "
                         f"{spec.name!r} is not micro-batch safe; name one whose capabilities list "
                         f"micro_batch ({', '.join(dbo_backend_names()) or 'none registered'}) or "
                         "turn off --enable-dbo and --ubatch-size")
    return int(parallel.num_ubatches)


def make_prepare_finalize(moe: Any, quant_config: Any, use_monolithic: bool = False,
                          routing_tables: Optional[tuple[torch.Tensor, ...]] = None
                          ) -> Optional[MoEPluginsPrepareAndFinalize]:
    """Our prepare/finalize for a vLLM MoE layer (FusedMoEConfig ``moe``) whose
    ``--all2all-backend`` is ours; None when EP is off (vLLM's own no-dispatch path then runs).
    ``routing_tables``: vLLM's (global_to_physical, physical_to_global, local_expert_global_ids)
    for round-robin placement, or None. The transport's id space is vLLM's ``moe.num_experts``
    (physical experts, redundant ones included): vLLM's router maps logical ids to it."""
    name = moe.moe_parallel_config.all2all_backend
    if use_monolithic and moe.moe_parallel_config.use_ep:
        raise ValueError(f"--all2all-backend {name} needs a modular MoE experts kernel; this "
                         f"layer's MoE backend ({moe.moe_backend}) is monolithic. Pick another "
                         "--moe-backend or an in-tree --all2all-backend")
    plan = layer_plan(moe.moe_parallel_config)
    if plan is None:
        _warn_once(f"--all2all-backend {name} was selected but expert parallelism is off (one "
                   "rank, or no --enable-expert-parallel): moe-plugins dispatches nothing and "
                   "vLLM's own MoE path runs")
        return None
    spec, layout, choice = plan.spec, plan.layout, plan.choice
    if plan.settings.max_tokens_set:
        _warn_once("moe-plugins overlap_max_tokens is not used under vLLM: vLLM runs the shared "
                   "expert on its own side stream below VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD; "
                   "set that instead")
    link = plan.settings.link
    if link is not None and spec.call_modes is None:
        _warn_once(f"moe-plugins link {link.name or '(link fields)'} is not used: backend "
                   f"{spec.name} has one transport; the link sets where a per-call backend "
                   "(deepep_auto) switches modes")
    wire_scheme = quant_scheme_of(quant_config)
    manager = ep_manager()
    ctx = manager.dist_context(layout, moe.device)
    backend = None
    slots: list[PrepareFinalize] = []
    if choice.strategy.dispatches:
        cfg = DispatchConfig(
            num_experts=moe.num_experts, hidden=moe.hidden_dim, num_topk=moe.experts_per_token,
            max_tokens_per_rank=max(1, moe.max_num_tokens), dtype=moe.in_dtype,
            quant=QuantSpec(wire_scheme if wire_scheme in spec.quants else QuantScheme.NONE))
        backend = manager.build(spec, ctx, cfg, link)
        # one more object per further micro-batch, on the manager (buffer) cached for cfg
        slots = [manager.build(spec, ctx, cfg, link) for _ in range(micro_batches(spec) - 1)]
    pf = MoEPluginsPrepareAndFinalize(backend, spec.name, ctx, choice, plan.settings.overlap,
                                      moe.num_experts, wire_scheme, spec.quants,
                                      None if routing_tables is None else routing_tables[0],
                                      micro_batch_backends=slots)
    key = (spec.name, layout, choice.strategy, plan.settings, wire_scheme)
    if key not in _LAYERS_LOGGED:
        _LAYERS_LOGGED.add(key)
        logger.info("moe-plugins vLLM layer: backend=%s layout=%s EP rank %d strategy=%s (%s) "
                    "output_is_reduced=%s shared-expert overlap=%s format=%s quant=%s "
                    "experts=%d physical (%d logical)%s", spec.name,
                    layout.describe(), ctx.rank, choice.strategy.value, choice.reason,
                    pf.output_is_reduced(), "on" if pf.supports_async() else "off",
                    "batched" if pf.batched else "standard",
                    (wire_scheme or QuantScheme.NONE).value, moe.num_experts,
                    getattr(moe, "num_logical_experts", moe.num_experts),
                    " with vLLM's routing table" if routing_tables is not None else "")
    return pf
