"""Rank functions of tests/backends/test_deepep_lines.py: what a DeepEP backend says about the
DeepEP it found, on the emulation presenting one API shape."""
from __future__ import annotations

import torch

from moe_plugins.config import DispatchConfig
from moe_plugins.groups import cached_dist_context
from moe_plugins.layout import ParallelLayout
from moe_plugins.quant import QuantSpec
from moe_plugins.registry import get_backend
from tests.checks import logged
from tests.emulation import deep_ep_shape, installed

# the logger that writes each backend's buffer line
_BUFFER_LOGGER = {"deepep_ll": "moe_plugins.lowlat.manager", "deepep_ht": "moe_plugins.all2all.deepep_ht"}


def buffer_info_lines(rank: int, world: int, backend: str, shape: str,
                      layout: ParallelLayout) -> list[str]:
    """The buffer INFO lines ``backend`` logs while it builds a buffer on the emulation in
    ``shape`` (hidden 2560: a buffer no other test of the pool keeps alive)."""
    with deep_ep_shape(shape), installed("deep_ep"), logged(_BUFFER_LOGGER[backend]) as records:
        pf = get_backend(backend).build(cached_dist_context(layout), DispatchConfig(
            8, 2560, 2, 4, torch.bfloat16, QuantSpec()))
        pf.manager.destroy()
    return [r for r in records if "buffer for EP rank" in r]
