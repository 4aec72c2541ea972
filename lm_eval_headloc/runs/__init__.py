"""A run: its options (``RunSpec``), its folder and record, its set-up and its plan."""
