"""How MoE layers of one vLLM parallel config run: backend, layout, reduction strategy and
switches (:class:`VllmLayerPlan`), decided once per layer and once for the engine.

Sequence parallelism is a model-level decision vLLM makes from
``ParallelConfig.use_sequence_parallel_moe`` before any layer exists; for our names the hook in
:mod:`moe_plugins.vllm.patches` answers it with :func:`sequence_parallel_moe` (vLLM's rule, the
backend's SP capability, and :func:`moe_plugins.planner.recommend.recommend_strategy` on the
engine config), and each layer then follows what vLLM built
(``FusedMoEParallelConfig.is_sequence_parallel``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional


from moe_plugins.interface import (ActivationFormat)
from moe_plugins.layout import ParallelLayout
from moe_plugins.planner.model_config import ModelSpec, model_spec_from_dict
from moe_plugins.planner.recommend import recommend_strategy
from moe_plugins.quant import QuantScheme
from moe_plugins.registry import AUTO, BackendSpec, select_backend
from moe_plugins.strategy import (ReductionStrategy, StrategyChoice, applicable_strategies,
                                  choose_strategy)
from moe_plugins.vllm.settings import PluginSettings, plugin_settings
from moe_plugins.vllm.names import registry_name

logger = logging.getLogger(__name__)

__all__ = ["VllmLayerPlan", "plan_vllm_layer", "layer_plan", "parallel_config_plan",
           "sequence_parallel_moe"]


_LOGGED: set[tuple] = set()


@dataclass(frozen=True)
class VllmLayerPlan:
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


def plan_vllm_layer(backend: str, layout: ParallelLayout, settings: PluginSettings,
                    require_available: bool = True, *, sequence_parallel: Optional[bool] = None,
                    model: Optional[ModelSpec] = None, num_tokens: Optional[int] = None
                    ) -> VllmLayerPlan:
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
    ``--additional-config`` if any, else
    :func:`moe_plugins.planner.recommend.recommend_strategy` for ``model`` (None: a model whose
    shape moe-plugins cannot read) at ``num_tokens`` tokens per DP group with the settings'
    shared-expert budget, wherever the layout and the backend's capabilities allow SP."""
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
    return VllmLayerPlan(spec, layout, choice, settings)


def _engine_choice(layout: ParallelLayout, caps: Any, settings: PluginSettings,
                   model: Optional[ModelSpec], num_tokens: Optional[int]) -> StrategyChoice:
    """The strategy of the engine-level decision (see :func:`plan_vllm_layer`), no strategy
    named."""
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


def layer_plan(parallel: Any) -> Optional[VllmLayerPlan]:
    """:func:`plan_vllm_layer` for vLLM's FusedMoEParallelConfig ``parallel`` under the current vLLM
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
    return plan_vllm_layer(registry_name(name) or AUTO, layout,
                           plugin_settings(vllm_config.additional_config),
                           sequence_parallel=parallel.is_sequence_parallel)


def parallel_config_plan(parallel_config: Any) -> VllmLayerPlan:
    """:func:`plan_vllm_layer` from vLLM's engine-level ``ParallelConfig`` (EP on), before any layer
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
    return plan_vllm_layer(name, layout, settings, require_available=name == AUTO,
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
