"""Drafters that need no model (prompt lookup)."""
