"""Triton glue: request dispatch of the Python-backend models, the hand-over codec."""
