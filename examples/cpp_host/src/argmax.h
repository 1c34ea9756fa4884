// Greedy sampling in C++: the argmax of each logits row, spread over a few threads when there
// are several rows (a decode batch's logits are S x vocab floats: 4 MB at S = 8 for Llama-3).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace cpp_host {

// Index of the first maximum of x[0, n) (torch.argmax's choice among ties); NaNs are ignored.
int32_t argmax_row(const float* x, int64_t n);

class ArgmaxPool {
 public:
  explicit ArgmaxPool(int num_workers);  // 0: the calling thread does every row
  ~ArgmaxPool();
  ArgmaxPool(const ArgmaxPool&) = delete;
  ArgmaxPool& operator=(const ArgmaxPool&) = delete;

  // out[r] = argmax_row(logits + r * vocab, vocab) for r < num_rows.
  void run(const float* logits, int64_t num_rows, int64_t vocab, int32_t* out);

 private:
  void work(int worker);
  void rows_of(int part, int num_parts);

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const float* logits_ = nullptr;
  int64_t num_rows_ = 0, vocab_ = 0;
  int32_t* out_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  int num_workers_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace cpp_host
