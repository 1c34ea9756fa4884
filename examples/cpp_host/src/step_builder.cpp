#include "step_builder.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace cpp_host {

namespace {

// Appends fields to a slot: device fields first (one contiguous host-to-device copy covers
// them), then host fields. A field's address is where the executor will read it: the device
// twin of the offset for XHAL_MEMORY_DEVICE, the host memory itself for XHAL_MEMORY_HOST.
class SlotWriter {
 public:
  explicit SlotWriter(const StepSlot& slot) : slot_(slot) {}

  int32_t* append(XhalTensorRef* ref, XhalMemory memory, int64_t rows, int64_t cols = -1) {
    int64_t numel = cols < 0 ? rows : rows * cols;
    if (cursor_ + numel > static_cast<int64_t>(slot_.host->num_ints())) {
      throw std::runtime_error("a step needs more than the " +
                               std::to_string(slot_.host->num_ints()) +
                               " ints its slot holds: raise --max-tokens-per-step or --max-num-seqs");
    }
    int32_t* host = slot_.host->ints() + cursor_;
    *ref = alias(memory, cursor_, rows, cols);
    cursor_ += numel;
    return host;
  }

  // A ref into already written ints (xLLM's layouts share memory between fields).
  XhalTensorRef alias(XhalMemory memory, int64_t offset, int64_t rows, int64_t cols = -1) const {
    XhalTensorRef r{};
    uintptr_t base = memory == XHAL_MEMORY_DEVICE
                         ? slot_.device_base
                         : reinterpret_cast<uintptr_t>(slot_.host->data());
    r.data = reinterpret_cast<const int32_t*>(base + offset * sizeof(int32_t));
    r.ndim = cols < 0 ? 1 : 2;
    r.shape[0] = rows;
    r.shape[1] = cols < 0 ? 0 : cols;
    r.dtype = XHAL_DTYPE_INT32;
    r.memory = memory;
    return r;
  }

  int64_t offset_of(const int32_t* host) const { return host - slot_.host->ints(); }
  int64_t cursor() const { return cursor_; }

 private:
  const StepSlot& slot_;
  int64_t cursor_ = 0;
};

// The same classification as xhal.adapter.derive_kind, from the host lengths.
int32_t classify(const std::vector<int>& q, const std::vector<int>& kv) {
  if (q.empty()) return XHAL_BATCH_EMPTY;
  bool all_decode = true, all_fresh = true, any_decode = false, any_chunk = false;
  for (size_t i = 0; i < q.size(); ++i) {
    all_decode &= q[i] == 1;
    all_fresh &= q[i] == kv[i];
    any_decode |= q[i] == 1 && kv[i] > 1;
    any_chunk |= q[i] > 1;
  }
  if (all_decode) return XHAL_BATCH_DECODE;
  if (all_fresh) return XHAL_BATCH_PREFILL;
  return any_decode && any_chunk ? XHAL_BATCH_MIXED : XHAL_BATCH_CHUNKED_PREFILL;
}

void cumulative(const std::vector<int>& lens, int32_t* out) {
  out[0] = 0;
  for (size_t i = 0; i < lens.size(); ++i) out[i + 1] = out[i] + lens[i];
}

}  // namespace

size_t slot_capacity_ints(int max_tokens, int max_seqs, int max_blocks_per_seq) {
  size_t t = max_tokens, b = max_seqs, w = max_blocks_per_seq;
  // ids, positions, slots [T]; selected [B]; block table [B, W] and paged indices [<= B*W];
  // at most 8 length arrays of B+1
  return 3 * t + b + 2 * b * w + 8 * (b + 1);
}

const char* kind_name(int32_t kind) {
  switch (kind) {
    case XHAL_BATCH_PREFILL: return "PREFILL";
    case XHAL_BATCH_CHUNKED_PREFILL: return "CHUNKED_PREFILL";
    case XHAL_BATCH_DECODE: return "DECODE";
    case XHAL_BATCH_MIXED: return "MIXED";
    case XHAL_BATCH_EMPTY: return "EMPTY";
    default: return "UNSET";
  }
}

BuiltStep build_step(const StepPlan& plan, const std::vector<RequestSpec>& requests,
                     const BuilderConfig& config, const StepSlot& slot) {
  const int bs = config.block_size;
  const auto D = XHAL_MEMORY_DEVICE;
  const auto H = XHAL_MEMORY_HOST;
  const int64_t num_seqs = static_cast<int64_t>(plan.chunks.size());
  const int64_t num_tokens = plan.num_tokens();
  std::vector<int> q, kv;
  int64_t width = 0, num_samples = 0;
  for (const auto& c : plan.chunks) {
    q.push_back(c.num_tokens);
    kv.push_back(c.start + c.num_tokens);
    width = std::max<int64_t>(width, static_cast<int64_t>(c.block_table.size()));
    num_samples += c.samples;
  }

  BuiltStep step;
  step.index = plan.index;
  step.slot = &slot;
  step.chunks = plan.chunks;
  XhalAttentionMetadataView& v = step.view;
  v.version = XHAL_METADATA_VERSION;
  v.convention = config.convention;
  SlotWriter w(slot);

  // tokens: prompt ids now, generated ids as patches the main thread fills in
  int32_t* ids = w.append(&step.input_ids, D, num_tokens);
  step.host_input_ids = ids;
  int32_t* pos = w.append(&step.positions, D, num_tokens);
  int32_t* slots = w.append(&v.slot_mapping, D, num_tokens);
  int32_t* selected = w.append(&step.selected_idxes, D, num_samples);
  int32_t* table = w.append(&v.block_table, D, num_seqs, width);
  int64_t row = 0, sample = 0;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    const auto& prompt = requests[c.request].prompt;
    for (int k = c.start; k < c.start + c.num_tokens; ++k, ++row) {
      if (k < static_cast<int>(prompt.size())) {
        ids[row] = prompt[k];
      } else {
        ids[row] = 0;
        step.patches.push_back({static_cast<int32_t>(row), c.request,
                                k - static_cast<int>(prompt.size())});
      }
      pos[row] = k;
      slots[row] = xhal_slot(c.block_table[k / bs], bs, k % bs);
    }
    if (c.samples) {
      selected[sample++] = static_cast<int32_t>(row - 1);
      step.sampled_requests.push_back(c.request);
    }
    int32_t* table_row = table + i * width;
    std::fill(table_row, table_row + width, 0);  // xLLM pads rows with 0
    std::copy(c.block_table.begin(), c.block_table.end(), table_row);
  }
  if (config.fault_block_table_shape) {
    v.block_table.ndim = 1;
    v.block_table.shape[0] = num_seqs * width;
    v.block_table.shape[1] = 0;
  }

  const int64_t b1 = num_seqs + 1;
  if (config.convention == XHAL_CONVENTION_CUDA) {
    // q_seq_lens / kv_seq_lens are cumulative [B+1]; q_cu_seq_lens holds the ends (q_cu[1:]);
    // kv_cu_seq_lens and qo_indptr are the cumulative arrays themselves
    int32_t* q_cu = w.append(&v.q_seq_lens, D, b1);
    cumulative(q, q_cu);
    int32_t* kv_cu = w.append(&v.kv_seq_lens, D, b1);
    cumulative(kv, kv_cu);
    v.q_cu_seq_lens = w.alias(D, w.offset_of(q_cu) + 1, num_seqs);
    v.kv_cu_seq_lens = v.kv_seq_lens;
    v.qo_indptr = v.q_seq_lens;
    // FlashInfer's paged-KV arrays, as xLLM's CUDA builder emits them
    int32_t* indptr = w.append(&v.paged_kv_indptr, D, b1);
    std::vector<int> pages;
    for (int len : kv) pages.push_back((len + bs - 1) / bs);
    cumulative(pages, indptr);
    int32_t* indices = w.append(&v.paged_kv_indices, D, indptr[num_seqs]);
    int32_t* last = w.append(&v.paged_kv_last_page_len, D, num_seqs);
    for (int64_t i = 0; i < num_seqs; ++i) {
      std::copy_n(plan.chunks[i].block_table.begin(), pages[i], indices + indptr[i]);
      last[i] = xhal_last_page_len(kv[i], bs);
    }
  } else {
    // per-sequence lengths [B]; q_cu_seq_lens with its leading 0 [B+1] (eager layout)
    int32_t* qd = w.append(&v.q_seq_lens, D, num_seqs);
    std::copy(q.begin(), q.end(), qd);
    int32_t* kvd = w.append(&v.kv_seq_lens, D, num_seqs);
    std::copy(kv.begin(), kv.end(), kvd);
    cumulative(q, w.append(&v.q_cu_seq_lens, D, b1));
    cumulative(kv, w.append(&v.kv_cu_seq_lens, D, b1));
  }
  step.device_ints = w.cursor();

  // host twins (planners read host lengths; xhal never reads a device tensor back)
  const int64_t n = xhal_seq_lens_numel(config.convention, num_seqs);
  int32_t* qh = w.append(&v.q_seq_lens_host, H, n);
  int32_t* kvh = w.append(&v.kv_seq_lens_host, H, n);
  if (config.convention == XHAL_CONVENTION_CUDA) {
    cumulative(q, qh);
    cumulative(kv, kvh);
  } else {
    std::copy(q.begin(), q.end(), qh);
    std::copy(kv.begin(), kv.end(), kvh);
  }

  v.batch_forward_type = classify(q, kv);
  v.is_prefill = v.batch_forward_type == XHAL_BATCH_PREFILL;
  v.is_chunked_prefill = v.batch_forward_type == XHAL_BATCH_CHUNKED_PREFILL ||
                         v.batch_forward_type == XHAL_BATCH_MIXED;
  v.max_query_len = q.empty() ? 0 : *std::max_element(q.begin(), q.end());
  v.max_seq_len = kv.empty() ? 0 : *std::max_element(kv.begin(), kv.end());
  return step;
}

}  // namespace cpp_host
