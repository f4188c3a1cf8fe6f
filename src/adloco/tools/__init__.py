"""Offline commands on a finished run: ``adloco estimate``, ``adloco gradients``, ``adloco eval`` / ``sample``."""
