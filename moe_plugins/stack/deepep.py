"""Which DeepEP is installed: its API line, its commit where the package can tell, and the
features our DeepEP backends (deepep_ll, deepep_ht, deepep_auto) depend on, probed from the
imported package once.

DeepEP has two lines whose ``deep_ep.Buffer`` our backends run on:

- the **V1 line** (commit 567632d, the last before the V2 rewrite; ``deep_ep/buffer.py``,
  extension ``deep_ep_cpp``), which ``scripts/deepep/build.sh`` builds with the low-latency
  combine fence of DeepEP PR #642 and the RC QP check of DeepEP PR #695 (without it the first
  low-latency dispatch traps on NVSHMEM 3.6 or later without IBGDA, e.g. one host), and with
  DeepEP PR #678's build-time timeouts, and records in ``deep_ep/moe_plugins_build.json``
  (commit, patches, the two timeout constants it was compiled with: :class:`Timeouts`);
- the **current line's legacy Buffer** (d4f41e4 and later: ``deep_ep/buffers/legacy.py``,
  still exported as ``deep_ep.Buffer`` beside V2's ``ElasticBuffer``, extension ``deep_ep._C``).

Between 567632d's ``deep_ep/buffer.py`` and d4f41e4's (= dd758ca's) ``deep_ep/buffers/legacy.py``
(every method's parameters compared, and the bodies), and the C++ runtime beneath them
(567632d ``csrc/deep_ep.cpp``, d4f41e4 ``csrc/legacy/buffer.hpp``), the differences and how each
is handled, by a probe of the installed package, never by its version:

- ``Buffer.__init__`` lost ``use_fabric``: the runtime's fabric flag is ``allow_mnnvl`` there.
  :meth:`DeepEPFound.buffer_kwargs` passes an option only where the constructor takes it, and
  refuses ``use_fabric`` without ``allow_mnnvl`` on a constructor without it (ValueError with
  the fix) instead of a TypeError from inside DeepEP.
- ``dispatch``, ``combine`` and ``low_latency_dispatch`` / ``low_latency_combine`` first run
  ``check_torch_deterministic()``: an AssertionError when torch's deterministic algorithms and
  ``torch.utils.deterministic.fill_uninitialized_memory`` are both on (``torch.empty`` would
  launch a fill kernel that races DeepEP's communication stream). Where the installed wrappers
  make that check (:attr:`DeepEPFound.checks_determinism`), our prepare/finalize make it before
  anything is sent (:meth:`DeepEPFound.determinism_error`), also where they call the C++ runtime
  without the wrapper (:class:`moe_plugins.lowlat.vendor.RuntimeCalls`).
- ``internode_dispatch`` lost ``num_worst_tokens`` (``dispatch`` asserts it is 0 across nodes):
  we never pass it.
- Importing the package runs ``check_nccl_so()`` (an AssertionError when the NCCL torch loaded
  is not the one DeepEP was linked against; ``EP_SUPPRESS_NCCL_CHECK=1`` skips it) and
  ``init_jit()``: :func:`moe_plugins.lowlat.vendor.import_vendor` turns any import failure into
  an ImportError naming it.
- The same: the low-latency methods' parameters and the C++ runtime's positional
  ``low_latency_dispatch`` / ``low_latency_combine`` (so :class:`RuntimeCalls` serves both
  lines), ``low_latency_update_mask_buffer(rank_to_mask, mask)`` (567632d's parameter has that
  name too), the size hints, the normal-mode config tables, ``topk_idx_t`` (read from the
  package: a current-line build may make it int32).
"""
from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["V1", "LEGACY", "V2_ONLY", "UNKNOWN", "BUILD_INFO", "DeepEPFound", "Timeouts",
           "describe_deepep", "require_buffer_api", "deepep_status", "INSTALL"]

V1 = "v1"
LEGACY = "legacy"
V2_ONLY = "v2-only"
UNKNOWN = "unknown"

#: What scripts/deepep/build.sh writes into the package it builds ({"line", "commit", "patches",
#: "timeouts": {"NUM_CPU_TIMEOUT_SECS", "NUM_TIMEOUT_CYCLES"}}).
BUILD_INFO = "moe_plugins_build.json"


@dataclass(frozen=True)
class Timeouts:
    """DeepEP's own bounds on a wait for a peer, two compiled constants (csrc/kernels/configs.cuh
    at 567632d; csrc/kernels/legacy/compiled.cuh on the current line), as the build record
    gives them, else DeepEP's defaults.

    cpu_s: ``NUM_CPU_TIMEOUT_SECS``, seconds a host thread waits for the peers' counts in
    normal-mode dispatch, then raises ("DeepEP error: CPU recv timeout"); gpu_cycles:
    ``NUM_TIMEOUT_CYCLES``, GPU clock cycles a kernel spins on a peer, then traps (or masks
    the peer, with a mask buffer); recorded: whether a build record named them.
    """

    cpu_s: float = 100.0
    gpu_cycles: int = 200_000_000_000
    recorded: bool = False

    #: The clock DeepEP's constant assumes ("200G cycles ~= 100s"; 101.7 s was seen on an H200).
    CYCLES_PER_S = 2e9

    @property
    def kernel_s(self) -> float:
        """The kernels' timeout in seconds, at :data:`CYCLES_PER_S`."""
        return self.gpu_cycles / self.CYCLES_PER_S

    def describe(self) -> str:
        """``timeouts 300 s (host), 600G cycles (kernels, about 300 s)``."""
        return (f"timeouts {self.cpu_s:g} s (host), {self.gpu_cycles / 1e9:g}G cycles "
                f"(kernels, about {self.kernel_s:g} s)")

#: What to install, for every message that refuses a DeepEP.
INSTALL = ("build DeepEP's V1 line (commit 567632d) with the patches of "
           "scripts/deepep/build.sh (moe-plugins' docs/backends.md), or install a current-line "
           "DeepEP (d4f41e4 or later) that keeps the legacy deep_ep.Buffer")

_LINE_WORDS = {
    V1: "DeepEP V1 line (deep_ep.Buffer of deep_ep/buffer.py)",
    LEGACY: "DeepEP current line, legacy Buffer (deep_ep.Buffer of deep_ep/buffers/legacy.py, "
            "beside V2's ElasticBuffer)",
    V2_ONLY: "DeepEP V2 API only (ElasticBuffer, no legacy deep_ep.Buffer)",
    UNKNOWN: "not a DeepEP API moe-plugins knows (no deep_ep.Buffer with the V1 methods, no "
             "ElasticBuffer)",
}
# The Buffer methods our backends call: without them the package is no DeepEP we can run on.
_BUFFER_METHODS = ("low_latency_dispatch", "low_latency_combine", "get_dispatch_layout",
                   "dispatch", "combine", "get_low_latency_rdma_size_hint", "destroy")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass(frozen=True)
class DeepEPFound:
    """The imported ``deep_ep``, described once (:func:`describe_deepep`).

    line: :data:`V1`, :data:`LEGACY`, :data:`V2_ONLY` or :data:`UNKNOWN` (from which classes the
        package has); version: the distribution's version, else ``deep_ep.__version__``, or
        None; commit: from the build record our script writes, else from a version's local part
        (DeepEP's setup.py appends ``+<git rev-parse --short HEAD>``), or None; patches: the
        build record's; location: where the package was imported from; extension: the module of
        its C++ classes (``deep_ep_cpp``, ``deep_ep._C``); constructor: ``Buffer.__init__``'s
        parameter names; checks_determinism: the Buffer's calls run
        ``check_torch_deterministic()``; timeouts: its compiled bounds on a wait for a peer
        (:class:`Timeouts`).
    """

    line: str
    version: Optional[str] = None
    commit: Optional[str] = None
    patches: tuple[str, ...] = ()
    location: str = "?"
    extension: Optional[str] = None
    constructor: frozenset[str] = field(default_factory=frozenset)
    checks_determinism: bool = False
    timeouts: Timeouts = Timeouts()

    def describe(self) -> str:
        """One line: the line, the commit (or version), the patches and the timeouts it was
        built with, where the package says."""
        words = _LINE_WORDS[self.line]
        if self.commit:
            words += f", commit {self.commit}"
        elif self.version:
            words += f", version {self.version} (no commit recorded)"
        else:
            words += ", commit unknown (no build record, no version)"
        if self.patches:
            words += f" with {', '.join(self.patches)}"
        if self.timeouts.recorded:
            words += f", {self.timeouts.describe()}"
        return words

    def unusable_reason(self) -> Optional[str]:
        """Why our DeepEP backends cannot run on this package (None: they can)."""
        if self.line in (V1, LEGACY):
            return None
        return (f"deep_ep at {self.location} is {self.describe()}; moe-plugins' DeepEP backends "
                f"call deep_ep.Buffer: {INSTALL}")

    def buffer_kwargs(self, requested: dict[str, bool], backend: str) -> dict[str, bool]:
        """The optional ``Buffer`` switches to pass: those of ``requested`` that are on (so a
        constructor without one still gets the call it knows), each checked against the
        installed constructor. ``use_fabric`` on a constructor without it (the current line,
        whose runtime allocates through the fabric API when ``allow_mnnvl`` is on): dropped with
        ``allow_mnnvl``, a ValueError without. Any other switch it lacks: ValueError."""
        out: dict[str, bool] = {}
        for name, on in requested.items():
            if not on:
                continue
            if name in self.constructor:
                out[name] = True
            elif name == "use_fabric" and requested.get("allow_mnnvl"):
                continue  # allow_mnnvl turns the fabric API on in this constructor
            elif name == "use_fabric":
                raise ValueError(
                    f"{backend}: use_fabric=True, but this DeepEP's Buffer ({self.describe()}) "
                    "has no use_fabric: it allocates through the fabric API exactly when "
                    "allow_mnnvl is on; pass allow_mnnvl=True with it, or use_fabric=False")
            else:
                raise ValueError(
                    f"{backend}: {name}=True, but this DeepEP's Buffer ({self.describe()}) takes "
                    f"no {name} (its parameters: {sorted(self.constructor)}); turn it off, or "
                    f"{INSTALL}")
        return out

    def determinism_error(self, backend: str) -> Optional[ValueError]:
        """The error for a call this DeepEP would refuse with its ``check_torch_deterministic``
        assert (torch's deterministic algorithms with ``fill_uninitialized_memory``); None
        when it runs the call (always on a DeepEP without that check)."""
        if not (self.checks_determinism and torch.are_deterministic_algorithms_enabled()
                and torch.utils.deterministic.fill_uninitialized_memory):
            return None
        return ValueError(
            f"{backend}: torch.use_deterministic_algorithms(True) is on with "
            "torch.utils.deterministic.fill_uninitialized_memory = True, and this DeepEP "
            f"({self.describe()}) refuses its calls then (torch.empty would launch a fill kernel "
            "that races DeepEP's communication stream); set "
            "torch.utils.deterministic.fill_uninitialized_memory = False, or turn deterministic "
            "algorithms off")


# Probed once per imported module object (the tests swap emulated modules in and out; the
# module is kept with its answer so that its id cannot be reused by another).
_FOUND: dict[int, tuple[ModuleType, DeepEPFound]] = {}


def describe_deepep(lib: ModuleType) -> DeepEPFound:
    """Describe the imported ``deep_ep`` module ``lib`` (cached per module object)."""
    cached = _FOUND.get(id(lib))
    if cached is not None and cached[0] is lib:
        return cached[1]
    found = _probe(lib)
    _FOUND[id(lib)] = (lib, found)
    return found


def require_buffer_api(lib: ModuleType, backend: str) -> DeepEPFound:
    """:func:`describe_deepep`, or ImportError when the package has no Buffer our backends can
    run on (V2 only, or unknown): what was found and what to install."""
    found = describe_deepep(lib)
    reason = found.unusable_reason()
    if reason is not None:
        raise ImportError(f"backend {backend!r}: {reason}")
    return found


def deepep_status(lib: ModuleType) -> tuple[str, Optional[str]]:
    """``RequiredPackage.describe`` of ``deep_ep``: (what was found, why unusable or None)."""
    found = describe_deepep(lib)
    return found.describe(), found.unusable_reason()


def _probe(lib: ModuleType) -> DeepEPFound:
    buffer = getattr(lib, "Buffer", None)
    has_buffer = buffer is not None and all(callable(getattr(buffer, m, None))
                                            for m in _BUFFER_METHODS)
    elastic = getattr(lib, "ElasticBuffer", None) is not None
    line = (LEGACY if has_buffer and elastic else V1 if has_buffer
            else V2_ONLY if elastic else UNKNOWN)
    location = str(getattr(lib, "__file__", None) or "?")
    version = _distribution_version(lib) or _text(getattr(lib, "__version__", None))
    record = _build_record(lib)
    commit = _text(record.get("commit")) or _commit_of(version)
    patches = tuple(str(p) for p in record.get("patches", ()) if p)
    config = getattr(lib, "Config", None)
    constructor: frozenset[str] = frozenset()
    checks = False
    if has_buffer:
        try:
            constructor = frozenset(inspect.signature(buffer.__init__).parameters) - {"self"}
        except (TypeError, ValueError):
            pass
        # the module the wrappers run in has the check they call (legacy.py imports it)
        checks = any(callable(getattr(getattr(buffer, m), "__globals__", {}).get(
            "check_torch_deterministic")) for m in ("low_latency_dispatch", "dispatch"))
    return DeepEPFound(line, version, commit, patches, location,
                       getattr(config, "__module__", None), constructor, checks,
                       _timeouts(record.get("timeouts")))


def _timeouts(recorded: Any) -> Timeouts:
    """The build record's ``timeouts`` (DeepEP's defaults where it names none, or a value that
    is not a positive number)."""
    if not isinstance(recorded, dict):
        return Timeouts()
    cpu, cycles = recorded.get("NUM_CPU_TIMEOUT_SECS"), recorded.get("NUM_TIMEOUT_CYCLES")
    if not all(isinstance(v, (int, float)) and v > 0 for v in (cpu, cycles)):
        return Timeouts()
    return Timeouts(float(cpu), int(cycles), True)


def _text(value: Any) -> Optional[str]:
    return str(value) if isinstance(value, str) and value else None


def _commit_of(version: Optional[str]) -> Optional[str]:
    """``2.1.0+dd758ca`` -> ``dd758ca``; None where the local part is no commit (``+local``)."""
    if not version or "+" not in version:
        return None
    local = version.split("+", 1)[1]
    return local if _COMMIT.match(local) else None


def _build_record(lib: ModuleType) -> dict:
    """The build record beside the package's ``__init__.py`` (our build script's), or {}."""
    where = getattr(lib, "__file__", None)
    if not where:
        return {}
    try:
        record = json.loads((Path(where).parent / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _distribution_version(lib: ModuleType) -> Optional[str]:
    """The version of the installed ``deep_ep`` distribution whose files hold the imported
    package (a build run in place, on PYTHONPATH, has none; another copy's is not this one's)."""
    where = getattr(lib, "__file__", None)
    if not where:
        return None
    try:
        dist = importlib.metadata.distribution("deep_ep")
    except importlib.metadata.PackageNotFoundError:
        return None
    package = Path(where).resolve().parent
    for f in dist.files or ():
        if f.name == "__init__.py" and f.parent.name == "deep_ep":
            try:
                if Path(str(dist.locate_file(f))).resolve().parent == package:
                    return dist.version
            except OSError:
                continue
    editable = dist.read_text("direct_url.json")
    if editable:
        try:
            url = json.loads(editable).get("url", "")
        except ValueError:
            url = ""
        if url.startswith("file://") and package.parent == Path(url[7:]).resolve():
            return dist.version
    return None
