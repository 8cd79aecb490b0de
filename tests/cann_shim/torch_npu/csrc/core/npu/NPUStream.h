// AuraKernel's declaration of the torch_npu stream API the rendered <op>_binding.cpp uses (see the shim's README.md).
#pragma once
namespace c10_npu {
struct NPUStream { void* stream(bool needEmptyCheck = true) const; };
NPUStream getCurrentNPUStream();
}  // namespace c10_npu
