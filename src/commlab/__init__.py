"""commlab: reproduce communication-efficient distributed training papers on one core."""

__version__ = "0.1.0"
