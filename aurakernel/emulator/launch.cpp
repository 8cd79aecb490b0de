// The one part of an emulator build that names its kernel: the entry and the launch's shape, from
// the build's defines (typed values only, see build()). Kept apart so that the large parts compile
// once: runner.cpp per hardware profile, a kernel's source for all its entries.
#include <cstdint>

extern "C" void AK_KERNEL(AK_PARAMS);

namespace ak {
extern const bool batch_mode = AK_BATCH_MODE;   // the tiling's SetScheduleMode(1), which SyncAll needs
namespace launch {
extern const int aic_per_block = AK_AIC_PER_BLOCK, aiv_per_block = AK_AIV_PER_BLOCK;
extern const uint64_t l2_args = AK_L2_ARGS, l2_vector_reads = AK_L2_VECTOR_READS;
void entry(uint8_t** gm) { AK_KERNEL(AK_ARGS); }
}  // namespace launch
}  // namespace ak
