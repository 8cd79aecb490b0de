// AuraKernel's stand-in for the aclrtlaunch_<kernel>.h headers ascendc_library generates (see README.md): the
// launch macro takes the block count, the stream and the kernel's arguments.
#pragma once
#include <cstdint>
template <typename... Args> inline uint32_t ak_aclrt_launch(uint32_t blockDim, void* stream, Args... args);
#define ACLRT_LAUNCH_KERNEL(kernel) ak_aclrt_launch
