"""Tests of the benchmarks in benchmarks/ (pytest puts that folder on the import path: pyproject.toml)."""
