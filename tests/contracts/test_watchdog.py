"""moe_plugins.watchdog's settings: the bound comes from the argument, else the environment, and
anything that is not a positive finite number of seconds is a clear error naming its source.
(The watchdog ending a process is tested on real ranks: tests/vllm_glue/test_vllm_faults.py and
the reduced EP matrix's fault-hang-watchdog job; on the GPU, the matrix's kill faults.)"""
from __future__ import annotations

import math

import pytest

from moe_plugins.watchdog import CALL_TIMEOUT_ENV, call_timeout_seconds, watch_call


def test_the_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(CALL_TIMEOUT_ENV, "30")
    assert call_timeout_seconds(5) == 5.0
    assert call_timeout_seconds() == 30.0


@pytest.mark.parametrize("raw", ["", "0", "off", "None"])
def test_off_by_default_and_by_the_environment(monkeypatch, raw):
    monkeypatch.setenv(CALL_TIMEOUT_ENV, raw)
    assert call_timeout_seconds() is None
    assert watch_call("layer", 1, None) is None  # nothing watched, no thread needed


@pytest.mark.parametrize("given,error,match", [
    (0, ValueError, "call_timeout_s=0"), (-1.5, ValueError, "expected seconds > 0"),
    (math.inf, ValueError, "finite"), (math.nan, ValueError, "finite"),
    ("30", TypeError, "number of seconds or None, got '30'"), (True, TypeError, "bool"),
])
def test_a_bad_argument_is_a_clear_error(given, error, match):
    with pytest.raises(error, match=match):
        call_timeout_seconds(given)


@pytest.mark.parametrize("raw,match", [("soon", "is not a number of seconds"),
                                       ("-3", r"\$MOE_PLUGINS_CALL_TIMEOUT_S=-3.0"),
                                       ("inf", "finite")])
def test_a_bad_environment_value_names_the_variable(monkeypatch, raw, match):
    monkeypatch.setenv(CALL_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=match):
        call_timeout_seconds()


def test_a_completed_call_is_no_longer_watched():
    """A call that ended on CPU is finished at once; the watchdog drops it at its next poll."""
    import torch

    call = watch_call("layer", 1, 60.0)
    assert call is not None and not call.finished()
    call.end(torch.device("cpu"))
    assert call.finished()


def test_a_capture_under_the_bound_is_not_watched_and_says_so_once(monkeypatch, caplog):
    """CUDA-graph replays make no host call: a capture is not watched, and the one WARNING says
    that the bound does not cover its replays (the CUDA runtime's answer stood in on CPU)."""
    import logging

    import torch

    from moe_plugins import watchdog

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(watchdog, "_WARNED_CAPTURE", [])
    with caplog.at_level(logging.WARNING, logger="moe_plugins.watchdog"):
        assert watch_call("layer", 1, 30.0) is None
        assert watch_call("layer", 2, 30.0) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "does not cover CUDA-graph replays" in warnings[0], warnings
