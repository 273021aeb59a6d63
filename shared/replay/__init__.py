"""Replay tables, numpy only: ``Table(storage, selector, rate_limiter)`` (after Reverb).

Modules: ``sumtree`` (sums/min/max over priorities), ``selectors`` (Fifo, Uniform,
Prioritized), ``rate_limiter`` (samples-per-insert band), ``nstep`` (n-step targets),
``storage`` (the protocol a table asks of a storage, segment checks), ``ring`` (the column
ring and ``RingStorage``, the base of the storages over it), one module a storage
(``transitions``, ``sequences`` for R2D1, ``segments`` for the on-policy queue), ``tables``
(the Table), ``frames`` (the Atari frame store), ``arena`` (where a table's state lives).

The batch types the tables write into a caller's destination (the learner's shared-memory
batch slot) are ``shared.data.batches``'; allocate one with ``from_spec(storage.batch_spec(n), buffer)``.
"""
