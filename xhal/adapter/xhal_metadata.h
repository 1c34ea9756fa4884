/*
 * xhal_metadata.h: the per-step attention-metadata contract between a C/C++ host and xhal.
 *
 * A host (xLLM's C++ runtime, or any engine that schedules requests and allocates KV blocks)
 * describes one step's batch with the fields below and hands the tensors to Python under the same
 * names: xLLM's PyAttentionMetadataView attribute names. xhal.adapter.from_xllm(view, convention)
 * turns them into xhal's normalized AttentionMetadata by views: no given tensor is copied and no
 * device tensor is read back to the host. Fields it needs but was not given are derived from the
 * host lengths. This header only describes the layout; it has no functions to link.
 * examples/cpp_host fills this struct from C++ every step and hands each field to Python as a
 * tensor over the same memory (its data_ptr() is the field's data pointer).
 *
 * Every tensor is int32, contiguous, row-major. B = number of sequences (rows of block_table),
 * T = number of tokens including padding (length of slot_mapping).
 *
 * Length conventions (xLLM's BatchInputBuilder fills them per platform):
 *
 *   field                     | XHAL_CONVENTION_NPU                 | XHAL_CONVENTION_CUDA
 *   --------------------------+-------------------------------------+----------------------------------
 *   q_seq_lens, kv_seq_lens   | per sequence, [B]                   | cumulative, leading 0, [B+1]
 *   q_seq_lens_host,          | as the device twin (CPU)            | as the device twin (CPU)
 *   kv_seq_lens_host(_values) |                                     |
 *   q_cu_seq_lens             | inclusive cumsum, [B] without the   | sequence ends q_seq_lens[1:], [B]
 *                             | leading 0 (ACL graph mode), or [B+1]| ([B+1] with a leading 0 is also
 *                             | with it                             | accepted)
 *   kv_cu_seq_lens, qo_indptr | cumulative, leading 0, [B+1]        | cumulative, leading 0, [B+1]
 *
 *   Fields may share memory, as xLLM's CUDA builder's do: in XHAL_CONVENTION_CUDA, q_cu_seq_lens
 *   may point at q_seq_lens + 1, and kv_cu_seq_lens / qo_indptr at kv_seq_lens / q_seq_lens.
 *
 *   Example, B = 3 with (q_len, kv_len) = (1, 5), (3, 7), (4, 4):
 *     npu:  q_seq_lens = {1, 3, 4}      kv_seq_lens = {5, 7, 4}        q_cu_seq_lens = {1, 4, 8}
 *     cuda: q_seq_lens = {0, 1, 4, 8}   kv_seq_lens = {0, 5, 12, 16}   q_cu_seq_lens = {1, 4, 8}
 *
 * Semantics:
 *   - kv_len includes this step's tokens. Sequence i's new tokens are rows
 *     [q_cu[i], q_cu[i+1]) of q/k/v and sit at KV positions [kv_len_i - q_len_i, kv_len_i);
 *     attention is causal, aligned bottom-right. Sequences may come in any order.
 *   - slot = block_id * block_size + offset (xhal_slot below). slot_mapping[t] == -1
 *     (XHAL_PADDING_SLOT) marks a padding token: its K/V is never written, its output unspecified.
 *   - block_table is [B, max_blocks]; only the first ceil(kv_len / block_size) entries of a row
 *     are meaningful. The rest may hold anything that is a valid block id (0, or ids left from
 *     earlier steps, as xhal's own persistent decode tables do): no backend reads them.
 *   - KV caches (bound once, not part of this view): per layer a key and a value tensor
 *     [num_blocks, block_size, num_kv_heads, head_dim] in the model's dtype (xLLM's default
 *     KVCacheShape), allocated by the host; no backend asks for another layout.
 *   - paged_kv_indptr [B+1], paged_kv_indices [nnz_pages], paged_kv_last_page_len [B] come
 *     together or not at all (FlashInfer's layout, filled by xLLM's CUDA builder);
 *     last_page_len = kv_len % block_size, or block_size when that is 0 (xhal_last_page_len).
 *     paged_kv_indptr_host / paged_kv_last_page_len_host, their CPU twins, may come with them.
 *   - Host (CPU) lengths are required, not optional: planners read them, and xhal never syncs a
 *     device tensor to the host. kv_seq_lens_host or kv_seq_lens_host_values must be given when
 *     B > 0; q_seq_lens_host may be left out for DECODE (all 1) and PREFILL (q == kv) batches.
 *   - batch_forward_type, when set, is the step's kind; otherwise xhal derives it from is_prefill,
 *     is_chunked_prefill and the host lengths.
 */
#ifndef XHAL_METADATA_H
#define XHAL_METADATA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define XHAL_METADATA_VERSION 1
#define XHAL_PADDING_SLOT (-1)
#define XHAL_MAX_DIMS 2

/* The step's kind. Values are xLLM's BatchForwardType values (Python: xhal.BatchKind). */
typedef enum XhalBatchKind {
  XHAL_BATCH_KIND_UNSET = -1,        /* let xhal derive the kind */
  XHAL_BATCH_PREFILL = 0,            /* every sequence starts from an empty KV cache */
  XHAL_BATCH_CHUNKED_PREFILL = 1,    /* prompts continue over KV cached by earlier steps */
  XHAL_BATCH_DECODE = 2,             /* one new token per sequence */
  XHAL_BATCH_MIXED = 3,              /* decodes and prefill chunks together */
  XHAL_BATCH_EMPTY = 4               /* no tokens (an idle data-parallel rank) */
} XhalBatchKind;

/* Which layout the length fields follow (table above). Python: convention="npu" / "cuda". */
typedef enum XhalConvention {
  XHAL_CONVENTION_NPU = 0,
  XHAL_CONVENTION_CUDA = 1
} XhalConvention;

/* Where a tensor lives. */
typedef enum XhalMemory {
  XHAL_MEMORY_DEVICE = 0,            /* the compute device (same device for every device field) */
  XHAL_MEMORY_HOST = 1               /* CPU memory */
} XhalMemory;

/* Element type. The contract is int32 everywhere; the enum exists so the struct is self-describing. */
typedef enum XhalDType {
  XHAL_DTYPE_INT32 = 0
} XhalDType;

/* One field: a borrowed pointer plus its shape. data == NULL means the field is absent. */
typedef struct XhalTensorRef {
  const int32_t *data;
  int32_t ndim;                      /* 1, or 2 for block_table */
  int64_t shape[XHAL_MAX_DIMS];      /* unused trailing dimensions are 0 */
  XhalDType dtype;                   /* always XHAL_DTYPE_INT32 */
  XhalMemory memory;
} XhalTensorRef;

/* One step's metadata, field for field the PyAttentionMetadataView names. */
typedef struct XhalAttentionMetadataView {
  int32_t version;                   /* XHAL_METADATA_VERSION */
  XhalConvention convention;
  int32_t batch_forward_type;        /* an XhalBatchKind, or XHAL_BATCH_KIND_UNSET */
  uint8_t is_prefill;                /* 1: PREFILL (no cached KV) */
  uint8_t is_chunked_prefill;        /* 1: CHUNKED_PREFILL or MIXED */
  int32_t max_query_len;             /* -1: derive from the host lengths */
  int32_t max_seq_len;               /* -1: derive from the host lengths */

  /* required */
  XhalTensorRef slot_mapping;        /* device [T]; -1 = padding token */
  XhalTensorRef block_table;         /* device [B, max_blocks]; past a row's pages: any valid id */

  /* lengths, in `convention` (table above) */
  XhalTensorRef q_seq_lens;          /* device, npu [B] | cuda [B+1] */
  XhalTensorRef kv_seq_lens;         /* device, npu [B] | cuda [B+1] */
  XhalTensorRef q_cu_seq_lens;       /* device, npu [B] or [B+1] | cuda [B] (ends) */
  XhalTensorRef kv_cu_seq_lens;      /* device [B+1], leading 0 */
  XhalTensorRef q_seq_lens_host;     /* host, same shape as q_seq_lens */
  XhalTensorRef kv_seq_lens_host;    /* host, same shape as kv_seq_lens */
  const int32_t *kv_seq_lens_host_values;  /* host list, same values as kv_seq_lens_host */
  int64_t num_kv_seq_lens_host_values;

  /* optional, FlashInfer layout (all three or none) */
  XhalTensorRef qo_indptr;           /* device [B+1], leading 0 */
  XhalTensorRef paged_kv_indptr;     /* device [B+1], leading 0 */
  XhalTensorRef paged_kv_indices;    /* device [nnz_pages] */
  XhalTensorRef paged_kv_last_page_len;  /* device [B] */
  /* optional host twins of the two above (xLLM's paged_kv_*_host): FlashInfer plans on the host,
   * so a backend stages these as given instead of rebuilding them; only with the device three */
  XhalTensorRef paged_kv_indptr_host;         /* host [B+1] */
  XhalTensorRef paged_kv_last_page_len_host;  /* host [B] */
} XhalAttentionMetadataView;

/* Length of q_seq_lens / kv_seq_lens (and their host twins) for num_seqs sequences. */
static inline int64_t xhal_seq_lens_numel(XhalConvention convention, int64_t num_seqs) {
  return convention == XHAL_CONVENTION_CUDA ? num_seqs + 1 : num_seqs;
}

/* The KV-cache slot of the token at `offset` inside block `block_id`. */
static inline int32_t xhal_slot(int32_t block_id, int32_t block_size, int32_t offset) {
  return block_id * block_size + offset;
}

/* Tokens in a sequence's last KV block (FlashInfer's paged_kv_last_page_len). */
static inline int32_t xhal_last_page_len(int32_t seq_len, int32_t block_size) {
  int32_t rest = seq_len % block_size;
  return rest != 0 ? rest : block_size;
}

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* XHAL_METADATA_H */
