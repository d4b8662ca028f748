"""Partition plans: the planner, its summary, the cross-rank checks, one rank's view."""
