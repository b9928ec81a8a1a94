"""A run's records: metrics, summary, TensorBoard events, progress, the run directory's lock, reports; and
the few dependency lines trainmesh keeps out of them (:mod:`.quiet`)."""
