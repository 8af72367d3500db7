"""Rank function of test_vllm_gates: ``nixl_ep`` built the way the vLLM glue builds it, over the
emulated library (gloo CPU ranks; imported only by tests that skip without vLLM)."""
from __future__ import annotations

import torch

from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.quant import QuantSpec
from moe_plugins.runner.demo import demo_inputs
from moe_plugins.config import MoEConfig
from moe_plugins.runner.model import MoEWeights, route
from tests.emulation import installed


def run_nixl_through_vllm_manager(rank: int, world: int, cfg: MoEConfig, num_tokens: int,
                                  vllm_store_group: bool, seed: int = 0) -> dict:
    """Build ``nixl_ep`` the way the vLLM glue does (our all2all manager, no backend_options)
    on the emulated nixl_ep, with the ``tcp_store_group`` vLLM's CUDA communicator passes (a
    StatelessProcessGroup) or none (vLLM's CPU communicator, and dp == 1 under EP), and run one
    routed forward: prepare -> the reference experts -> finalize."""
    import torch.distributed as dist
    from vllm.distributed.utils import StatelessProcessGroup

    from moe_plugins.config import DispatchConfig
    from moe_plugins.runner.experts import TorchExperts
    from moe_plugins.registry import get_backend
    from moe_plugins.vllm.manager import MoEPluginsAll2AllManager

    from vllm.distributed import get_ep_group

    from tests.vllm_glue.vllm_dist import vllm_parallel_state

    layout = ParallelLayout(world, 1, True)
    store_group = None
    if vllm_store_group:
        store_group = StatelessProcessGroup(rank=rank, world_size=world, store=dist.PrefixStore(
            "vllm_tcp_store", dist.distributed_c10d._get_default_store()))
    # vLLM's EP group over the ranks (TP-shaped here: vLLM's DP needs one engine per DP rank)
    with installed("nixl_ep"), vllm_parallel_state(rank, world, world, "moe_plugins_nixl_ep"):
        ep = get_ep_group()
        manager = MoEPluginsAll2AllManager(ep.cpu_group, ep.device_group, store_group)
        backend = manager.build(get_backend("nixl_ep"), cached_dist_context(layout),
                                DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk,
                                               num_tokens, cfg.dtype))
        try:
            weights = MoEWeights.random(cfg, seed)
            x = demo_inputs(cfg, num_tokens, rank, seed)
            topk_weights, topk_ids = route(x, weights.router, cfg.num_topk, cfg.renormalize)
            prep = backend.prepare(x, topk_weights, topk_ids, QuantSpec())
            experts = TorchExperts(weights.local_experts(world, rank), QuantSpec(), cfg.dtype)
            out = backend.finalize(experts.apply(prep), topk_weights, topk_ids,
                                   torch.empty_like(x))
            used_store = backend.manager.options.tcp_store_group
            return dict(out=out, store_is_vllms=used_store is (
                store_group.store if store_group is not None else None))
        finally:
            backend.reset_call_state()
            manager.destroy()


def build_through_vllm_manager(rank: int, world: int, backend: str, cfg: MoEConfig,
                               additional_config: dict) -> dict:
    """Build ``backend`` the way the vLLM glue does (our all2all manager, no backend_options,
    the link of ``additional_config``'s moe_plugins section) on the emulated deep_ep; returns
    the options the manager built it with and, for deepep_auto, its threshold."""
    from moe_plugins.config import DispatchConfig
    from moe_plugins.registry import get_backend
    from moe_plugins.vllm.manager import MoEPluginsAll2AllManager
    from moe_plugins.vllm.settings import plugin_settings
    from vllm.distributed import get_ep_group

    from tests.vllm_glue.vllm_dist import vllm_parallel_state

    layout = ParallelLayout(world, 1, True)
    link = plugin_settings(additional_config).link
    with installed("deep_ep"), vllm_parallel_state(rank, world, world, f"moe_plugins_{backend}"):
        ep = get_ep_group()
        manager = MoEPluginsAll2AllManager(ep.cpu_group, ep.device_group)
        pf = manager.build(get_backend(backend), cached_dist_context(layout),
                           DispatchConfig(cfg.num_experts, cfg.hidden, cfg.num_topk, 16,
                                          cfg.dtype), link)
        try:
            options = pf.manager.options  # type: ignore[attr-defined]
            return dict(link=getattr(options, "link", None),
                        threshold=getattr(pf, "threshold", None))
        finally:
            manager.destroy()
