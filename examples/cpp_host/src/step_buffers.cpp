#include "step_buffers.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace cpp_host {

namespace {
constexpr size_t kPage = 4096;
}

HostBuffer::HostBuffer(size_t num_bytes) : num_bytes_((num_bytes + kPage - 1) / kPage * kPage) {
  // page alignment: cudaHostRegister pins whole pages, and every field offset stays aligned
  data_ = std::aligned_alloc(kPage, num_bytes_);
  if (data_ == nullptr) throw std::bad_alloc();
  std::memset(data_, 0, num_bytes_);
}

HostBuffer::~HostBuffer() { std::free(data_); }

}  // namespace cpp_host
