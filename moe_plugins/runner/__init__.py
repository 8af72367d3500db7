"""The engine-agnostic reference runner: the MoE model (``model``), torch experts
(``experts``), the single-process reference (``reference``), the MoE layer that drives a
backend (``layer``), the multi-process launcher (``launch``) and the CPU demo (``demo``)."""
