"""vLLM-facing classes: our all2all manager and the prepare/finalize adapter.

Imported by the hooks of :mod:`moe_plugins.vllm_patches` once vLLM builds a communicator or a
MoE layer with one of our ``--all2all-backend`` names (so vLLM's fused-MoE code is loaded by
then). Everything engine-agnostic stays in :mod:`moe_plugins`; this module translates.

How a layer maps onto vLLM's modular kernel (vLLM's EP group = DP x TP ranks, every TP rank of a
DP group holds the same tokens, vLLM's sequence parallelism is off for our names):

| strategy | prepare | finalize | ``output_is_reduced()`` | vLLM runner afterwards |
|---|---|---|---|---|
| LOCAL (tp == 1) | dispatch all tokens | combine into ``output`` | True | nothing |
| ROW_SCATTER_ALLREDUCE | dispatch the owned rows | combine into the owned rows, zero the rest | False | ``all_reduce(shared partial + routed)`` once |
| GATHER_PLUS_ALLREDUCE | dispatch the owned rows | combine, then all_gather the rows over TP | True | all_reduce of the shared output |
| TP_UNIFIED (dp == 1) | none (local experts on all tokens) | weight and reduce into ``output`` | False | ``all_reduce(shared partial + routed)`` once |

Expert ids (standard format): our backends hand LOCAL ids (-1 for experts elsewhere) to the
experts; vLLM's experts take GLOBAL ids and map them with ``expert_map``. The adapter converts: a
slot whose expert is held elsewhere gets a global id this rank does not hold and weight 0.

Batched format (backends whose capabilities say BATCHED, e.g. DeepEP low-latency): prepare hands
vLLM ``[num_local_experts, max_recv_tokens, hidden]`` with per-expert counts, the experts return
unweighted rows in the same layout, and the backend's combine applies the router weights. vLLM
picks batched experts only when ``use_batched_activation_format`` is true; the hook in
:mod:`moe_plugins.vllm_patches` answers it from :func:`layer_plan`, as this module does.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous, TopKWeightAndReduceDelegate)

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats
from moe_plugins.groups import DistContext
from moe_plugins.interface import (ActivationFormat, AsyncResult, PrepareFinalize, PrepareResult,
                                   check_finalize_result)
from moe_plugins.layout import OwnedTokens, ParallelLayout, owned_rows, slice_owned
from moe_plugins.overlap import OverlapConfig
from moe_plugins.quant import QuantScheme, QuantSpec, quantize_for_dispatch, swizzle_nvfp4_sf
from moe_plugins.registry import AUTO, BackendSpec, select_backend
from moe_plugins.strategy import (ReductionStrategy, StrategyChoice, applicable_strategies,
                                  choose_strategy)
from moe_plugins.vllm_plugin import PluginSettings, plugin_settings, registry_name

logger = logging.getLogger(__name__)

__all__ = ["MoEPluginsAll2AllManager", "MoEPluginsPrepareAndFinalize", "make_prepare_finalize",
           "quant_scheme_of", "ep_manager", "LayerPlan", "plan_layer", "layer_plan",
           "parallel_config_plan", "max_dispatched_tokens"]

_LOGGED: set[tuple] = set()
_WARNED: set[str] = set()
_FIRST_CALL_LOGGED: set[str] = set()
# EP groups without a vLLM all2all manager (dp == 1): one of ours per group, made on first use.
_GROUP_MANAGERS: dict[str, "MoEPluginsAll2AllManager"] = {}


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
        self._store: Optional[dist.Store] = None

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
        return DistContext(layout, self.rank, self.device_group, tp_group, torch.device(device))

    def build(self, spec: BackendSpec, ctx: DistContext, cfg: DispatchConfig) -> PrepareFinalize:
        """A new prepare/finalize for one layer, on the cached manager of its config."""
        engine_options = getattr(spec.manager, "engine_options", None)
        if cfg.backend_options is None and engine_options is not None:
            options = engine_options(self.tcp_store)
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

    def destroy(self) -> None:
        for manager in self._managers.values():
            destroy = getattr(manager, "destroy", None)
            if destroy is not None:
                destroy()
        self._managers.clear()


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
               require_available: bool = True) -> LayerPlan:
    """The plan for ``--all2all-backend`` ``backend`` (a registry name or ``auto``) on ``layout``.

    The backend is chosen for unquantized dispatch (every backend has it); a quantized layer is
    checked against the chosen backend's quants when its experts are known. vLLM's sequence
    parallelism is off for out-of-tree names, so SP_ALLGATHER never applies; layers are planned
    as having a shared expert (routed-only layers are served as well: the runner's single
    all_reduce then carries the routed rows alone). ``require_available=False``: plan a named
    backend even where its package or GPU is missing here (building it still refuses)."""
    spec = select_backend(layout, QuantScheme.NONE, backend, require_available=require_available)
    caps = spec.capabilities
    options = applicable_strategies(layout, supports_sp=False, supports_row_scatter=caps.row_scatter,
                                    has_shared_expert=True)
    if settings.strategy is not None:
        if settings.strategy not in options:
            raise ValueError(f"--additional-config strategy {settings.strategy.value} does not "
                             f"apply to layout {layout.describe()} with backend {spec.name}; "
                             f"applicable: {[s.value for s in options]}")
        choice = StrategyChoice(settings.strategy, "requested by --additional-config")
    else:
        choice = choose_strategy(layout, supports_sp=False, supports_row_scatter=caps.row_scatter,
                                 has_shared_expert=True,
                                 single_collective=settings.overlap.single_collective)
    return LayerPlan(spec, layout, choice, settings)


def layer_plan(parallel: Any) -> Optional[LayerPlan]:
    """:func:`plan_layer` for vLLM's FusedMoEParallelConfig ``parallel`` under the current vLLM
    config; None when our backend has nothing to do (EP off)."""
    from vllm.config import get_current_vllm_config

    name = parallel.all2all_backend
    if not parallel.use_ep:
        return None
    if parallel.pcp_size > 1 or parallel.enable_eplb:
        raise ValueError(f"--all2all-backend {name} serves EP groups of DP x TP ranks with a "
                         "fixed expert placement; turn off prefill context parallelism and EPLB")
    vllm_config = get_current_vllm_config()
    layout = ParallelLayout(dp=parallel.dp_size,
                            tp=vllm_config.parallel_config.tensor_parallel_size, ep=True)
    if layout.world_size != parallel.ep_size:
        raise ValueError(f"vLLM's EP size {parallel.ep_size} is not dp x tp = "
                         f"{layout.world_size}; moe-plugins serves EP groups of data-parallel x "
                         "tensor-parallel ranks")
    return plan_layer(registry_name(name) or AUTO, layout,
                      plugin_settings(vllm_config.additional_config))


def parallel_config_plan(parallel_config: Any) -> LayerPlan:
    """:func:`plan_layer` from vLLM's engine-level ``ParallelConfig`` (EP on): what the scheduler
    limits are decided from, before any layer exists. Settings from ``--additional-config``
    are not known there; they change the strategy only, never whether a dp > 1 layout
    dispatches, so the defaults stand in for them."""
    layout = ParallelLayout(dp=parallel_config.data_parallel_size,
                            tp=parallel_config.tensor_parallel_size, ep=True)
    name = registry_name(parallel_config.all2all_backend) or AUTO
    # A named backend's format does not depend on this process having its package or a GPU
    # (the API server decides the limits); 'auto' picks among the usable ones.
    return plan_layer(name, layout, plugin_settings(None), require_available=name == AUTO)


def max_dispatched_tokens(layout: ParallelLayout) -> Optional[int]:
    """The most rows any EP rank dispatches in the current forward, from vLLM's DP metadata
    (what vLLM's in-tree two-sided flashinfer backend sizes its MnnvlMoe prepare by:
    ``max(dp_metadata.get_chunk_sizes_across_dp_rank())``). Our TP ranks dispatch only the rows
    they own (:func:`owned_rows`), so with per-DP-rank sizes the bound is the largest DP rank's
    first owned chunk; sizes vLLM already split per TP rank (sequence parallel: one entry per
    EP rank) are owned chunks themselves. None outside a forward or without DP metadata (the
    backend then sizes by the layer's max_tokens_per_rank)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    dp = get_forward_context().dp_metadata
    if dp is None:
        return None
    # The runner sets the chunk sizes around the MoE call; outside it the per-DP-rank totals.
    sizes = (dp.get_chunk_sizes_across_dp_rank() if getattr(dp, "local_sizes", None) is not None
             else dp.num_tokens_across_dp_cpu.tolist())
    if not sizes:
        return None
    largest = int(max(sizes))
    if layout.tp > 1 and len(sizes) == layout.world_size:
        return largest
    return owned_rows(largest, layout.tp, 0).num_owned


@dataclass
class _Call:
    """Per-call state between prepare and finalize."""

    owned: OwnedTokens


class MoEPluginsPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's prepare/finalize over one of our :class:`PrepareFinalize` backends.

    backend: None for TP_UNIFIED (no dispatch); its activation format (standard or batched) is
    the one vLLM's experts get. ``stats`` counts what this layer sent (the backend's counters) and
    ``calls`` the prepares that ran. ``quants``: what the backend can put on the wire.
    """

    def __init__(self, backend: Optional[PrepareFinalize], backend_name: str, ctx: DistContext,
                 choice: StrategyChoice, overlap: OverlapConfig, num_experts: int,
                 wire_scheme: Optional[QuantScheme],
                 quants: frozenset[QuantScheme] = frozenset(QuantScheme)):
        super().__init__()
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
        self.first_expert = ctx.rank * self.experts_per_rank
        self.stats: DispatchStats = backend.stats if backend is not None else DispatchStats()
        self.calls = 0
        self._wire_scheme = wire_scheme
        self._quants = quants
        self._quant = QuantSpec()
        self._recv_quant: Optional[ReceiveQuant] = None
        self._nvfp4_swizzle = False
        self._placement_checked = False
        self._call: Optional[_Call] = None

    # -- capabilities ------------------------------------------------------------------------
    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return (mk.FusedMoEActivationFormat.BatchedExperts if self.batched
                else mk.FusedMoEActivationFormat.Standard)

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None if self.backend is None else self.backend.max_num_tokens_per_rank()

    def num_dispatchers(self) -> int:
        return 1 if self.backend is None else self.backend.num_dispatchers()

    def output_is_reduced(self) -> bool:
        return self.strategy in (ReductionStrategy.LOCAL, ReductionStrategy.GATHER_PLUS_ALLREDUCE)

    def supports_async(self) -> bool:
        # vLLM runs the shared expert between finalize_async and its receive hook.
        return self.overlap.overlap and self.backend is not None and self.backend.supports_async()

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        """Check the experts against what the backend delivers; fix the wire quantization; then
        let the backend adapt its wire format to the experts (packed UE8M0 scales for experts
        that ask for them, as vLLM's in-tree DeepEP LL class does)."""
        self._setup_for_experts(fused_experts)
        # Only a quantized wire has a scale format to adapt (experts that take unquantized
        # inputs get bf16 whatever the layer's quant config says).
        if self.backend is not None and self._quant.quantized_on_wire:
            self.backend.post_init_setup(fused_experts)

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
        qc = fused_experts.quant_config
        if fused_experts.expects_unquantized_inputs or qc is None or qc.quant_dtype is None:
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
            rows, quant_config.a1_scale, recv.quant_dtype, recv.per_act_token_quant,
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
        """Our transports place experts in contiguous blocks per EP rank: vLLM's 'linear'."""
        if self._placement_checked:
            return
        n, first = self.experts_per_rank, self.first_expert
        expected = torch.full((self.num_experts,), -1, dtype=torch.int64)
        expected[first:first + n] = torch.arange(n)
        got = None if expert_map is None else expert_map.detach().to("cpu", torch.int64)
        if self.ctx.layout.ep_size > 1 and (got is None or not torch.equal(got, expected)):
            raise ValueError(
                f"EP rank {self.ctx.rank} holds experts {None if got is None else got.tolist()} "
                f"(expert_map), moe-plugins places experts in contiguous blocks "
                f"({first}..{first + n - 1} here); use --expert-placement-strategy linear and no "
                "EPLB with moe-plugins backends"
            )
        self._placement_checked = True

    def _global_ids(self, prep: PrepareResult, ids_dtype: torch.dtype, weights_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """LOCAL ids (-1: elsewhere) -> GLOBAL ids; elsewhere -> an expert this rank does not
        hold, with weight 0."""
        assert prep.topk_ids is not None and prep.topk_weights is not None
        local = prep.topk_ids
        held_elsewhere = (self.first_expert + self.experts_per_rank) % self.num_experts
        ids = torch.where(local >= 0, local + self.first_expert,
                          torch.full_like(local, held_elsewhere)).to(ids_dtype)
        weights = torch.where(local >= 0, prep.topk_weights,
                              torch.zeros_like(prep.topk_weights)).to(weights_dtype)
        return ids, weights

    def _to_vllm(self, prep: PrepareResult, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> mk.PrepareResultType:
        """Our PrepareResult -> vLLM's (x, x_sf, expert_tokens_meta, topk_ids, topk_weights)."""
        meta = None if prep.expert_tokens_meta is None else mk.ExpertTokensMetadata(
            expert_num_tokens=prep.expert_tokens_meta.expert_num_tokens,
            expert_num_tokens_cpu=None)
        if self.batched:
            # x [num_local_experts, max_recv_tokens, hidden]; the experts keep the caller's ids
            return prep.x, prep.x_sf, meta, None, None
        ids, weights = self._global_ids(prep, topk_ids.dtype, topk_weights.dtype)
        return prep.x, prep.x_sf, meta, ids, weights

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
                      defer_input_quant: bool) -> Any:
        """a1 [num_tokens, hidden]; topk_* [num_tokens, num_topk] with GLOBAL ids. Returns
        (hook, receiver) or a receiver; the receiver gives vLLM's 5-tuple (x, x_sf,
        expert_tokens_meta, topk_ids, topk_weights) of the received rows (standard: GLOBAL ids;
        batched: x [num_local_experts, max_recv_tokens, hidden] and no ids/weights)."""
        self._check_placement(expert_map)
        if self._call is not None and self.backend is not None:
            # The last call raised between prepare and finalize; its error already surfaced.
            self.backend.reset_call_state()
            self._call = None
        self.calls += 1
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
        quant = QuantSpec() if defer_input_quant else self._quant
        if self.backend is None:  # no dispatch: quantize the local rows as a receive would
            if self._recv_quant is not None and not defer_input_quant:
                every_row = torch.ones(a1.shape[0], dtype=torch.bool, device=a1.device)
                x, x_sf = self._quantize_received(a1, None, every_row, quant_config)
            else:
                x, x_sf = quantize_for_dispatch(a1, quant)
                if x_sf is not None and quant.scheme is QuantScheme.NVFP4 and self._nvfp4_swizzle:
                    x_sf = swizzle_nvfp4_sf(x_sf)
            return lambda: (x, x_sf, None, None, None)

        layout = self.ctx.layout
        owned = slice_owned(owned_rows(a1.shape[0], layout.tp, self.ctx.tp_rank), a1, topk_ids,
                            topk_weights)
        sent = self.backend.prepare_async_bounded(owned.hidden_states, owned.topk_weights,
                                                  owned.topk_ids, quant,
                                                  max_dispatched_tokens(layout))
        self._call = _Call(owned)

        recv_quant = None if defer_input_quant else self._recv_quant

        def receiver() -> mk.PrepareResultType:
            prep = sent.receiver()
            assert isinstance(prep, PrepareResult)
            x, x_sf, meta, ids, weights = self._to_vllm(prep, topk_ids, topk_weights)
            if recv_quant is not None:
                x, x_sf = self._quantize_received(x, x_sf, self._valid_rows(prep), quant_config)
            elif (x_sf is not None and quant.scheme is QuantScheme.NVFP4 and self._nvfp4_swizzle
                  and not prep.x_sf_swizzled):
                # A backend that returns NVFP4 scales row-aligned: interleave them here, as
                # vLLM's two-sided backend does after its all-to-all (only when present).
                x_sf = swizzle_nvfp4_sf(x_sf)
            return x, x_sf, meta, ids, weights

        return (sent.hook, receiver) if sent.hook is not None else receiver

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_map: Optional[torch.Tensor],
                apply_router_weight_on_input: bool, quant_config: Any,
                defer_input_quant: bool = False) -> mk.PrepareResultType:
        ret = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                 apply_router_weight_on_input, quant_config, defer_input_quant)
        hook, receiver = ret if isinstance(ret, tuple) else (None, ret)
        if hook is not None:
            hook()
        return receiver()

    # -- finalize ------------------------------------------------------------------------------
    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce) -> Any:
        """output [num_tokens, hidden] (written in place); fused_expert_output: the experts'
        output for the received rows (standard: reduced here by ``weight_and_reduce_impl``;
        batched: [num_local_experts, max_recv_tokens, hidden], weighted by the combine)."""
        if isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate) and not self.batched:
            weight_and_reduce_impl = TopKWeightAndReduceContiguous()
        if self.backend is None:
            weight_and_reduce_impl.apply(output=output, fused_expert_output=fused_expert_output,
                                         topk_weights=topk_weights, topk_ids=topk_ids,
                                         apply_router_weight_on_input=apply_router_weight_on_input)
            return lambda: None
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError("finalize called without a matching prepare on this layer")
        backend = self.backend
        try:
            if self.batched:
                expert_out = fused_expert_output
            else:
                expert_out = weight_and_reduce_impl.apply(
                    output=None, fused_expert_output=fused_expert_output,
                    topk_weights=topk_weights, topk_ids=topk_ids,
                    apply_router_weight_on_input=apply_router_weight_on_input)
            if expert_out.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
                expert_out = expert_out.clone()  # vLLM may alias the experts' output to `output`
            rows = call.owned.rows
            target = output[rows.as_slice]
            sent: AsyncResult = backend.finalize_async(expert_out, call.owned.topk_weights,
                                                       call.owned.topk_ids, target)
        except BaseException:
            backend.reset_call_state()
            raise

        def receiver() -> None:
            try:
                check_finalize_result(backend, target, sent.receiver())
            finally:
                backend.reset_call_state()
            if self.strategy is ReductionStrategy.GATHER_PLUS_ALLREDUCE:
                self._all_gather_rows(output, rows.start, rows.stop, rows.chunk)
            elif rows.num_owned != rows.num_tokens:
                output[:rows.start].zero_()
                output[rows.stop:].zero_()

        return (sent.hook, receiver) if sent.hook is not None else receiver

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: mk.TopKWeightAndReduce) -> None:
        ret = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                  apply_router_weight_on_input, weight_and_reduce_impl)
        hook, receiver = ret if isinstance(ret, tuple) else (None, ret)
        if hook is not None:
            hook()
        receiver()

    def _all_gather_rows(self, output: torch.Tensor, start: int, stop: int, chunk: int) -> None:
        """output [num_tokens, hidden] holds this TP rank's rows [start, stop); fill the rest."""
        tp = self.ctx.layout.tp
        padded = output.new_zeros(chunk, output.shape[1])
        padded[: stop - start] = output[start:stop]
        gathered = output.new_empty(chunk * tp, output.shape[1])
        dist.all_gather_into_tensor(gathered, padded, group=self.ctx.tp_group)
        output.copy_(gathered[: output.shape[0]])


def make_prepare_finalize(moe: Any, quant_config: Any, use_monolithic: bool = False
                          ) -> Optional[MoEPluginsPrepareAndFinalize]:
    """Our prepare/finalize for a vLLM MoE layer (FusedMoEConfig ``moe``) whose
    ``--all2all-backend`` is ours; None when EP is off (vLLM's own no-dispatch path then runs)."""
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
    if choice.strategy.dispatches:
        backend = manager.build(spec, ctx, DispatchConfig(
            num_experts=moe.num_experts, hidden=moe.hidden_dim, num_topk=moe.experts_per_token,
            max_tokens_per_rank=max(1, moe.max_num_tokens), dtype=moe.in_dtype,
            quant=QuantSpec(wire_scheme if wire_scheme in spec.quants else QuantScheme.NONE)))
    pf = MoEPluginsPrepareAndFinalize(backend, spec.name, ctx, choice, plan.settings.overlap,
                                      moe.num_experts, wire_scheme, spec.quants)
    key = (spec.name, layout, choice.strategy, plan.settings, wire_scheme)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("moe-plugins vLLM layer: backend=%s layout=%s EP rank %d strategy=%s (%s) "
                    "output_is_reduced=%s shared-expert overlap=%s format=%s quant=%s", spec.name,
                    layout.describe(), ctx.rank, choice.strategy.value, choice.reason,
                    pf.output_is_reduced(), "on" if pf.supports_async() else "off",
                    "batched" if pf.batched else "standard",
                    (wire_scheme or QuantScheme.NONE).value)
    return pf
