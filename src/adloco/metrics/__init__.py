"""Run metrics: ``metrics.jsonl`` written and read back, experiment trackers, and plots."""
