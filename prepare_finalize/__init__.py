"""Prepare/finalize backends, one module per class; each module exports its BackendSpec as SPEC."""
