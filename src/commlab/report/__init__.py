"""Reports: MLflow runs -> tidy tables -> claims verdicts -> figures -> HTML."""
