"""Transport of ``deepep_ll``: DeepEP's ``deep_ep.Buffer`` in low-latency mode.

Runs on both DeepEP lines that have ``deep_ep.Buffer`` (:mod:`moe_plugins.stack.deepep` says
which is installed and how they differ): the V1 line (commit 567632d, the last before the V2
rewrite, ``deep_ep/buffer.py``) and the current line's legacy Buffer (d4f41e4 and later,
``deep_ep/buffers/legacy.py``): ``Buffer(group, num_nvl_bytes, num_rdma_bytes,
low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
explicitly_destroy, enable_shrink)`` with ``low_latency_dispatch/low_latency_combine``.
``deep_ep`` is imported when a manager is built, never at import time.

The library calls. In both lines each of ``Buffer.low_latency_dispatch`` / ``low_latency_combine``
is one call of the C++ runtime (``Buffer.runtime``: 567632d's ``deep_ep_cpp.Buffer``,
csrc/deep_ep.cpp; the current line's ``deep_ep._C`` legacy Buffer, csrc/legacy/buffer.hpp, with
the same positional parameters) wrapped in Python: an assert on the QP depth, the current line's
``check_torch_deterministic()``, the handle tuple, a tuple of the tensors to record and an
``EventOverlap``. None of that is used here (no ``async_finish``; the QP depth is checked once,
when the layer is built; the determinism check is made by the prepare/finalize; the handle is the
two tensors the combine needs), and on the H200 it is host time on every eager call. So where
``deep_ep.Buffer``'s two methods have those signatures, the manager hands the prepare/finalize
that runtime's two methods (:class:`moe_plugins.lowlat.vendor.RuntimeCalls`); they call them
with the arguments that wrapper passes, in the order the C++ takes them, and leave to the C++
host asserts what those check. With any other signature the calls go through the Python
methods. ``buffer.runtime`` is read on each call, so a destroyed buffer (runtime None) raises.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.lowlat.limits import token_capacity
from moe_plugins.lowlat.manager import LowLatencyManager, LowLatencyOptions
from moe_plugins.lowlat.vendor import RuntimeCalls, wrappers_match
from moe_plugins.registry import RequiredPackage, TokenLimit
from moe_plugins.stack.deepep import DeepEPFound, deepep_status, require_buffer_api

if TYPE_CHECKING:
    from moe_plugins.planner.link_model import LinkModel

__all__ = ["DeepEPLLOptions", "DeepEPLLManager", "DEEPEP_PACKAGE"]

DEEPEP_PACKAGE = RequiredPackage(
    module="deep_ep",
    install="DeepEP publishes no wheel: build its V1 line (commit 567632d, with the patches of "
            "scripts/deepep/build.sh) from source against CUDA + NVSHMEM (moe-plugins' "
            "docs/backends.md)",
    describe=deepep_status,
)

_DEFAULT_QP_DEPTH = 1024  # DeepEP's default NVSHMEM_QP_DEPTH


def qp_depth() -> int:
    """NVSHMEM_QP_DEPTH as DeepEP's Buffer reads it (environment, default 1024); ValueError
    naming the variable for a value that is not a positive whole number."""
    raw = os.environ.get("NVSHMEM_QP_DEPTH", "").strip()
    if not raw:
        return _DEFAULT_QP_DEPTH
    try:
        depth = int(raw)
    except ValueError:
        depth = 0
    if depth < 1:
        raise ValueError(f"NVSHMEM_QP_DEPTH={raw!r} is not a positive whole number (NVSHMEM's "
                         "queue-pair depth, which DeepEP's low-latency kernels need at least "
                         "2 x (tokens per rank + 1) of); set it to e.g. 1024, or unset it for "
                         f"the default {_DEFAULT_QP_DEPTH}")
    return depth


def runtime_calls_known(buffer: Any) -> bool:
    """Whether ``buffer`` (a deep_ep.Buffer) has the low-latency Python methods of 567632d and
    d4f41e4 (the same parameters) and a runtime: then its runtime takes the calls those methods
    make (see the module doc)."""
    return wrappers_match(buffer, ("low_latency_dispatch", "low_latency_combine"), "deepep_ll",
                          "DeepEP 567632d / d4f41e4")


@dataclass(frozen=True)
class DeepEPLLOptions(LowLatencyOptions):
    """DeepEP LL settings (``DispatchConfig.backend_options``); see :class:`LowLatencyOptions`
    for ``allow_nvlink`` (which wins over hook overlap, and why) and ``pad_hidden``.

    enable_shrink: allocate DeepEP's rank mask buffer, needed for :meth:`set_rank_masked`.
    allow_mnnvl: allow multi-node NVLink.
    """

    enable_shrink: bool = False
    allow_mnnvl: bool = False


class DeepEPLLManager(LowLatencyManager):
    """One ``deep_ep.Buffer`` per EP group and size: RDMA bytes from DeepEP's size hint for
    (tokens per rank, kernel hidden, ranks, experts), low-latency mode, one QP per local expert,
    NVLink per ``allow_nvlink``; built with ``explicitly_destroy`` and destroyed by the last
    :meth:`destroy`."""

    backend_name = "deepep_ll"
    required = DEEPEP_PACKAGE
    options_type = DeepEPLLOptions
    dispatch_methods = ("low_latency_dispatch",)
    combine_methods = ("low_latency_combine",)
    update_mask_method = "low_latency_update_mask_buffer"
    query_mask_method = "low_latency_query_mask_buffer"
    clean_mask_method = "low_latency_clean_mask_buffer"
    # Buffer::destroy (567632d csrc/deep_ep.cpp) meets every rank in an NVSHMEM barrier
    # (nvshmem_barrier_all, no timeout, the mask not consulted) before freeing the RDMA buffer
    teardown_waits_for_every_rank = True
    options: DeepEPLLOptions
    deepep: DeepEPFound

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        super().__init__(ctx, cfg)
        if runtime_calls_known(self.buffer):
            # the wrapper's per-call assert, made once on the buffer's depth
            try:
                self._check_qp_depth(int(getattr(self.buffer, "nvshmem_qp_depth",
                                                 _DEFAULT_QP_DEPTH)))
            except ValueError:
                self.destroy()
                raise
            runtime = type(self.buffer.runtime)
            self.runtime_calls = RuntimeCalls(runtime.low_latency_dispatch,
                                              runtime.low_latency_combine)

    @classmethod
    def engine_options(cls, tcp_store: Any, fault_tolerance: bool = False,
                       link: Optional[LinkModel] = None) -> Optional[DeepEPLLOptions]:
        """With the engine's fault tolerance on, DeepEP needs its mask buffer (``enable_shrink``),
        as vLLM's in-tree DeepEP LL manager builds it; otherwise the defaults."""
        return DeepEPLLOptions(enable_shrink=True) if fault_tolerance else None

    def library_timeout(self) -> tuple[Optional[float], bool]:
        """DeepEP's kernel timeout as the installed DeepEP was built (NUM_TIMEOUT_CYCLES; 200G
        cycles, about 100 s, unless its build record says otherwise:
        :class:`moe_plugins.stack.deepep.Timeouts`); its kernels trap there unless the buffer
        has a mask (``enable_shrink``), which they set instead."""
        return self.deepep.timeouts.kernel_s, not self.options.enable_shrink

    def _probe_library(self) -> str:
        self.deepep = require_buffer_api(self.lib, self.backend_name)
        self.checks_determinism = self.deepep.checks_determinism
        # switches the installed constructor lacks: refused here, before any collective
        self._buffer_switches = self.deepep.buffer_kwargs(self._switches(), self.backend_name)
        return self.deepep.describe()

    def _switches(self) -> dict[str, bool]:
        """The Buffer's optional switches this manager asks for (passed only when on)."""
        return {"allow_mnnvl": self.options.allow_mnnvl,
                "enable_shrink": self.options.enable_shrink}

    def determinism_error(self) -> Optional[ValueError]:
        return self.deepep.determinism_error(self.backend_name)

    def _check_limits(self) -> None:
        self._check_qp_depth(qp_depth())

    def _check_qp_depth(self, depth: int) -> None:
        why = self._qp_depth_error(self.max_tokens_per_rank, depth)
        if why is not None:
            raise ValueError(why)

    @classmethod
    def _qp_depth_error(cls, capacity: int, depth: int) -> Optional[str]:
        """Why a buffer of ``capacity`` tokens per rank cannot run at QP depth ``depth``, or
        None: Buffer.low_latency_dispatch asserts qp_depth >= 2 * (max tokens + 1)."""
        need = 2 * (capacity + 1)
        if need <= depth:
            return None
        return (f"{cls.backend_name}: {capacity} tokens per rank need NVSHMEM_QP_DEPTH >= {need} "
                f"(DeepEP asserts qp depth >= 2 * (tokens + 1)), it is {depth}; set "
                f"NVSHMEM_QP_DEPTH={need} before the first layer is built, or lower "
                "max_tokens_per_rank")

    @classmethod
    def token_limit(cls, num_ranks: int) -> TokenLimit:
        """The most tokens per rank whose buffer capacity (rounded up as the kernels need,
        :func:`moe_plugins.lowlat.limits.token_capacity`) passes the QP-depth check
        :meth:`_check_limits` makes, at this process's NVSHMEM_QP_DEPTH."""
        depth = qp_depth()
        tokens = depth // 2
        while tokens > 0 and cls._qp_depth_error(token_capacity(tokens, num_ranks),
                                                 depth) is not None:
            tokens -= 1
        return TokenLimit(tokens, f"NVSHMEM_QP_DEPTH={depth}: DeepEP's low-latency dispatch "
                          "asserts a depth of at least 2 x (tokens + 1); set NVSHMEM_QP_DEPTH "
                          "higher for larger batches")

    def _size_hint(self, max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return int(self.lib.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks,
                                                                  num_experts))

    def _create_buffer(self) -> Any:
        return self.lib.Buffer(
            self.group,
            num_nvl_bytes=self._num_nvl_bytes(),
            num_rdma_bytes=self.num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=self._num_qps_per_rank(),
            allow_nvlink_for_low_latency_mode=self.options.allow_nvlink,
            explicitly_destroy=True,
            **self._buffer_switches,
        )

    def _num_nvl_bytes(self) -> int:
        """NVLink buffer bytes: none in low-latency mode alone (a buffer that also runs normal
        mode, deepep_auto's, adds DeepEP's normal-mode hint)."""
        return 0

    def _num_qps_per_rank(self) -> int:
        """Low-latency mode needs one QP per local expert."""
        return self.num_local_experts

    def _destroy_buffer(self, buffer: Any) -> None:
        buffer.destroy()

    def _check_can_mask(self, rank: Optional[int]) -> None:
        if not self.options.enable_shrink:
            raise ValueError("deepep_ll: rank masking needs DeepEP's mask buffer; build the layer "
                             "with DeepEPLLOptions(enable_shrink=True)")
