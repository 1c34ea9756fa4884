#include "builder_thread.h"

namespace cpp_host {

BuilderThread::BuilderThread(Scheduler& scheduler, const std::vector<RequestSpec>& requests,
                             BuilderConfig config, const StepSlot* slots[2],
                             const std::atomic<bool>& in_python)
    : scheduler_(scheduler), requests_(requests), config_(config), slots_{slots[0], slots[1]},
      in_python_(in_python), thread_([this] { loop(); }) {}

BuilderThread::~BuilderThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BuilderThread::request_next() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    requested_ = true;
    ready_ = false;
  }
  cv_.notify_all();
}

std::optional<BuiltStep> BuilderThread::wait(std::chrono::seconds bound, bool* timed_out) {
  std::unique_lock<std::mutex> lock(mutex_);
  bool ready = cv_.wait_for(lock, bound, [this] { return ready_; });
  if (timed_out != nullptr) *timed_out = !ready;
  if (!ready) return std::nullopt;
  ready_ = false;
  if (error_) std::rethrow_exception(error_);
  return std::move(result_);
}

void BuilderThread::loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return requested_ || stop_; });
      if (stop_) return;
      requested_ = false;
    }
    std::optional<BuiltStep> built;
    std::exception_ptr error;
    try {
      if (!scheduler_.done()) {
        built = build_step(scheduler_.next(), requests_, config_, *slots_[next_slot_]);
        next_slot_ ^= 1;
      }
    } catch (...) {
      error = std::current_exception();
    }
    bool during_python = in_python_.load();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      result_ = std::move(built);
      error_ = error;
      ready_ = true;
      overlapped_ += during_python;
    }
    cv_.notify_all();
  }
}

}  // namespace cpp_host
