"""Tests of the planner (cost model and strategy recommendation)."""
