// AuraKernel's AscendC emulator runner: runs every core of every block of one kernel entry over GM
// buffers (a thread each: per block its AIC and AIVs as launch.cpp's aic_per_block /
// aiv_per_block launch them) and prints a JSON report (per-core pipe counters, UB allocations,
// rule errors) on stdout.
//
//   runner <blockDim> <dir> <nargs>      dir/arg<i>.bin holds argument i (inputs, poisoned outputs,
//                                        workspace, tiling); every buffer is written back in place.
//
// Compiled once per hardware profile (its pipe figures); a kernel's build links it with the kernel
// and launch.cpp, which names the entry and the launch's shape. Each GM buffer sits in its own mapping that
// ends 32 B-aligned against a PROT_NONE guard page (and starts after one), so an out-of-bounds
// access faults; the SIGSEGV handler names the argument.
#include "kernel_operator.h"

#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>

namespace ak::launch {   // launch.cpp, built with the kernel
extern const int aic_per_block, aiv_per_block;
extern const uint64_t l2_args, l2_vector_reads;
void entry(uint8_t** gm);
}  // namespace ak::launch

namespace {

struct GmBuffer { uint8_t* map = nullptr; size_t map_len = 0; uint8_t* data = nullptr; size_t size = 0; uint8_t* guard_lo = nullptr; uint8_t* guard_hi = nullptr; };
std::vector<GmBuffer> g_bufs;

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

// ---- between cores: cross-core flags and SyncAll over the launch's threads ----------------------
// One mutex guards every counter. A core that waits registers what it waits for; when no core is
// left running (each has ended or waits) and no wait can be met, the kernel would hang on the NPU:
// every waiter is released with a `hang` error naming what it waited for.
namespace {
constexpr int FLAGS = 11, MODES = 3;
struct Thread {
    ak::Core* core = nullptr;
    std::vector<double> sets[MODES][FLAGS];   // when each CrossCoreSetFlag got there, in order
    int waits[MODES][FLAGS] = {};             // CrossCoreWaitFlags that returned
    std::vector<double> syncs;                 // each SyncAll's arrival
};
std::vector<Thread> g_threads;
std::mutex g_mu;
std::condition_variable g_cv;
int g_running = 0;
bool g_hung = false;
struct Waiter { std::function<bool()> met; std::string what; };
std::vector<Waiter*> g_waiters;

int tid_of(const ak::Core& c) {   // the thread order: per block its AIC, then its AIVs
    return int(c.block_idx) * (ak::launch::aic_per_block + ak::launch::aiv_per_block) + (c.kind == AscendC::AIC ? 0 : ak::launch::aic_per_block + c.sub_idx);
}
std::string core_name(const ak::Core& c) {
    return (c.kind == AscendC::AIC ? std::string("the AIC") : "AIV " + std::to_string(c.sub_idx)) + " of block " + std::to_string(c.block_idx);
}
// the threads whose sets (or arrivals) a wait of mode `mode` (3: SyncAll<true>, 4: SyncAll<false>) by t needs
std::vector<int> partners(const ak::Core& c, int mode) {
    std::vector<int> out;
    for (size_t u = 0; u < g_threads.size(); ++u) {
        const ak::Core& o = *g_threads[u].core;
        const bool same_block = o.block_idx == c.block_idx;
        if ((mode == 0 && o.kind == c.kind) || (mode == 1 && same_block && o.kind == AscendC::AIV) ||
            (mode == 2 && same_block && o.kind != c.kind) || (mode == 3 && o.kind == AscendC::AIV) || mode == 4)
            out.push_back(int(u));
    }
    return out;
}
bool stuck() {   // under g_mu: nobody runs and no registered wait can be met
    if (g_running > 0) return false;
    for (Waiter* w : g_waiters) if (w->met()) return false;
    return !g_waiters.empty();
}
// Block until `met` (under g_mu), reported as `what` if it never can be.
void block_until(std::unique_lock<std::mutex>& lock, const std::function<bool()>& met, const std::string& what) {
    if (met()) return;
    Waiter w{met, what};
    g_waiters.push_back(&w);
    --g_running;
    if (stuck()) { g_hung = true; g_cv.notify_all(); }
    g_cv.wait(lock, [&] { return g_hung || w.met(); });
    g_waiters.erase(std::find(g_waiters.begin(), g_waiters.end(), &w));
    ++g_running;
    if (!w.met()) ak::fail("hang", what);
}
void thread_done() {
    std::lock_guard<std::mutex> lock(g_mu);
    --g_running;
    if (stuck()) g_hung = true;
    g_cv.notify_all();
}
}  // namespace

namespace ak {
// arguments the build's l2_args mark (a bit each); and, for a vector core's read, those its
// l2_vector_reads mark (the AI core's Cube side read the same bytes just before)
bool gm_in_l2(const void* gm, bool vector_read) {
    const uint64_t marked = launch::l2_args | (vector_read ? launch::l2_vector_reads : 0);
    const uint8_t* a = static_cast<const uint8_t*>(gm);
    for (size_t i = 0; i < g_bufs.size() && i < 64; ++i)
        if ((marked >> i & 1u) && a >= g_bufs[i].data && a < g_bufs[i].data + g_bufs[i].size) return true;
    return false;
}
void cross_core_set(int mode, int flag, double at) {
    std::lock_guard<std::mutex> lock(g_mu);
    const Core& c = core();
    Thread& me = g_threads[tid_of(c)];
    const int mine = int(me.sets[mode][flag].size()) + 1;
    for (int u : partners(c, mode)) {   // each receiver's counter: the sets it has not waited for
        const Thread& r = g_threads[u];
        if (mine - r.waits[mode][flag] > 15)
            fail("CrossCoreSetFlag", "flag " + std::to_string(flag) + " (mode " + std::to_string(mode) + ") set a 16th time for " +
                 core_name(*r.core) + " before it waited: its counter holds at most 15");
    }
    me.sets[mode][flag].push_back(at);
    g_cv.notify_all();
}
double cross_core_wait(int mode, int flag) {
    std::unique_lock<std::mutex> lock(g_mu);
    const Core& c = core();
    Thread& me = g_threads[tid_of(c)];
    const int k = me.waits[mode][flag];   // this is the (k+1)-th wait: it needs each partner's (k+1)-th set
    const std::vector<int> from = partners(c, mode);
    if (from.empty()) fail("CrossCoreWaitFlag", "mode 2 on " + core_name(c) + ", whose AI core has no " +
                           (c.kind == AscendC::AIC ? "AIV" : "AIC") + " in this launch");
    block_until(lock, [&] { for (int u : from) if (int(g_threads[u].sets[mode][flag].size()) <= k) return false; return true; },
                "CrossCoreWaitFlag(" + std::to_string(flag) + ") of mode " + std::to_string(mode) + " on " + core_name(c) +
                " waits for a CrossCoreSetFlag that never comes (wait " + std::to_string(k + 1) + ")");
    me.waits[mode][flag] = k + 1;
    double at = 0;
    for (int u : from) at = std::max(at, g_threads[u].sets[mode][flag][k]);
    return at;
}
double sync_all(bool aiv_only, double at) {
    std::unique_lock<std::mutex> lock(g_mu);
    const Core& c = core();
    Thread& me = g_threads[tid_of(c)];
    const size_t k = me.syncs.size();
    me.syncs.push_back(at);
    g_cv.notify_all();
    const std::vector<int> from = partners(c, aiv_only ? 3 : 4);
    block_until(lock, [&] { for (int u : from) if (g_threads[u].syncs.size() <= k) return false; return true; },
                "SyncAll " + std::to_string(k + 1) + " on " + core_name(c) + " waits for a core that never arrives");
    double last = 0;
    for (int u : from) last = std::max(last, g_threads[u].syncs[k]);
    return last;
}
}  // namespace ak

int main(int argc, char** argv) {
    if (argc != 4) { fprintf(stderr, "usage: runner <blockDim> <dir> <nargs>\n"); return 2; }
    const int block_dim = atoi(argv[1]);
    ak::set_launch_blocks(block_dim);
    const char* trace = getenv("AK_TRACE");   // a file: every core's instructions appended, per pipe, start, end
    ak::tracing = trace != nullptr && *trace;
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
    const int per_block = ak::launch::aic_per_block + ak::launch::aiv_per_block, nthreads = block_dim * per_block;
    std::vector<std::unique_ptr<ak::Core>> cores(nthreads);
    std::vector<std::string> errors(nthreads);
    g_threads.resize(nthreads);
    for (int t = 0; t < nthreads; ++t) {
        cores[t] = std::make_unique<ak::Core>();
        ak::Core& k = *cores[t];
        const int slot = t % per_block;
        k.block_idx = t / per_block;
        k.block_num = block_dim;
        k.kind = slot < ak::launch::aic_per_block ? AscendC::AIC : AscendC::AIV;
        k.sub_idx = slot < ak::launch::aic_per_block ? 0 : slot - ak::launch::aic_per_block;
        k.aic_per_block = ak::launch::aic_per_block;
        k.aiv_per_block = ak::launch::aiv_per_block;
        g_threads[t].core = &k;
    }
    g_running = nthreads;
    std::vector<std::thread> threads;
    for (int t = 0; t < nthreads; ++t) {
        threads.emplace_back([&, t] {
            ak::current = cores[t].get();
            try {
                ak::launch::entry(gm.data());
                const ak::Core& k = *cores[t];
                for (int i = 0; i < ak::Core::EVENTS * ak::Core::IDS; ++i)   // a FreeTensor's wait is the TPipe's at exit
                    if (k.flags[i] && k.flag_by[i].rfind("the FreeTensor", 0) != 0)
                        ak::fail("queue discipline", k.flag_by[i] + " (event " +
                                 AscendC::detail::event_str(AscendC::HardEvent(i / ak::Core::IDS), i % ak::Core::IDS) +
                                 ") never met its WaitFlag");
            } catch (const std::exception& e) {
                errors[t] = e.what();
            }
            thread_done();
        });
    }
    for (auto& t : threads) t.join();
    /* an AIC -> AIV (or AIV -> AIC) flag set more often than its receiver waited for it stays counted in the
       receiver's flag: the next launch's first waits on it would return before their sets */
    for (int t = 0; t < nthreads; ++t) {
        const ak::Core& c = *cores[t];
        for (int f = 0; f < FLAGS && errors[t].empty(); ++f)
            for (int u : partners(c, 2)) {
                const int left = int(g_threads[u].sets[2][f].size()) - g_threads[t].waits[2][f];
                if (left > 0 && errors[u].empty()) {
                    errors[t] = "cross-core flags: CrossCoreSetFlag(" + std::to_string(f) + ") of mode 2 from " + core_name(*cores[u]) +
                                " set " + std::to_string(left) + " more time(s) than " + core_name(c) +
                                " waited for it: the launch ends with its counter at " + std::to_string(left);
                    break;
                }
            }
    }
    for (int i = 0; i < nargs; ++i) {
        FILE* f = fopen((dir + "/arg" + std::to_string(i) + ".bin").c_str(), "wb");
        fwrite(g_bufs[i].data, 1, g_bufs[i].size, f);
        fclose(f);
    }
    if (ak::tracing) {
        FILE* f = fopen(trace, "a");
        if (f == nullptr) { fprintf(stderr, "AK_TRACE=%s: cannot be written\n", trace); return 2; }
        fprintf(f, "# %s, %d blocks: block core pipe start end instruction (cycles)\n", argv[0], block_dim);
        for (int t = 0; t < nthreads; ++t) {
            const ak::Core& c = *cores[t];
            const std::string core = c.kind == AscendC::AIC ? "AIC" : "AIV" + std::to_string(c.sub_idx);
            for (const ak::Issued& i : c.c.timeline)
                fprintf(f, "%lld %s %s %.1f %.1f %.*s\n", (long long)c.block_idx, core.c_str(), ak::pipe_name(i.pipe), i.start, i.end,
                        int(strcspn(i.what, "< ")), i.what);   /* the name without template arguments */
        }
        fclose(f);
    }
    /* a block's makespan is at least its HBM traffic (reads and writes, every core of it) over its share */
    std::vector<double> floor(block_dim, 0.0);
    for (int t = 0; t < nthreads; ++t)
        floor[t / per_block] += double(cores[t]->c.gm_read + cores[t]->c.gm_written) / ak::hbm_share_per_cycle;
    printf("{\"blocks\": [");
    for (int b = 0; b < nthreads; ++b) {
        const ak::Core& c = *cores[b];
        printf("%s{\"block\": %lld, \"core\": \"%s\", \"busy\": [%.1f, %.1f, %.1f, %.1f, %.1f, %.1f, %.1f], \"makespan\": %.1f, \"gm_read\": %llu, "
               "\"gm_written\": %llu, \"l2_read\": %llu, \"l2_written\": %llu, \"vec_repeats\": %llu, \"instrs\": [%llu, %llu, %llu, %llu], \"ub_used\": %u, \"buffers\": [",
               b ? ", " : "", (long long)c.block_idx, c.kind == AscendC::AIC ? "AIC" : ("AIV" + std::to_string(c.sub_idx)).c_str(), c.c.busy[0], c.c.busy[1], c.c.busy[2], c.c.busy[3], c.c.busy[4], c.c.busy[5], c.c.busy[6],
               std::max(c.c.makespan(), floor[b / per_block]),
               (unsigned long long)c.c.gm_read, (unsigned long long)c.c.gm_written, (unsigned long long)c.c.l2_read,
               (unsigned long long)c.c.l2_written, (unsigned long long)c.c.vec_repeats,
               (unsigned long long)c.c.instrs[0], (unsigned long long)c.c.instrs[1], (unsigned long long)c.c.instrs[2],
               (unsigned long long)c.c.instrs[3], c.mem_used[ak::UB]);
        for (size_t i = 0; i < c.allocs.size(); ++i)
            printf("%s[\"%s\", %u]", i ? ", " : "", json_escape(c.allocs[i].first).c_str(), c.allocs[i].second);
        printf("], \"error\": %s%s%s}", errors[b].empty() ? "null" : "\"", json_escape(errors[b]).c_str(), errors[b].empty() ? "" : "\"");
    }
    printf("]}\n");
    return 0;
}
