"""Engine form of the network: step modules, per-session state rows, arenas, the graph contract."""
