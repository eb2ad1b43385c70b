// The fused recurrent cells, which torch sends a GPU's LSTM and GRU to.
//
// For a tensor on CUDA or on a privateuse1 device, torch's nn.LSTM, nn.GRU, LSTMCell and
// GRUCell do the gates' matmuls and then call one fused kernel per cell and step
// (aten::_thnn_fused_lstm_cell, _thnn_fused_gru_cell, and their backward). Those have a
// CUDA kernel and no CPU one, so the CPU's kernel cannot run them on the device. Here each
// is written with the device's own operators, in the order of CUDA's kernels
// (aten/src/ATen/native/cuda/RNN.cu): the same sums in the same order and the same
// workspace (the activated gates, which the backward reads). Each operator is queued on
// the current stream as any other. In float32 and float64 the results are CUDA's; in
// float16 and bfloat16 CUDA keeps a cell's intermediates in float32, and here each
// operator rounds to the tensor's dtype.

#include "boxed.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat_ops.h>
#include <ATen/ops/zeros_like_ops.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace anydevice_sim {
namespace {

using Optional = std::optional<at::Tensor>;

// at::cat and at::zeros_like, called through their operators' declarations: the headers
// of the functions themselves take 1.5 s of the build to read.
at::Tensor cat(const std::vector<at::Tensor>& tensors, int64_t dim) {
  return at::_ops::cat::call(tensors, dim);
}

at::Tensor zeros_like(const at::Tensor& t) {
  return at::_ops::zeros_like::call(t, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                    std::nullopt);
}

bool given(const Optional& t) {
  return t.has_value() && t->defined();
}

// The gates' pre-activations: input + hidden (+ input bias + hidden bias), summed in the
// order CUDA's kernels sum them.
at::Tensor gate_sums(const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                     const Optional& input_bias, const Optional& hidden_bias) {
  at::Tensor sums = input_gates.add(hidden_gates);
  if (given(input_bias)) {
    sums.add_(*input_bias).add_(*hidden_bias);
  }
  return sums;
}

void check_cell(const char* op, const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                const at::Tensor& state, int64_t gates) {
  TORCH_CHECK(input_gates.dim() == 2 && input_gates.sizes() == hidden_gates.sizes(), op,
              ": input_gates and hidden_gates must be the same 2-d shape, got ",
              input_gates.sizes(), " and ", hidden_gates.sizes());
  TORCH_CHECK(state.dim() == 2 && state.numel() * gates == input_gates.numel(), op,
              ": the state ", state.sizes(), " does not fit gates of shape ",
              input_gates.sizes());
}

// (hy, cy, workspace): workspace holds the activated input, forget, cell and output gates.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell(const at::Tensor& input_gates,
                                                         const at::Tensor& hidden_gates,
                                                         const at::Tensor& cx,
                                                         const Optional& input_bias,
                                                         const Optional& hidden_bias) {
  check_cell("_thnn_fused_lstm_cell", input_gates, hidden_gates, cx, 4);
  at::Tensor workspace = gate_sums(input_gates, hidden_gates, input_bias, hidden_bias);
  const std::vector<at::Tensor> g = workspace.chunk(4, 1);
  g[0].sigmoid_();
  g[1].sigmoid_();
  g[2].tanh_();
  g[3].sigmoid_();
  at::Tensor cy = g[1].mul(cx).add_(g[0].mul(g[2]));  // (fg * cx) + (ig * cg)
  at::Tensor hy = g[3].mul(cy.tanh());
  return {hy, cy, workspace};
}

// (grad of the gates' pre-activations, grad of cx, grad of each bias); a missing grad_hy or
// grad_cy counts as zeros, as in CUDA's kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell_backward(
    const Optional& grad_hy, const Optional& grad_cy, const at::Tensor& cx,
    const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  if (!given(grad_hy) && !given(grad_cy)) {
    return {};
  }
  const std::vector<at::Tensor> g = workspace.chunk(4, 1);
  const at::Tensor& ig = g[0];
  const at::Tensor& fg = g[1];
  const at::Tensor& cg = g[2];
  const at::Tensor& og = g[3];
  const at::Tensor go = given(grad_hy) ? *grad_hy : zeros_like(cx);
  const at::Tensor tanh_cy = cy.tanh();
  // gcx = go * og * (1 - tanh(cy)^2) + goc
  at::Tensor gcx = go.mul(og).mul_(tanh_cy.mul(tanh_cy).neg_().add_(1));
  if (given(grad_cy)) {
    gcx.add_(*grad_cy);
  }
  at::Tensor gig = gcx.mul(cg).mul_(ig.neg().add_(1)).mul_(ig);
  at::Tensor gfg = gcx.mul(cx).mul_(fg.neg().add_(1)).mul_(fg);
  at::Tensor gcg = gcx.mul(ig).mul_(cg.mul(cg).neg_().add_(1));
  at::Tensor gog = go.mul(tanh_cy).mul_(og.neg().add_(1)).mul_(og);
  at::Tensor grad_gates = cat({gig, gfg, gcg, gog}, 1);
  at::Tensor grad_cx = gcx.mul(fg);
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {grad_gates, grad_cx, grad_bias};
}

// (hy, workspace): workspace holds the reset, input and new gates, hx, and the hidden new
// gate with its bias.
std::tuple<at::Tensor, at::Tensor> gru_cell(const at::Tensor& input_gates,
                                            const at::Tensor& hidden_gates,
                                            const at::Tensor& hx, const Optional& input_bias,
                                            const Optional& hidden_bias) {
  check_cell("_thnn_fused_gru_cell", input_gates, hidden_gates, hx, 3);
  const std::vector<at::Tensor> i = input_gates.chunk(3, 1);
  const std::vector<at::Tensor> h = hidden_gates.chunk(3, 1);
  const bool bias = given(input_bias);
  const std::vector<at::Tensor> b1 = bias ? input_bias->chunk(3, 0) : std::vector<at::Tensor>();
  const std::vector<at::Tensor> b2 = bias ? hidden_bias->chunk(3, 0) : std::vector<at::Tensor>();
  auto sum = [&](int k) {
    at::Tensor s = i[k].add(h[k]);
    return bias ? s.add_(b1[k]).add_(b2[k]) : s;
  };
  at::Tensor rg = sum(0).sigmoid_();
  at::Tensor ig = sum(1).sigmoid_();
  const at::Tensor hn = bias ? h[2].add(b2[2]) : h[2];
  at::Tensor in = bias ? i[2].add(b1[2]) : i[2];
  at::Tensor ng = in.add(rg.mul(hn)).tanh_();
  at::Tensor hy = ng.add(ig.mul(hx.sub(ng)));  // ng + ig * (hx - ng)
  return {hy, cat({rg, ig, ng, hx, hn}, 1)};
}

// (grad of the input gates, of the hidden gates, of hx, of each bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  TORCH_CHECK(grad_hy.dim() == 2 && workspace.dim() == 2 &&
                  workspace.size(0) == grad_hy.size(0) &&
                  workspace.size(1) == 5 * grad_hy.size(1),
              "_thnn_fused_gru_cell_backward: the workspace ", workspace.sizes(),
              " does not fit grad_hy ", grad_hy.sizes());
  const std::vector<at::Tensor> w = workspace.chunk(5, 1);
  const at::Tensor& rg = w[0];
  const at::Tensor& ig = w[1];
  const at::Tensor& ng = w[2];
  const at::Tensor& hx = w[3];
  const at::Tensor& hn = w[4];
  const at::Tensor& go = grad_hy;
  at::Tensor gig = go.mul(hx.sub(ng)).mul_(ig.neg().add_(1)).mul_(ig);
  at::Tensor ghx = go.mul(ig);
  at::Tensor gin = go.mul(ig.neg().add_(1)).mul_(ng.mul(ng).neg_().add_(1));
  at::Tensor ghn = gin.mul(rg);
  at::Tensor grg = gin.mul(hn).mul_(rg.neg().add_(1)).mul_(rg);
  at::Tensor grad_input = cat({grg, gig, gin}, 1);
  at::Tensor grad_hidden = cat({grg, gig, ghn}, 1);
  at::Tensor grad_input_bias = has_bias ? grad_input.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden.sum(0) : at::Tensor();
  return {grad_input, grad_hidden, ghx, grad_input_bias, grad_hidden_bias};
}

// The entry points torch calls (boxed: see boxed.h).

void lstm_cell_boxed(const c10::OperatorHandle& op, boxed::Stack* stack) {
  const auto a = boxed::args(op, stack);  // gates (input, hidden), cx, biases?
  auto [hy, cy, workspace] = lstm_cell(a[0].toTensor(), a[1].toTensor(), a[2].toTensor(),
                                       boxed::tensor(a[3]), boxed::tensor(a[4]));
  boxed::done(op, stack, std::move(hy), std::move(cy), std::move(workspace));
}

void lstm_cell_backward_boxed(const c10::OperatorHandle& op, boxed::Stack* stack) {
  const auto a = boxed::args(op, stack);  // grad_hy?, grad_cy?, cx, cy, workspace, has_bias
  auto [grad_gates, grad_cx, grad_bias] =
      lstm_cell_backward(boxed::tensor(a[0]), boxed::tensor(a[1]), a[2].toTensor(),
                         a[3].toTensor(), a[4].toTensor(), a[5].toBool());
  boxed::done(op, stack, std::move(grad_gates), std::move(grad_cx), std::move(grad_bias));
}

void gru_cell_boxed(const c10::OperatorHandle& op, boxed::Stack* stack) {
  const auto a = boxed::args(op, stack);  // gates (input, hidden), hx, biases?
  auto [hy, workspace] = gru_cell(a[0].toTensor(), a[1].toTensor(), a[2].toTensor(),
                                  boxed::tensor(a[3]), boxed::tensor(a[4]));
  boxed::done(op, stack, std::move(hy), std::move(workspace));
}

void gru_cell_backward_boxed(const c10::OperatorHandle& op, boxed::Stack* stack) {
  const auto a = boxed::args(op, stack);  // grad_hy, workspace, has_bias
  auto [grad_input, grad_hidden, grad_hx, grad_input_bias, grad_hidden_bias] =
      gru_cell_backward(a[0].toTensor(), a[1].toTensor(), a[2].toBool());
  boxed::done(op, stack, std::move(grad_input), std::move(grad_hidden), std::move(grad_hx),
              std::move(grad_input_bias), std::move(grad_hidden_bias));
}

}  // namespace

void register_recurrent_cells(torch::Library& aten) {
  aten.impl("_thnn_fused_lstm_cell", boxed::entry<&lstm_cell_boxed>());
  aten.impl("_thnn_fused_lstm_cell_backward_impl", boxed::entry<&lstm_cell_backward_boxed>());
  aten.impl("_thnn_fused_gru_cell", boxed::entry<&gru_cell_boxed>());
  aten.impl("_thnn_fused_gru_cell_backward", boxed::entry<&gru_cell_backward_boxed>());
}

}  // namespace anydevice_sim
