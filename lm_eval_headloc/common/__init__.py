"""Shared by every layer: the exceptions, the one number check, file writing, timing."""
