"""The libraries moe-plugins runs on: which ones are installed and what they offer
(:mod:`moe_plugins.stack.deepep`), and the versions supported and run on
(:mod:`moe_plugins.stack.versions`)."""
