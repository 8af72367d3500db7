"""moe-plugins: expert-parallel MoE prepare/finalize backends for vLLM.

Importing this package needs torch alone; vendor libraries are imported by the backend that
needs them. See docs/design.md in the project for the contracts.
"""
from moe_plugins.faults import (CollectiveError, LayerBrokenError, OutOfStepError,
                                PeerInputError, PeerMaskedError)
from moe_plugins.interface import (ActivationFormat, PrepareFinalize, PrepareResult,
                                   RowScatterTarget, row_scatter_add)
from moe_plugins.layout import ParallelLayout, owned_rows, slice_owned
from moe_plugins.quant import QuantScheme, QuantSpec
from moe_plugins.registry import BackendSelectionError
from moe_plugins.runner.rank_errors import RankDiedError, RankError, RankTimeoutError
from moe_plugins.strategy import ReductionStrategy, choose_strategy
from moe_plugins.vllm.patching import VllmPatchError
from moe_plugins.vllm.version import UnsupportedVllmError
from moe_plugins.callbound import CallTimeoutError, PeerFailedError
from moe_plugins.survival import (ExpertsLostError, PeerLossOptions, PeerLostError,
                                  RankEvictedError)

__version__ = "0.1.0"

__all__ = ["ActivationFormat", "PrepareFinalize", "PrepareResult", "RowScatterTarget",
           "row_scatter_add", "ParallelLayout", "owned_rows", "slice_owned", "QuantScheme",
           "QuantSpec", "ReductionStrategy", "choose_strategy", "__version__", "PeerLossOptions",
           # every exception the package raises on purpose (docs/faults.md, "Errors")
           "BackendSelectionError", "CallTimeoutError", "CollectiveError", "ExpertsLostError",
           "LayerBrokenError", "PeerLostError", "RankEvictedError",
           "OutOfStepError", "PeerFailedError", "PeerInputError", "PeerMaskedError", "RankDiedError", "RankError",
           "RankTimeoutError",
           "UnsupportedVllmError", "VllmPatchError"]
