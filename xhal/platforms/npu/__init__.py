"""The Ascend NPU platform: torch_npu FIA paged attention, NPU graphs with replay-time updates of
FIA's host arguments, HCCL, torch_npu DeviceOps (docs/npu-ops.md quotes the official rules it
follows)."""
