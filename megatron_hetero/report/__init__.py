"""Reporting a plan: the human and JSON plan report, and the rank-map, schedule and timeline drawings."""
