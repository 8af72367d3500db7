"""scripts/deepep/build.sh on CPU: the patches it carries apply to a source tree, are checked
and recorded in deep_ep/moe_plugins_build.json, a built tree is left as it is, and a tree a
patch does not apply to stops the build. DeepEP's sources are not here: the tree is made of
each patch's pre-image (the lines its hunks expect), in 567632d's order, and its setup.py
records the compile flags it was given instead of compiling."""
from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "deepep" / "build.sh"
PATCHES = sorted((ROOT / "scripts" / "deepep").glob("567632d-*.patch"))
_HUNK = re.compile(r"^@@ -(\d+)")

_SETUP = """import json, os
open("deep_ep_cpp.cpython-emulated.so", "w").close()
with open("build_env.json", "w") as f:
    json.dump({k: os.environ.get(k) for k in ("CPPFLAGS", "NVCC_APPEND_FLAGS")}, f)
"""


def _pre_images() -> dict[str, list[tuple[int, list[str]]]]:
    """Per source file, each hunk of the carried patches as (its line in 567632d, the lines it
    expects)."""
    files: dict[str, list[tuple[int, list[str]]]] = {}
    for patch in PATCHES:
        path, hunk = None, None
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                path = line[6:]
            elif (m := _HUNK.match(line)) and path:
                hunk = (int(m.group(1)), [])
                files.setdefault(path, []).append(hunk)
            elif hunk is not None and line[:1] in (" ", "-"):
                hunk[1].append(line[1:])
            elif hunk is not None and line == "":
                hunk[1].append("")
    return files


def _source_archive(tmp_path: Path, drop: str = "") -> Path:
    """A .tgz of a tree the patches apply to (``drop``: a line left out, so one does not)."""
    tree = tmp_path / "src"
    for path, hunks in _pre_images().items():
        lines: list[str] = []
        for _, expected in sorted(hunks):
            lines += ["// filler"] * 8 + expected
        text = "\n".join(line for line in lines if not (drop and drop in line)) + "\n"
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
    (tree / "deep_ep").mkdir(parents=True, exist_ok=True)
    (tree / "deep_ep" / "buffer.py").write_text("")
    (tree / "setup.py").write_text(_SETUP)
    archive = tmp_path / "deepep-567632d.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for item in tree.iterdir():
            tar.add(item, arcname=item.name)
    return archive


def _build(archive: Path, dest: Path, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(["bash", str(SCRIPT), str(dest)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DEEPEP_SRC": str(archive), **env})


def test_the_carried_patches_are_named_by_their_source():
    names = {p.name for p in PATCHES}
    assert {"567632d-combine-fence.patch", "567632d-rc-qp-assert.patch",
            "567632d-timeout-override.patch"} <= names
    for patch in PATCHES:
        head = patch.read_text().split("diff --git", 1)[0]
        assert re.search(r"https://github.com/deepseek-ai/DeepEP/pull/\d+", head), patch.name


def test_build_applies_checks_and_records_every_patch(tmp_path):
    archive, dest = _source_archive(tmp_path), tmp_path / "DeepEP"
    run = _build(archive, dest)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("pr642-combine-fence", "pr695-rc-qp-assert", "pr678-timeout-override"):
        assert f"applied {name}" in run.stdout
    ll = (dest / "csrc/kernels/internode_ll.cu").read_text()
    assert "fence_view_async_shared();" in ll and "bool needs_ibgda = false;" in ll
    assert "EP_DEVICE_ASSERT(ibgda_get_state()->num_rc_per_pe >= num_local_experts);" not in ll
    record = json.loads((dest / "deep_ep/moe_plugins_build.json").read_text())
    assert record["line"] == "v1" and record["commit"] == "567632d"
    assert record["patches"] == ["pr642-combine-fence", "pr695-rc-qp-assert",
                                 "pr678-timeout-override"]
    assert record["timeouts"] == {"NUM_CPU_TIMEOUT_SECS": 100, "NUM_TIMEOUT_CYCLES": 200000000000}
    again = _build(archive, dest)  # the same build: left as it is
    assert again.returncode == 0 and "is already built" in again.stdout, again.stdout


def test_a_tree_a_patch_does_not_apply_to_stops_the_build(tmp_path):
    archive = _source_archive(tmp_path, drop="EP_DEVICE_ASSERT(ibgda_get_state()")
    run = _build(archive, tmp_path / "DeepEP")
    assert run.returncode != 0
    assert "567632d-rc-qp-assert.patch does not apply" in run.stderr, run.stderr
    assert not (tmp_path / "DeepEP/deep_ep/moe_plugins_build.json").exists()


def test_the_timeout_option_reaches_both_compilers_and_the_record(tmp_path):
    """DEEPEP_TIMEOUT_S=300: PR #678's #ifndef is applied, both constants go to the host
    compiler (CPPFLAGS) and to nvcc (NVCC_APPEND_FLAGS), the cycles at 2 GHz, and the record
    names both; DEEPEP_TIMEOUT_CYCLES sets the cycles alone; a rebuild with other values is
    not skipped; a value that is no positive integer is refused before anything is built."""
    archive, dest = _source_archive(tmp_path), tmp_path / "DeepEP"
    run = _build(archive, dest, DEEPEP_TIMEOUT_S="300")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "#ifndef NUM_CPU_TIMEOUT_SECS" in (dest / "csrc/kernels/configs.cuh").read_text()
    env = json.loads((dest / "build_env.json").read_text())
    defines = "-DNUM_CPU_TIMEOUT_SECS=300 -DNUM_TIMEOUT_CYCLES=600000000000ull"
    assert env["CPPFLAGS"].endswith(defines) and env["NVCC_APPEND_FLAGS"].endswith(defines)
    record = json.loads((dest / "deep_ep/moe_plugins_build.json").read_text())
    assert record["timeouts"] == {"NUM_CPU_TIMEOUT_SECS": 300, "NUM_TIMEOUT_CYCLES": 600000000000}
    assert "pr678-timeout-override" in record["patches"]
    run = _build(archive, dest, DEEPEP_TIMEOUT_S="1800", DEEPEP_TIMEOUT_CYCLES="3000000000000")
    assert run.returncode == 0 and "is already built" not in run.stdout, run.stdout
    record = json.loads((dest / "deep_ep/moe_plugins_build.json").read_text())
    assert record["timeouts"] == {"NUM_CPU_TIMEOUT_SECS": 1800,
                                  "NUM_TIMEOUT_CYCLES": 3000000000000}
    bad = _build(archive, tmp_path / "other", DEEPEP_TIMEOUT_S="1e3")
    assert bad.returncode != 0 and "give positive integers" in bad.stderr
    assert not (tmp_path / "other").exists()
