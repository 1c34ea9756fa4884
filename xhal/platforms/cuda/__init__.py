"""The CUDA platform: FlashInfer attention (Triton fallback), CUDA graphs, NCCL, fused DeviceOps."""
