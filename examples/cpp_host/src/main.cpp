// xhal_cpp_host: a C++ serving host that embeds Python and drives xhal's ModelExecutor once per
// step, as xLLM's worker drives its PyExecutorImpl. See ../README.md.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <sstream>
#include <vector>

#include "args.h"
#include "builder_thread.h"
#include "python_executor.h"
#include "scheduler.h"
#include "step_builder.h"

using namespace cpp_host;

namespace {

double now_us() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<RequestSpec> synthetic_requests(const Synthetic& s, int vocab) {
  std::vector<RequestSpec> out;
  for (int r = 0; r < s.num_requests; ++r) {
    RequestSpec spec;
    spec.max_new_tokens = s.max_new_tokens;
    for (int j = 0; j < s.prompt_len; ++j) spec.prompt.push_back((r * 131 + j * 31 + 7) % vocab);
    out.push_back(spec);
  }
  return out;
}

void check_token_ids(const std::vector<RequestSpec>& requests, int vocab) {
  for (size_t r = 0; r < requests.size(); ++r) {
    for (int32_t id : requests[r].prompt) {
      if (id < 0 || id >= vocab) {
        throw std::invalid_argument("request " + std::to_string(r) + " has token id " +
                                    std::to_string(id) + " outside the vocabulary [0, " +
                                    std::to_string(vocab) + ")");
      }
    }
  }
}

std::string describe_step(const BuiltStep& s, const StepOutput& out) {
  std::ostringstream line;
  line << "step " << s.index << " kind=" << kind_name(s.view.batch_forward_type)
       << " seqs=" << s.chunks.size() << " tokens=" << s.num_tokens() << " chunks=";
  for (size_t i = 0; i < s.chunks.size(); ++i) {
    const auto& c = s.chunks[i];
    line << (i ? "," : "") << "r" << c.request << ":" << c.start << "+" << c.num_tokens
         << (c.samples ? "*" : "");
  }
  line << " sampled=";
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    line << (i ? "," : "") << "r" << s.sampled_requests[i] << ":" << out.tokens[i];
  }
  line << " python_us=" << static_cast<long>(out.python_us);
  return line.str();
}

int serve(const Args& args) {
  Interpreter interpreter(args.python);  // once per process; this thread holds the GIL now
  PyExecutor executor(args.executor);
  std::cout << "executor " << executor.describe() << std::endl;
  std::vector<RequestSpec> requests = args.requests;
  if (args.synthetic.num_requests > 0) requests = synthetic_requests(args.synthetic, executor.vocab_size());
  check_token_ids(requests, executor.vocab_size());

  const ExecutorOptions& e = args.executor;
  Scheduler scheduler(requests, e.block_size, e.num_blocks, e.max_num_seqs, e.max_tokens_per_step);
  BuilderConfig config{e.convention, e.block_size, args.fault_block_table_shape};
  std::atomic<bool> in_python{false};
  executor.set_in_python_flag(&in_python);
  const StepSlot* slots[2] = {&executor.slot(0), &executor.slot(1)};
  BuilderThread builder(scheduler, requests, config, slots, in_python);

  // The builder never needs the GIL: it builds the first step while this thread holds it.
  bool timed_out = false;
  builder.request_next();
  std::optional<BuiltStep> step = builder.wait(std::chrono::seconds(120), &timed_out);
  if (timed_out) throw std::runtime_error("the builder thread did not finish while the GIL was held");
  std::cout << "gil-probe ok: the builder thread built step 0 while the main thread held the GIL"
            << std::endl;

  std::vector<std::vector<int32_t>> generated(requests.size());
  std::vector<double> starts, decode_python_us, decode_argmax_us, waits;
  std::vector<int> decode_seqs;
  int num_steps = 0;
  bool zero_copy_ok = true;
  {
    GilRelease release;  // between steps the GIL is free; run() takes it for the step only
    while (step) {
      for (const TokenPatch& p : step->patches) {
        // the token the previous step sampled, written where the executor reads input_ids
        step->host_input_ids[p.index] = generated[p.request].at(p.token_index);
      }
      builder.request_next();  // step N+1 is laid out while Python runs step N
      std::vector<ZeroCopyCheck> checks;
      starts.push_back(now_us());
      StepOutput out = executor.run(*step, num_steps == 0 || args.print_steps ? &checks : nullptr);
      for (size_t i = 0; i < out.tokens.size(); ++i) {
        generated[step->sampled_requests[i]].push_back(out.tokens[i]);
      }
      for (const auto& c : checks) {
        zero_copy_ok &= c.ok();
        if (num_steps == 0 || !c.ok()) {
          std::printf("zero-copy %s cpp=0x%zx python=0x%zx %s\n", c.field.c_str(),
                      static_cast<size_t>(c.cpp), static_cast<size_t>(c.python),
                      c.ok() ? "ok" : "MISMATCH");
        }
      }
      if (step->view.batch_forward_type == XHAL_BATCH_DECODE) {
        decode_python_us.push_back(out.python_us);
        decode_argmax_us.push_back(out.argmax_us);
        decode_seqs.push_back(static_cast<int>(step->chunks.size()));
      } else {
        decode_seqs.push_back(-1);
      }
      if (args.print_steps) std::cout << describe_step(*step, out) << std::endl;
      ++num_steps;
      double wait_start = now_us();
      step = builder.wait(std::chrono::seconds(600), &timed_out);
      if (timed_out) throw std::runtime_error("the builder thread built no step in 10 minutes");
      waits.push_back(now_us() - wait_start);  // 0 when N+1 was built while N ran
    }
    starts.push_back(now_us());

    for (size_t r = 0; r < requests.size(); ++r) {
      std::cout << "tokens r" << r << ":";
      for (int32_t t : generated[r]) std::cout << " " << t;
      std::cout << std::endl;
    }
    std::cout << "summary steps=" << num_steps << " execute_calls=" << executor.execute_calls()
              << " compute_logits_calls=" << executor.compute_logits_calls()
              << " built_next_while_python_held_gil=" << builder.overlapped() << "/" << num_steps
              << " zero_copy=" << (zero_copy_ok ? "ok" : "MISMATCH") << std::endl;

    // step time of the pure-decode steps at the largest batch (first one left out: warm-up)
    std::vector<double> step_us, python_us, argmax_us, wait_us;
    int widest = *std::max_element(decode_seqs.begin(), decode_seqs.end());
    for (int i = 0, d = 0; i < num_steps; ++i) {
      if (decode_seqs[i] < 0) continue;
      if (decode_seqs[i] == widest && d > 0) {
        step_us.push_back(starts[i + 1] - starts[i]);
        python_us.push_back(decode_python_us[d]);
        argmax_us.push_back(decode_argmax_us[d]);
        wait_us.push_back(waits[i]);
      }
      ++d;
    }
    if (!step_us.empty()) {
      std::printf(
          "decode-steps seqs=%d n=%zu step_us_median=%.1f python_us_median=%.1f "
          "argmax_us_median=%.1f wait_for_builder_us_median=%.1f\n",
          widest, step_us.size(), median(step_us), median(python_us), median(argmax_us),
          median(wait_us));
    }

    if (args.crossing_iters > 0) {
      // the boundary itself: an EMPTY step (execute returns [0, hidden] without device work)
      // and a no-op call, each with the GIL taken and released around it
      Scheduler none({RequestSpec{1 << 30, 1, {0}}}, e.block_size, 1, 1, 1);
      BuiltStep empty = build_step(none.next(), {RequestSpec{1 << 30, 1, {0}}}, config, executor.slot(0));
      std::vector<double> empty_us, noop_us;
      for (int i = 0; i < args.crossing_iters; ++i) {
        double t0 = now_us();
        executor.run(empty);
        empty_us.push_back(now_us() - t0);
        noop_us.push_back(executor.noop_call_us());
      }
      std::vector<double> prebuilt_us = executor.prebuilt_execute_us(empty, args.crossing_iters);
      std::printf(
          "crossing iters=%d empty_execute_us_median=%.2f "
          "empty_execute_prebuilt_views_us_median=%.2f noop_call_us_median=%.2f\n",
          args.crossing_iters, median(empty_us), median(prebuilt_us), median(noop_us));
    }
  }
  return zero_copy_ok ? 0 : 4;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return serve(parse_args(argc, argv));
  } catch (const std::invalid_argument& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const PythonError& e) {
    std::cerr << "python error: " << e.what() << std::endl;
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
