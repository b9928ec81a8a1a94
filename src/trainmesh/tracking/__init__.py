"""A run's records: metrics, summary, TensorBoard events, progress, the run directory's lock, reports."""
