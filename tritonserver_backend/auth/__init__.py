"""Admin key and session tokens."""
