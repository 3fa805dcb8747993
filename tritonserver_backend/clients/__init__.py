"""Clients of the served tensor API (gRPC/HTTP)."""
