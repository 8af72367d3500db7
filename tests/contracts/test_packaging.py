"""What the distribution installs: one top-level package (``moe_plugins``), the backends' two
folders inside it, and one name per backend that finds its modules in both folders.

The registry's tests run over the backends the entry points register, so a backend whose entry
point is missing from pyproject.toml would join no test list; the checks here fail instead.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from moe_plugins.registry import registered_backends

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENTRY_POINTS = PYPROJECT["project"]["entry-points"]["moe_plugins.backends"]
FOLDERS = {"prepare_finalize": "moe_plugins.prepare_finalize", "all2all": "moe_plugins.all2all"}


def _exports_spec(path: Path) -> bool:
    """The module assigns a module-level ``SPEC`` (a backend's prepare/finalize module)."""
    tree = ast.parse(path.read_text())
    return any(isinstance(n, (ast.Assign, ast.AnnAssign))
               and any(isinstance(t, ast.Name) and t.id == "SPEC"
                       for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
               for n in tree.body)


def _modules(folder: str) -> set[str]:
    return {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}


def test_every_backend_module_is_an_entry_point_named_as_its_files():
    """Each prepare/finalize module that exports a SPEC is registered under its own file name,
    and the entry point names the module inside our namespace."""
    with_spec = {m for m in _modules("prepare_finalize")
                 if _exports_spec(ROOT / "prepare_finalize" / f"{m}.py")}
    assert with_spec == set(ENTRY_POINTS), (
        f"prepare_finalize/ modules with a SPEC {sorted(with_spec)} and the entry points of "
        f"pyproject.toml {sorted(ENTRY_POINTS)} must be the same names: add the missing entry "
        "point under [project.entry-points.\"moe_plugins.backends\"]")
    for name, value in ENTRY_POINTS.items():
        assert value == f"moe_plugins.prepare_finalize.{name}:SPEC", (name, value)


def test_each_backend_name_finds_its_modules_in_both_folders():
    """A reader who knows a backend's name finds ``prepare_finalize/<name>.py`` and
    ``all2all/<name>.py``; the registered spec is the one those modules define."""
    specs = registered_backends()
    for name in ENTRY_POINTS:
        for folder in FOLDERS:
            assert (ROOT / folder / f"{name}.py").is_file(), f"{folder}/{name}.py is missing"
        spec = specs[name]
        assert spec.name == name
        assert spec.prepare_finalize.__module__ == f"moe_plugins.prepare_finalize.{name}", (
            name, spec.prepare_finalize)
        assert spec.manager.__module__ == f"moe_plugins.all2all.{name}", (name, spec.manager)
    # and nothing in either folder but the backends' modules (shared code lives once, elsewhere)
    for folder in FOLDERS:
        assert _modules(folder) == set(ENTRY_POINTS), (
            f"{folder}/ holds {sorted(_modules(folder) - set(ENTRY_POINTS))} that name no "
            "backend: a backend's modules carry its registered name")


def test_packages_list_every_package_folder():
    """pyproject lists its packages by hand (the two folders map into our namespace, which
    setuptools' finder cannot express): every folder with an ``__init__.py`` is listed."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert mapping == {v: k for k, v in FOLDERS.items()}
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "moe_plugins").rglob("__init__.py")} | set(FOLDERS.values())
    assert listed == found, (f"in pyproject.toml but not a package: {sorted(listed - found)}; "
                             f"a package not in pyproject.toml: {sorted(found - listed)}")


@pytest.mark.timeout(240)
def test_the_wheel_installs_no_top_level_package_but_ours(tmp_path):
    """A wheel built from this tree holds ``moe_plugins/`` (with ``all2all`` and
    ``prepare_finalize`` inside it) and its dist-info, nothing else at the top."""
    # from a copy of the sources: setuptools builds in the tree (build/, *.egg-info), and a stale
    # build/lib of the checkout would put modules in the wheel that the sources no longer have
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("moe_plugins", *FOLDERS):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("moe_plugins-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"moe_plugins"}, sorted(top)
    for folder, package in FOLDERS.items():
        for module in _modules(folder):
            assert f"{package.replace('.', '/')}/{module}.py" in names, (folder, module)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    for name in ENTRY_POINTS:
        assert f"{name} = moe_plugins.prepare_finalize.{name}:SPEC" in text, text


def test_the_backends_page_says_where_each_backend_lives():
    """docs/backends.md's "Where each backend lives" names each registered backend's
    prepare/finalize module, and its options class's import where its manager module has one."""
    text = (ROOT / "docs" / "backends.md").read_text()
    for name in ENTRY_POINTS:
        assert f"`moe_plugins.prepare_finalize.{name}`" in text, name
        tree = ast.parse((ROOT / "all2all" / f"{name}.py").read_text())
        for cls in (n.name for n in tree.body if isinstance(n, ast.ClassDef)
                    and n.name.endswith("Options")):
            assert f"from moe_plugins.all2all.{name} import {cls}" in text, (name, cls)
