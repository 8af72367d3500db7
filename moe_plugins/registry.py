"""Backend registry: entry-point group ``moe_plugins.backends``, capability matrix, selection.

Backend names are compared here and nowhere else. Each entry point names a :class:`BackendSpec`
(or a zero-argument callable returning one); the built-in backends are registered through the same
entry points in pyproject.toml, so a third-party package adds a backend exactly as we do.

``BACKEND_EP_DP_TP_SUPPORT[name] = (ep_dp, dp, tp, sp)`` and ``BACKEND_SUPPORTED_QUANTS[name]``
are built from the registered specs on first access.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from moe_plugins.interface import ActivationFormat
from moe_plugins.backend_manager import BackendManager, manager_gaps
from moe_plugins.layout import ParallelLayout
from moe_plugins.quant import QuantScheme

if TYPE_CHECKING:
    from moe_plugins.config import DispatchConfig
    from moe_plugins.placement import ExpertPlacement
    from moe_plugins.groups import DistContext
    from moe_plugins.interface import PrepareFinalize

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "moe_plugins.backends"
AUTO = "auto"

__all__ = ["Transport", "Capabilities", "WireLayout", "RequiredPackage", "BackendSpec",
           "CallModes", "TokenLimit", "BackendSelectionError", "ENTRY_POINT_GROUP", "AUTO",
           "registered_backends", "get_backend", "select_backend", "refusal_reason",
           "reload_backends"]


@dataclass(frozen=True)
class Capabilities:
    """ep_dp: dispatches across an EP group of several ranks; dp: dp > 1; tp: tp > 1 together with
    dp > 1 (TP slicing before dispatch); sp: sequence parallel; row_scatter: row-scatter finalize;
    recv_hook: prepare/finalize return a receive hook that really defers the receive;
    placements: dispatches by the layer's :class:`moe_plugins.placement.ExpertPlacement`
    (``DispatchConfig.placement``: round-robin, EPLB's redundant copies); False: linear only;
    micro_batch: two calls of one layer may be in flight at once, each on its own
    prepare/finalize object over the same manager (vLLM's dual-batch overlap: the library
    buffer double-buffers, the per-call state lives in the object); rank_masking: the manager
    can leave EP ranks out (``set_rank_masked``/``masked_ranks``/``clean_buffers``), what an
    engine's fault tolerance polls."""

    ep_dp: bool
    dp: bool
    tp: bool
    sp: bool
    row_scatter: bool = True
    recv_hook: bool = False
    activation_format: ActivationFormat = ActivationFormat.STANDARD
    placements: bool = False
    micro_batch: bool = False
    rank_masking: bool = False


@dataclass(frozen=True)
class WireLayout:
    """What one dispatched row of a layer occupies on a backend's wire (the plan counts with it).

    hidden: columns each row carries (kernels compiled for fixed sizes pad the layer's hidden up
        to one: a low-latency backend sends hidden 256 as 2048); header_bytes: bytes every
        message carries in front of its row (DeepEP/NIXL EP low-latency: 16, the source token
        index); topk_id_bytes: bytes of one expert id where a STANDARD-format row carries its
        routing (int64 ids: 8; flashinfer's int32: 4), next to a float32 weight each."""

    hidden: int
    header_bytes: int = 0
    topk_id_bytes: int = 8


@dataclass(frozen=True)
class TokenLimit:
    """The most tokens per rank a backend's layer can be built for (``tokens``) and what sets
    that limit (``reason``, with the fix), as its manager would refuse more."""

    tokens: int
    reason: str


@dataclass(frozen=True)
class RequiredPackage:
    """An import the backend needs and how to install it.

    module: the import name; install: the instruction a user follows (a pip command, or how to
    build it); extra: the optional dependency of moe-plugins (``pyproject.toml``) that installs
    it, "" when none does (DeepEP: built from source)."""

    module: str
    install: str
    extra: str = ""
    #: Where a package has API lines that differ (DeepEP), what the installed one is, probed
    #: from the imported module: (what was found, in words; why it cannot serve, or None).
    describe: Optional[Callable[[ModuleType], tuple[str, Optional[str]]]] = None

    def missing(self) -> str | None:
        try:
            found = importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"package '{self.module}' not installed ({self.install})"

    def found(self) -> tuple[Optional[str], Optional[str]]:
        """(what is installed, in words, or None where the package does not say; why it cannot
        serve, or None). Imports the package where it has :attr:`describe`; a package that
        fails to import is unusable with that error."""
        if self.describe is None or self.missing() is not None:
            return None, None
        try:
            module = importlib.import_module(self.module)
        except Exception as e:  # a vendor package may check its environment at import
            return None, (f"package '{self.module}' failed to import ({type(e).__name__}: {e}); "
                          f"{self.install}")
        return self.describe(module)


class Transport(Enum):
    """How a backend's all-to-alls move data, which sets how the planner times them
    (:mod:`moe_plugins.planner.transport_time`).

    LOW_LATENCY: GPU-initiated messages, one per (token, expert) pair, over RDMA (IBGDA) and,
        where allowed, NVLink (DeepEP's low-latency mode, NIXL EP).
    NORMAL: DeepEP's normal mode: one row per (token, destination node) over RDMA, forwarded
        over NVLink to the ranks of the node; a set number of SMs copies.
    NVLINK_TWO_SIDED: one row per (token, rank) inside one NVLink domain (FlashInfer).
    NVLINK_ONE_SIDED: one row per (token, rank), written by the sender straight into the
        receiver's buffer, inside one NVLink domain (FlashInfer / TensorRT-LLM).
    NCCL: ``all_to_all_v`` over the process group (NCCL on GPUs): a count exchange, then rows.
    """

    LOW_LATENCY = "low_latency"
    NORMAL = "normal"
    NVLINK_TWO_SIDED = "nvlink_two_sided"
    NVLINK_ONE_SIDED = "nvlink_one_sided"
    NCCL = "nccl"


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend: what an entry point of the group ``moe_plugins.backends`` names.

    Arguments (the fields):
        name: the backend's name (``moe-plugins list``; under vLLM ``moe_plugins_<name>``); its
            modules are ``prepare_finalize/<name>.py`` and ``all2all/<name>.py``.
        prepare_finalize: called ``prepare_finalize(manager, cfg)`` per layer: the
            :class:`moe_plugins.interface.PrepareFinalize` that moves the tokens (it keeps
            ``cfg`` as its ``cfg``; :meth:`prepare_finalize_on` checks it).
        manager: the class called ``manager(ctx, cfg)`` (:class:`moe_plugins.groups.DistContext`,
            :class:`moe_plugins.config.DispatchConfig`) that owns the library's buffers; it keeps
            :class:`moe_plugins.backend_manager.BackendManager` (a spec whose manager does not is
            skipped at loading, with a WARNING). Its constructor raises ImportError naming the
            extra when a required package is missing.
        capabilities: what the backend serves (:class:`Capabilities`: EP over DP, TP, SP,
            row-scatter finalize, placements, micro-batches, rank masking, activation format).
        quants: the activation formats it carries (:class:`moe_plugins.quant.QuantScheme`).
        required, needs_cuda: the packages it imports and whether it needs a CUDA GPU.
        description, use_for, distribution, priority: its row of ``moe-plugins list`` and the
            order ``--backend auto`` tries (higher first).
        dtypes, ep_sizes, token_limit, wire_layout: the kernels' limits (activation dtypes, EP
            group sizes, tokens per rank for an EP size, the row it puts on the wire); None: no
            limit.
        transport, call_modes: how its all-to-alls move data (the planner's time model).
    """

    name: str
    prepare_finalize: Callable[..., "PrepareFinalize"]
    manager: type[BackendManager]
    capabilities: Capabilities
    quants: frozenset[QuantScheme]
    required: tuple[RequiredPackage, ...] = ()
    needs_cuda: bool = False
    description: str = ""
    # when a user picks this backend, in a few words (`moe-plugins list --markdown`)
    use_for: str = ""
    distribution: str = ""
    # auto-selection tries higher priority first (specialised GPU kernels before the reference)
    priority: int = 0
    # activation dtypes the kernels take; None: any
    dtypes: Optional[frozenset[torch.dtype]] = None
    # EP group sizes the kernels run on (with EP on); None: any
    ep_sizes: Optional[frozenset[int]] = None
    # how the all-to-alls move data (the planner's time model)
    transport: Transport = Transport.NCCL
    # a backend that picks its transport per call (deepep_auto): the two backends whose wire
    # rows and transport its calls have; None: one transport, ``transport``
    call_modes: Optional["CallModes"] = None
    # the most tokens per rank a layer over this many EP ranks can be built for, from the
    # manager's own check (e.g. DeepEP's NVSHMEM QP depth); None: no limit but memory
    token_limit: Optional[Callable[[int], Optional[TokenLimit]]] = None

    # The backend's own check of a layer config, raising what building it would raise (dtype,
    # hidden, topk limits), and the row its kernels put on the wire; needs no process group.
    # None: rows carry the layer's hidden and no header.
    wire_layout: Optional[Callable[["DispatchConfig"], WireLayout]] = None

    def wire_layout_for(self, cfg: "DispatchConfig") -> WireLayout:
        """:attr:`wire_layout` of ``cfg``, or the layer's own hidden without a header."""
        return self.wire_layout(cfg) if self.wire_layout is not None else WireLayout(cfg.hidden)

    def unavailable_reason(self) -> str | None:
        """None when the backend can be built on this machine, else exactly why not."""
        reasons = [r for r in (p.missing() or p.found()[1] for p in self.required) if r]
        if self.needs_cuda and not torch.cuda.is_available():
            reasons.append("needs a CUDA GPU, none visible")
        return "; ".join(reasons) or None

    @property
    def ep_dp_tp_support(self) -> tuple[bool, bool, bool, bool]:
        c = self.capabilities
        return (c.ep_dp, c.dp, c.tp, c.sp)

    def build(self, ctx: "DistContext", cfg: "DispatchConfig") -> "PrepareFinalize":
        """Create the manager and the prepare/finalize for one layer."""
        return self.prepare_finalize_on(self.manager(ctx, cfg), cfg)

    def prepare_finalize_on(self, manager: BackendManager, cfg: "DispatchConfig"
                            ) -> "PrepareFinalize":
        """``prepare_finalize(manager, cfg)``, checked to keep ``cfg`` as its ``cfg`` (the
        engines read the layer's shape there: :attr:`moe_plugins.interface.PrepareFinalize.cfg`).
        Raises TypeError naming the class that does not."""
        pf = self.prepare_finalize(manager, cfg)
        if getattr(pf, "cfg", None) is not cfg:
            raise TypeError(
                f"backend {self.name!r}: {type(pf).__name__} does not keep the layer config it "
                "was built with as .cfg (moe_plugins.interface.PrepareFinalize.cfg); set "
                "self.cfg = cfg in its __init__")
        return pf


@dataclass(frozen=True)
class CallModes:
    """The two modes of a backend that picks its transport per call (``deepep_auto``): a call
    moves what ``low_latency`` would (one message per (token, expert) pair) while the busiest
    rank's rows are at most the layer's threshold, what ``normal`` would above it.
    ``capacity``: the low-latency rows per rank `moe-plugins plan` assumes the layer is built
    for (the threshold is the time model's crossover, at most this)."""

    low_latency: BackendSpec
    normal: BackendSpec
    capacity: int


class BackendSelectionError(ValueError):
    """No backend fits; the message lists every backend and what is missing for each."""


def _load_entry_points() -> dict[str, BackendSpec]:
    specs: dict[str, BackendSpec] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist_name = ep.dist.name if ep.dist is not None else "?"
        try:
            obj = ep.load()
            spec = obj() if callable(obj) and not isinstance(obj, BackendSpec) else obj
        except Exception as e:  # a broken third-party backend must not break the others
            logger.warning("backend entry point %r from %s failed to load: %s: %s",
                           ep.name, dist_name, type(e).__name__, e)
            continue
        if not isinstance(spec, BackendSpec):
            logger.warning("backend entry point %r from %s gave %s, expected a BackendSpec; skipped",
                           ep.name, dist_name, type(spec).__name__)
            continue
        if spec.name != ep.name:
            logger.warning("backend entry point %r from %s names spec %r; the entry point name "
                           "must equal BackendSpec.name; skipped", ep.name, dist_name, spec.name)
            continue
        gaps = manager_gaps(spec.manager)
        if gaps:
            logger.warning("backend %r from %s: its manager %r lacks %s of "
                           "moe_plugins.backend_manager.BackendManager; subclass BackendManager to take "
                           "its defaults, or define them; skipped", spec.name, dist_name,
                           spec.manager, ", ".join(gaps))
            continue
        if spec.name == AUTO or spec.name in specs:
            logger.warning("backend %r from %s is already registered by %s (or reserved); skipped",
                           spec.name, dist_name, specs[spec.name].distribution
                           if spec.name in specs else "moe-plugins")
            continue
        specs[spec.name] = BackendSpec(**{**spec.__dict__, "distribution": dist_name})
    return specs


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, BackendSpec]:
    specs = _load_entry_points()
    if not specs:
        raise RuntimeError(
            f"no backends are registered in the entry-point group '{ENTRY_POINT_GROUP}': "
            "moe-plugins is not installed as a distribution; run `pip install -e .` in its checkout"
        )
    return specs


def reload_backends() -> None:
    """Forget the loaded entry points (after installing a package that registers a backend)."""
    _registry.cache_clear()


def registered_backends() -> dict[str, BackendSpec]:
    return dict(_registry())


def get_backend(name: str) -> BackendSpec:
    specs = _registry()
    if name not in specs:
        raise ValueError(f"unknown moe-plugins backend {name!r}; registered: {sorted(specs)} "
                         f"(or {AUTO!r} to pick by layout)")
    return specs[name]


def refusal_reason(spec: BackendSpec, layout: ParallelLayout, quant: QuantScheme,
                   require_available: bool = True, dtype: Optional[torch.dtype] = None,
                   placement: Optional["ExpertPlacement"] = None) -> str | None:
    """Why ``spec`` cannot serve ``layout`` with ``quant`` (activation ``dtype``, expert
    ``placement``: None is linear), or None."""
    c, why = spec.capabilities, []
    if placement is not None and not placement.is_linear and not c.placements:
        why.append(f"expert placement {placement.describe()} (the backend dispatches contiguous "
                   "expert blocks only)")
    if dtype is not None and spec.dtypes is not None and dtype not in spec.dtypes:
        why.append(f"activations {dtype} not in {sorted(str(d) for d in spec.dtypes)}")
    if layout.ep and layout.world_size > 1 and layout.dp > 1:
        if not c.ep_dp:
            why.append("no EP dispatch")
        if not c.dp:
            why.append(f"no DP (dp={layout.dp})")
        if layout.tp > 1 and not c.tp:
            why.append(f"no TP inside the EP group (tp={layout.tp})")
    if layout.ep and spec.ep_sizes is not None and layout.ep_size not in spec.ep_sizes:
        why.append(f"EP size {layout.ep_size} not in {sorted(spec.ep_sizes)}")
    if quant not in spec.quants:
        why.append(f"quant {quant.value} not in {sorted(q.value for q in spec.quants)}")
    if require_available:
        missing = spec.unavailable_reason()
        if missing:
            why.append(missing)
    return "; ".join(why) or None


def select_backend(layout: ParallelLayout, quant: QuantScheme = QuantScheme.NONE,
                   name: str = AUTO, require_available: bool = True,
                   dtype: Optional[torch.dtype] = None) -> BackendSpec:
    """The backend for this layout, quant and activation dtype: ``name`` itself (checked), or
    with ``auto`` the registered backend of highest priority that fits (ties by name). Raises
    :class:`BackendSelectionError` listing why each backend was refused."""
    specs = _registry()
    candidates = (sorted(specs.values(), key=lambda s: (-s.priority, s.name)) if name == AUTO
                  else [get_backend(name)])
    refusals = {}
    for spec in candidates:
        why = refusal_reason(spec, layout, quant, require_available, dtype)
        if why is None:
            return spec
        refusals[spec.name] = why
    fits = [s.name for s in specs.values()
            if refusal_reason(s, layout, quant, require_available, dtype) is None]
    lines = "\n".join(f"  - {n}: {w}" for n, w in refusals.items())
    raise BackendSelectionError(
        f"backend {name!r} cannot serve layout {layout.describe()} with quant {quant.value}:\n"
        f"{lines}\nbackends that would: {fits or 'none'}; change the layout or quant, or install "
        "what is missing"
    )


def __getattr__(attr: str) -> Any:
    # Built from the registry on access, so importing moe_plugins loads no entry point.
    if attr == "BACKEND_EP_DP_TP_SUPPORT":
        return {n: s.ep_dp_tp_support for n, s in _registry().items()}
    if attr == "BACKEND_SUPPORTED_QUANTS":
        return {n: s.quants for n, s in _registry().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
