// DeepSpeed 0.19.8's CPU Adam step (`ds_adam_step`, csrc/adam/cpu_adam_impl.cpp) called with the GIL released.
//
// DeepSpeed binds `adam_update` without releasing the GIL, so while the pipelined update's thread runs it (the
// first applied steps, DeepSpeed's own arithmetic) the main thread cannot launch the next forward's kernels. This
// binding calls the very function in DeepSpeed's loaded library (its registry of optimizers, its bias-correction
// powers, its compiled arithmetic): only the GIL differs. fitone/zero2/cpu_adam.py binds it and falls back.

#include <torch/extension.h>

#include <dlfcn.h>

#include <string>

namespace {

using Step = int (*)(int, size_t, float, float, float, float, float, bool, torch::Tensor&, torch::Tensor&,
                     torch::Tensor&, torch::Tensor&);
// int ds_adam_step(int, size_t, float lr, float beta1, float beta2, float eps, float weight_decay,
//                  bool bias_correction, torch::Tensor& params, grads, exp_avg, exp_avg_sq)
constexpr const char* SYMBOL = "_Z12ds_adam_stepimfffffbRN2at6TensorES1_S1_S1_";
Step step_of_deepspeed = nullptr;

// `library`: the file of DeepSpeed's loaded cpu_adam module; RTLD_NOLOAD finds it and never loads a second copy
bool bind(const std::string& library)
{
    void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) { return false; }
    step_of_deepspeed = reinterpret_cast<Step>(dlsym(handle, SYMBOL));
    return step_of_deepspeed != nullptr;
}

int adam_update(int optimizer_id, size_t step, float lr, float beta1, float beta2, float eps, float weight_decay,
                bool bias_correction, torch::Tensor& params, torch::Tensor& grads, torch::Tensor& exp_avg,
                torch::Tensor& exp_avg_sq)
{
    TORCH_CHECK(step_of_deepspeed != nullptr, "fitone_ds_adam: bind() DeepSpeed's cpu_adam library first");
    return step_of_deepspeed(optimizer_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, params,
                             grads, exp_avg, exp_avg_sq);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("bind", &bind, "resolve DeepSpeed's ds_adam_step in its loaded cpu_adam library");
    m.def("adam_update", &adam_update, "DeepSpeed's adam_update, the GIL released",
          py::call_guard<py::gil_scoped_release>());
}
