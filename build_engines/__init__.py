"""Build pipeline: the CED reference network, its engine split, checkpoint I/O, adapters, export and quantization."""
