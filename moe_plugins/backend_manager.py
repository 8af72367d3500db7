"""The backend manager's contract: what an engine (:class:`moe_plugins.runner.layer.MoELayer`,
the vLLM glue) uses of the object that owns a backend's process groups, library buffers and
workspaces (:class:`BackendManager`), and the optional rank-masking members a manager whose
library can leave EP ranks out implements (:class:`RankMasking`). The prepare/finalize built on a
manager is the other half of a backend (:mod:`moe_plugins.interface`).
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Protocol, runtime_checkable

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import DistContext

__all__ = ["BackendManager", "RankMasking", "manager_gaps"]


class BackendManager(Protocol):
    """A backend's communication manager (``BackendSpec.manager``), one per layer config and EP
    group: it owns what the calls need (process groups, library buffers, workspaces), and the
    prepare/finalize built on it (``BackendSpec.prepare_finalize(manager, cfg)``) makes the
    calls. These members are what the engines (:class:`moe_plugins.runner.layer.MoELayer`, the
    vLLM glue) use of a manager; a manager that can mask EP ranks also implements
    :class:`RankMasking`.

    A manager class may subclass this protocol to take the defaults below (every built-in one
    does); one that does not must define every member itself: the registry skips a backend
    whose manager lacks one, with a WARNING naming it (:func:`manager_gaps`).
    """

    #: True when the library masks a failed peer by itself (NIXL EP: a peer whose kernels time
    #: out), so an engine's fault tolerance polls the mask even where the user did not turn it
    #: on (vLLM: ``support_fault_tolerance``). Only read for backends with ``rank_masking``.
    masks_by_itself: ClassVar[bool] = False

    def __init__(self, ctx: DistContext, cfg: DispatchConfig) -> None:
        """Build for the layer config ``cfg`` over the EP group of ``ctx``. Raises ImportError
        naming the extra when a package is missing, ValueError/TypeError for a config the
        backend cannot serve (before any collective); may then be collective over the EP group
        (a library buffer)."""

    @classmethod
    def engine_options(cls, tcp_store: Any, fault_tolerance: bool = False,
                       link: Optional[Any] = None) -> Optional[object]:
        """The ``DispatchConfig.backend_options`` an engine (the vLLM glue) builds this backend
        with when the user gave none. ``tcp_store``: a ``torch.distributed.Store`` shared by the
        EP group, for libraries that exchange connection metadata through one;
        ``fault_tolerance``: the engine will poll the rank mask (:class:`RankMasking`), so the
        buffer must have one; ``link``: the engine's link model (a
        ``moe_plugins.planner.link_model.LinkModel``; vLLM: ``--additional-config``), for a
        backend that takes one (``deepep_auto``); others ignore it. Returns the backend's options
        object, or None for its defaults."""
        return None

    def destroy(self) -> None:
        """Release what the manager holds (its share of a library buffer, workspaces);
        idempotent. The layer (``MoELayer.destroy``) and the engine (vLLM's communicator
        teardown) call it; a prepare/finalize built on the manager is unusable afterwards."""


def manager_gaps(manager: object) -> list[str]:
    """What the class ``manager`` lacks of :class:`BackendManager`: one line per member that is
    missing or of another kind (a bool where the protocol's is a bool, else a callable); []
    when it conforms. The registry checks every backend's manager with it."""
    if not isinstance(manager, type):
        return [f"{manager!r} is not a class"]
    gaps = []
    for name in _MANAGER_MEMBERS:
        want_bool = isinstance(vars(BackendManager)[name], bool)
        have = getattr(manager, name, None)
        if not (isinstance(have, bool) if want_bool else callable(have)):
            gaps.append(f"{name} ({'a bool class attribute' if want_bool else 'a method'})")
    return gaps


# the protocol's members, in the order declared (the dunders and typing's own names left out)
_MANAGER_MEMBERS = tuple(n for n in vars(BackendManager) if not n.startswith("_"))


@runtime_checkable
class RankMasking(Protocol):
    """A backend manager whose library can leave EP ranks out of dispatch and combine (their
    experts then count as zero): what vLLM's fault tolerance polls and recovers through
    (``query_fault``, ``clean_buffers``, ``update_mask``; moe_plugins.vllm.manager)."""

    def can_mask(self) -> bool:
        """Whether this manager's buffer has a rank mask at all."""
        ...

    def masked_ranks(self) -> list[int]:
        """EP ranks masked in the library's mask now."""
        ...

    def set_rank_masked(self, rank: int, masked: bool = True) -> None:
        """Stop (``masked``) or resume sending to and receiving from EP rank ``rank``: an int
        in [0, EP size); ``masked``: a bool or the int 0/1. Anything else is refused before
        the mask changes (:func:`moe_plugins.masking.checked_mask_request`)."""
        ...

    def clean_buffers(self) -> None:
        """After a fault, rank-local: zero the library's buffers and unmask every rank."""
        ...

    def masked_by_library(self) -> list[int]:
        """EP ranks masked that no caller masked (:meth:`set_rank_masked`): the library masked
        them by itself (a peer that did not answer within its timeout), so a call since then
        left their experts out of its result; [] for a buffer without a mask."""
        ...
