// AuraKernel's declaration of the CANN platform query the rendered <op>_host.cpp uses (see ../../README.md).
#pragma once
#include <cstddef>
#include <cstdint>
namespace platform_ascendc {
class PlatformAscendC {
 public:
    explicit PlatformAscendC(void* platformInfo);
    uint32_t GetCoreNumAic() const;
    uint32_t GetCoreNumAiv() const;
    size_t GetLibApiWorkSpaceSize() const;
};
}  // namespace platform_ascendc
