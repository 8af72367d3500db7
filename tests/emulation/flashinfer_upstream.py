"""The flashinfer classes, functions and module names our flashinfer backend and its emulation
(tests/emulation/flashinfer_two_sided.py) use, as the published wheels define them, read with
``ast`` from the wheels' Python files (:data:`FILES`):

- "0.7.2.post1": flashinfer_python-0.7.2.post1-py3-none-any.whl (MnnvlMoe and moe_ep),
- "0.7.4": flashinfer_python-0.7.4-py3-none-any.whl (moe_ep only; comm/trtllm_alltoall.py is
  gone).

Per class: its decorators and bases, its dataclass fields ``(name, default, keyword-only)``, its
methods ``name -> (kind, ((parameter, default, kind), ...))`` (method kinds "", "static",
"class", "property"; parameter kinds "pos", "kw", "*", "**"; ``self``/``cls`` left out), its
class attributes and the attributes its methods set on ``self``. Defaults are ``repr`` of the
value where the source is a constant expression, else the source text. A class's methods include
those of its bases in :data:`FILES` (NVLinkTwoSidedAlltoAll's MoEEpCommunication). Per module:
which of the names the emulation installs it defines or imports.

The emulation is checked against this (tests/emulation/test_flashinfer_upstream.py).
Regenerate from the two wheels with
``python -m tests.emulation.flashinfer_upstream WHEEL_0.7.2.post1 WHEEL_0.7.4`` (prints
:data:`UPSTREAM`).
"""
from __future__ import annotations

import ast
import sys
import zipfile
from typing import Any

__all__ = ["FILES", "MODULES", "UPSTREAM", "read_wheel", "effective_methods"]

#: Python file in the wheel -> the classes and top-level functions read from it.
FILES: dict[str, tuple[str, ...]] = {
    "flashinfer/moe_ep/config.py": ("BootstrapConfig",),
    "flashinfer/moe_ep/core/comm/communication.py": (
        "MoEEpCommParams", "MoEEpDispatchResult", "MoEEpCommunication"),
    "flashinfer/moe_ep/backends/split/comm/nvlink_two_sided/config.py": ("NVLinkTwoSidedConfig",),
    "flashinfer/moe_ep/backends/split/comm/nvlink_two_sided/communication.py": (
        "NVLinkTwoSidedAlltoAll",),
    "flashinfer/comm/mapping.py": ("Mapping",),
    "flashinfer/comm/mnnvl.py": ("MnnvlConfig", "MnnvlMemory"),
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


UPSTREAM: dict[str, dict[str, Any]] = {
    '0.7.2.post1': {
        'classes': {
            'BootstrapConfig': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass(frozen=True)',),
                'fields': (
                    ('world_size', None, False),
                    ('rank', None, False),
                    ('stream', '0', False),
                    ('auto_bootstrap', 'True', False),
                    ('device', 'None', True),
                    ('nccl_comm', 'None', False),
                    ('process_group', 'None', False),
                    ('tcp_store', 'None', False),
                ),
                'methods': {'__post_init__': ('', ())},
                'self_attrs': (),
            },
            'Mapping': {
                'attrs': (),
                'bases': ('object',),
                'decorators': (),
                'fields': (),
                'methods': {
                    '__eq__': ('', (('other', None, 'pos'),)),
                    '__hash__': ('', ()),
                    '__init__': (
                        '',
                        (
                            ('world_size', '1', 'pos'),
                            ('rank', '0', 'pos'),
                            ('gpus_per_node', '8', 'pos'),
                            ('cp_size', '1', 'kw'),
                            ('cp_config', 'None', 'kw'),
                            ('tp_size', '1', 'kw'),
                            ('pp_size', '1', 'kw'),
                            ('moe_cluster_size', '-1', 'kw'),
                            ('moe_tp_size', '-1', 'kw'),
                            ('moe_ep_size', '-1', 'kw'),
                            ('attn_tp_size', '-1', 'kw'),
                            ('attn_cp_size', '-1', 'kw'),
                            ('auto_parallel', 'False', 'kw'),
                            ('enable_attention_dp', 'False', 'kw'),
                        ),
                    ),
                    'cp_group': ('property', ()),
                    'cp_rank': ('property', ()),
                    'ep_experts': ('', (('num_experts', None, 'pos'),)),
                    'from_dict': ('class', (('mapping', None, 'pos'),)),
                    'get_local_rank': ('', (('rank', None, 'pos'),)),
                    'get_node_rank': ('', (('rank', None, 'pos'),)),
                    'has_cp': ('', ()),
                    'has_moe_cluster': ('', ()),
                    'has_moe_ep': ('', ()),
                    'has_moe_tp': ('', ()),
                    'has_pp': ('', ()),
                    'has_tp': ('', ()),
                    'is_first_pp_rank': ('', ()),
                    'is_last_pp_rank': ('', ()),
                    'is_multi_node': ('', ()),
                    'is_second_last_pp_rank': ('', ()),
                    'local_rank': ('property', ()),
                    'moe_cluster_group': ('property', ()),
                    'moe_cluster_rank': ('property', ()),
                    'moe_ep_group': ('property', ()),
                    'moe_ep_rank': ('property', ()),
                    'moe_tp_group': ('property', ()),
                    'moe_tp_rank': ('property', ()),
                    'next_pp_rank': ('', ()),
                    'node_rank': ('property', ()),
                    'pp_group': ('property', ()),
                    'pp_layers': ('', (('num_layers', None, 'pos'),)),
                    'pp_rank': ('property', ()),
                    'prev_pp_rank': ('', ()),
                    'rank': ('property', ()),
                    'to_dict': ('', ()),
                    'tp_group': ('property', ()),
                    'tp_rank': ('property', ()),
                },
                'self_attrs': (
                    '_rank',
                    'attn_cp_size',
                    'attn_tp_size',
                    'auto_parallel',
                    'cp_config',
                    'cp_groups',
                    'cp_size',
                    'enable_attention_dp',
                    'gpus_per_node',
                    'moe_cluster_groups',
                    'moe_cluster_size',
                    'moe_ep_groups',
                    'moe_ep_size',
                    'moe_tp_groups',
                    'moe_tp_size',
                    'pp_groups',
                    'pp_size',
                    'rank',
                    'tp_groups',
                    'tp_size',
                    'world_size',
                ),
            },
            'MnnvlConfig': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass',),
                'fields': (
                    ('comm_backend', 'None', False),
                    ('allocation_granularity', '0', False),
                    ('fabric_page_size', '536870912', False),
                ),
                'methods': {},
                'self_attrs': (),
            },
            'MnnvlMemory': {
                'attrs': (
                    '_fabric_supported',
                    'address_refcnt',
                    'allocated_map',
                    'allocation_granularity',
                    'comm',
                    'config',
                    'current_mem_offset',
                    'current_rank_stride',
                    'current_start_address',
                    'dev_id',
                    'fabric_page_size',
                    'initialized',
                ),
                'bases': (),
                'decorators': (),
                'fields': (),
                'methods': {
                    '__del__': ('', ()),
                    '__init__': (
                        '',
                        (
                            ('mapping', None, 'pos'),
                            ('size', None, 'pos'),
                        ),
                    ),
                    'as_torch_strided_tensor': ('', (('dtype', None, 'pos'),)),
                    'close_mnnvl_memory': ('static', (('ptr', None, 'pos'),)),
                    'get_allocation_granularity': ('static', (('dev_id', None, 'pos'),)),
                    'get_allocation_prop': ('static', (('dev_id', None, 'pos'),)),
                    'get_comm': ('static', (('mapping', None, 'pos'),)),
                    'initialize': ('static', ()),
                    'mapped': ('property', ()),
                    'new_mnnvl_memory_address': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('size', None, 'pos'),
                        ),
                    ),
                    'open_mnnvl_memory': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('size', None, 'pos'),
                        ),
                    ),
                    'set_comm_from_config': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('config', 'None', 'pos'),
                        ),
                    ),
                    'support_nvlink': ('static', (('need_all_up', 'True', 'pos'),)),
                    'supports_mnnvl': ('static', ()),
                },
                'self_attrs': ('mapping', 'ptr', 'rank_stride', 'segment_size'),
            },
            'MnnvlMoe': {
                'attrs': (
                    'moe_mapping',
                    'moe_prepare_workspace',
                    'moe_prepare_workspace_tensor',
                    'moe_workspace',
                    'moe_workspace_tensor',
                ),
                'bases': (),
                'decorators': ('deprecated(_MNNVL_MOE_DEPRECATION)',),
                'fields': (),
                'methods': {
                    'compute_target_rank_id': (
                        'static',
                        (
                            ('token_selected_experts', None, 'pos'),
                            ('expert_count', None, 'pos'),
                            ('ep_size', None, 'pos'),
                        ),
                    ),
                    'get_moe_prepare_workspace': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('config', 'None', 'pos'),
                        ),
                    ),
                    'get_moe_workspaces': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('config', 'None', 'pos'),
                        ),
                    ),
                    'mnnvl_moe_alltoallv': (
                        'static',
                        (
                            ('x', None, 'pos'),
                            ('alltoall_info', None, 'pos'),
                            ('workspace', None, 'pos'),
                            ('ep_rank', None, 'pos'),
                            ('ep_size', None, 'pos'),
                        ),
                    ),
                    'mnnvl_moe_alltoallv_combine': (
                        'static',
                        (
                            ('x', None, 'pos'),
                            ('alltoall_info', None, 'pos'),
                            ('workspace', None, 'pos'),
                            ('ep_rank', None, 'pos'),
                            ('ep_size', None, 'pos'),
                            ('top_k', None, 'pos'),
                            ('token_count', None, 'pos'),
                        ),
                    ),
                    'mnnvl_moe_alltoallv_prepare': (
                        'static',
                        (
                            ('gathered_target_rank_ids', None, 'pos'),
                            (
                                'real_rank_token_count_cumsum',
                                None,
                                'pos',
                            ),
                            ('gathered_expert_ids', None, 'pos'),
                            ('gathered_scales', None, 'pos'),
                            ('max_token_count_per_rank', None, 'pos'),
                            ('expert_count', None, 'pos'),
                            ('top_k', None, 'pos'),
                            ('ep_rank', None, 'pos'),
                            ('ep_size', None, 'pos'),
                        ),
                    ),
                    'mnnvl_moe_alltoallv_prepare_without_allgather': (
                        'static',
                        (
                            ('expert_ids', None, 'pos'),
                            ('scales', None, 'pos'),
                            ('expert_statics', None, 'pos'),
                            ('workspace', None, 'pos'),
                            ('max_token_count_per_rank', None, 'pos'),
                            ('ep_rank', None, 'pos'),
                            ('ep_size', None, 'pos'),
                            ('expert_count', None, 'pos'),
                            ('slot_count', None, 'pos'),
                            ('top_k', None, 'pos'),
                        ),
                    ),
                },
                'self_attrs': (),
            },
            'MoEAlltoallInfo': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass',),
                'fields': (
                    ('local_gather_indices', None, False),
                    ('send_rank_count_cumsum', None, False),
                    ('send_rank_local_indices', None, False),
                    ('recv_rank_count_cumsum', None, False),
                    ('recv_rank_local_indices', None, False),
                    ('backward_recv_rank_local_indices', None, False),
                    ('local_token_allocation_count', None, False),
                ),
                'methods': {},
                'self_attrs': (),
            },
            'MoEEpCommParams': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass(frozen=True)',),
                'fields': (
                    ('num_experts', None, False),
                    ('top_k', None, False),
                    ('max_tokens_per_rank', None, False),
                    ('hidden_size', None, False),
                    ('dtype', 'None', False),
                    ('dispatch_format', 'None', False),
                    ('invalid_expert_id', '-1', False),
                ),
                'methods': {
                    '__post_init__': ('', ()),
                    'dispatch_bytes_per_token': ('property', ()),
                    'token_dtype': ('property', ()),
                },
                'self_attrs': (),
            },
            'MoEEpCommunication': {
                'attrs': ('backend_name', 'supports_cuda_graph'),
                'bases': ('ABC',),
                'decorators': (),
                'fields': (),
                'methods': {
                    '__init__': (
                        '',
                        (
                            ('bootstrap', None, 'pos'),
                            ('params', None, 'pos'),
                        ),
                    ),
                    'combine': (
                        '',
                        (
                            ('expert_output', None, 'pos'),
                            ('output', 'None', 'kw'),
                        ),
                    ),
                    'destroy': ('', ()),
                    'dispatch': (
                        '',
                        (
                            ('hidden_states', None, 'pos'),
                            ('topk_ids', None, 'pos'),
                            ('topk_weights', 'None', 'pos'),
                            ('hidden_states_scale', 'None', 'kw'),
                            ('max_tokens_per_rank', 'None', 'kw'),
                            ('eplb_local_stats', 'None', 'kw'),
                        ),
                    ),
                    'get_combine_input_buffer': ('', (('dtype', None, 'pos'),)),
                    'is_platform_supported': ('class', ()),
                    'is_workload_feasible': ('', (('max_tokens_per_rank', None, 'pos'),)),
                },
                'self_attrs': (
                    'bootstrap',
                    'ep_rank',
                    'ep_size',
                    'num_local_experts',
                    'params',
                ),
            },
            'MoEEpDispatchResult': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass(frozen=True)',),
                'fields': (
                    ('hidden_states', None, False),
                    ('topk_ids', None, False),
                    ('topk_weights', None, False),
                    ('tokens_per_rank', None, False),
                    ('hidden_states_scale', 'None', False),
                    ('eplb_gathered_stats', 'None', False),
                ),
                'methods': {},
                'self_attrs': (),
            },
            'NVLinkTwoSidedAlltoAll': {
                'attrs': (),
                'bases': ('MoEEpCommunication',),
                'decorators': ("register_communication('nvlink_two_sided')",),
                'fields': (),
                'methods': {
                    '__init__': (
                        '',
                        (
                            ('bootstrap', None, 'pos'),
                            ('params', None, 'pos'),
                            ('config', 'None', 'pos'),
                        ),
                    ),
                    'combine': (
                        '',
                        (
                            ('expert_output', None, 'pos'),
                            ('output', 'None', 'kw'),
                        ),
                    ),
                    'destroy': ('', ()),
                    'dispatch': (
                        '',
                        (
                            ('hidden_states', None, 'pos'),
                            ('topk_ids', None, 'pos'),
                            ('topk_weights', 'None', 'pos'),
                            ('hidden_states_scale', 'None', 'kw'),
                            ('max_tokens_per_rank', 'None', 'kw'),
                            ('eplb_local_stats', 'None', 'kw'),
                        ),
                    ),
                    'is_platform_supported': ('class', ()),
                },
                'self_attrs': (
                    '_prepare_workspace',
                    '_state',
                    '_workspace',
                    'config',
                ),
            },
            'NVLinkTwoSidedConfig': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass',),
                'fields': (
                    ('backend_name', "'nvlink_two_sided'", False),
                    ('comm_backend', 'None', False),
                ),
                'methods': {},
                'self_attrs': (),
            },
        },
        'functions': {
            'get_moe_commworkspace_size_per_rank': (('ep_size', None, 'pos'),),
            'get_moe_prepare_workspace_size_per_rank': (('ep_size', None, 'pos'),),
            'moe_comm': (
                ('input', None, 'pos'),
                ('send_rank_cum_sum', None, 'pos'),
                ('send_indices', None, 'pos'),
                ('output', None, 'pos'),
                ('recv_rank_cum_sum', None, 'pos'),
                ('recv_indices', None, 'pos'),
                ('all_workspaces', None, 'pos'),
                ('ep_rank', None, 'pos'),
                ('ep_size', None, 'pos'),
            ),
            'moe_prepare': (
                ('experts_ids', None, 'pos'),
                ('scales', None, 'pos'),
                ('experts_statics', None, 'pos'),
                ('workspace', None, 'pos'),
                ('max_token_count_per_rank', None, 'pos'),
                ('ep_rank', None, 'pos'),
                ('ep_size', None, 'pos'),
                ('expert_count', None, 'pos'),
                ('slot_count', None, 'pos'),
                ('top_k', None, 'pos'),
            ),
        },
        'modules': {
            'flashinfer.comm': ('Mapping',),
            'flashinfer.comm.mapping': ('Mapping',),
            'flashinfer.comm.mnnvl': ('Mapping', 'MnnvlConfig', 'MnnvlMemory'),
            'flashinfer.comm.trtllm_alltoall': (
                'Mapping',
                'MnnvlConfig',
                'MnnvlMemory',
                'MnnvlMoe',
                'MoEAlltoallInfo',
                'get_moe_commworkspace_size_per_rank',
                'get_moe_prepare_workspace_size_per_rank',
                'moe_comm',
                'moe_prepare',
            ),
            'flashinfer.moe_ep': (
                'BootstrapConfig',
                'MoEEpCommParams',
                'MoEEpCommunication',
                'MoEEpDispatchResult',
                'NVLinkTwoSidedAlltoAll',
                'NVLinkTwoSidedConfig',
            ),
        },
    },
    '0.7.4': {
        'classes': {
            'BootstrapConfig': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass(frozen=True)',),
                'fields': (
                    ('world_size', None, False),
                    ('rank', None, False),
                    ('stream', '0', False),
                    ('auto_bootstrap', 'True', False),
                    ('device', 'None', True),
                    ('nccl_comm', 'None', False),
                    ('process_group', 'None', False),
                    ('tcp_store', 'None', False),
                ),
                'methods': {'__post_init__': ('', ())},
                'self_attrs': (),
            },
            'Mapping': {
                'attrs': (),
                'bases': ('object',),
                'decorators': (),
                'fields': (),
                'methods': {
                    '__eq__': ('', (('other', None, 'pos'),)),
                    '__hash__': ('', ()),
                    '__init__': (
                        '',
                        (
                            ('world_size', '1', 'pos'),
                            ('rank', '0', 'pos'),
                            ('gpus_per_node', '8', 'pos'),
                            ('cp_size', '1', 'kw'),
                            ('cp_config', 'None', 'kw'),
                            ('tp_size', '1', 'kw'),
                            ('pp_size', '1', 'kw'),
                            ('moe_cluster_size', '-1', 'kw'),
                            ('moe_tp_size', '-1', 'kw'),
                            ('moe_ep_size', '-1', 'kw'),
                            ('attn_tp_size', '-1', 'kw'),
                            ('attn_cp_size', '-1', 'kw'),
                            ('auto_parallel', 'False', 'kw'),
                            ('enable_attention_dp', 'False', 'kw'),
                        ),
                    ),
                    'cp_group': ('property', ()),
                    'cp_rank': ('property', ()),
                    'ep_experts': ('', (('num_experts', None, 'pos'),)),
                    'from_dict': ('class', (('mapping', None, 'pos'),)),
                    'get_local_rank': ('', (('rank', None, 'pos'),)),
                    'get_node_rank': ('', (('rank', None, 'pos'),)),
                    'has_cp': ('', ()),
                    'has_moe_cluster': ('', ()),
                    'has_moe_ep': ('', ()),
                    'has_moe_tp': ('', ()),
                    'has_pp': ('', ()),
                    'has_tp': ('', ()),
                    'is_first_pp_rank': ('', ()),
                    'is_last_pp_rank': ('', ()),
                    'is_multi_node': ('', ()),
                    'is_second_last_pp_rank': ('', ()),
                    'local_rank': ('property', ()),
                    'moe_cluster_group': ('property', ()),
                    'moe_cluster_rank': ('property', ()),
                    'moe_ep_group': ('property', ()),
                    'moe_ep_rank': ('property', ()),
                    'moe_tp_group': ('property', ()),
                    'moe_tp_rank': ('property', ()),
                    'next_pp_rank': ('', ()),
                    'node_rank': ('property', ()),
                    'pp_group': ('property', ()),
                    'pp_layers': ('', (('num_layers', None, 'pos'),)),
                    'pp_rank': ('property', ()),
                    'prev_pp_rank': ('', ()),
                    'rank': ('property', ()),
                    'to_dict': ('', ()),
                    'tp_group': ('property', ()),
                    'tp_rank': ('property', ()),
                },
                'self_attrs': (
                    '_rank',
                    'attn_cp_size',
                    'attn_tp_size',
                    'auto_parallel',
                    'cp_config',
                    'cp_groups',
                    'cp_size',
                    'enable_attention_dp',
                    'gpus_per_node',
                    'moe_cluster_groups',
                    'moe_cluster_size',
                    'moe_ep_groups',
                    'moe_ep_size',
                    'moe_tp_groups',
                    'moe_tp_size',
                    'pp_groups',
                    'pp_size',
                    'rank',
                    'tp_groups',
                    'tp_size',
                    'world_size',
                ),
            },
            'MnnvlConfig': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass',),
                'fields': (
                    ('comm_backend', 'None', False),
                    ('allocation_granularity', '0', False),
                    ('fabric_page_size', '536870912', False),
                ),
                'methods': {},
                'self_attrs': (),
            },
            'MnnvlMemory': {
                'attrs': (
                    'address_refcnt',
                    'allocated_map',
                    'allocation_granularity',
                    'comm',
                    'config',
                    'current_mem_offset',
                    'current_rank_stride',
                    'current_start_address',
                    'dev_id',
                    'fabric_page_size',
                    'initialized',
                ),
                'bases': (),
                'decorators': (),
                'fields': (),
                'methods': {
                    '__del__': ('', ()),
                    '__init__': (
                        '',
                        (
                            ('mapping', None, 'pos'),
                            ('size', None, 'pos'),
                        ),
                    ),
                    'as_torch_strided_tensor': ('', (('dtype', None, 'pos'),)),
                    'close_mnnvl_memory': ('static', (('ptr', None, 'pos'),)),
                    'fabric_handles': ('property', ()),
                    'get_allocation_granularity': ('static', (('dev_id', None, 'pos'),)),
                    'get_allocation_prop': (
                        'static',
                        (
                            ('dev_id', None, 'pos'),
                            ('handle_type', None, 'pos'),
                        ),
                    ),
                    'get_comm': ('static', (('mapping', None, 'pos'),)),
                    'initialize': ('static', ()),
                    'local_mem_handle': ('property', ()),
                    'mapped': ('property', ()),
                    'new_mnnvl_memory_address': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('size', None, 'pos'),
                        ),
                    ),
                    'open_mnnvl_memory': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('size', None, 'pos'),
                        ),
                    ),
                    'set_comm_from_config': (
                        'static',
                        (
                            ('mapping', None, 'pos'),
                            ('config', 'None', 'pos'),
                        ),
                    ),
                    'support_nvlink': ('static', (('need_all_up', 'True', 'pos'),)),
                    'supports_mnnvl': ('static', ()),
                    'uses_fabric_handles': (
                        'static',
                        (
                            ('comm', None, 'pos'),
                            ('dev_id', None, 'pos'),
                        ),
                    ),
                },
                'self_attrs': ('mapping', 'ptr', 'rank_stride', 'segment_size'),
            },
            'MoEEpCommParams': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass(frozen=True)',),
                'fields': (
                    ('num_experts', None, False),
                    ('top_k', None, False),
                    ('max_tokens_per_rank', None, False),
                    ('hidden_size', None, False),
                    ('dtype', 'None', False),
                    ('dispatch_format', 'None', False),
                    ('invalid_expert_id', '-1', False),
                ),
                'methods': {
                    '__post_init__': ('', ()),
                    'dispatch_bytes_per_token': ('property', ()),
                    'token_dtype': ('property', ()),
                },
                'self_attrs': (),
            },
            'MoEEpCommunication': {
                'attrs': ('backend_name', 'supports_cuda_graph'),
                'bases': ('ABC',),
                'decorators': (),
                'fields': (),
                'methods': {
                    '__init__': (
                        '',
                        (
                            ('bootstrap', None, 'pos'),
                            ('params', None, 'pos'),
                        ),
                    ),
                    'combine': (
                        '',
                        (
                            ('expert_output', None, 'pos'),
                            ('output', 'None', 'kw'),
                        ),
                    ),
                    'destroy': ('', ()),
                    'dispatch': (
                        '',
                        (
                            ('hidden_states', None, 'pos'),
                            ('topk_ids', None, 'pos'),
                            ('topk_weights', 'None', 'pos'),
                            ('hidden_states_scale', 'None', 'kw'),
                            (
                                'runtime_max_tokens_per_rank',
                                'None',
                                'kw',
                            ),
                            ('eplb_local_stats', 'None', 'kw'),
                        ),
                    ),
                    'get_combine_input_buffer': ('', (('dtype', None, 'pos'),)),
                    'is_platform_supported': ('class', ()),
                },
                'self_attrs': (
                    'bootstrap',
                    'ep_rank',
                    'ep_size',
                    'num_local_experts',
                    'params',
                ),
            },
            'MoEEpDispatchResult': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass(frozen=True)',),
                'fields': (
                    ('hidden_states', None, False),
                    ('topk_ids', None, False),
                    ('topk_weights', None, False),
                    ('tokens_per_rank', None, False),
                    ('hidden_states_scale', 'None', False),
                    ('eplb_gathered_stats', 'None', False),
                ),
                'methods': {},
                'self_attrs': (),
            },
            'NVLinkTwoSidedAlltoAll': {
                'attrs': ('_WORKSPACES',),
                'bases': ('MoEEpCommunication',),
                'decorators': ("register_communication('nvlink_two_sided')",),
                'fields': (),
                'methods': {
                    '__init__': (
                        '',
                        (
                            ('bootstrap', None, 'pos'),
                            ('params', None, 'pos'),
                            ('config', 'None', 'pos'),
                        ),
                    ),
                    'combine': (
                        '',
                        (
                            ('expert_output', None, 'pos'),
                            ('output', 'None', 'kw'),
                        ),
                    ),
                    'destroy': ('', ()),
                    'dispatch': (
                        '',
                        (
                            ('hidden_states', None, 'pos'),
                            ('topk_ids', None, 'pos'),
                            ('topk_weights', 'None', 'pos'),
                            ('hidden_states_scale', 'None', 'kw'),
                            (
                                'runtime_max_tokens_per_rank',
                                'None',
                                'kw',
                            ),
                            ('eplb_local_stats', 'None', 'kw'),
                        ),
                    ),
                    'is_platform_supported': ('class', ()),
                },
                'self_attrs': (
                    '_prepare_workspace',
                    '_state',
                    '_workspace',
                    'config',
                ),
            },
            'NVLinkTwoSidedConfig': {
                'attrs': (),
                'bases': (),
                'decorators': ('dataclass',),
                'fields': (
                    ('backend_name', "'nvlink_two_sided'", False),
                    ('comm_backend', 'None', False),
                ),
                'methods': {},
                'self_attrs': (),
            },
        },
        'functions': {},
        'modules': {
            'flashinfer.comm': ('Mapping',),
            'flashinfer.comm.mapping': ('Mapping',),
            'flashinfer.comm.mnnvl': ('Mapping', 'MnnvlConfig', 'MnnvlMemory'),
            'flashinfer.moe_ep': (
                'BootstrapConfig',
                'MoEEpCommParams',
                'MoEEpCommunication',
                'MoEEpDispatchResult',
                'NVLinkTwoSidedAlltoAll',
                'NVLinkTwoSidedConfig',
            ),
        },
    },
}


def _format(obj: Any, indent: int = 0, width: int = 100) -> str:
    """``repr`` of nested dicts and tuples, broken into lines of at most ``width`` columns
    (pprint's aligned indentation overruns them)."""
    flat = repr(obj)
    if indent + len(flat) < width - 30 or not isinstance(obj, (dict, tuple)) or not obj:
        return flat
    pad = " " * (indent + 4)
    if isinstance(obj, dict):
        items = [f"{pad}{k!r}: {_format(v, indent + 4, width)}" for k, v in sorted(obj.items())]
        return "{\n" + ",\n".join(items) + ",\n" + " " * indent + "}"
    items = [pad + _format(v, indent + 4, width) for v in obj]
    return "(\n" + ",\n".join(items) + ",\n" + " " * indent + ")"


def main(wheels: list[str]) -> None:
    """Print :data:`UPSTREAM` as read from the flashinfer wheels ``wheels``."""
    table = {}
    for wheel in wheels:
        version = wheel.rsplit("/", 1)[-1].split("-")[1]
        table[version] = read_wheel(wheel)
    print("UPSTREAM: dict[str, dict[str, Any]] = " + _format(table))


if __name__ == "__main__":
    main(sys.argv[1:])
