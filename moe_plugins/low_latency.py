"""Low-latency (batched, per-expert) dispatch/combine shared by DeepEP LL and NIXL EP.

DeepEP's V1 ``Buffer.low_latency_dispatch/low_latency_combine`` and ``nixl_ep.Buffer.dispatch/
combine`` have one API shape: dispatch sends every (token, expert) pair to the rank holding the
expert and returns a packed receive layout ``[num_local_experts, num_max_dispatch_tokens_per_rank
* num_ranks, hidden]`` with a receive count per local expert; combine sends each expert output
back and reduces it **with the router weights** into ``out``. So the logic lives here once:

- :class:`LowLatencyManager`: validation of the layer against the kernels' limits, the buffer
  (one per EP group and size, cached, destroyed explicitly), the library calls, rank masking.
  A backend's manager only names its package, its method names and how its buffer is built.
- :class:`LowLatencyPrepareFinalize`: prepare (dispatch) and finalize (combine with ``out=``,
  row-scatter variant), per-call handle reset in ``finally``. The async calls use
  ``return_recv_hook`` (send now, receive in the hook: two kernel launches); the synchronous
  ``prepare``/``finalize`` make the blocking call (one launch of both phases). Where the
  library's release is known (:class:`RuntimeCalls`), they call its C++ runtime themselves,
  without its Python wrapper, and leave to the runtime's host asserts what those check.

Hidden-size rule. The kernels are compiled for :data:`KERNEL_HIDDEN_SIZES` only. A layer whose
hidden size is one of them runs as is. A smaller one runs **padded to the next kernel size**
when ``pad_hidden`` is on (the default): prepare copies the tokens into zero-padded rows before
the dispatch and hands the experts views of the first ``hidden`` columns; finalize pads the
expert outputs the same way and copies the first ``hidden`` columns of the combined rows out.
Zero columns change no real column (combine is a per-column weighted sum); the cost is one
copy each way and ``kernel_hidden - hidden`` more columns on the wire, logged once at INFO.
Build the layer with :func:`round_up_hidden_size` (as vLLM rounds its layer up) to avoid it.
With ``pad_hidden=False`` an unsupported size is a ValueError; above 8192 it always is.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.counters import DispatchStats
from moe_plugins.faults import group_faults
from moe_plugins.groups import DistContext
from moe_plugins.interface import (ActivationFormat, AsyncResult, ExpertTokensMeta, Hook,
                                   PrepareFinalize, PrepareResult, RowScatterTarget,
                                   check_finalize_routing,
                                   check_prepare_inputs, row_scatter_add)
from moe_plugins.quant import FP8_BLOCK, QuantScheme, QuantSpec
from moe_plugins.registry import BackendSpec, Capabilities, RequiredPackage, WireLayout

logger = logging.getLogger(__name__)

__all__ = [
    "KERNEL_HIDDEN_SIZES", "MAX_TOPK", "LowLatencyOptions", "round_up_hidden_size",
    "kernel_hidden_size", "token_capacity", "unpack_ue8m0_scales", "dequantize_batched",
    "LowLatencyManager", "RuntimeCalls", "WRAPPER_PARAMETERS", "wrappers_match",
    "LowLatencyPrepareFinalize", "low_latency_spec", "destroy_all_buffers", "buffer_cache",
    "import_vendor", "check_kernel_layer", "assert_expert_ids", "expert_id_error",
]

#: Hidden sizes the low-latency kernels are compiled for (DeepEP V1 and nixl_ep SWITCH_HIDDEN).
KERNEL_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: Largest top-k of the dispatch kernel (``kNumMaxTopK`` in both libraries).
MAX_TOPK = 11
#: Each dispatched pair carries a 16-byte header (the source token index) in front of its row.
_MSG_HEADER_BYTES = 16
_UE8M0_PACK = 4  # UE8M0 scales are packed four to an int32: one int32 per 512 columns
_QUANTS = frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK128})


@dataclass(frozen=True)
class LowLatencyOptions:
    """Settings both low-latency backends share (each backend's options class extends this).

    allow_nvlink: let the kernels move data over NVLink between GPUs of one node (default on;
        DeepEP ``allow_nvlink_for_low_latency_mode``, NIXL EP ``not disable_ll_nvlink``).
        DeepEP warns that NVLink is "somehow incompatible with the hook-based overlapping": for
        an NVLink peer the *send* half of a hook-mode dispatch/combine copies the rows itself
        with SM stores into the peer's memory (for an RDMA peer it only posts the writes), so
        less of the transfer is left for the shared expert to overlap with. NVLink wins by
        default: it changes no result on NVLink-connected GPUs (DeepEP warns PCIe peers may hit
        memory-ordering errors), it is the only transport on a node without RDMA NICs (a single
        H200), and hook mode stays on either way (the shared expert is still launched between
        the send and the receive). Turn it off on RDMA-equipped nodes to keep the whole
        transfer inside the hook window.
    pad_hidden: pad an unsupported hidden size up to the next kernel size (see module doc);
        False makes it a ValueError at construction.
    check_expert_ids: check in prepare that every expert id is in [-1, num_experts) (the
        kernels do not: an id out of range makes them write outside their buffers). No host
        sync. None (the default): on for CPU tensors (a ValueError at once), off on CUDA,
        where it costs four small kernels per call: on the H200 they added ~7 us to a
        deepep_ll round trip under CUDA-graph replay (1.26x the raw library at 8 tokens, where
        vLLM's in-tree class checks nothing) and more eager (benchmarks/README.md). True turns
        it on on CUDA too: a device-side assert, shown at the next sync and, as every CUDA
        device assert, ending the process's CUDA context. Routers (vLLM's, ours) only produce
        ids in range; turn it on when debugging one that may not.
    """

    allow_nvlink: bool = True
    pad_hidden: bool = True
    check_expert_ids: Optional[bool] = None


def check_kernel_layer(cfg: DispatchConfig, backend: str, bf16_why: str, max_topk: int,
                       quants: frozenset[QuantScheme]) -> None:
    """The layer checks DeepEP-style kernels share (ValueError with the fix): bfloat16
    activations (``bf16_why`` says which kernel needs them), top-k within the dispatch kernel's
    limit, a quant scheme the kernels move."""
    if cfg.dtype != torch.bfloat16:
        raise ValueError(f"{backend}: {bf16_why}, the layer is {cfg.dtype}; build the layer in "
                         "torch.bfloat16 or use another backend (e.g. 'torch')")
    if cfg.num_topk > max_topk:
        raise ValueError(f"{backend}: num_topk={cfg.num_topk} exceeds the dispatch kernel's limit "
                         f"of {max_topk} experts per token; use another backend (e.g. 'torch')")
    if cfg.quant.scheme not in quants:
        raise ValueError(f"{backend}: quant scheme {cfg.quant.scheme.value} is not supported; "
                         f"supported: {sorted(q.value for q in quants)}")


def round_up_hidden_size(hidden: int) -> int:
    """The smallest kernel hidden size >= ``hidden`` (build a layer with it to avoid padding)."""
    for size in KERNEL_HIDDEN_SIZES:
        if size >= hidden:
            return size
    raise ValueError(
        f"hidden={hidden} is larger than the largest hidden size the low-latency kernels support "
        f"({KERNEL_HIDDEN_SIZES[-1]}); supported: {list(KERNEL_HIDDEN_SIZES)}; use another "
        "backend (e.g. 'torch') for this layer"
    )


def kernel_hidden_size(hidden: int, pad_hidden: bool, backend: str) -> int:
    """The hidden size the kernels run for a layer of ``hidden`` (the module doc's rule)."""
    if hidden in KERNEL_HIDDEN_SIZES:
        return hidden
    padded = round_up_hidden_size(hidden)
    if not pad_hidden:
        raise ValueError(
            f"{backend}: hidden={hidden} is not a size the kernels are compiled for "
            f"({list(KERNEL_HIDDEN_SIZES)}); build the layer with hidden={padded} "
            f"(moe_plugins.low_latency.round_up_hidden_size), or set pad_hidden=True in the "
            "backend options to pad the activations inside prepare/finalize"
        )
    return padded


def token_capacity(max_tokens_per_rank: int, num_ranks: int) -> int:
    """Smallest capacity >= ``max_tokens_per_rank`` with ``num_ranks * capacity`` a multiple of 4
    (the kernels' TMA needs the packed token dimension, ranks x capacity, to be a multiple of 4).
    Pass ``num_ranks=1`` when the number of ranks in the layout can change (NIXL EP's active rank
    bound): the capacity itself is then a multiple of 4."""
    step = 4 // math.gcd(num_ranks, 4)
    return -(-max_tokens_per_rank // step) * step


def unpack_ue8m0_scales(packed: torch.Tensor) -> torch.Tensor:
    """Packed UE8M0 scales -> float32 scales.

    packed: int32 [..., hidden // 512], four biased 8-bit exponents per int32, lowest byte first
    (the layout DeepEP/NIXL EP return with ``use_ue8m0=True``). Returns float32
    [..., hidden // 128] holding ``2 ** (e - 127)``.
    """
    if packed.dtype != torch.int32:
        raise TypeError(f"packed UE8M0 scales must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 8, device=packed.device, dtype=torch.int32)
    exps = (packed.unsqueeze(-1) >> shifts) & 0xFF  # [..., hidden // 512, 4]
    return torch.exp2(exps.flatten(-2).float() - 127.0)


def dequantize_batched(x: torch.Tensor, x_sf: Optional[torch.Tensor]) -> torch.Tensor:
    """The values a low-latency dispatch delivered, for experts (and tests) that compute in
    float: x float8_e4m3fn/bf16 [num_local_experts, slots, hidden]; x_sf None, float32
    block-128 scales [..., hidden // 128] or packed UE8M0 int32 [..., hidden // 512] ->
    float32 [num_local_experts, slots, hidden]."""
    if x_sf is None:
        return x.float()
    scales = unpack_ue8m0_scales(x_sf) if x_sf.dtype == torch.int32 else x_sf.float()
    return x.float() * scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., : x.shape[-1]]


def expert_id_error(num_experts: int, backend: str) -> str:
    """The message of :func:`assert_expert_ids` (built once per layer, not per call)."""
    return (f"{backend}: topk_ids hold expert ids outside [-1, {num_experts}) (-1: no expert); "
            f"route over the layer's {num_experts} experts")


def assert_expert_ids(ids: torch.Tensor, num_experts: int, msg: str) -> None:
    """ids int [num_tokens, num_topk] must lie in [-1, num_experts); see
    ``LowLatencyOptions.check_expert_ids`` (no host sync). CPU: one min/max reduction read on
    the host. CUDA: clamped to the range, the ids are unchanged exactly when all lie in it, so
    four small kernels (clamp, in-place compare, all, the device-side assert) instead of the
    five of a min/max reduction compared twice."""
    if ids.is_cpu:  # the values are on the host already
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < -1 or int(hi) >= num_experts:
                raise ValueError(msg)
        return
    torch._assert_async(ids.clamp(-1, num_experts - 1).eq_(ids).all(), msg)


def first_method(obj: Any, names: tuple[str, ...]) -> Callable[..., Any]:
    """The bound method of ``obj`` named by the first of ``names`` it has (AttributeError
    naming them all when it has none)."""
    for name in names:
        method = getattr(obj, name, None)
        if method is not None:
            return method
    raise AttributeError(f"{type(obj).__name__} has none of the methods {', '.join(names)}")


def import_vendor(required: RequiredPackage, backend: str) -> ModuleType:
    """Import a backend's vendor package; ImportError naming the install step when missing."""
    try:
        return importlib.import_module(required.module)
    except ImportError as e:
        raise ImportError(
            f"backend {backend!r} needs the '{required.module}' package, which is not "
            f"importable ({type(e).__name__}: {e}); {required.install}"
        ) from e


@dataclass(frozen=True)
class RuntimeCalls:
    """A library's C++ runtime methods that take the low-latency calls directly, bypassing its
    Python wrapper (:mod:`all2all.deepep`'s module doc says why), with the positional
    signatures of DeepEP 567632d's ``deep_ep_cpp.Buffer`` (csrc/deep_ep.cpp). Both are unbound,
    called with ``buffer.runtime`` read on each call (a destroyed buffer has none, and the call
    raises):

    - ``dispatch(runtime, x, topk_idx, cumulative_local_expert_recv_stats,
      dispatch_wait_recv_cost_stats, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
      round_scale, use_ue8m0, async, return_recv_hook)`` -> (recv_x, recv_x_scales or None,
      recv_count, src_info, layout_range, event, hook);
    - ``combine(runtime, x, topk_idx, topk_weights, src_info, layout_range,
      combine_wait_recv_cost_stats, num_max_dispatch_tokens_per_rank, num_experts, use_logfmt,
      zero_copy, async, return_recv_hook, out)`` -> (combined_x, event, hook).

    Their first statements are host asserts (``EP_HOST_ASSERT``, a RuntimeError through
    pybind11) that nothing has been launched or changed before: x bfloat16, 2-D (dispatch) or
    3-D (combine) and contiguous; topk_idx 2-D, contiguous, in ``topk_idx_t``; the dispatch's
    tokens within ``num_max_dispatch_tokens_per_rank``; topk_weights float32, 2-D and
    contiguous. :class:`LowLatencyPrepareFinalize` leaves exactly those checks to them: where
    one refuses a call, it names the fault (or copies a non-contiguous input) and calls again.
    """

    dispatch: Callable[..., tuple]
    combine: Callable[..., tuple]


#: The parameters of the low-latency Python methods of DeepEP 567632d's ``deep_ep.Buffer`` and
#: of nixl_ep v1.4.0 / 1.5.1's ``nixl_ep.Buffer`` (nixl_ep forked DeepEP's; ``self`` first),
#: whose bodies are one runtime call each (all2all/deepep.py, all2all/nixl_ep.py).
WRAPPER_PARAMETERS: dict[str, tuple[str, ...]] = {
    "low_latency_dispatch": (
        "self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
        "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
        "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"),
    "low_latency_combine": (
        "self", "x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy",
        "async_finish", "return_recv_hook", "out", "combine_wait_recv_cost_stats"),
}
_WRAPPERS_LOGGED: set[type] = set()


def wrappers_match(buffer: Any, runtime_methods: tuple[str, ...], backend: str,
                   release: str) -> bool:
    """Whether ``buffer``'s low-latency Python methods have :data:`WRAPPER_PARAMETERS`, those
    of ``release``, whose bodies are known to be one call each of ``buffer.runtime``'s
    ``runtime_methods``: then the runtime can take the calls directly (:class:`RuntimeCalls`).
    Otherwise INFO once per buffer class."""
    cls = type(buffer)
    try:
        known = all(tuple(inspect.signature(getattr(cls, name)).parameters) == params
                    for name, params in WRAPPER_PARAMETERS.items())
    except (AttributeError, TypeError, ValueError):
        known = False
    known = known and all(callable(getattr(getattr(buffer, "runtime", None), name, None))
                          for name in runtime_methods)
    if not known and cls not in _WRAPPERS_LOGGED:
        _WRAPPERS_LOGGED.add(cls)
        logger.info("%s: %s.%s's low-latency methods are not those of %s; calling them instead "
                    "of its C++ runtime", backend, cls.__module__, cls.__name__, release)
    return known


class _BufferCache:
    """Library buffers shared by the managers of one EP group and size (a model's MoE layers all
    share one), reference-counted; the last :meth:`release` destroys the buffer."""

    def __init__(self) -> None:
        self._entries: dict[tuple, list[Any]] = {}  # key -> [buffer, refs, destroy]

    def acquire(self, key: tuple, create: Callable[[], Any], destroy: Callable[[Any], None]) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = [create(), 0, destroy]
        entry[1] += 1
        return entry[0]

    def release(self, key: tuple) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._entries[key]
            entry[2](entry[0])

    def clear(self) -> None:
        entries, self._entries = list(self._entries.values()), {}
        for buffer, _, destroy in entries:
            destroy(buffer)


_BUFFERS = _BufferCache()
_PADDING_LOGGED: set[tuple] = set()


def buffer_cache() -> _BufferCache:
    """The process's reference-counted cache of vendor buffers (``acquire(key, create, destroy)``
    / ``release(key)``); every DeepEP and NIXL EP manager keeps its buffer here, so
    :func:`destroy_all_buffers` frees them all."""
    return _BUFFERS


def destroy_all_buffers() -> None:
    """Destroy every cached low-latency buffer of this process (engine teardown, tests). The
    managers that used them must not be used afterwards."""
    _BUFFERS.clear()


class LowLatencyManager(ABC):
    """Buffer, kernel limits and library calls of one low-latency backend for one layer config.

    Subclasses set the class attributes (package, options type, the library's method names)
    and implement :meth:`_size_hint`, :meth:`_create_buffer` and :meth:`_destroy_buffer`
    (plus :meth:`_check_limits` / :meth:`_check_can_mask` for library-specific limits).
    Construction order: options and layer checks (no collective), the vendor import (ImportError
    naming the extra), the EP group's sizes, then the shared buffer (collective on creation).

    Attributes after construction: ``num_ranks``/``rank`` (EP group), ``num_experts``,
    ``num_local_experts``, ``hidden`` (the layer's), ``kernel_hidden`` (what the kernels run),
    ``max_tokens_per_rank`` (the token capacity every rank passes to dispatch), ``buffer``.
    """

    backend_name: ClassVar[str]
    required: ClassVar[RequiredPackage]
    options_type: ClassVar[type[LowLatencyOptions]]
    #: The buffer's dispatch / combine method names, preferred first: the first the buffer has
    #: is bound (a release's alias that forwards to another name costs a frame per call).
    dispatch_methods: ClassVar[tuple[str, ...]]  # e.g. ("low_latency_dispatch",)
    combine_methods: ClassVar[tuple[str, ...]]
    update_mask_method: ClassVar[str]  # (rank, mask: bool) -> None
    query_mask_method: ClassVar[str]  # (int32 [num_ranks] tensor) -> None
    clean_mask_method: ClassVar[str]  # () -> None: every rank the buffer reaches unmasked
    #: The library masks peers by itself (a timed-out peer), so an engine should always poll.
    masks_by_itself: ClassVar[bool] = False
    #: The runtime calls a prepare/finalize makes itself instead of :meth:`dispatch` /
    #: :meth:`combine` (set by a manager whose library's runtime has them; None: those methods).
    runtime_calls: Optional[RuntimeCalls] = None

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        self.options = self._options(cfg.backend_options)
        self.kernel_hidden = self.wire_layout(cfg).hidden
        self.lib = import_vendor(self.required, self.backend_name)
        self.topk_idx_dtype: torch.dtype = getattr(self.lib, "topk_idx_t", torch.int64)
        self.ctx, self.cfg = ctx, cfg
        self.group = ctx.ep_group
        self.num_ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # The kernels place physical expert p on rank p // num_local_experts: the placement's
        # physical ids are what they dispatch.
        self.placement = cfg.placement_for(self.num_ranks)
        self.num_experts = self.placement.num_physical
        self.num_local_experts = self.placement.num_local
        self.hidden = cfg.hidden
        self.max_tokens_per_rank = token_capacity(cfg.max_tokens_per_rank,
                                                  self._layout_ranks_multiple())
        self._check_limits()
        # Plain option values (switches) separate buffers; objects such as a store do not.
        switches = tuple((f.name, v) for f in dataclasses.fields(self.options)
                         if isinstance(v := getattr(self.options, f.name), (bool, int, str))
                         and f.name != "pad_hidden")
        key = (self.backend_name, id(self.group), self.rank, self.num_ranks, self.kernel_hidden,
               self.max_tokens_per_rank, self.num_experts, switches)
        self.buffer = _BUFFERS.acquire(key, self._create_logged, self._destroy_buffer)
        self._key: Optional[tuple] = key
        # Bound once: a getattr by name per call is host time on every dispatch and combine.
        self._dispatch_call = first_method(self.buffer, self.dispatch_methods)
        self._combine_call = first_method(self.buffer, self.combine_methods)
        if self.padded and key not in _PADDING_LOGGED:
            _PADDING_LOGGED.add(key)
            logger.info("%s: hidden %d is not a kernel size; activations are zero-padded to %d "
                        "inside prepare/finalize (build the layer with hidden=%d to avoid the "
                        "copies)", self.backend_name, self.hidden, self.kernel_hidden,
                        self.kernel_hidden)

    def _create_logged(self) -> Any:
        buffer = self._create_buffer()
        logger.info("%s: buffer for EP rank %d/%d, %d local experts, kernel hidden %d, %d tokens "
                    "per rank, %d RDMA bytes, NVLink %s", self.backend_name, self.rank,
                    self.num_ranks, self.num_local_experts, self.kernel_hidden,
                    self.max_tokens_per_rank, self.num_rdma_bytes,
                    "on" if self.options.allow_nvlink else "off")
        return buffer

    @classmethod
    def engine_options(cls, tcp_store: Any, fault_tolerance: bool = False
                       ) -> Optional[LowLatencyOptions]:
        """The ``backend_options`` an engine (the vLLM glue) builds this backend with when the
        user gave none; ``tcp_store``: a torch.distributed Store shared by the EP group, for
        libraries that exchange connection metadata through one; ``fault_tolerance``: the
        engine will poll the rank mask (:meth:`masked_ranks`), so the buffer must have one.
        None: the defaults."""
        return None

    # -- configuration ---------------------------------------------------------------------
    @classmethod
    def wire_layout(cls, cfg: DispatchConfig) -> WireLayout:
        """Check the layer against the kernels' limits (the errors building a manager raises,
        without a process group) and return what one dispatched message carries: the kernel
        hidden size and the 16-byte header (``BackendSpec.wire_layout``, read by the plan)."""
        options = cls._options(cfg.backend_options)
        cls._check_layer(cfg)
        return WireLayout(kernel_hidden_size(cfg.hidden, options.pad_hidden, cls.backend_name),
                          _MSG_HEADER_BYTES)

    @classmethod
    def _options(cls, given: object) -> LowLatencyOptions:
        if given is None:
            return cls.options_type()
        if not isinstance(given, cls.options_type):
            raise TypeError(
                f"{cls.backend_name}: backend_options must be a {cls.options_type.__name__}, got "
                f"{type(given).__name__}; pass DispatchConfig(backend_options="
                f"{cls.options_type.__name__}(...))"
            )
        return given

    @classmethod
    def _check_layer(cls, cfg: DispatchConfig) -> None:
        check_kernel_layer(cfg, cls.backend_name, "the low-latency kernels move bfloat16 "
                           "activations", MAX_TOPK, _QUANTS)

    def _check_limits(self) -> None:
        """Library-specific limits on the computed sizes (raise ValueError with the fix)."""

    def _layout_ranks_multiple(self) -> int:
        """What the rank count of the receive layout is always a multiple of (for the token
        capacity rounding): the EP size where the layout always spans every rank."""
        return self.num_ranks

    @property
    def padded(self) -> bool:
        return self.kernel_hidden != self.hidden

    @property
    def num_rdma_bytes(self) -> int:
        """The library's size hint for this layer's (tokens, kernel hidden, ranks, experts)."""
        return self._size_hint(self.max_tokens_per_rank, self.kernel_hidden, self.num_ranks,
                               self.num_experts)

    @abstractmethod
    def _size_hint(self, max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        """The library's RDMA buffer size hint, in bytes."""

    @abstractmethod
    def _create_buffer(self) -> Any:
        """Build the library buffer for this manager's sizes (collective over the EP group)."""

    @abstractmethod
    def _destroy_buffer(self, buffer: Any) -> None:
        """Release a buffer built by :meth:`_create_buffer`."""

    # -- the library calls -----------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool, use_ue8m0: bool,
                 recv_hook: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                           Any, Optional[Hook]]:
        """Issue the send of x bf16 [num_tokens, kernel_hidden] (contiguous) to the experts in
        topk_idx topk_idx_dtype [num_tokens, num_topk]. Returns (recv_x, recv_x_sf or None,
        recv_count int32 [num_local_experts], handle, hook). ``recv_hook``: the receive happens
        in ``hook`` (hook mode: two kernel launches); False: one launch sends and receives
        (blocking on the stream, as the library's default) and hook is None."""
        recv, count, handle, _event, hook = self._dispatch_call(
            x, topk_idx, self.max_tokens_per_rank, self.num_experts,
            use_fp8=use_fp8, round_scale=use_ue8m0, use_ue8m0=use_ue8m0,
            async_finish=False, return_recv_hook=recv_hook)
        if use_fp8:
            return recv[0], recv[1], count, handle, hook
        return recv, None, count, handle, hook

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: Any, out: torch.Tensor, recv_hook: bool) -> Optional[Hook]:
        """Issue the send of expert outputs x bf16 [num_local_experts, num_recv_slots,
        kernel_hidden]; the receive reduces them with topk_weights float32 [num_tokens,
        num_topk] into out bf16 [num_tokens, kernel_hidden], in the returned hook
        (``recv_hook``) or in the same launch (False: returns None)."""
        _combined, _event, hook = self._combine_call(
            x, topk_idx, topk_weights, handle, async_finish=False, zero_copy=False,
            return_recv_hook=recv_hook, out=out)
        return hook

    # -- elastic rank masking --------------------------------------------------------------
    def set_rank_masked(self, rank: int, masked: bool = True) -> None:
        """Stop (``masked``) or resume sending to and receiving from EP rank ``rank``; combine
        then leaves out the experts of masked ranks (their topk weights count as zero)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        self._check_can_mask(rank)
        getattr(self.buffer, self.update_mask_method)(rank, masked)

    def masked_ranks(self) -> list[int]:
        """EP ranks currently masked in the library's mask buffer."""
        self._check_can_mask(None)
        status = torch.zeros(self._mask_len(), dtype=torch.int32, device=self.ctx.device)
        getattr(self.buffer, self.query_mask_method)(status)
        return [r for r, m in enumerate(status.tolist()) if m]

    def can_mask(self) -> bool:
        """Whether this buffer has a rank mask at all (what :meth:`masked_ranks` needs)."""
        try:
            self._check_can_mask(None)
        except ValueError:
            return False
        return True

    def clean_buffers(self) -> None:
        """After a fault (vLLM's ``clean_buffers``, rank-local): zero this rank's RDMA buffer,
        which a dispatch/combine that hit a dead or timed-out peer may have left partly written,
        then reset the mask so every rank the buffer reaches takes part again."""
        self._check_can_mask(None)
        self.buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
        _synchronize(self.ctx.device)
        getattr(self.buffer, self.clean_mask_method)()
        _synchronize(self.ctx.device)

    def _check_can_mask(self, rank: Optional[int]) -> None:
        """Raise ValueError when this buffer cannot mask ``rank`` (None: cannot mask at all)."""

    def _mask_len(self) -> int:
        return self.num_ranks

    def destroy(self) -> None:
        """Release this manager's share of the buffer (the last one destroys it); idempotent."""
        if self._key is not None:
            key, self._key = self._key, None
            _BUFFERS.release(key)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (the buffer is written by kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# What finalize needs from prepare, a plain tuple (built on every call: a dataclass's __init__
# costs ~0.5 us more): (handle: the library's; num_tokens given to prepare; expert_shape: the shape
# the expert outputs must have, the receive's (num_local_experts, num_recv_slots, hidden) with
# the layer's hidden where it is padded; topk_ids and topk_weights as given to prepare (finalize
# must get the same); ids and weights: prepare's in the library's dtypes, int64 and float32 (a
# finalize given those very tensors, as every caller does, reuses them without checking or
# casting again)).
_CallState = tuple

_BF16, _F32 = torch.bfloat16, torch.float32


class LowLatencyPrepareFinalize(PrepareFinalize):
    """BATCHED layout: prepare returns x [num_local_experts, num_recv_slots, hidden] with a
    token count per local expert, topk ids/weights None (combine applies the weights).

    num_recv_slots = ``max_tokens_per_rank * num_ranks`` (NIXL EP: times the active rank bound);
    only the first ``expert_num_tokens[e]`` rows of expert ``e`` are valid. x is bfloat16
    (``x_sf is None``) or float8_e4m3fn with x_sf float32 [..., hidden // 128], block-128
    scales in the kernels' column-major layout; with packed UE8M0 scales (experts that ask
    for them, :meth:`post_init_setup`) x_sf is int32 [..., ceil(hidden / 512)].

    Host cost per call: the layer's sizes and limits were checked when the manager was built;
    a call checks only what can change (the inputs' shapes, dtypes, token count, the quant spec
    when it is another object than last time) and adds its pair count to the stats, which are
    computed when read.
    """

    activation_format = ActivationFormat.BATCHED

    def __init__(self, manager: LowLatencyManager, cfg: DispatchConfig):
        self.manager = manager
        self.cfg = cfg
        self.use_ue8m0 = False
        self._state: Optional[_CallState] = None  # (see _CallState)
        # No host exchange on these kernels: a call that fails on one rank (before its
        # dispatch, or between dispatch and combine) breaks the group (moe_plugins.faults).
        self.faults = group_faults(manager.ctx.ep_group)
        self.name = (f"{manager.backend_name} layer (experts={cfg.num_experts} "
                     f"hidden={cfg.hidden} topk={cfg.num_topk}, EP rank {manager.rank})")
        # What every call reads, read once (each attribute chain is host time per call).
        self._hidden = manager.hidden
        self._topk = cfg.num_topk
        self._padded = manager.padded
        self._idx_dtype = manager.topk_idx_dtype
        self._max_tokens = manager.max_tokens_per_rank
        check = manager.options.check_expert_ids  # None: on CPU only (see LowLatencyOptions)
        self._check_ids = manager.ctx.device.type != "cuda" if check is None else check
        self._num_experts = manager.num_experts
        self._id_error = expert_id_error(manager.num_experts, manager.backend_name)
        #: The library runtime's calls this object makes itself (None: the manager's dispatch /
        #: combine); with them, the runtime's host asserts check what they check (RuntimeCalls).
        self.runtime_calls: Optional[RuntimeCalls] = manager.runtime_calls
        self._buffer = manager.buffer
        self._checked_quant: Optional[QuantSpec] = None  # the last quant spec prepare accepted
        self._fp8 = False  # and whether it puts FP8 on the wire
        self._calls = 0
        self._tokens = [0, 0]  # tokens dispatched: [bf16, fp8] on the wire (pairs: x num_topk)
        # tokens dispatched whose combine never ran (abandoned or raised): what the combine
        # brought back is the rest, so a combine counts nothing itself
        self._uncombined = 0

    @property
    def stats(self) -> DispatchStats:  # type: ignore[override]
        """What this rank sent, summed over calls: one message per (token, expert) pair (-1
        entries included: counting them exactly would need a sync), each with a 16-byte header;
        combine bytes are the rows combine brings back to this rank's pairs (what this rank
        sends is only known on the device; summed over ranks the two are equal)."""
        kh, k = self.manager.kernel_hidden, self._topk
        bf16, fp8 = self._tokens[0] * k, self._tokens[1] * k
        pairs = bf16 + fp8
        in_flight = 0 if self._state is None else self._state[1]
        return DispatchStats(calls=self._calls, pairs=pairs, rows=pairs,
                             act_bytes=(2 * bf16 + fp8) * kh, sf_bytes=fp8 * (kh // FP8_BLOCK) * 4,
                             meta_bytes=pairs * _MSG_HEADER_BYTES,
                             combine_bytes=(pairs - (self._uncombined + in_flight) * k) * kh * 2)

    def num_dispatchers(self) -> int:
        return self.manager.num_ranks

    def supports_async(self) -> bool:
        return True

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.manager.max_tokens_per_rank

    def topk_indices_dtype(self) -> torch.dtype:
        """The dtype the library wants topk ids in (int32 router ids are widened in prepare)."""
        return self.manager.topk_idx_dtype

    def post_init_setup(self, experts: object) -> None:
        """Dispatch packed UE8M0 scales when ``experts.supports_packed_ue8m0_act_scales()``."""
        asks = getattr(experts, "supports_packed_ue8m0_act_scales", None)
        if asks is None or not asks():
            return
        if self.cfg.quant.quantized_on_wire:
            self.use_ue8m0 = True
            logger.info("%s: experts read packed UE8M0 scales; dispatching power-of-two scales "
                        "packed four to an int32", self.manager.backend_name)
        else:
            logger.warning("%s: %s can take FP8 activations with packed UE8M0 scales, but this "
                           "layer dispatches unquantized activations (quant %s)",
                           self.manager.backend_name, type(experts).__name__,
                           self.cfg.quant.scheme.value)

    def reset_call_state(self) -> None:
        if self._state is not None:  # dispatched, never combined: peers wait in the combine
            self.faults.mark_broken("a call was abandoned between its dispatch and its combine")
            self._uncombined += self._state[1]
        self._state = None

    # -- padding of the hidden dimension (see the module doc) ------------------------------
    def _pad_last(self, t: torch.Tensor) -> torch.Tensor:
        m = self.manager
        out = t.new_zeros(*t.shape[:-1], m.kernel_hidden)
        out[..., : m.hidden] = t
        return out

    def _ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids in the library's dtype, contiguous (a cast only when it is another dtype:
        even a no-op ``.to`` costs a microsecond of host time)."""
        if topk_ids.dtype is not self._idx_dtype:
            topk_ids = topk_ids.to(self._idx_dtype)
        return topk_ids.contiguous()

    def _check_quant(self, quant: QuantSpec) -> None:
        if quant.scheme not in _QUANTS:
            raise ValueError(f"{self.manager.backend_name}: quant scheme {quant.scheme.value} is "
                             f"not supported; supported: {sorted(q.value for q in _QUANTS)}")

    def prepare_async(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec) -> AsyncResult:
        """hidden_states bf16 [num_tokens, hidden], topk_weights float32 [num_tokens, num_topk],
        topk_ids int32/int64 [num_tokens, num_topk] (PHYSICAL ids, -1 for none). The send is
        issued here (hook mode); the hook receives; the receiver returns the
        :class:`PrepareResult`."""
        recv_x, recv_sf, recv_count, hook = self.dispatch_send(hidden_states, topk_weights,
                                                               topk_ids, quant, True)
        return AsyncResult(hook, lambda: PrepareResult(recv_x, recv_sf,
                                                       ExpertTokensMeta(recv_count), None, None))

    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, quant: QuantSpec) -> PrepareResult:
        """:meth:`prepare_async` with nothing to run between its send and its receive: one
        blocking library call (send and receive in one kernel launch instead of two: a
        launch's host time less per call, eager)."""
        recv_x, recv_sf, recv_count, _ = self.dispatch_send(hidden_states, topk_weights,
                                                            topk_ids, quant, False)
        return PrepareResult(recv_x, recv_sf, ExpertTokensMeta(recv_count), None, None)

    def dispatch_send(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quant: QuantSpec, recv_hook: bool
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                 Optional[Hook]]:
        """:meth:`prepare_async`'s halves without the result objects (the vLLM adapter builds
        vLLM's own from them): checks the call and issues the dispatch. Returns the receive
        buffers (the class doc's x and x_sf, filled once ``hook`` has run; hook None when not
        ``recv_hook``: filled already), recv_count int32 [num_local_experts] and the hook. A call
        that raises here breaks the group: peers are in or past this dispatch."""
        if self.faults.broken is not None:  # the common case costs one attribute read
            self.faults.check(self.name)
        try:
            h_shape = hidden_states.shape
            rt = self.runtime_calls
            # A layer's common call passes in one test: [n, hidden] tokens, float32 weights and
            # ids in the library's dtype of shape [n, num_topk], the quant spec of the last call,
            # no call in flight; and bf16 contiguous tokens within the capacity, contiguous ids,
            # which the runtime's asserts check where it is called directly (RuntimeCalls). Any
            # other call takes the full checks, which raise every error they raised before, in
            # the same order.
            if not (len(h_shape) == 2 and h_shape[1] == self._hidden
                    and topk_weights.dtype is _F32 and topk_ids.dtype is self._idx_dtype
                    and quant is self._checked_quant and self._state is None
                    and topk_ids.shape == topk_weights.shape == (h_shape[0], self._topk)
                    and (rt is not None or hidden_states.dtype is _BF16
                         and h_shape[0] <= self._max_tokens)):
                self._check_call(hidden_states, topk_weights, topk_ids, quant)
                ids = self._ids(topk_ids)
                x = hidden_states.contiguous()
                weights = topk_weights if topk_weights.dtype is _F32 else topk_weights.float()
            elif rt is None:
                ids, x, weights = topk_ids.contiguous(), hidden_states.contiguous(), topk_weights
            else:  # the runtime's asserts check the rest
                ids, x, weights = topk_ids, hidden_states, topk_weights
            n = h_shape[0]
            use_fp8 = self._fp8
            use_ue8m0 = use_fp8 and self.use_ue8m0
            if self._check_ids:
                assert_expert_ids(ids, self._num_experts, self._id_error)
            if self._padded:
                x = self._pad_last(x)
            if rt is None:
                recv_x, recv_sf, recv_count, handle, hook = self.manager.dispatch(
                    x, ids, use_fp8, use_ue8m0, recv_hook)
            else:
                try:
                    recv_x, recv_sf, recv_count, src_info, layout_range, _, hook = rt.dispatch(
                        self._buffer.runtime, x, ids, None, None, self._max_tokens,
                        self._num_experts, use_fp8, use_ue8m0, use_ue8m0, False, recv_hook)
                except RuntimeError as refused:
                    x, ids = self._refused_dispatch(hidden_states, topk_weights, topk_ids,
                                                    quant, x, ids, refused)
                    recv_x, recv_sf, recv_count, src_info, layout_range, _, hook = rt.dispatch(
                        self._buffer.runtime, x, ids, None, None, self._max_tokens,
                        self._num_experts, use_fp8, use_ue8m0, use_ue8m0, False, recv_hook)
                handle = (src_info, layout_range)
            if self._padded:  # the experts get views of the layer's columns (and scales)
                hidden = self._hidden
                recv_x = recv_x[..., :hidden]
                if recv_sf is not None:  # packed UE8M0 scales: int32, one per 512 columns
                    per = FP8_BLOCK * (_UE8M0_PACK if recv_sf.dtype is torch.int32 else 1)
                    recv_sf = recv_sf[..., : -(-hidden // per)]
            self._state = (handle, n, recv_x.shape, topk_ids, topk_weights, ids, weights)
            self._calls += 1
            self._tokens[use_fp8] += n
        except BaseException as e:  # peers are in (or past) this dispatch: out of step now
            self.faults.mark_broken(f"{self.name}: prepare raised on this rank", e)
            raise
        return recv_x, recv_sf, recv_count, hook

    def _refused_dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, quant: QuantSpec, x: torch.Tensor,
                          ids: torch.Tensor, error: RuntimeError
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The runtime's dispatch raised ``error`` on (x, ids). Where its asserts refused the
        call (nothing launched, RuntimeCalls), a wrong input raises its error with the fix and
        non-contiguous inputs come back as contiguous copies, to be dispatched; otherwise the
        runtime's error propagates."""
        self._check_call(hidden_states, topk_weights, topk_ids, quant)
        if x.is_contiguous() and ids.is_contiguous():
            raise error
        return x.contiguous(), ids.contiguous()

    def _check_call(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, quant: QuantSpec) -> None:
        """Every check of a prepare, each raising with the fix; a new quant spec is kept."""
        check_prepare_inputs(hidden_states, topk_weights, topk_ids, self.cfg)
        if quant is not self._checked_quant:  # a layer passes the same spec on every call
            self._check_quant(quant)
            self._checked_quant, self._fp8 = quant, quant.quantized_on_wire
        m = self.manager
        n = hidden_states.shape[0]  # hidden and top-k: checked against the layer above
        if hidden_states.dtype is not torch.bfloat16:
            raise TypeError(f"{m.backend_name}: hidden_states must be bfloat16 (the kernels "
                            f"dispatch bf16 and quantize to FP8 themselves), got "
                            f"{hidden_states.dtype}")
        if n > self._max_tokens:
            raise ValueError(f"{m.backend_name}: prepare got {n} tokens but the buffers hold "
                             f"{m.max_tokens_per_rank} per rank; raise "
                             "DispatchConfig.max_tokens_per_rank")
        if self._state is not None:
            raise RuntimeError("prepare called twice without finalize (or reset_call_state)")

    def finalize_async(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> AsyncResult:
        """fused_expert_output bf16 [num_local_experts, num_recv_slots, hidden]: UNWEIGHTED
        expert outputs in prepare's layout; topk_weights/topk_ids: those given to prepare.
        ``output``: [num_tokens, hidden] to fill, or a row-scatter target whose owned rows
        receive the combined rows (added after the shared-expert join). Hook mode."""
        hook, dest = self.combine_send(fused_expert_output, topk_weights, topk_ids, output, True)
        if dest is output:  # the library writes the output itself
            return AsyncResult(hook, lambda: output)
        return AsyncResult(hook, lambda: self.combine_received(dest, output))

    def finalize(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget) -> torch.Tensor:
        """:meth:`finalize_async` as one blocking library call (send and receive in one kernel
        launch). Returns ``output`` (a row-scatter target: its buffer)."""
        _, dest = self.combine_send(fused_expert_output, topk_weights, topk_ids, output, False)
        return output if dest is output else self.combine_received(dest, output)

    def combine_received(self, dest: torch.Tensor, output: torch.Tensor | RowScatterTarget
                         ) -> torch.Tensor:
        """After the combine's receive: ``dest`` (what :meth:`combine_send` returned) into
        ``output``; returns ``output`` (a row-scatter target: its buffer)."""
        if dest is output:
            return output
        combined = dest[:, : self._hidden] if self._padded else dest
        if isinstance(output, RowScatterTarget):
            return row_scatter_add(output, combined)
        output.copy_(combined)
        return output

    def combine_send(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, output: torch.Tensor | RowScatterTarget,
                     recv_hook: bool) -> tuple[Optional[Hook], torch.Tensor]:
        """:meth:`finalize_async`'s first half without the result object: checks the call and
        issues the combine. Returns (hook or None, dest: the tensor the library writes,
        ``output`` itself where it can); after the hook, :meth:`combine_received` writes
        ``output``. A call that raises here breaks the group."""
        st = self._state
        if st is None:
            raise RuntimeError("finalize called without a matching prepare on this backend")
        handle, n, expert_shape, prepared_ids, prepared_weights, ids, weights = st
        rt = self.runtime_calls
        try:
            if fused_expert_output.shape != expert_shape:
                raise ValueError(f"fused_expert_output has shape {tuple(fused_expert_output.shape)}"
                                 f", expected {list(expert_shape)} (prepare's layout)")
            # bf16 and contiguous expert outputs, contiguous float32 weights: the runtime's
            # asserts check them where it is called directly (RuntimeCalls)
            if rt is None and fused_expert_output.dtype is not _BF16:
                raise self._expert_dtype_error(fused_expert_output)
            if topk_ids is not prepared_ids or topk_weights is not prepared_weights:
                # the same routing only (a combine reduces by the dispatch's)
                check_finalize_routing(prepared_ids, topk_ids, topk_weights)
                ids = self._ids(topk_ids)
                weights = (topk_weights if topk_weights.dtype is _F32
                           else topk_weights.float())
            if isinstance(output, RowScatterTarget):
                if output.rows.num_owned != n:
                    raise ValueError(f"row-scatter target owns {output.rows.num_owned} rows, "
                                     f"prepare was given {n} tokens")
                dest = fused_expert_output.new_empty(n, self.manager.kernel_hidden)
            else:
                if output.shape != (n, self._hidden):
                    raise ValueError(f"finalize output has shape {tuple(output.shape)}, expected "
                                     f"[{n}, {self._hidden}] (the tokens given to prepare)")
                direct = (not self._padded and output.dtype is _BF16
                          and output.is_contiguous())
                dest = (output if direct
                        else fused_expert_output.new_empty(n, self.manager.kernel_hidden))
            x = self._pad_last(fused_expert_output) if self._padded else fused_expert_output
            if rt is None:
                hook = self.manager.combine(x.contiguous(), ids, weights.contiguous(), handle,
                                            dest, recv_hook)
            else:
                try:
                    _, _, hook = rt.combine(
                        self._buffer.runtime, x, ids, weights, handle[0], handle[1], None,
                        self._max_tokens, self._num_experts, False, False, False, recv_hook, dest)
                except RuntimeError as refused:
                    x, weights = self._refused_combine(x, weights, refused)
                    _, _, hook = rt.combine(
                        self._buffer.runtime, x, ids, weights, handle[0], handle[1], None,
                        self._max_tokens, self._num_experts, False, False, False, recv_hook, dest)
        except BaseException as e:  # peers are in this combine: out of step now
            self._uncombined += n
            self.faults.mark_broken(f"{self.name}: finalize raised on this rank", e)
            raise
        finally:
            self._state = None
        return hook, dest

    def _refused_combine(self, x: torch.Tensor, weights: torch.Tensor, error: RuntimeError
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The runtime's combine raised ``error`` on (x, weights): as
        :meth:`_refused_dispatch`, for the expert outputs' dtype and the inputs' layout."""
        if x.dtype is not _BF16:
            raise self._expert_dtype_error(x) from error
        if x.is_contiguous() and weights.is_contiguous():
            raise error
        return x.contiguous(), weights.contiguous()

    def _expert_dtype_error(self, fused_expert_output: torch.Tensor) -> TypeError:
        return TypeError(f"{self.manager.backend_name}: expert outputs must be bfloat16 for the "
                         f"combine kernel, got {fused_expert_output.dtype}")


def low_latency_spec(name: str, prepare_finalize: type[LowLatencyPrepareFinalize],
                     manager: type[LowLatencyManager], description: str,
                     priority: int) -> BackendSpec:
    """The registry entry of a low-latency backend (both share capabilities and quants).

    sp follows vLLM's ``use_sequence_parallel_moe`` tuple, which lists deepep_low_latency and
    nixl_ep; tp: TP slicing happens before prepare. micro_batch: both libraries double-buffer
    (two calls in flight, as vLLM's DBO runs its in-tree LL classes) and the per-call handle
    lives in the prepare/finalize object; rank_masking: both have a mask buffer (DeepEP with
    ``enable_shrink``)."""
    return BackendSpec(
        name=name,
        prepare_finalize=prepare_finalize,
        manager=manager,
        capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=True, row_scatter=True,
                                  recv_hook=True, activation_format=ActivationFormat.BATCHED,
                                  placements=True, micro_batch=True, rank_masking=True),
        quants=_QUANTS,
        required=(manager.required,),
        needs_cuda=True,
        description=description,
        priority=priority,
        dtypes=frozenset({torch.bfloat16}),  # the kernels dispatch bf16 (and quantize to FP8)
        wire_layout=manager.wire_layout,
    )
