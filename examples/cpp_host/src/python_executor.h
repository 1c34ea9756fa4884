// The embedded interpreter and xhal's ModelExecutor behind it. The only files that include
// pybind11 are python_executor.cpp and interpreter.cpp; the rest of the host is plain C++.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "step_builder.h"
#include "step_buffers.h"
#include "xhal_metadata.h"

namespace cpp_host {

// A Python exception, carried into C++ with its type and message.
class PythonError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ExecutorOptions {
  std::string model_dir;
  std::string device = "cpu";
  std::string dtype = "auto";
  std::string load_format = "auto";  // "dummy": random weights, config.json only
  XhalConvention convention = XHAL_CONVENTION_CUDA;
  int block_size = 16;
  int num_blocks = 64;
  int max_num_seqs = 8;
  int max_model_len = 256;
  int max_tokens_per_step = 256;
  bool eager = false;
  // on the CPU too, keep device fields in separate buffers filled by a copy each step and copy
  // the logits into C++'s buffer: the GPU's data path, testable without a GPU
  bool staged = false;
  int argmax_threads = 1;  // threads besides the caller that share a batch's argmax rows
};

struct StepOutput {
  std::vector<int32_t> tokens;  // one per selected row, argmax in C++
  double python_us = 0;         // time inside the GIL-held section
  double argmax_us = 0;
};

// One field's C++ address next to the data_ptr() Python sees for it.
struct ZeroCopyCheck {
  std::string field;
  uintptr_t cpp = 0, python = 0;
  bool ok() const { return cpp == python; }
};

// Owns the Python model, its ModelExecutor, the bound KV caches and the two step slots (host
// memory owned here, wrapped once as tensors). Construct and destroy with the GIL held; run()
// takes the GIL itself, so call it with the GIL released.
class PyExecutor {
 public:
  explicit PyExecutor(const ExecutorOptions& options);
  ~PyExecutor();
  PyExecutor(const PyExecutor&) = delete;
  PyExecutor& operator=(const PyExecutor&) = delete;

  const StepSlot& slot(int i) const;
  int vocab_size() const;
  int max_blocks_per_seq() const;
  std::string describe() const;  // platform, dtype, graphs, KV shape

  // Exactly one execute and (when the step samples) one compute_logits. Throws PythonError.
  // With `checks`, every field's tensor data_ptr() is compared with the C++ address.
  StepOutput run(const BuiltStep& step, std::vector<ZeroCopyCheck>* checks = nullptr);
  // execute(step) `iters` times on inputs built once: the crossing without building the views.
  std::vector<double> prebuilt_execute_us(const BuiltStep& step, int iters);
  // A call into Python that does nothing (builtins.abs(0)), GIL taken and released around it.
  double noop_call_us();
  // Set while run() holds the GIL, so another thread can tell that its work overlapped Python.
  void set_in_python_flag(std::atomic<bool>* flag);
  int64_t execute_calls() const;
  int64_t compute_logits_calls() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The interpreter, started once for the life of the process. `python` is the interpreter whose
// environment (a venv's site-packages) the host uses.
class Interpreter {
 public:
  explicit Interpreter(const std::string& python);
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;
};

// Releases the GIL for the scope (a serving framework's worker thread between steps).
class GilRelease {
 public:
  GilRelease();
  ~GilRelease();
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  void* state_;
};

}  // namespace cpp_host
