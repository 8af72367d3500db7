"""Entry-point registry, capability matrix, selection errors, and a real third-party backend."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from moe_plugins import registry
from moe_plugins.backend_manager import BackendManager, RankMasking
from moe_plugins.layout import ParallelLayout
from moe_plugins.quant import QuantScheme
from moe_plugins.registry import (BackendSelectionError, BackendSpec, Capabilities, RequiredPackage,
                                  refusal_reason, select_backend)
from moe_plugins.prepare_finalize.torch import TorchPrepareFinalize

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_capability_matrix_is_built_from_registered_specs():
    assert registry.BACKEND_EP_DP_TP_SUPPORT["torch"] == (True, True, True, True)
    assert registry.BACKEND_SUPPORTED_QUANTS["torch"] == frozenset(QuantScheme)


def test_builtin_backend_comes_from_the_entry_point_of_this_distribution():
    assert registry.get_backend("torch").distribution == "moe-plugins"


def test_unknown_backend_name_lists_registered_ones():
    with pytest.raises(ValueError, match=r"unknown moe-plugins backend 'nope'; registered: \[.*'torch'"):
        registry.get_backend("nope")


def _spec(**kw: object) -> BackendSpec:
    base = dict(name="t", prepare_finalize=TorchPrepareFinalize, manager=object,
                capabilities=Capabilities(ep_dp=True, dp=True, tp=False, sp=False),
                quants=frozenset({QuantScheme.NONE}))
    return BackendSpec(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("spec,layout,quant,expected", [
    (_spec(), ParallelLayout(2, 2, True), QuantScheme.NONE, "no TP inside the EP group (tp=2)"),
    (_spec(), ParallelLayout(4, 1, True), QuantScheme.FP8_BLOCK128, "quant fp8_block128 not in ['none']"),
    (_spec(required=(RequiredPackage("moe_plugins_missing_pkg", "pip install 'moe-plugins[x]'"),)),
     ParallelLayout(4, 1, True), QuantScheme.NONE,
     "package 'moe_plugins_missing_pkg' not installed (pip install 'moe-plugins[x]')"),
])
def test_refusal_reason_says_what_is_missing(spec, layout, quant, expected):
    assert expected in (refusal_reason(spec, layout, quant) or "")


@pytest.mark.parametrize("layout", [ParallelLayout(1, 1, False), ParallelLayout(1, 2, False),
                                    ParallelLayout(2, 1, True), ParallelLayout(2, 2, True),
                                    ParallelLayout(4, 1, True)], ids=lambda l: l.describe())
@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_BLOCK128, QuantScheme.NVFP4])
def test_auto_selection_serves_every_cpu_layout_with_the_reference_backend(layout, quant):
    """On CPU every other built-in backend needs CUDA (and a vendor package): auto selection
    must give exactly the reference backend, for every layout and quant, in both dtypes."""
    others = {n for n, s in registry.registered_backends().items() if n != "torch"}
    assert others and all(registry.get_backend(n).needs_cuda for n in others)
    for dtype in (torch.float32, torch.bfloat16):
        assert select_backend(layout, quant, dtype=dtype).name == "torch"


@pytest.fixture
def third_party_backend() -> Iterator[None]:
    """Install examples/third_party_backend into this environment; uninstall afterwards."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation",
                          str(ROOT / "examples" / "third_party_backend")], check=True)
    registry.reload_backends()
    try:
        yield
    finally:
        subprocess.run(pip + ["uninstall", "-y", "moe-plugins-example-backend"], check=True)
        registry.reload_backends()


def _check_manager(spec: BackendSpec) -> None:
    """The manager class of ``spec`` against moe_plugins.backend_manager.BackendManager, by its
    signatures: what the engines call on it must bind as they call it."""
    m = spec.manager
    assert isinstance(m, type), f"{spec.name}: manager {m!r} is not a class"
    assert isinstance(m.masks_by_itself, bool), spec.name
    # as MoELayer and the vLLM glue call them: m(ctx, cfg), m.engine_options(store,
    # fault_tolerance=...), manager.destroy()
    inspect.signature(m).bind(object(), object())
    inspect.signature(m.engine_options).bind(object(), fault_tolerance=True, link=None)
    inspect.signature(m.destroy).bind(object())
    # the rank_masking capability is exactly a manager with the masking methods
    assert spec.capabilities.rank_masking == issubclass(m, RankMasking), spec.name


def _entry_point_names() -> list[str]:
    return sorted(ep.name for ep in importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP))


@pytest.mark.parametrize("name", _entry_point_names())
def test_every_registered_manager_keeps_the_manager_protocol(name):
    """Every backend of the entry-point group is registered (the loader skips one whose
    manager lacks a member) and its manager binds the calls the engines make."""
    assert name in registry.registered_backends()
    _check_manager(registry.get_backend(name))


class _NoDestroy:
    def __init__(self, ctx: object, cfg: object):
        pass


class _WithDefaults(_NoDestroy, BackendManager):
    pass


_BARE = BackendSpec(name="bare_manager", prepare_finalize=TorchPrepareFinalize,
                    manager=_NoDestroy,  # type: ignore[arg-type]
                    capabilities=Capabilities(ep_dp=True, dp=True, tp=False, sp=False),
                    quants=frozenset({QuantScheme.NONE}))
_DEFAULTS = dataclasses.replace(_BARE, name="defaults_manager", manager=_WithDefaults)


def test_a_backend_whose_manager_lacks_a_member_is_skipped_with_a_warning(monkeypatch, caplog):
    """A manager without the protocol's members would fail inside an engine (destroy at
    teardown); the loader refuses it at once, names what is missing and loads the others; the
    same class taking the protocol's defaults is loaded."""
    real = importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)
    extra = [importlib.metadata.EntryPoint(n, f"{__name__}:{v}", registry.ENTRY_POINT_GROUP)
             for n, v in (("bare_manager", "_BARE"), ("defaults_manager", "_DEFAULTS"))]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [*real, *extra])
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        specs = registry._load_entry_points()
    assert "bare_manager" not in specs and {"torch", "defaults_manager"} <= set(specs)
    assert "masks_by_itself (a bool class attribute), engine_options (a method), destroy (a " \
        "method) of moe_plugins.backend_manager.BackendManager" in caplog.text
    _check_manager(specs["defaults_manager"])


def test_third_party_backend_registers_lists_and_is_selectable(third_party_backend):
    out = subprocess.run([str(BIN / "moe-plugins"), "list", "--json"], check=True,
                         capture_output=True, text=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["example_allgather"] == dict(
        name="example_allgather", usable=True, reason=None, ep_dp=True, dp=True, tp=False,
        sp=False, placements=True, quants=["none"], distribution="moe-plugins-example-backend",
        found={})  # it requires no vendor library, so there is nothing found to name
    assert select_backend(ParallelLayout(2, 1, True), name="example_allgather").name == "example_allgather"
    _check_manager(registry.get_backend("example_allgather"))
    # and it really runs: the demo on 2 gloo ranks, checked against the reference
    demo = subprocess.run([str(BIN / "moe-plugins"), "demo", "--ranks", "2", "--ep", "--backend",
                           "example_allgather", "--json"], capture_output=True, text=True, timeout=120)
    assert demo.returncode == 0, demo.stderr
    assert [json.loads(line)["strategy"] for line in demo.stdout.splitlines()] == ["LOCAL"]


def test_unsupported_layout_lists_the_alternatives(third_party_backend):
    with pytest.raises(BackendSelectionError) as e:
        select_backend(ParallelLayout(2, 2, True), name="example_allgather")
    msg = str(e.value)
    assert "example_allgather: no TP inside the EP group (tp=2)" in msg
    # exactly the usable alternatives, as a list: on CPU that is the reference backend alone
    assert msg.splitlines()[-1].startswith("backends that would: ['torch']; ")


def _usable(name: str, priority: int, **kw: object) -> BackendSpec:
    return _spec(name=name, priority=priority,
                 capabilities=Capabilities(ep_dp=True, dp=True, tp=True, sp=True), **kw)


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch):
    """Registry contents for selection-order tests; the real one comes back afterwards."""
    def install(*specs: BackendSpec) -> None:
        monkeypatch.setattr(registry, "_registry", lambda: {s.name: s for s in specs})
    return install


def test_auto_prefers_higher_priority(fake_registry):
    fake_registry(_usable("ref", 0), _usable("fast", 30))
    assert select_backend(ParallelLayout(2, 1, True)).name == "fast"


def test_auto_skips_a_backend_whose_kernels_refuse_the_dtype(fake_registry):
    import torch

    fake_registry(_usable("ref", 0), _usable("bf16only", 30, dtypes=frozenset({torch.bfloat16})))
    assert select_backend(ParallelLayout(2, 1, True), dtype=torch.float32).name == "ref"
    assert select_backend(ParallelLayout(2, 1, True), dtype=torch.bfloat16).name == "bf16only"
    with pytest.raises(BackendSelectionError, match=r"bf16only: activations torch.float32 not in"):
        select_backend(ParallelLayout(2, 1, True), name="bf16only", dtype=torch.float32)


def test_the_backend_lists_of_the_tests_are_not_empty():
    """tests/backend_lists.py draws the lists the backend tests run over from the registry; an
    empty one (a capability no backend of ours has any more, a registry that failed to load)
    would leave its tests with no cases and pass them silently."""
    from tests import backend_lists

    for name in backend_lists.__all__:
        value = getattr(backend_lists, name)
        if isinstance(value, list):
            assert value, f"tests/backend_lists.py: {name} is empty"
            assert set(value) <= set(registry.registered_backends()), name
