"""The Python floor of vLLM: vLLM 0.33 and 0.34 need Python >= 3.11. moe-plugins installs on
3.10 (its backends run without vLLM); `moe-plugins list` says, where vLLM is absent on an older
Python, why it cannot be installed there. The interpreter's version is faked at the function
that reads it, and vLLM's absence at the metadata lookup."""
from __future__ import annotations

import importlib.metadata
import tomllib

import pytest

from moe_plugins.cli import main
from moe_plugins.stack.versions import VLLM_PYTHON
from moe_plugins.vllm import version
from tests.checks import ROOT


@pytest.fixture
def no_vllm(monkeypatch):
    real = importlib.metadata.distribution

    def distribution(name: str):
        if name in version.SUPPORTED_VLLM:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def _list_vllm_line(capsys) -> str:
    assert main(["list"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("vLLM: ")]
    assert len(lines) == 1
    return lines[0]


def test_on_python_310_without_vllm_list_says_why_it_cannot_be_installed(
        no_vllm, monkeypatch, capsys):
    monkeypatch.setattr(version, "python_version", lambda: (3, 10))
    line = _list_vllm_line(capsys)
    assert line.startswith("vLLM: vLLM is not installed; ")
    assert "this is Python 3.10, and vLLM 0.33 and 0.34 need Python >= 3.11" in line
    assert "use Python 3.11 or later" in line and "pip install" not in line


def test_on_python_311_without_vllm_list_says_how_to_install_it(no_vllm, monkeypatch, capsys):
    monkeypatch.setattr(version, "python_version", lambda: (3, 11))
    line = _list_vllm_line(capsys)
    assert "pip install 'vllm>=0.33,<0.35'" in line and "Python 3." not in line


def test_list_names_the_installed_vllm(capsys):
    dist, ver = version.installed_vllm()
    assert _list_vllm_line(capsys) == f"vLLM: {dist} {ver}, supported by moe-plugins' vLLM plugin"


def test_pyproject_and_docs_say_the_floor():
    """The package installs on 3.10 (requires-python); the vllm extra is left without a marker,
    so that pip on 3.10 says why it finds no vLLM ("Requires-Python >=3.11") instead of
    installing the package without it; the docs say 3.11."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    assert all(";" not in r for r in project["optional-dependencies"]["vllm"])
    need = "Python >= {}.{}".format(*VLLM_PYTHON)
    for page in ("README.md", "docs/vllm.md", "docs/stack.md"):
        assert need in (ROOT / page).read_text(), page
