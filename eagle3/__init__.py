"""eagle3: train EAGLE-3 speculative-decoding draft heads that SGLang and vLLM load as-is."""

__version__ = "0.1.0"
