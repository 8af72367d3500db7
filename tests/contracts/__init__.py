"""Tests of the contracts: interface, layout, placement, quant, registry, strategy."""
