"""Algorithms: pure functions of a batch of tensors (no env, no sockets, no replay).

A batch is one of ``shared.data.batches``' types with torch tensors for leaves; an algorithm
returns losses, diagnostics and, where it applies, new priorities.
"""
