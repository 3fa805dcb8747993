"""The build stage: checkpoint -> engines (ONNX graphs, or TensorRT plans built from them) + manifest.

    python -m build_engines build --model embedded/mol2-small --out artifacts/engines/mol2-small [--format onnx|trt]
"""
