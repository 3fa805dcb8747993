"""Adapters: the registry, slots in the banks, the admin service."""
