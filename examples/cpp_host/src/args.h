// The host's command line.
#pragma once

#include <string>
#include <vector>

#include "python_executor.h"
#include "scheduler.h"

namespace cpp_host {

struct Synthetic {  // --synthetic B:PROMPT_LEN:MAX_NEW, for benchmarks
  int num_requests = 0, prompt_len = 0, max_new_tokens = 0;
};

struct Args {
  std::string python;
  ExecutorOptions executor;
  std::vector<RequestSpec> requests;
  Synthetic synthetic;
  bool fault_block_table_shape = false;
  bool print_steps = true;
  int crossing_iters = 0;
};

// Throws std::invalid_argument with a message naming the flag and the expected form.
Args parse_args(int argc, char** argv);
std::string usage();

}  // namespace cpp_host
