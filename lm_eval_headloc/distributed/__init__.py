"""Measurements on Ray workers, each with its own model."""
