"""Greedy evaluation on held-out seeds: the one-shot `rlpipe evaluate` and the periodic evaluator service."""
