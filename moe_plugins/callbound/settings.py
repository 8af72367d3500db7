"""The settings of the call bound (:mod:`moe_plugins.callbound.watchdog`): the bound and the start-up
bound, from an argument or the environment, checked with errors that name their source."""
from __future__ import annotations

import math
import os
from typing import Optional, Union

__all__ = ["CALL_TIMEOUT_ENV", "FIRST_CALL_TIMEOUT_ENV", "POLL_S", "MIN_TIMEOUT_S",
           "call_timeout_seconds", "first_call_timeout_seconds"]

CALL_TIMEOUT_ENV = "MOE_PLUGINS_CALL_TIMEOUT_S"
FIRST_CALL_TIMEOUT_ENV = "MOE_PLUGINS_FIRST_CALL_TIMEOUT_S"
#: Seconds between the watchdog's checks: the error comes at most this late after the bound.
POLL_S = 0.2
#: The smallest bound accepted (seconds): below it a healthy call on a busy host is overdue.
MIN_TIMEOUT_S = 0.5
#: Start-up bound when none is given: this many call bounds, and at least _FIRST_FLOOR_S.
_FIRST_FACTOR, _FIRST_FLOOR_S = 10.0, 600.0


# -- the bound and the start-up bound --------------------------------------------------------------
def _seconds(given: Union[float, int, str, None], source: str, off_hint: str) -> Optional[float]:
    """``given`` seconds as a float: None and any zero (``0``, ``0.0``, ``-0``) are off (None);
    otherwise a finite number >= MIN_TIMEOUT_S (ValueError/TypeError naming ``source``). Text is
    parsed only from the environment (a ``source`` starting with ``$``)."""
    if isinstance(given, str) and source.startswith("$"):
        text = given.strip()
        if text.lower() in ("", "off", "none"):
            return None
        try:
            given = float(text)
        except ValueError:
            raise ValueError(f"{source}={text!r} is not a number of seconds; give a bound in "
                             f"seconds, e.g. 30, or 0 {off_hint}") from None
    if given is None:
        return None
    if isinstance(given, bool) or not isinstance(given, (int, float)):
        raise TypeError(f"{source} must be a number of seconds or None, got {given!r} "
                        f"({type(given).__name__})")
    if given == 0:  # 0, 0.0 and -0 alike
        return None
    if not math.isfinite(given) or given < 0:
        raise ValueError(f"{source}={given!r}: expected a finite number of seconds >= "
                         f"{MIN_TIMEOUT_S:g}, e.g. 30 (0 {off_hint})")
    if given < MIN_TIMEOUT_S:
        raise ValueError(f"{source}={given:g} s is below the floor of {MIN_TIMEOUT_S:g} s: the "
                         f"watchdog checks every {POLL_S:g} s and a healthy call on a busy host "
                         "takes longer, so such a bound would end healthy ranks while blaming a "
                         f"peer; give a bound well above a forward step's time, e.g. 30 (0 "
                         f"{off_hint})")
    return float(given)


def call_timeout_seconds(given: Optional[float] = None) -> Optional[float]:
    """The call bound in seconds, or None (off): ``given``, else ``$MOE_PLUGINS_CALL_TIMEOUT_S``,
    else off. 0 (``0``, ``0.0``, ``-0``) turns it off in either (the argument's 0 overrides the
    environment); ``off``/``none``/empty in the environment too. Anything else must be a finite
    number of seconds >= :data:`MIN_TIMEOUT_S` (ValueError/TypeError naming its source)."""
    if given is None:
        return _seconds(os.environ.get(CALL_TIMEOUT_ENV, ""), f"${CALL_TIMEOUT_ENV}",
                        "turns the bound off")
    return _seconds(given, "call_timeout_s", "turns the bound off")


def first_call_timeout_seconds(call_timeout_s: Optional[float],
                               given: Optional[float] = None) -> Optional[float]:
    """The start-up bound (seconds) of a layer whose call bound is ``call_timeout_s`` (None: off,
    then this is None too): ``given``, else ``$MOE_PLUGINS_FIRST_CALL_TIMEOUT_S``, else
    ``max(10 x call_timeout_s, 600)``; 0 means no separate start-up bound (the call bound). It
    must not be below the call bound (ValueError naming its source)."""
    if call_timeout_s is None:
        return None
    source = "first_call_timeout_s"
    if given is None:
        raw = os.environ.get(FIRST_CALL_TIMEOUT_ENV, "").strip()
        if not raw:
            return max(_FIRST_FACTOR * call_timeout_s, _FIRST_FLOOR_S)
        source, given = f"${FIRST_CALL_TIMEOUT_ENV}", raw  # type: ignore[assignment]
    first = _seconds(given, source, "runs the first calls under the call bound")
    if first is None:
        return call_timeout_s
    if first < call_timeout_s:
        raise ValueError(f"{source}={first:g} s is below the call bound ({call_timeout_s:g} s): "
                         "the start-up bound covers the slow first calls, so give at least the "
                         "call bound, e.g. 600")
    return first
