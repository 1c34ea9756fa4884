"""The engine's device side, the only part of ``serve_cli.engine`` that touches torch: the model,
its KV cache and executor (``ModelRunner``), the input builder that emits xLLM's C++ metadata
layout, and the sampler. The engine above it (scheduler, detokenizer, ``EngineCore``) imports no
torch."""
