"""Replay service: the experience hub between samplers and the learner."""
