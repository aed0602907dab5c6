"""Data: what the train loader is handed, where it stands, and the randomness that survives a resume."""
