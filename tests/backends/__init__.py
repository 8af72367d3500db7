"""Tests of the backends on their emulated vendor libraries (tests/emulation)."""
