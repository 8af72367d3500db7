"""GPU tests (marker ``gpu``); they skip cleanly without CUDA."""
