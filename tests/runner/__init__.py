"""Tests of the reference runner: the layer on gloo ranks against the reference, overlap, faults,
experts, router."""
