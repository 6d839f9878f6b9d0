"""The inference engine: GGUF reading, quantised weights, models, tokenizer, generation."""
