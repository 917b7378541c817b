"""Datasets by name: preparation into ``data/prepared/<name>/`` and loading sharded batches."""

from commlab.data.base import DatasetSpec, PreparedData, load_dataset, shard_indices

__all__ = ["DatasetSpec", "PreparedData", "load_dataset", "shard_indices"]
