"""Shared test set-up: quiet MLflow, and a scratch MLflow store per test session."""

import os

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A data_dir with a stand-in of every paper-scale dataset, prepared as its DVC stage prepares
    the real data (tests/standins.py)."""
    from standins import prepare_standins

    return prepare_standins(tmp_path_factory.mktemp("standins"))
