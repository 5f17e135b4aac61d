// The C++ PrivateUse1 hooks of the `tpu` device.
//
// PyTorch reaches some device features only from C++: at::PrivateUse1HooksInterface (pinned host
// memory, generators, storage resizing), the allocator registered for the device type
// (torch.accelerator's memory statistics) and the device guard (torch.accelerator.synchronize).
// The Python hooks object (torch._C._acc) exposes only is_available / has_primary_context /
// is_built, and its guard cannot synchronise; the hooks can be registered only ONCE per process,
// so these objects replace the Python ones entirely. Built and loaded by
// torchtpu/runtime/native.py.
//
// What needs the runtime is asked of one Python object, `callbacks` (torchtpu/device/hooks.py):
// each hook calls one of its functions by name, holding the GIL. To add a hook: override it
// here, add its function there.

// pybind11 as bundled with torch, not <torch/extension.h>: that one pulls in all of libtorch's
// C++ API and makes the first build ~5x slower (about 36 s of CPU instead of 7 s).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Dtype.h>    // THPDtype: a torch.dtype's ScalarType
#include <torch/csrc/Storage.h>  // THPStorage_Wrap: a storage's Python object, with its jax.Array

#include <chrono>
#include <cstring>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>
#include <utility>

namespace py = pybind11;

namespace torchtpu {
void register_autocast();  // autocast.cpp: PyTorch's CUDA autocast policy on AutocastPrivateUse1
// eager.cpp: the native eager kernel (torchtpu/eager/native_kernels.py)
void native_eager_setup(py::dict refs);
void native_eager_register(const std::string& ns, const std::string& name, const std::string& metric,
                           py::object kernel, std::vector<int8_t> kinds, std::vector<int64_t> triggers, bool dots,
                           bool inplace, bool checked);
void native_eager_clear();
void native_eager_forget();
void native_views_register();
void native_eager_enable(bool on);
bool native_eager_enabled();
int64_t native_reserve_address(int64_t nbytes);
void native_set_next_address(int64_t next);
py::dict native_eager_stats();
void native_eager_budget(bool on);
py::tuple native_eager_budget_read();
}

namespace {

// ---------------------------------------------------------------------------------------------
// Pinned host memory.
//
// A tpu tensor's data is a jax.Array; PJRT copies host buffers itself and offers no page-locked
// buffer torch could own. So "pinned" memory here is aligned (64-byte, what XLA wants for
// zero-copy) host memory that PyTorch *treats* as pinned: pin_memory() and is_pinned() work,
// the DataLoader pins batches, and `.to("tpu", non_blocking=True)` sees a pinned source, as on
// CUDA. Each live allocation is recorded so that isPinnedPtr() can answer for any pointer into
// it (a view or slice of a pinned tensor is pinned too). It is also the device type's host
// allocator (at::getHostAllocator), which torch.accelerator.empty_host_cache() calls: without
// one that call dereferenced a null allocator. Nothing is cached, so there is nothing to empty.
// ---------------------------------------------------------------------------------------------
class PinnedAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;  // 64-byte aligned; throws on OOM
    if (ptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(static_cast<const char*>(ptr), nbytes);
      bytes_.increase(nbytes);
      count_.increase(1);
    }
    // Pinned memory is host memory: the DataPtr's device is the CPU, as for CUDA's pinned memory.
    return {ptr, ptr, &Delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);  // plain host memcpy
  }

  // True when ptr lies inside [start, start + size) of a live allocation.
  bool contains(const void* ptr) const {
    const char* p = static_cast<const char*>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.upper_bound(p);  // first allocation starting after p
    if (it == live_.begin()) return false;
    --it;  // the last allocation starting at or before p
    return p < it->first + it->second;
  }

  size_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<size_t>(bytes_.current);
  }

  // at::HostAllocator: memory is freed as tensors die (no cache, no streams to wait for).
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    at::HostStats stats;
    stats.active_bytes = stats.allocated_bytes = bytes_;
    stats.active_requests = stats.allocations = count_;
    stats.num_host_alloc = count_.allocated;
    stats.num_host_free = count_.freed;
    return stats;
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_.reset_accumulated();
    count_.reset_accumulated();
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_.reset_peak();
    count_.reset_peak();
  }

 private:
  // A plain function pointer (DataPtr's deleter), hence a static that finds the one allocator.
  static void Delete(void* ptr);

  void release(void* ptr) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(static_cast<const char*>(ptr));
      if (it != live_.end()) {
        bytes_.decrease(it->second);
        count_.decrease(1);
        live_.erase(it);
      }
    }
    c10::free_cpu(ptr);
  }

  mutable std::mutex mutex_;
  std::map<const char*, size_t> live_;  // start -> size, ordered for the interior lookup
  c10::CachingAllocator::Stat bytes_, count_;  // live bytes and allocations
};

// Leaked on purpose: pinned tensors can be freed during interpreter shutdown, after static
// destructors have run; a never-destroyed allocator keeps their deleter valid to the end.
PinnedAllocator& pinned_allocator() {
  static PinnedAllocator* allocator = new PinnedAllocator();
  return *allocator;
}

void PinnedAllocator::Delete(void* ptr) {
  if (ptr) pinned_allocator().release(ptr);
}

// ---------------------------------------------------------------------------------------------
// Calling Python.
// ---------------------------------------------------------------------------------------------

// The callbacks object given to register_hooks. Leaked on purpose (as the hooks below): PyTorch
// may call a hook during interpreter shutdown, after static destructors would have run.
py::object* g_callbacks = nullptr;

// Run `body` (which calls the callbacks and converts their results) holding the GIL. Hooks are
// called from C++ with or without the GIL held. A Python exception propagates as it is
// (py::error_already_set): PyTorch's bindings restore it, so torch.OutOfMemoryError stays one.
template <typename Body>
auto with_python(const char* hook, Body&& body) {
  TORCH_CHECK(Py_IsInitialized() && g_callbacks != nullptr, "tpu: ", hook,
              " was called without a Python interpreter or registered callbacks");
  py::gil_scoped_acquire gil;
  return body(*g_callbacks);
}

// ---------------------------------------------------------------------------------------------
// Random generators: torch.Generator("tpu").
//
// A tpu generator is a (seed, offset) pair, like the device's default state in
// torchtpu/runtime/rng.py: a random op given `generator=g` draws its key from g's pair (the
// Python executor reads and advances it through initial_seed / get_offset / set_offset), so the
// same seed gives the same numbers as torch.tpu.manual_seed. get_state() is 16 bytes (seed,
// offset as native uint64s), the format of torch.tpu.get_rng_state().
// ---------------------------------------------------------------------------------------------
class TpuGenerator : public c10::GeneratorImpl {
 public:
  explicit TpuGenerator(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        seed_(seed) {}

  // PyTorch's bindings hold mutex_ around these already: none of them takes it.
  void set_current_seed(uint64_t seed) override { store(seed, 0); }  // a new seed restarts
  uint64_t current_seed() const override { return load().first; }
  void set_offset(uint64_t offset) override { store(load().first, offset); }
  uint64_t get_offset() const override { return load().second; }

  uint64_t seed() override {
    uint64_t seed = c10::detail::getNonDeterministicRandom();
    set_current_seed(seed);
    return seed;
  }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto [seed, offset] = load();
    const uint64_t words[2] = {seed, offset};
    at::TensorBase state = at::detail::empty_cpu({kStateBytes}, c10::ScalarType::Byte);
    std::memcpy(state.mutable_data_ptr(), words, kStateBytes);
    return state.getIntrusivePtr();
  }

  void set_state(const c10::TensorImpl& state) override {
    at::detail::check_rng_state(state);
    TORCH_CHECK(state.numel() == kStateBytes, "tpu RNG state must be ", kStateBytes,
                " bytes (seed, offset), from get_state() or torch.tpu.get_rng_state(); got ",
                state.numel());
    uint64_t words[2];
    std::memcpy(words, state.data(), kStateBytes);
    store(words[0], words[1]);
  }

 protected:
  virtual std::pair<uint64_t, uint64_t> load() const { return {seed_, offset_}; }
  virtual void store(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }

 private:
  static constexpr int64_t kStateBytes = 16;

  TpuGenerator* clone_impl() const override {  // a standalone copy (of a default one, too)
    auto* copy = new TpuGenerator(device_.index());
    std::tie(copy->seed_, copy->offset_) = load();
    return copy;
  }

  uint64_t seed_;
  uint64_t offset_ = 0;
};

// The device's default generator (torch.accelerator.get_rng_state, initial_seed): its pair IS
// the state in torchtpu/runtime/rng.py that torch.tpu.manual_seed sets and random ops without a
// generator draw from, so both APIs read one state.
class TpuDefaultGenerator final : public TpuGenerator {
 public:
  using TpuGenerator::TpuGenerator;

  void set_current_seed(uint64_t seed) override {  // as torch.tpu.manual_seed (initial_seed too)
    with_python("the default generator", [&](py::object& callbacks) {
      callbacks.attr("manual_seed")(static_cast<int>(device_.index()), seed);
    });
  }

 protected:
  std::pair<uint64_t, uint64_t> load() const override {
    return with_python("the default generator", [&](py::object& callbacks) {
      auto pair = callbacks.attr("rng_state")(static_cast<int>(device_.index())).cast<py::tuple>();
      return std::make_pair(pair[0].cast<uint64_t>(), pair[1].cast<uint64_t>());
    });
  }

  void store(uint64_t seed, uint64_t offset) override {
    with_python("the default generator", [&](py::object& callbacks) {
      callbacks.attr("set_rng_state")(static_cast<int>(device_.index()), seed, offset);
    });
  }
};

// ---------------------------------------------------------------------------------------------
// The device allocator.
//
// A tpu storage's bytes are a jax.Array that PJRT allocates; a storage's own data pointer is a
// fake, never dereferenced address (torchtpu/device/bridge.py). PyTorch still asks the allocator
// registered for the device type: torch.accelerator's memory functions (c10::getDeviceAllocator,
// whose absence is the internal assert "device_allocator"), and torch.UntypedStorage(n,
// device="tpu"), which crashed without one. So allocate() hands out a fake address from the
// bridge's counter (the array comes at first use, as for torch.empty), and the statistics are
// torchtpu.runtime.memory's: PJRT's figures, or torchtpu's own accounting on XLA:CPU.
// ---------------------------------------------------------------------------------------------
class TpuAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    auto [index, address] = with_python("allocate", [&](py::object& callbacks) {
      auto pair = callbacks.attr("allocate")(nbytes).cast<py::tuple>();
      return std::make_pair(pair[0].cast<int>(), pair[1].cast<uintptr_t>());
    });
    return {reinterpret_cast<void*>(address),
            c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index))};
  }

  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {
    TORCH_CHECK(false, "tpu: a tpu storage's bytes live in a jax.Array and cannot be copied by "
                       "address; copy the tensor instead (tensor.clone())");
  }

  // The runtime has started: before that there is nothing to report (PyTorch then returns empty
  // statistics, as for CUDA before its first use).
  bool initialized() override {
    return with_python("allocator", [](py::object& callbacks) {
      return callbacks.attr("is_initialized")().cast<bool>();
    });
  }

  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    with_python("empty_cache", [](py::object& callbacks) { callbacks.attr("empty_cache")(); });
  }

  // XLA runs a device's work in order and frees a buffer when its last user is done.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex index) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    with_python("memory_stats", [&](py::object& callbacks) {
      // PyTorch's flattened names ("allocated_bytes.all.current", ...); absent ones stay 0.
      py::dict figures = callbacks.attr("memory_stats")(static_cast<int>(index));
      auto figure = [&](const std::string& key) -> int64_t {
        if (!figures.contains(key)) return 0;
        py::object value = figures[py::str(key)];
        return py::isinstance<py::int_>(value) ? value.cast<int64_t>() : 0;
      };
      const std::pair<const char*, c10::CachingAllocator::StatArray*> arrays[] = {
          {"allocation", &stats.allocation},         {"segment", &stats.segment},
          {"active", &stats.active},                 {"allocated_bytes", &stats.allocated_bytes},
          {"reserved_bytes", &stats.reserved_bytes}, {"active_bytes", &stats.active_bytes},
          {"requested_bytes", &stats.requested_bytes}};
      constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      for (const auto& [name, array] : arrays) {
        auto& stat = (*array)[kAll];
        const std::string prefix = std::string(name) + ".all.";
        stat.current = figure(prefix + "current");
        stat.peak = figure(prefix + "peak");
        stat.allocated = figure(prefix + "allocated");
        stat.freed = figure(prefix + "freed");
      }
      stats.num_alloc_retries = figure("num_alloc_retries");
      stats.num_ooms = figure("num_ooms");
      stats.num_device_alloc = figure("num_device_alloc");
      stats.num_device_free = figure("num_device_free");
    });
    return stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex /*index*/) override {}  // none are accumulated

  void resetPeakStats(c10::DeviceIndex index) override {
    with_python("reset_peak_memory_stats", [&](py::object& callbacks) {
      callbacks.attr("reset_peak_memory_stats")(static_cast<int>(index));
    });
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex index) override {
    return with_python("mem_get_info", [&](py::object& callbacks) {
      auto pair = callbacks.attr("mem_get_info")(static_cast<int>(index)).cast<py::tuple>();
      return std::make_pair(pair[0].cast<size_t>(), pair[1].cast<size_t>());
    });
  }
};

TpuAllocator& device_allocator() {  // leaked on purpose, as the pinned allocator
  static TpuAllocator* allocator = new TpuAllocator();
  return *allocator;
}

// ---------------------------------------------------------------------------------------------
// The device guard. It holds the current device of each thread, the one torch.tpu.set_device sets
// and PyTorch reads wherever a tpu device has no index (`.to("tpu")`, factories, autograd's
// worker threads, `with torch.device(...)`): Python's torch.tpu.current_device reads the same
// value through current_device() below, so there is one current device, as for CUDA. A thread
// that never set one uses the process default: tpu:0, or under torchrun tpu:LOCAL_RANK
// (set_device_layout). One in-order stream per device (XLA orders a device's work itself), so
// waiting for a stream or an event is waiting for the device (synchronizeDevice, which the Python
// guard cannot do and torch.accelerator.synchronize() needs). An event remembers its device and,
// recorded with enable_timing, the time its work had finished (the device is waited for then, as
// torch.tpu.Event does), which elapsedTime subtracts.
// ---------------------------------------------------------------------------------------------
thread_local int tls_device = -1;       // -1: this thread has not chosen; use the default
std::atomic<int> g_default_device{0};   // the process's device (LOCAL_RANK under torchrun)
std::atomic<int> g_device_count{1};     // what torch.tpu.device_count() says

int current_device() {
  return tls_device >= 0 ? tls_device : g_default_device.load(std::memory_order_relaxed);
}

// An index made current (set_device_index, device_index(), DeviceGuard) must exist, as CUDA's
// guard checks. The count held here can be low before the runtime starts (a TPU host knows its
// count only then), so an index past it is checked by Python, which may start the runtime.
void check_device(c10::DeviceIndex index) {
  if (index < g_device_count.load(std::memory_order_relaxed)) return;
  with_python("set_device", [&](py::object& callbacks) {
    callbacks.attr("check_index")(static_cast<int>(index));
  });
}

struct TpuEvent {
  c10::DeviceIndex device = 0;
  double finished_ms = 0;  // steady-clock milliseconds; timing events only
};

struct TpuGuard final : c10::impl::DeviceGuardImplInterface {
  static constexpr auto kType = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device device) const override {
    auto old = getDevice();
    setDevice(device);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(kType, static_cast<c10::DeviceIndex>(current_device()));
  }
  void setDevice(c10::Device device) const override {
    if (device.index() < 0) return;
    check_device(device.index());
    tls_device = device.index();
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) tls_device = device.index();
  }
  c10::Stream getStream(c10::Device device) const noexcept override { return stream(device); }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return stream(device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const noexcept override { return stream; }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_device_count.load(std::memory_order_relaxed));
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex /*index*/,
              const c10::EventFlag flag) const override {
    if (*event == nullptr) *event = new TpuEvent();
    auto* recorded = static_cast<TpuEvent*>(*event);
    recorded->device = stream.device_index();
    if (flag == c10::EventFlag::BACKEND_DEFAULT) {  // enable_timing=True
      synchronizeDevice(recorded->device);
      recorded->finished_ms = std::chrono::duration<double, std::milli>(
          std::chrono::steady_clock::now().time_since_epoch()).count();
    }
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  // Done once waited for: the answer is true, and truthful (a query does not return early).
  bool queryEvent(void* event) const override {
    synchronizeEvent(event);
    return true;
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) synchronizeDevice(static_cast<TpuEvent*>(event)->device);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*index*/) const override {
    return static_cast<TpuEvent*>(end)->finished_ms - static_cast<TpuEvent*>(start)->finished_ms;
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*index*/) const noexcept override {
    delete static_cast<TpuEvent*>(event);
  }
  bool queryStream(const c10::Stream& stream) const override {
    synchronizeStream(stream);
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    synchronizeDevice(stream.device_index());
  }

  // torch.accelerator.get_device_capability: the dtypes a tpu tensor can hold.
  c10::DeviceCapability getDeviceCapability(c10::Device /*device*/) const override {
    c10::DeviceCapability capability;
    capability.capability_data.capability_bits = 0;
    with_python("get_device_capability", [&](py::object& callbacks) {
      for (py::handle dtype : callbacks.attr("supported_dtypes")()) {
        TORCH_CHECK(THPDtype_Check(dtype.ptr()), "tpu: supported_dtypes() must return torch.dtypes");
        const auto type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
#define TPU_SUPPORTS(_, name) \
  if (type == c10::ScalarType::name) capability.capability_data.supported_scalar_types.has_##name = 1;
        AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(TPU_SUPPORTS)
#undef TPU_SUPPORTS
      }
    });
    return capability;
  }

  void synchronizeDevice(const c10::DeviceIndex index) const override {
    with_python("synchronize", [&](py::object& callbacks) {
      callbacks.attr("synchronize")(static_cast<int>(index));
    });
  }

 private:
  static c10::Stream stream(c10::Device device) {
    return c10::Stream(c10::Stream::DEFAULT, device.index() >= 0 ? device : c10::Device(kType, 0));
  }
};

// ---------------------------------------------------------------------------------------------
// The hooks.
// ---------------------------------------------------------------------------------------------
struct TpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }

  // Must never throw (AcceleratorHooksInterface's contract): a Python error reads as False.
  bool isAvailable() const override {
    if (!Py_IsInitialized()) return false;  // asked during interpreter shutdown
    py::gil_scoped_acquire gil;
    try {
      return g_callbacks->attr("is_available")().cast<bool>();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("torchtpu hooks: is_available");
      return false;
    }
  }

  bool hasPrimaryContext(c10::DeviceIndex index) const override {
    if (!Py_IsInitialized()) return false;
    return with_python("has_primary_context", [&](py::object& callbacks) {
      return callbacks.attr("has_primary_context")(static_cast<int>(index)).cast<bool>();
    });
  }

  void init() const override {}  // nothing to set up: the runtime starts lazily in Python

  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator(); }

  bool isPinnedPtr(const void* data) const override {
    return data != nullptr && pinned_allocator().contains(data);
  }

  at::Device getDeviceFromPtr(void* /*data*/) const override {
    TORCH_CHECK(false,
                "tpu: a raw pointer cannot name a tpu device: tpu tensors hold jax.Arrays, not "
                "device pointers (from_blob/DLPack on tpu memory is not supported)");
  }

  // torch.Generator("tpu"): a new generator; "tpu" without an index means the current device.
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<TpuGenerator>(resolve(index));
  }

  // torch.accelerator's random functions; PyTorch keeps the returned reference.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    index = resolve(index);
    std::lock_guard<std::mutex> lock(mutex_);
    at::Generator& generator = default_generators_[index];  // std::map: references stay valid
    if (!generator.defined()) generator = at::make_generator<TpuDefaultGenerator>(index);
    return generator;
  }

  // UntypedStorage.resize_ (FSDP2 frees an unsharded parameter with resize_(0) and re-allocates
  // it with resize_(n)). The bridge resizes the storage's jax.Array (the prefix kept, zeros
  // after, dropped at 0 bytes) and gives a fresh fake address; then the storage takes its new
  // byte count. Our storages are made fixed-size (resizable() is False, which keeps PyTorch's own
  // kernels from resizing them), but an explicit resize_ of the storage is meant.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    uintptr_t address = with_python("resize_", [&](py::object& callbacks) {
      PyObject* wrapped = THPStorage_Wrap(storage);  // the storage's own Python object
      if (wrapped == nullptr) throw py::error_already_set();
      auto pystorage = py::reinterpret_steal<py::object>(wrapped);
      return callbacks.attr("resize_storage")(pystorage, nbytes).cast<uintptr_t>();
    });
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(c10::DataPtr(reinterpret_cast<void*>(address), storage.device()));
    impl->set_nbytes(nbytes);
  }

 private:
  static c10::DeviceIndex resolve(c10::DeviceIndex index) {
    if (index >= 0) return index;
    return with_python("current_device", [](py::object& callbacks) {
      return static_cast<c10::DeviceIndex>(callbacks.attr("current_device")().cast<int>());
    });
  }

  mutable std::mutex mutex_;
  mutable std::map<c10::DeviceIndex, at::Generator> default_generators_;
};

// Leaked on purpose: PyTorch keeps the registered pointers for the life of the process (there is
// no unregister) and may call them during shutdown, after static destructors would have run.
TpuHooks* g_hooks = nullptr;

void register_hooks(py::object callbacks) {
  if (g_hooks != nullptr) {  // ours already: just swap the callbacks (we hold the GIL)
    *g_callbacks = std::move(callbacks);
    return;
  }
  TORCH_CHECK(!at::isPrivateUse1HooksRegistered(),
              "PrivateUse1 hooks are already registered in this process (e.g. by "
              "torch._C._acc.register_python_privateuseone_hook); they can be registered only once");
  g_callbacks = new py::object(std::move(callbacks));
  g_hooks = new TpuHooks();
  at::RegisterPrivateUse1HooksInterface(g_hooks);
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &device_allocator());
  at::setHostAllocator(c10::DeviceType::PrivateUse1, &pinned_allocator());
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)) {  // else someone's guard stays
    c10::impl::registerDeviceGuard(c10::DeviceType::PrivateUse1, new TpuGuard());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torchtpu's C++ PrivateUse1 hooks, allocator and guard; see torchtpu.runtime.native";
  m.def("register_hooks", &register_hooks, py::arg("callbacks"),
        "register_hooks(callbacks) -> None: register the C++ PrivateUse1 hooks, device allocator "
        "and guard (once per process); `callbacks` answers what needs Python "
        "(torchtpu.device.hooks)");
  m.def("current_device", &current_device,
        "current_device() -> int: this thread's current tpu device (the guard's)");
  m.def("set_current_device", [](int index) { tls_device = index; }, py::arg("index"),
        "set_current_device(index) -> None: this thread's current tpu device");
  m.def("set_device_layout", [](int default_device, int count) {
          g_default_device = default_device;
          g_device_count = count;
        }, py::arg("default_device"), py::arg("count"),
        "set_device_layout(default_device, count) -> None: the device of threads that chose none, "
        "and the device count the guard reports");
  m.def("pinned_bytes", [] { return pinned_allocator().bytes(); },
        "pinned_bytes() -> int: bytes of pinned host memory now allocated");
  m.def("register_autocast", &torchtpu::register_autocast,
        "register_autocast() -> None: PyTorch's CUDA autocast policy as the AutocastPrivateUse1 "
        "kernels (once per process)");
  m.def("native_eager_setup", &torchtpu::native_eager_setup, "native_eager_setup(refs): what the native "
        "eager kernel reads of the Python side (eager/native_kernels.py)");
  m.def("native_eager_register", &torchtpu::native_eager_register,
        "native_eager_register(ns, name, metric, kernel, kinds, triggers, dots, inplace, checked): the C++ kernel of one op on "
        "PrivateUse1 (its Python kernel must be on PrivateUse2)");
  m.def("native_eager_clear", &torchtpu::native_eager_clear, "deregister every native eager kernel");
  m.def("native_eager_forget", &torchtpu::native_eager_forget, "drop every program the native kernels learned");
  m.def("native_views_register", &torchtpu::native_views_register,
        "native_views_register(): the CPU's kernels of view, as_strided, _reshape_alias and unfold on PrivateUse1");
  m.def("native_eager_enable", &torchtpu::native_eager_enable, "native_eager_enable(on): use the native path");
  m.def("native_eager_enabled", &torchtpu::native_eager_enabled, "whether the native path is in use");
  m.def("native_reserve_address", &torchtpu::native_reserve_address,
        "native_reserve_address(nbytes) -> int: a fresh fake device address (the one counter)");
  m.def("native_set_next_address", &torchtpu::native_set_next_address,
        "native_set_next_address(next): move the address counter forward to next");
  m.def("native_eager_budget", &torchtpu::native_eager_budget,
        "native_eager_budget(on): time the stages of native calls from now (the sums reset)");
  m.def("native_eager_budget_read", &torchtpu::native_eager_budget_read,
        "native_eager_budget_read() -> (calls, ns: walk, lookup, JAX call, outputs, op count)");
  m.def("native_eager_stats", &torchtpu::native_eager_stats,
        "native_eager_stats() -> {op: (native calls, keys, calls left to Python: mode, checked argument, argument, given up, learning)}");
}
