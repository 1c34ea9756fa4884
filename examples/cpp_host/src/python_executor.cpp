#include "python_executor.h"

#include <pybind11/embed.h>

#include "argmax.h"

#include <algorithm>
#include <chrono>
#include <sstream>

namespace py = pybind11;
using namespace py::literals;

namespace cpp_host {

namespace {

double now_us() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

// A Python exception as a C++ one, built while the GIL is held (error_already_set::what()
// formats the Python type and message).
[[noreturn]] void rethrow(const py::error_already_set& e) { throw PythonError(e.what()); }

uintptr_t data_ptr(const py::object& t) { return t.attr("data_ptr")().cast<uintptr_t>(); }

const char* convention_name(XhalConvention c) { return c == XHAL_CONVENTION_NPU ? "npu" : "cuda"; }

}  // namespace

struct StepInputs {
  py::dict view;
  py::object ids, positions, selected;
};

struct PyExecutor::Impl {
  ExecutorOptions options;
  // C++-owned memory first: members are destroyed in reverse order, so every tensor viewing
  // this memory is released before it is freed
  StepSlot slots[2];
  std::unique_ptr<HostBuffer> logits_host;
  std::vector<uintptr_t> pinned;  // registered with the device runtime, unregistered at the end

  py::object torch, executor, caches, platform;
  py::object host_tensor[2], device_tensor[2], logits_tensor;
  py::object execute, compute_logits, noop;
  bool on_cpu = true;
  // device fields in their own device buffers, filled by one copy per step (always off the CPU;
  // on the CPU with ExecutorOptions::staged, to exercise the GPU's layout there)
  bool staged = false;
  int vocab = 0, max_blocks = 0;
  int64_t num_execute = 0, num_logits = 0;
  std::atomic<bool>* in_python = nullptr;
  std::unique_ptr<ArgmaxPool> argmax;
  std::string summary;

  py::object wrap(HostBuffer& buffer, const char* dtype) {
    py::memoryview memory = py::memoryview::from_memory(buffer.data(),
                                                        static_cast<py::ssize_t>(buffer.num_bytes()));
    // frombuffer shares the memory: the tensor's data_ptr() is buffer.data()
    return torch.attr("frombuffer")(memory, "dtype"_a = torch.attr(dtype));
  }

  void pin(HostBuffer& buffer) {
    // page-locked so that copies between it and the GPU run asynchronously; CUDA is the only
    // device this example pins for (other devices copy from pageable memory, just slower)
    if (platform.attr("device_type").cast<std::string>() != "cuda") return;
    py::object cudart = torch.attr("cuda").attr("cudart")();
    auto ptr = reinterpret_cast<uintptr_t>(buffer.data());
    py::object err = cudart.attr("cudaHostRegister")(ptr, buffer.num_bytes(), 0);
    if (py::int_(err).cast<int>() != 0) {
      throw std::runtime_error("cudaHostRegister failed on a " +
                               std::to_string(buffer.num_bytes()) + "-byte step buffer");
    }
    pinned.push_back(ptr);
  }

  // The step's tensors (views of the slot) and its metadata dict; GIL held.
  StepInputs inputs(const BuiltStep& step, int slot, std::vector<ZeroCopyCheck>* checks) const {
    StepInputs in;
    const XhalAttentionMetadataView& v = step.view;
    auto field = [&](const char* name, const XhalTensorRef& ref) -> py::object {
      py::object t = tensor_of(ref, slot);
      if (checks != nullptr && !t.is_none() &&
          (ref.ndim == 2 ? ref.shape[0] * ref.shape[1] : ref.shape[0]) > 0) {
        checks->push_back({name, reinterpret_cast<uintptr_t>(ref.data), data_ptr(t)});
      }
      return t;
    };
    if (checks != nullptr) {  // the slot itself: the tensor Python wraps it in is its memory
      checks->push_back({"host_slot", reinterpret_cast<uintptr_t>(slots[slot].host->data()),
                         data_ptr(host_tensor[slot])});
    }
    py::dict& view = in.view;  // PyAttentionMetadataView's attribute names; absent ones left out
    const std::pair<const char*, const XhalTensorRef*> fields[] = {
        {"slot_mapping", &v.slot_mapping},
        {"block_table", &v.block_table},
        {"q_seq_lens", &v.q_seq_lens},
        {"kv_seq_lens", &v.kv_seq_lens},
        {"q_cu_seq_lens", &v.q_cu_seq_lens},
        {"kv_cu_seq_lens", &v.kv_cu_seq_lens},
        {"q_seq_lens_host", &v.q_seq_lens_host},
        {"kv_seq_lens_host", &v.kv_seq_lens_host},
        {"qo_indptr", &v.qo_indptr},
        {"paged_kv_indptr", &v.paged_kv_indptr},
        {"paged_kv_indices", &v.paged_kv_indices},
        {"paged_kv_last_page_len", &v.paged_kv_last_page_len},
    };
    for (const auto& [name, ref] : fields) {
      if (ref->data != nullptr) view[name] = field(name, *ref);
    }
    view["batch_forward_type"] = v.batch_forward_type;
    view["is_prefill"] = static_cast<bool>(v.is_prefill);
    view["is_chunked_prefill"] = static_cast<bool>(v.is_chunked_prefill);
    view["max_query_len"] = v.max_query_len;
    view["max_seq_len"] = v.max_seq_len;
    in.ids = field("input_ids", step.input_ids);
    in.positions = field("positions", step.positions);
    in.selected = field("selected_idxes", step.selected_idxes);

    return in;
  }

  py::object tensor_of(const XhalTensorRef& ref, int slot) const {
    if (ref.data == nullptr) return py::none();
    bool host = ref.memory == XHAL_MEMORY_HOST || !staged;
    uintptr_t base = host ? reinterpret_cast<uintptr_t>(slots[slot].host->data())
                          : slots[slot].device_base;
    auto address = reinterpret_cast<uintptr_t>(ref.data);
    int64_t numel = ref.ndim == 2 ? ref.shape[0] * ref.shape[1] : ref.shape[0];
    int64_t offset = static_cast<int64_t>(address - base) / static_cast<int64_t>(sizeof(int32_t));
    if (address < base || offset + numel > static_cast<int64_t>(slots[slot].host->num_ints())) {
      throw std::logic_error("a step field points outside its slot");
    }
    py::object t = (host ? host_tensor : device_tensor)[slot].attr("narrow")(0, offset, numel);
    if (ref.ndim == 2) t = t.attr("view")(ref.shape[0], ref.shape[1]);
    return t;
  }
};

PyExecutor::PyExecutor(const ExecutorOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = options;
  m.argmax = std::make_unique<ArgmaxPool>(options.argmax_threads);
  try {
    m.torch = py::module_::import("torch");
    py::object platforms = py::module_::import("xhal.platforms");
    py::object load_model = py::module_::import("models.loader").attr("load_model");
    py::object executor_mod = py::module_::import("xhal.executor");
    m.platform = platforms.attr("get")(options.device);
    m.on_cpu = m.platform.attr("device_type").cast<std::string>() == "cpu";
    m.staged = !m.on_cpu || options.staged;
    py::object device = m.platform.attr("device")();
    py::object model = load_model(options.model_dir, options.dtype, device,
                                  "progress"_a = false, "load_format"_a = options.load_format);
    py::object dtype = py::iter(model.attr("parameters")()).attr("__next__")().attr("dtype");
    py::object config = executor_mod.attr("ExecutorConfig")(
        "dtype"_a = dtype, "block_size"_a = options.block_size,
        "max_num_seqs"_a = options.max_num_seqs, "max_model_len"_a = options.max_model_len,
        "enforce_eager"_a = options.eager,
        "metadata_convention"_a = convention_name(options.convention));
    m.executor = executor_mod.attr("ModelExecutor")(model, m.platform, config);
    // KV caches: allocated once, bound once, kept alive here for the life of the host. They
    // are bound in xLLM's form, a (k, v, index, conv, ssm, index_scale) tuple per layer.
    m.caches = m.executor.attr("allocate_kv_caches")(options.num_blocks);
    py::list per_layer;
    for (py::handle cache : m.caches) {
      py::object none = py::none();
      per_layer.append(py::make_tuple(cache.attr("key"), cache.attr("value"), none, none, none, none));
    }
    m.executor.attr("bind_kv_caches")(per_layer);
    m.max_blocks = config.attr("max_blocks_per_seq").cast<int>();
    py::object model_config = model.attr("config");
    py::object vocab = py::isinstance<py::dict>(model_config)
                           ? py::object(model_config["vocab_size"])
                           : py::object(model_config.attr("vocab_size"));
    m.vocab = vocab.cast<int>();

    size_t ints = slot_capacity_ints(options.max_tokens_per_step, options.max_num_seqs,
                                     m.max_blocks);
    for (int i = 0; i < 2; ++i) {
      m.slots[i].host = std::make_unique<HostBuffer>(ints * sizeof(int32_t));
      m.host_tensor[i] = m.wrap(*m.slots[i].host, "int32");
      if (!m.staged) {
        m.device_tensor[i] = m.host_tensor[i];  // the executor reads the host memory itself
      } else {
        m.pin(*m.slots[i].host);
        m.device_tensor[i] = m.torch.attr("zeros")(m.slots[i].host->num_ints(),
                                                   "dtype"_a = m.torch.attr("int32"),
                                                   "device"_a = device);
      }
      m.slots[i].device_base = data_ptr(m.device_tensor[i]);
    }
    if (m.staged) {
      m.logits_host = std::make_unique<HostBuffer>(sizeof(float) * options.max_num_seqs *
                                                   static_cast<size_t>(m.vocab));
      m.pin(*m.logits_host);
      m.logits_tensor = m.wrap(*m.logits_host, "float32");
    }
    m.execute = m.executor.attr("execute");
    m.compute_logits = m.executor.attr("compute_logits");
    m.noop = py::module_::import("builtins").attr("abs");
    bool graphs = !m.executor.attr("decode_graphs").is_none();
    if (!m.on_cpu && graphs) {
      // as the reference server does: no request pays for a capture or a JIT compile
      m.executor.attr("capture_graphs")("progress"_a = false);
      m.executor.attr("warm_up")();
    }
    std::ostringstream s;
    s << "platform=" << py::str(m.platform.attr("name")).cast<std::string>()
      << " device=" << py::str(device).cast<std::string>()
      << " dtype=" << py::str(dtype).cast<std::string>() << " graphs=" << (graphs ? "on" : "off")
      << " convention=" << convention_name(options.convention)
      << " staged=" << (m.staged ? "yes" : "no")
      << " kv_cache=" << options.num_blocks << "x" << options.block_size << " blocks x "
      << py::len(m.caches) << " layers vocab=" << m.vocab;
    m.summary = s.str();
  } catch (const py::error_already_set& e) {
    rethrow(e);
  }
}

PyExecutor::~PyExecutor() {
  Impl& m = *impl_;
  try {
    m.logits_tensor = py::object();
    for (int i = 0; i < 2; ++i) m.host_tensor[i] = m.device_tensor[i] = py::object();
    if (!m.pinned.empty()) {
      m.platform.attr("synchronize")();
      py::object cudart = m.torch.attr("cuda").attr("cudart")();
      for (uintptr_t ptr : m.pinned) cudart.attr("cudaHostUnregister")(ptr);
    }
  } catch (const py::error_already_set&) {
    // tearing down: nothing left to report to
  }
}

const StepSlot& PyExecutor::slot(int i) const { return impl_->slots[i]; }
int PyExecutor::vocab_size() const { return impl_->vocab; }
int PyExecutor::max_blocks_per_seq() const { return impl_->max_blocks; }
std::string PyExecutor::describe() const { return impl_->summary; }
void PyExecutor::set_in_python_flag(std::atomic<bool>* flag) { impl_->in_python = flag; }
int64_t PyExecutor::execute_calls() const { return impl_->num_execute; }
int64_t PyExecutor::compute_logits_calls() const { return impl_->num_logits; }

StepOutput PyExecutor::run(const BuiltStep& step, std::vector<ZeroCopyCheck>* checks) {
  Impl& m = *impl_;
  const int slot = step.slot == &m.slots[0] ? 0 : 1;
  const int64_t num_samples = step.selected_idxes.shape[0];
  StepOutput out;
  const float* logits = nullptr;
  py::gil_scoped_acquire gil;  // the only place the host takes the GIL for a step
  if (m.in_python != nullptr) m.in_python->store(true);
  double start = now_us();
  py::object logits_ref;
  try {
    if (m.staged && step.num_tokens() > 0) {  // an EMPTY step reads no device field
      // the step's one host-to-device copy: every device field, from the pinned slot
      m.device_tensor[slot].attr("narrow")(0, 0, step.device_ints)
          .attr("copy_")(m.host_tensor[slot].attr("narrow")(0, 0, step.device_ints),
                         "non_blocking"_a = true);
    }
    StepInputs in = m.inputs(step, slot, checks);
    py::object hidden = m.execute(in.ids, in.positions, in.view);
    ++m.num_execute;
    if (num_samples > 0) {
      py::object result = m.compute_logits(hidden, in.selected);
      ++m.num_logits;
      py::tuple shape = result.attr("shape");
      if (py::len(shape) != 2 || shape[0].cast<int64_t>() != num_samples ||
          shape[1].cast<int>() != m.vocab || !result.attr("dtype").is(m.torch.attr("float32"))) {
        throw PythonError("compute_logits returned " + py::str(shape).cast<std::string>() + " " +
                          py::str(result.attr("dtype")).cast<std::string>() +
                          ", expected float32 [" + std::to_string(num_samples) + ", " +
                          std::to_string(m.vocab) + "]");
      }
      if (!m.staged) {
        logits_ref = result.attr("contiguous")();  // read in place while the reference lives
        logits = reinterpret_cast<const float*>(data_ptr(logits_ref));
      } else {
        // blocking copy into C++'s pinned buffer: the step's one device sync
        m.logits_tensor.attr("narrow")(0, 0, num_samples * m.vocab)
            .attr("view")(num_samples, m.vocab)
            .attr("copy_")(result);
        logits = reinterpret_cast<const float*>(m.logits_host->data());
      }
    }
  } catch (const py::error_already_set& e) {
    if (m.in_python != nullptr) m.in_python->store(false);
    rethrow(e);
  }
  out.python_us = now_us() - start;
  if (m.in_python != nullptr) m.in_python->store(false);
  {
    // argmax in C++, without the GIL (logits_ref keeps CPU logits alive meanwhile)
    py::gil_scoped_release release;
    double argmax_start = now_us();
    out.tokens.resize(num_samples);
    if (num_samples > 0) m.argmax->run(logits, num_samples, m.vocab, out.tokens.data());
    out.argmax_us = now_us() - argmax_start;
  }
  return out;  // logits_ref is dropped here, with the GIL held
}

std::vector<double> PyExecutor::prebuilt_execute_us(const BuiltStep& step, int iters) {
  Impl& m = *impl_;
  const int slot = step.slot == &m.slots[0] ? 0 : 1;
  std::vector<double> times;
  std::unique_ptr<StepInputs> in;  // Python objects: created and released with the GIL held
  {
    py::gil_scoped_acquire gil;
    in = std::make_unique<StepInputs>(m.inputs(step, slot, nullptr));
  }
  try {
    for (int i = 0; i < iters; ++i) {
      double start = now_us();
      {
        py::gil_scoped_acquire gil;
        try {
          m.execute(in->ids, in->positions, in->view);
        } catch (const py::error_already_set& e) {
          rethrow(e);
        }
      }
      times.push_back(now_us() - start);
    }
  } catch (...) {
    py::gil_scoped_acquire gil;
    in.reset();
    throw;
  }
  py::gil_scoped_acquire gil;
  in.reset();
  return times;
}

double PyExecutor::noop_call_us() {
  double start = now_us();
  {
    py::gil_scoped_acquire gil;
    try {
      impl_->noop(0);
    } catch (const py::error_already_set& e) {
      rethrow(e);
    }
  }
  return now_us() - start;
}

}  // namespace cpp_host
