"""The ``moe-plugins`` command: ``list``, ``demo`` (:mod:`moe_plugins.cli.main`) and ``plan``
(:mod:`moe_plugins.cli.plan`), with the argument types and layout flags they share
(:mod:`moe_plugins.cli.args`). Formatting only: what they print comes from the registry, the
reference runner and the planner."""
from moe_plugins.cli.main import backends_markdown, build_parser, main

__all__ = ["main", "build_parser", "backends_markdown"]
