// fitone's exact fp32 AdamW read straight from the gradient as it is (bf16, fp16 or fp32): what PyTorch's fused CPU
// Adam (`torch._fused_adamw_` / `_fused_adam_`, aten/src/ATen/native/cpu/FusedAdamKernel.cpp) computes on that
// gradient widened to fp32, bit for bit, without the widened copy and without writing the unscaled gradient back.
//
// PyTorch's bits depend on its dispatch capability (torch.backends.cpu.get_cpu_capability()), because its compiler
// contracted some multiply-adds into FMAs in its AVX2 and AVX512 builds and none in its DEFAULT build, and not the
// same ones in its vector loop and its scalar tail (the last numel % lanes elements of a call). So the arithmetic
// is chosen at call time (`Arith`), per region, by fitone/zero2/adam32.py; this file is built with
// -ffp-contract=off, so that every FMA here is an explicit std::fma and every other operation rounds once.
// tests/zero2/test_adam32.py holds each capability's choice to PyTorch's kernel.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 4096;  // elements per parallel task's inner loop

inline float widen(uint16_t h)  // bf16: the top half of an fp32 pattern
{
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float widen(_Float16 h) { return static_cast<float>(h); }  // exact, as every fp16 number is an fp32 one
inline float widen(float f) { return f; }

// GCC has no vector type for _Float16 without AVX512-FP16, so a loop that reads fp16 runs element by element:
// fp16 is widened a block at a time into an L1 buffer by F16C's conversion (exact), then the fp32 loop runs on it
inline void widen_block(const _Float16* __restrict__ src, float* __restrict__ dst, int64_t n)
{
    int64_t k = 0;
#if defined(__F16C__)
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
#endif
    for (; k < n; ++k) dst[k] = static_cast<float>(src[k]);
}

// The new master's 16-bit cast, a block at a time while it is in cache (the pipelined update uploads that instead of
// the fp32 master: half the link's bytes). Round to nearest even, as master.to(dtype) rounds: F16C's conversion and
// c10::BFloat16's (NaN to its quiet 0x7fc0)
enum Out { NO_OUT, OUT_HALF, OUT_BF16 };

inline uint16_t narrow_bf16(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return 0x7fc0;
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void narrow_block(const float* __restrict__ src, void* dst, Out kind, int64_t n)
{
    if (kind == OUT_BF16) {
        auto* d = static_cast<uint16_t*>(dst);
        for (int64_t k = 0; k < n; ++k) d[k] = narrow_bf16(src[k]);
        return;
    }
    auto* d = static_cast<_Float16*>(dst);
    int64_t k = 0;
#if defined(__F16C__)
    for (; k + 8 <= n; k += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; k < n; ++k) d[k] = static_cast<_Float16>(src[k]);
}

struct Cast {
    void* out;  // the 16-bit copy of the master's elements, indexed as the master; nullptr: none
    Out kind;
    void at(const float* P, int64_t lo, int64_t hi) const
    {
        if (out) narrow_block(P + lo, static_cast<char*>(out) + 2 * lo, kind, hi - lo);
    }
};

// PLAIN: no FMA (DEFAULT). VECTOR: PyTorch's vector loop on AVX2/AVX512, exp_avg_sq = fma(c2 * g, g, v * beta2).
// SCALAR: its scalar tail there, exp_avg_sq = fma(v, beta2, c2 * g * g). Both fused ones: the lerp and Adam's
// (not W's) weight decay as one FMA each.
enum Arith { PLAIN, VECTOR, SCALAR };
enum Decay { NO_DECAY, ADAMW_DECAY, ADAM_DECAY };

struct Hyper {
    float scale, decay, wd;   // g / scale; AdamW: p * decay; Adam: g + p * wd
    float coeff;              // the lerp's: 1 - beta1, or (1 - beta1) - 1 where that is at least 0.5
    bool small;               // |1 - beta1| < 0.5: the lerp's base is exp_avg, else the gradient
    float beta2, c2, bc2_sqrt, eps, neg_step_size;
};

inline float fmadd(bool fused, float a, float b, float c) { return fused ? std::fma(a, b, c) : a * b + c; }

template <typename grad_t, bool SCALE, Decay DECAY, Arith A>
void block(float* __restrict__ P, float* __restrict__ M, float* __restrict__ V, const grad_t* __restrict__ G,
           int64_t lo, int64_t hi, const Hyper& h)
{
    constexpr bool FUSED = A != PLAIN;
    const float scale = h.scale, decay = h.decay, wd = h.wd, coeff = h.coeff, beta2 = h.beta2, c2 = h.c2;
    const float bc2 = h.bc2_sqrt, eps = h.eps, nss = h.neg_step_size;
    const bool small = h.small;
    for (int64_t k = lo; k < hi; ++k) {
        float g = widen(G[k]);
        if (SCALE) g = g / scale;
        float p = P[k];
        if (DECAY == ADAMW_DECAY) p = p * decay;
        if (DECAY == ADAM_DECAY) g = fmadd(FUSED, p, wd, g);
        const float m0 = M[k];
        const float m = fmadd(FUSED, coeff, g - m0, small ? m0 : g);  // exp_avg.lerp_(grad, 1 - beta1)
        const float cg = c2 * g;
        float v;
        if (A == VECTOR) v = std::fma(cg, g, V[k] * beta2);
        else if (A == SCALAR) v = std::fma(V[k], beta2, cg * g);
        else v = V[k] * beta2 + cg * g;
        const float denom = std::sqrt(v) / bc2 + eps;
        P[k] = p + nss * m / denom;
        M[k] = m;
        V[k] = v;
    }
}

// The inverse of one step (fitone.zero2.speculative's undo_adamw's arithmetic): the old master and moments back from
// the new ones and the same gradient at scale 1 / `u.inv_scale`, to a few fp32 roundings. Not bit for bit with
// anything, so no FMA choice, and every constant division but the denominator's is a multiply by its reciprocal
// (a division costs several multiplies; bench/results/2026-12-06b-cpu/).
// The speculation's tests bound it.
struct Undo {
    float inv_scale, inv_decay, wd, inv_beta1, one_minus_beta1, inv_beta2, c2, inv_bc2_sqrt, eps, step_size;
};

template <typename grad_t, Decay DECAY>
void undo_block(float* __restrict__ P, float* __restrict__ M, float* __restrict__ V, const grad_t* __restrict__ G,
                int64_t lo, int64_t hi, const Undo& u)
{
    for (int64_t k = lo; k < hi; ++k) {
        const float g0 = widen(G[k]) * u.inv_scale;
        const float m = M[k], v = V[k];
        float p = P[k] + u.step_size * m / (std::sqrt(v) * u.inv_bc2_sqrt + u.eps);  // before the moments: it read these
        if (DECAY == ADAMW_DECAY) p = p * u.inv_decay;
        const float g = DECAY == ADAM_DECAY ? g0 + p * u.wd : g0;  // Adam's L2 term on the old weights
        P[k] = p;
        M[k] = (m - u.one_minus_beta1 * g) * u.inv_beta1;
        V[k] = std::max((v - u.c2 * g * g) * u.inv_beta2, 0.0f);
    }
}

// block() over [lo, hi), through the L1 buffer where the gradient is fp16; with `undo`, each block is first taken
// back one step (from the same gradient at the undo's scale) while it is in cache: a redo costs one pass, not two
template <typename grad_t, bool SCALE, Decay DECAY, Arith A>
void span(float* P, float* M, float* V, const grad_t* G, int64_t lo, int64_t hi, const Hyper& h, const Undo* undo,
          const Cast& cast)
{
    if constexpr (std::is_same_v<grad_t, _Float16>) {
        alignas(64) float buf[BLOCK];
        for (int64_t a = lo; a < hi; a += BLOCK) {
            const int64_t n = std::min(hi, a + BLOCK) - a;
            widen_block(G + a, buf, n);
            if (undo) undo_block<float, DECAY>(P + a, M + a, V + a, buf, 0, n, *undo);
            block<float, SCALE, DECAY, A>(P + a, M + a, V + a, buf, 0, n, h);
            cast.at(P, a, a + n);
        }
    } else {
        for (int64_t a = lo; a < hi; a += BLOCK) {
            const int64_t b = std::min(hi, a + BLOCK);
            if (undo) undo_block<grad_t, DECAY>(P, M, V, G, a, b, *undo);
            block<grad_t, SCALE, DECAY, A>(P, M, V, G, a, b, h);
            cast.at(P, a, b);
        }
    }
}

template <typename grad_t, bool SCALE, Decay DECAY>
void regions(float* P, float* M, float* V, const grad_t* G, int64_t n, const Hyper& h, Arith body, int64_t lanes,
             int64_t tail_vector, const Undo* undo, const Cast& cast)
{
    // PyTorch's vector loop covers whole vectors of the call's elements; its scalar tail the rest, of which its
    // compiler vectorized whole runs of `tail_vector` (AVX512: one 8-lane epilogue) with the vector loop's arithmetic
    const int64_t body_end = n - n % lanes;
    const int64_t vector_end = tail_vector > 0 ? body_end + (n - body_end) / tail_vector * tail_vector : body_end;
    at::parallel_for(0, (body_end + BLOCK - 1) / BLOCK, 16, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b) {
            const int64_t lo = b * BLOCK, hi = std::min(body_end, lo + BLOCK);
            if (body == PLAIN) span<grad_t, SCALE, DECAY, PLAIN>(P, M, V, G, lo, hi, h, undo, cast);
            else span<grad_t, SCALE, DECAY, VECTOR>(P, M, V, G, lo, hi, h, undo, cast);
        }
    });
    if (body == PLAIN) return span<grad_t, SCALE, DECAY, PLAIN>(P, M, V, G, body_end, n, h, undo, cast);
    span<grad_t, SCALE, DECAY, VECTOR>(P, M, V, G, body_end, vector_end, h, undo, cast);
    span<grad_t, SCALE, DECAY, SCALAR>(P, M, V, G, vector_end, n, h, undo, cast);
}

template <typename grad_t>
void dispatch(float* P, float* M, float* V, const grad_t* G, int64_t n, const Hyper& h, bool scale, Decay decay,
              Arith body, int64_t lanes, int64_t tail_vector, const Undo* u, const Cast& c)
{
    if (scale) {
        if (decay == ADAMW_DECAY) return regions<grad_t, true, ADAMW_DECAY>(P, M, V, G, n, h, body, lanes, tail_vector, u, c);
        if (decay == ADAM_DECAY) return regions<grad_t, true, ADAM_DECAY>(P, M, V, G, n, h, body, lanes, tail_vector, u, c);
        return regions<grad_t, true, NO_DECAY>(P, M, V, G, n, h, body, lanes, tail_vector, u, c);
    }
    if (decay == ADAMW_DECAY) return regions<grad_t, false, ADAMW_DECAY>(P, M, V, G, n, h, body, lanes, tail_vector, u, c);
    if (decay == ADAM_DECAY) return regions<grad_t, false, ADAM_DECAY>(P, M, V, G, n, h, body, lanes, tail_vector, u, c);
    regions<grad_t, false, NO_DECAY>(P, M, V, G, n, h, body, lanes, tail_vector, u, c);
}

// lr, betas, eps, weight_decay, step and scale as PyTorch's kernel takes them (doubles; its step a float, its
// grad_scale an fp32 tensor), turned into fp32 constants by its expressions. `undo_scale` > 0: first take the
// states back the step they took at that scale (same step, hyperparameters and gradient), block by block
void step_op(torch::Tensor master, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad, double lr,
             double beta1, double beta2, double weight_decay, double eps, double step, bool adam_w_mode, double scale,
             bool has_scale, bool fused, int64_t lanes, int64_t tail_vector, double undo_scale, torch::Tensor out16)
{
    const int64_t n = master.numel();
    for (const auto* t : {&master, &exp_avg, &exp_avg_sq}) {
        TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->device().is_cpu(),
                    "the exact fp32 AdamW holds contiguous fp32 CPU master weights and moments");
        TORCH_CHECK(t->numel() == n, "master, moments and gradient differ in length");
    }
    TORCH_CHECK(grad.numel() == n && grad.is_contiguous() && grad.device().is_cpu(),
                "the gradient must be a contiguous CPU tensor of the master's length");
    TORCH_CHECK(lanes > 0, "lanes must be positive");
    Cast cast{nullptr, NO_OUT};
    if (out16.numel() > 0) {  // empty: no cast
        TORCH_CHECK(out16.numel() == n && out16.is_contiguous() && out16.device().is_cpu() &&
                        (out16.scalar_type() == torch::kHalf || out16.scalar_type() == torch::kBFloat16),
                    "the master's 16-bit cast goes to a contiguous fp16 or bf16 CPU tensor of its length");
        cast = {out16.data_ptr(), out16.scalar_type() == torch::kHalf ? OUT_HALF : OUT_BF16};
    }
    const double s = double(float(step));  // PyTorch reads its step tensor as a float
    const double bias_correction1 = 1 - std::pow(beta1, s);
    const double bias_correction2 = 1 - std::pow(beta2, s);
    const float w = float(1 - beta1);
    const bool small = std::abs(w) < 0.5f;
    Hyper h{float(scale), float(1 - lr * weight_decay), float(weight_decay), small ? w : w - 1.0f, small,
            float(beta2), float(1 - beta2), float(std::sqrt(bias_correction2)), float(eps),
            -float(lr / bias_correction1)};
    // undo_adamw's constants (Python doubles, each rounded to fp32 where it meets a tensor), reciprocals in double
    Undo u{float(1 / undo_scale), float(1 / (1 - lr * weight_decay)), float(weight_decay), float(1 / beta1),
           float(1 - beta1), float(1 / beta2), float(1 - beta2),
           float(1 / std::sqrt(1 - std::pow(beta2, double(step)))), float(eps),
           float(lr / (1 - std::pow(beta1, double(step))))};
    const Undo* undo = undo_scale > 0 ? &u : nullptr;
    const Decay how = weight_decay == 0 ? NO_DECAY : adam_w_mode ? ADAMW_DECAY : ADAM_DECAY;
    const Arith body = fused ? VECTOR : PLAIN;
    auto* P = master.data_ptr<float>();
    auto* M = exp_avg.data_ptr<float>();
    auto* V = exp_avg_sq.data_ptr<float>();
    switch (grad.scalar_type()) {
        case torch::kBFloat16:
            dispatch(P, M, V, reinterpret_cast<const uint16_t*>(grad.data_ptr()), n, h, has_scale, how, body, lanes,
                     tail_vector, undo, cast);
            break;
        case torch::kHalf:
            dispatch(P, M, V, reinterpret_cast<const _Float16*>(grad.data_ptr()), n, h, has_scale, how, body, lanes,
                     tail_vector, undo, cast);
            break;
        case torch::kFloat:
            dispatch(P, M, V, grad.data_ptr<float>(), n, h, has_scale, how, body, lanes, tail_vector, undo, cast);
            break;
        default: TORCH_CHECK(false, "the gradient must be bf16, fp16 or fp32, not ", grad.scalar_type());
    }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    // the GIL is released: the pipelined update runs this in its thread beside the main thread's launches
    m.def("adamw", &step_op, "PyTorch's fused CPU AdamW, bit for bit, from a 16-bit or fp32 gradient read as it is; "
          "with undo_scale > 0, after taking the states back the step they took at that scale; a non-empty out16 "
          "gets the new master's 16-bit cast",
          py::call_guard<py::gil_scoped_release>());
}
