"""Sampler service: environments in, segments out."""
