"""Analyses of runs and checkpoints."""
