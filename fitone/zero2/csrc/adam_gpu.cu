// fitone's exact fp32 AdamW on the GPU: the bits of csrc/adam32.cpp's vector loop (or of its plain arithmetic, where
// PyTorch's CPU capability has no FMAs), for a share of the pipelined update's chunks (fitone.zero2.gpu_adam).
// Every operation is an IEEE round-to-nearest intrinsic (no contraction, no flushed denormals, whatever the flags),
// every FMA an explicit __fmaf_rn where adam32.cpp has std::fma, so an element gets the CPU's bits.
// The constants come from fitone.zero2.gpu_adam.constants, adam32.cpp's expressions. tests/gpu holds the bits.

#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

enum Decay { NO_DECAY = 0, ADAMW_DECAY = 1, ADAM_DECAY = 2 };

struct Hyper {
    float scale, decay, wd, coeff, beta2, c2, bc2_sqrt, eps, neg_step_size;
    bool small;
};

__device__ __forceinline__ float widen(uint16_t h, bool bf16)
{
    if (bf16) return __uint_as_float(uint32_t(h) << 16);
    return __half2float(__ushort_as_half(h));  // exact: every fp16 number is an fp32 one
}

__device__ __forceinline__ float fmadd(bool fused, float a, float b, float c)
{
    return fused ? __fmaf_rn(a, b, c) : __fadd_rn(__fmul_rn(a, b), c);
}

template <bool BF16, bool SCALE, int DECAY, bool FUSED>
__global__ void adamw_kernel(float* __restrict__ P, float* __restrict__ M, float* __restrict__ V,
                             const uint16_t* __restrict__ G, int64_t n, Hyper h)
{
    const int64_t stride = int64_t(blockDim.x) * gridDim.x;
    for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride) {
        float g = widen(G[k], BF16);
        if (SCALE) g = __fdiv_rn(g, h.scale);
        float p = P[k];
        if (DECAY == ADAMW_DECAY) p = __fmul_rn(p, h.decay);
        if (DECAY == ADAM_DECAY) g = fmadd(FUSED, p, h.wd, g);
        const float m0 = M[k];
        const float m = fmadd(FUSED, h.coeff, __fsub_rn(g, m0), h.small ? m0 : g);  // exp_avg.lerp_(grad, 1 - beta1)
        const float cg = __fmul_rn(h.c2, g);
        const float vb = __fmul_rn(V[k], h.beta2);
        const float v = FUSED ? __fmaf_rn(cg, g, vb) : __fadd_rn(vb, __fmul_rn(cg, g));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), h.bc2_sqrt), h.eps);
        P[k] = __fadd_rn(p, __fdiv_rn(__fmul_rn(h.neg_step_size, m), denom));
        M[k] = m;
        V[k] = v;
    }
}

template <bool BF16, bool SCALE, int DECAY>
void launch_fused(bool fused, float* P, float* M, float* V, const uint16_t* G, int64_t n, const Hyper& h,
                  int blocks, cudaStream_t stream)
{
    if (fused) adamw_kernel<BF16, SCALE, DECAY, true><<<blocks, 256, 0, stream>>>(P, M, V, G, n, h);
    else adamw_kernel<BF16, SCALE, DECAY, false><<<blocks, 256, 0, stream>>>(P, M, V, G, n, h);
}

template <bool BF16, bool SCALE>
void launch_decay(int decay, bool fused, float* P, float* M, float* V, const uint16_t* G, int64_t n,
                  const Hyper& h, int blocks, cudaStream_t stream)
{
    if (decay == ADAMW_DECAY) return launch_fused<BF16, SCALE, ADAMW_DECAY>(fused, P, M, V, G, n, h, blocks, stream);
    if (decay == ADAM_DECAY) return launch_fused<BF16, SCALE, ADAM_DECAY>(fused, P, M, V, G, n, h, blocks, stream);
    launch_fused<BF16, SCALE, NO_DECAY>(fused, P, M, V, G, n, h, blocks, stream);
}

// `constants`: scale, decay, wd, coeff, beta2, c2, bc2_sqrt, eps, neg_step_size, small (fp32 values, as doubles)
void step_op(torch::Tensor master, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
             std::vector<double> constants, bool has_scale, int64_t decay, bool fused)
{
    const int64_t n = master.numel();
    for (const auto* t : {&master, &exp_avg, &exp_avg_sq}) {
        TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->is_cuda() && t->numel() == n,
                    "the GPU AdamW holds contiguous fp32 CUDA master weights and moments of one length");
    }
    TORCH_CHECK(grad.numel() == n && grad.is_contiguous() && grad.is_cuda() &&
                (grad.scalar_type() == torch::kBFloat16 || grad.scalar_type() == torch::kHalf),
                "the GPU AdamW reads a contiguous bf16 or fp16 CUDA gradient of the master's length");
    TORCH_CHECK(constants.size() == 10, "ten constants");
    if (n == 0) return;
    const c10::cuda::CUDAGuard guard(master.device());
    Hyper h{float(constants[0]), float(constants[1]), float(constants[2]), float(constants[3]),
            float(constants[4]), float(constants[5]), float(constants[6]), float(constants[7]),
            float(constants[8]), constants[9] != 0.0};
    const int blocks = int(std::min<int64_t>((n + 255) / 256, 65535));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    auto* P = master.data_ptr<float>();
    auto* M = exp_avg.data_ptr<float>();
    auto* V = exp_avg_sq.data_ptr<float>();
    auto* G = reinterpret_cast<const uint16_t*>(grad.data_ptr());
    const bool bf16 = grad.scalar_type() == torch::kBFloat16;
    if (bf16 && has_scale) launch_decay<true, true>(int(decay), fused, P, M, V, G, n, h, blocks, stream);
    else if (bf16) launch_decay<true, false>(int(decay), fused, P, M, V, G, n, h, blocks, stream);
    else if (has_scale) launch_decay<false, true>(int(decay), fused, P, M, V, G, n, h, blocks, stream);
    else launch_decay<false, false>(int(decay), fused, P, M, V, G, n, h, blocks, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("adamw", &step_op, "adam32.cpp's fp32 AdamW bits on CUDA tensors, on the current stream");
}
