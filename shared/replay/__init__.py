"""Replay tables, numpy only: ``Table(storage, selector, rate_limiter)`` (after Reverb).

Modules: ``sumtree`` (sums/min/max over priorities), ``selectors`` (Fifo, Uniform,
Prioritized), ``rate_limiter`` (samples-per-insert band), ``nstep`` (n-step targets),
``tables`` (storages and the Table), ``sequences`` (the R2D1 sequence storage). The batch types the tables write into a caller's
destination (the learner's shared-memory batch slot) are ``shared.data.batches``'; allocate one
with ``from_spec(storage.batch_spec(n), buffer)``.
"""
