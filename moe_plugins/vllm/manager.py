"""Our all2all manager in vLLM's communicator slot: it holds the EP group, caches one backend
manager per (backend, layer config), bounds vLLM's group timeouts and answers vLLM's
fault-tolerance polls.

Fault tolerance (``--enable-fault-tolerance``): our manager declares ``support_fault_tolerance``
where the backend our name plans for can mask ranks and the engine asked for it (or the library
masks peers by itself, NIXL EP), and answers vLLM's polls: ``query_active_mask`` /
``query_fault`` (the library's rank mask against the one of the last recovery point) and
``clean_buffers`` (rank-local: zero the RDMA buffers, unmask).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.interface import PrepareFinalize
from moe_plugins.backend_manager import BackendManager, RankMasking
from moe_plugins.layout import ParallelLayout
from moe_plugins.masking import checked_mask_request
from moe_plugins.planner.link_model import LinkModel
from moe_plugins.registry import BackendSpec
from moe_plugins.vllm.layer_plan import parallel_config_plan

logger = logging.getLogger(__name__)

__all__ = ["bound_vllm_timeout", "MoEPluginsAll2AllManager", "ep_manager"]


# EP groups without a vLLM all2all manager (dp == 1): one of ours per group, made on first use.
_GROUP_MANAGERS: dict[str, "MoEPluginsAll2AllManager"] = {}


def bound_vllm_timeout(*groups: Any) -> Optional[float]:
    """vLLM's groups wait torch's default (up to 30 minutes) unless the user gave
    ``--distributed-timeout-seconds``; then bound ours (moe_plugins.groups.bound_timeout, env
    ``MOE_PLUGINS_TIMEOUT_S``). Returns the timeout in force when known (errors name it)."""
    from vllm.config import get_current_vllm_config_or_none

    from moe_plugins.groups import bound_timeout

    config = get_current_vllm_config_or_none()
    given = config.parallel_config.distributed_timeout_seconds if config is not None else None
    if given is not None:
        return float(given)
    seconds = None
    for group in groups:
        seconds = bound_timeout(group)
    return seconds


class MoEPluginsAll2AllManager(All2AllManagerBase):
    """vLLM's all2all manager slot for our names: holds the EP group and caches one backend
    manager per (backend, layer config), as vLLM's managers cache handles. The MoE layers reach
    the backend through :func:`make_prepare_finalize`; vLLM's naive dispatch/combine entry points
    are not served (our layers run inside the modular kernel)."""

    def __init__(self, cpu_group: Any, device_group: Any, tcp_store_group: Any = None):
        super().__init__(cpu_group, tcp_store_group)
        # device_group: NCCL on CUDA, gloo on CPU; our transports use it for the all-to-alls.
        self.device_group = device_group if device_group is not None else cpu_group
        self._managers: dict[tuple[str, DispatchConfig], BackendManager] = {}
        self._device = torch.device("cpu")  # the layers' (every layer of a rank has one)
        self.timeout_s = bound_vllm_timeout(cpu_group, self.device_group)
        self._store: Optional[dist.Store] = None
        self._last_mask: Optional[torch.Tensor] = None
        # EP rank -> masked, as vLLM's sentinel set it (update_mask) since the last clean:
        # applied to every backend manager, also those built later.
        self._masks: dict[int, bool] = {}
        self.support_fault_tolerance = _fault_tolerance_wanted()
        if self.support_fault_tolerance:
            warn_if_the_bound_defeats_fault_tolerance()

    @property
    def tcp_store(self) -> "dist.Store":
        """The Store our backends exchange connection metadata through (NIXL agents): the one
        vLLM's communicator was given (``tcp_store_group.store``), else a prefix store on the EP
        CPU group's own store, as vLLM's in-tree NIXL EP manager does."""
        if self._store is None:
            given = getattr(self.tcp_store_group, "store", self.tcp_store_group)
            self._store = given if given is not None else dist.PrefixStore(
                "moe_plugins", self.cpu_group.get_group_store())
        return self._store

    def dist_context(self, layout: ParallelLayout, device: torch.device | str) -> DistContext:
        """Our view of this rank: EP rank = rank in vLLM's EP group (DP-major, TP-minor, as
        :class:`ParallelLayout` numbers ranks)."""
        if layout.world_size != self.world_size:
            raise ValueError(f"layout {layout.describe()} needs an EP group of {layout.world_size} "
                             f"ranks, vLLM's EP group has {self.world_size}; moe-plugins serves "
                             "EP groups of data-parallel x tensor-parallel ranks only")
        tp_group = None
        if layout.tp > 1:
            from vllm.distributed import get_tp_group

            tp_group = get_tp_group().device_group
            bound_vllm_timeout(tp_group)
        return DistContext(layout, self.rank, self.device_group, tp_group, torch.device(device),
                           self.timeout_s)

    def build(self, spec: BackendSpec, ctx: DistContext, cfg: DispatchConfig,
              link: Optional[LinkModel] = None) -> PrepareFinalize:
        """A new prepare/finalize for one layer, on the cached manager of its config. ``link``:
        the engine's link model (``--additional-config``), handed to a backend that picks its
        transport per call (``BackendSpec.call_modes``)."""
        if cfg.backend_options is None:
            options = spec.manager.engine_options(self.tcp_store,
                                                  fault_tolerance=self.support_fault_tolerance,
                                                  link=link)
            if options is not None:
                cfg = dataclasses.replace(cfg, backend_options=options)
        key = (spec.name, cfg)
        manager = self._managers.get(key)
        if manager is None:
            manager = self._managers[key] = spec.manager(ctx, cfg)
            self._device = ctx.device
            if self._masks and isinstance(manager, RankMasking) and manager.can_mask():
                for rank, masked in self._masks.items():
                    manager.set_rank_masked(rank, masked)
        return spec.prepare_finalize_on(manager, cfg)

    def _not_served(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "moe-plugins backends run MoE layers through vLLM's modular kernel (prepare/finalize); "
            "this layer's quantization method uses vLLM's naive dispatch/combine instead. Use an "
            "in-tree --all2all-backend (e.g. allgather_reducescatter) for this model"
        )

    dispatch_router_logits = _not_served
    dispatch = _not_served
    combine = _not_served

    # -- fault tolerance (vLLM polls these when support_fault_tolerance is set) -----------
    def _masking_managers(self) -> list[RankMasking]:
        return [m for m in self._managers.values()
                if isinstance(m, RankMasking) and m.can_mask()]

    def query_active_mask(self) -> torch.Tensor:
        """int32 [EP size] on this rank's device: 1 where a rank is masked (dead or unreachable)
        in any of our layers' library buffers, 0 where it is live; all zeros before the first
        layer is built."""
        mask = torch.zeros(self.world_size, dtype=torch.int32)
        for m in self._masking_managers():
            for r in m.masked_ranks():
                mask[r] = 1
        return mask.to(self._device)

    def query_fault(self) -> torch.Tensor:
        """Scalar bool tensor: True when the mask differs from the one of the last recovery
        point (:meth:`clean_buffers`; at start-up: nothing masked)."""
        current = self.query_active_mask()
        if self._last_mask is None or self._last_mask.shape != current.shape:
            self._last_mask = torch.zeros_like(current)
        return (current != self._last_mask.to(current.device)).any()

    def clean_buffers(self) -> None:
        """Post-fault cleanup, rank-local: every buffer our layers use is zeroed and unmasked
        (the library's clean), and the recovery point is reset."""
        for m in self._masking_managers():
            m.clean_buffers()
        self._last_mask = None
        self._masks.clear()

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """vLLM 0.34's fault-tolerance sentinel: after :meth:`clean_buffers` on a retry it masks
        every dead EP rank again (and scale-down masks the ranks it removes); ``masked=False``
        takes a rank back. Rank-local, like vLLM's in-tree DeepEP LL and NIXL EP managers: every
        buffer our layers use stops (or resumes) sending to and receiving from ``rank`` (its
        experts then count as zero in the combine, as the library defines), layers built later
        get the same mask, and the recovery point takes it in, so :meth:`query_fault` reports
        only masks the library sets by itself from here on. ``rank``: an int in [0, EP size);
        ``masked``: a bool or the int 0/1; anything else is refused before any mask changes
        (:func:`moe_plugins.masking.checked_mask_request`)."""
        rank, masked = checked_mask_request(rank, masked, self.world_size, "update_mask")
        if not self.support_fault_tolerance:
            raise ValueError(
                "update_mask: this EP group's backend cannot mask ranks (or fault tolerance is "
                "off); --enable-fault-tolerance serves our names whose backend has the "
                "rank_masking capability (`moe-plugins list`)")
        for m in self._masking_managers():
            m.set_rank_masked(rank, masked)
        self._masks[rank] = masked
        if self._last_mask is None or self._last_mask.shape[0] != self.world_size:
            self._last_mask = torch.zeros(self.world_size, dtype=torch.int32)
        self._last_mask[rank] = int(masked)

    def destroy(self) -> None:
        for manager in self._managers.values():
            manager.destroy()
        self._managers.clear()


_WARNED: list[bool] = []


def warn_if_the_bound_defeats_fault_tolerance(parallel: Any = None) -> bool:
    """One WARNING per process (True when given) where vLLM's fault tolerance is on together
    with the call bound: the bound ends a rank whose peer died (exit status 70), and vLLM's
    executor shuts down when any worker exits, so the sentinel never gets to mask the dead peer.
    ``parallel``: vLLM's ParallelConfig (default: the current config's)."""
    from moe_plugins.callbound import CALL_TIMEOUT_ENV, call_timeout_seconds

    if parallel is None:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        parallel = None if config is None else config.parallel_config
    if parallel is None or not getattr(parallel, "enable_fault_tolerance", False):
        return False
    bound = call_timeout_seconds()
    if bound is None or _WARNED:
        return False
    _WARNED.append(True)
    logger.warning("moe-plugins: --enable-fault-tolerance with $%s=%g: the call bound ends a "
                   "rank whose peer died or hangs (exit status 70), and vLLM's executor then "
                   "shuts down the engine, so fault tolerance never masks the dead peer; unset "
                   "$%s to let the library's timeout mask it, or drop --enable-fault-tolerance "
                   "to keep the bound", CALL_TIMEOUT_ENV, bound, CALL_TIMEOUT_ENV)
    return True


def _fault_tolerance_wanted() -> bool:
    """vLLM's rule for its LL managers, read from the backend our name plans for: the manager can
    mask ranks, and the engine enabled fault tolerance or the library masks peers by itself.
    (vLLM's model runner polls only with dp > 1, where the communicator holds this manager.)"""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return False
    parallel = config.parallel_config
    if not parallel.enable_expert_parallel:
        return False
    try:
        spec = parallel_config_plan(parallel).spec
    except ValueError:
        return False  # no backend of ours serves this layout: building a layer will say why
    if not spec.capabilities.rank_masking:
        return False
    return (bool(getattr(parallel, "enable_fault_tolerance", False))
            or spec.manager.masks_by_itself)


def ep_manager() -> MoEPluginsAll2AllManager:
    """Our manager of vLLM's EP group: the communicator's (dp > 1), else one made here (dp == 1
    with EP: vLLM builds no all2all manager then). Collective on first use per group."""
    from vllm.distributed import get_ep_group

    ep = get_ep_group()
    found = getattr(ep.device_communicator, "all2all_manager", None)
    if isinstance(found, MoEPluginsAll2AllManager):
        return found
    if found is not None:
        raise RuntimeError(f"vLLM's EP group holds a {type(found).__name__} although one of our "
                           "backends is selected; the communicator hook did not run")
    manager = _GROUP_MANAGERS.get(ep.unique_name)
    if manager is None:
        manager = _GROUP_MANAGERS[ep.unique_name] = MoEPluginsAll2AllManager(
            ep.cpu_group, ep.device_group)
    return manager
