"""Analyses of runs and checkpoints: the measures, their views and plots."""
