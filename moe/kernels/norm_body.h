// RMSNorm over rows, compiled once per instruction set (included by experts_cpu.cpp inside each
// per-ISA namespace): out = weight * round(x / sqrt(mean(x^2) + eps)), the statistics in fp32 and
// round() the cast back to x's dtype, as transformers' LlamaRMSNorm / DeepseekV3RMSNorm compute it
// (for bf16 the product with the weight is rounded once more, like a bf16 multiply).

// x rows at stride ldx, out rows at stride ldo.
template <typename T>
static void rms_norm_rows(const T* x, int64_t ldx, const T* w, T* out, int64_t ldo, int64_t rows, int64_t D,
                          float eps) {
  alignas(64) float lanes[MOE_W];
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * ldx;
    vf a0 = vzero(), a1 = vzero();
    int64_t c = 0;
    for (; c + 2 * MOE_W <= D; c += 2 * MOE_W) {
      const vf v0 = vload(xr + c), v1 = vload(xr + c + MOE_W);
      a0 = vfma(v0, v0, a0);
      a1 = vfma(v1, v1, a1);
    }
    for (; c + MOE_W <= D; c += MOE_W) {
      const vf v0 = vload(xr + c);
      a0 = vfma(v0, v0, a0);
    }
    vstore(lanes, vadd(a0, a1));
    float ss = 0.f;
    for (int i = 0; i < MOE_W; ++i) ss += lanes[i];
    for (; c < D; ++c) {
      const float v = to_float(xr[c]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    T* o = out + r * ldo;
    for (int64_t j = 0; j < D; ++j) {
      T h;
      store_value(&h, to_float(xr[j]) * inv);  // the cast back to x's dtype
      store_value(o + j, to_float(w[j]) * to_float(h));
    }
  }
}

struct NormKernels {
  static void rms_norm(bool bf16, const void* x, int64_t ldx, const void* w, void* out, int64_t ldo, int64_t rows,
                       int64_t D, float eps) {
    if (bf16)
      rms_norm_rows(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out),
                    ldo, rows, D, eps);
    else
      rms_norm_rows(static_cast<const float*>(x), ldx, static_cast<const float*>(w), static_cast<float*>(out), ldo, rows,
                    D, eps);
  }
};
