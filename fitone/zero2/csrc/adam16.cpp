// fitone's fused AdamW step on 16-bit optimizer states (fitone/zero2/low_precision.py says the arithmetic).
//
// One pass per element: the bf16 master, bf16 moments and the gradient (bf16, fp16 or fp32) are read once,
// stepped in fp32 and written back rounded to bf16: to the nearest, stochastically, or to the nearest with a
// bf16 compensation buffer (Kahan summation: it holds what rounding the weight lost). Every operation is one
// IEEE fp32 operation in the order low_precision.adamw_16bit (the reference) writes it; the build passes
// -ffp-contract=off, so no compiler fuses a multiply and an add into an FMA on one instruction set and not on
// another: the bits depend neither on the SIMD level nor on the thread count (elementwise, no reductions).
//
// Stochastic rounding's bits are the reference's table entries (RandomBits.table), read from its 16-bit copy
// with the first BLOCK entries repeated at the end: entry (global index + offset) mod TABLE_SIZE, and a block
// of consecutive elements reads one contiguous run of it (a load, not a gather: the loop vectorizes).
//
// An fp16 gradient is widened a block at a time into an L1 buffer (`widen_block`, exact) and the block runs the
// fp32 gradient's loop on it: GCC has no vector type for _Float16 without AVX512-FP16, so a loop reading fp16
// itself runs element by element. The same values, so the same bits as reading each element in place.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TABLE_SIZE = (int64_t(1) << 20) + 7;  // low_precision.TABLE_SIZE
constexpr int64_t BLOCK = 4096;                         // elements per inner loop (j wraps at most once)

inline float widen(uint16_t h)
{
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float widen(float f) { return f; }

// fp16 into fp32 (exact, as every fp16 number is an fp32 one), 8 at a time by F16C's conversion where the build
// has it (-march=native), else element by element (the same values)
inline void widen_block(const _Float16* __restrict__ src, float* __restrict__ dst, int64_t n)
{
    int64_t k = 0;
#if defined(__F16C__)
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
#endif
    for (; k < n; ++k) dst[k] = static_cast<float>(src[k]);
}

inline uint32_t pattern(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline bool finite(uint32_t u) { return (u & 0x7FFFFFFFu) < 0x7F800000u; }

// The rounding helpers pick among 32-bit patterns and shift once at the end: GCC then narrows each vector to bf16
// with one shift and one pack. Picking among 16-bit results instead (the first version) made it pack both
// candidates and blend them, and tested "not a NaN" on the integer pattern: 1.25-1.3x the time of the whole step in
// every rounding (one thread, 64K elements in L2; 1.1-1.2x over 16M). The same bits: every fp32 pattern (and, for
// stochastic(), nine values of the bits for each) was checked against the first version's helpers.

// round to the nearest bf16, ties to even (c10::BFloat16's rounding); a NaN stays a NaN, quieted
inline uint16_t nearest(float f)
{
    const uint32_t u = pattern(f);
    const uint32_t x = f != f ? u | 0x00400000u : u + 0x7FFFu + ((u >> 16) & 1u);  // NaN: (u >> 16) | 0x0040
    return uint16_t(x >> 16);
}

// nearest() of a pattern that is no NaN (a finite number)
inline uint16_t nearest_number(uint32_t u) { return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }

// the 16 random bits added below the bf16 part of an fp32 pattern, then truncated (rounded to the nearest bf16 after
// truncating, which leaves it as it is); none for an infinity or NaN. A finite number stays one or becomes an
// infinity; an infinity or NaN is truncated as it is, and stays a NaN (quieted) where its top half still is one
inline uint16_t stochastic(uint32_t u, uint32_t bits)
{
    bits = (u & 0x7FFFFFFFu) >= 0x7F800000u ? 0u : bits;
    const uint32_t quiet = (u & 0x7FFF0000u) > 0x7F800000u ? 0x00400000u : 0u;
    return uint16_t(((u + bits) | quiet) >> 16);
}

struct Hyper {
    float scale;       // the gradient is divided by it (when has_scale)
    float decay;       // AdamW: p * (1 - lr * wd)
    float wd;          // Adam (not W): g + p * wd
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float bc2_sqrt, eps, step_size;
    const uint16_t* bits;  // stochastic rounding's, TABLE_SIZE + BLOCK of them
    int64_t offset;    // the global index of element 0
    int64_t table[3];  // the table offsets of the master, m and v at this step
};

enum Decay { NO_DECAY, ADAMW_DECAY, ADAM_DECAY };
enum Rounding { TO_NEAREST, STOCHASTIC, COMPENSATED };  // COMPENSATED: to the nearest, the error kept in C

// one block of elements [lo, hi), whose gradient G starts at element lo (G[0] is element lo's): the choices are
// template arguments, so the loop has no branch but selects and the compiler vectorizes it
template <typename grad_t, bool SCALE, Decay DECAY, Rounding R>
void block(uint16_t* __restrict__ P, uint16_t* __restrict__ M, uint16_t* __restrict__ V, uint16_t* __restrict__ C,
           const grad_t* __restrict__ G, int64_t lo, int64_t hi, const Hyper& h)
{
    const uint32_t j0 = uint32_t((h.offset + lo + h.table[0]) % TABLE_SIZE);
    const uint32_t j1 = uint32_t((h.offset + lo + h.table[1]) % TABLE_SIZE);
    const uint32_t j2 = uint32_t((h.offset + lo + h.table[2]) % TABLE_SIZE);
    const float scale = h.scale, decay = h.decay, wd = h.wd, beta1 = h.beta1, omb1 = h.one_minus_beta1;
    const float beta2 = h.beta2, omb2 = h.one_minus_beta2, bc2 = h.bc2_sqrt, eps = h.eps, step = h.step_size;
    const int32_t n = int32_t(hi - lo);
    // j < TABLE_SIZE and n <= BLOCK: within the table
    const uint16_t* __restrict__ T0 = R == STOCHASTIC ? h.bits + j0 : nullptr;
    const uint16_t* __restrict__ T1 = R == STOCHASTIC ? h.bits + j1 : nullptr;
    const uint16_t* __restrict__ T2 = R == STOCHASTIC ? h.bits + j2 : nullptr;
    P += lo, M += lo, V += lo;
    if (R == COMPENSATED) C += lo;
    for (int32_t k = 0; k < n; ++k) {
        float g = widen(G[k]);
        if (SCALE) g = g / scale;
        float p = widen(P[k]);
        if (R == COMPENSATED) p = p + widen(C[k]);
        if (DECAY == ADAMW_DECAY) p = p * decay;
        if (DECAY == ADAM_DECAY) g = g + p * wd;
        float m = widen(M[k]) * beta1;
        float gm = g * omb1;
        m = m + gm;
        float v = widen(V[k]) * beta2;
        float gg = g * g;
        gg = gg * omb2;
        v = v + gg;
        float t = std::sqrt(v);
        t = t / bc2;
        t = t + eps;
        float u = m / t;
        u = u * step;
        p = p - u;
        if (R == STOCHASTIC) {
            P[k] = stochastic(pattern(p), T0[k]);
            M[k] = stochastic(pattern(m), T1[k]);
            V[k] = stochastic(pattern(v), T2[k]);
        } else if (R == COMPENSATED) {
            const uint16_t q = nearest(p);
            const float c = p - widen(q);  // exact: what rounding to the nearest lost
            P[k] = q;
            C[k] = finite(pattern(c)) ? nearest_number(pattern(c)) : uint16_t(0);
            M[k] = nearest(m);
            V[k] = nearest(v);
        } else {
            P[k] = nearest(p);
            M[k] = nearest(m);
            V[k] = nearest(v);
        }
    }
}

// block() over [lo, hi) (at most BLOCK elements), through an L1 buffer where the gradient is fp16
template <typename grad_t, bool SCALE, Decay DECAY, Rounding R>
void span(uint16_t* P, uint16_t* M, uint16_t* V, uint16_t* C, const grad_t* G, int64_t lo, int64_t hi,
          const Hyper& h)
{
    if constexpr (std::is_same_v<grad_t, _Float16>) {
        alignas(64) float buf[BLOCK];
        widen_block(G + lo, buf, hi - lo);
        block<float, SCALE, DECAY, R>(P, M, V, C, buf, lo, hi, h);
    } else {
        block<grad_t, SCALE, DECAY, R>(P, M, V, C, G + lo, lo, hi, h);
    }
}

template <typename grad_t, bool SCALE, Decay DECAY, Rounding R>
void run(uint16_t* P, uint16_t* M, uint16_t* V, uint16_t* C, const grad_t* G, int64_t n, const Hyper& h)
{
    // 16 blocks a task at least: a small slice runs on the calling thread
    at::parallel_for(0, (n + BLOCK - 1) / BLOCK, 16, [&](int64_t first, int64_t last) {
        for (int64_t b = first; b < last; ++b)
            span<grad_t, SCALE, DECAY, R>(P, M, V, C, G, b * BLOCK, std::min(n, (b + 1) * BLOCK), h);
    });
}

template <typename grad_t, bool SCALE, Decay DECAY>
void dispatch(uint16_t* P, uint16_t* M, uint16_t* V, uint16_t* C, const grad_t* G, int64_t n, const Hyper& h,
              Rounding r)
{
    if (r == STOCHASTIC) return run<grad_t, SCALE, DECAY, STOCHASTIC>(P, M, V, C, G, n, h);
    if (r == COMPENSATED) return run<grad_t, SCALE, DECAY, COMPENSATED>(P, M, V, C, G, n, h);
    run<grad_t, SCALE, DECAY, TO_NEAREST>(P, M, V, C, G, n, h);
}

template <typename grad_t>
void dispatch(uint16_t* P, uint16_t* M, uint16_t* V, uint16_t* C, const grad_t* G, int64_t n, const Hyper& h,
              bool scale, Decay decay, Rounding r)
{
    if (scale) {
        if (decay == ADAMW_DECAY) return dispatch<grad_t, true, ADAMW_DECAY>(P, M, V, C, G, n, h, r);
        if (decay == ADAM_DECAY) return dispatch<grad_t, true, ADAM_DECAY>(P, M, V, C, G, n, h, r);
        return dispatch<grad_t, true, NO_DECAY>(P, M, V, C, G, n, h, r);
    }
    if (decay == ADAMW_DECAY) return dispatch<grad_t, false, ADAMW_DECAY>(P, M, V, C, G, n, h, r);
    if (decay == ADAM_DECAY) return dispatch<grad_t, false, ADAM_DECAY>(P, M, V, C, G, n, h, r);
    return dispatch<grad_t, false, NO_DECAY>(P, M, V, C, G, n, h, r);
}

void adamw_16bit(torch::Tensor master, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor compensation,
                 torch::Tensor grad,
                 int64_t offset, double scale, bool has_scale, double decay, double wd, bool adamw, bool has_wd,
                 double beta1, double one_minus_beta1, double beta2, double one_minus_beta2, double bc2_sqrt,
                 double eps, double step_size, bool stochastic_rounding, torch::Tensor table, int64_t table0,
                 int64_t table1, int64_t table2)
{
    const int64_t n = master.numel();
    for (const auto* t : {&master, &exp_avg, &exp_avg_sq}) {
        TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                    "the fused 16-bit step holds contiguous bf16 CPU tensors");
        TORCH_CHECK(t->numel() == n, "master, moments and gradient differ in length");
    }
    TORCH_CHECK(grad.numel() == n && grad.is_contiguous() && grad.device().is_cpu(),
                "the gradient must be a contiguous CPU tensor of the master's length");
    Hyper h{float(scale), float(decay), float(wd), float(beta1), float(one_minus_beta1), float(beta2),
            float(one_minus_beta2), float(bc2_sqrt), float(eps), float(step_size), nullptr, offset,
            {table0, table1, table2}};
    if (stochastic_rounding) {
        TORCH_CHECK(table.scalar_type() == torch::kInt16 && table.is_contiguous() &&
                        table.numel() == TABLE_SIZE + BLOCK,
                    "stochastic rounding reads RandomBits.extended (int16, TABLE_SIZE + BLOCK entries)");
        h.bits = reinterpret_cast<const uint16_t*>(table.data_ptr());
    }
    const bool compensated = compensation.numel() > 0;
    TORCH_CHECK(!compensated || !stochastic_rounding, "the compensation goes with rounding to the nearest");
    if (compensated)
        TORCH_CHECK(compensation.scalar_type() == torch::kBFloat16 && compensation.is_contiguous() &&
                        compensation.device().is_cpu() && compensation.numel() == n,
                    "the compensation must be a contiguous bf16 CPU tensor of the master's length");
    const Rounding r = stochastic_rounding ? STOCHASTIC : compensated ? COMPENSATED : TO_NEAREST;
    const Decay how = !has_wd ? NO_DECAY : adamw ? ADAMW_DECAY : ADAM_DECAY;
    auto* P = reinterpret_cast<uint16_t*>(master.data_ptr());
    auto* M = reinterpret_cast<uint16_t*>(exp_avg.data_ptr());
    auto* V = reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr());
    auto* C = compensated ? reinterpret_cast<uint16_t*>(compensation.data_ptr()) : nullptr;
    switch (grad.scalar_type()) {
        case torch::kBFloat16:
            dispatch(P, M, V, C, reinterpret_cast<const uint16_t*>(grad.data_ptr()), n, h, has_scale, how, r);
            break;
        case torch::kHalf:
            dispatch(P, M, V, C, reinterpret_cast<const _Float16*>(grad.data_ptr()), n, h, has_scale, how, r);
            break;
        case torch::kFloat:
            dispatch(P, M, V, C, grad.data_ptr<float>(), n, h, has_scale, how, r);
            break;
        default: TORCH_CHECK(false, "the gradient must be bf16, fp16 or fp32, not ", grad.scalar_type());
    }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    // the GIL is released: the pipelined update runs this in its thread beside the main thread's launches
    m.def("adamw_16bit", &adamw_16bit, "fitone's fused AdamW on bf16 states",
          py::call_guard<py::gil_scoped_release>());
}
