"""What the backends share (cuda and npu above all; cpu_ref takes the single-rank collective and the
graph-key check): the single-rank and tensor-form collectives, the stream-graph runner that
captures in pieces, sync-free sampling and the persistent-inputs check, each file named after the
backend file it serves."""
