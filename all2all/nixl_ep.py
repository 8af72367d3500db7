"""Transport of ``nixl_ep``: NIXL EP's ``nixl_ep.Buffer`` (low-latency kernels over NIXL).

Follows the nixl_ep Python API of ai-dynamo/nixl v1.4.0 (examples/device/ep/nixl_ep):
``Buffer(disable_ll_nvlink, explicitly_destroy, rank, low_latency_mode, group, comm,
tcp_store_group, timeout_ms)``, ``update_memory_buffers(num_ranks, num_experts_per_rank,
num_rdma_bytes)``, ``connect_ranks(remote_ranks)``, ``dispatch/combine`` (the names every nixl
release since v1.0.0 has; v1.1+ also calls them ``low_latency_*``, and its ``dispatch/combine``
forward there: the manager calls ``low_latency_*`` where the buffer has them),
``update_mask_buffer`` / ``query_mask_buffer``. ``nixl_ep`` is imported when a manager is built,
never at import time.

The library calls. In v1.4.0 and 1.5.1 (``nixl_ep/buffer.py``) ``low_latency_dispatch`` /
``low_latency_combine`` are each one call of the C++ runtime (``Buffer.runtime``, a
``nixl_ep_cpp.Buffer``: ``dispatch`` / ``combine``, csrc/nixl_ep.cpp) wrapped in Python: the
handle tuple, a tuple of tensors to record, an ``EventOverlap``; as DeepEP's
(:mod:`moe_plugins.all2all.deepep_ll`), none of it is used here. Where the two methods have those releases'
parameters, the prepare/finalize call the runtime directly (:class:`RuntimeCalls`): its dispatch
takes DeepEP's positional arguments, its combine the same without ``num_experts``. Its host
asserts come first, before anything is launched or changed, as DeepEP's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.lowlat.manager import LowLatencyManager, LowLatencyOptions
from moe_plugins.lowlat.vendor import RuntimeCalls, wrappers_match
from moe_plugins.registry import RequiredPackage

if TYPE_CHECKING:
    from moe_plugins.planner.link_model import LinkModel

__all__ = ["NixlEPOptions", "NixlEPManager", "NIXL_PACKAGE"]

NIXL_PACKAGE = RequiredPackage(
    module="nixl_ep", install="pip install 'nixl>=1.5' (moe-plugins' [nixl] extra)", extra="nixl")

_NO_STORE = (
    "nixl_ep needs a tcp_store_group: a torch.distributed Store through which the ranks exchange "
    "their NIXL agent metadata when they connect (connect_ranks writes NIXL_EP/<rank> and reads "
    "the peers' keys). Pass one in the backend options, for example a prefix store on the store "
    "the process group was initialized with: DispatchConfig(backend_options=NixlEPOptions("
    "tcp_store_group=torch.distributed.PrefixStore('nixl_ep', store)))"
)

_RUNTIME_METHODS = ("dispatch", "combine")


def runtime_calls(buffer: Any) -> Optional[RuntimeCalls]:
    """The calls of ``buffer.runtime`` (a nixl_ep_cpp.Buffer) the prepare/finalize can make
    directly: None unless ``buffer``'s low-latency methods are those of v1.4.0 / 1.5.1."""
    if not wrappers_match(buffer, _RUNTIME_METHODS, "nixl_ep", "nixl_ep v1.4.0 / 1.5.1"):
        return None
    runtime = type(buffer.runtime)
    return RuntimeCalls(runtime.dispatch, _without_num_experts(runtime.combine))


def _without_num_experts(combine: Callable[..., tuple]) -> Callable[..., tuple]:
    """nixl_ep's runtime combine under RuntimeCalls' positional signature, which has DeepEP's
    ``num_experts`` (nixl's combine reads the expert layout from ``layout_range``)."""
    def call(runtime: Any, x: Any, topk_idx: Any, topk_weights: Any, src_info: Any,
             layout_range: Any, wait_stats: Any, max_tokens: int, num_experts: int,
             use_logfmt: bool, zero_copy: bool, async_: bool, recv_hook: bool, out: Any) -> tuple:
        return combine(runtime, x, topk_idx, topk_weights, src_info, layout_range, wait_stats,
                       max_tokens, use_logfmt, zero_copy, async_, recv_hook, out)
    return call


@dataclass(frozen=True)
class NixlEPOptions(LowLatencyOptions):
    """NIXL EP settings (``DispatchConfig.backend_options``); see :class:`LowLatencyOptions`
    for ``allow_nvlink`` (``disable_ll_nvlink`` here) and ``pad_hidden``.

    tcp_store_group: required; a ``torch.distributed.Store`` (TCPStore, or a PrefixStore on
        one) shared by the EP ranks, used to exchange agent metadata when ranks connect.
    timeout_ms: GPU kernel timeout (nixl v1.2+); in low-latency mode a timed-out peer is masked
        out. None: the library's default (30 s).
    """

    tcp_store_group: Any = None
    timeout_ms: Optional[int] = None


class NixlEPManager(LowLatencyManager):
    """One ``nixl_ep.Buffer`` per EP group and size. Lifecycle: ``Buffer(rank, tcp_store_group)``
    -> ``update_memory_buffers`` (NIXL's size hint) -> ``connect_ranks`` (every EP rank) ->
    (layers) -> clean up on the last :meth:`destroy`: drop the store, ``destroy()``."""

    backend_name = "nixl_ep"
    required = NIXL_PACKAGE
    options_type = NixlEPOptions
    # v1.1+ names them low_latency_*; its dispatch/combine forward there through *args/**kwargs
    dispatch_methods = ("low_latency_dispatch", "dispatch")
    combine_methods = ("low_latency_combine", "combine")
    update_mask_method = "update_mask_buffer"
    query_mask_method = "query_mask_buffer"
    # Buffer::destroy (csrc/nixl_ep.cpp) waits for its NVLink peers only under the kernel
    # timeout and deregisters its memory locally: it returns with a peer lost
    teardown_waits_for_every_rank = False
    clean_mask_method = "clean_mask_buffer"
    # In low-latency mode NIXL EP masks a peer whose kernels time out (vLLM's in-tree NIXL EP
    # manager always declares fault tolerance for that reason).
    masks_by_itself = True
    options: NixlEPOptions

    @classmethod
    def engine_options(cls, tcp_store: Any, fault_tolerance: bool = False,
                       link: Optional[LinkModel] = None) -> NixlEPOptions:
        """The options an engine builds this backend with: the ranks exchange their agent
        metadata through ``tcp_store`` (a torch.distributed Store shared by the EP group).
        The mask buffer always exists, so ``fault_tolerance`` changes nothing."""
        return NixlEPOptions(tcp_store_group=tcp_store)

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        opts = cfg.backend_options
        if opts is None or (isinstance(opts, NixlEPOptions) and opts.tcp_store_group is None):
            raise ValueError(_NO_STORE)
        super().__init__(ctx, cfg)
        self.runtime_calls = runtime_calls(self.buffer)

    def library_timeout(self) -> tuple[Optional[float], bool]:
        """NIXL EP's kernel timeout where one is given (``timeout_ms``): it masks the peer
        there, never traps."""
        ms = self.options.timeout_ms
        return (None if ms is None else ms / 1000.0), False

    def _layout_ranks_multiple(self) -> int:
        # The receive layout spans the active rank bound (highest unmasked rank + 1), which
        # masking changes: keep the token capacity itself a multiple of 4.
        return 1

    def _size_hint(self, max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return int(self.lib.Buffer.get_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts))

    def _create_buffer(self) -> Any:
        extra = {} if self.options.timeout_ms is None else {"timeout_ms": self.options.timeout_ms}
        buffer = self.lib.Buffer(  # low-latency mode is the default (and the only v1.0 mode)
            disable_ll_nvlink=not self.options.allow_nvlink,
            explicitly_destroy=True,
            rank=self.rank,
            tcp_store_group=self.options.tcp_store_group,
            **extra,
        )
        buffer.update_memory_buffers(num_ranks=self.num_ranks,
                                     num_experts_per_rank=self.num_local_experts,
                                     num_rdma_bytes=self.num_rdma_bytes)
        buffer.connect_ranks(list(range(self.num_ranks)))  # the local rank is filtered out
        return buffer

    def _destroy_buffer(self, buffer: Any) -> None:
        buffer.set_tcp_store_group(None)
        buffer.destroy()

    def _check_can_mask(self, rank: Optional[int]) -> None:
        if rank is not None and rank == self.rank:
            raise ValueError(f"nixl_ep cannot mask the local rank ({rank}); mask it on its peers")
