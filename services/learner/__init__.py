"""Learner service: batches in, parameter versions out."""
