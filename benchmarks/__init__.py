"""Benchmarks and studies of the serving system: one harness (`harness.py`), one module per benchmark, run as
`python -m benchmarks NAME`. Above every other package: nothing but scripts and tests imports it."""
