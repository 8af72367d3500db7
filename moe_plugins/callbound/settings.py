"""The settings of the call bound (:mod:`moe_plugins.callbound.watchdog`): the bound and the
start-up bound, from an argument, a CLI flag or the environment, through one parser.

What every source accepts (:func:`parse_seconds`): 0 in any spelling (``0``, ``0.0``, ``-0``,
``0e3``, surrounding blanks) means "off" (for the start-up bound: "the call bound itself"); a
finite number of seconds >= :data:`MIN_TIMEOUT_S` is the bound; anything else is refused with a
ValueError/TypeError that names the source and lists these forms, ``off``, ``none``, a negative
or non-finite number, and a nonzero number below the floor (``1e-400``, which a float rounds to
0, included) among them. An environment variable that is empty (or only blanks) counts as unset,
for both variables: the call bound is then off and the start-up bound its default.

The environment is read once per process, on first use (:func:`environment_seconds`): every
layer of a process, the vLLM glue's included, sees the same values. A process that changes the
variables after that (a test, a benchmark building layers with and without the bound) calls
:func:`reread_environment`.
"""
from __future__ import annotations

import decimal
import math
import os
from typing import Optional, Union

__all__ = ["CALL_TIMEOUT_ENV", "FIRST_CALL_TIMEOUT_ENV", "POLL_S", "MIN_TIMEOUT_S",
           "parse_seconds", "environment_seconds", "reread_environment",
           "call_timeout_seconds", "first_call_timeout_seconds"]

CALL_TIMEOUT_ENV = "MOE_PLUGINS_CALL_TIMEOUT_S"
FIRST_CALL_TIMEOUT_ENV = "MOE_PLUGINS_FIRST_CALL_TIMEOUT_S"
#: Seconds between the watchdog's checks: the error comes at most this late after the bound.
POLL_S = 0.2
#: The smallest bound accepted (seconds): below it a healthy call on a busy host is overdue.
MIN_TIMEOUT_S = 0.5
#: Start-up bound when none is given: this many call bounds, and at least _FIRST_FLOOR_S.
_FIRST_FACTOR, _FIRST_FLOOR_S = 10.0, 600.0

#: What a 0 means, per setting (named in every refusal).
CALL_OFF = "turns the bound off"
FIRST_OFF = "runs the first calls under the call bound"

Seconds = Union[int, float, str]


def _refused(source: str, shown: str, problem: str, off_meaning: str) -> ValueError:
    return ValueError(
        f"{source}={shown} {problem}; accepted: 0 in any spelling (0, 0.0, -0) {off_meaning}, "
        f"or a finite number of seconds >= {MIN_TIMEOUT_S:g}, e.g. 30")


def parse_seconds(given: Seconds, source: str, off_meaning: str = CALL_OFF) -> Optional[float]:
    """One bound setting as seconds: None for 0 in any spelling (off), else a finite float >=
    :data:`MIN_TIMEOUT_S`. ``given``: an int or float, or its text (an environment variable, a
    CLI flag, or the argument given as text). ``source`` names it in the errors (``$NAME``,
    ``--flag``, ``name``); ``off_meaning``: what a 0 means there. Raises TypeError for any other
    type, ValueError for any other value; each message lists the accepted forms. Whether a
    value is zero is decided on its decimal text, so ``1e-400`` (a float 0.0) is refused as
    below the floor, not taken as off; the value is shown as given (``0.4999999`` stays that)."""
    if isinstance(given, str):
        shown = repr(given.strip())
        try:
            exact = decimal.Decimal(given.strip())
        except decimal.InvalidOperation:
            raise _refused(source, shown, "is not a number of seconds", off_meaning) from None
        if exact.is_nan():
            raise _refused(source, shown, "is not a number of seconds", off_meaning)
        is_zero = exact.is_zero()
        value = float(exact)
    elif isinstance(given, (int, float)) and not isinstance(given, bool):
        shown = repr(given)
        if len(shown) > 40:  # an int of hundreds of digits: its start and its size
            shown = f"{shown[:8]}... ({len(shown)} digits)"
        try:
            is_zero, value = given == 0, float(given)
        except OverflowError:  # an int past any float: 10**400
            raise _refused(source, shown, "is not finite (too large for seconds)",
                           off_meaning) from None
        if math.isnan(value):
            raise _refused(source, shown, "is not a number of seconds", off_meaning)
    else:
        raise TypeError(
            f"{source} must be a number of seconds (an int or float, or its text), got "
            f"{given!r} ({type(given).__name__}); pass 0 to turn it off ({off_meaning}) or a "
            f"finite number >= {MIN_TIMEOUT_S:g}, e.g. 30")
    if is_zero:
        return None
    if math.isinf(value):
        raise _refused(source, shown, "is not finite", off_meaning)
    if value < 0:
        raise _refused(source, shown, "is negative", off_meaning)
    if value < MIN_TIMEOUT_S:
        raise _refused(source, shown,
                       f"is below the floor of {MIN_TIMEOUT_S:g} s (the watchdog checks every "
                       f"{POLL_S:g} s and a healthy call on a busy host takes longer, so such a "
                       "bound would end healthy ranks while blaming a peer)", off_meaning)
    return value


class _Unset:
    """An environment variable that is not set, or empty."""


UNSET = _Unset()
_READ: dict[str, Union[Optional[float], _Unset]] = {}  # variable -> its parsed value


def environment_seconds(name: str) -> Union[Optional[float], _Unset]:
    """``$name`` (:data:`CALL_TIMEOUT_ENV` or :data:`FIRST_CALL_TIMEOUT_ENV`) parsed by
    :func:`parse_seconds`, read on the first call in this process and kept (a value that is
    refused is read again, and refused again, next time): :data:`UNSET` when the variable is
    not set or empty, None for 0, else seconds."""
    if name in _READ:
        return _READ[name]
    raw = os.environ.get(name, "")
    off = FIRST_OFF if name == FIRST_CALL_TIMEOUT_ENV else CALL_OFF
    value = UNSET if not raw.strip() else parse_seconds(raw, f"${name}", off)
    _READ[name] = value
    return value


def reread_environment() -> None:
    """Forget the values read from the environment: the next use reads the variables again.
    For a process that changes them after a layer was built (tests, benchmarks); a layer built
    before keeps the bound it was built with."""
    _READ.clear()


def call_timeout_seconds(given: Optional[Seconds] = None) -> Optional[float]:
    """The call bound in seconds, or None (off): ``given`` (0: off, whatever the environment
    says), else ``$MOE_PLUGINS_CALL_TIMEOUT_S``, else off (:func:`parse_seconds`)."""
    if given is not None:
        return parse_seconds(given, "call_timeout_s", CALL_OFF)
    value = environment_seconds(CALL_TIMEOUT_ENV)
    return None if isinstance(value, _Unset) else value


def first_call_timeout_seconds(call_timeout_s: Optional[float],
                               given: Optional[Seconds] = None,
                               bound_why: str = "") -> Optional[float]:
    """The start-up bound (seconds) of a layer whose call bound is ``call_timeout_s`` (None: off,
    then this is None too, the setting still checked): ``given``, else
    ``$MOE_PLUGINS_FIRST_CALL_TIMEOUT_S``, else ``max(10 x call_timeout_s, 600)``; 0 means no
    separate start-up bound (the call bound). It must not be below the call bound in force,
    the user's or, with none set, the backstop (``bound_why`` says which): ValueError naming its
    source, the bound and where it comes from."""
    if given is not None:
        source, first = "first_call_timeout_s", parse_seconds(given, "first_call_timeout_s",
                                                              FIRST_OFF)
    else:
        source, value = f"${FIRST_CALL_TIMEOUT_ENV}", environment_seconds(FIRST_CALL_TIMEOUT_ENV)
        if isinstance(value, _Unset):
            return (None if call_timeout_s is None
                    else max(_FIRST_FACTOR * call_timeout_s, _FIRST_FLOOR_S))
        first = value
    if call_timeout_s is None:
        return None
    if first is None:
        return call_timeout_s
    if first < call_timeout_s:
        raise ValueError(f"{source}={first!r} s is below the call bound in force "
                         f"({call_timeout_s:g} s{bound_why or ', as set'}): the start-up bound "
                         "covers a layer's slow first calls and is never below the call bound; "
                         f"give at least {call_timeout_s:g}, e.g. 600, or 0 to run the first "
                         "calls under the call bound")
    return first
