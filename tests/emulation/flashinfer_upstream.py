"""The flashinfer classes, functions and module names our flashinfer backends (two-sided and
one-sided) and their emulations (tests/emulation/flashinfer_two_sided.py, flashinfer_one_sided.py,
flashinfer_mnnvl.py) use, as the published wheels define them, read with
``ast`` from the wheels' Python files (:data:`FILES`):

- "0.7.2.post1": flashinfer_python-0.7.2.post1-py3-none-any.whl (MnnvlMoe and moe_ep; the
  one-sided class wraps comm/trtllm_moe_alltoall.py's MoeAlltoAll),
- "0.7.4": flashinfer_python-0.7.4-py3-none-any.whl (moe_ep only; comm/trtllm_alltoall.py and
  comm/trtllm_moe_alltoall.py are gone).

Per class: its decorators and bases, its dataclass fields ``(name, default, keyword-only)``, its
methods ``name -> (kind, ((parameter, default, kind), ...))`` (method kinds "", "static",
"class", "property"; parameter kinds "pos", "kw", "*", "**"; ``self``/``cls`` left out), its
class attributes and the attributes its methods set on ``self``. Defaults are ``repr`` of the
value where the source is a constant expression, else the source text. A class's methods include
those of its bases in :data:`FILES` (NVLinkTwoSidedAlltoAll's MoEEpCommunication). Per module:
which of the names the emulation installs it defines or imports.

The emulation is checked against this (tests/emulation/test_flashinfer_upstream.py).
The table is data, kept in flashinfer_upstream.json (:data:`TABLE`); regenerate it from the two
wheels with ``python -m tests.emulation.flashinfer_upstream WHEEL_0.7.2.post1 WHEEL_0.7.4``.
"""
from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["FILES", "MODULES", "TABLE", "UPSTREAM", "read_wheel", "effective_methods"]

#: Python file in the wheel -> the classes and top-level functions read from it.
FILES: dict[str, tuple[str, ...]] = {
    "flashinfer/moe_ep/config.py": ("BootstrapConfig",),
    "flashinfer/moe_ep/core/comm/communication.py": (
        "MoEEpCommParams", "MoEEpDispatchResult", "MoEEpCommunication", "create_communication"),
    "flashinfer/moe_ep/backends/split/comm/nvlink_two_sided/config.py": ("NVLinkTwoSidedConfig",),
    "flashinfer/moe_ep/backends/split/comm/nvlink_two_sided/communication.py": (
        "NVLinkTwoSidedAlltoAll",),
    "flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/config.py": ("NVLinkOneSidedConfig",),
    "flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/communication.py": (
        "NVLinkOneSidedAlltoAll",),
    "flashinfer/fused_moe/api.py": ("QuantFormat",),
    "flashinfer/comm/trtllm_moe_alltoall.py": ("moe_a2a_active_rank_mask",),
    "flashinfer/comm/mapping.py": ("Mapping",),
    "flashinfer/comm/mnnvl.py": ("MnnvlConfig", "MnnvlMemory"),
    "flashinfer/comm/abstractions.py": ("CommBackend",),
    "flashinfer/comm/trtllm_alltoall.py": (
        "MoEAlltoallInfo", "MnnvlMoe", "moe_prepare", "moe_comm",
        "get_moe_commworkspace_size_per_rank", "get_moe_prepare_workspace_size_per_rank"),
}
#: Module the emulation installs -> its file in the wheel.
MODULES = {
    "flashinfer.comm": "flashinfer/comm/__init__.py",
    "flashinfer.comm.mapping": "flashinfer/comm/mapping.py",
    "flashinfer.comm.mnnvl": "flashinfer/comm/mnnvl.py",
    "flashinfer.comm.trtllm_alltoall": "flashinfer/comm/trtllm_alltoall.py",
    "flashinfer.moe_ep": "flashinfer/moe_ep/__init__.py",
    "flashinfer.fused_moe": "flashinfer/fused_moe/__init__.py",
}
_NAMES = {n for names in FILES.values() for n in names}


def _default(node: ast.expr) -> str:
    """repr of a constant expression's value (so ``1 << 29`` reads as the emulation's
    ``repr(536870912)``), else the source text."""
    if all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
           for n in ast.walk(node)):
        return repr(eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}}))
    return ast.unparse(node)


def _parameters(f: ast.FunctionDef) -> tuple[tuple[str, str | None, str], ...]:
    a = f.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [_default(d) for d in a.defaults]
    out = [(p.arg, d, "pos") for p, d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, None, "*"))
    out += [(p.arg, None if d is None else _default(d), "kw")
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, None, "**"))
    return tuple(p for p in out if p[0] not in ("self", "cls"))


def _method_kind(f: ast.FunctionDef) -> str:
    names = {ast.unparse(d) for d in f.decorator_list}
    for kind, decorator in (("static", "staticmethod"), ("class", "classmethod"),
                            ("property", "property")):
        if decorator in names:
            return kind
    return ""


def _field(stmt: ast.AnnAssign) -> tuple[str, str | None, bool]:
    """(name, default, keyword-only) of a dataclass field; ``field(default=..., kw_only=...)``
    read through."""
    assert isinstance(stmt.target, ast.Name)
    value, kw_only = stmt.value, False
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
        kws = {k.arg: k.value for k in value.keywords}
        kw_only = "kw_only" in kws and ast.literal_eval(kws["kw_only"]) is True
        if "default" in kws:
            value = kws["default"]
        elif "default_factory" in kws:
            return stmt.target.id, f"default_factory={ast.unparse(kws['default_factory'])}", kw_only
        else:
            value = None
    return stmt.target.id, None if value is None else _default(value), kw_only


def _class(node: ast.ClassDef) -> dict[str, Any]:
    decorators = tuple(ast.unparse(d) for d in node.decorator_list)
    is_dataclass = any(d.split("(")[0] in ("dataclass", "dataclasses.dataclass")
                       for d in decorators)
    fields, attrs, methods, self_attrs = [], set(), {}, set()
    kw_only_rest = False  # after ``_: KW_ONLY``
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            annotation = ast.unparse(stmt.annotation)
            if is_dataclass and annotation.endswith("KW_ONLY"):
                kw_only_rest = True
            elif is_dataclass and "ClassVar" not in annotation:
                name, default, kw_only = _field(stmt)
                fields.append((name, default, kw_only or kw_only_rest))
            else:
                attrs.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            attrs.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.FunctionDef):
            setter = any(ast.unparse(d).endswith((".setter", ".deleter"))
                         for d in stmt.decorator_list)  # the property's getter stands for it
            public = not stmt.name.startswith("_") or stmt.name.endswith("__")
            if public and not setter:
                methods[stmt.name] = (_method_kind(stmt), _parameters(stmt))
            for sub in ast.walk(stmt):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    self_attrs.add(sub.attr)
    return dict(decorators=decorators, bases=tuple(ast.unparse(b) for b in node.bases),
                fields=tuple(fields), methods=methods, attrs=tuple(sorted(attrs)),
                self_attrs=tuple(sorted(self_attrs)))


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return names


def read_wheel(wheel: str) -> dict[str, Any]:
    """The table of one flashinfer wheel: classes, functions and module names of interest."""
    classes, functions, modules = {}, {}, {}
    with zipfile.ZipFile(wheel) as z:
        present = set(z.namelist())
        for path, names in FILES.items():
            if path not in present:
                continue
            for node in ast.parse(z.read(path)).body:
                if isinstance(node, ast.ClassDef) and node.name in names:
                    classes[node.name] = _class(node)
                elif isinstance(node, ast.FunctionDef) and node.name in names:
                    functions[node.name] = _parameters(node)
        for module, path in MODULES.items():
            if path in present:
                modules[module] = tuple(sorted(_top_level_names(ast.parse(z.read(path)))
                                               & _NAMES))
    return dict(classes=classes, functions=functions, modules=modules)


def effective_methods(table: dict[str, Any], cls: str) -> dict[str, tuple]:
    """``cls``'s methods with those it inherits from its bases in the table."""
    info = table["classes"][cls]
    out: dict[str, tuple] = {}
    for base in info["bases"]:
        if base in table["classes"]:
            out.update(effective_methods(table, base))
    out.update(info["methods"])
    return out


#: The table (JSON next to this file, lists read back as tuples): release -> {"classes": ...,
#: "modules": ...}, as :func:`read_wheel` gives it.
TABLE = Path(__file__).with_suffix(".json")


def _tuples(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _tuples(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return tuple(_tuples(v) for v in obj)
    return obj


UPSTREAM: dict[str, dict[str, Any]] = _tuples(json.loads(TABLE.read_text()))


def main(wheels: list[str]) -> None:
    """Write :data:`TABLE` as read from the flashinfer wheels ``wheels``."""
    table = {}
    for wheel in wheels:
        version = wheel.rsplit("/", 1)[-1].split("-")[1]
        table[version] = read_wheel(wheel)
    TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE} ({', '.join(sorted(table))})")


if __name__ == "__main__":
    main(sys.argv[1:])
