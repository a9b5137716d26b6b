// nmsparse::cpu24_linear's autograd, in C++: the gradients of F.linear with the dense weight.
//
//   dx = grad @ W (W: `weight` when given, else unpacked from values/bits), dW = grad^T x for a given
//   `weight` that requires grad, db = grad summed over tokens; values and bits get none.
//
// In C++ rather than Python (torch.library.register_autograd) because every call passes the Autograd
// key, also under torch.no_grad (Hugging Face's generate): the Python kernel cost about 10 us a call
// there (16 us a tiny layer's call against 6 us under inference_mode), some 1 ms a token for a 1B
// Llama's 112 layers. Here a call that records nothing goes straight to the kernel (8 us).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bits,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& weight, int64_t n,
                       int64_t max_tokens, c10::string_view isa) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("nmsparse::cpu24_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                               int64_t, int64_t, c10::string_view)>();
  return op.call(x, values, bits, bias, weight, n, max_tokens, isa);
}

at::Tensor call_unpack(const at::Tensor& values, const at::Tensor& bits, int64_t n) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("nmsparse::cpu24_unpack", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(values, bits, n);
}

bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

struct Cpu24Linear : public torch::autograd::Function<Cpu24Linear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const at::Tensor& bits, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& weight, int64_t n, int64_t max_tokens,
                            c10::string_view isa) {
    // the graph's edges are the tensors given, in order: x, values, bits, then bias and weight if given
    ctx->saved_data["bias_edge"] = given(bias) ? int64_t{3} : int64_t{-1};
    ctx->saved_data["weight_edge"] = given(weight) ? int64_t{3} + given(bias) : int64_t{-1};
    ctx->saved_data["n"] = n;
    ctx->save_for_backward({x, values, bits, given(weight) ? *weight : at::Tensor()});
    at::AutoDispatchBelowADInplaceOrView below;
    return call_linear(x, values, bits, bias, weight, n, max_tokens, isa);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &values = saved[1], &bits = saved[2], &weight = saved[3];
    const at::Tensor& grad = grads[0];
    const int64_t bias_edge = ctx->saved_data["bias_edge"].toInt();
    const int64_t weight_edge = ctx->saved_data["weight_edge"].toInt();
    const auto needs = [&](int64_t edge) { return edge >= 0 && ctx->needs_input_grad(edge); };
    at::Tensor dx, db, dw;
    if (ctx->needs_input_grad(0)) {
      const bool resident = weight.defined() && weight.numel() > 0;
      dx = at::matmul(grad, resident ? weight : call_unpack(values, bits, ctx->saved_data["n"].toInt()));
    }
    const at::Tensor flat = grad.reshape({-1, grad.size(-1)});
    if (needs(weight_edge)) dw = flat.t().mm(x.reshape({-1, x.size(-1)}));
    if (needs(bias_edge)) db = flat.sum(0);
    return {dx, at::Tensor(), at::Tensor(), db, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor cpu24_linear_autograd(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bits,
                                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& weight,
                                 int64_t n, int64_t max_tokens, c10::string_view isa) {
  const bool record = at::GradMode::is_enabled() &&
                      (x.requires_grad() || (given(bias) && bias->requires_grad()) ||
                       (given(weight) && weight->requires_grad()));
  if (!record) {  // decoding (no_grad, or nothing that needs a gradient): no graph node to make
    at::AutoDispatchBelowADInplaceOrView below;
    return call_linear(x, values, bits, bias, weight, n, max_tokens, isa);
  }
  return Cpu24Linear::apply(x, values, bits, bias, weight, n, max_tokens, isa);
}

}  // namespace

TORCH_LIBRARY_IMPL(nmsparse, Autograd, m) { m.impl("cpu24_linear", cpu24_linear_autograd); }
