"""Tests of the vLLM glue, against vLLM's own code (skipped without vLLM installed)."""
