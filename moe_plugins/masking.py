"""Rank masks: one meaning in our API, each library's word translated here.

**The contract.** In moe-plugins' API a rank is *masked* or not: ``masked=True`` (or 1) leaves
the rank out of dispatch and combine (its experts count as zero), ``False`` (or 0) takes it back,
and :meth:`masked_ranks` lists the masked ranks. Whatever word a library stores, that is what
our flag means, on every backend. The libraries' words differ: DeepEP's and NIXL EP's mask
buffers hold one int32 per rank, nonzero = masked (``low_latency_query_mask_buffer`` /
``query_mask_buffer``; their ``update_mask_buffer(rank, mask)`` takes True = masked);
flashinfer's ``moe_ep`` fault tolerance holds ``active_rank_mask``, 1 = active, 0 = left out.
Each backend names its library's word (:class:`MaskWord`) and translates only through
:func:`masked_from_library` / :func:`library_word`.

And the check of a rank-mask request, ``(rank, masked)``, that every masking entry point makes
before it changes any state: ``LowLatencyManager.set_rank_masked`` (deepep_ll, nixl_ep, the
low-latency half of deepep_auto) and the vLLM manager's ``update_mask``.

Why strict: a mask changes what the combine returns (a masked rank's experts count as zero), so
a flag read the wrong way is a wrong result with no error. ``bool('False')`` is True; a tensor's
truth needs a host sync and means "any" or "all" only by convention; a float 0.5 is neither.
So the flag is a bool, or the int 0 or 1 (what vLLM and the libraries' C++ bindings take), and
nothing else; the rank is a Python int (not a bool) inside the EP group.
"""
from __future__ import annotations

import enum
from typing import Sequence

__all__ = ["checked_mask_request", "MaskWord", "masked_from_library", "library_word"]


class MaskWord(enum.Enum):
    """What a library's per-rank mask word says."""

    NONZERO_MASKED = "nonzero = masked"  # DeepEP (enable_shrink), NIXL EP
    ONE_ACTIVE = "1 = active"  # flashinfer moe_ep's active_rank_mask


def masked_from_library(words: Sequence[int], word: MaskWord) -> list[int]:
    """The masked ranks (ascending) of a library mask read as ints (one per rank)."""
    if word is MaskWord.NONZERO_MASKED:
        return [r for r, w in enumerate(words) if w]
    return [r for r, w in enumerate(words) if w != 1]


def library_word(masked: bool, word: MaskWord) -> int:
    """The int a library stores for a rank whose masked flag (ours) is ``masked``."""
    if word is MaskWord.NONZERO_MASKED:
        return int(masked)
    return 0 if masked else 1


def _given(value: object) -> str:
    """What a caller passed, for an error message: the value and its type (a tensor by shape)."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return (f"a {type(value).__module__}.{type(value).__name__} of shape "
                f"{tuple(shape)} and dtype {value.dtype}")  # type: ignore[attr-defined]
    return f"{value!r} ({type(value).__name__})"


def checked_mask_request(rank: object, masked: object, num_ranks: int,
                         where: str) -> tuple[int, bool]:
    """``(rank, masked)`` as ``(int, bool)``, or raise before anything changes.

    rank: a Python ``int`` (not a bool) in ``[0, num_ranks)``; masked: a ``bool``, or the int
    ``0`` or ``1``. Anything else (strings, floats, None, tensors of any shape, numpy scalars)
    raises TypeError, an int out of range ValueError; each message says what was given, what
    is accepted and the fix. ``where``: the entry point, named in the message."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(
            f"{where}: rank must be a Python int, an EP rank in [0, {num_ranks}); got "
            f"{_given(rank)}. Pass the rank as an int (int(t.item()) for a one-element tensor)")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"{where}: rank must be an EP rank in [0, {num_ranks}); got {rank}. "
                         f"Pass the rank of a peer in this EP group of {num_ranks} ranks")
    if isinstance(masked, bool):
        return rank, masked
    if not isinstance(masked, int):
        raise TypeError(
            f"{where}: masked must be a bool (True masks the rank, False takes it back) or the "
            f"int 0 or 1; got {_given(masked)}. Pass masked=True or masked=False (a string is "
            "not parsed: bool('False') is True; a tensor: bool(t.item()))")
    if masked not in (0, 1):
        raise ValueError(f"{where}: masked must be a bool or the int 0 or 1; got {masked}. "
                         "Pass masked=True or masked=False")
    return rank, bool(masked)
