"""Triton-free serving library that the thin `model_repository/*/1/model.py` files wire to Triton's Python backend."""
