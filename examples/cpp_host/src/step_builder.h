// One step's inputs laid out as xLLM's C++ builder lays them out (xhal_metadata.h), in either
// length convention, written into a host-owned StepSlot. Runs on the builder thread: no Python.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "scheduler.h"
#include "step_buffers.h"
#include "xhal_metadata.h"

namespace cpp_host {

// input_ids[index] is the request's generated token `token_index`, which the step before this
// one samples: the main thread fills it in after that step's argmax, before this step runs.
struct TokenPatch {
  int32_t index = 0;
  int request = 0;
  int token_index = 0;
};

struct BuiltStep {
  int index = 0;
  const StepSlot* slot = nullptr;
  XhalAttentionMetadataView view{};  // field for field the PyAttentionMetadataView names
  XhalTensorRef input_ids{}, positions{}, selected_idxes{};  // device [T], [T], [S]
  int32_t* host_input_ids = nullptr;  // where the builder wrote input_ids (patched in place)
  int64_t device_ints = 0;           // slot ints [0, device_ints) must reach the device
  std::vector<int> sampled_requests; // request of each selected row, in row order
  std::vector<TokenPatch> patches;
  std::vector<ScheduledChunk> chunks;
  int num_tokens() const { return static_cast<int>(input_ids.shape[0]); }
};

struct BuilderConfig {
  XhalConvention convention = XHAL_CONVENTION_CUDA;
  int block_size = 16;
  // a deliberately malformed block_table (1-D), to show a Python ValueError reaching C++
  bool fault_block_table_shape = false;
};

// Ints a slot needs for the largest step the scheduler may build.
size_t slot_capacity_ints(int max_tokens, int max_seqs, int max_blocks_per_seq);

BuiltStep build_step(const StepPlan& plan, const std::vector<RequestSpec>& requests,
                     const BuilderConfig& config, const StepSlot& slot);

const char* kind_name(int32_t kind);

}  // namespace cpp_host
