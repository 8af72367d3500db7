"""The public ``Buffer`` methods of DeepEP's two API shapes, as their upstream files define
them: each method's parameters with their defaults (as source text), read with ``ast`` from

- "v1": ``deep_ep/buffer.py`` at 567632d (the V1 line's last commit),
- "legacy": ``deep_ep/buffers/legacy.py`` at d4f41e4 (the same file at dd758ca).

The emulations (tests/emulation/deep_ep.py, deep_ep_legacy.py) are checked against this
(tests/emulation/test_ll_emulation.py). Regenerate from a DeepEP clone with
``python -m tests.emulation.deep_ep_upstream PATH_TO_DEEPEP_CLONE`` (prints this table).
"""
from __future__ import annotations

import ast
import subprocess
import sys

__all__ = ["SOURCES", "UPSTREAM", "buffer_methods"]

SOURCES = {"v1": ("567632d", "deep_ep/buffer.py"),
           "legacy": ("d4f41e4", "deep_ep/buffers/legacy.py")}


def buffer_methods(source: str) -> dict[str, tuple[tuple[str, str | None], ...]]:
    """class Buffer's methods in ``source``: name -> ((parameter, default source or None), ...)
    without ``self``; private methods left out."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and node.name == "Buffer"):
            continue
        for f in node.body:
            if isinstance(f, ast.FunctionDef) and (f.name == "__init__" or not f.name.startswith("_")):
                a = f.args
                names = [x.arg for x in a.posonlyargs + a.args]
                defaults = [None] * (len(names) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
                out[f.name] = tuple((n, d) for n, d in zip(names, defaults) if n != "self")
    return out


UPSTREAM: dict[str, dict[str, tuple[tuple[str, str | None], ...]]] = {'legacy': {'__init__': (('group', None),
                         ('num_nvl_bytes', '0'),
                         ('num_rdma_bytes', '0'),
                         ('low_latency_mode', 'False'),
                         ('num_qps_per_rank', '24'),
                         ('allow_nvlink_for_low_latency_mode', 'True'),
                         ('allow_mnnvl', 'False'),
                         ('explicitly_destroy', 'False'),
                         ('enable_shrink', 'False'),
                         ('comm', 'None')),
            'capture': (),
            'clean_low_latency_buffer': (('num_max_dispatch_tokens_per_rank', None),
                                         ('hidden', None),
                                         ('num_experts', None)),
            'combine': (('x', None),
                        ('handle', None),
                        ('topk_weights', 'None'),
                        ('bias', 'None'),
                        ('config', 'None'),
                        ('previous_event', 'None'),
                        ('async_finish', 'False'),
                        ('allocate_on_comm_stream', 'False')),
            'destroy': (),
            'dispatch': (('x', None),
                         ('handle', 'None'),
                         ('num_tokens_per_rank', 'None'),
                         ('num_tokens_per_rdma_rank', 'None'),
                         ('is_token_in_rank', 'None'),
                         ('num_tokens_per_expert', 'None'),
                         ('topk_idx', 'None'),
                         ('topk_weights', 'None'),
                         ('expert_alignment', '1'),
                         ('num_worst_tokens', '0'),
                         ('config', 'None'),
                         ('previous_event', 'None'),
                         ('async_finish', 'False'),
                         ('allocate_on_comm_stream', 'False')),
            'get_combine_config': (('num_ranks', None),),
            'get_comm_stream': (),
            'get_dispatch_config': (('num_ranks', None),),
            'get_dispatch_layout': (('topk_idx', None),
                                    ('num_experts', None),
                                    ('previous_event', 'None'),
                                    ('async_finish', 'False'),
                                    ('allocate_on_comm_stream', 'False')),
            'get_local_buffer_tensor': (('dtype', None),
                                        ('size', 'None'),
                                        ('offset', '0'),
                                        ('use_rdma_buffer', 'False')),
            'get_low_latency_rdma_size_hint': (('num_max_dispatch_tokens_per_rank', None),
                                               ('hidden', None),
                                               ('num_ranks', None),
                                               ('num_experts', None)),
            'get_next_low_latency_combine_buffer': (('handle', None),),
            'internode_combine': (('x', None),
                                  ('handle', None),
                                  ('topk_weights', 'None'),
                                  ('bias', 'None'),
                                  ('config', 'None'),
                                  ('previous_event', 'None'),
                                  ('async_finish', 'False'),
                                  ('allocate_on_comm_stream', 'False')),
            'internode_dispatch': (('x', None),
                                   ('handle', 'None'),
                                   ('num_tokens_per_rank', 'None'),
                                   ('num_tokens_per_rdma_rank', 'None'),
                                   ('is_token_in_rank', 'None'),
                                   ('num_tokens_per_expert', 'None'),
                                   ('topk_idx', 'None'),
                                   ('topk_weights', 'None'),
                                   ('expert_alignment', '1'),
                                   ('config', 'None'),
                                   ('previous_event', 'None'),
                                   ('async_finish', 'False'),
                                   ('allocate_on_comm_stream', 'False')),
            'is_sm90_compiled': (),
            'low_latency_clean_mask_buffer': (),
            'low_latency_combine': (('x', None),
                                    ('topk_idx', None),
                                    ('topk_weights', None),
                                    ('handle', None),
                                    ('use_logfmt', 'False'),
                                    ('zero_copy', 'False'),
                                    ('async_finish', 'False'),
                                    ('return_recv_hook', 'False'),
                                    ('out', 'None'),
                                    ('combine_wait_recv_cost_stats', 'None')),
            'low_latency_dispatch': (('x', None),
                                     ('topk_idx', None),
                                     ('num_max_dispatch_tokens_per_rank', None),
                                     ('num_experts', None),
                                     ('cumulative_local_expert_recv_stats', 'None'),
                                     ('dispatch_wait_recv_cost_stats', 'None'),
                                     ('use_fp8', 'True'),
                                     ('round_scale', 'False'),
                                     ('use_ue8m0', 'False'),
                                     ('async_finish', 'False'),
                                     ('return_recv_hook', 'False')),
            'low_latency_query_mask_buffer': (('mask_status', None),),
            'low_latency_update_mask_buffer': (('rank_to_mask', None), ('mask', 'False')),
            'set_num_sms': (('new_num_sms', None),)},
 'v1': {'__init__': (('group', None),
                     ('num_nvl_bytes', '0'),
                     ('num_rdma_bytes', '0'),
                     ('low_latency_mode', 'False'),
                     ('num_qps_per_rank', '24'),
                     ('allow_nvlink_for_low_latency_mode', 'True'),
                     ('allow_mnnvl', 'False'),
                     ('use_fabric', 'False'),
                     ('explicitly_destroy', 'False'),
                     ('enable_shrink', 'False'),
                     ('comm', 'None')),
        'capture': (),
        'clean_low_latency_buffer': (('num_max_dispatch_tokens_per_rank', None),
                                     ('hidden', None),
                                     ('num_experts', None)),
        'combine': (('x', None),
                    ('handle', None),
                    ('topk_weights', 'None'),
                    ('bias', 'None'),
                    ('config', 'None'),
                    ('previous_event', 'None'),
                    ('async_finish', 'False'),
                    ('allocate_on_comm_stream', 'False')),
        'destroy': (),
        'dispatch': (('x', None),
                     ('handle', 'None'),
                     ('num_tokens_per_rank', 'None'),
                     ('num_tokens_per_rdma_rank', 'None'),
                     ('is_token_in_rank', 'None'),
                     ('num_tokens_per_expert', 'None'),
                     ('topk_idx', 'None'),
                     ('topk_weights', 'None'),
                     ('expert_alignment', '1'),
                     ('num_worst_tokens', '0'),
                     ('config', 'None'),
                     ('previous_event', 'None'),
                     ('async_finish', 'False'),
                     ('allocate_on_comm_stream', 'False')),
        'get_combine_config': (('num_ranks', None),),
        'get_comm_stream': (),
        'get_dispatch_config': (('num_ranks', None),),
        'get_dispatch_layout': (('topk_idx', None),
                                ('num_experts', None),
                                ('previous_event', 'None'),
                                ('async_finish', 'False'),
                                ('allocate_on_comm_stream', 'False')),
        'get_local_buffer_tensor': (('dtype', None),
                                    ('size', 'None'),
                                    ('offset', '0'),
                                    ('use_rdma_buffer', 'False')),
        'get_low_latency_rdma_size_hint': (('num_max_dispatch_tokens_per_rank', None),
                                           ('hidden', None),
                                           ('num_ranks', None),
                                           ('num_experts', None)),
        'get_next_low_latency_combine_buffer': (('handle', None),),
        'internode_combine': (('x', None),
                              ('handle', None),
                              ('topk_weights', 'None'),
                              ('bias', 'None'),
                              ('config', 'None'),
                              ('previous_event', 'None'),
                              ('async_finish', 'False'),
                              ('allocate_on_comm_stream', 'False')),
        'internode_dispatch': (('x', None),
                               ('handle', 'None'),
                               ('num_tokens_per_rank', 'None'),
                               ('num_tokens_per_rdma_rank', 'None'),
                               ('is_token_in_rank', 'None'),
                               ('num_tokens_per_expert', 'None'),
                               ('topk_idx', 'None'),
                               ('topk_weights', 'None'),
                               ('expert_alignment', '1'),
                               ('num_worst_tokens', '0'),
                               ('config', 'None'),
                               ('previous_event', 'None'),
                               ('async_finish', 'False'),
                               ('allocate_on_comm_stream', 'False')),
        'is_sm90_compiled': (),
        'low_latency_clean_mask_buffer': (),
        'low_latency_combine': (('x', None),
                                ('topk_idx', None),
                                ('topk_weights', None),
                                ('handle', None),
                                ('use_logfmt', 'False'),
                                ('zero_copy', 'False'),
                                ('async_finish', 'False'),
                                ('return_recv_hook', 'False'),
                                ('out', 'None'),
                                ('combine_wait_recv_cost_stats', 'None')),
        'low_latency_dispatch': (('x', None),
                                 ('topk_idx', None),
                                 ('num_max_dispatch_tokens_per_rank', None),
                                 ('num_experts', None),
                                 ('cumulative_local_expert_recv_stats', 'None'),
                                 ('dispatch_wait_recv_cost_stats', 'None'),
                                 ('use_fp8', 'True'),
                                 ('round_scale', 'False'),
                                 ('use_ue8m0', 'False'),
                                 ('async_finish', 'False'),
                                 ('return_recv_hook', 'False')),
        'low_latency_query_mask_buffer': (('mask_status', None),),
        'low_latency_update_mask_buffer': (('rank_to_mask', None), ('mask', 'False')),
        'set_num_sms': (('new_num_sms', None),)}}


def main(clone: str) -> None:
    """Print :data:`UPSTREAM` as read from the DeepEP clone ``clone``."""
    import pprint

    table = {}
    for shape, (rev, path) in SOURCES.items():
        source = subprocess.run(["git", "-C", clone, "show", f"{rev}:{path}"],
                                capture_output=True, text=True, check=True).stdout
        table[shape] = buffer_methods(source)
    print(pprint.pformat(table, width=100, sort_dicts=True))


if __name__ == "__main__":
    main(sys.argv[1])
