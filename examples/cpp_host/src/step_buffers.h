// Host-owned memory one step's inputs are written into, and the layout of a step in it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace cpp_host {

// A page-aligned int32 region owned by C++ for the life of the host. Python wraps it once in a
// CPU tensor without copying (the tensor's data_ptr() is data()); on a GPU it is registered as
// pinned memory so the step's single host-to-device copy is asynchronous.
class HostBuffer {
 public:
  explicit HostBuffer(size_t num_bytes);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  size_t num_bytes() const { return num_bytes_; }
  int32_t* ints() const { return static_cast<int32_t*>(data_); }
  size_t num_ints() const { return num_bytes_ / sizeof(int32_t); }

 private:
  void* data_ = nullptr;
  size_t num_bytes_ = 0;
};

// Where one step slot's fields live: `host` is written by the builder; `device_base` is the
// address of the same layout on the compute device (equal to host->data() on the CPU, where the
// executor reads the host memory itself).
struct StepSlot {
  std::unique_ptr<HostBuffer> host;
  uintptr_t device_base = 0;
};

}  // namespace cpp_host
