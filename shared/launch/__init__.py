"""Run control: start, follow, watch, scale, stop and clean a run (supervisord or Ray), and its
run directory. ``lab`` (grids, tuning, results) and ``artefacts`` (export, package, play) sit
above it, and ``cli`` above them all (tests/test_layers.py keeps that order)."""
