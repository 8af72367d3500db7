"""The backend lists the tests run over, drawn from the registry's capabilities: a backend that
this distribution registers joins every list whose capability it has, and with it every test
that list drives (docs/adding_a_backend.md, "In this repository", names them). Backends of
other distributions (a third-party package installed next to ours) are left out: their tests
live with them.
"""
from __future__ import annotations

from typing import Callable

from moe_plugins.registry import BackendSpec, Transport, registered_backends

__all__ = ["ours", "transports", "LOW_LATENCY", "NORMAL_MODE", "MICRO_BATCH", "RANK_MASKING",
           "PLACEMENTS", "DEEPEP"]

def ours(where: Callable[[BackendSpec], bool]) -> list[str]:
    """Names of this distribution's backends for which ``where(spec)`` holds, sorted."""
    return sorted(n for n, s in registered_backends().items()
                  if s.distribution == "moe-plugins" and where(s))


def transports(spec: BackendSpec) -> set[Transport]:
    """The transports a backend's calls use: its one transport, or with ``call_modes`` (a
    transport picked per call) those of both modes."""
    modes = spec.call_modes
    if modes is None:
        return {spec.transport}
    return {modes.low_latency.transport, modes.normal.transport}


#: the low-latency family on every call (DeepEP LL, NIXL EP): tests/backends/test_low_latency.py,
#: the plan's per-pair counts in tests/planner/test_plan.py, vLLM's kernel with the router weight
#: on the input (tests/vllm_glue/test_vllm_modular_kernel.py)
LOW_LATENCY = ours(lambda s: transports(s) == {Transport.LOW_LATENCY})
#: backends that run DeepEP's normal mode on some calls: tests/backends/test_deepep_ht.py,
#: vLLM's kernel over them (tests/vllm_glue/test_vllm_modular_kernel.py), the GPU matrix's
#: normal-mode rank function on CPU (tests/runner/test_ep_matrix_cpu.py)
NORMAL_MODE = ours(lambda s: Transport.NORMAL in transports(s))
#: capability micro_batch (vLLM's dual-batch overlap): tests/vllm_glue/test_vllm_dbo.py
MICRO_BATCH = ours(lambda s: s.capabilities.micro_batch)
#: capability rank_masking (vLLM's fault tolerance, masks the library sets by itself):
#: tests/vllm_glue/test_vllm_dbo.py, tests/runner/test_ep_findings.py
RANK_MASKING = ours(lambda s: s.capabilities.rank_masking)
#: capability placements (round-robin and EPLB's redundant experts):
#: tests/contracts/test_placement.py
PLACEMENTS = ours(lambda s: s.capabilities.placements)
#: backends on DeepEP (they name the DeepEP found, or refuse one without the Buffer API):
#: tests/backends/test_deepep_lines.py
DEEPEP = ours(lambda s: any(p.module == "deep_ep" for p in s.required))
