"""Checkpoint formats: ours and the release's, configs, drafter sidecars."""
