"""What cuda and npu share: the single-rank and tensor-form collectives, the stream-graph runner that
captures in pieces, and sync-free sampling (each named after the backend file it serves)."""
