// Autocast for the `tpu` device: PyTorch's CUDA cast policy on the AutocastPrivateUse1 key.
//
// `torch.autocast("tpu", dtype)` turns on the AutocastPrivateUse1 dispatch key; without kernels
// there, every op under it failed ("Could not run 'aten::matmul' ... 'Autocasttpu' backend").
// This registers, with PyTorch's own machinery (at::autocast::WrapFunction and the op lists of
// ATen/autocast_mode.h, the lists CUDA's autocast is built from), exactly CUDA's policy:
//
//   lower_precision_fp  matmul, mm, bmm, linear, addmm, baddbmm, conv*, prelu, einsum, SDPA, ...:
//                       floating inputs cast to the autocast dtype (fp32 weights' casts cached
//                       for the block, as on CUDA);
//   fp32                exp, log, pow, softplus, norms, losses, cdist, upsampling, ...: run in fp32;
//   fp32_set_opt_dtype  softmax, log_softmax, sum, prod, cumsum, cumprod, vector/matrix norms:
//                       fp32 unless the call gives a dtype;
//   fp32_append_dtype   norm.Scalar, norm.ScalarOpt_dim: redispatched with dtype=float32;
//   promote             addcdiv, addcmul, atan2, bilinear, cross, dot, vdot, index_put, ...:
//                       the widest floating input type;
//   banned              binary_cross_entropy (as on CUDA: use binary_cross_entropy_with_logits);
//   everything else     falls through (runs in its inputs' dtypes).
//
// The casts happen above autograd, so lower-precision ops save their inputs for backward in the
// low dtype, and torch.compile traces them (dynamo and aot_autograd run these same kernels on
// fake tpu tensors). No per-op Python: an op under autocast costs a C++ wrapper and its casts.
//
// ATen/autocast_mode.h pulls in ATen's full operator headers, so this lives in its own
// translation unit (compiled in parallel with hooks.cpp, which stays light); hooks.cpp binds
// register_autocast() into the extension module.

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace torchtpu {

using namespace at;  // the op lists name Tensor, Scalar, ScalarType, IntArrayRef unqualified

namespace {

Tensor binary_cross_entropy_banned(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

void register_kernels(torch::Library& m) {
#define TORCHTPU_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(TORCHTPU_LOWER_PRECISION_FP)
#undef TORCHTPU_LOWER_PRECISION_FP

#define TORCHTPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(TORCHTPU_FP32)
#undef TORCHTPU_FP32

#define TORCHTPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(TORCHTPU_FP32_SET_OPT_DTYPE)
#undef TORCHTPU_FP32_SET_OPT_DTYPE

  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)

#define TORCHTPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(TORCHTPU_PROMOTE)
#undef TORCHTPU_PROMOTE

#if __has_include(<ATen/ops/linalg_matrix_sqrth.h>)  // torch >= 2.14, which runs it in fp32 on CUDA
  KERNEL_PRIVATEUSEONE(linalg_matrix_sqrth, fp32)
#endif

  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN((&binary_cross_entropy_banned)));
}

}  // namespace

// Register the policy (once; later calls do nothing). Called by torchtpu when it registers the
// device, not at load time: a failure (another library owning AutocastPrivateUse1) is then a
// Python exception naming it, rather than a library that fails to load.
void register_autocast() {
  static bool registered = false;  // called from Python, holding the GIL
  if (registered) return;
  // Leaked on purpose, as the hooks: the dispatcher keeps these registrations for the process.
  auto* every_op = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::AutocastPrivateUse1,
                                      __FILE__, __LINE__);
  every_op->fallback(torch::CppFunction::makeFallthrough());
  auto* aten_ops = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutocastPrivateUse1,
                                      __FILE__, __LINE__);
  register_kernels(*aten_ops);
  registered = true;
}

}  // namespace torchtpu
