#include "scheduler.h"

#include <algorithm>
#include <stdexcept>

namespace cpp_host {

BlockAllocator::BlockAllocator(int num_blocks) {
  if (num_blocks <= 0) throw std::invalid_argument("--num-blocks must be positive");
  // hand out low ids first: reversed so that pop_back() yields 0, 1, 2, ...
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int32_t BlockAllocator::allocate() {
  if (free_.empty()) {
    throw std::runtime_error(
        "the KV block pool is exhausted by running requests (this host does not preempt): "
        "raise --num-blocks");
  }
  int32_t block = free_.back();
  free_.pop_back();
  return block;
}

void BlockAllocator::release(const std::vector<int32_t>& blocks) {
  free_.insert(free_.end(), blocks.rbegin(), blocks.rend());
}

int StepPlan::num_tokens() const {
  int n = 0;
  for (const auto& c : chunks) n += c.num_tokens;
  return n;
}

Scheduler::Scheduler(std::vector<RequestSpec> requests, int block_size, int num_blocks,
                     int max_num_seqs, int max_tokens_per_step)
    : blocks_(num_blocks), block_size_(block_size), max_num_seqs_(max_num_seqs),
      max_tokens_per_step_(max_tokens_per_step) {
  if (requests.empty()) throw std::invalid_argument("give at least one --request");
  for (auto& r : requests) {
    if (r.prompt.empty()) throw std::invalid_argument("a request needs at least one prompt token");
    if (r.max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be >= 1");
    State s;
    s.spec = std::move(r);
    requests_.push_back(std::move(s));
  }
}

bool Scheduler::reserve(State& s, int num_tokens, bool may_fail) {
  int needed = (s.computed + num_tokens + block_size_ - 1) / block_size_;
  int missing = needed - static_cast<int>(s.blocks.size());
  if (missing <= 0) return true;
  if (may_fail && !blocks_.can_allocate(missing)) return false;
  for (int i = 0; i < missing; ++i) s.blocks.push_back(blocks_.allocate());
  return true;
}

StepPlan Scheduler::next() {
  for (const auto& blocks : released_) blocks_.release(blocks);
  released_.clear();
  StepPlan plan;
  plan.index = step_;
  int budget = max_tokens_per_step_;
  auto schedule = [&](int id, State& s, bool may_fail) {
    int remaining = s.known_tokens() - s.computed;
    int q = std::min(remaining, budget);
    if (q <= 0 || static_cast<int>(plan.chunks.size()) >= max_num_seqs_) return false;
    if (!reserve(s, q, may_fail)) return false;
    ScheduledChunk c;
    c.request = id;
    c.start = s.computed;
    c.num_tokens = q;
    c.samples = q == remaining;
    c.block_table = s.blocks;
    s.computed += q;
    budget -= q;
    if (c.samples && ++s.scheduled_samples == s.spec.max_new_tokens) {
      s.finished = true;
      ++num_finished_;
      // freed when the next step is planned: this step still reads and writes them
      released_.push_back(std::move(s.blocks));
      s.blocks.clear();
    }
    plan.chunks.push_back(std::move(c));
    return true;
  };
  for (int id = 0; id < num_requests(); ++id) {
    State& s = requests_[id];
    if (s.admitted && !s.finished) schedule(id, s, /*may_fail=*/false);
  }
  for (int id = 0; id < num_requests(); ++id) {
    State& s = requests_[id];
    if (s.admitted || s.spec.arrival_step > step_) continue;
    // admission in arrival order: a request that does not fit waits, and so do later ones
    if (!schedule(id, s, /*may_fail=*/true)) break;
    s.admitted = true;
  }
  ++step_;
  return plan;
}

}  // namespace cpp_host
