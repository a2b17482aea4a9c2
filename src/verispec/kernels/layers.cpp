// A stack of decoder layers in one call: norms, projections, rotary embedding, KV-cache writes,
// attention, MLP and residuals, for the few-row passes of decoding, drafting and verification.
//
// Why: a small model's decode step is dominated by per-operation overhead, not arithmetic (SmolLM2-135M:
// 30 layers x ~25 torch/Python operations per token). Here the Python interpreter is entered once per
// pass instead of once per operation, and the work between the compiled kernels (rotary, cache writes,
// residuals) happens in plain loops. Every step is the same arithmetic as the Python path in
// models/transformer.py, operation for operation (the same kernels, the same fp32 multiplies and adds
// in the same order, no fused multiply-adds), so both paths give the same bits and a row's result still
// does not depend on how many rows share the pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <string>
#include <vector>

torch::Tensor causal_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start);
torch::Tensor prompt_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start);
bool prompt_attention_supported(int64_t head_dim);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor groups, c10::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias, std::string path);
torch::Tensor int8_gate_up_silu(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor wsum,
                                std::string path);

namespace {

constexpr int64_t kBf16Rows = 16;  // kernels.MAX_ROWS: the compiled bf16 path's row limit
constexpr int64_t kInvariantRows = 65;  // kernels.INVARIANT_ROWS: longer passes are prompts

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// One matrix product, as kernels.linear / Int8Linear.forward compute it.
struct Projection {
  // int8: scale and sums; packed int4 (uint8 weights): scale holds the groups; bias may be undefined
  torch::Tensor weight, scale, sums, bias;

  // ``widen``: a prompt's bf16 product in fp32 on weights widened for the call (kernels.prompt_linear).
  torch::Tensor operator()(const torch::Tensor& x, const std::string& path, bool widen) const {
    if (weight.scalar_type() == torch::kInt8) return int8_linear(x, weight, scale, sums, maybe(bias), path);
    if (weight.scalar_type() == torch::kUInt8) return int4_linear(x, weight, scale, maybe(bias));  // a draft's
    const int64_t rows = x.numel() / x.size(-1);
    if (weight.scalar_type() == torch::kBFloat16 && rows <= kBf16Rows && x.size(-1) % 8 == 0 &&
        weight.is_contiguous()) {
      auto out = bf16_linear(x, weight);
      return bias.defined() ? out + bias : out;
    }
    if (x.scalar_type() == weight.scalar_type() && (!bias.defined() || bias.scalar_type() == weight.scalar_type()))
      return at::linear(x, weight, maybe(bias));
    auto out = widen && weight.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kFloat32
                   ? at::linear(x, weight.to(torch::kFloat32))
                   : at::linear(x.to(weight.scalar_type()), weight).to(x.scalar_type());
    return bias.defined() ? out + bias : out;
  }

  // silu(gate) * up of this [gate | up] product, as kernels.gate_up_silu computes it.
  torch::Tensor silu_of(const torch::Tensor& x, const std::string& path, bool widen) const {
    if (weight.scalar_type() == torch::kInt8 && !bias.defined()) return int8_gate_up_silu(x, weight, scale, sums, path);
    return silu_mul((*this)(x, path, widen));
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  Projection qkv, o, gate_up, down;
};

Projection projection(const std::vector<torch::Tensor>& t, size_t at) {
  auto opt = [&](size_t i) { return t[i].numel() > 0 ? t[i] : torch::Tensor(); };
  return Projection{t[at], opt(at + 1), opt(at + 2), opt(at + 3)};
}

}  // namespace

class LayerStack {
 public:
  // ``layers``: per layer [attn_norm, qkv (weight, scale, sums, bias), o (4), mlp_norm, gate_up (4), down (4)],
  // an empty tensor where a layer has no such part (a float weight's scale and sums, a missing bias).
  LayerStack(std::vector<std::vector<torch::Tensor>> layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
             double eps, double scale)
      : H_(heads), KV_(kv_heads), D_(head_dim), eps_(eps), scale_(static_cast<float>(scale)) {
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 18, "a layer is 18 tensors");
      layers_.push_back(Layer{t[0], t[9], projection(t, 1), projection(t, 5), projection(t, 10), projection(t, 14)});
    }
  }

  // hidden [1, T, hidden] fp32 at positions [start, start + T); ``index``/``parts`` name the layers to run
  // and which sub-blocks (bit 0 attention, bit 1 MLP); keys/values: the cache [layers, KV, capacity, D];
  // cos/signed_sin [T, D]; a prompt's MLP runs ``mlp_rows`` rows at a time (transformer.MLP_ROWS). ``widen``
  // (kernels.bf16_prompt_path() == "fp32"): bf16 products of more rows than the few-row kernel takes run in
  // fp32 on widened weights, as kernels.linear runs them.
  // Returns new hidden states (the input is not modified).
  torch::Tensor run(torch::Tensor hidden, std::vector<int64_t> index, std::vector<int64_t> parts, torch::Tensor keys,
                    torch::Tensor values, int64_t start, torch::Tensor cos, torch::Tensor signed_sin,
                    std::string path, int64_t mlp_rows, bool widen) const {
    TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.dim() == 3 && hidden.size(0) == 1, "hidden: [1, T, D]");
    TORCH_CHECK(index.size() == parts.size(), "one parts entry per layer");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == torch::kFloat32 &&
                values.scalar_type() == torch::kFloat32 && keys.size(1) == KV_ && keys.size(3) == D_,
                "cache: contiguous fp32 [layers, KV, capacity, D]");
    const int64_t T = hidden.size(1), width = hidden.size(2), capacity = keys.size(2);
    TORCH_CHECK(start + T <= capacity, "the cache has no room for these positions");
    auto c = cos.contiguous(), s = signed_sin.contiguous();
    TORCH_CHECK(c.size(0) == T && c.size(1) == D_ && s.sizes() == c.sizes(), "rotary tables: [T, D]");
    auto h = hidden.reshape({T, width}).clone();
    for (size_t n = 0; n < index.size(); ++n) {
      const int64_t i = index[n];
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()), "layer index out of range");
      const Layer& L = layers_[i];
      if (parts[n] & 1) h.add_(attention(L, h, keys[i], values[i], start, c, s, path, widen));
      if (parts[n] & 2)
        for (int64_t b = 0; b < T; b += mlp_rows) {  // each row's MLP is its own: chunks give the same bits
          auto part = h.narrow(0, b, std::min(mlp_rows, T - b));
          part.add_(L.down(L.gate_up.silu_of(rms_norm(part, L.mlp_norm, eps_), path, widen), path, widen));
        }
    }
    return h.view({1, T, width});
  }

 private:
  // DecoderLayer.attention: qkv, then queries and keys rotated (x*cos + roll(x, D/2)*signed_sin), keys and
  // values written to the cache, queries scaled, row-by-row attention, output projection.
  torch::Tensor attention(const Layer& L, const torch::Tensor& h, torch::Tensor keys, torch::Tensor values,
                          int64_t start, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                          const std::string& path, bool widen) const {
    const int64_t T = h.size(0), H = H_, KV = KV_, D = D_, half = D / 2, capacity = keys.size(1);
    auto qkv = L.qkv(rms_norm(h, L.attn_norm, eps_), path, widen).contiguous();  // [T, (H + 2 KV) * D]
    TORCH_CHECK(qkv.size(1) == (H + 2 * KV) * D, "qkv width");
    auto q = torch::empty({H, T, D}, h.options());
    const float* src = qkv.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = signed_sin.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* kp = keys.data_ptr<float>();
    float* vp = values.data_ptr<float>();
    const float scale = scale_;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = src + t * (H + 2 * KV) * D;
      const float* ct = cp + t * D;
      const float* st = sp + t * D;
      for (int64_t head = 0; head < H + KV; ++head) {
        const float* x = row + head * D;
        float* dst = head < H ? qp + (head * T + t) * D : kp + ((head - H) * capacity + start + t) * D;
        const float factor = head < H ? scale : 1.f;  // r * 1 == r: keys are stored unscaled
        for (int64_t d = 0; d < half; ++d) dst[d] = (x[d] * ct[d] + x[d + half] * st[d]) * factor;
        for (int64_t d = half; d < D; ++d) dst[d] = (x[d] * ct[d] + x[d - half] * st[d]) * factor;
      }
      for (int64_t g = 0; g < KV; ++g) {
        const float* x = row + (H + KV + g) * D;
        std::copy(x, x + D, vp + (g * capacity + start + t) * D);
      }
    }
    });
    if (T <= kInvariantRows) return L.o(causal_attention(q, keys, values, start), path, widen);  // [T, H * D]
    // A prompt: on AMX bf16 tiles where the CPU has them, else torch's fused attention, as
    // kernels.causal_attention computes it.
    if (prompt_attention_supported(D))
      return L.o(prompt_attention(q, keys.narrow(1, 0, start + T), values.narrow(1, 0, start + T), start), path, widen);
    auto k = keys.narrow(1, 0, start + T).unsqueeze(0), v = values.narrow(1, 0, start + T).unsqueeze(0);
    c10::optional<torch::Tensor> mask;
    if (start > 0) mask = torch::ones({T, start + T}, h.options().dtype(torch::kBool)).tril(start);
    auto out = at::scaled_dot_product_attention(q.unsqueeze(0), k, v, mask, 0.0, start == 0, 1.0, KV != H);
    return L.o(out[0].transpose(0, 1).reshape({T, H * D}), path, widen);
  }

  std::vector<Layer> layers_;
  int64_t H_, KV_, D_;
  double eps_;
  float scale_;
};

void register_layer_stack(pybind11::module& m) {
  pybind11::class_<LayerStack>(m, "LayerStack")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, int64_t, int64_t, int64_t, double, double>())
      .def("run", &LayerStack::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
