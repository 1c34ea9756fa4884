#include "args.h"

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <sstream>
#include <stdexcept>

#ifndef XHAL_DEFAULT_PYTHON
#define XHAL_DEFAULT_PYTHON "python3"
#endif

namespace cpp_host {

namespace {

int to_int(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    int value = std::stoi(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(flag + " expects an integer, got '" + text + "'");
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, sep);) parts.push_back(part);
  return parts;
}

// ARRIVAL_STEP:MAX_NEW_TOKENS:ID,ID,...
RequestSpec parse_request(const std::string& text) {
  auto parts = split(text, ':');
  if (parts.size() != 3) {
    throw std::invalid_argument("--request expects ARRIVAL_STEP:MAX_NEW_TOKENS:ID,ID,... got '" +
                                text + "'");
  }
  RequestSpec r;
  r.arrival_step = to_int("--request arrival step", parts[0]);
  r.max_new_tokens = to_int("--request max new tokens", parts[1]);
  for (const auto& id : split(parts[2], ',')) r.prompt.push_back(to_int("--request token id", id));
  return r;
}

}  // namespace

std::string usage() {
  return "usage: xhal_cpp_host --model DIR [--device cpu|cuda|...] [--dtype auto|float32|bfloat16]\n"
         "         [--load-format auto|dummy] [--convention cuda|npu] [--eager] [--staged]\n"
         "         [--block-size N] [--num-blocks N] [--max-num-seqs N] [--max-model-len N]\n"
         "         [--max-tokens-per-step N] [--request ARRIVAL:MAX_NEW:ID,ID,...]...\n"
         "         [--synthetic B:PROMPT_LEN:MAX_NEW] [--crossing-iters N] [--quiet]\n"
         "         [--argmax-threads N (default: a quarter of the cores, at most 3)]\n"
         "         [--fault block-table-shape] [--python PATH]\n";
}

Args parse_args(int argc, char** argv) {
  Args a;
  const char* env_python = std::getenv("XHAL_PYTHON");
  a.python = env_python != nullptr ? env_python : XHAL_DEFAULT_PYTHON;
  ExecutorOptions& e = a.executor;
  // idle cores help with a batch's argmax; none on a small machine
  e.argmax_threads = std::min(3, static_cast<int>(std::thread::hardware_concurrency() / 4));
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value\n" + usage());
      return argv[++i];
    };
    if (flag == "--model") e.model_dir = value();
    else if (flag == "--device") e.device = value();
    else if (flag == "--dtype") e.dtype = value();
    else if (flag == "--load-format") e.load_format = value();
    else if (flag == "--python") a.python = value();
    else if (flag == "--eager") e.eager = true;
    else if (flag == "--staged") e.staged = true;
    else if (flag == "--quiet") a.print_steps = false;
    else if (flag == "--block-size") e.block_size = to_int(flag, value());
    else if (flag == "--num-blocks") e.num_blocks = to_int(flag, value());
    else if (flag == "--max-num-seqs") e.max_num_seqs = to_int(flag, value());
    else if (flag == "--max-model-len") e.max_model_len = to_int(flag, value());
    else if (flag == "--max-tokens-per-step") e.max_tokens_per_step = to_int(flag, value());
    else if (flag == "--argmax-threads") e.argmax_threads = to_int(flag, value());
    else if (flag == "--crossing-iters") a.crossing_iters = to_int(flag, value());
    else if (flag == "--request") a.requests.push_back(parse_request(value()));
    else if (flag == "--convention") {
      std::string c = value();
      if (c != "cuda" && c != "npu") {
        throw std::invalid_argument("--convention expects cuda or npu, got '" + c + "'");
      }
      e.convention = c == "npu" ? XHAL_CONVENTION_NPU : XHAL_CONVENTION_CUDA;
    } else if (flag == "--synthetic") {
      auto parts = split(value(), ':');
      if (parts.size() != 3) throw std::invalid_argument("--synthetic expects B:PROMPT_LEN:MAX_NEW");
      a.synthetic = {to_int(flag, parts[0]), to_int(flag, parts[1]), to_int(flag, parts[2])};
    } else if (flag == "--fault") {
      std::string f = value();
      if (f != "block-table-shape") {
        throw std::invalid_argument("--fault knows only block-table-shape, got '" + f + "'");
      }
      a.fault_block_table_shape = true;
    } else if (flag == "--help" || flag == "-h") {
      throw std::invalid_argument(usage());
    } else {
      throw std::invalid_argument("unknown flag " + flag + "\n" + usage());
    }
  }
  if (e.model_dir.empty()) throw std::invalid_argument("--model DIR is required\n" + usage());
  if (a.requests.empty() && a.synthetic.num_requests <= 0) {
    throw std::invalid_argument("give --request (repeatable) or --synthetic\n" + usage());
  }
  if (e.argmax_threads < 0) throw std::invalid_argument("--argmax-threads must be >= 0");
  if (e.block_size <= 0 || e.max_num_seqs <= 0 || e.max_tokens_per_step <= 0) {
    throw std::invalid_argument("--block-size, --max-num-seqs and --max-tokens-per-step must be > 0");
  }
  return a;
}

}  // namespace cpp_host
