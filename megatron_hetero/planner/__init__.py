"""The planner: cost model, hardware profiles and presets, profile fitting, and the layout search.
Pure: never imports torch."""
