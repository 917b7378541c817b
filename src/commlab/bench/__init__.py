"""Benchmarks by name (python -m commlab bench NAME): each prints ratios measured side by side in one run."""
