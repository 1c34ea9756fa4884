"""xhal-serve, the reference host: it owns requests, scheduling, KV blocks, sampling and output,
and calls the executor once per step (the role xLLM's C++ runtime plays)."""
