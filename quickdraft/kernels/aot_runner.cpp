// quickdraft's AOT package runner: PyTorch's AOTIModelPackageLoader behind a TorchScript class
// whose calls from Python release the GIL.
//
// PyTorch's own Python binding of the loader (torch._C._aoti.AOTIModelPackageLoader, which
// torch._inductor.aoti_load_package returns) holds the GIL for the whole call: an AOT step of
// 50-700 ms stops every other Python thread of the process for that long, and in `quickdraft
// serve` the event loop that streams tokens to clients is such a thread. Calls into a
// TorchScript class's methods release the GIL while the C++ runs (measured: a 1 ms ticker
// thread's longest gap during 50 ms calls was 1.3 ms), as eager PyTorch ops do.
//
// Built as its own small library (aot_runner.so), apart from the kernels: the loader's C++ API
// changes between PyTorch releases, so where this file does not compile, the AOT steps run
// through PyTorch's binding (holding the GIL) and the kernels are unaffected.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct AotPackage : torch::CustomClassHolder {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;

  explicit AotPackage(const std::string& path)
      : loader(std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, "model")) {}

  // The package's flat inputs in its traced order; its flat outputs. (The loader takes the
  // list's tensors: the caller's list is copied into this call's own vector.)
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs) { return loader->boxed_run(std::move(inputs)); }

  std::vector<std::string> call_spec() { return loader->get_call_spec(); }

  std::vector<std::string> constant_fqns() { return loader->get_constant_fqns(); }

  // Hand the package tensors it reads as constants (the model's weights, not copied with
  // user_managed: they must outlive the package).
  void load_constants(c10::Dict<std::string, at::Tensor> constants, bool check_full_update, bool user_managed) {
    std::unordered_map<std::string, at::Tensor> map;
    for (const auto& item : constants) map.emplace(item.key(), item.value());
    loader->load_constants(map, /*use_inactive=*/false, check_full_update, user_managed);
  }
};

}  // namespace

TORCH_LIBRARY(quickdraft_aot, m) {
  m.class_<AotPackage>("AotPackage")
      .def(torch::init<std::string>())
      .def("run", &AotPackage::run)
      .def("call_spec", &AotPackage::call_spec)
      .def("constant_fqns", &AotPackage::constant_fqns)
      .def("load_constants", &AotPackage::load_constants);
}
