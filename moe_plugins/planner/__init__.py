"""The planner: the analytic cost model of a decoder layer's communication (``plan``), the link
model it prices transfers with (``link_model``) and the model-shape reader for Hugging Face
configs (``model_config``)."""
