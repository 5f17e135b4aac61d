// The C++ PrivateUse1 hooks of the `tpu` device.
//
// PyTorch reaches some device features only through at::PrivateUse1HooksInterface, in C++:
// pinned host memory (Tensor.pin_memory, DataLoader(pin_memory=True)), and later generators,
// storage resizing and device allocators. The Python hooks object (torch._C._acc) exposes only
// is_available / has_primary_context / is_built, and the hooks can be registered only ONCE per
// process, so this object replaces the Python one entirely. Built and loaded by
// torchtpu/runtime/native.py.
//
// To add a hook later (getNewGenerator, resizePrivateUse1Bytes, a device allocator, ...):
// override it in TpuHooks; if it needs Python, pass one more callable to register_hooks and
// call it the way isAvailable() does (take the GIL first).

// pybind11 as bundled with torch, not <torch/extension.h>: that one pulls in all of libtorch's
// C++ API and makes the first build ~5x slower (about 36 s of CPU instead of 7 s).
#include <pybind11/pybind11.h>

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <map>
#include <mutex>

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------------------------------------
// Pinned host memory.
//
// A tpu tensor's data is a jax.Array; PJRT copies host buffers itself and offers no page-locked
// buffer torch could own. So "pinned" memory here is aligned (64-byte, what XLA wants for
// zero-copy) host memory that PyTorch *treats* as pinned: pin_memory() and is_pinned() work,
// the DataLoader pins batches, and `.to("tpu", non_blocking=True)` sees a pinned source, as on
// CUDA. Each live allocation is recorded so that isPinnedPtr() can answer for any pointer into
// it (a view or slice of a pinned tensor is pinned too).
// ---------------------------------------------------------------------------------------------
class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;  // 64-byte aligned; throws on OOM
    if (ptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(static_cast<const char*>(ptr), nbytes);
      bytes_ += nbytes;
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
    return bytes_;
  }

 private:
  // A plain function pointer (DataPtr's deleter), hence a static that finds the one allocator.
  static void Delete(void* ptr);

  void release(void* ptr) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(static_cast<const char*>(ptr));
      if (it != live_.end()) {
        bytes_ -= it->second;
        live_.erase(it);
      }
    }
    c10::free_cpu(ptr);
  }

  mutable std::mutex mutex_;
  std::map<const char*, size_t> live_;  // start -> size, ordered for the interior lookup
  size_t bytes_ = 0;
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
// The hooks.
// ---------------------------------------------------------------------------------------------
struct TpuHooks final : at::PrivateUse1HooksInterface {
  // The Python callables are set once, under the GIL, by register_hooks.
  py::function is_available_;
  py::function has_primary_context_;

  bool isBuilt() const override { return true; }

  // Must never throw (AcceleratorHooksInterface's contract): a Python error reads as False.
  bool isAvailable() const override {
    if (!Py_IsInitialized()) return false;  // asked during interpreter shutdown
    py::gil_scoped_acquire gil;  // called from C++ with or without the GIL held
    try {
      return is_available_().cast<bool>();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("torchtpu hooks: is_available");
      return false;
    }
  }

  bool hasPrimaryContext(c10::DeviceIndex device_index) const override {
    if (!Py_IsInitialized()) return false;
    py::gil_scoped_acquire gil;
    try {
      return has_primary_context_(static_cast<int>(device_index)).cast<bool>();
    } catch (py::error_already_set& e) {
      // A c10::Error reaches Python as RuntimeError; pybind's error needs the GIL we hold here.
      TORCH_CHECK(false, "torchtpu hooks: has_primary_context(", static_cast<int>(device_index),
                  ") raised: ", e.what());
    }
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
};

// Leaked on purpose: PyTorch keeps the registered pointer for the life of the process (there is
// no unregister) and may call it during shutdown, after static destructors would have run.
TpuHooks* g_hooks = nullptr;

void register_hooks(py::function is_available, py::function has_primary_context) {
  if (g_hooks != nullptr) {  // ours already: just swap the callables (we hold the GIL)
    g_hooks->is_available_ = std::move(is_available);
    g_hooks->has_primary_context_ = std::move(has_primary_context);
    return;
  }
  TORCH_CHECK(!at::isPrivateUse1HooksRegistered(),
              "PrivateUse1 hooks are already registered in this process (e.g. by "
              "torch._C._acc.register_python_privateuseone_hook); they can be registered only once");
  auto* hooks = new TpuHooks();
  hooks->is_available_ = std::move(is_available);
  hooks->has_primary_context_ = std::move(has_primary_context);
  at::RegisterPrivateUse1HooksInterface(hooks);
  g_hooks = hooks;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torchtpu's C++ PrivateUse1 hooks (pinned memory); see torchtpu.runtime.native";
  m.def("register_hooks", &register_hooks, py::arg("is_available"),
        py::arg("has_primary_context"),
        "register_hooks(is_available: Callable[[], bool], has_primary_context: Callable[[int], "
        "bool]) -> None: register the C++ PrivateUse1 hooks (once per process)");
  m.def("pinned_bytes", [] { return pinned_allocator().bytes(); },
        "pinned_bytes() -> int: bytes of pinned host memory now allocated");
}
