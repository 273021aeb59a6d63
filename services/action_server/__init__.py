"""Action-server service: batched policy inference for the samplers."""
