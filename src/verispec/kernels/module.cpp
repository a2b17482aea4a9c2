// The Python module: every compiled kernel of verispec, one extension.
#include <torch/extension.h>

torch::Tensor causal_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start);
torch::Tensor prompt_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start);
bool prompt_attention_supported(int64_t head_dim);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> quantize_rows(torch::Tensor x);
std::vector<torch::Tensor> quantize_rows_with(torch::Tensor x, int64_t lanes);
std::vector<std::string> int8_paths();
torch::Tensor int8_accumulate(torch::Tensor q, torch::Tensor w, torch::Tensor wsum, std::string path);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias, std::string path);
torch::Tensor int8_gate_up_silu(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor wsum,
                                std::string path);
bool silu_on_tiles(const torch::Tensor& x, const torch::Tensor& w, int64_t out, const std::string& path);
std::vector<std::string> int4_paths();
void set_int4_path(const std::string& path);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor groups, c10::optional<torch::Tensor> bias);
void register_layer_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_attention", &causal_attention, "row-by-row causal attention over the KV cache");
  m.def("prompt_attention", &prompt_attention, "causal attention of a prompt on AMX bf16 tiles (bf16x3)");
  m.def("prompt_attention_supported", &prompt_attention_supported, "whether prompt_attention runs here");
  m.def("bf16_linear", &bf16_linear, "bf16-weight linear for few rows");
  m.def("rms_norm", &rms_norm, "fp32 RMSNorm");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("quantize_rows", &quantize_rows, "per-row symmetric int8 quantization: (q, scale)");
  m.def("quantize_rows_with", &quantize_rows_with, "quantize_rows on 8 (AVX2) or 16 (AVX-512 where present) lanes");
  m.def("int8_paths", &int8_paths, "the int8 accumulation paths this CPU can run");
  m.def("int8_accumulate", &int8_accumulate, "int32 accumulators of int8 rows against int8 weights");
  m.def("int8_linear", &int8_linear, "int8-weight, int8-activation linear with fp32 rescale");
  m.def("int8_gate_up_silu", &int8_gate_up_silu, "silu(gate) * up of a fused int8 [gate | up] projection");
  m.def("int8_silu_on_tiles", &silu_on_tiles, "whether int8_gate_up_silu applies the silu on AMX tiles");
  m.def("int4_paths", &int4_paths, "the int4 draft paths this CPU can run");
  m.def("set_int4_path", &set_int4_path, "the path every later int4_linear call takes");
  m.def("int4_linear", &int4_linear, "a draft's int4-weight (groups of 32), int8-activation linear");
  register_layer_stack(m);  // LayerStack: a pass through decoder layers in one call
}
