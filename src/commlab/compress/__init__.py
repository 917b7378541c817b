"""Shared gradient compression pieces: selectors, residual memory, quantisers."""
