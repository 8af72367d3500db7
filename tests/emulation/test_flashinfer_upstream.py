"""The flashinfer emulation (tests/emulation/flashinfer_two_sided.py, flashinfer_one_sided.py,
flashinfer_mnnvl.py) against the published wheels' source, per release
(tests/emulation/flashinfer_upstream.py): every class, method, dataclass field, enum member,
function and module name the emulation presents is upstream's, with upstream's parameters,
defaults and kinds, and it presents everything our backends (all2all/flashinfer_nvlink_two_sided.py,
all2all/flashinfer_nvlink_one_sided.py) use. Single process, no ranks."""
from __future__ import annotations

import dataclasses
import enum
import inspect
import types
from typing import Any

import pytest

from tests.emulation import flashinfer_two_sided as fi
from tests.emulation.flashinfer_upstream import MODULES, UPSTREAM, effective_methods

#: What all2all/flashinfer_nvlink_two_sided.py calls or reads, per class: every release that has the class has
#: these, and the emulation of that release presents them.
CALLED = {
    "Mapping": {"__init__"},
    "MnnvlConfig": set(),
    "MnnvlMemory": {"initialize"},
    "MnnvlMoe": {"get_moe_workspaces", "get_moe_prepare_workspace",
                 "mnnvl_moe_alltoallv_prepare_without_allgather", "mnnvl_moe_alltoallv",
                 "mnnvl_moe_alltoallv_combine"},
    "BootstrapConfig": set(),
    "MoEEpCommParams": set(),
    "MoEEpDispatchResult": set(),
    "NVLinkTwoSidedConfig": set(),
    "NVLinkTwoSidedAlltoAll": {"__init__", "dispatch", "combine", "destroy"},
    # all2all/flashinfer_nvlink_one_sided.py (and the release-specific members below)
    "NVLinkOneSidedConfig": set(),
    "NVLinkOneSidedAlltoAll": {"__init__", "dispatch", "combine", "destroy",
                               "get_combine_input_buffer"},
    "QuantFormat": set(),
    # vLLM's in-tree managers' communicator (vllm/distributed/device_communicators/mnnvl_compat.py)
    # subclasses it; the vLLM tests run those managers on the emulation
    "CommBackend": {"Get_rank", "Get_size", "allgather", "bcast", "barrier", "Split"},
}
#: What the one-sided backend uses of one release only: 0.7.2.post1's checkpoints and mask
#: helper sit on the wrapped MoeAlltoAll (``alltoall``) and in flashinfer.comm; 0.7.4 has them
#: on the class, with the transports' switches on the config.
RELEASE_ONLY = {
    "0.7.2.post1": dict(methods={"alltoall"}, fields=set(),
                        functions={"moe_a2a_active_rank_mask"}),
    "0.7.4": dict(methods={"active_rank_mask", "checkpoint_prepare", "checkpoint_restore",
                           "lamport_enabled"},
                  fields={"cft", "lamport", "lamport_max_tokens"}, functions=set()),
}
#: The dataclass fields our backend passes or reads.
FIELDS_USED = {
    "MnnvlConfig": {"comm_backend"},
    "BootstrapConfig": {"world_size", "rank", "process_group"},
    "MoEEpCommParams": {"num_experts", "top_k", "max_tokens_per_rank", "hidden_size", "dtype",
                        "dispatch_format", "invalid_expert_id"},
    "MoEEpDispatchResult": {"hidden_states", "hidden_states_scale", "topk_ids", "topk_weights"},
    "NVLinkTwoSidedConfig": {"comm_backend"},
    "NVLinkOneSidedConfig": {"comm_backend", "enable_rank_mask", "extra_payload_bytes_per_token",
                             "use_low_precision_combine"},
}
_KINDS = {inspect.Parameter.POSITIONAL_ONLY: "pos", inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
          inspect.Parameter.KEYWORD_ONLY: "kw", inspect.Parameter.VAR_POSITIONAL: "*",
          inspect.Parameter.VAR_KEYWORD: "**"}
_DUNDERS = ("__init__", "__post_init__", "__del__", "__eq__", "__hash__")


def _parameters(f: Any) -> tuple:
    return tuple((p.name, None if p.default is p.empty else repr(p.default), _KINDS[p.kind])
                 for p in inspect.signature(f).parameters.values()
                 if p.name not in ("self", "cls"))


def _methods(cls: type) -> dict[str, tuple]:
    """The emulated class's methods as flashinfer_upstream records them (a dataclass's
    generated methods left out: its fields stand for them)."""
    generated = {"__init__", "__eq__", "__hash__"} if dataclasses.is_dataclass(cls) else set()
    out: dict[str, tuple] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object left out
        for name, attr in vars(klass).items():
            if (name.startswith("_") and name not in _DUNDERS) or name in generated:
                continue
            if getattr(attr, "__name__", "") == "_no_init_or_replace_init":
                continue  # the __init__ typing.Protocol gives a protocol class (CommBackend)
            if isinstance(attr, staticmethod):
                out[name] = ("static", _parameters(attr.__func__))
            elif isinstance(attr, classmethod):
                out[name] = ("class", _parameters(attr.__func__))
            elif isinstance(attr, property):
                out[name] = ("property", ())
            elif inspect.isfunction(attr):
                out[name] = ("", _parameters(attr))
    return out


#: what typing.Protocol and abc set on a protocol class (CommBackend), not in its source
_PROTOCOL_ATTRS = {"_abc_impl", "_is_protocol", "_is_runtime_protocol"}


def _class_attrs(cls: type) -> set[str]:
    return {name for klass in cls.__mro__[:-1] for name, attr in vars(klass).items()
            if not name.startswith("__") and not callable(attr) and name not in _PROTOCOL_ATTRS
            and not isinstance(attr, (staticmethod, classmethod, property))
            and name not in getattr(klass, "__dataclass_fields__", {})}


def _fields(cls: type) -> tuple:
    return tuple((f.name, None if f.default is dataclasses.MISSING else repr(f.default),
                  f.kw_only) for f in dataclasses.fields(cls))


def _emulated(version: str) -> dict[str, types.ModuleType]:
    return {name: mod for name, mod in fi._build(version).items() if name in MODULES}


def _emulated_classes(version: str) -> dict[str, type]:
    upstream = UPSTREAM[version]["classes"]
    return {name: obj for mod in _emulated(version).values() for name, obj in vars(mod).items()
            if isinstance(obj, type) and name in upstream}


@pytest.mark.parametrize("version", sorted(UPSTREAM))
def test_the_emulated_classes_are_upstreams(version):
    """Each emulated class: its dataclass fields (names, order, defaults, keyword-only) and
    frozenness are upstream's; every method it has is upstream's (the class's own or its base's)
    with upstream's kind, parameters and defaults; its class attributes exist upstream."""
    upstream = UPSTREAM[version]["classes"]
    emulated = _emulated_classes(version)
    for name, cls in emulated.items():
        info = upstream[name]
        if issubclass(cls, enum.Enum):  # an enum: upstream's members
            assert set(cls.__members__) == set(info["attrs"]), (version, name)
            continue
        if info["fields"] or dataclasses.is_dataclass(cls):
            assert _fields(cls) == info["fields"], (version, name)
            frozen = any("frozen=True" in d for d in info["decorators"])
            assert cls.__dataclass_params__.frozen == frozen, (version, name)
        methods = effective_methods(UPSTREAM[version], name)
        for method, signature in _methods(cls).items():
            assert method in methods, (version, name, method)
            assert signature == methods[method], (version, name, method)
        known = set(info["attrs"]) | set(info["self_attrs"])
        for base in info["bases"]:
            if base in upstream:
                known |= set(upstream[base]["attrs"]) | set(upstream[base]["self_attrs"])
        assert _class_attrs(cls) <= known, (version, name, _class_attrs(cls) - known)


@pytest.mark.parametrize("version", sorted(UPSTREAM))
def test_the_emulation_presents_what_the_backend_uses(version):
    """Every class our backend uses that the release defines is emulated, with the methods and
    fields the backend calls; the ones the release lacks (MnnvlMoe in 0.7.4) are absent."""
    upstream = UPSTREAM[version]["classes"]
    emulated = _emulated_classes(version)
    assert {c for c in CALLED if c in upstream} == {c for c in CALLED if c in emulated}
    for name in emulated.keys() & CALLED.keys():
        assert CALLED[name] <= set(effective_methods(UPSTREAM[version], name)), (version, name)
        assert CALLED[name] <= set(_methods(emulated[name])), (version, name)
        if name in FIELDS_USED:
            assert FIELDS_USED[name] <= {f for f, _, _ in upstream[name]["fields"]}
            assert FIELDS_USED[name] <= {f.name for f in dataclasses.fields(emulated[name])}


@pytest.mark.parametrize("version", sorted(UPSTREAM))
def test_the_emulated_modules_and_functions_are_upstreams(version):
    """The emulated modules are the release's (flashinfer.comm.trtllm_alltoall only in
    0.7.2.post1), each presents only names the release's module has, and the emulated
    trtllm_alltoall functions have upstream's parameters."""
    upstream = UPSTREAM[version]
    emulated = _emulated(version)
    assert set(emulated) == set(upstream["modules"])
    interest = set(upstream["classes"]) | set(upstream["functions"])
    for module, mod in emulated.items():
        names = {n for n in vars(mod) if n in interest}
        assert names <= set(upstream["modules"][module]), (version, module)
    functions = {n: f for mod in emulated.values() for n, f in vars(mod).items()
                 if n in upstream["functions"] and inspect.isfunction(f)}
    assert set(functions) == set(upstream["functions"]), version
    for name, params in upstream["functions"].items():
        assert _parameters(functions[name]) == params, (version, name)


@pytest.mark.parametrize("version", sorted(UPSTREAM))
def test_the_one_sided_members_of_one_release(version):
    """What the one-sided backend probes per release: the emulated class and config have
    upstream's release-specific members, and lack the other release's."""
    table, emulated = UPSTREAM[version], _emulated_classes(version)
    methods = effective_methods(table, "NVLinkOneSidedAlltoAll")
    fields = {f for f, _, _ in table["classes"]["NVLinkOneSidedConfig"]["fields"]}
    emulated_methods = _methods(emulated["NVLinkOneSidedAlltoAll"])
    emulated_fields = {f.name for f in dataclasses.fields(emulated["NVLinkOneSidedConfig"])}
    for release, used in RELEASE_ONLY.items():
        present = release == version
        assert (used["methods"] <= set(methods)) is present, (version, release)
        assert (used["methods"] <= set(emulated_methods)) is present, (version, release)
        if used["fields"]:
            assert (used["fields"] <= fields) is present and \
                (used["fields"] <= emulated_fields) is present, (version, release)
        if used["functions"]:
            assert (used["functions"] <= set(table["functions"])) is present, (version, release)
    bound = [p for p, _, _ in methods["dispatch"][1] if "max_tokens_per_rank" in p]
    assert bound == (["runtime_max_tokens_per_rank"] if version == "0.7.4"
                     else ["max_tokens_per_rank"])


def test_the_two_releases_differ_where_the_backend_probes():
    """What all2all/flashinfer_nvlink_two_sided.py handles: MnnvlMoe only in 0.7.2.post1; dispatch's per-call
    bound is max_tokens_per_rank there and runtime_max_tokens_per_rank in 0.7.4 (read from the
    signature); both keep the pending routing in ``_state``, which the backend's reset drops."""
    old, new = UPSTREAM["0.7.2.post1"], UPSTREAM["0.7.4"]
    assert "MnnvlMoe" in old["classes"] and "MnnvlMoe" not in new["classes"]
    bounds = [[p for p, _, kind in effective_methods(t, "NVLinkTwoSidedAlltoAll")["dispatch"][1]
               if "max_tokens_per_rank" in p] for t in (old, new)]
    assert bounds == [["max_tokens_per_rank"], ["runtime_max_tokens_per_rank"]]
    for table in (old, new):
        assert "_state" in table["classes"]["NVLinkTwoSidedAlltoAll"]["self_attrs"]
    from moe_plugins.all2all.flashinfer_nvlink_two_sided import _MNNVL_MOE_CACHE_ATTRS

    assert set(_MNNVL_MOE_CACHE_ATTRS) <= set(old["classes"]["MnnvlMoe"]["attrs"])
