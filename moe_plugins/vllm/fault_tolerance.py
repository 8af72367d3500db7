"""What our layers do in vLLM's fault-tolerance flow after the sentinel removed an EP rank.

vLLM 0.34's flow (``--enable-fault-tolerance``, dp > 1): after every step the model runner
polls the EP all2all manager's ``query_fault``; a fault raises the step (its output is never
used) and the engine sentinel asks every worker for ``query_active_mask``; the operator's
``scale_down`` then runs on every surviving worker ``clean_buffers``, a rebuilt DP group,
``update_mask`` for each dead EP rank, and the redistribution of the dead rank's experts
through EPLB's maps (its slots marked dead, each logical expert routed to its replicas on the
survivors, the ones without a replica moved into a spare slot and reloaded from disk). Our
manager answers the polls and masks (:mod:`moe_plugins.vllm.manager`); vLLM's router re-homes
(docs/faults.md, "When a rank dies under vLLM").

One thing the layer itself must do: once the highest EP rank is masked, NIXL EP's receive
layout spans only the ranks up to the highest active one (``active_rank_bound`` x max tokens
rows per local expert), and its combine refuses expert outputs of any other row count, while
vLLM's batched experts size their output for every rank the buffer was built for (their
``max_num_tokens x num_dispatchers`` rows). :func:`fit_expert_output` hands the combine the
rows the receive holds.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["fit_expert_output"]


def fit_expert_output(expert_out: torch.Tensor, expert_shape: Optional[torch.Size]
                      ) -> torch.Tensor:
    """``expert_out`` [num_local_experts, rows, hidden] (vLLM's batched experts' output, rows =
    max tokens x the buffer's ranks) for a receive of ``expert_shape`` [num_local_experts,
    recv_rows, hidden]: itself where the shapes agree, else, where the receive spans fewer
    rows (NIXL EP with the highest ranks masked; a slot's rows are its sources' one after
    another, so the rows past ``recv_rows`` were never received), its first ``recv_rows`` rows,
    contiguous as the library wants them (one copy per call, only in that state). Any other
    shape is returned as given: the combine's own check names it."""
    if expert_shape is None or expert_out.shape == expert_shape:
        return expert_out
    if (expert_out.dim() == 3 and len(expert_shape) == 3
            and expert_out.shape[0] == expert_shape[0] and expert_out.shape[2] == expert_shape[2]
            and expert_out.shape[1] > expert_shape[1]):
        return expert_out[:, :expert_shape[1]].contiguous()
    return expert_out
