"""Custom ops of the CED network (sparse global-KV attention, SWA replay attention, pointer score): one definition,
many back ends (PyTorch reference, OpenAI Triton kernel, ONNX schema, onnxruntime, TensorRT plugin)."""
