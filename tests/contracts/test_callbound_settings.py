"""moe_plugins.callbound.settings: one parser for the call bound and the start-up bound, from the
argument, ``--call-timeout-s`` and the environment; the environment read once per process.
(``moe-plugins demo`` refusing a bad value before its ranks start: tests/test_cli.py.)"""
from __future__ import annotations

import math

import pytest

from moe_plugins.callbound import CallBound, reread_environment
from moe_plugins.callbound.settings import (CALL_TIMEOUT_ENV, FIRST_CALL_TIMEOUT_ENV,
                                            MIN_TIMEOUT_S, call_timeout_seconds,
                                            first_call_timeout_seconds, parse_seconds)

ACCEPTED = "accepted: 0 in any spelling (0, 0.0, -0)"
ZEROS = ["0", "0.0", "00", "-0", "+0", "  0 ", "0e3", "0.000", 0, 0.0, -0.0]
# (value, the text the message shows it as, what it says)
REFUSED = [
    ("off", "'off'", "is not a number of seconds"),
    ("none", "'none'", "is not a number of seconds"),
    ("None", "'None'", "is not a number of seconds"),
    ("soon", "'soon'", "is not a number of seconds"),
    ("30s", "'30s'", "is not a number of seconds"),
    ("0x10", "'0x10'", "is not a number of seconds"),
    ("nan", "'nan'", "is not a number of seconds"),
    ("inf", "'inf'", "is not finite"),
    ("-inf", "'-inf'", "is not finite"),
    ("1e400", "'1e400'", "is not finite"),
    ("-3", "'-3'", "is negative"),
    ("-0.5", "'-0.5'", "is negative"),
    ("1e-400", "'1e-400'", "is below the floor of 0.5 s"),  # a float rounds it to 0: not off
    ("0.4999999", "'0.4999999'", "is below the floor of 0.5 s"),
    ("0.001", "'0.001'", "is below the floor of 0.5 s"),
    (math.nan, "nan", "is not a number of seconds"),
    (math.inf, "inf", "is not finite"),
    (-1.5, "-1.5", "is negative"),
    (-1, "-1", "is negative"),
    (5e-324, "5e-324", "is below the floor of 0.5 s"),
    (0.4999999, "0.4999999", "is below the floor of 0.5 s"),
    (0.001, "0.001", "is below the floor of 0.5 s"),
]


@pytest.mark.parametrize("given", ZEROS, ids=repr)
def test_zero_in_any_spelling_is_off_in_every_source(given, monkeypatch):
    assert parse_seconds(given, "x") is None
    assert call_timeout_seconds(given) is None
    if isinstance(given, str):
        monkeypatch.setenv(CALL_TIMEOUT_ENV, given)
        monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, given)
        assert call_timeout_seconds() is None
        assert first_call_timeout_seconds(5.0) == 5.0  # 0: the first calls under the call bound


@pytest.mark.parametrize("given,value", [("30", 30.0), (" 30 ", 30.0), ("0.5", 0.5), (0.5, 0.5),
                                         (MIN_TIMEOUT_S, MIN_TIMEOUT_S), (2, 2.0),
                                         ("1e1", 10.0), ("600.25", 600.25)])
def test_a_finite_number_at_or_above_the_floor_is_the_bound(given, value):
    got = parse_seconds(given, "x")
    assert got == value and type(got) is float


@pytest.mark.parametrize("given,shown,problem", REFUSED, ids=[repr(r[0]) for r in REFUSED])
def test_anything_else_is_refused_with_the_accepted_forms(given, shown, problem, monkeypatch):
    with pytest.raises(ValueError) as e:
        call_timeout_seconds(given)
    text = str(e.value)
    assert text.startswith(f"call_timeout_s={shown} {problem}"), text
    assert ACCEPTED in text and "turns the bound off" in text and ">= 0.5" in text
    if isinstance(given, str):  # the same from either variable, naming it
        monkeypatch.setenv(CALL_TIMEOUT_ENV, given)
        with pytest.raises(ValueError, match=f"^\\${CALL_TIMEOUT_ENV}={shown} {problem}"):
            call_timeout_seconds()
        monkeypatch.delenv(CALL_TIMEOUT_ENV)
        monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, given)
        with pytest.raises(ValueError) as first:
            first_call_timeout_seconds(5.0)
        assert str(first.value).startswith(f"${FIRST_CALL_TIMEOUT_ENV}={shown} {problem}")
        assert "runs the first calls under the call bound" in str(first.value)


def test_the_below_floor_message_shows_the_value_as_given():
    with pytest.raises(ValueError) as e:
        call_timeout_seconds(0.4999999)
    assert "0.4999999" in str(e.value) and "=0.5 " not in str(e.value)


@pytest.mark.parametrize("given", [True, False, None, [30], b"30"], ids=repr)
def test_other_types_are_a_type_error(given):
    with pytest.raises(TypeError, match="must be a number of seconds"):
        parse_seconds(given, "call_timeout_s")  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["", "   "])
def test_an_empty_variable_counts_as_unset_for_both(monkeypatch, raw):
    """docs/faults.md: the call bound off, the start-up bound its default."""
    monkeypatch.setenv(CALL_TIMEOUT_ENV, raw)
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, raw)
    assert call_timeout_seconds() is None
    assert first_call_timeout_seconds(5.0) == 600.0
    assert first_call_timeout_seconds(100.0) == 1000.0


def test_the_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(CALL_TIMEOUT_ENV, "30")
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "90")
    assert call_timeout_seconds(5) == 5.0
    assert call_timeout_seconds("7") == 7.0
    assert call_timeout_seconds() == 30.0
    assert call_timeout_seconds(0) is None  # the argument's 0 turns it off despite the env
    assert first_call_timeout_seconds(5.0, 20) == 20.0
    assert first_call_timeout_seconds(5.0) == 90.0


def test_the_start_up_bound(monkeypatch):
    monkeypatch.delenv(FIRST_CALL_TIMEOUT_ENV, raising=False)
    assert first_call_timeout_seconds(None) is None
    assert first_call_timeout_seconds(5.0) == 600.0
    assert first_call_timeout_seconds(100.0) == 1000.0
    with pytest.raises(ValueError, match=r"first_call_timeout_s=2.0 s is below the call bound"):
        first_call_timeout_seconds(5.0, 2)
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "2")
    reread_environment()  # read once per process: unset above
    with pytest.raises(ValueError, match=r"FIRST_CALL_TIMEOUT_S=2.0 s is below the call bound"):
        first_call_timeout_seconds(5.0)
    assert CallBound("layer", 5.0, 30.0).describe() == "5 s (first calls 30 s)"
    assert CallBound("layer", 0).describe() == "off"


def test_a_bad_start_up_value_is_refused_with_the_bound_off_too(monkeypatch):
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "off")
    with pytest.raises(ValueError, match="'off' is not a number of seconds"):
        first_call_timeout_seconds(None)
    with pytest.raises(ValueError, match="'off' is not a number of seconds"):
        CallBound("layer", 0)


def test_the_environment_is_read_once_per_process_until_reread(monkeypatch):
    monkeypatch.setenv(CALL_TIMEOUT_ENV, "30")
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "90")
    assert call_timeout_seconds() == 30.0 and first_call_timeout_seconds(30.0) == 90.0
    monkeypatch.setenv(CALL_TIMEOUT_ENV, "40")
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "off")
    assert call_timeout_seconds() == 30.0 and first_call_timeout_seconds(30.0) == 90.0
    assert CallBound("layer").describe() == "30 s (first calls 90 s)"
    reread_environment()
    assert call_timeout_seconds() == 40.0
    with pytest.raises(ValueError, match="'off'"):
        first_call_timeout_seconds(40.0)
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "0")  # a refused value is not kept: read again
    assert first_call_timeout_seconds(40.0) == 40.0


@pytest.mark.parametrize("given", [10**400, -10**400])
def test_an_int_too_large_for_a_float_is_refused_by_name(given):
    """An int past any float (OverflowError in float()) is refused as not finite, shown by its
    start and size, as every other refused value: a ValueError naming the argument."""
    from moe_plugins.callbound.settings import call_timeout_seconds

    with pytest.raises(ValueError) as e:
        call_timeout_seconds(given)
    assert str(e.value).startswith(f"call_timeout_s={str(given)[:8]}... (")
    assert "is not finite" in str(e.value) and "e.g. 30" in str(e.value)


@pytest.mark.parametrize("start_up", [True, False], ids=["vllm-adapter", "moe-layer"])
def test_a_start_up_bound_below_the_backstop_is_refused_alike_with_what_the_bound_is(
        monkeypatch, start_up):
    """One rule for the vLLM adapter (start_up=True: its first calls keep a start-up window)
    and MoELayer (start_up=False): with no call bound set, a start-up bound below the backstop
    is refused, and the message says that the bound in force is the backstop, not a bound the
    user set, and what to give."""
    monkeypatch.delenv(CALL_TIMEOUT_ENV, raising=False)
    monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "30")
    reread_environment()
    try:
        with pytest.raises(ValueError) as e:
            CallBound("layer").backstop("deepep_ll", 100.0, True, start_up=start_up)
        assert str(e.value) == (
            "$MOE_PLUGINS_FIRST_CALL_TIMEOUT_S=30.0 s is below the call bound in force (90 s: "
            "no call bound was set; this is moe-plugins' backstop under deepep_ll's 100 s "
            "timeout): the start-up bound covers a layer's slow first calls and is never below "
            "the call bound; give at least 90, e.g. 600, or 0 to run the first calls under the "
            "call bound")
        monkeypatch.setenv(FIRST_CALL_TIMEOUT_ENV, "120")
        reread_environment()
        bound = CallBound("layer")
        bound.backstop("deepep_ll", 100.0, True, start_up=start_up)
        assert bound.first_timeout_s == (120.0 if start_up else 90.0)
    finally:
        monkeypatch.delenv(FIRST_CALL_TIMEOUT_ENV)
        reread_environment()
