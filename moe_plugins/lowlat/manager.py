"""The low-latency manager: the layer checked against the kernels' limits, and the library buffer
(one per EP group and size, cached, destroyed explicitly) with its rank mask.

A backend's manager (:mod:`moe_plugins.all2all.deepep_ll`, :mod:`moe_plugins.all2all.nixl_ep`) only names its package and
method names and says how its buffer is built and sized.
"""
from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext
from moe_plugins.backend_manager import BackendManager
from moe_plugins.lowlat.limits import (LL_QUANTS, MAX_TOPK, MSG_HEADER_BYTES, check_kernel_layer,
                                       kernel_hidden_size, token_capacity)
from moe_plugins.lowlat.vendor import RuntimeCalls, buffer_cache, import_vendor
from moe_plugins.masking import (MaskWord, checked_mask_request, library_word,
                                 masked_from_library)
from moe_plugins.registry import RequiredPackage, TokenLimit, WireLayout

logger = logging.getLogger(__name__)

__all__ = ["LowLatencyOptions", "LowLatencyManager"]


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
        vLLM's in-tree class checks nothing) and more eager (host_overhead.py, commit f9c7c43). True
        turns it on on CUDA too: a device-side assert, shown at the next sync and, as every CUDA
        device assert, ending the process's CUDA context. Routers (vLLM's, ours) only produce
        ids in range; turn it on when debugging one that may not.
    """

    allow_nvlink: bool = True
    pad_hidden: bool = True
    check_expert_ids: Optional[bool] = None


_PADDING_LOGGED: set[tuple] = set()


class LowLatencyManager(BackendManager, ABC):
    """Buffer and kernel limits of one low-latency backend for one layer config. The manager
    owns the library buffer (and its rank mask); the prepare/finalize makes the dispatch and
    combine calls on it (:class:`moe_plugins.lowlat.prepare_finalize.LowLatencyPrepareFinalize`).

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
    #: The buffer's dispatch / combine method names, preferred first: the prepare/finalize binds
    #: the first the buffer has (a release's alias that forwards to another name costs a frame
    #: per call) where it does not call the runtime directly (:attr:`runtime_calls`).
    dispatch_methods: ClassVar[tuple[str, ...]]  # e.g. ("low_latency_dispatch",)
    combine_methods: ClassVar[tuple[str, ...]]
    update_mask_method: ClassVar[str]  # (rank, mask: bool) -> None
    query_mask_method: ClassVar[str]  # (int32 [num_ranks] tensor) -> None
    #: whether the library's buffer teardown waits for every rank of the group with no
    #: timeout (a barrier), so that it never returns once a rank is lost (:meth:`peers_lost`)
    teardown_waits_for_every_rank: ClassVar[bool] = False
    clean_mask_method: ClassVar[str]  # () -> None: every rank the buffer reaches unmasked
    #: what the library's mask words say (both libraries: nonzero = masked, their update
    #: takes True = masked); our flag's one meaning is translated through it (masking.py)
    mask_word: ClassVar[MaskWord] = MaskWord.NONZERO_MASKED
    #: The runtime calls the prepare/finalize makes instead of the buffer's Python methods (set
    #: by a manager whose library release is known; None: the methods named above).
    runtime_calls: Optional[RuntimeCalls] = None

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        self.options = self._options(cfg.backend_options)
        self.kernel_hidden = self.wire_layout(cfg).hidden
        self.lib = import_vendor(self.required, self.backend_name)
        #: The installed library, in words (the buffer's INFO line names it).
        self.library = self._probe_library()
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
        self.buffer = buffer_cache().acquire(key, self._create_logged, self._teardown)
        self._key: Optional[tuple] = key
        self._buffer_key = key  # the buffer's, shared with the other managers of its key
        if self.padded and key not in _PADDING_LOGGED:
            _PADDING_LOGGED.add(key)
            logger.info("%s: hidden %d is not a kernel size; activations are zero-padded to %d "
                        "inside prepare/finalize (build the layer with hidden=%d to avoid the "
                        "copies)", self.backend_name, self.hidden, self.kernel_hidden,
                        self.kernel_hidden)

    def _create_logged(self) -> Any:
        buffer = self._create_buffer()
        logger.info("%s: buffer for EP rank %d/%d, %d local experts, kernel hidden %d, %d tokens "
                    "per rank, %d RDMA bytes, NVLink %s; %s", self.backend_name, self.rank,
                    self.num_ranks, self.num_local_experts, self.kernel_hidden,
                    self.max_tokens_per_rank, self.num_rdma_bytes,
                    "on" if self.options.allow_nvlink else "off", self.library)
        return buffer

    # -- configuration ---------------------------------------------------------------------
    @classmethod
    def token_limit(cls, num_ranks: int) -> Optional[TokenLimit]:
        """The most tokens per rank a layer over ``num_ranks`` EP ranks can be built for
        (``BackendSpec.token_limit``, read by the plan), from the checks :meth:`__init__`
        runs; None: no limit but memory."""
        return None

    def _probe_library(self) -> str:
        """Check the imported library (``self.lib``) can serve this backend (ImportError naming
        what was found and what to install where it cannot) and describe it in words."""
        return self.required.module

    def determinism_error(self) -> Optional[ValueError]:
        """The error for a call the library would refuse in torch's current deterministic
        settings (None: it runs it). Read by the prepare/finalize where
        :attr:`checks_determinism` is set."""
        return None

    #: The library refuses calls under some of torch's deterministic settings
    #: (:meth:`determinism_error`).
    checks_determinism: bool = False

    # -- configuration ---------------------------------------------------------------------
    @classmethod
    def wire_layout(cls, cfg: DispatchConfig) -> WireLayout:
        """Check the layer against the kernels' limits (the errors building a manager raises,
        without a process group) and return what one dispatched message carries: the kernel
        hidden size and the 16-byte header (``BackendSpec.wire_layout``, read by the plan)."""
        options = cls._options(cfg.backend_options)
        cls._check_layer(cfg)
        return WireLayout(kernel_hidden_size(cfg.hidden, options.pad_hidden, cls.backend_name),
                          MSG_HEADER_BYTES)

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
                           "activations", MAX_TOPK, LL_QUANTS)

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

    # -- elastic rank masking --------------------------------------------------------------
    def set_rank_masked(self, rank: int, masked: bool = True) -> None:
        """Stop (``masked``) or resume sending to and receiving from EP rank ``rank``; combine
        then leaves out the experts of masked ranks (their topk weights count as zero).
        ``rank``: an int in [0, EP size); ``masked``: a bool or the int 0/1 (anything else is
        refused before the mask changes: :func:`moe_plugins.masking.checked_mask_request`)."""
        rank, masked = checked_mask_request(rank, masked, self.num_ranks,
                                            f"{self.backend_name} set_rank_masked")
        self._check_can_mask(rank)
        getattr(self.buffer, self.update_mask_method)(rank, bool(library_word(masked,
                                                                              self.mask_word)))
        chosen = _CALLER_MASKED.setdefault(self._buffer_key, set())
        if masked:
            chosen.add(rank)
        else:
            chosen.discard(rank)

    def masked_by_library(self) -> list[int]:
        """EP ranks masked in the buffer that no caller masked (:meth:`set_rank_masked`): the
        library masked them itself, a peer whose kernels did not answer within its timeout
        (NIXL EP always; DeepEP with ``enable_shrink``). A call since then left their experts
        out of its result. One host sync; [] for a buffer without a mask."""
        if not self.can_mask():
            return []
        chosen = _CALLER_MASKED.get(self._buffer_key, set())
        return [r for r in self.masked_ranks() if r not in chosen]

    def masked_ranks(self) -> list[int]:
        """EP ranks currently masked in the library's mask buffer."""
        self._check_can_mask(None)
        status = torch.zeros(self._mask_len(), dtype=torch.int32, device=self.ctx.device)
        getattr(self.buffer, self.query_mask_method)(status)
        return masked_from_library(status.tolist(), self.mask_word)

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
        _CALLER_MASKED.pop(self._buffer_key, None)

    def library_timeout(self) -> tuple[Optional[float], bool]:
        """The library's own bound on a wait for a peer (seconds; None: none known) and whether
        its kernels trap at it (see ``PrepareFinalize.library_timeout_s``)."""
        return None, False

    def _check_can_mask(self, rank: Optional[int]) -> None:
        """Raise ValueError when this buffer cannot mask ``rank`` (None: cannot mask at all)."""

    def _mask_len(self) -> int:
        return self.num_ranks

    def peers_lost(self, ranks: Sequence[int]) -> None:
        """EP ``ranks`` of this buffer's group were declared lost for good (their processes
        died, or they were evicted: :mod:`moe_plugins.survival`). Where the library's teardown
        waits for every rank (:attr:`teardown_waits_for_every_rank`), the buffer is then not
        torn down (:meth:`destroy`): it would never return. Host state only."""
        _LOST_PEERS.setdefault(self._buffer_key, set()).update(int(r) for r in ranks)

    def _teardown(self, buffer: Any) -> None:
        """The last release of the buffer: the library's teardown, unless it would wait for a
        lost rank forever (:meth:`peers_lost`); then one WARNING and the buffer stays until
        the process exits."""
        lost = sorted(_LOST_PEERS.pop(self._buffer_key, ()))
        _CALLER_MASKED.pop(self._buffer_key, None)
        if lost and self.teardown_waits_for_every_rank:
            logger.warning("%s: the buffer is not torn down: the library's teardown waits for "
                           "every rank of the EP group, with no timeout, and EP ranks %s are "
                           "lost; its memory is freed when this process exits",
                           self.backend_name, lost)
            return
        self._destroy_buffer(buffer)

    def destroy(self) -> None:
        """Release this manager's share of the buffer (the last one tears it down:
        :meth:`_teardown`); idempotent."""
        if self._key is not None:
            key, self._key = self._key, None
            buffer_cache().release(key)


# The EP ranks declared lost for good, per buffer (cache key): see LowLatencyManager.peers_lost.
_LOST_PEERS: dict[tuple, set[int]] = {}

# The ranks callers masked (set_rank_masked), per buffer (cache key): a mask the library set on
# its own is one not in here.
_CALLER_MASKED: dict[tuple, set[int]] = {}


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (the buffer is written by kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
