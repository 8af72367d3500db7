"""The call bound: an optional deadline on each layer call that ends a process stuck on a dead or
hung peer with a clear error (the watchdog), its settings and errors, the notice a failing rank
posts for its peers, and the lock-free timer over a library's host wait. docs/faults.md says
what it guarantees; :mod:`moe_plugins.callbound.watchdog` how it works;
:mod:`moe_plugins.callbound.layer_bound` which bound each call runs under."""
from moe_plugins.callbound.errors import EXIT_CODE, CallTimeoutError, PeerFailedError
from moe_plugins.callbound.fault_notice import FaultNotice, notice_for, wait_or_told
from moe_plugins.callbound.host_timer import bound_host_waits, host_wait
from moe_plugins.callbound.settings import (CALL_TIMEOUT_ENV, FIRST_CALL_TIMEOUT_ENV,
                                            MIN_TIMEOUT_S, call_timeout_seconds,
                                            first_call_timeout_seconds, parse_seconds,
                                            reread_environment)
from moe_plugins.callbound.layer_bound import CallBound
from moe_plugins.callbound.watchdog import (WatchedCall, capture_calls,
                                            expect_replay, on_call_timeout,
                                            replays_in_step_windows, watch_call, watch_step,
                                            watchdog_alive)

__all__ = ["EXIT_CODE", "CallTimeoutError", "PeerFailedError", "FaultNotice", "notice_for",
           "wait_or_told", "bound_host_waits", "host_wait", "CALL_TIMEOUT_ENV",
           "FIRST_CALL_TIMEOUT_ENV", "MIN_TIMEOUT_S", "call_timeout_seconds",
           "first_call_timeout_seconds", "parse_seconds", "reread_environment", "CallBound",
           "WatchedCall", "capture_calls",
           "expect_replay", "on_call_timeout", "replays_in_step_windows", "watch_call",
           "watch_step", "watchdog_alive"]
