"""Transport of the ``flashinfer_nvlink_one_sided`` backend: flashinfer's NVLink one-sided
all-to-all (``flashinfer.moe_ep.NVLinkOneSidedAlltoAll``, flashinfer-python 0.7.2.post1 and
0.7.4).

The dispatch kernel writes each token, with its scales and routing, straight into the receive
buffers of the ranks that own its experts (MNNVL symmetric memory, the same memory set-up as the
two-sided backend); the combine reads the expert outputs back and reduces them on the token's
rank. One object per layer config and EP group, created on the first dispatch (a collective every
rank reaches together); objects of one layout share flashinfer's workspace and run their rounds
one after another (the library refuses interleaved rounds: no dual-batch overlap).

The releases differ where this module probes them, by signature and attribute, not by version:
the per-call bound (``runtime_max_tokens_per_rank`` in 0.7.4, ``max_tokens_per_rank`` in
0.7.2.post1), the rank-mask helper (the object's ``active_rank_mask`` in 0.7.4,
``flashinfer.comm.moe_a2a_active_rank_mask`` in 0.7.2.post1), the checkpoints (on the object in
0.7.4, on its ``alltoall`` in 0.7.2.post1) and the optional transports (0.7.4 only: CFT counted
writes over the NVLink fabric and the Lamport transport for small steps, which the library picks
per step where every rank supports them; 0.7.2.post1 has the fence path only). flashinfer is
imported here, lazily.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.mnnvl.manager import (INSTALL_HINT, Dispatched, MnnvlManager, MnnvlTransport,
                                      TorchGroupComm, moe_ep_dispatch)
from moe_plugins.groups import DistContext
from moe_plugins.masking import MaskWord, checked_mask_request, library_word
from moe_plugins.quant import QuantScheme

logger = logging.getLogger(__name__)

__all__ = ["FlashInferOneSidedOptions", "FlashInferOneSidedManager", "SUPPORTED_TOPK",
           "MAX_EP_RANKS"]

# Kernel limits (flashinfer moe_ep nvlink_one_sided/communication.py, moeAlltoAllKernels.h): the
# top-k values the kernels are specialized for, and the most EP ranks (kMaxRanks: 256 in 0.7.4,
# 64 in 0.7.2.post1, whose rank mask is one 64-bit word).
SUPPORTED_TOPK = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 22)
MAX_EP_RANKS = 256
_MAX_EP_RANKS_ONE_MASK_WORD = 64
# QuantFormat of what crosses the wire, per activation quantization (vLLM 0.34's mapping)
_FORMATS = {QuantScheme.FP8_BLOCK128: "DeepSeekFp8", QuantScheme.NVFP4: "NVFP4"}
_UNQUANTIZED = {torch.bfloat16: "BF16", torch.float16: "FP16"}
_LOGGED: set[tuple] = set()


@dataclass(frozen=True)
class FlashInferOneSidedOptions:
    """``DispatchConfig.backend_options`` of ``flashinfer_nvlink_one_sided``.

    nvfp4_swizzled_sf: after the all-to-all, interleave nvfp4 scales into the 128x4 layout the
        CUTLASS/TRT-LLM NVFP4 GEMMs read (the prepare result then says ``x_sf_swizzled``).
    cft, lamport: the optional transports of flashinfer 0.7.4 (CFT counted writes; the Lamport
        transport for small steps). None (default): the library's choice, where every rank
        supports them; True: asked for (a WARNING where unavailable); False: off.
    lamport_max_tokens: the Lamport transport's largest step (None: the library's default).
    use_low_precision_combine: the combine sends e4m3 rows (less traffic, lower precision).
    enable_rank_mask: compile in rank masking (needed by ``set_rank_masked``).
    timeout_sec: flashinfer 0.7.4's bound on every wait for a peer (the kernel traps after it);
        None: the library's default (300 s).
    """

    nvfp4_swizzled_sf: bool = True
    cft: Optional[bool] = None
    lamport: Optional[bool] = None
    lamport_max_tokens: Optional[int] = None
    use_low_precision_combine: bool = False
    enable_rank_mask: bool = False
    timeout_sec: Optional[int] = None

    def __post_init__(self) -> None:
        if self.cft is True and self.lamport is True:
            raise ValueError("FlashInferOneSidedOptions(cft=True, lamport=True): both ask for "
                             "every eligible step; set one of them to None (the library's "
                             "choice) or False")
        for name in ("lamport_max_tokens", "timeout_sec"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"FlashInferOneSidedOptions.{name} must be a positive int or "
                                 f"None, got {value!r}")


@dataclass(frozen=True)
class _Api:
    """What the installed flashinfer offers of the one-sided class."""

    version: str
    cls: Any
    config_fields: frozenset[str]
    bound_keyword: str  # dispatch's per-call bound


def _probe_api() -> _Api:
    """ImportError (naming the extra) when flashinfer or its one-sided class is missing."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "backend 'flashinfer_nvlink_one_sided' needs flashinfer (flashinfer-python >= 0.7.2), "
            f"which is not installed ({e}); install it with: {INSTALL_HINT}") from e
    version = str(getattr(flashinfer, "__version__", "unknown"))
    try:
        from flashinfer.moe_ep import NVLinkOneSidedAlltoAll, NVLinkOneSidedConfig
    except ImportError as e:
        raise ImportError(
            f"flashinfer {version} has no flashinfer.moe_ep.NVLinkOneSidedAlltoAll (0.7.2.post1 "
            f"and later have it); install a supported version: {INSTALL_HINT}") from e
    params = inspect.signature(NVLinkOneSidedAlltoAll.dispatch).parameters
    bound = next((n for n in ("runtime_max_tokens_per_rank", "max_tokens_per_rank")
                  if n in params), None)
    if bound is None:
        raise ImportError(
            "flashinfer.moe_ep.NVLinkOneSidedAlltoAll.dispatch takes neither "
            "runtime_max_tokens_per_rank (0.7.4) nor max_tokens_per_rank (0.7.2.post1) (its "
            f"parameters: {list(params)}); install flashinfer-python 0.7.4 or 0.7.2.post1")
    return _Api(version, NVLinkOneSidedAlltoAll,
                frozenset(f.name for f in fields(NVLinkOneSidedConfig)), bound)


def _why(requested: Optional[bool]) -> str:
    return {None: "flashinfer's choice", True: "requested", False: "turned off in the options"}[
        requested]


class _OneSidedTransport(MnnvlTransport):
    """NVLinkOneSidedAlltoAll behind the MNNVL transport interface."""

    m: "FlashInferOneSidedManager"

    def __init__(self, manager: "FlashInferOneSidedManager"):
        super().__init__(manager)
        self.comm: Any = None
        self._mask: Optional[torch.Tensor] = None

    def _communication(self) -> Any:
        if self.comm is None:
            from flashinfer.fused_moe import QuantFormat
            from flashinfer.moe_ep import BootstrapConfig, MoEEpCommParams, NVLinkOneSidedConfig

            m, o = self.m, self.m.options
            params = MoEEpCommParams(
                num_experts=m.num_experts, top_k=m.num_topk,
                max_tokens_per_rank=m.max_tokens_per_rank, hidden_size=m.cfg.hidden,
                dtype=m.cfg.dtype, dispatch_format=QuantFormat[m.dispatch_format])
            wanted = dict(cft=o.cft, lamport=o.lamport, lamport_max_tokens=o.lamport_max_tokens,
                          timeout_sec=o.timeout_sec)
            config = NVLinkOneSidedConfig(
                comm_backend=TorchGroupComm(m.group), enable_rank_mask=o.enable_rank_mask,
                use_low_precision_combine=o.use_low_precision_combine,
                **{k: v for k, v in wanted.items()
                   if v is not None and k in m.api.config_fields})
            bootstrap = BootstrapConfig(world_size=m.num_ranks, rank=m.rank,
                                        process_group=m.group)
            self.comm = m.api.cls(bootstrap, params, config)
            m.log_transports(self.comm)
        return self.comm

    def _rank_mask(self, comm: Any) -> Optional[torch.Tensor]:
        """The active-rank mask of this call (flashinfer's word: 1 = active), or None without
        rank masking; our flags translated through the one contract (moe_plugins.masking)."""
        m = self.m
        if not m.options.enable_rank_mask:
            return None
        active = [r for r in range(m.num_ranks)
                  if library_word(r in m.masked, m.mask_word) == 1]
        if hasattr(comm, "active_rank_mask"):  # 0.7.4
            return comm.active_rank_mask(active)
        from flashinfer.comm import moe_a2a_active_rank_mask  # 0.7.2.post1

        return moe_a2a_active_rank_mask(active, m.num_ranks)

    def dispatch(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, tokens_per_rank: int) -> Dispatched:
        comm = self._communication()
        mask = self._rank_mask(comm)
        extra = {} if mask is None else {"active_rank_mask": mask}
        out = moe_ep_dispatch(comm, self.m.api.bound_keyword, x, x_sf, topk_ids, topk_weights,
                              tokens_per_rank, **extra)
        self._mask = mask
        return out

    def combine(self, expert_output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self.comm is None:
            raise RuntimeError("combine called without a matching dispatch")
        mask, self._mask = self._mask, None
        out = self.comm.combine(expert_output,
                                **({} if mask is None else {"active_rank_mask": mask}))
        assert out.shape[0] == num_tokens, (tuple(out.shape), num_tokens)
        return out

    def reset(self) -> None:
        # A round abandoned between dispatch and combine breaks the layer (the peers wait in
        # the combine: moe_plugins.faults), which is rebuilt with a new object.
        self._mask = None

    def destroy(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()

    def checkpoint_target(self) -> Any:
        """What holds the checkpoint methods: the object (0.7.4) or its MoeAlltoAll (0.7.2.post1);
        None before the first dispatch (nothing mapped)."""
        if self.comm is None:
            return None
        return self.comm if hasattr(self.comm, "checkpoint_prepare") else self.comm.alltoall


class FlashInferOneSidedManager(MnnvlManager):
    """One per layer config and EP group. The kernels dispatch PHYSICAL ids: physical expert
    ``p`` lives on EP rank ``p // num_local`` (``placement``, from the config).

    Raises at construction: ImportError (flashinfer or its one-sided class missing, naming the
    extra), TypeError (backend_options of another type), ValueError (one EP rank, a dtype, top-k,
    number of experts or EP size the kernels do not take). Nothing is allocated until the first
    dispatch. Rank masking (``enable_rank_mask``): :meth:`set_rank_masked` leaves a peer out of
    the next calls (nothing is sent to it, its experts count as zero), the one mask contract of
    moe-plugins (``masked=True`` masks), translated to flashinfer's active-rank mask (1 = active).
    """

    backend_name = "flashinfer_nvlink_one_sided"
    row_align_bytes = 1  # the one-sided kernels take rows of any width
    #: flashinfer's active_rank_mask: one bit per EP rank, 1 = active
    mask_word: ClassVar[MaskWord] = MaskWord.ONE_ACTIVE

    def __init__(self, ctx: DistContext, cfg: DispatchConfig):
        options = cfg.backend_options if cfg.backend_options is not None \
            else FlashInferOneSidedOptions()
        if not isinstance(options, FlashInferOneSidedOptions):
            raise TypeError(
                "backend 'flashinfer_nvlink_one_sided' takes backend_options of type "
                "FlashInferOneSidedOptions (moe_plugins.all2all.flashinfer_nvlink_one_sided), "
                f"got {type(options).__name__}")
        self.options = options
        self.api = _probe_api()
        self.flashinfer_version = self.api.version
        self._init_ep_layout(ctx, cfg)
        self.dispatch_format = self._check_config(ctx, cfg)
        self._init_ep_process_group(ctx)
        self.masked: set[int] = set()
        self._transport = _OneSidedTransport(self)

    def _check_config(self, ctx: DistContext, cfg: DispatchConfig) -> str:
        """The kernels' limits (ValueError with the fix); returns the dispatch QuantFormat."""
        ep = ctx.layout.ep_size
        limit = MAX_EP_RANKS if "cft" in self.api.config_fields else _MAX_EP_RANKS_ONE_MASK_WORD
        if ep > limit:
            raise ValueError(f"flashinfer {self.api.version}'s one-sided all-to-all runs on at "
                             f"most {limit} EP ranks, got {ep}; use fewer ranks per EP group")
        if cfg.dtype not in _UNQUANTIZED:
            raise ValueError(f"flashinfer's one-sided combine takes bfloat16 or float16 expert "
                             f"outputs, got a layer of {cfg.dtype}; build the layer in bfloat16")
        if cfg.num_topk not in SUPPORTED_TOPK:
            raise ValueError(f"flashinfer's one-sided all-to-all supports num_topk in "
                             f"{SUPPORTED_TOPK}, got {cfg.num_topk}; use another backend")
        if self.num_experts % ep:
            raise ValueError(f"flashinfer's one-sided all-to-all needs the number of physical "
                             f"experts ({self.num_experts}) divisible by the EP size ({ep}); "
                             "choose a number of redundant experts that makes it so")
        if cfg.quant.scheme is QuantScheme.NONE or not cfg.quant.quantized_on_wire:
            return _UNQUANTIZED[cfg.dtype]
        return _FORMATS[cfg.quant.scheme]

    def log_transports(self, comm: Any) -> None:
        """One INFO line per layer config: the release, the layout, and which transports the
        library agreed on and why (the library logs why one it could not use is off)."""
        o = self.options
        if "cft" in self.api.config_fields:
            lamport_max = int(getattr(comm, "lamport_max_tokens", 0))
            lamport = (f"on for steps of <= {lamport_max} tokens per rank" if lamport_max
                       else "off") + f" ({_why(o.lamport)})"
            # the library's own flag: whether this workspace holds CFT endpoints
            cft_on = bool(getattr(comm, "_cft_enabled", False))
            cft = ("on" if cft_on else "off") + f" ({_why(o.cft)})"
            for name, requested, on in (("lamport", o.lamport, lamport_max), ("cft", o.cft,
                                                                               cft_on)):
                if requested and not on:
                    logger.warning("flashinfer_nvlink_one_sided: %s was requested but is off "
                                   "(flashinfer logged why)", name)
        else:
            lamport = cft = f"not in flashinfer {self.api.version}"
            if o.cft or o.lamport:
                logger.warning("flashinfer_nvlink_one_sided: cft/lamport requested, but flashinfer "
                               "%s has the fence path only", self.api.version)
        key = (self.num_ranks, self.num_experts, self.num_topk, self.cfg.hidden,
               self.max_tokens_per_rank, self.dispatch_format, o, lamport, cft)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info("flashinfer_nvlink_one_sided: flashinfer %s, EP size %d, %d experts, "
                        "topk %d, max %d tokens per rank, dispatch %s, transports: Lamport %s, "
                        "CFT counted writes %s, fence path otherwise; rank mask %s",
                        self.api.version, self.num_ranks, self.num_experts, self.num_topk,
                        self.max_tokens_per_rank, self.dispatch_format, lamport, cft,
                        "compiled in" if o.enable_rank_mask else "off")

    # -- rank masking (moe-plugins' contract: masked=True leaves the rank out) ------------------
    def set_rank_masked(self, rank: int, masked: bool = True) -> None:
        """Stop (``masked``) or resume sending to and receiving from EP rank ``rank`` from the
        next call on; the combine then leaves out its experts. Every active rank must give the
        same mask (flashinfer's contract). ValueError without ``enable_rank_mask`` or for this
        rank itself (the kernels need the local rank active); TypeError/ValueError for a flag
        that is not a bool or 0/1 (:func:`moe_plugins.masking.checked_mask_request`)."""
        rank, masked = checked_mask_request(rank, masked, self.num_ranks,
                                            f"{self.backend_name} set_rank_masked")
        if not self.options.enable_rank_mask:
            raise ValueError("flashinfer_nvlink_one_sided was built without rank masking; build "
                             "it with FlashInferOneSidedOptions(enable_rank_mask=True)")
        if masked and rank == self.rank:
            raise ValueError(f"EP rank {rank} cannot mask itself: flashinfer's kernels need the "
                             "local rank active; mask it on its peers")
        (self.masked.add if masked else self.masked.discard)(rank)

    def masked_ranks(self) -> list[int]:
        """EP ranks this rank currently leaves out."""
        return sorted(self.masked)

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint_prepare(self) -> None:
        """Release the workspace's physical memory before a process checkpoint (collective, only
        between calls); nothing before the first dispatch."""
        target = self.transport().checkpoint_target()  # type: ignore[attr-defined]
        if target is not None:
            target.checkpoint_prepare()

    def checkpoint_restore(self) -> None:
        """Back the workspace with new memory after :meth:`checkpoint_prepare` (collective)."""
        target = self.transport().checkpoint_target()  # type: ignore[attr-defined]
        if target is not None:
            target.checkpoint_restore(TorchGroupComm(self.group))
