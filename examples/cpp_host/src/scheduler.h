// The host's own continuous batching: requests, a trivial KV block allocator and a scheduler
// that decides, step by step, which tokens of which requests run. Plain C++: no Python, no GIL.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cpp_host {

// A request as given on the command line: it arrives at step `arrival_step`, brings
// `prompt` token ids and asks for `max_new_tokens` greedy tokens (no stop token: the schedule
// is fixed by the lengths alone, which lets the next step be built before this one's tokens are
// known, as xLLM's asynchronous scheduling does).
struct RequestSpec {
  int arrival_step = 0;
  int max_new_tokens = 1;
  std::vector<int32_t> prompt;
};

// Fixed-size pool of KV blocks handed out from a free list. Block ids index the KV tensors'
// first dimension, so every id is < num_blocks.
class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);
  bool can_allocate(int count) const { return static_cast<int>(free_.size()) >= count; }
  int32_t allocate();  // throws std::runtime_error when the pool is empty
  void release(const std::vector<int32_t>& blocks);
  int num_free() const { return static_cast<int>(free_.size()); }

 private:
  std::vector<int32_t> free_;
};

// One sequence's share of a step: tokens [start, start + num_tokens) of the request.
struct ScheduledChunk {
  int request = 0;
  int start = 0;        // KV position of the first new token (= tokens already cached)
  int num_tokens = 0;   // q_len
  bool samples = false; // the chunk reaches the end of the known tokens: its last row is sampled
  std::vector<int32_t> block_table;  // the request's blocks, enough for start + num_tokens
};

struct StepPlan {
  int index = 0;
  std::vector<ScheduledChunk> chunks;
  int num_tokens() const;
};

// Decides each step's batch: running requests first (a decode, or the next chunk of a prompt),
// then arrived requests in order while the token budget and free blocks allow. A request
// finishes in the step that samples its last token; its blocks return to the pool when the
// next step is planned, not within the step that still uses them (the next step runs after
// this one on the device, so reusing them then cannot race).
class Scheduler {
 public:
  Scheduler(std::vector<RequestSpec> requests, int block_size, int num_blocks,
            int max_num_seqs, int max_tokens_per_step);

  bool done() const { return num_finished_ == static_cast<int>(requests_.size()); }
  // The next step's plan. Throws std::runtime_error when a running request needs a block and
  // none is free (this host does not preempt).
  StepPlan next();
  const RequestSpec& spec(int request) const { return requests_[request].spec; }
  int num_requests() const { return static_cast<int>(requests_.size()); }

 private:
  struct State {
    RequestSpec spec;
    bool admitted = false, finished = false;
    int computed = 0;   // tokens whose KV is (or will be, once queued steps run) in the cache
    int scheduled_samples = 0;  // tokens some step samples for it
    std::vector<int32_t> blocks;
    int known_tokens() const { return static_cast<int>(spec.prompt.size()) + scheduled_samples; }
  };
  bool reserve(State& s, int num_tokens, bool may_fail);

  std::vector<State> requests_;
  std::vector<std::vector<int32_t>> released_;
  BlockAllocator blocks_;
  int block_size_, max_num_seqs_, max_tokens_per_step_;
  int step_ = 0, num_finished_ = 0;
};

}  // namespace cpp_host
