// The second C++ thread: it runs the scheduler and lays out step N+1 while the main (worker)
// thread is inside Python for step N. It never touches Python, so it never waits for the GIL.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "scheduler.h"
#include "step_builder.h"

namespace cpp_host {

class BuilderThread {
 public:
  // `in_python` is set by the executor while it holds the GIL; slots alternate 0, 1, 0, ...
  BuilderThread(Scheduler& scheduler, const std::vector<RequestSpec>& requests,
                BuilderConfig config, const StepSlot* slots[2], const std::atomic<bool>& in_python);
  ~BuilderThread();

  void request_next();  // start building the next step
  // The step asked for (nullopt once every request has finished), or nullopt with
  // `timed_out` when it is not ready within `bound`. Rethrows the builder's exception.
  std::optional<BuiltStep> wait(std::chrono::seconds bound, bool* timed_out = nullptr);
  int overlapped() const { return overlapped_; }  // builds finished while Python held the GIL

 private:
  void loop();

  Scheduler& scheduler_;
  const std::vector<RequestSpec>& requests_;
  BuilderConfig config_;
  const StepSlot* slots_[2];
  const std::atomic<bool>& in_python_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool requested_ = false, ready_ = false, stop_ = false;
  std::optional<BuiltStep> result_;
  std::exception_ptr error_;
  int next_slot_ = 0;
  int overlapped_ = 0;
  std::thread thread_;  // last: started once every member above exists
};

}  // namespace cpp_host
