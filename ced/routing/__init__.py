"""The MoL2 pointer head."""
