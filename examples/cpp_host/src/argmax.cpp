#include "argmax.h"

#include <limits>

namespace cpp_host {

int32_t argmax_row(const float* x, int64_t n) {
  // one pass over independent lanes, each keeping its maximum and where it first saw it: the
  // compare-and-select vectorizes (std::max_element's loop does not, and is ~6x slower), then
  // the lanes are reduced to the first index of the row's maximum
  constexpr int kLanes = 16;
  float value[kLanes];
  int32_t index[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    value[j] = -std::numeric_limits<float>::infinity();
    index[j] = j;
  }
  const int32_t count = static_cast<int32_t>(n);
  int32_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      bool greater = x[i + j] > value[j];
      value[j] = greater ? x[i + j] : value[j];
      index[j] = greater ? i + j : index[j];
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  int32_t at = 0;
  for (int j = 0; j < kLanes; ++j) {
    if (value[j] > best || (value[j] == best && index[j] < at)) {
      best = value[j];
      at = index[j];
    }
  }
  for (; i < count; ++i) {
    if (x[i] > best) {  // the tail comes after every lane's indices
      best = x[i];
      at = i;
    }
  }
  return at;
}

ArgmaxPool::ArgmaxPool(int num_workers) : num_workers_(num_workers) {
  for (int w = 0; w < num_workers; ++w) workers_.emplace_back([this, w] { work(w); });
}

ArgmaxPool::~ArgmaxPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ArgmaxPool::rows_of(int part, int num_parts) {
  for (int64_t r = part; r < num_rows_; r += num_parts) {
    out_[r] = argmax_row(logits_ + r * vocab_, vocab_);
  }
}

void ArgmaxPool::run(const float* logits, int64_t num_rows, int64_t vocab, int32_t* out) {
  const int helpers = num_rows > 1 ? num_workers_ : 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    logits_ = logits;
    num_rows_ = num_rows;
    vocab_ = vocab;
    out_ = out;
    pending_ = helpers;
    if (helpers > 0) ++generation_;
  }
  if (helpers == 0) {
    rows_of(0, 1);
    return;
  }
  wake_.notify_all();
  rows_of(0, helpers + 1);  // the calling thread takes a share too
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
}

void ArgmaxPool::work(int worker) {
  uint64_t seen = 0;
  for (;;) {
    int parts;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      parts = num_workers_ + 1;
    }
    rows_of(worker + 1, parts);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --pending_;
    }
    done_.notify_one();
  }
}

}  // namespace cpp_host
