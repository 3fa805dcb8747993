"""Engine-directory checks: the build manifest, what is stale."""
