"""The planner: the analytic cost model of a decoder layer's communication. ``plan``
(:func:`~moe_plugins.planner.plan.plan_layer`) puts together what the all-to-alls move
(``traffic``), the decoder layer's TP collectives and weights (``decoder``) and the strategy
recommendation (``recommend``) into the result types of ``results``; ``link_model`` prices the
transfers; ``model_config`` reads model shapes from Hugging Face configs."""
