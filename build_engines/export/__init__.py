"""Engine form of the network: step modules with explicit fixed-shape state, and their ONNX export.

`encoder_step.EncoderStep`, `decoder_step.DecoderStep` and `pointer_step.PointerStep` hold the reference modules'
weights and run one step of a batch of rows, each row with its own position, window rings and global-KV length;
the `torch` engine runs them as they are, `onnx_export` turns each into one ONNX graph with the `mol2` ops as
local functions. `layout.StepLayout` is the contract: every graph input and output, with its shape.
"""
