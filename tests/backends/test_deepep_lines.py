"""Which DeepEP is installed (moe_plugins.stack.deepep): its line, its commit where the package
can tell, and the probes our DeepEP backends take their differences from."""
from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

from moe_plugins.stack import deepep as found_mod
from tests.backend_lists import DEEPEP
from moe_plugins.stack.deepep import (LEGACY, UNKNOWN, V1, V2_ONLY, describe_deepep,
                                      require_buffer_api)


class _V1Buffer:
    """The methods and constructor of 567632d's Buffer our probes read (bodies never run)."""

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None):
        raise AssertionError("not built")

    def low_latency_dispatch(self): ...
    def low_latency_combine(self): ...
    def get_dispatch_layout(self): ...
    def dispatch(self): ...
    def combine(self): ...
    def destroy(self): ...

    @staticmethod
    def get_low_latency_rdma_size_hint(*args): ...


def _module(tmp_path: Path, name: str, record: dict | None = None, **attrs) -> types.ModuleType:
    """A package module whose __init__.py lies in tmp_path/name (with a build record if given)."""
    pkg = tmp_path / name / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if record is not None:
        (pkg / found_mod.BUILD_INFO).write_text(json.dumps(record))
    module = types.ModuleType("deep_ep")
    module.__file__ = str(pkg / "__init__.py")
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


def test_the_build_record_names_the_commit_and_the_fence(tmp_path):
    lib = _module(tmp_path, "v1", {"line": "v1", "commit": "567632d",
                                   "patches": ["pr642-combine-fence"]}, Buffer=_V1Buffer)
    found = describe_deepep(lib)
    assert (found.line, found.commit, found.patches) == (V1, "567632d", ("pr642-combine-fence",))
    assert found.unusable_reason() is None
    assert found.describe() == ("DeepEP V1 line (deep_ep.Buffer of deep_ep/buffer.py), commit "
                                "567632d with pr642-combine-fence")
    assert "use_fabric" in found.constructor and not found.checks_determinism


def test_a_version_gives_the_commit_where_its_local_part_is_one():
    assert found_mod._commit_of("2.1.0+dd758ca") == "dd758ca"
    assert found_mod._commit_of("1.2.1+567632d") == "567632d"
    assert found_mod._commit_of("2.1.0+local") is None
    assert found_mod._commit_of("2.1.0") is None and found_mod._commit_of(None) is None


def test_without_record_or_distribution_the_version_attribute_is_said(tmp_path):
    lib = _module(tmp_path, "cur", None, Buffer=_V1Buffer, ElasticBuffer=object,
                  __version__="2.1.0")
    found = describe_deepep(lib)
    assert found.line == LEGACY and found.commit is None and found.version == "2.1.0"
    assert found.describe().endswith("version 2.1.0 (no commit recorded)")


@pytest.mark.parametrize("attrs,line", [({"ElasticBuffer": object}, V2_ONLY), ({}, UNKNOWN),
                                        ({"Buffer": object}, UNKNOWN)],
                         ids=["v2-only", "nothing", "buffer-without-methods"])
def test_a_package_without_the_buffer_api_is_an_import_error_naming_it(tmp_path, attrs, line):
    lib = _module(tmp_path, line, {"commit": "b306af0"}, **attrs)
    found = describe_deepep(lib)
    assert found.line == line
    with pytest.raises(ImportError) as e:
        require_buffer_api(lib, "deepep_ll")
    msg = str(e.value)
    assert msg.startswith("backend 'deepep_ll': deep_ep at ") and "commit b306af0" in msg
    assert "scripts/deepep/build.sh" in msg and "d4f41e4" in msg


def test_use_fabric_on_a_constructor_without_it(tmp_path):
    class Legacy(_V1Buffer):
        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                     num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                     allow_mnnvl=False, explicitly_destroy=False, enable_shrink=False, comm=None):
            raise AssertionError("not built")

    v1 = describe_deepep(_module(tmp_path, "a", None, Buffer=_V1Buffer))
    cur = describe_deepep(_module(tmp_path, "b", None, Buffer=Legacy, ElasticBuffer=object))
    ask = {"allow_mnnvl": False, "use_fabric": True}
    assert v1.buffer_kwargs(ask, "deepep_ht") == {"use_fabric": True}
    with pytest.raises(ValueError, match="has no use_fabric: .* pass allow_mnnvl=True"):
        cur.buffer_kwargs(ask, "deepep_ht")
    assert cur.buffer_kwargs({"allow_mnnvl": True, "use_fabric": True}, "x") == {
        "allow_mnnvl": True}
    assert cur.buffer_kwargs({"enable_shrink": False}, "x") == {}
    gone = describe_deepep(_module(tmp_path, "c", None, Buffer=types.new_class(
        "Old", (_V1Buffer,), exec_body=lambda ns: ns.update(__init__=lambda self, group: None))))
    with pytest.raises(ValueError, match=r"enable_shrink=True, but .* takes no enable_shrink"):
        gone.buffer_kwargs({"enable_shrink": True}, "deepep_ll")


def test_the_determinism_check_follows_the_library(tmp_path):
    def check_torch_deterministic() -> None:
        assert not (torch.are_deterministic_algorithms_enabled()
                    and torch.utils.deterministic.fill_uninitialized_memory)

    namespace = {"check_torch_deterministic": check_torch_deterministic}
    exec("def low_latency_dispatch(self):\n    check_torch_deterministic()\n", namespace)
    checked = types.new_class("Checked", (_V1Buffer,), exec_body=lambda ns: ns.update(
        low_latency_dispatch=namespace["low_latency_dispatch"]))
    v1 = describe_deepep(_module(tmp_path, "a", None, Buffer=_V1Buffer))
    cur = describe_deepep(_module(tmp_path, "b", None, Buffer=checked, ElasticBuffer=object))
    assert cur.checks_determinism and not v1.checks_determinism
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert v1.determinism_error("deepep_ll") is None
        err = cur.determinism_error("deepep_ll")
        assert isinstance(err, ValueError) and "fill_uninitialized_memory = False" in str(err)
        with pytest.raises(AssertionError):
            check_torch_deterministic()  # what the library would raise instead
    finally:
        torch.use_deterministic_algorithms(before)
    assert cur.determinism_error("deepep_ll") is None


def test_a_package_that_fails_its_own_import_check_is_an_import_error(tmp_path, monkeypatch):
    """DeepEP's current line asserts at import that torch's NCCL is the one it was built with:
    building the backend, and the registry's availability check, name that error."""
    from moe_plugins.lowlat.vendor import import_vendor
    from moe_plugins.registry import RequiredPackage

    pkg = tmp_path / "nccl_checked_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("assert False, 'Invalid NCCL versions: a (loaded) v.s. b'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    required = RequiredPackage("nccl_checked_pkg", "build it", describe=found_mod.deepep_status)
    with pytest.raises(ImportError, match=r"'nccl_checked_pkg' package, which is not importable "
                                          r"\(AssertionError: Invalid NCCL versions"):
        import_vendor(required, "deepep_ll")
    described, reason = required.found()
    assert described is None and "failed to import (AssertionError: Invalid NCCL" in reason


# -- `moe-plugins list` names the DeepEP found ------------------------------------------------

DEEPEP_ROWS = DEEPEP
# what each emulated API shape is called (the legacy emulation has a __version__, no record)
_LINE_WORDS = {
    "v1": "DeepEP V1 line (deep_ep.Buffer of deep_ep/buffer.py), commit unknown (no build "
          "record, no version)",
    "legacy": "DeepEP current line, legacy Buffer (deep_ep.Buffer of deep_ep/buffers/legacy.py, "
              "beside V2's ElasticBuffer), version 2.1.0 (no commit recorded)"}


def _list_rows(capsys) -> dict:
    from moe_plugins.cli import main as cli_main

    assert cli_main(["list", "--json"]) == 0
    return {r["name"]: r for r in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize("shape", ["v1", "legacy"])
def test_list_names_the_deepep_line_of_each_shape(capsys, shape):
    from tests.emulation import installed

    with installed("deep_ep", deep_ep_shape=shape):
        rows = _list_rows(capsys)
        from moe_plugins.cli import main as cli_main

        assert cli_main(["list"]) == 0
        text = capsys.readouterr().out
    words = _LINE_WORDS[shape]
    for name in DEEPEP_ROWS:
        assert rows[name]["found"] == {"deep_ep": words}
        reason = rows[name]["reason"] or ""
        assert "deep_ep" not in reason  # only the GPU can be missing here
    assert f"found deep_ep: {words}" in text
    assert rows["torch"]["found"] == {}


def _fake_deepep(tmp_path: Path, **attrs) -> types.ModuleType:
    import importlib.machinery

    module = _module(tmp_path, "fake", {"line": "v2", "commit": "dd758ca"}, **attrs)
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None, origin=module.__file__)
    return module


@pytest.mark.parametrize("attrs,words", [
    ({"ElasticBuffer": object}, "DeepEP V2 API only (ElasticBuffer, no legacy deep_ep.Buffer), "
                                "commit dd758ca"),
    ({}, "not a DeepEP API moe-plugins knows")], ids=["v2-only", "unknown"])
def test_list_and_build_refuse_a_deepep_without_the_buffer_api(capsys, monkeypatch, tmp_path,
                                                               attrs, words):
    """Not usable, saying what was found and what to install; building the backend is the
    same ImportError, before any constructor of the package runs."""
    from moe_plugins.config import DispatchConfig
    from moe_plugins.groups import DistContext
    from moe_plugins.layout import ParallelLayout
    from moe_plugins.registry import get_backend

    monkeypatch.setitem(__import__("sys").modules, "deep_ep", _fake_deepep(tmp_path, **attrs))
    rows = _list_rows(capsys)
    for name in DEEPEP_ROWS:
        row = rows[name]
        assert row["usable"] is False and words in row["found"]["deep_ep"]
        assert "moe-plugins' DeepEP backends call deep_ep.Buffer" in row["reason"]
        assert "scripts/deepep/build.sh" in row["reason"]
        ctx = DistContext(ParallelLayout(2, 1, True), 0, None, None, torch.device("cpu"))
        with pytest.raises(ImportError, match=rf"backend .{name}.: deep_ep at .*{re.escape(words[:20])}"):
            get_backend(name).build(ctx, DispatchConfig(8, 2048, 2, dtype=torch.bfloat16))


def test_list_names_the_recorded_commit_and_fence(capsys, monkeypatch, tmp_path):
    """A DeepEP built by scripts/deepep/build.sh: its rows name the commit and the fence patch
    from deep_ep/moe_plugins_build.json and stay usable as far as the package goes."""
    import importlib.machinery

    from tests.emulation import deep_ep as emulated

    module = _module(tmp_path, "built", {"line": "v1", "commit": "567632d",
                                         "patches": ["pr642-combine-fence"]},
                     Buffer=emulated.Buffer)
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None, origin=module.__file__)
    monkeypatch.setitem(__import__("sys").modules, "deep_ep", module)
    rows = _list_rows(capsys)
    for name in DEEPEP_ROWS:
        assert rows[name]["found"] == {"deep_ep": "DeepEP V1 line (deep_ep.Buffer of "
                                                  "deep_ep/buffer.py), commit 567632d with "
                                                  "pr642-combine-fence"}
        assert "deep_ep" not in (rows[name]["reason"] or "")


@pytest.mark.parametrize("shape", sorted(_LINE_WORDS))
@pytest.mark.parametrize("backend", ["deepep_ll", "deepep_ht"])
def test_the_buffer_info_line_names_the_deepep_found(rank_pool, backend, shape):
    """The one INFO line per buffer (per worker and layer config) names the line."""
    from moe_plugins.layout import ParallelLayout
    from tests.backends import deepep_lines_ranks

    lines = rank_pool(2).run(deepep_lines_ranks.buffer_info_lines, backend, shape,
                             ParallelLayout(2, 1, True))
    for got in lines:
        assert len(got) == 1 and got[0].startswith(f"{backend}: buffer for EP rank ")
        assert got[0].endswith("; " + _LINE_WORDS[shape])


def test_the_build_record_gives_the_timeouts_it_was_built_with(tmp_path):
    """scripts/deepep/build.sh DEEPEP_TIMEOUT_S=300 records both constants: the kernels' cycles
    read as seconds at DeepEP's 2 GHz, both named in the description; without a record (or
    with one whose values are no positive numbers) DeepEP's defaults, not named."""
    record = {"line": "v1", "commit": "567632d", "patches": ["pr678-timeout-override"],
              "timeouts": {"NUM_CPU_TIMEOUT_SECS": 300, "NUM_TIMEOUT_CYCLES": 600_000_000_000}}
    found = describe_deepep(_module(tmp_path, "t300", record, Buffer=_V1Buffer))
    assert (found.timeouts.cpu_s, found.timeouts.kernel_s, found.timeouts.recorded) == (
        300.0, 300.0, True)
    assert found.describe().endswith(
        "with pr678-timeout-override, timeouts 300 s (host), 600G cycles (kernels, about 300 s)")
    plain = describe_deepep(_module(tmp_path, "none", {"commit": "567632d"}, Buffer=_V1Buffer))
    assert (plain.timeouts.cpu_s, plain.timeouts.kernel_s, plain.timeouts.recorded) == (
        100.0, 100.0, False)
    assert "timeouts" not in plain.describe()
    bad = dict(record, timeouts={"NUM_CPU_TIMEOUT_SECS": "300", "NUM_TIMEOUT_CYCLES": -1})
    assert not describe_deepep(_module(tmp_path, "bad", bad, Buffer=_V1Buffer)).timeouts.recorded
