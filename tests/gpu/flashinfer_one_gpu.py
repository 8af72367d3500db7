"""flashinfer's moe_ep NVLink backends on a host with one GPU.

``flashinfer.moe_ep.NVLinkTwoSidedAlltoAll`` (0.7.4; also in 0.7.2.post1 beside ``MnnvlMoe``)
starts only where every EP rank's ``MnnvlMemory.supports_mnnvl()`` says its GPU has NVLinks and
all of them are up (flashinfer/moe_ep/backends/split/comm/nvlink_common.py); on a one-GPU host it
raises "NVLink backends are not supported on EP ranks [0, 1]". With every rank on that one GPU no
byte crosses NVLink: each rank maps the others' MNNVL workspace on the same device, as the
``MnnvlMoe`` API does here unchecked. So the GPU tests answer that platform check True on a
one-GPU host, for the block only; the memory, the kernels and the data path are flashinfer's own.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import torch

T = TypeVar("T")


@contextlib.contextmanager
def nvlink_check_on_one_gpu() -> Iterator[bool]:
    """Inside the block, on a host with exactly one GPU, flashinfer's ``MnnvlMemory
    .supports_mnnvl()`` returns True; elsewhere nothing changes. Yields whether it did."""
    if torch.cuda.device_count() != 1:
        yield False
        return
    try:
        from flashinfer.comm.mnnvl import MnnvlMemory
    except ImportError:
        yield False
        return
    before = MnnvlMemory.__dict__.get("supports_mnnvl")
    MnnvlMemory.supports_mnnvl = staticmethod(lambda: True)
    try:
        yield True
    finally:
        if before is None:
            del MnnvlMemory.supports_mnnvl
        else:
            MnnvlMemory.supports_mnnvl = before


def on_one_gpu(rank: int, world: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A rank function: ``fn(rank, world, *args, **kwargs)`` under
    :func:`nvlink_check_on_one_gpu` (``pool.run(on_one_gpu, fn, ...)``)."""
    with nvlink_check_on_one_gpu():
        return fn(rank, world, *args, **kwargs)
