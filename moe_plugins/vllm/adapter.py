"""vLLM-facing classes: our all2all manager and the prepare/finalize adapter.

Imported by the hooks of :mod:`moe_plugins.vllm.patches` once vLLM builds a communicator or a
MoE layer with one of our ``--all2all-backend`` names (so vLLM's fused-MoE code is loaded by
then). Everything engine-agnostic stays in :mod:`moe_plugins`; this module translates.

How a layer maps onto vLLM's modular kernel (vLLM's EP group = DP x TP ranks; without SP every
TP rank of a DP group holds the same tokens; under vLLM's sequence-parallel MoE the model hands
each TP rank its owned chunk):

| strategy | prepare | finalize | ``output_is_reduced()`` | vLLM runner afterwards |
|---|---|---|---|---|
| LOCAL (tp == 1) | dispatch all tokens | combine into ``output`` | True | nothing |
| SP_ALLGATHER (vLLM's SP on) | dispatch all of the chunk (no second slicing) | combine into ``output`` | True | nothing (the model all_gathers the chunks) |
| ROW_SCATTER_ALLREDUCE | dispatch the owned rows | combine into the owned rows, zero the rest | False | ``all_reduce(shared partial + routed)`` once |
| GATHER_PLUS_ALLREDUCE | dispatch the owned rows | combine, then all_gather the rows over TP | True | all_reduce of the shared output |
| TP_UNIFIED (dp == 1) | none (local experts on all tokens) | weight and reduce into ``output`` | False | ``all_reduce(shared partial + routed)`` once |

Expert ids: vLLM's router hands the layer ids in its expert id space (``moe.num_experts`` ids:
with EPLB the physical ids its router mapped logical ones to, contiguous per rank; with
round-robin placement the logical ids, and the routing table ``global_to_physical`` vLLM gives
its LL backends). Our transports dispatch PHYSICAL ids (physical expert p on EP rank
p // num_local, :mod:`moe_plugins.placement`): the adapter maps through the routing table first,
and checks once that this rank's ``expert_map`` holds exactly the slots the transport delivers.
Standard format: our backends hand LOCAL slots (-1 for experts elsewhere) to the experts;
vLLM's experts take vLLM ids and map them with ``expert_map``. The adapter converts through the
inverse of ``expert_map``: a slot held elsewhere gets an id this rank does not hold and weight 0.

Batched format (backends whose capabilities say BATCHED, e.g. DeepEP low-latency): prepare hands
vLLM ``[num_local_experts, max_recv_tokens, hidden]`` with per-expert counts, the experts return
unweighted rows in the same layout, and the backend's combine applies the router weights. vLLM
picks batched experts only when ``use_batched_activation_format`` is true; the hook in
:mod:`moe_plugins.vllm.patches` answers it from :func:`layer_plan`, as this module does.

Sequence parallelism is a model-level decision vLLM makes from
``ParallelConfig.use_sequence_parallel_moe`` before any layer exists; for our names the hook in
:mod:`moe_plugins.vllm.patches` answers it with :func:`sequence_parallel_moe` (vLLM's rule, the
backend's SP capability, and :func:`moe_plugins.planner.plan.recommend_strategy` on the engine config),
and each layer then follows what vLLM built (``FusedMoEParallelConfig.is_sequence_parallel``).

Dual-batch overlap (``--enable-dbo``): vLLM runs two micro-batches of one layer on two threads
that hand over at its yields, so two calls of one layer are in flight. The adapter keeps one call
state per micro-batch id (``dbo_current_ubatch_id()``) and, for backends whose capabilities say
``micro_batch``, one backend prepare/finalize object per micro-batch over the same manager and
library buffer (the per-call handle lives in that object; the layer's counters sum them). It takes
part in vLLM's protocol where vLLM's in-tree DeepEP LL class does: before its combine send it
runs the receive hook the other micro-batch registered (``dbo_maybe_run_recv_hook``), so at most
two transfers are in flight (the libraries double-buffer).

Fault tolerance (``--enable-fault-tolerance``): our manager declares ``support_fault_tolerance``
where the backend our name plans for can mask ranks and the engine asked for it (or the library
masks peers by itself, NIXL EP), and answers vLLM's polls: ``query_active_mask`` /
``query_fault`` (the library's rank mask against the one of the last recovery point) and
``clean_buffers`` (rank-local: zero the RDMA buffers, unmask).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous, TopKWeightAndReduceDelegate)
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_enabled, dbo_maybe_run_recv_hook

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats
from moe_plugins.groups import DistContext
from moe_plugins.interface import (ActivationFormat, AsyncResult, LazyExpertTokensMeta,
                                   PrepareFinalize, PrepareResult, check_finalize_result)
from moe_plugins.layout import ParallelLayout, owned_rows, slice_owned
from moe_plugins.lowlat.prepare_finalize import LowLatencyPrepareFinalize
from moe_plugins.planner.model_config import ModelSpec, model_spec_from_dict
from moe_plugins.overlap import OverlapConfig
from moe_plugins.placement import ExpertPlacement
from moe_plugins.planner.plan import recommend_strategy
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch, swizzle_nvfp4_sf
from moe_plugins.registry import AUTO, BackendSpec, select_backend
from moe_plugins.strategy import (ReductionStrategy, StrategyChoice, applicable_strategies,
                                  choose_strategy)
from moe_plugins.vllm.batch_hint import batch_hint
from moe_plugins.vllm.plugin import (PluginSettings, dbo_backend_names, plugin_settings,
                                     registry_name)

logger = logging.getLogger(__name__)

__all__ = ["MoEPluginsAll2AllManager", "MoEPluginsPrepareAndFinalize", "make_prepare_finalize",
           "quant_scheme_of", "ep_manager", "LayerPlan", "plan_layer", "layer_plan",
           "parallel_config_plan", "sequence_parallel_moe", "micro_batches"]

_LOGGED: set[tuple] = set()
_WARNED: set[str] = set()
_DEFERRED = QuantSpec()  # what travels under defer_input_quant: the activations as they are
_FIRST_CALL_LOGGED: set[str] = set()
# EP groups without a vLLM all2all manager (dp == 1): one of ours per group, made on first use.
_GROUP_MANAGERS: dict[str, "MoEPluginsAll2AllManager"] = {}


def _bound_vllm_timeout(*groups: Any) -> Optional[float]:
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


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


class MoEPluginsAll2AllManager(All2AllManagerBase):
    """vLLM's all2all manager slot for our names: holds the EP group and caches one backend
    manager per (backend, layer config), as vLLM's managers cache handles. The MoE layers reach
    the backend through :func:`make_prepare_finalize`; vLLM's naive dispatch/combine entry points
    are not served (our layers run inside the modular kernel)."""

    def __init__(self, cpu_group: Any, device_group: Any, tcp_store_group: Any = None):
        super().__init__(cpu_group, tcp_store_group)
        # device_group: NCCL on CUDA, gloo on CPU; our transports use it for the all-to-alls.
        self.device_group = device_group if device_group is not None else cpu_group
        self._managers: dict[tuple[str, DispatchConfig], Any] = {}
        self.timeout_s = _bound_vllm_timeout(cpu_group, self.device_group)
        self._store: Optional[dist.Store] = None
        self._last_mask: Optional[torch.Tensor] = None
        self.support_fault_tolerance = _fault_tolerance_wanted()

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
            _bound_vllm_timeout(tp_group)
        return DistContext(layout, self.rank, self.device_group, tp_group, torch.device(device),
                           self.timeout_s)

    def build(self, spec: BackendSpec, ctx: DistContext, cfg: DispatchConfig) -> PrepareFinalize:
        """A new prepare/finalize for one layer, on the cached manager of its config."""
        engine_options = getattr(spec.manager, "engine_options", None)
        if cfg.backend_options is None and engine_options is not None:
            options = engine_options(self.tcp_store, fault_tolerance=self.support_fault_tolerance)
            if options is not None:
                cfg = dataclasses.replace(cfg, backend_options=options)
        key = (spec.name, cfg)
        manager = self._managers.get(key)
        if manager is None:
            manager = self._managers[key] = spec.manager(ctx, cfg)
        return spec.prepare_finalize(manager, cfg)

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
    def _masking_managers(self) -> list[Any]:
        return [m for m in self._managers.values()
                if getattr(m, "can_mask", None) is not None and m.can_mask()]

    def query_active_mask(self) -> torch.Tensor:
        """int32 [EP size] on this rank's device: 1 where a rank is masked (dead or unreachable)
        in any of our layers' library buffers, 0 where it is live; all zeros before the first
        layer is built."""
        device = torch.device("cpu")
        mask = torch.zeros(self.world_size, dtype=torch.int32)
        for m in self._masking_managers():
            device = m.ctx.device
            for r in m.masked_ranks():
                mask[r] = 1
        return mask.to(device)

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

    def destroy(self) -> None:
        for manager in self._managers.values():
            destroy = getattr(manager, "destroy", None)
            if destroy is not None:
                destroy()
        self._managers.clear()


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
            or bool(getattr(spec.manager, "masks_by_itself", False)))


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


def quant_scheme_of(quant_config: Any) -> Optional[QuantScheme]:
    """Our WIRE quant scheme for vLLM's FusedMoEQuantConfig (what a backend can put on the wire
    quantized: FP8 block-128, NVFP4), NONE for unquantized activations, or None for every other
    activation format (those travel in the model dtype and are quantized after the receive,
    see :func:`receive_quantization`)."""
    if quant_config is None or quant_config.quant_dtype is None:
        return QuantScheme.NONE
    if (quant_config.quant_dtype == torch.float8_e4m3fn and not quant_config.per_act_token_quant
            and list(quant_config.block_shape or []) == [128, 128]):
        return QuantScheme.FP8_BLOCK128
    if quant_config.quant_dtype == "nvfp4":
        return QuantScheme.NVFP4
    return None


# Activation formats vLLM's moe_kernel_quantize_input produces natively for experts (the others,
# mxfp4 and mxfp6, it only emulates, or refuses outside XPU).
_RECEIVE_QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8, "mxfp8", "nvfp4")


@dataclass(frozen=True)
class ReceiveQuant:
    """The arguments of vLLM's ``moe_kernel_quantize_input`` for activations that crossed the
    wire unquantized and are quantized after the receive, before the experts (as vLLM's in-tree
    DeepEP LL ``_do_quant`` does). ``spans_rows``: the scale is computed over many rows (dynamic
    per-tensor), so rows that carry no token are zeroed first (their contents are unspecified
    and would otherwise set the scale)."""

    quant_dtype: Any
    per_act_token_quant: bool
    block_shape: Optional[tuple[int, ...]]
    is_scale_swizzled: bool
    mx_alignment: int

    @property
    def spans_rows(self) -> bool:
        return not self.per_act_token_quant and self.block_shape is None and \
            self.quant_dtype in (torch.float8_e4m3fn, torch.int8)

    def input_scale(self, quant_config: Any) -> Optional[torch.Tensor]:
        """The scale argument for this call's quant config: NVFP4 takes the input global scale
        (``a1_gscale``, as vLLM's DeepEP HT backend quantizes NVFP4 after its dispatch), the
        others the static input scale (``a1_scale``; None: dynamic)."""
        return quant_config.a1_gscale if self.quant_dtype == "nvfp4" else quant_config.a1_scale


def receive_quantization(quant_config: Any) -> Optional[ReceiveQuant]:
    """How vLLM's experts with ``quant_config`` get their activations quantized after a
    model-dtype dispatch; None when vLLM has no native quantization for that format."""
    if quant_config.quant_dtype not in _RECEIVE_QUANT_DTYPES:
        return None
    block = quant_config.block_shape
    return ReceiveQuant(quant_config.quant_dtype, bool(quant_config.per_act_token_quant),
                        None if block is None else tuple(block),
                        bool(getattr(quant_config, "is_scale_swizzled", True)),
                        int(getattr(quant_config, "mx_alignment", 0)))


def _nvfp4_global_scale(quant_config: Any) -> float:
    """The one input global scale an NVFP4 wire uses (vLLM's ``a1_gscale``)."""
    gs = quant_config.a1_gscale
    if gs is None:
        raise ValueError("NVFP4 experts without an input global scale (quant_config.a1_gscale "
                         "is None); moe-plugins quantizes NVFP4 activations before the "
                         "all-to-all with it, as vLLM's two-sided flashinfer backend does")
    flat = gs.detach().float().flatten().cpu()
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        raise ValueError(f"NVFP4 input global scales differ per expert ({flat.tolist()}); the "
                         "activations cross the wire before the expert is known, so they need "
                         "one scale for the layer")
    return float(flat[0])


@dataclass(frozen=True)
class LayerPlan:
    """How MoE layers of one parallel config run: backend, layout, strategy, switches."""

    spec: BackendSpec
    layout: ParallelLayout
    choice: StrategyChoice
    settings: PluginSettings

    @property
    def batched(self) -> bool:
        """vLLM must pick batched-format experts (the backend dispatches, in the batched format)."""
        return (self.choice.strategy.dispatches
                and self.spec.capabilities.activation_format is ActivationFormat.BATCHED)


def plan_layer(backend: str, layout: ParallelLayout, settings: PluginSettings,
               require_available: bool = True, *, sequence_parallel: Optional[bool] = None,
               model: Optional[ModelSpec] = None, num_tokens: Optional[int] = None) -> LayerPlan:
    """The plan for ``--all2all-backend`` ``backend`` (a registry name or ``auto``) on ``layout``.

    The backend is chosen for unquantized dispatch (every backend has it); a quantized layer is
    checked against the chosen backend's quants when its experts are known. Layers are planned
    as having a shared expert (routed-only layers are served as well: the runner's single
    all_reduce then carries the routed rows alone). ``require_available=False``: plan a named
    backend even where its package or GPU is missing here (building it still refuses).

    sequence_parallel: what vLLM decided for the layer (``FusedMoEParallelConfig.
    is_sequence_parallel``). True: the model hands the MoE each TP rank's owned chunk and
    all_gathers after it, so the strategy is SP_ALLGATHER. False: the model did not chunk (SP
    off, or a model without vLLM's SP path), SP_ALLGATHER does not apply. None: the decision
    itself, made from the engine config before any layer exists (what
    ``ParallelConfig.use_sequence_parallel_moe`` answers for our names): a strategy named in
    ``--additional-config`` if any, else :func:`moe_plugins.planner.plan.recommend_strategy` for
    ``model`` (None: a model whose shape moe-plugins cannot read) at ``num_tokens`` tokens per
    DP group with the settings' shared-expert budget, wherever the layout and the backend's
    capabilities allow SP."""
    spec = select_backend(layout, QuantScheme.NONE, backend, require_available=require_available)
    caps = spec.capabilities
    if sequence_parallel and not layout.sequence_parallel(caps.sp):
        raise ValueError(f"vLLM runs this MoE layer sequence-parallel, but backend {spec.name} "
                         f"on layout {layout.describe()} has no sequence parallelism; name a "
                         "backend whose capabilities include SP (moe-plugins list)")
    supports_sp = caps.sp if sequence_parallel is None else sequence_parallel
    options = applicable_strategies(layout, supports_sp=supports_sp,
                                    supports_row_scatter=caps.row_scatter, has_shared_expert=True)
    requested = settings.strategy
    if requested is not None and requested not in options:
        hint = ""
        if requested is ReductionStrategy.SP_ALLGATHER and sequence_parallel is False:
            hint = ("; this model's MoE layers do not run vLLM's sequence-parallel path (SP "
                    "needs EP, tp > 1, dp > 1 and a model that chunks the tokens before its MoE)")
        raise ValueError(f"--additional-config strategy {requested.value} does not apply to "
                         f"layout {layout.describe()} with backend {spec.name}; applicable: "
                         f"{[s.value for s in options]}{hint}")
    if sequence_parallel:
        if requested not in (None, ReductionStrategy.SP_ALLGATHER):
            raise ValueError(f"--additional-config strategy {requested.value} was requested, "
                             "but vLLM built this MoE layer sequence-parallel; the model's "
                             "sequence-parallel MoE decision and the plugin settings disagree")
        choice = StrategyChoice(ReductionStrategy.SP_ALLGATHER,
                                "vLLM's sequence-parallel MoE: the model hands each TP rank its "
                                "owned chunk and all_gathers after the MoE")
    elif requested is not None:
        choice = StrategyChoice(requested, "requested by --additional-config")
    elif sequence_parallel is None:
        choice = _engine_choice(layout, caps, settings, model, num_tokens)
    else:
        choice = choose_strategy(layout, supports_sp=False, supports_row_scatter=caps.row_scatter,
                                 has_shared_expert=True,
                                 single_collective=settings.overlap.single_collective)
    return LayerPlan(spec, layout, choice, settings)


def _engine_choice(layout: ParallelLayout, caps: Any, settings: PluginSettings,
                   model: Optional[ModelSpec], num_tokens: Optional[int]) -> StrategyChoice:
    """The strategy of the engine-level decision (see :func:`plan_layer`), no strategy named."""
    kw = dict(supports_row_scatter=caps.row_scatter,
              single_collective=settings.overlap.single_collective)
    if not layout.sequence_parallel(caps.sp):
        return choose_strategy(layout, supports_sp=False, has_shared_expert=True, **kw)
    if model is None:
        if settings.shared_expert_budget_bytes is not None:
            raise ValueError(
                "--additional-config moe_plugins.shared_expert_budget_gb was given, but "
                "moe-plugins cannot read this model's shape (it reads DeepSeek-V2/V3 and "
                "Qwen2/3-MoE configs), so the shared experts' memory cannot be weighed; name the "
                "strategy instead: \"strategy\": \"SP_ALLGATHER\" or \"ROW_SCATTER_ALLREDUCE\"")
        return StrategyChoice(ReductionStrategy.SP_ALLGATHER,
                              "SP applies: one all_reduce's worth of TP bytes per decoder layer "
                              "(reduce_scatter + all_gather) against row-scatter's two; model "
                              "shape unknown, so no shared-expert memory was weighed")
    return recommend_strategy(layout, model, supports_sp=True,
                              num_tokens=num_tokens if num_tokens else 256,
                              shared_expert_budget_bytes=settings.shared_expert_budget_bytes, **kw)


def layer_plan(parallel: Any) -> Optional[LayerPlan]:
    """:func:`plan_layer` for vLLM's FusedMoEParallelConfig ``parallel`` under the current vLLM
    config (sequence-parallel exactly when vLLM built the layer so); None when our backend has
    nothing to do (EP off)."""
    from vllm.config import get_current_vllm_config

    name = parallel.all2all_backend
    if not parallel.use_ep:
        return None
    if parallel.pcp_size > 1:
        raise ValueError(f"--all2all-backend {name} serves EP groups of DP x TP ranks; turn off "
                         "prefill context parallelism")
    vllm_config = get_current_vllm_config()
    layout = ParallelLayout(dp=parallel.dp_size,
                            tp=vllm_config.parallel_config.tensor_parallel_size, ep=True)
    if layout.world_size != parallel.ep_size:
        raise ValueError(f"vLLM's EP size {parallel.ep_size} is not dp x tp = "
                         f"{layout.world_size}; moe-plugins serves EP groups of data-parallel x "
                         "tensor-parallel ranks")
    return plan_layer(registry_name(name) or AUTO, layout,
                      plugin_settings(vllm_config.additional_config),
                      sequence_parallel=parallel.is_sequence_parallel)


def parallel_config_plan(parallel_config: Any) -> LayerPlan:
    """:func:`plan_layer` from vLLM's engine-level ``ParallelConfig`` (EP on), before any layer
    exists: what the scheduler limits (``use_batched_dp_moe``) and the model's
    sequence-parallel MoE (``use_sequence_parallel_moe``) are decided from.

    The model's shape, ``--additional-config`` and the scheduler's token budget come from the
    vLLM config that holds ``parallel_config`` when it is the current one (every process that
    builds the model: the same serialized config, so the same answer everywhere); without it
    (a ParallelConfig on its own, or the argument parser) the defaults stand in for them, which
    never changes whether a dp > 1 layout dispatches or in the batched format."""
    vllm_config = _owning_vllm_config(parallel_config)
    layout = ParallelLayout(dp=parallel_config.data_parallel_size,
                            tp=parallel_config.tensor_parallel_size, ep=True)
    name = registry_name(parallel_config.all2all_backend) or AUTO
    settings = plugin_settings(None if vllm_config is None else vllm_config.additional_config)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    # A named backend's format does not depend on this process having its package or a GPU
    # (the API server decides the limits); 'auto' picks among the usable ones.
    return plan_layer(name, layout, settings, require_available=name == AUTO,
                      model=_model_spec(vllm_config),
                      num_tokens=getattr(scheduler, "max_num_batched_tokens", None))


def sequence_parallel_moe(parallel_config: Any) -> bool:
    """``ParallelConfig.use_sequence_parallel_moe`` for our names: vLLM's own rule for its
    in-tree names (EP on, tp > 1, dp > 1), with the backend's SP capability from the registry
    and the strategy :func:`parallel_config_plan` chooses (SP unless ``--additional-config``
    or the shared-expert budget says otherwise). Logs the decision once per process."""
    if not (parallel_config.enable_expert_parallel and parallel_config.tensor_parallel_size > 1
            and parallel_config.data_parallel_size > 1):
        return False
    plan = parallel_config_plan(parallel_config)
    on = plan.choice.strategy is ReductionStrategy.SP_ALLGATHER
    key = ("sp", plan.spec.name, plan.layout, plan.choice)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("moe-plugins: sequence-parallel MoE %s for backend %s on %s (%s: %s)",
                    "on" if on else "off", plan.spec.name, plan.layout.describe(),
                    plan.choice.strategy.value, plan.choice.reason)
    return on


def _owning_vllm_config(parallel_config: Any) -> Any:
    """The current vLLM config when it holds ``parallel_config``, else None."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return None
    held = config.parallel_config
    return config if held is parallel_config or held == parallel_config else None


def _model_spec(vllm_config: Any) -> Optional[ModelSpec]:
    """The MoE shape of vLLM's model config (DeepSeek-V2/V3, Qwen2/3-MoE), at the dtype vLLM
    serves it in; None without a model config or for a family moe-plugins cannot read."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    data = dict(model_config.hf_text_config.to_dict())
    data["torch_dtype"] = str(model_config.dtype).removeprefix("torch.")
    try:
        return model_spec_from_dict(data, f"{model_config.model} (vLLM model config)")
    except ValueError:
        return None


# Per-call state between prepare and finalize (one per micro-batch), a plain tuple (made on
# every call): (rows: the owned rows, None where the adapter is ``_whole``; topk_ids and
# topk_weights: the routing handed to the backend's prepare, which its finalize must get;
# owns_all: this TP rank owns every row, nothing to slice out of, or zero around, the output).
_Call = tuple


class _LazyTokensMetadata(mk.ExpertTokensMetadata):
    """vLLM's ExpertTokensMetadata over a backend's :class:`LazyExpertTokensMeta`: the counts
    are made when vLLM's experts read them (its STANDARD experts route by the ids and do not)."""

    def __init__(self, meta: LazyExpertTokensMeta):
        self._meta = meta
        self.expert_num_tokens_cpu = None
        self.psum_recv_per_rank = None

    @property  # type: ignore[override]
    def expert_num_tokens(self) -> torch.Tensor:
        return self._meta.expert_num_tokens


def _nothing() -> None:
    """The receiver of a finalize that has nothing left to do."""


class MoEPluginsPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's prepare/finalize over one of our :class:`PrepareFinalize` backends.

    backend: None for TP_UNIFIED (no dispatch); its activation format (standard or batched) is
    the one vLLM's experts get. ``stats`` counts what this layer sent (the backend's counters) and
    ``calls`` the prepares that ran. ``quants``: what the backend can put on the wire.
    ``global_to_physical``: vLLM's routing table (int [num_experts], the first of the
    ``routing_tables`` it hands its LL backends with round-robin placement), None where vLLM's
    ids are already physical (linear, EPLB); a round-robin ``expert_map`` without one is
    recognised and mapped with the same table.
    ``micro_batch_backends``: prepare/finalize objects of the same backend over the same manager
    for micro-batch ids 1, 2, ... (vLLM's dual-batch overlap; ``backend`` serves id 0);
    ``stats`` sums them all.
    """

    def __init__(self, backend: Optional[PrepareFinalize], backend_name: str, ctx: DistContext,
                 choice: StrategyChoice, overlap: OverlapConfig, num_experts: int,
                 wire_scheme: Optional[QuantScheme],
                 quants: frozenset[QuantScheme] = frozenset(QuantScheme),
                 global_to_physical: Optional[torch.Tensor] = None,
                 micro_batch_backends: Sequence[PrepareFinalize] = ()):
        super().__init__()
        if backend is None and micro_batch_backends:
            raise ValueError("micro_batch_backends need a backend for micro-batch 0")
        layout = ctx.layout
        if num_experts % layout.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size "
                             f"{layout.ep_size}; pick an EP size that divides the experts")
        self.backend, self.backend_name, self.ctx = backend, backend_name, ctx
        self.batched = backend is not None and backend.activation_format is ActivationFormat.BATCHED
        if self.batched and backend is not None and backend.max_num_tokens_per_rank() is None:
            raise ValueError(f"batched backend {backend_name!r} reports no max_num_tokens_per_rank"
                             "; vLLM sizes its batched experts from it")
        self.strategy = choice.strategy
        self.overlap = overlap
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // layout.ep_size
        self._g2p = None if global_to_physical is None else global_to_physical.to(torch.int64)
        # vLLM id of each local slot, then (index num_local) one held elsewhere; from expert_map
        self._slot_ids: Optional[torch.Tensor] = None
        self._placement_map: Optional[torch.Tensor] = None
        self._no_stats = DispatchStats()
        self.calls = 0
        self._wire_scheme = wire_scheme
        self._quants = quants
        self._quant = QuantSpec()
        self._recv_quant: Optional[ReceiveQuant] = None
        self._nvfp4_swizzle = False
        self._first_call_logged = False
        # The TP group the tokens handed to prepare are shared by. Under vLLM's sequence-parallel
        # MoE the model already gave this rank its owned chunk (padded and split as owned_rows
        # does it), so it owns all of it, as a group of one: nothing is sliced a second time.
        sp = choice.strategy is ReductionStrategy.SP_ALLGATHER
        self._tp, self._tp_rank = (1, 0) if sp else (layout.tp, ctx.tp_rank)
        # one rank's rows are all the rows, and nothing is gathered after the finalize
        self._whole = self._tp == 1 and self.strategy is not ReductionStrategy.GATHER_PLUS_ALLREDUCE
        # micro-batch id -> its backend object and its call in flight
        self._backends: tuple[PrepareFinalize, ...] = (
            () if backend is None else (backend, *micro_batch_backends))
        # read once: only a per-call backend pays for reading vLLM's forward context per call
        self._wants_hint = backend is not None and backend.uses_batch_hint
        self._calls: dict[int, _Call] = {}  # (see _Call)
        # our low-latency backends (every micro-batch's object): the adapter calls their send
        # and receive halves directly (dispatch_send, combine_send, combine_received)
        self._low_latency = bool(self._backends) and all(
            isinstance(b, LowLatencyPrepareFinalize) for b in self._backends)
        # read once: vLLM asks on every prepare and finalize
        self._async = overlap.overlap and backend is not None and backend.supports_async()
        # micro-batch ids below this have a backend object (no backend: any id, nothing to call)
        self._num_slots = len(self._backends) if backend is not None else sys.maxsize

    @property
    def stats(self) -> DispatchStats:
        """What this layer sent: the backend's counters, summed over its micro-batch objects
        (read when asked, not per call)."""
        if self.backend is None:
            return self._no_stats
        if len(self._backends) == 1:
            return self.backend.stats
        return DispatchStats.total([b.stats for b in self._backends])

    # -- capabilities ------------------------------------------------------------------------
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return (mk.FusedMoEActivationFormat.BatchedExperts if self.batched
                else mk.FusedMoEActivationFormat.Standard)

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        """Batched backends: the backend's id dtype (DeepEP/NIXL EP: the library's
        ``topk_idx_t``), so vLLM's router emits it and no cast runs per call, as vLLM's in-tree
        DeepEP LL class asks. Standard backends: None (the router's default, int32), because
        the ids also reach vLLM's experts, and some take int32 only (its CPU experts do)."""
        return self.backend.topk_indices_dtype() if self.batched and self.backend else None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None if self.backend is None else self.backend.max_num_tokens_per_rank()

    def num_dispatchers(self) -> int:
        return 1 if self.backend is None else self.backend.num_dispatchers()

    def output_is_reduced(self) -> bool:
        # SP_ALLGATHER: the rows of this rank's chunk are complete (vLLM's runner reduces
        # nothing under SP; the model all_gathers), as vLLM's in-tree SP backends report.
        return self.strategy in (ReductionStrategy.LOCAL, ReductionStrategy.GATHER_PLUS_ALLREDUCE,
                                 ReductionStrategy.SP_ALLGATHER)

    def supports_async(self) -> bool:
        # vLLM runs the shared expert between finalize_async and its receive hook.
        return self._async

    def supports_dbo(self) -> bool:
        """Micro-batch safe: no dispatch (TP_UNIFIED), or one backend object per micro-batch."""
        return self.backend is None or len(self._backends) > 1

    def _no_slot(self, ubatch: int) -> None:
        """Micro-batch ``ubatch`` called a layer with no backend object for it (prepare and
        finalize compare vLLM's micro-batch id with ``_num_slots`` inline: one int compare)."""
        raise RuntimeError(
            f"micro-batch {ubatch} called layer backend {self.backend_name!r}, which was "
            f"built with {len(self._backends)} call slot(s); build it under the vLLM config "
            "that enables dual-batch overlap (--enable-dbo), with a backend whose "
            "capabilities list micro_batch")

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        """Check the experts against what the backend delivers; fix the wire quantization; then
        let the backend adapt its wire format to the experts (packed UE8M0 scales for experts
        that ask for them, as vLLM's in-tree DeepEP LL class does)."""
        self._setup_for_experts(fused_experts)
        # Only a quantized wire has a scale format to adapt (experts that take unquantized
        # inputs get bf16 whatever the layer's quant config says).
        if self._quant.quantized_on_wire:
            for backend in self._backends:
                backend.post_init_setup(fused_experts)

    def _setup_for_experts(self, fused_experts: mk.FusedMoEExperts) -> None:
        if self.batched:
            impl = fused_experts.finalize_weight_and_reduce_impl()
            if not isinstance(impl, TopKWeightAndReduceDelegate):
                raise ValueError(
                    f"batched backend {self.backend_name!r} applies the router weights in its "
                    f"combine, but {type(fused_experts).__name__} reduces with "
                    f"{type(impl).__name__}; use experts that leave the reduction to the "
                    "prepare/finalize (TopKWeightAndReduceDelegate)")
        self._quant, self._recv_quant, self._nvfp4_swizzle = QuantSpec(), None, False
        if fused_experts.expects_unquantized_inputs:
            return
        qc = fused_experts.quant_config
        if qc is None or qc.quant_dtype is None:
            return
        scheme = quant_scheme_of(qc)
        if scheme is not None and scheme in self._quants and scheme is self._wire_scheme:
            # The format the transport can put on the wire goes quantized.
            if scheme is QuantScheme.NVFP4:
                # As vLLM's two-sided flashinfer backend: quantized before the all-to-all with
                # the layer's global scale, scales unswizzled on the wire and interleaved
                # after it when the experts read them swizzled.
                self._nvfp4_swizzle = bool(getattr(qc, "is_scale_swizzled", True))
                self._quant = QuantSpec(scheme, nvfp4_global_scale=_nvfp4_global_scale(qc),
                                        nvfp4_swizzled_sf=self._nvfp4_swizzle)
            else:
                self._quant = QuantSpec(scheme)
            return
        if self.batched and qc.quant_dtype == "nvfp4":
            # vLLM's in-tree DeepEP LL: NVFP4 experts on a batched bf16 dispatch quantize their
            # input themselves (it hands them bf16 rows, no scales).
            return
        recv = receive_quantization(qc)
        if recv is None:
            raise ValueError(
                f"{type(fused_experts).__name__} wants activations quantized as "
                f"quant_dtype={qc.quant_dtype!r} (block_shape={qc.block_shape}, per-token="
                f"{qc.per_act_token_quant}); backend {self.backend_name!r} puts "
                f"{sorted(q.value for q in self._quants)} on the wire and vLLM's "
                "moe_kernel_quantize_input has no native quantization for that format to run "
                "after the receive. Use experts that take bf16 or one of fp8 (block-128, "
                "per-token, per-tensor), int8, mxfp8, nvfp4, or an in-tree --all2all-backend")
        # Every other format goes in the model dtype and is quantized right after the receive.
        self._recv_quant = recv

    def _quantize_received(self, x: torch.Tensor, x_sf: Optional[torch.Tensor],
                           valid: torch.Tensor, quant_config: Any
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [num_recv_tokens, hidden] or batched [num_local_experts, max_recv_tokens, hidden]
        in the model dtype (x_sf None) -> vLLM's quantized activations and scales for the
        experts, by vLLM's own ``moe_kernel_quantize_input`` with the layer's quant config (the
        call's ``quant_config``: static scales live there). ``valid`` bool [rows]: rows that
        carry a token. Batched: quantized as [-1, hidden] and reshaped, scales by vLLM's
        ``normalize_batched_scales_shape`` (as vLLM's DeepEP LL ``_do_quant``)."""
        from vllm.model_executor.layers.fused_moe.utils import (moe_kernel_quantize_input,
                                                                 normalize_batched_scales_shape)

        recv = self._recv_quant
        assert recv is not None and x_sf is None
        rows = x.reshape(-1, x.shape[-1])
        if recv.spans_rows:
            rows = torch.where(valid.reshape(-1, 1), rows, torch.zeros_like(rows))
        q, q_sf = moe_kernel_quantize_input(
            rows, recv.input_scale(quant_config), recv.quant_dtype, recv.per_act_token_quant,
            None if recv.block_shape is None else list(recv.block_shape),
            is_scale_swizzled=recv.is_scale_swizzled, mx_alignment=recv.mx_alignment)
        if not self.batched:
            return q, q_sf
        num_experts = x.shape[0]
        q = q.view(num_experts, -1, q.shape[-1])
        if q_sf is not None and recv.quant_dtype != "nvfp4":
            q_sf = normalize_batched_scales_shape(q_sf, num_experts)
        return q, q_sf

    # -- helpers -------------------------------------------------------------------------------
    def _check_placement(self, expert_map: Optional[torch.Tensor]) -> None:
        """Once per ``expert_map`` tensor (one host sync): it must hold on this rank exactly the
        slots the transport delivers here (physical id p on rank p // num_local, after the
        routing table); builds the slot -> vLLM id table the standard format returns."""
        if self._slot_ids is not None and expert_map is self._placement_map:
            return
        e, per, rank, ep = self.num_experts, self.experts_per_rank, self.ctx.rank, \
            self.ctx.layout.ep_size
        got = (torch.arange(e) if expert_map is None and ep == 1
               else None if expert_map is None else expert_map.detach().to("cpu", torch.int64))
        if got is None or got.shape != (e,):
            raise ValueError(f"EP rank {rank} got expert_map "
                             f"{None if got is None else tuple(got.shape)}, expected int "
                             f"[{e}] (vLLM's id -> local slot, -1 elsewhere) under EP size {ep}")
        if self._g2p is None and ep > 1 and torch.equal(
                got, _slots_of(ExpertPlacement.round_robin(e, ep).global_to_physical(), per, rank)):
            # vLLM's round-robin placement without its routing table: the same table, made here
            self._g2p = ExpertPlacement.round_robin(e, ep).global_to_physical()
        g2p = torch.arange(e) if self._g2p is None else self._g2p.to("cpu")
        expected = _slots_of(g2p, per, rank)
        if not torch.equal(got, expected):
            raise ValueError(
                f"EP rank {rank} holds slots {got.tolist()} (expert_map) but the transport "
                f"delivers {expected.tolist()} here (physical id p on EP rank p // {per}, "
                f"{'after the routing table' if self._g2p is not None else 'ids as given'}); "
                "moe-plugins serves vLLM's linear and round-robin placements and EPLB's physical "
                "experts. Use --expert-placement-strategy linear or round_robin")
        slot_ids = torch.zeros(per + 1, dtype=torch.int64)
        mine = got >= 0
        slot_ids[got[mine]] = torch.arange(e)[mine]
        elsewhere = (~mine).nonzero().flatten()
        slot_ids[per] = int(elsewhere[0]) if elsewhere.numel() else 0  # weight 0 there anyway
        device = expert_map.device if expert_map is not None else self.ctx.device
        self._slot_ids = slot_ids.to(device)
        if self._g2p is not None:
            self._g2p = self._g2p.to(device)
        self._placement_map = expert_map

    def _physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's ids -> the PHYSICAL ids the transports dispatch (same shape and dtype)."""
        if self._g2p is None:
            return topk_ids
        return torch.take(self._g2p, topk_ids.long()).to(topk_ids.dtype)

    def _global_ids(self, prep: PrepareResult, ids_dtype: torch.dtype, weights_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """LOCAL slots (-1: elsewhere) -> vLLM's ids through the inverse of ``expert_map``;
        elsewhere -> an id this rank does not hold, with weight 0."""
        assert prep.topk_ids is not None and prep.topk_weights is not None
        assert self._slot_ids is not None
        local = prep.topk_ids
        # (-1 takes the last entry: an id held elsewhere)
        ids = torch.take(self._slot_ids, local if local.dtype is torch.int64 else local.long())
        # where, not masked_fill: the same mask without masked_fill's copy of the weights first
        weights = torch.where(local < 0, 0.0, prep.topk_weights)
        if ids.dtype is not ids_dtype:
            ids = ids.to(ids_dtype)
        if weights.dtype is not weights_dtype:
            weights = weights.to(weights_dtype)
        return ids, weights

    def _to_vllm(self, prep: PrepareResult, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 quant: QuantSpec, quant_config: Any, defer_input_quant: bool
                 ) -> mk.PrepareResultType:
        """Our PrepareResult -> vLLM's (x, x_sf, expert_tokens_meta, topk_ids, topk_weights),
        quantized after the receive where the experts want a format the wire does not carry."""
        etm = prep.expert_tokens_meta
        if etm is None:
            meta = None
        elif isinstance(etm, LazyExpertTokensMeta):
            meta = _LazyTokensMetadata(etm)
        else:
            meta = mk.ExpertTokensMetadata(etm.expert_num_tokens, None)
        x, x_sf = prep.x, prep.x_sf
        if self.batched:
            # x [num_local_experts, max_recv_tokens, hidden]; the experts keep the caller's ids
            ids = weights = None
        else:
            ids, weights = self._global_ids(prep, topk_ids.dtype, topk_weights.dtype)
        if self._recv_quant is not None and not defer_input_quant:
            x, x_sf = self._quantize_received(x, x_sf, self._valid_rows(prep), quant_config)
        elif (x_sf is not None and quant.scheme is QuantScheme.NVFP4 and self._nvfp4_swizzle
              and not prep.x_sf_swizzled):
            # A backend that returns NVFP4 scales row-aligned: interleave them here, as
            # vLLM's two-sided backend does after its all-to-all (only when present).
            x_sf = swizzle_nvfp4_sf(x_sf)
        return x, x_sf, meta, ids, weights

    @staticmethod
    def _valid_rows(prep: PrepareResult) -> torch.Tensor:
        """bool, one per received row: the row carries a token (STANDARD: some local expert id;
        BATCHED: within its expert's count)."""
        if prep.topk_ids is not None:
            return (prep.topk_ids >= 0).any(dim=1)
        assert prep.expert_tokens_meta is not None
        counts = prep.expert_tokens_meta.expert_num_tokens.to(prep.x.device)
        slots = torch.arange(prep.x.shape[1], device=prep.x.device)
        return slots[None, :] < counts[:, None]

    def _log_first_call(self, num_tokens: int) -> None:
        self._first_call_logged = True
        key = self.backend_name
        if key not in _FIRST_CALL_LOGGED:
            _FIRST_CALL_LOGGED.add(key)
            logger.info("moe-plugins: prepare/finalize of backend %s ran on EP rank %d of %d "
                        "(strategy %s, first call %d tokens)", self.backend_name, self.ctx.rank,
                        self.ctx.layout.ep_size, self.strategy.value, num_tokens)

    # -- prepare -------------------------------------------------------------------------------
    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: Optional[torch.Tensor],
                      apply_router_weight_on_input: bool, quant_config: Any,
                      defer_input_quant: bool = False) -> Any:
        """a1 [num_tokens, hidden]; topk_* [num_tokens, num_topk] with GLOBAL ids. Returns
        (hook, receiver) or a receiver; the receiver gives vLLM's 5-tuple (x, x_sf,
        expert_tokens_meta, topk_ids, topk_weights) of the received rows (standard: GLOBAL ids;
        batched: x [num_local_experts, max_recv_tokens, hidden] and no ids/weights).

        vLLM's modular kernel runs nothing between a dispatch's send and its receive hook unless
        dual-batch overlap is on (then the other micro-batch computes there); without it the
        dispatch is the backend's blocking ``prepare`` (on the low-latency kernels one launch
        instead of two, which vLLM's in-tree class always makes) and only a receiver returns."""
        return self._prepare(a1, topk_weights, topk_ids, expert_map, apply_router_weight_on_input,
                             quant_config, defer_input_quant, not dbo_enabled())

    def _prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool,
                 quant_config: Any, defer_input_quant: bool, blocking: bool) -> Any:
        slot = dbo_current_ubatch_id()  # 0 without dual-batch overlap
        if slot >= self._num_slots:
            self._no_slot(slot)
        if self._calls.pop(slot, None) is not None:
            # This micro-batch's last call raised between prepare and finalize; its error
            # already surfaced.
            self._backends[slot].reset_call_state()
        self.calls += 1
        if not self._first_call_logged:
            self._log_first_call(a1.shape[0])
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input needs num_topk == 1, got "
                                 f"{topk_ids.shape[1]}")
            a1 = a1 * topk_weights.to(a1.dtype)
            if self.batched:
                # A batched backend's combine applies the weights it is given (prepare's, which
                # finalize passes on): the input already carries the router weight, so it
                # combines with unit weights, as vLLM's in-tree batched backends do.
                topk_weights = torch.ones_like(topk_weights)
        quant = _DEFERRED if defer_input_quant else self._quant
        if self.backend is None:  # no dispatch: quantize the local rows as a receive would
            if self._recv_quant is not None and not defer_input_quant:
                every_row = torch.ones(a1.shape[0], dtype=torch.bool, device=a1.device)
                x, x_sf = self._quantize_received(a1, None, every_row, quant_config)
            else:
                x, x_sf = quantize_for_dispatch(a1, quant)
                if x_sf is not None and quant.scheme is QuantScheme.NVFP4 and self._nvfp4_swizzle:
                    x_sf = swizzle_nvfp4_sf(x_sf)
            return lambda: (x, x_sf, None, None, None)

        # TP_UNIFIED (no backend) takes any expert_map; checked once per expert_map tensor
        if expert_map is not self._placement_map or self._slot_ids is None:
            self._check_placement(expert_map)
        ids = topk_ids if self._g2p is None else self._physical_ids(topk_ids)
        # tp == 1 owns every row: nothing to slice, and the backend's input check covers what
        # slice_owned would check (the three tensors cover the same tokens).
        if self._whole:  # one TP rank, no all_gather after the finalize: no rows to track
            x, weights, rows, owns_all = a1, topk_weights, None, True
        else:
            rows = owned_rows(a1.shape[0], self._tp, self._tp_rank)
            if self._tp == 1:
                x, weights = a1, topk_weights
            else:
                owned = slice_owned(rows, a1, ids, topk_weights)
                x, ids, weights = owned.hidden_states, owned.topk_ids, owned.topk_weights
            owns_all = rows.num_owned == rows.num_tokens
        backend = self._backends[slot]
        if self._wants_hint:
            # per-call backends pick their transport (deepep_auto) or size their receive rows
            # (flashinfer two-sided, by vLLM's DP metadata as vLLM's in-tree two-sided backend)
            # from what every rank agrees on; under SP a1 is already this rank's chunk (vLLM
            # pads the chunks to one size)
            backend.set_batch_hint(batch_hint(a1.shape[0], self.ctx.layout,
                                              presliced=self._tp != self.ctx.layout.tp))
        # registered first: a receive that raises leaves a call the next prepare resets
        self._calls[slot] = (rows, ids, weights, owns_all)
        if self._low_latency and (defer_input_quant or self._recv_quant is None):
            # our low-latency backends' send, vLLM's result built from the receive buffers
            # (no PrepareResult in between: host time on every eager call)
            recv_x, recv_sf, count, hook = backend.dispatch_send(x, weights, ids, quant,
                                                                 not blocking)
            result = (recv_x, recv_sf, mk.ExpertTokensMetadata(count, None), None, None)
            return (hook, lambda: result) if hook is not None else lambda: result
        if blocking:
            result = self._to_vllm(backend.prepare(x, weights, ids, quant), topk_ids,
                                   topk_weights, quant, quant_config, defer_input_quant)
            return lambda: result
        sent = backend.prepare_async(x, weights, ids, quant)

        def receiver() -> mk.PrepareResultType:
            prep = sent.receiver()
            assert isinstance(prep, PrepareResult)
            return self._to_vllm(prep, topk_ids, topk_weights, quant, quant_config,
                                 defer_input_quant)

        return (sent.hook, receiver) if sent.hook is not None else receiver

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_map: Optional[torch.Tensor],
                apply_router_weight_on_input: bool, quant_config: Any,
                defer_input_quant: bool = False) -> mk.PrepareResultType:
        """:meth:`prepare_async` with the receive at once (the backend's blocking dispatch)."""
        return self._prepare(a1, topk_weights, topk_ids, expert_map, apply_router_weight_on_input,
                             quant_config, defer_input_quant, True)()

    # -- finalize ------------------------------------------------------------------------------
    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce) -> Any:
        """output [num_tokens, hidden] (written in place); fused_expert_output: the experts'
        output for the received rows (standard: reduced here by ``weight_and_reduce_impl``;
        batched: [num_local_experts, max_recv_tokens, hidden], weighted by the combine).
        Hook mode: vLLM runs the shared expert between this and the hook."""
        return self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                              apply_router_weight_on_input, weight_and_reduce_impl, False)

    def _finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  apply_router_weight_on_input: bool,
                  weight_and_reduce_impl: mk.TopKWeightAndReduce, blocking: bool) -> Any:
        if not self.batched and isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            weight_and_reduce_impl = TopKWeightAndReduceContiguous()
        if self.backend is None:
            weight_and_reduce_impl.apply(output=output, fused_expert_output=fused_expert_output,
                                         topk_weights=topk_weights, topk_ids=topk_ids,
                                         apply_router_weight_on_input=apply_router_weight_on_input)
            return lambda: None
        slot = dbo_current_ubatch_id()
        if slot >= self._num_slots:
            self._no_slot(slot)
        call = self._calls.pop(slot, None)
        if call is None:
            raise RuntimeError("finalize called without a matching prepare on this layer")
        rows, ids, weights, owns_all = call
        backend = self._backends[slot]
        # As vLLM's in-tree LL class: receive what the other micro-batch left in flight before
        # this combine's send (no-op without dual-batch overlap).
        dbo_maybe_run_recv_hook()
        try:
            if self.batched:
                # [num_local_experts, max_recv_tokens, hidden]: never vLLM's output's shape, so
                # never aliased to it (vLLM aliases its fused output to `output` where the
                # shapes match)
                expert_out = fused_expert_output
            else:
                expert_out = weight_and_reduce_impl.apply(
                    output=None, fused_expert_output=fused_expert_output,
                    topk_weights=topk_weights, topk_ids=topk_ids,
                    apply_router_weight_on_input=apply_router_weight_on_input)
                if expert_out.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
                    expert_out = expert_out.clone()
            target = output if owns_all else output[rows.as_slice]
            done = owns_all and self.strategy is not ReductionStrategy.GATHER_PLUS_ALLREDUCE
            if self._low_latency:  # their halves, without the result objects in between
                hook, dest = backend.combine_send(expert_out, weights, ids, target, not blocking)
                if hook is None:
                    backend.combine_received(dest, target)
                    if done:
                        return _nothing
                    received = None
                elif dest is target and done:  # the library writes the output itself
                    return hook, _nothing
                else:
                    def received() -> torch.Tensor:
                        return backend.combine_received(dest, target)
            elif blocking:  # the backend's finalize checks that it wrote ``target``
                backend.finalize(expert_out, weights, ids, target)
                backend.reset_call_state()
                if done:
                    return _nothing
                hook, received = None, None
            else:
                sent: AsyncResult = backend.finalize_async(expert_out, weights, ids, target)
                hook, received = sent.hook, sent.receiver
        except BaseException:
            backend.reset_call_state()
            raise

        def receiver() -> None:
            if received is not None:
                try:
                    check_finalize_result(backend, target, received())
                finally:
                    backend.reset_call_state()
            if self.strategy is ReductionStrategy.GATHER_PLUS_ALLREDUCE:
                self._all_gather_rows(output, rows.start, rows.stop, rows.chunk)
            elif not owns_all:
                output[:rows.start].zero_()
                output[rows.stop:].zero_()

        return (hook, receiver) if hook is not None else receiver

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: mk.TopKWeightAndReduce) -> None:
        """:meth:`finalize_async` as the backend's blocking combine."""
        self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce_impl, True)()

    def _all_gather_rows(self, output: torch.Tensor, start: int, stop: int, chunk: int) -> None:
        """output [num_tokens, hidden] holds this TP rank's rows [start, stop); fill the rest."""
        tp = self.ctx.layout.tp
        padded = output.new_zeros(chunk, output.shape[1])
        padded[: stop - start] = output[start:stop]
        gathered = output.new_empty(chunk * tp, output.shape[1])
        dist.all_gather_into_tensor(gathered, padded, group=self.ctx.tp_group)
        output.copy_(gathered[: output.shape[0]])


def _slots_of(global_to_physical: torch.Tensor, per_rank: int, rank: int) -> torch.Tensor:
    """int64 [num_experts]: the local slot on ``rank`` of each id whose physical expert it holds
    (physical p on rank p // per_rank), -1 elsewhere: the expert_map the transport implies."""
    g2p = global_to_physical.long()
    return torch.where(g2p // per_rank == rank, g2p % per_rank, torch.full_like(g2p, -1))


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
        backend = manager.build(spec, ctx, cfg)
        # one more object per further micro-batch, on the manager (buffer) cached for cfg
        slots = [manager.build(spec, ctx, cfg) for _ in range(micro_batches(spec) - 1)]
    pf = MoEPluginsPrepareAndFinalize(backend, spec.name, ctx, choice, plan.settings.overlap,
                                      moe.num_experts, wire_scheme, spec.quants,
                                      None if routing_tables is None else routing_tables[0],
                                      micro_batch_backends=slots)
    key = (spec.name, layout, choice.strategy, plan.settings, wire_scheme)
    if key not in _LOGGED:
        _LOGGED.add(key)
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
