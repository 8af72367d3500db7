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


def test_a_transport_failure_at_the_call_site_is_a_collective_error_and_nothing_else_is():
    """At a layer's call site (call_fault_error): torch.distributed's own failures (gloo's
    transport, by its source in the text; a DistError such as NCCL's) become CollectiveError
    naming the layer, the library, the call and the group, and break the group; the library's
    own timeout keeps its words; an expert's RuntimeError that merely reads like a transport's,
    and our own errors, are left alone (None), the group untouched."""
    import torch.distributed as dist

    from moe_plugins.faults import (CollectiveError, GroupFaults, LayerBrokenError,
                                    call_fault_error)

    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:433. This is typically caused by a remote "
                        "worker crashing.")
    faults = GroupFaults([0, 1, 2, 3], 0)
    wrapped = call_fault_error(faults, "layer X", "deepep_ll", 100.0, 60.0, 7, gone)
    assert isinstance(wrapped, CollectiveError)
    assert str(wrapped).startswith(
        "layer X: a collective inside deepep_ll's call (call 7) did not complete on the EP group "
        "of ranks [0, 1, 2, 3]: a peer went away (its process died or left the group); the peer "
        "that did not answer: peer [127.0.0.1]:433 (as the transport names it)"), str(wrapped)
    assert faults.broken is not None and "Connection closed by peer" in faults.broken
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp: remote process exited")
    assert isinstance(call_fault_error(GroupFaults([0, 1], 0), "L", "deepep_ht", 100.0, 60.0, 1,
                                       nccl), CollectiveError)
    trap = RuntimeError("CUDA error: unspecified launch failure")
    assert "library's own timeout" in str(call_fault_error(GroupFaults([0, 1], 0), "L",
                                                           "deepep_ll", 100.0, 60.0, 1, trap))
    for other in (RuntimeError("EOF while reading the expert weights: Connection closed"),
                  ValueError("gloo/transport"), LayerBrokenError("gloo/transport closed by peer"),
                  CollectiveError("a peer went away")):
        untouched = GroupFaults([0, 1], 0)
        assert call_fault_error(untouched, "L", "deepep_ll", 100.0, 60.0, 1, other) is None
        assert untouched.broken is None
