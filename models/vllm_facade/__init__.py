"""The generic vLLM facade over any registered decoder family (`facade.DecoderVLLMModel`)."""
