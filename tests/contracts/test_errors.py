"""Every exception class moe-plugins defines is importable from ``moe_plugins`` and has a row in
the one table of docs/faults.md ("Errors"): when, whether the layer is usable after, what to do.
Recovery texts advise only what can work."""
from __future__ import annotations

import ast
from pathlib import Path

import moe_plugins

ROOT = Path(__file__).resolve().parents[2]


def _defined_exceptions() -> set[str]:
    names = set()
    for path in (ROOT / "moe_plugins").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception"))
                    for b in node.bases):
                names.add(node.name)
    return names


def test_every_exception_is_exported_and_in_the_errors_table():
    defined = _defined_exceptions()
    assert {"CallTimeoutError", "LayerBrokenError", "PeerMaskedError"} <= defined
    assert defined <= set(moe_plugins.__all__), defined - set(moe_plugins.__all__)
    assert all(issubclass(getattr(moe_plugins, n), BaseException) for n in defined)
    doc = (ROOT / "docs" / "faults.md").read_text()
    table = doc[doc.index("## Errors"):doc.index("## The call bound")]
    rows = {line.split("|")[1] for line in table.splitlines() if line.startswith("| `")}
    missing = [n for n in defined if not any(f"`{n}`" in r for r in rows)]
    assert not missing, missing


def test_recovery_texts_after_a_dead_peer_say_restart():
    from moe_plugins.faults import GroupFaults

    faults = GroupFaults([0, 1])
    faults.mark_broken("a peer died")
    try:
        faults.check("layer")
    except moe_plugins.LayerBrokenError as e:
        text = str(e)
    assert "restart every rank of the EP group" in text and "executor shuts down" in text
    source = (ROOT / "moe_plugins" / "runner" / "layer.py").read_text()
    assert "set_rank_masked) to serve" not in source  # impossible on a broken group


def test_a_library_timeout_on_a_peer_is_wrapped_with_what_it_means():
    """What DeepEP's own timeout looks like on the host (a trapped kernel's CUDA error at the
    next CUDA call, its host wait's runtime_error) becomes CollectiveError saying a peer died
    or hangs and every rank must restart; anything else, or a library without a timeout, is
    left alone."""
    from moe_plugins.faults import CollectiveError, LayerBrokenError, library_timeout_error

    trap = RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be ...")
    wrapped = library_timeout_error("layer X", "deepep_ll", 100.0, trap)
    assert isinstance(wrapped, CollectiveError)
    text = str(wrapped)
    assert "layer X" in text and "about 100 s" in text and "unspecified launch failure" in text
    assert "CUDA context is lost" in text and "Restart every rank of the EP group" in text
    host = RuntimeError("DeepEP error: CPU recv timeout")
    assert "CUDA context" not in str(library_timeout_error("L", "deepep_ht", 100.0, host))
    assert library_timeout_error("L", "deepep_ll", None, trap) is None
    assert library_timeout_error("L", "deepep_ll", 100.0, RuntimeError("shape mismatch")) is None
    assert library_timeout_error("L", "deepep_ll", 100.0, ValueError("unspecified launch failure")) is None
    assert library_timeout_error("L", "deepep_ll", 100.0, LayerBrokenError("x timeout")) is None
