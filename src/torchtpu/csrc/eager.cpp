// The native eager path: the `tpu` kernel of the ops that dominate real programs, in C++.
//
// An eager op through a Python kernel costs PyTorch's dispatcher boxing the call into Python
// objects, the kernel's argument walk and the wrapping of its result: about 15 us on top of the
// JAX call. Here the PrivateUse1 kernel of a registered op is a C++ functor that, per call:
//
//   1. checks that the op may run at once: the context's eager mode is DEFER_NEVER (the shared
//      `Execution` object of that mode, read as `runtime/execution.py`'s `current()` reads it), no
//      graph is being captured and no profiler span is wanted; or that it may be recorded: the
//      mode is DEFER_AND_FUSE's plain recording (`native_kernels._recording_executor`);
//   2. walks the boxed arguments once, building the call's key (the static arguments, and for a
//      tensor whether it is its storage's whole array or a view of which geometry) and the list of
//      dynamic values (storages' jax.Arrays, cached device scalars), as eager/dispatch.py's `Call`;
//   3. finds the key's jitted program in its own table, calls it through CPython's vectorcall (JAX's
//      C++ fast path then checks shapes and dtypes and launches), or, recording, hands it with its
//      dynamic values to the executor's `call` (eager/fused.py: a node, Deferred outputs), and
//   4. wraps each output array (or Deferred) as a new `tpu` tensor: a StorageImpl with a fresh
//      fake address whose Python object holds it (`storage._jax`, what device/bridge.py reads).
//
// Everything else takes the Python kernel, registered on the PrivateUse2 key for these ops and
// reached by redispatching there: a first call, any other mode, capture, a tensor without a
// computed array (deferred outside DEFER_AND_FUSE, lazy bits, another dtype), a CPU tensor other
// than a 0-d scalar, an argument the key cannot hold, an error. The Python path stays the
// reference: the table is filled by *learning* from it. On a key's first call the Python kernel
// runs (its result is the call's result) and reports the program and dynamic values it used
// (`Kernel.last`); when they are the very objects this walk produced, the program is recorded for
// the key. A call of the same key then runs (or records) exactly what the Python kernel would
// have. Keys that do not match are left to Python after a few tries made at once (a try while
// recording does not count: giving a key up would leave it to Python in every mode).
//
// All of it runs holding the GIL (PyTorch's bindings release it around the dispatcher).

#include <Python.h>
#include <pybind11/pybind11.h>

#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <ATen/native/BinaryOps.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/result_type.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace torchtpu {

namespace {

// Argument kinds, as eager/dispatch.py's _Signature: a tensor, a dynamic number (a cached device
// scalar), a static value (part of the key).
// a factory's `device` (static, and the device of its outputs when no tensor argument gives one).
enum Kind : int8_t { kTensor = 0, kList = 1, kScalar = 3, kStatic = 4, kDevice = 5 };

// Key tags: what follows each tag in the key.
enum Tag : int64_t {
  tNone = -1, tDyn = -2, tView = -3, tBool = -4, tInt = -5, tDouble = -6, tIntList = -7,
  tString = -8, tDevice = -9, tDoubleList = -10, tBoolList = -11, tOmitted = -12, tList = -13,
};

// ------------------------------------------------------------------------- process-wide state
struct Globals {
  bool enabled = false;
  PyObject* array_type = nullptr;        // jaxlib's ArrayImpl
  PyObject* laid_out_type = nullptr;     // eager/dispatch.py's _LaidOut (outputs not contiguous)
  PyObject* override_var = nullptr;      // runtime/execution.py's _override ContextVar
  PyObject* execution_globals = nullptr; // its module dict (`_default`)
  PyObject* never = nullptr;             // the DEFER_NEVER Execution object
  PyObject* bridge_globals = nullptr;    // device/bridge.py's module dict (`capturing`)
  PyObject* modes_globals = nullptr;     // eager/modes.py's module dict (`tracing`)
  PyObject* precision_globals = nullptr; // ops/precision.py's module dict (`_blocks`)
  PyObject* matmul_setting = nullptr;    // torch._C._get_float32_matmul_precision
  PyObject* scalar_fn = nullptr;         // dispatch._scalar(value)
  PyObject* host_scalar_fn = nullptr;    // dispatch._host_scalar(value, dtype)
  PyObject* op_counts = nullptr;         // metrics.ops (a Counter)
  PyObject* write_back = nullptr;        // native_kernels.write_back(target, value, name)
  PyObject* wrap_laid_out = nullptr;     // dispatch.wrap_laid_out(out, device, layouts)
  PyObject* defer_check = nullptr;       // ops/checks.py's defer(code, blocking)
  PyObject* deferred_type = nullptr;     // eager/fused.py's Deferred (a DEFER_AND_FUSE graph's value)
  PyObject* recording_executor = nullptr;  // native_kernels._recording_executor(): the FusedExecutor
                                           // this context records into, or None
  PyObject* s_call = nullptr;            // "call"
  PyObject* s_fn = nullptr;
  PyObject* s_layouts = nullptr;
  PyObject* s_jax = nullptr;             // "_jax"
  PyObject* s_dtype = nullptr;
  PyObject* s_shape = nullptr;
  PyObject* s_capturing = nullptr;
  PyObject* s_tracing = nullptr;
  PyObject* s_default = nullptr;
  PyObject* s_stale = nullptr;
  PyObject* s_blocks = nullptr;
  PyObject* s_learn = nullptr;
  PyObject* s_last = nullptr;
  // jax dtype object -> torch ScalarType, and back (index: ScalarType)
  std::unordered_map<PyObject*, c10::ScalarType> from_jax;
  PyObject* to_jax[static_cast<int>(c10::ScalarType::NumOptions)] = {};
  // (tag, bits) -> a cached 0-d device array (owned references)
  std::unordered_map<std::pair<int64_t, int64_t>, PyObject*, c10::hash<std::pair<int64_t, int64_t>>> scalars;
  std::atomic<int64_t> next_address{int64_t(1) << 40};
  // Where a native call's time goes (off by default; benchmarks/eager_overhead.py's budget): calls
  // timed, and ns spent per stage, summed over them: the GIL, mode check and argument walk; the
  // table lookup; the JAX call; the outputs (tensors built or the in-place write); the op count.
  bool budget_on = false;
  int64_t budget_calls = 0;
  int64_t budget_ns[5] = {};
  std::vector<std::unique_ptr<torch::Library>> libraries;
};

Globals& G() {
  static Globals* g = new Globals();  // leaked: kernels may run during interpreter shutdown
  return *g;
}

int64_t reserve_address(int64_t nbytes) {
  return G().next_address.fetch_add((nbytes / 64 + 2) * 64);
}

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const {
    size_t h = key.size();
    for (int64_t v : key) h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

struct Entry {
  PyObject* fn = nullptr;       // the jitted program (owned); null: this key stays with Python
  PyObject* layouts = nullptr;  // its outputs' memory orders where PyTorch's are not contiguous (owned)
  int misses = 0;               // learning attempts that did not match
};

constexpr int kMaxMisses = 3;
constexpr size_t kMaxEntries = 4096;  // per op, as the Python kernel's LRU (static keys hold shapes)

// The dynamic values of one call (new references), released on every exit.
struct DynList {
  std::vector<PyObject*> items;
  ~DynList() {
    for (PyObject* o : items) Py_DECREF(o);
  }
  void push(PyObject* o) { items.push_back(o); }  // steals
  void release() {
    for (PyObject* o : items) Py_DECREF(o);
    items.clear();
  }
};

class NativeOp;
void run(NativeOp& self, const c10::OperatorHandle& op, torch::jit::Stack* stack);

class NativeOp final : public c10::OperatorKernel {
 public:
  NativeOp(py::object kernel, std::vector<int8_t> kinds, std::vector<int64_t> triggers, bool dots,
           const std::string& metric, bool inplace, bool checked)
      : kernel_(std::move(kernel)), kinds_(std::move(kinds)), triggers_(std::move(triggers)), dots_(dots),
        name_(py::str(metric)), inplace_(inplace), checked_(checked) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    run(*this, op, stack);
  }

  py::object kernel_;
  std::vector<int8_t> kinds_;     // per schema argument
  std::vector<int64_t> triggers_; // arguments whose non-default value needs the Python checks
  bool dots_;
  py::object name_;               // str(op), the metrics' key
  bool inplace_;                  // op_(self, ...): the functional program's result written into self
  bool checked_;                  // its programs return the device-side index checks' code last
  std::unordered_map<std::vector<int64_t>, Entry, KeyHash> table_;
  int64_t native_calls_ = 0;  // calls run natively (at once)
  // calls left to Python, by why: another mode/capture, a checked argument, an argument the walk
  // cannot take, a key given up on, a first call (learning)
  int64_t left_[5] = {};
  int64_t laid_out_in_python_ = 0;  // native calls whose laid-out outputs took the Python wrap
  int64_t recorded_ = 0;            // calls recorded natively into a DEFER_AND_FUSE graph
};

void to_python(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);
}

PyObject* module_global(PyObject* globals, PyObject* name) {
  return PyDict_GetItem(globals, name);  // borrowed; null if absent
}

// An `Execution` a context holds, as execution.py's `current()` reads it: 1 it is DEFER_NEVER's,
// 0 another mode's, -1 none to go by (a follower copy made stale when the process default left
// DEFER_AND_FUSE: `current()` passes over it). Steals the reference.
int holds_never(PyObject* execution) {
  Globals& g = G();
  int verdict = 1;
  if (execution != g.never) {
    PyObject* stale = PyObject_GetAttr(execution, g.s_stale);
    if (stale == nullptr) PyErr_Clear();
    verdict = stale == Py_True ? -1 : 0;
    Py_XDECREF(stale);
  }
  Py_DECREF(execution);
  return verdict;
}

// Whether no graph is being captured and no profiler span is wanted (both take the Python kernels).
bool untraced() {
  Globals& g = G();
  PyObject* capturing = module_global(g.bridge_globals, g.s_capturing);
  if (capturing == nullptr || PyObject_IsTrue(capturing)) return false;
  return module_global(g.modes_globals, g.s_tracing) == Py_False;
}

// Whether this context runs ops at once (DEFER_NEVER), with nothing capturing or tracing.
bool at_once() {
  Globals& g = G();
  if (!untraced()) return false;
  PyObject* execution = nullptr;
  if (PyContextVar_Get(g.override_var, nullptr, &execution) < 0) {
    PyErr_Clear();
    return false;
  }
  if (execution != nullptr) {
    int verdict = holds_never(execution);
    if (verdict >= 0) return verdict == 1;
  }
  if (at::impl::ThreadLocalPythonObjects::contains("context")) {
    // an autograd thread running a backward pass: its caller's mode (execution.py's `current`)
    const auto& caller = at::impl::ThreadLocalPythonObjects::get("context");
    PyObject* context = caller ? caller->ptr(&caller->pyinterpreter()) : nullptr;
    if (context != nullptr && context != Py_None) {
      PyObject* theirs = PyObject_GetItem(context, g.override_var);  // (KeyError: none of its own)
      if (theirs == nullptr) {
        PyErr_Clear();
      } else {
        int verdict = holds_never(theirs);
        if (verdict >= 0) return verdict == 1;
      }
    }
  }
  return module_global(g.execution_globals, g.s_default) == g.never;
}

// The DEFER_AND_FUSE executor a call in this context records into (a new reference), or null: the
// context's mode is DEFER_AND_FUSE's plain recording (not a capture's, nothing capturing or
// tracing), as native_kernels._recording_executor finds it.
PyObject* recording_executor() {
  Globals& g = G();
  if (g.recording_executor == nullptr || g.deferred_type == nullptr || !untraced()) return nullptr;
  PyObject* executor = PyObject_CallNoArgs(g.recording_executor);
  if (executor == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (executor == Py_None) {
    Py_DECREF(executor);
    return nullptr;
  }
  return executor;
}

// A cached device scalar for (tag, bits); `make` builds it on a miss. New reference or null.
template <typename Make>
PyObject* cached_scalar(int64_t tag, int64_t bits, Make make) {
  Globals& g = G();
  auto key = std::make_pair(tag, bits);
  auto it = g.scalars.find(key);
  if (it != g.scalars.end()) {
    Py_INCREF(it->second);
    return it->second;
  }
  PyObject* value = make();
  if (value == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (Py_TYPE(value) != reinterpret_cast<PyTypeObject*>(g.array_type)) {  // not cacheable (out of range)
    Py_DECREF(value);
    return nullptr;
  }
  if (g.scalars.size() >= 8192) {
    for (auto& kv : g.scalars) Py_DECREF(kv.second);
    g.scalars.clear();
  }
  Py_INCREF(value);
  g.scalars.emplace(key, value);
  return value;
}

// Below this many elements an in-place op's target is not donated on the native path (its Python
// kernel donates a sole-owned target: for large buffers, where updating in place matters, calls
// whose target could be donated go to Python).
constexpr int64_t kDonateFrom = 1 << 14;

int64_t double_bits(double v) {
  int64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

// A Python number's cached device scalar (dispatch._scalar). New reference or null.
PyObject* number_scalar(const c10::IValue& v) {
  Globals& g = G();
  if (v.isDouble()) {
    double d = v.toDouble();
    return cached_scalar(tDouble, double_bits(d), [&] {
      return PyObject_CallOneArg(g.scalar_fn, py::float_(d).ptr());
    });
  }
  if (v.isBool()) {
    bool b = v.toBool();
    return cached_scalar(tBool, b, [&] { return PyObject_CallOneArg(g.scalar_fn, b ? Py_True : Py_False); });
  }
  if (v.isInt()) {
    int64_t i = v.toInt();
    return cached_scalar(tInt, i, [&] { return PyObject_CallOneArg(g.scalar_fn, py::int_(i).ptr()); });
  }
  return nullptr;  // complex, symbolic: Python
}

// A CPU 0-d tensor joining the op as a scalar (dispatch._host_scalar). New reference or null.
PyObject* host_scalar(const at::Tensor& t) {
  Globals& g = G();
  c10::ScalarType st = t.scalar_type();
  if (c10::isComplexType(st) || g.to_jax[static_cast<int>(st)] == nullptr) return nullptr;
  // the value's bits as the cache key, and the Python number _host_scalar is given on a miss
  int64_t bits;
  py::object value;
  if (c10::isFloatingType(st)) {
    double d = t.item<double>();
    bits = double_bits(d);
    value = py::float_(d);
  } else if (st == c10::ScalarType::Bool) {
    bits = t.item<bool>();
    value = py::bool_(bits != 0);
  } else {
    bits = t.item<int64_t>();
    value = py::int_(bits);
  }
  return cached_scalar(1000 + static_cast<int64_t>(st), bits, [&] {
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(st));  // borrowed
    return PyObject_CallFunctionObjArgs(g.host_scalar_fn, value.ptr(), dtype, nullptr);
  });
}

// A static argument into the key; false if the key cannot hold it.
bool static_key(const c10::IValue& v, std::vector<int64_t>& key) {
  if (v.isNone()) {
    key.push_back(tNone);
  } else if (v.isBool()) {
    key.push_back(tBool);
    key.push_back(v.toBool());
  } else if (v.isInt()) {
    key.push_back(tInt);
    key.push_back(v.toInt());
  } else if (v.isDouble()) {
    double d = v.toDouble();
    key.push_back(tDouble);
    key.push_back(std::isnan(d) ? int64_t(0x7ff8000000000000LL) : double_bits(d));
  } else if (v.isIntList()) {
    auto list = v.toIntList();
    key.push_back(tIntList);
    key.push_back(static_cast<int64_t>(list.size()));
    for (int64_t x : list) key.push_back(x);
  } else if (v.isDoubleList()) {
    auto list = v.toDoubleList();
    key.push_back(tDoubleList);
    key.push_back(static_cast<int64_t>(list.size()));
    for (double x : list) key.push_back(double_bits(x));
  } else if (v.isBoolList()) {
    auto list = v.toBoolList();
    key.push_back(tBoolList);
    key.push_back(static_cast<int64_t>(list.size()));
    for (bool x : list) key.push_back(x);
  } else if (v.isString()) {
    const std::string& s = v.toStringRef();
    key.push_back(tString);
    key.push_back(static_cast<int64_t>(s.size()));
    for (char c : s) key.push_back(c);
  } else if (v.isDevice()) {
    key.push_back(tDevice);
    key.push_back(static_cast<int64_t>(v.toDevice().type()));
    key.push_back(v.toDevice().index());
  } else {
    return false;  // a symbolic size, a generator, a list of lists ...: Python
  }
  return true;
}

// Whether `o` is a value a storage holds for the native kernel: a computed array, or (where
// `deferred_ok`: recording in DEFER_AND_FUSE) a graph's Deferred.
bool is_value(PyObject* o, bool deferred_ok) {
  Globals& g = G();
  return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(g.array_type) ||
         (deferred_ok && g.deferred_type != nullptr && Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(g.deferred_type));
}

// Reads a tensor argument: appends its key entry and dynamic values; false: leave the call to Python.
bool tensor_arg(const at::Tensor& t, int& device, std::vector<int64_t>& key, DynList& dyn, bool recording) {
  Globals& g = G();
  if (!t.defined()) {
    key.push_back(tNone);
    return true;
  }
  c10::Device where = t.device();
  if (where.type() != c10::DeviceType::PrivateUse1) {
    if (where.type() == c10::DeviceType::CPU && t.dim() == 0) {  // a scalar joining a device op
      // (a wrapped Python number reaches the Python kernel as the number itself)
      PyObject* s = t.unsafeGetTensorImpl()->is_wrapped_number() ? number_scalar(c10::IValue(t.item())) : host_scalar(t);
      if (s == nullptr) return false;
      dyn.push(s);
      key.push_back(tDyn);
      return true;
    }
    return false;  // the device mismatch error is Python's
  }
  if (device < 0) {
    device = where.index();
  } else if (device != where.index()) {
    return false;
  }
  if (t.is_conj() || t.is_neg()) return false;
  c10::ScalarType st = t.scalar_type();
  PyObject* storage = THPStorage_Wrap(t.storage());
  if (storage == nullptr) {
    PyErr_Clear();
    return false;
  }
  PyObject* array = PyObject_GetAttr(storage, g.s_jax);
  Py_DECREF(storage);
  if (array == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (!is_value(array, recording)) {
    Py_DECREF(array);  // none yet, lazy bits, or a deferred value outside DEFER_AND_FUSE
    return false;
  }
  dyn.push(array);
  PyObject* dtype = PyObject_GetAttr(array, g.s_dtype);
  if (dtype == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool same_dtype = dtype == g.to_jax[static_cast<int>(st)];
  Py_DECREF(dtype);
  if (!same_dtype) return false;  // a dtype view (view(dtype), bytes after torch.load): Python
  PyObject* shape = PyObject_GetAttr(array, g.s_shape);
  if (shape == nullptr || !PyTuple_Check(shape)) {
    Py_XDECREF(shape);
    PyErr_Clear();
    return false;
  }
  auto sizes = t.sizes();
  bool same_shape = PyTuple_GET_SIZE(shape) == static_cast<Py_ssize_t>(sizes.size());
  for (size_t i = 0; same_shape && i < sizes.size(); i++) {
    same_shape = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)) == sizes[i];
  }
  Py_DECREF(shape);
  if (same_shape && t.is_contiguous() && t.storage_offset() == 0) {
    key.push_back(tDyn);
    key.push_back(static_cast<int64_t>(st));  // (an in-place op's result must fit its target's dtype)
    return true;
  }
  // a view, read inside the op's program: its storage's array, its offset, and its geometry
  PyObject* offset = number_scalar(c10::IValue(t.storage_offset()));
  if (offset == nullptr) return false;
  dyn.push(offset);
  key.push_back(tView);
  key.push_back(static_cast<int64_t>(st));
  key.push_back(static_cast<int64_t>(sizes.size()));
  auto strides = t.strides();
  int64_t contiguous = 1;
  std::vector<int64_t> normal(sizes.size());
  for (size_t i = sizes.size(); i-- > 0;) {  // strides of size-1 dims address nothing (dispatch._view)
    normal[i] = sizes[i] == 1 ? contiguous : strides[i];
    contiguous *= std::max<int64_t>(sizes[i], 1);
  }
  for (size_t i = 0; i < sizes.size(); i++) {
    key.push_back(sizes[i]);
    key.push_back(normal[i]);
  }
  return true;
}

// A new tpu tensor holding `array` on tpu:`device`; undefined on failure (a Python error set).
// The geometry of an output that a laid-out program (dispatch._LaidOut.fn) returns already
// transposed into its memory order `order` (a tuple of dims from the outermost), as
// bridge.wrap_in_memory_order gives it: the tensor's sizes are the array's put back in dim order,
// its strides those of a dense layout in that order. False where that function would reshape the
// array first (the strides come out contiguous after all, or the array's dims are not in the
// order of the strides, which happens with ties between size-1 dims): the caller then wraps in Python.
bool laid_out_geometry(const std::vector<int64_t>& stored, PyObject* order, std::vector<int64_t>& sizes,
                       std::vector<int64_t>& strides) {
  size_t n = stored.size();
  if (order == nullptr || order == Py_None || !PyTuple_Check(order) || static_cast<size_t>(PyTuple_GET_SIZE(order)) != n) {
    sizes = stored;
    return true;  // (not transposed: a contiguous output)
  }
  std::vector<int64_t> dims(n);
  sizes.assign(n, 0);
  for (size_t p = 0; p < n; p++) {
    dims[p] = PyLong_AsLongLong(PyTuple_GET_ITEM(order, p));
    if (dims[p] < 0 || static_cast<size_t>(dims[p]) >= n) return false;
    sizes[dims[p]] = stored[p];
  }
  strides.assign(n, 0);
  int64_t step = 1;
  for (size_t p = n; p-- > 0;) {  // bridge.strides_in_order
    strides[dims[p]] = step;
    step *= std::max<int64_t>(sizes[dims[p]], 1);
  }
  bool contiguous = true;  // bridge.dense_layout: None for contiguous strides or an empty tensor
  step = 1;
  for (size_t d = n; d-- > 0;) {
    if (sizes[d] == 0) return false;
    contiguous = contiguous && strides[d] == step;
    step *= std::max<int64_t>(sizes[d], 1);
  }
  if (contiguous) return false;
  std::vector<int64_t> by_stride(n);  // bridge.memory_order: by decreasing stride, ties in dim order
  for (size_t d = 0; d < n; d++) by_stride[d] = static_cast<int64_t>(d);
  std::stable_sort(by_stride.begin(), by_stride.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  step = 1;
  for (size_t p = n; p-- > 0;) {  // the strides must be those of that order, and the array's dims in it
    if (strides[by_stride[p]] != step || sizes[by_stride[p]] != stored[p]) return false;
    step *= std::max<int64_t>(sizes[by_stride[p]], 1);
  }
  return true;
}

at::Tensor wrap(PyObject* array, int device, PyObject* order = nullptr, bool* python = nullptr) {
  Globals& g = G();
  if (array == Py_None) return at::Tensor();
  if (!is_value(array, true)) {
    PyErr_SetString(PyExc_TypeError, "tpu: a native eager program returned something other than an array");
    return at::Tensor();
  }
  PyObject* dtype = PyObject_GetAttr(array, g.s_dtype);
  if (dtype == nullptr) return at::Tensor();
  auto found = g.from_jax.find(dtype);
  Py_DECREF(dtype);
  if (found == g.from_jax.end()) {
    PyErr_SetString(PyExc_TypeError, "tpu: a native eager program returned an array of an unknown dtype");
    return at::Tensor();
  }
  PyObject* shape = PyObject_GetAttr(array, g.s_shape);
  if (shape == nullptr) return at::Tensor();
  std::vector<int64_t> sizes(PyTuple_GET_SIZE(shape));
  int64_t numel = 1;
  for (size_t i = 0; i < sizes.size(); i++) {
    sizes[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    numel *= sizes[i];
  }
  Py_DECREF(shape);
  std::vector<int64_t> strides;
  if (order != nullptr) {
    std::vector<int64_t> stored = std::move(sizes);
    if (!laid_out_geometry(stored, order, sizes, strides)) {
      *python = true;
      return at::Tensor();
    }
  }
  c10::ScalarType st = found->second;
  int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(st));
  c10::Device where(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  // as torch._C._construct_storage_from_data_pointer builds device/bridge.py's storages
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), static_cast<size_t>(nbytes),
      c10::DataPtr(reinterpret_cast<void*>(reserve_address(nbytes)), where), /*allocator=*/nullptr,
      /*resizable=*/false));
  PyObject* py_storage = THPStorage_Wrap(storage);
  if (py_storage == nullptr) return at::Tensor();
  int failed = PyObject_SetAttr(py_storage, g.s_jax, array);
  Py_DECREF(py_storage);  // (the storage keeps its Python object, and so the array, while it lives)
  if (failed) return at::Tensor();
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                         c10::scalarTypeToTypeMeta(st));
  if (strides.empty()) {
    tensor.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  } else {
    tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  }
  return tensor;
}

// Each output of a laid-out program as a tensor (into `outs`), or false where one needs the Python
// wrap (dispatch.wrap_laid_out), which also raises what is wrong with them.
bool wrap_laid_out(const c10::OperatorHandle& op, PyObject* out, PyObject* layouts, int device,
                   std::vector<at::Tensor>& outs) {
  // One output (the schema's one; a checked op's code was taken off above), or a tuple of them
  // with one order each (the lowering's outputs past the schema's have none: dispatch._padded).
  bool python = false;
  bool single = op.schema().returns().size() == 1;
  if (single) {
    PyObject* order = PyTuple_Check(layouts) && PyTuple_GET_SIZE(layouts) > 0 ? PyTuple_GET_ITEM(layouts, 0) : Py_None;
    outs.push_back(wrap(out, device, order, &python));
    python = python || !outs.back().defined();
  } else if (PyTuple_Check(out) && static_cast<size_t>(PyTuple_GET_SIZE(out)) == op.schema().returns().size()) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(out) && !python; i++) {
      PyObject* item = PyTuple_GET_ITEM(out, i);
      PyObject* order = PyTuple_Check(layouts) && i < PyTuple_GET_SIZE(layouts) ? PyTuple_GET_ITEM(layouts, i) : Py_None;
      outs.push_back(wrap(item, device, order, &python));  // (None: an undefined tensor)
      python = python || (!outs.back().defined() && item != Py_None);
    }
  } else {
    python = true;
  }
  PyErr_Clear();
  return !python;
}

// Pushes the program's result onto the stack as the op's returns; false (nothing pushed, a Python
// error set) if it cannot.
bool push_outputs(const c10::OperatorHandle& op, PyObject* out, int device, torch::jit::Stack* stack) {
  size_t nreturns = op.schema().returns().size();
  if (nreturns == 1) {
    at::Tensor t = wrap(out, device);
    if (!t.defined()) return false;
    stack->emplace_back(std::move(t));
    return true;
  }
  if (!PyTuple_Check(out) && !PyList_Check(out)) {
    PyErr_SetString(PyExc_TypeError, "tpu: a native eager program returned one value for several outputs");
    return false;
  }
  PyObject* seq = PySequence_Fast(out, "outputs");
  if (seq == nullptr || static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)) != nreturns) {
    Py_XDECREF(seq);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tpu: wrong number of outputs");
    return false;
  }
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < nreturns; i++) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    at::Tensor t = wrap(item, device);
    if (!t.defined() && item != Py_None) {
      Py_DECREF(seq);
      return false;
    }
    outs.push_back(std::move(t));
  }
  Py_DECREF(seq);
  for (auto& t : outs) stack->emplace_back(std::move(t));
  return true;
}

// Writes an in-place op's result into its target: the storage's array replaced when the target is
// all of it in the result's dtype and shape, else through the bridge (a view's scatter, a cast, the
// cast check). False with a Python error set on failure.
bool write_into(const at::Tensor& target, PyObject* out, NativeOp& self) {
  Globals& g = G();
  if (is_value(out, true) && target.is_contiguous() &&
      target.storage_offset() == 0 && !target.is_conj() && !target.is_neg()) {
    PyObject* storage = THPStorage_Wrap(target.storage());
    if (storage == nullptr) return false;
    PyObject* old = PyObject_GetAttr(storage, g.s_jax);
    bool simple = false;
    if (old != nullptr && is_value(old, true)) {
      PyObject* old_dtype = PyObject_GetAttr(old, g.s_dtype);
      PyObject* new_dtype = PyObject_GetAttr(out, g.s_dtype);
      PyObject* old_shape = PyObject_GetAttr(old, g.s_shape);
      PyObject* new_shape = PyObject_GetAttr(out, g.s_shape);
      simple = old_dtype != nullptr && old_dtype == new_dtype &&
               old_dtype == g.to_jax[static_cast<int>(target.scalar_type())] && old_shape != nullptr &&
               new_shape != nullptr && PyObject_RichCompareBool(old_shape, new_shape, Py_EQ) == 1 &&
               PyTuple_GET_SIZE(new_shape) == static_cast<Py_ssize_t>(target.dim());
      for (int64_t d = 0; simple && d < target.dim(); d++) {
        simple = PyLong_AsLongLong(PyTuple_GET_ITEM(new_shape, d)) == target.size(d);
      }
      Py_XDECREF(old_dtype);
      Py_XDECREF(new_dtype);
      Py_XDECREF(old_shape);
      Py_XDECREF(new_shape);
    }
    Py_XDECREF(old);
    PyErr_Clear();
    int failed = simple ? PyObject_SetAttr(storage, g.s_jax, out) : 0;
    Py_DECREF(storage);
    if (simple) return failed == 0;
  }
  PyObject* py_target = THPVariable_Wrap(target);
  if (py_target == nullptr) return false;
  PyObject* done = PyObject_CallFunctionObjArgs(g.write_back, py_target, out, self.name_.ptr(), nullptr);
  Py_DECREF(py_target);
  Py_XDECREF(done);
  return done != nullptr;
}

void count_op(NativeOp& self) {
  Globals& g = G();
  PyObject* counts = g.op_counts;
  PyObject* old = PyDict_GetItem(counts, self.name_.ptr());  // borrowed
  long long n = old == nullptr ? 0 : PyLong_AsLongLong(old);
  PyObject* updated = PyLong_FromLongLong(n + 1);
  PyDict_SetItem(counts, self.name_.ptr(), updated);
  Py_DECREF(updated);
}

// Learns a key from the Python kernel's run of this call: records its program when it used exactly
// this walk's dynamic values.
void learn(NativeOp& self, const c10::OperatorHandle& op, torch::jit::Stack* stack, std::vector<int64_t>&& key,
           const DynList& dyn, bool recording) {
  Globals& g = G();
  PyObject* kernel = self.kernel_.ptr();
  if (PyObject_SetAttr(kernel, g.s_learn, Py_True) < 0) PyErr_Clear();
  {
    py::gil_scoped_release release;  // as PyTorch calls a Python kernel; it takes the GIL itself
    to_python(op, stack);
  }
  PyObject* last = PyObject_GetAttr(kernel, g.s_last);
  if (last == nullptr) PyErr_Clear();
  if (PyObject_SetAttr(kernel, g.s_last, Py_None) < 0) PyErr_Clear();
  if (PyObject_SetAttr(kernel, g.s_learn, Py_False) < 0) PyErr_Clear();
  if (self.table_.size() >= kMaxEntries) {  // bounded, as the Python kernel's LRU
    for (auto& kv : self.table_) {
      Py_XDECREF(kv.second.fn);
      Py_XDECREF(kv.second.layouts);
    }
    self.table_.clear();
  }
  Entry& entry = self.table_[std::move(key)];
  bool match = last != nullptr && PyTuple_Check(last) && PyTuple_GET_SIZE(last) == 2;
  PyObject* fn = match ? PyTuple_GET_ITEM(last, 0) : nullptr;
  PyObject* values = match ? PyTuple_GET_ITEM(last, 1) : nullptr;
  match = match && PyList_Check(values) && static_cast<size_t>(PyList_GET_SIZE(values)) == dyn.items.size();
  for (size_t i = 0; match && i < dyn.items.size(); i++) match = PyList_GET_ITEM(values, i) == dyn.items[i];
  PyObject* layouts = nullptr;
  if (match && Py_TYPE(fn) == reinterpret_cast<PyTypeObject*>(g.laid_out_type)) {  // outputs laid out as PyTorch's
    fn = PyObject_GetAttr(fn, g.s_fn);
    layouts = PyObject_GetAttr(PyTuple_GET_ITEM(last, 0), g.s_layouts);
    match = fn != nullptr && layouts != nullptr && !self.inplace_;
    if (!match) {
      Py_XDECREF(fn);
      Py_XDECREF(layouts);
      PyErr_Clear();
      fn = layouts = nullptr;
    }
  } else if (match) {
    Py_INCREF(fn);
  }
  if (match && entry.fn == nullptr) {
    entry.fn = fn;  // (the reference taken above)
    entry.layouts = layouts;
    entry.misses = 0;
  } else if (!match && recording) {
    // (a mismatch while recording is not counted: giving the key up would leave it to Python in
    // every mode; a later call, recorded or at once, learns it)
  } else if (!match) {
    entry.misses++;
    // A common cause: the Python side's bounded scalar cache (dispatch._scalar) evicted a number
    // this side still holds, and made a new array for it; this side's cache is dropped so that the
    // next call takes the arrays Python holds now (a long-running process would otherwise give up
    // on every new signature with that number).
    for (auto& kv : g.scalars) Py_DECREF(kv.second);
    g.scalars.clear();
    if (std::getenv("TORCHTPU_NATIVE_DEBUG")) {
      fprintf(stderr, "native eager: %s did not learn: python %zd values, native %zu:",
              py::str(self.name_).cast<std::string>().c_str(),
              values && PyList_Check(values) ? PyList_GET_SIZE(values) : (Py_ssize_t)-1, dyn.items.size());
      for (size_t i = 0; i < dyn.items.size(); i++) {
        fprintf(stderr, " %p/%p", (void*)dyn.items[i],
                values && PyList_Check(values) && (Py_ssize_t)i < PyList_GET_SIZE(values) ? (void*)PyList_GET_ITEM(values, i) : nullptr);
      }
      fprintf(stderr, "\n");
    }
  }
  Py_XDECREF(last);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The stage times of one native call (read only when the budget is on).
struct Stamps {
  bool on;
  int64_t t[6] = {};
  explicit Stamps(bool on) : on(on) {
    if (on) t[0] = now_ns();
  }
  void mark(int i) {
    if (on) t[i] = now_ns();
  }
  void done(Globals& g) {  // (after the op count: stage 5)
    if (!on) return;
    t[5] = now_ns();
    g.budget_calls++;
    for (int i = 0; i < 5; i++) g.budget_ns[i] += t[i + 1] - t[i];
  }
};

void run(NativeOp& self, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Globals& g = G();
  if (!g.enabled) return to_python(op, stack);
  Stamps stamps(g.budget_on);
  py::gil_scoped_acquire gil;
  // In DEFER_AND_FUSE a known call is recorded here (the executor's `call`, as modes.execute does
  // it) rather than run; an in-place one's result is then written into its target as at once.
  py::object executor;
  if (!at_once()) {
    PyObject* found = recording_executor();
    if (found == nullptr) {
      self.left_[0]++;
      py::gil_scoped_release release;
      return to_python(op, stack);
    }
    executor = py::reinterpret_steal<py::object>(found);
  }
  bool recording = static_cast<bool>(executor);
  const auto& schema = op.schema();
  size_t nargs = schema.arguments().size();
  auto args = torch::jit::last(*stack, nargs);
  for (int64_t i : self.triggers_) {  // an argument PyTorch's checks look at (add's alpha)
    const auto& given = schema.arguments()[i].default_value();
    bool at_default = given.has_value() && args[i] == *given;
    if (!at_default && schema.arguments()[i].name() == "alpha" && args[i].isScalar() && args[0].isTensor()) {
      // add's and sub's alpha: PyTorch's own check, on the type the op computes in
      const c10::IValue& other = args[1];
      c10::ScalarType computed = other.isTensor() ? at::result_type(args[0].toTensor(), other.toTensor())
                                 : other.isScalar() ? at::result_type(args[0].toTensor(), other.toScalar())
                                                    : args[0].toTensor().scalar_type();
      at::native::alpha_check(computed, args[i].toScalar());
      continue;
    }
    if (!at_default) {
      self.left_[1]++;
      py::gil_scoped_release release;
      return to_python(op, stack);
    }
  }
  thread_local std::vector<int64_t> key;
  key.clear();
  key.push_back(static_cast<int64_t>(c10::get_default_dtype_as_scalartype()));
  bool ok = true;
  if (self.dots_) {  // its programs key on the fp32 matmul precision (ops/precision.py's setting)
    PyObject* blocks = module_global(g.precision_globals, g.s_blocks);
    ok = blocks != nullptr && !PyObject_IsTrue(blocks);
    if (ok) {
      PyObject* setting = PyObject_CallNoArgs(g.matmul_setting);
      ok = setting != nullptr;
      if (ok) {
        key.push_back(PyUnicode_CompareWithASCIIString(setting, "highest") == 0 ? 0
                      : PyUnicode_CompareWithASCIIString(setting, "high") == 0 ? 1 : 2);
        Py_DECREF(setting);
      } else {
        PyErr_Clear();
      }
    }
  }
  // The arguments the Python kernel is not given (PyTorch's boxing into Python drops those at
  // their defaults: keyword-only ones, and positional ones after the last given): no dynamic value.
  const auto& formals = schema.arguments();
  auto is_default = [&](size_t i) {
    const auto& d = formals[i].default_value();
    return d.has_value() && args[i] == *d;
  };
  size_t kwarg_only_start = nargs;
  while (kwarg_only_start > 0 && formals[kwarg_only_start - 1].kwarg_only()) kwarg_only_start--;
  size_t positional_end = kwarg_only_start;
  while (positional_end > 0 && is_default(positional_end - 1)) positional_end--;
  DynList dyn;
  int device = -1;
  int factory_device = -1;  // a `device` argument's index (the current device where it names none)
  for (size_t i = 0; ok && i < nargs; i++) {
    const c10::IValue& v = args[i];
    if (i < kwarg_only_start ? i >= positional_end : is_default(i)) {
      key.push_back(tOmitted);
      continue;
    }
    switch (self.kinds_[i]) {
      case kTensor:
        if (v.isNone()) {
          key.push_back(tNone);
        } else if (v.isTensor()) {
          ok = tensor_arg(v.toTensor(), device, key, dyn, recording);
        } else {
          ok = static_key(v, key);  // (an untyped slot's value)
        }
        break;
      case kList:  // Tensor[] (cat's): each element as a tensor argument
        if (v.isTensorList()) {
          auto list = v.toTensorList();
          key.push_back(tList);
          key.push_back(static_cast<int64_t>(list.size()));
          for (size_t j = 0; ok && j < list.size(); j++) ok = tensor_arg(list.get(j), device, key, dyn, recording);
        } else {
          ok = false;
        }
        break;
      case kScalar:
        if (v.isNone()) {
          key.push_back(tNone);
        } else if (v.isTensor()) {
          ok = tensor_arg(v.toTensor(), device, key, dyn, recording);
        } else {
          PyObject* s = number_scalar(v);
          ok = s != nullptr;
          if (ok) {
            dyn.push(s);
            key.push_back(tDyn);
            key.push_back(v.isDouble() ? tDouble : v.isBool() ? tBool : tInt);
          }
        }
        break;
      case kDevice:
        if (v.isNone()) {
          key.push_back(tNone);
        } else if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
          // as dispatch._device_index: the index given, else the current device (the device guard's)
          c10::Device given = v.toDevice();
          factory_device = given.has_index()
                               ? given.index()
                               : c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
          key.push_back(tDevice);
          key.push_back(static_cast<int64_t>(given.type()));
          key.push_back(factory_device);  // (its programs place their outputs on that device)
        } else {
          ok = false;
        }
        break;
      default:
        ok = static_key(v, key);
    }
  }
  if (ok && device < 0) device = factory_device;  // a factory: the device it names
  if (!ok || device < 0) {  // (no tpu tensor and no tpu device named: Python finds the device)
    PyErr_Clear();
    self.left_[2]++;
    py::gil_scoped_release release;
    return to_python(op, stack);
  }
  if (self.inplace_ && !recording) {  // (a recorded program donates nothing: the Python kernel's
                                      // run_inplace does not either in DEFER_AND_FUSE)
    const at::Tensor& target = args[0].toTensor();
    bool whole = target.numel() >= kDonateFrom && target.is_contiguous() && target.storage_offset() == 0;
    if (whole && Py_REFCNT(dyn.items[0]) <= 2) {  // the storage and this walk: the Python kernel donates it
      self.left_[2]++;
      dyn.release();  // (it counts the array's holders: this walk's reference must not be one)
      py::gil_scoped_release release;
      return to_python(op, stack);
    }
  }
  stamps.mark(1);
  auto found = self.table_.find(key);
  if (found == self.table_.end() || found->second.fn == nullptr) {
    if (found != self.table_.end() && found->second.misses >= kMaxMisses) {
      self.left_[3]++;
      py::gil_scoped_release release;
      return to_python(op, stack);
    }
    self.left_[4]++;
    return learn(self, op, stack, std::vector<int64_t>(key), dyn, recording);
  }
  stamps.mark(2);
  PyObject* out;
  if (recording) {  // executor.call(fn, *dyn): a node of the graph, its outputs Deferred values
    thread_local std::vector<PyObject*> argv;
    argv.clear();
    argv.push_back(executor.ptr());
    argv.push_back(found->second.fn);
    argv.insert(argv.end(), dyn.items.begin(), dyn.items.end());
    out = PyObject_VectorcallMethod(g.s_call, argv.data(), argv.size(), nullptr);
  } else {
    out = PyObject_Vectorcall(found->second.fn, dyn.items.data(), dyn.items.size(), nullptr);
  }
  stamps.mark(3);
  if (out == nullptr) {  // an error: the Python kernel runs the call again and raises it as PyTorch would
    PyErr_Clear();
    py::gil_scoped_release release;
    return to_python(op, stack);
  }
  if (self.checked_) {  // (outputs..., code): the code kept until the next synchronisation, as
                        // dispatch.Kernel._execute keeps it (checks.defer; this mode never blocks)
    Py_ssize_t n = PyTuple_Check(out) ? PyTuple_GET_SIZE(out) : 0;
    PyObject* results = nullptr;
    if (n >= 2) {
      PyObject* done = PyObject_CallFunctionObjArgs(g.defer_check, PyTuple_GET_ITEM(out, n - 1), Py_False, nullptr);
      if (done != nullptr) {
        Py_DECREF(done);
        results = op.schema().returns().size() == 1 ? PyTuple_GET_ITEM(out, 0) : PyTuple_GetSlice(out, 0, n - 1);
        if (op.schema().returns().size() == 1) Py_INCREF(results);
      }
    } else {
      PyErr_SetString(PyExc_TypeError, "tpu: a checked native eager program returned no check code");
    }
    Py_DECREF(out);
    if (results == nullptr) throw py::error_already_set();
    out = results;
  }
  if (self.inplace_) {
    at::Tensor target = args[0].toTensor();
    bool written = write_into(target, out, self);
    Py_DECREF(out);
    if (!written) throw py::error_already_set();
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(std::move(target));
    stamps.mark(4);
    (recording ? self.recorded_ : self.native_calls_)++;
    count_op(self);
    stamps.done(g);
    return;
  }
  PyObject* layouts = found->second.layouts;
  std::vector<at::Tensor> laid_out;
  if (layouts != nullptr && wrap_laid_out(op, out, layouts, device, laid_out)) {  // outputs PyTorch lays
    torch::jit::drop(*stack, nargs);                                              // out otherwise than contiguously
    for (auto& t : laid_out) stack->emplace_back(std::move(t));
    Py_DECREF(out);
    stamps.mark(4);
    (recording ? self.recorded_ : self.native_calls_)++;
    count_op(self);
    stamps.done(g);
    return;
  }
  if (layouts != nullptr) {  // the ones bridge.wrap_in_memory_order reshapes: wrapped in Python
    self.laid_out_in_python_++;
    PyObject* wrapped = PyObject_CallFunctionObjArgs(g.wrap_laid_out, out, py::int_(device).ptr(), layouts, nullptr);
    Py_DECREF(out);
    if (wrapped == nullptr) throw py::error_already_set();
    torch::jit::drop(*stack, nargs);
    if (THPVariable_Check(wrapped)) {
      stack->emplace_back(THPVariable_Unpack(wrapped));
    } else {
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(wrapped); i++) {
        PyObject* item = PyTuple_GET_ITEM(wrapped, i);
        stack->emplace_back(item == Py_None ? at::Tensor() : THPVariable_Unpack(item));
      }
    }
    Py_DECREF(wrapped);
    stamps.mark(4);
    (recording ? self.recorded_ : self.native_calls_)++;
    count_op(self);
    stamps.done(g);
    return;
  }
  torch::jit::drop(*stack, nargs);
  bool pushed = push_outputs(op, out, device, stack);
  Py_DECREF(out);
  if (!pushed) throw py::error_already_set();
  stamps.mark(4);
  (recording ? self.recorded_ : self.native_calls_)++;
  count_op(self);
  stamps.done(g);
}

// ------------------------------------------------------------------------- registration
std::vector<NativeOp*>& registered_ops() {
  static auto* ops = new std::vector<NativeOp*>();
  return *ops;
}

}  // namespace

void native_eager_setup(py::dict refs) {
  Globals& g = G();
  auto keep = [](py::handle h) {
    PyObject* o = h.ptr();
    Py_INCREF(o);
    return o;
  };
  g.array_type = keep(refs["array_type"]);
  g.laid_out_type = keep(refs["laid_out_type"]);
  g.override_var = keep(refs["override_var"]);
  g.execution_globals = keep(refs["execution_globals"]);
  g.never = keep(refs["never"]);
  g.bridge_globals = keep(refs["bridge_globals"]);
  g.modes_globals = keep(refs["modes_globals"]);
  g.precision_globals = keep(refs["precision_globals"]);
  g.matmul_setting = keep(refs["matmul_setting"]);
  g.scalar_fn = keep(refs["scalar"]);
  g.host_scalar_fn = keep(refs["host_scalar"]);
  g.op_counts = keep(refs["op_counts"]);
  g.write_back = keep(refs["write_back"]);
  g.wrap_laid_out = keep(refs["wrap_laid_out"]);
  g.defer_check = keep(refs["defer_check"]);
  if (refs.contains("deferred_type")) {
    g.deferred_type = keep(refs["deferred_type"]);
    g.recording_executor = keep(refs["recording_executor"]);
  }
  g.s_call = PyUnicode_InternFromString("call");
  g.s_fn = PyUnicode_InternFromString("fn");
  g.s_layouts = PyUnicode_InternFromString("layouts");
  g.s_jax = PyUnicode_InternFromString("_jax");
  g.s_dtype = PyUnicode_InternFromString("dtype");
  g.s_shape = PyUnicode_InternFromString("shape");
  g.s_capturing = PyUnicode_InternFromString("capturing");
  g.s_stale = PyUnicode_InternFromString("stale");
  g.s_tracing = PyUnicode_InternFromString("tracing");
  g.s_default = PyUnicode_InternFromString("_default");
  g.s_blocks = PyUnicode_InternFromString("_blocks");
  g.s_learn = PyUnicode_InternFromString("learn");
  g.s_last = PyUnicode_InternFromString("last");
  for (auto item : py::list(refs["dtypes"])) {  // (torch dtype, jax dtype) pairs
    auto pair = item.cast<py::tuple>();
    auto st = reinterpret_cast<THPDtype*>(pair[0].ptr())->scalar_type;
    PyObject* jax_dtype = keep(pair[1]);
    g.from_jax[jax_dtype] = st;
    g.to_jax[static_cast<int>(st)] = jax_dtype;
  }
}

void native_eager_register(const std::string& ns, const std::string& name, const std::string& metric,
                           py::object kernel, std::vector<int8_t> kinds, std::vector<int64_t> triggers, bool dots,
                           bool inplace, bool checked) {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse1,
                                              __FILE__, __LINE__);
  auto functor = std::make_unique<NativeOp>(std::move(kernel), std::move(kinds), std::move(triggers), dots,
                                            metric, inplace, checked);
  registered_ops().push_back(functor.get());
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(functor)));
  G().libraries.push_back(std::move(lib));
}

// Views: the CPU's own kernels of the four primitive view ops, which only make a tensor of another
// geometry on the same storage (device-agnostic metadata, PyTorch's checks and messages); the other
// view ops (transpose, permute, slice, select, expand, unsqueeze, ...) are PyTorch's composite
// kernels over these, as on CUDA.
at::Tensor view_as_cpu(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor as_strided_as_cpu(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                             std::optional<c10::SymInt> storage_offset) {
  std::optional<int64_t> offset;
  if (storage_offset.has_value()) offset = storage_offset->guard_int(__FILE__, __LINE__);
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                                           offset);
}

at::Tensor reshape_alias_as_cpu(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold_as_cpu(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

void native_views_register() {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                              __FILE__, __LINE__);
  lib->impl("view", TORCH_FN(view_as_cpu));
  lib->impl("as_strided", TORCH_FN(as_strided_as_cpu));
  lib->impl("_reshape_alias", TORCH_FN(reshape_alias_as_cpu));
  lib->impl("unfold", TORCH_FN(unfold_as_cpu));
  G().libraries.push_back(std::move(lib));
}

void native_eager_clear() {
  registered_ops().clear();
  G().libraries.clear();  // (their destructors deregister the kernels)
}

// Drops every learned program (a lowering changed: its kernels build new ones, learned again).
void native_eager_forget() {
  for (NativeOp* op : registered_ops()) {
    for (auto& kv : op->table_) {
      Py_XDECREF(kv.second.fn);
      Py_XDECREF(kv.second.layouts);
    }
    op->table_.clear();
  }
}

void native_eager_enable(bool on) { G().enabled = on; }

bool native_eager_enabled() { return G().enabled; }

int64_t native_reserve_address(int64_t nbytes) { return reserve_address(nbytes); }

void native_set_next_address(int64_t next) {
  int64_t current = G().next_address.load();
  while (next > current && !G().next_address.compare_exchange_weak(current, next)) {
  }
}

void native_eager_budget(bool on) {
  Globals& g = G();
  g.budget_on = on;
  g.budget_calls = 0;
  for (int64_t& ns : g.budget_ns) ns = 0;
}

py::tuple native_eager_budget_read() {
  Globals& g = G();
  return py::make_tuple(g.budget_calls, g.budget_ns[0], g.budget_ns[1], g.budget_ns[2], g.budget_ns[3], g.budget_ns[4]);
}

py::dict native_eager_stats() {
  py::dict stats;
  for (NativeOp* op : registered_ops()) {
    stats[op->name_] = py::make_tuple(op->native_calls_, op->table_.size(), op->left_[0], op->left_[1],
                                      op->left_[2], op->left_[3], op->left_[4], op->laid_out_in_python_,
                                      op->recorded_);
  }
  return stats;
}

}  // namespace torchtpu
