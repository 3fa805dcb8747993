"""The ONNX opset of our exported graphs: part of every engine manifest, read by serving processes without torch."""

OPSET = 18
