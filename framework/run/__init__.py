"""A run: its arguments and config, checks made before training, its directory, identity, lock and signals."""
