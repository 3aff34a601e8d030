"""Block-quantized weights kept as they ship (GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).

`matrix.QuantizedMatrix` is the in-memory form every kernel reads; `gguf_blocks` repacks a
GGUF tensor's blocks into it without ever making a float copy of the whole tensor.
"""
