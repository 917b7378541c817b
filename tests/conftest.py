"""Shared test set-up: quiet MLflow, and a scratch MLflow store per test session."""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
