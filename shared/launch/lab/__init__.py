"""The lab: experiments over many runs (grids, tuning), their run records (listing, results rows,
learning curves, statistics). It starts runs through ``shared.launch``'s run control, never the
other way round."""
