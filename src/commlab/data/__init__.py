"""Datasets by name: preparation into ``data/prepared/<name>/`` and loading sharded batches."""

from commlab.data.base import DatasetSpec, PreparedData, load_dataset, shard_indices
from commlab.data.checks import DamagedDataError

__all__ = ["DamagedDataError", "DatasetSpec", "PreparedData", "load_dataset", "shard_indices"]
