"""Knocking components out of a model: their names, where they are, the hooks, the
ablation kinds, and ``hf-headablate`` (the lowest layer above ``tasks`` and ``common``)."""
