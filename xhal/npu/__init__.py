"""The Ascend NPU platform: torch_npu FIA paged attention, NPU graphs with replay-time updates of
FIA's host arguments, HCCL, torch_npu DeviceOps (shared/reference/npu.md has the sources)."""
