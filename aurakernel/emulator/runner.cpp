// AuraKernel's AscendC emulator runner: runs every block of one kernel entry over GM buffers and
// prints a JSON report (per-block pipe counters, UB allocations, rule errors) on stdout.
//
//   runner <blockDim> <dir> <nargs>      dir/arg<i>.bin holds argument i (inputs, poisoned outputs,
//                                        workspace, tiling); every buffer is written back in place.
//
// Built by aurakernel/emulator/__init__.py with -DAK_KERNEL=<entry> -DAK_PARAMS=<GM_ADDR list>
// -DAK_ARGS=<gm[0], gm[1], ...>: typed values only. Each GM buffer sits in its own mapping that
// ends 32 B-aligned against a PROT_NONE guard page (and starts after one), so an out-of-bounds
// access faults; the SIGSEGV handler names the argument.
#include "kernel_operator.h"

#include <barrier>
#include <csignal>
#include <cstdio>
#include <memory>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>

extern "C" void AK_KERNEL(AK_PARAMS);

namespace {

struct GmBuffer { uint8_t* map = nullptr; size_t map_len = 0; uint8_t* data = nullptr; size_t size = 0; uint8_t* guard_lo = nullptr; uint8_t* guard_hi = nullptr; };
std::vector<GmBuffer> g_bufs;
std::unique_ptr<std::barrier<>> g_barrier;

std::string json_escape(const std::string& s) {
    std::string o;
    for (char c : s) { if (c == '"' || c == '\\') o += '\\'; if (c == '\n') { o += "\\n"; continue; } o += c; }
    return o;
}

void on_segv(int, siginfo_t* info, void*) {
    const uint8_t* a = static_cast<const uint8_t*>(info->si_addr);
    char msg[256];
    int arg = -1; long off = 0;
    for (size_t i = 0; i < g_bufs.size(); ++i) {
        const GmBuffer& b = g_bufs[i];
        if (a >= b.map && a < b.map + b.map_len) { arg = int(i); off = long(a - b.data); break; }
    }
    if (arg >= 0)
        snprintf(msg, sizeof msg, "{\"fatal\": \"GM bounds: access at byte %ld of argument %d (%zu B): a guard page\"}\n", off, arg, g_bufs[arg].size);
    else
        snprintf(msg, sizeof msg, "{\"fatal\": \"segmentation fault outside every GM buffer\"}\n");
    (void)!write(1, msg, strlen(msg));
    _exit(3);
}

GmBuffer map_arg(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", path.c_str()); exit(2); }
    fseek(f, 0, SEEK_END);
    const size_t size = size_t(ftell(f));
    fseek(f, 0, SEEK_SET);
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t body = (size + 31 + page - 1) / page * page;
    GmBuffer b;
    b.map_len = body + 2 * page;
    b.map = static_cast<uint8_t*>(mmap(nullptr, b.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    b.guard_lo = b.map;
    b.guard_hi = b.map + page + body;
    mprotect(b.guard_lo, page, PROT_NONE);
    mprotect(b.guard_hi, page, PROT_NONE);
    b.data = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(b.guard_hi - size) & ~uintptr_t(31));
    b.size = size;
    if (size && fread(b.data, 1, size, f) != size) { fprintf(stderr, "short read %s\n", path.c_str()); exit(2); }
    fclose(f);
    return b;
}

}  // namespace

// The hard SyncAll: every block waits for every other. The hardware needs the kernel declared a mix
// type (vector-only: KERNEL_TYPE_MIX_AIV_1_0 with isAIVOnly; Cube + Vector: MIX_AIC_1_1 / 1_2 without)
// and the launch in batch mode (SetScheduleMode(1)), or cores another stream holds never arrive.
#ifndef AK_BATCH_MODE
#define AK_BATCH_MODE 0
#endif
namespace {
void sync_all(bool aiv_only) {
    const int type = ak::core().kernel_type;
    if (aiv_only && type != KERNEL_TYPE_MIX_AIV_1_0)
        ak::fail("SyncAll", "SyncAll<true> in a kernel not declared KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0)"
                 " (the hard sync of a vector-only kernel needs the mix type; without it the cores hang)");
    if (!aiv_only && type != KERNEL_TYPE_MIX_AIC_1_1 && type != KERNEL_TYPE_MIX_AIC_1_2)
        ak::fail("SyncAll", "SyncAll<false> in a kernel not declared KERNEL_TYPE_MIX_AIC_1_1 or KERNEL_TYPE_MIX_AIC_1_2");
    if (!AK_BATCH_MODE)
        ak::fail("SyncAll", "SyncAll in a kernel launched without batch mode (the tiling's SetScheduleMode(1)):"
                 " blocks another stream holds may never start, and the ones waiting hang");
    g_barrier->arrive_and_wait();
}
}  // namespace
namespace AscendC {
template <> void SyncAll<true>() { sync_all(true); }
template <> void SyncAll<false>() { sync_all(false); }
}

int main(int argc, char** argv) {
    if (argc != 4) { fprintf(stderr, "usage: runner <blockDim> <dir> <nargs>\n"); return 2; }
    const int block_dim = atoi(argv[1]);
    const std::string dir = argv[2];
    const int nargs = atoi(argv[3]);
    for (int i = 0; i < nargs; ++i) g_bufs.push_back(map_arg(dir + "/arg" + std::to_string(i) + ".bin"));
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);

    std::vector<uint8_t*> gm(nargs);
    for (int i = 0; i < nargs; ++i) gm[i] = g_bufs[i].data;
    g_barrier = std::make_unique<std::barrier<>>(block_dim);
    std::vector<std::unique_ptr<ak::Core>> cores(block_dim);
    std::vector<std::string> errors(block_dim);
    std::vector<std::thread> threads;
    for (int b = 0; b < block_dim; ++b) {
        cores[b] = std::make_unique<ak::Core>();
        cores[b]->block_idx = b;
        cores[b]->block_num = block_dim;
        threads.emplace_back([&, b] {
            ak::current = cores[b].get();
            try {
                AK_KERNEL(AK_ARGS);
                const ak::Core& k = *cores[b];
                for (int i = 0; i < ak::Core::EVENTS * ak::Core::IDS; ++i)   // a FreeTensor's wait is the TPipe's at exit
                    if (k.flags[i] && k.flag_by[i].rfind("the FreeTensor", 0) != 0)
                        ak::fail("queue discipline", k.flag_by[i] + " (event " +
                                 AscendC::detail::event_str(AscendC::HardEvent(i / ak::Core::IDS), i % ak::Core::IDS) +
                                 ") never met its WaitFlag");
            } catch (const std::exception& e) {
                errors[b] = e.what();
                g_barrier->arrive_and_drop();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < nargs; ++i) {
        FILE* f = fopen((dir + "/arg" + std::to_string(i) + ".bin").c_str(), "wb");
        fwrite(g_bufs[i].data, 1, g_bufs[i].size, f);
        fclose(f);
    }
    printf("{\"blocks\": [");
    for (int b = 0; b < block_dim; ++b) {
        const ak::Core& c = *cores[b];
        printf("%s{\"busy\": [%.1f, %.1f, %.1f, %.1f, %.1f, %.1f, %.1f], \"makespan\": %.1f, \"gm_read\": %llu, "
               "\"gm_written\": %llu, \"vec_repeats\": %llu, \"instrs\": [%llu, %llu, %llu, %llu], \"ub_used\": %u, \"buffers\": [",
               b ? ", " : "", c.c.busy[0], c.c.busy[1], c.c.busy[2], c.c.busy[3], c.c.busy[4], c.c.busy[5], c.c.busy[6],
               c.c.makespan(),
               (unsigned long long)c.c.gm_read, (unsigned long long)c.c.gm_written, (unsigned long long)c.c.vec_repeats,
               (unsigned long long)c.c.instrs[0], (unsigned long long)c.c.instrs[1], (unsigned long long)c.c.instrs[2],
               (unsigned long long)c.c.instrs[3], c.mem_used[ak::UB]);
        for (size_t i = 0; i < c.allocs.size(); ++i)
            printf("%s[\"%s\", %u]", i ? ", " : "", json_escape(c.allocs[i].first).c_str(), c.allocs[i].second);
        printf("], \"error\": %s%s%s}", errors[b].empty() ? "null" : "\"", json_escape(errors[b]).c_str(), errors[b].empty() ? "" : "\"");
    }
    printf("]}\n");
    return 0;
}
