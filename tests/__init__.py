"""The test suite: contracts, runner, backends (and their vendor emulations), planner, vLLM glue,
GPU. A test module and the rank functions its spawned ranks run sit side by side: test_X.py and
X_ranks.py."""
