// AuraKernel's emulation of the AscendC kernel API (vector path, Atlas A2/A3), for g++ on a CPU.
//
// Written from the documented signatures (see the project's docs/ascendc notes), not from CANN
// sources. A kernel includes it as "kernel_operator.h" and compiles unchanged; the runner
// (runner.cpp) executes every block and reports what the hardware would have refused:
//   * UB capacity       the InitBuffer sizes (each rounded up to 32 B, times its buffer count)
//                       must fit the UB below its reserved top (AK_UB_USABLE);
//   * 32 B alignment    every LocalTensor a vector op or a copy touches starts on 32 B;
//   * DataCopy 32 B     count * sizeof(T) must be a multiple of 32 B (hardware rounds down silently);
//   * repeat <= 255     level-0 calls;
//   * queue discipline  AllocTensor beyond the queue's buffers, DeQue of an empty queue, EnQue
//                       beyond the depth, SetFlag/WaitFlag unpaired at the end of the kernel;
//   * events            under a TPipe, event IDs from its pool (the queues take theirs there too);
//                       two users of one (event, ID) at once;
//   * SyncAll           the mix kernel type and a batch-mode launch;
//   * Cast              the documented (source, target, round mode) combinations;
//   * GM bounds         a copy beyond a GlobalTensor's SetGlobalBuffer size.
// What each API models and what it does not: README.md beside this directory.
// A broken rule throws ak::RuleError("<rule>: <what> (<buffer>)"), reported by the runner.
//
// Timing: each instruction is charged to its pipe (MTE2: GM->UB, MTE3: UB->GM, V: vector,
// S: scalar) and starts when its pipe is free (pipes run their queues in order), the UB buffers it
// reads or writes are ready (data written by another pipe, or a buffer still being read before it
// is overwritten) and the scalar unit has issued it: the scalar unit walks the program in order and
// hands each instruction to its pipe's queue, so a scalar wait (WaitFlag<V_S>, GetValue on a result
// another pipe is still producing) holds back every instruction after it in program order, on
// every pipe. A WaitFlag resumes its pipe when the signalling pipe had finished everything queued
// before the matching SetFlag. That is exactly the overlap the kernel's queue order and buffer
// counts allow: a copy issued after a compute step that ends in a scalar wait cannot run under it,
// one issued before it (a prefetch) can. Per-pipe busy cycles and the block's makespan are returned
// as counters.
#pragma once

// Only what an NPU build of the real kernel_operator.h exposes reaches the kernel: no <cmath> (its
// INFINITY, expf, std::exp are not there on the device), so the emulator's own math uses builtins.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>
#include <algorithm>
#include <type_traits>
#include <utility>

// The target's figures come from its profile (aurakernel/emulator/__init__.py: pipe_defines):
// UB bytes and the part below the reserved top, and the cycle costs of the pipes. A core's MTE rate to
// HBM is its share of the chip's (AK_HBM_BYTES_PER_CYCLE over the launch's blocks, at most
// AK_VECTOR_CORES of them), capped by the core's own (AK_MTE_CORE_BYTES_PER_CYCLE): the runner sets
// it from the launch's block count, so one build serves every launch.
#if !defined(AK_UB_BYTES) || !defined(AK_UB_USABLE) || !defined(AK_MTE_CORE_BYTES_PER_CYCLE) || !defined(AK_MTE_LATENCY) || \
    !defined(AK_VEC_ISSUE) || !defined(AK_VEC_SLOW_FACTOR) || !defined(AK_SCALAR_OP) || !defined(AK_L1_USABLE) || \
    !defined(AK_L0A_BYTES) || !defined(AK_L0B_BYTES) || !defined(AK_L0C_BYTES) || !defined(AK_CUBE_MACS_16BIT) || \
    !defined(AK_CUBE_MACS_FP32) || !defined(AK_MTE1_BYTES_PER_CYCLE) || !defined(AK_FIX_BYTES_PER_CYCLE) || \
    !defined(AK_L2_BYTES_PER_CYCLE) || !defined(AK_HBM_BYTES_PER_CYCLE) || !defined(AK_VECTOR_CORES)
#error "build through aurakernel.emulator.build: it defines the target's AK_* figures"
#endif

#define __global__
#define __aicore__
#define __gm__
#define __ubuf__
#define GM_ADDR uint8_t*

namespace ak {

struct RuleError : std::runtime_error {
    explicit RuleError(const std::string& m) : std::runtime_error(m) {}
};

[[noreturn]] inline void fail(const std::string& rule, const std::string& what) { throw RuleError(rule + ": " + what); }

enum Pipe { MTE2 = 0, MTE3 = 1, VEC = 2, SCALAR = 3, MTE1 = 4, CUBE = 5, FIX = 6, NPIPES = 7 };
// The core's memories: the vector side's UB; the Cube side's L1 (A1 / B1), L0A (A2), L0B (B2), L0C (CO1).
enum Mem { UB = 0, L1 = 1, L0A = 2, L0B = 3, L0C = 4, NMEMS = 5 };
inline const char* mem_name(Mem m) { static const char* n[] = {"UB", "L1", "L0A", "L0B", "L0C"}; return n[m]; }

// The timing state of one buffer slot (a queue buffer or a TBuf), and where it lives.
struct Slot {
    std::string name;
    double ready = 0;     // when its last write completes
    double free_at = 0;   // when its last read completes
    Mem mem = UB;
    uint8_t* base = nullptr;   // its memory's start (alignment is relative to it)
    // the sync rule: the pipe that last wrote it and when (program order), and each pipe's last read
    int writer = -1;
    uint64_t write_seq = 0;
    uint64_t read_seq[NPIPES] = {};
};
inline const char* pipe_name(int p) {
    static const char* n[] = {"MTE2", "MTE3", "V", "S", "MTE1", "M", "FIX"};
    return n[p];
}

// one instruction's place on its pipe's timeline (kept only when the runner traces: AK_TRACE)
struct Issued {
    int pipe;
    double start, end;
    const char* what;   // the API call that issued it
};
inline bool tracing = false;

struct Counters {
    std::vector<Issued> timeline;   // every instruction, when tracing
    double busy[NPIPES] = {};   // cycles each pipe worked
    double at[NPIPES] = {};     // when each pipe is next free
    uint64_t gm_read = 0, gm_written = 0, l2_read = 0, l2_written = 0, vec_repeats = 0, instrs[NPIPES] = {};
    double makespan() const { return *std::max_element(at, at + NPIPES); }
};

// Per-block context: the UB arena, the allocation cursor, counters and event bookkeeping.
struct Core {
    int64_t block_idx = 0, block_num = 1;
    // which engine this is (AscendC::AIC 1 / AIV 2) and its place in its AI core: the launch gives
    // each block 0 or 1 Cube cores (AIC) and 0, 1 or 2 vector cores (AIV); sub_idx is an AIV's index there
    int kind = 2, sub_idx = 0, aic_per_block = 0, aiv_per_block = 1;
    int init_count = 0;
    // each memory's arena (the UB's made with the core, zeroed; the Cube side's on a kernel's first
    // buffer there, poisoned: NaN for floats until written), its start and its allocation cursor
    std::vector<uint8_t> mem[NMEMS];
    uint8_t* mem_base[NMEMS] = {};
    uint32_t mem_used[NMEMS] = {};
    std::vector<Slot*> slots;
    Counters c;
    // Events: every (HardEvent, ID) flag, set by a SetFlag or a queue and cleared by its WaitFlag, with
    // who set it and when; the TPipe's pool of IDs per HardEvent (taken by AllocEventID and by the queues'
    // EnQue / FreeTensor) and the ID FetchEventID last handed out, good for one SetFlag.
    static constexpr int EVENTS = 64, IDS = 8;
    int flags[EVENTS * IDS] = {0};
    // Program order (a counter over every instruction and sync) and what each pipe may touch: a write
    // of pipe W issued before safe[W][P] is complete for pipe P (a SetFlag / WaitFlag, a queue's EnQue /
    // DeQue or FreeTensor / AllocTensor, or a PipeBarrier<PIPE_ALL> between), and so is a read of W
    // before P overwrites it. Each flag keeps, from its SetFlag, what its setting pipe could see then.
    uint64_t seq = 0;
    uint64_t safe[NPIPES][NPIPES] = {};
    uint64_t flag_safe[EVENTS * IDS][NPIPES] = {};
    double flag_at[EVENTS * IDS] = {0};   // when the pipe that set each flag had finished what preceded the SetFlag
    std::string flag_by[EVENTS * IDS];
    uint8_t pool[EVENTS] = {0};
    std::string pool_by[EVENTS * IDS];
    int fetched[EVENTS];
    void* pipe = nullptr;      // the kernel's TPipe (GetTPipePtr), once constructed
    int kernel_type = -1;      // KERNEL_TASK_TYPE_DEFAULT's value, -1 when not declared
    int atomic = 0;            // SetAtomicAdd<T>'s type (1 float, 2 half, 3 bfloat16_t): writes to GM add; 0: off
    std::vector<std::pair<std::string, uint32_t>> allocs;   // every InitBuffer, for the UB report
    Core() {
        for (int& f : fetched) f = -1;
    }
    ~Core() { for (auto* s : slots) delete s; }
    Slot* new_slot(const std::string& name, Mem m = UB) {
        slots.push_back(new Slot{name});
        slots.back()->mem = m;
        slots.back()->base = mem_base[m];
        return slots.back();
    }
    static uint32_t capacity(Mem m) {
        static const uint32_t cap[NMEMS] = {uint32_t(AK_UB_USABLE), uint32_t(AK_L1_USABLE), uint32_t(AK_L0A_BYTES),
                                            uint32_t(AK_L0B_BYTES), uint32_t(AK_L0C_BYTES)};
        return cap[m];
    }
    void arena(Mem m) {
        mem[m].assign((m == UB ? AK_UB_BYTES : capacity(m)) + 1024, m == UB ? 0 : 0xff);
        mem_base[m] = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(mem[m].data()) + 1023) & ~uintptr_t(1023));
    }
    // a buffer in memory m, in order, against the part of it a kernel may use
    uint8_t* alloc(uint32_t bytes, const std::string& what, Mem m = UB) {
        if ((kind == 2) != (m == UB))   // the A2/A3 cores are split: UB on the AIVs, L1 / L0 on the AIC
            fail("position", what + " in " + mem_name(m) + " on " + (kind == 2 ? "a vector core (AIV), which has only the UB: "
                 "the Cube's buffers are the AIC's (launch on it: KERNEL_TYPE_AIC_ONLY or a mix type)"
                 : "the Cube core (AIC), which has no UB: vector buffers are the AIVs' (a mix type launches both)"));
        if (mem[m].empty()) arena(m);
        if (mem_used[m] + bytes > capacity(m))
            fail(std::string(mem_name(m)) + " capacity", what + " needs " + std::to_string(bytes) + " B at offset " +
                 std::to_string(mem_used[m]) + ", beyond the " + std::to_string(capacity(m)) + " B usable" +
                 (m == UB ? " (" + std::to_string(AK_UB_BYTES) + " B UB, top " + std::to_string(AK_UB_BYTES - AK_UB_USABLE) +
                            " B reserved)" : std::string(" of ") + mem_name(m)));
        uint8_t* p = mem_base[m] + mem_used[m];
        mem_used[m] += bytes;
        allocs.emplace_back(what, bytes);
        return p;
    }
    // The sync rule: data another pipe wrote (or still reads) is touched only after an event from that
    // pipe to this one; without one the NPU reads it early or overwrites it under the reader.
    void check_sync(const Slot& s, Pipe p, bool write) const {
        if (s.writer >= 0 && s.writer != p && s.write_seq >= safe[s.writer][p])
            fail("sync", std::string(pipe_name(p)) + (write ? " overwrites " : " reads ") + s.name + " after " +
                 pipe_name(s.writer) + " wrote it, with no " + pipe_name(s.writer) + " -> " + pipe_name(p) +
                 " event between (on the NPU it " + (write ? "races the write" : "reads it early") + ")");
        if (write)   // the scalar unit's reads are done when it issues what follows them: no event needed
            for (int r = 0; r < NPIPES; ++r)
                if (r != p && r != SCALAR && s.read_seq[r] && s.read_seq[r] >= safe[r][p])
                    fail("sync", std::string(pipe_name(p)) + " overwrites " + s.name + " that " + pipe_name(r) +
                         " reads, with no " + pipe_name(r) + " -> " + pipe_name(p) + " event between");
    }
    // Charge `cycles` to `pipe`, starting after its inputs are ready and its outputs are free.
    // `what` defaults to the calling API function's name, for the trace.
    void issue(Pipe pipe, double cycles, std::initializer_list<Slot*> reads, std::initializer_list<Slot*> writes,
               const char* what = __builtin_FUNCTION()) {
        const uint64_t now = ++seq;
        for (Slot* s : reads) if (s) check_sync(*s, pipe, false);
        for (Slot* s : writes) if (s) check_sync(*s, pipe, true);
        for (Slot* s : reads) if (s) s->read_seq[pipe] = now;
        for (Slot* s : writes) if (s) { s->writer = pipe; s->write_seq = now; }
        double start = std::max(c.at[pipe], c.at[SCALAR]);   // not before the scalar unit has issued it
        for (Slot* s : reads) if (s) start = std::max(start, s->ready);
        for (Slot* s : writes) if (s) start = std::max({start, s->free_at, s->ready});
        const double end = start + cycles;
        for (Slot* s : reads) if (s) s->free_at = std::max(s->free_at, end);
        for (Slot* s : writes) if (s) s->ready = end;
        c.at[pipe] = end;
        c.busy[pipe] += cycles;
        if (tracing) c.timeline.push_back({pipe, start, end, what});
        c.instrs[pipe] += 1;
    }
};

inline thread_local Core* current = nullptr;
// a core's MTE rate to HBM: its share of the chip's for the launch's blocks (set_launch_blocks)
inline double hbm_bytes_per_cycle = AK_MTE_CORE_BYTES_PER_CYCLE;
// a block's share of HBM itself: its reads and writes together (MTE2 and MTE3 each run at the rate
// above, but both draw on this), so no block finishes before its traffic / this (the runner's floor)
inline double hbm_share_per_cycle = AK_HBM_BYTES_PER_CYCLE;
inline void set_launch_blocks(int blocks) {
    const int sharing = std::max(1, std::min(blocks, int(AK_VECTOR_CORES)));
    hbm_share_per_cycle = double(AK_HBM_BYTES_PER_CYCLE) / sharing;
    hbm_bytes_per_cycle = std::min(double(AK_MTE_CORE_BYTES_PER_CYCLE), hbm_share_per_cycle);
}
inline Core& core() { return *current; }

// Between cores (the runner defines these over its threads): CrossCoreSetFlag of `mode` on `flag`,
// its pipe having reached `at`; the matching CrossCoreWaitFlag, which blocks this core until the
// set comes (a wait no set can ever meet is reported as a hang) and returns when the setter got
// there; SyncAll over the AIVs (aiv_only) or every core, each arriving at `at`.
void cross_core_set(int mode, int flag, double at);
// whether the launch keeps the GM buffer holding `gm` in L2 (for a vector core's read: or finds it
// there, its AI core's Cube side having read it just before)
bool gm_in_l2(const void* gm, bool vector_read);
double cross_core_wait(int mode, int flag);
double sync_all(bool aiv_only, double at);

}  // namespace ak

// ---- kernel type ---------------------------------------------------------------------------------
// KERNEL_TASK_TYPE_DEFAULT(type) in the kernel body declares which cores it launches on; the hard
// SyncAll needs a mix type (KERNEL_TYPE_MIX_AIV_1_0 for a vector-only kernel), so it is recorded.
enum KernelMetaType : uint8_t { KERNEL_TYPE_AIV_ONLY, KERNEL_TYPE_AIC_ONLY, KERNEL_TYPE_MIX_AIV_1_0, KERNEL_TYPE_MIX_AIC_1_0,
                                KERNEL_TYPE_MIX_AIC_1_1, KERNEL_TYPE_MIX_AIC_1_2, KERNEL_TYPE_AICORE, KERNEL_TYPE_VECTORCORE,
                                KERNEL_TYPE_MIX_AICORE, KERNEL_TYPE_MIX_VECTOR_CORE, KERNEL_TYPE_MAX };
// The launch (the emulator build's `cores`) must be the one the kernel declares: a Cube-only or
// vector-only type on a mix launch, or the reverse, runs the wrong engines.
namespace ak {
extern const bool batch_mode;   // the launch's schedule mode (the build's batch_mode), defined by launch.cpp
inline void declare_kernel_type(int type) {
    // per KernelMetaType (AIV_ONLY, AIC_ONLY, MIX_AIV_1_0, MIX_AIC_1_0, MIX_AIC_1_1, MIX_AIC_1_2): its AICs and AIVs per block
    static constexpr int cores[][2] = {{0, 1}, {1, 0}, {0, 1}, {1, 0}, {1, 1}, {1, 2}};
    auto& k = core();
    const bool split = type >= 0 && type < 6;
    const int aic = split ? cores[type][0] : 0, aiv = split ? cores[type][1] : 0;
    if (aic != k.aic_per_block || aiv != k.aiv_per_block)
        fail("kernel type", "declared with " + std::to_string(aic) + " AIC and " + std::to_string(aiv) + " AIV per block, "
             "launched with " + std::to_string(k.aic_per_block) + " and " + std::to_string(k.aiv_per_block) +
             " (the emulator build's cores: aiv, aic, mix_1_1 or mix_1_2)");
    k.kernel_type = type;
}
}  // namespace ak
#define KERNEL_TASK_TYPE_DEFAULT(value) (::ak::declare_kernel_type(int(value)))

// ---- element types ---------------------------------------------------------------------------
using half = _Float16;
struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    bfloat16_t(float f) {   // round to nearest even; NaN stays a quiet NaN
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) { bits = uint16_t((u >> 16) | 0x40u); return; }
        u += 0x7fffu + ((u >> 16) & 1u);
        bits = uint16_t(u >> 16);
    }
    operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};

namespace AscendC {

enum class TPosition : uint8_t { GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC, LCM = VECCALC,
                                 SPM, SHM = SPM, TSCM, C2PIPE2GM, C2PIPE2LOCAL, MAX };
using QuePosition = TPosition;
namespace detail {
// where a position's buffers live (TSCM, C2, CO2 and the others are not emulated: ak::NMEMS)
constexpr ak::Mem memory_of(TPosition p) {
    return p == TPosition::VECIN || p == TPosition::VECOUT || p == TPosition::VECCALC ? ak::UB
         : p == TPosition::A1 || p == TPosition::B1 || p == TPosition::C1 ? ak::L1
         : p == TPosition::A2 ? ak::L0A : p == TPosition::B2 ? ak::L0B : p == TPosition::CO1 ? ak::L0C : ak::NMEMS;
}
}  // namespace detail
enum class RoundMode : uint8_t { CAST_NONE = 0, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };
enum class HardEvent : uint8_t { MTE2_MTE1, MTE1_MTE2, MTE1_M, M_MTE1, MTE2_V, V_MTE2, MTE3_V, V_MTE3, M_V, V_M, V_V,
    MTE3_MTE1, MTE1_MTE3, MTE1_V, MTE2_M, M_MTE2, V_MTE1, M_FIX, FIX_M, MTE3_MTE2, MTE2_MTE3, S_V, V_S, S_MTE2,
    MTE2_S, S_MTE3, MTE3_S, MTE2_FIX, FIX_MTE2, FIX_S, M_S, FIX_MTE3, MTE1_FIX, FIX_MTE1, FIX_FIX, MAX };
enum class CMPMODE : uint8_t { LT = 0, GT, EQ, LE, GE, NE };
enum class SELMODE : uint8_t { VSEL_CMPMASK_SPR = 0, VSEL_TENSOR_SCALAR_MODE, VSEL_TENSOR_TENSOR_MODE };
enum class ReduceOrder : uint8_t { ORDER_VALUE_INDEX = 0, ORDER_INDEX_VALUE, ORDER_ONLY_VALUE, ORDER_ONLY_INDEX };
enum pipe_t { PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_FIX, PIPE_ALL };
using TEventID = int8_t;
enum event_t { EVENT_ID0 = 0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };

constexpr int32_t ONE_BLK_SIZE = 32;
constexpr int32_t ONE_REPEAT_BYTE_SIZE = 256;
constexpr int32_t MAX_REPEAT_TIMES = 255;

struct DataCopyParams {
    uint16_t blockCount = 1, blockLen = 0, srcStride = 0, dstStride = 0;
    DataCopyParams() = default;
    DataCopyParams(uint16_t c, uint16_t l, uint16_t s, uint16_t d) : blockCount(c), blockLen(l), srcStride(s), dstStride(d) {}
};
struct DataCopyExtParams {
    uint16_t blockCount = 1; uint32_t blockLen = 0, srcStride = 0, dstStride = 0, rsv = 0;
    DataCopyExtParams() = default;
    DataCopyExtParams(uint16_t c, uint32_t l, uint32_t s, uint32_t d, uint32_t r)   // five: the real struct has no shorter one
        : blockCount(c), blockLen(l), srcStride(s), dstStride(d), rsv(r) {}
};
template <typename T> struct DataCopyPadExtParams {
    bool isPad = false; uint8_t leftPadding = 0, rightPadding = 0; T paddingValue = 0;
    DataCopyPadExtParams() = default;
    DataCopyPadExtParams(bool p, uint8_t l, uint8_t r, T v) : isPad(p), leftPadding(l), rightPadding(r), paddingValue(v) {}
};
struct UnaryRepeatParams {
    uint32_t blockNumber = 8; uint16_t dstBlkStride = 1, srcBlkStride = 1; uint8_t dstRepStride = 8, srcRepStride = 8;
    UnaryRepeatParams() = default;
    UnaryRepeatParams(uint16_t db, uint16_t sb, uint8_t dr, uint8_t sr) : dstBlkStride(db), srcBlkStride(sb), dstRepStride(dr), srcRepStride(sr) {}
};
struct BinaryRepeatParams {
    uint32_t blockNumber = 8; uint8_t dstBlkStride = 1, src0BlkStride = 1, src1BlkStride = 1;
    uint8_t dstRepStride = 8, src0RepStride = 8, src1RepStride = 8;
    BinaryRepeatParams() = default;
    BinaryRepeatParams(uint8_t db, uint8_t s0b, uint8_t s1b, uint8_t dr, uint8_t s0r, uint8_t s1r)
        : dstBlkStride(db), src0BlkStride(s0b), src1BlkStride(s1b), dstRepStride(dr), src0RepStride(s0r), src1RepStride(s1r) {}
};
struct CopyRepeatParams {
    uint16_t dstStride = 1, srcStride = 1, dstRepeatSize = 8, srcRepeatSize = 8;
    CopyRepeatParams() = default;
    CopyRepeatParams(uint16_t ds, uint16_t ss, uint16_t dr, uint16_t sr) : dstStride(ds), srcStride(ss), dstRepeatSize(dr), srcRepeatSize(sr) {}
};
struct BrcbRepeatParams {
    uint16_t dstBlkStride = 1, dstRepStride = 8;
    BrcbRepeatParams() = default;
    BrcbRepeatParams(uint16_t b, uint16_t r) : dstBlkStride(b), dstRepStride(r) {}
};

// ---- tensors -----------------------------------------------------------------------------------
template <typename T> class GlobalTensor {
 public:
    using PrimType = T;
    void SetGlobalBuffer(__gm__ T* buffer, uint64_t bufferSize) { base_ = buffer; size_ = bufferSize; }
    void SetGlobalBuffer(__gm__ T* buffer) { base_ = buffer; size_ = UINT64_MAX; }
    __gm__ T* GetPhyAddr(uint64_t offset = 0) const { return base_ + offset; }
    __gm__ T* ak_ptr() const { return base_; }   // the emulator's own access
    // a scalar-unit read of GM (through its data cache): timed as one scalar op, as a UB GetValue is
    T GetValue(uint64_t off) const {
        check(off, 1);
        ak::core().c.gm_read += sizeof(T);
        ak::core().issue(ak::SCALAR, AK_SCALAR_OP, {}, {});
        return base_[off];
    }
    void SetValue(uint64_t off, T v) { check(off, 1); ak::core().c.gm_written += sizeof(T); base_[off] = v; }
    uint64_t GetSize() const { return size_; }
    GlobalTensor operator[](uint64_t offset) const {
        GlobalTensor g; g.base_ = base_ + offset; g.size_ = size_ == UINT64_MAX ? size_ : (offset <= size_ ? size_ - offset : 0);
        return g;
    }
    void check(uint64_t off, uint64_t n) const {
        if (size_ != UINT64_MAX && off + n > size_)
            ak::fail("GM bounds", "access to elements [" + std::to_string(off) + ", " + std::to_string(off + n) +
                     ") of a GlobalTensor of " + std::to_string(size_));
    }
 private:
    T* base_ = nullptr;
    uint64_t size_ = 0;
};

template <typename T> class LocalTensor {
 public:
    using PrimType = T;
    LocalTensor() = default;
    LocalTensor(T* p, uint32_t len, ak::Slot* slot) : ptr_(p), len_(len), slot_(slot) {}
    LocalTensor operator[](uint32_t offset) const { return LocalTensor(ptr_ + offset, offset <= len_ ? len_ - offset : 0, slot_); }
    T GetValue(uint32_t i) const { ak::core().issue(ak::SCALAR, AK_SCALAR_OP, {slot_}, {}); return ptr_[i]; }
    template <typename S> void SetValue(uint32_t i, S v) const { ak::core().issue(ak::SCALAR, AK_SCALAR_OP, {}, {slot_}); ptr_[i] = T(v); }
    T& operator()(uint32_t i) const { return ptr_[i]; }
    template <typename U> LocalTensor<U> ReinterpretCast() const {
        return LocalTensor<U>(reinterpret_cast<U*>(ptr_), uint32_t(len_ * sizeof(T) / sizeof(U)), slot_);
    }
    void SetSize(uint32_t n) { len_ = n; }
    uint32_t GetSize() const { return len_; }
    // On the NPU a LocalTensor's address is an integer (its UB address), not a pointer a kernel could
    // dereference: so it is here. The emulator itself reads the data through ak_ptr().
    uint64_t GetPhyAddr() const { return GetPhyAddr(0); }
    uint64_t GetPhyAddr(uint32_t offset) const {
        return uint64_t(reinterpret_cast<const uint8_t*>(ptr_ + offset) - slot_->base);
    }
    T* ak_ptr() const { return ptr_; }
    ak::Slot* slot() const { return slot_; }
    // the alignment rule (32 B for most operands; a reduction's result needs only its element or
    // value-index pair) and the extent of an access of n elements
    // Vector instructions and UB copies take UB tensors only (check); the Cube's take theirs (check_in).
    void check(uint32_t n, const char* api, uint32_t align = 32) const { check_in(ak::UB, n, api, align); }
    void check_in(ak::Mem m, uint32_t n, const char* api, uint32_t align = 32) const {
        if (ptr_ == nullptr) ak::fail("queue discipline", std::string(api) + " on an unallocated LocalTensor");
        if (slot_->mem != m)
            ak::fail("position", std::string(api) + " takes a LocalTensor in " + ak::mem_name(m) + ", not one in " +
                     ak::mem_name(slot_->mem) + " (" + slot_->name + ")");
        const uintptr_t off = reinterpret_cast<uintptr_t>(ptr_) - reinterpret_cast<uintptr_t>(slot_->base);
        if (off % align != 0)
            ak::fail(align == 32 ? "32 B alignment" : std::to_string(align) + " B alignment", std::string(api) +
                     " on a LocalTensor at " + ak::mem_name(m) + " offset " + std::to_string(off) + " (" + slot_->name + ")");
        if (n > len_)
            ak::fail(m == ak::UB ? "UB bounds" : std::string(ak::mem_name(m)) + " bounds", std::string(api) + " of " +
                     std::to_string(n) + " elements on a LocalTensor of " + std::to_string(len_) + " (" + slot_->name + ")");
    }
    ak::Mem mem() const { return slot_ ? slot_->mem : ak::UB; }
 private:
    T* ptr_ = nullptr;
    uint32_t len_ = 0;
    ak::Slot* slot_ = nullptr;
};

// ---- events (SetFlag / WaitFlag and the TPipe's pool of IDs) ----------------------------------
namespace detail {
inline const char* event_name(HardEvent e) {
    static const char* names[] = {"MTE2_MTE1", "MTE1_MTE2", "MTE1_M", "M_MTE1", "MTE2_V", "V_MTE2", "MTE3_V", "V_MTE3", "M_V",
        "V_M", "V_V", "MTE3_MTE1", "MTE1_MTE3", "MTE1_V", "MTE2_M", "M_MTE2", "V_MTE1", "M_FIX", "FIX_M", "MTE3_MTE2",
        "MTE2_MTE3", "S_V", "V_S", "S_MTE2", "MTE2_S", "S_MTE3", "MTE3_S", "MTE2_FIX", "FIX_MTE2", "FIX_S", "M_S", "FIX_MTE3",
        "MTE1_FIX", "FIX_MTE1", "FIX_FIX", "MAX"};
    return names[int(e)];
}
inline std::string event_str(HardEvent e, int32_t id) { return std::string(event_name(e)) + " id " + std::to_string(id); }
inline int flag_slot(HardEvent e, int32_t id) {
    if (id < 0 || id >= ak::Core::IDS) ak::fail("events", event_str(e, id) + " outside 0..7");
    return int(e) * ak::Core::IDS + id;
}
}  // namespace detail

inline ak::Pipe event_src(HardEvent e) {
    switch (e) {
        case HardEvent::MTE2_V: case HardEvent::MTE2_S: case HardEvent::MTE2_MTE3: return ak::MTE2;
        case HardEvent::MTE3_V: case HardEvent::MTE3_S: case HardEvent::MTE3_MTE2: return ak::MTE3;
        case HardEvent::V_MTE2: case HardEvent::V_MTE3: case HardEvent::V_S: case HardEvent::V_V: return ak::VEC;
        case HardEvent::MTE2_MTE1: case HardEvent::MTE2_M: case HardEvent::MTE2_FIX: return ak::MTE2;
        case HardEvent::MTE1_MTE2: case HardEvent::MTE1_M: case HardEvent::MTE1_FIX: return ak::MTE1;
        case HardEvent::M_MTE1: case HardEvent::M_FIX: case HardEvent::M_MTE2: case HardEvent::M_S: return ak::CUBE;
        case HardEvent::FIX_M: case HardEvent::FIX_MTE2: case HardEvent::FIX_MTE1: case HardEvent::FIX_S:
        case HardEvent::FIX_FIX: case HardEvent::FIX_MTE3: return ak::FIX;
        case HardEvent::M_V: return ak::CUBE;
        case HardEvent::V_M: case HardEvent::V_MTE1: return ak::VEC;
        case HardEvent::MTE3_MTE1: return ak::MTE3;
        case HardEvent::MTE1_MTE3: case HardEvent::MTE1_V: return ak::MTE1;
        default: return ak::SCALAR;
    }
}
inline ak::Pipe event_dst(HardEvent e) {
    switch (e) {
        case HardEvent::V_MTE2: case HardEvent::S_MTE2: case HardEvent::MTE3_MTE2: return ak::MTE2;
        case HardEvent::V_MTE3: case HardEvent::S_MTE3: case HardEvent::MTE2_MTE3: return ak::MTE3;
        case HardEvent::MTE2_V: case HardEvent::MTE3_V: case HardEvent::S_V: case HardEvent::V_V: return ak::VEC;
        case HardEvent::MTE1_MTE2: case HardEvent::M_MTE2: case HardEvent::FIX_MTE2: return ak::MTE2;
        case HardEvent::MTE2_MTE1: case HardEvent::M_MTE1: case HardEvent::FIX_MTE1: return ak::MTE1;
        case HardEvent::MTE1_M: case HardEvent::MTE2_M: case HardEvent::FIX_M: return ak::CUBE;
        case HardEvent::M_FIX: case HardEvent::MTE2_FIX: case HardEvent::MTE1_FIX: case HardEvent::FIX_FIX: return ak::FIX;
        case HardEvent::M_V: case HardEvent::MTE1_V: return ak::VEC;
        case HardEvent::V_M: return ak::CUBE;
        case HardEvent::V_MTE1: case HardEvent::MTE3_MTE1: return ak::MTE1;
        case HardEvent::MTE1_MTE3: case HardEvent::FIX_MTE3: return ak::MTE3;
        default: return ak::SCALAR;
    }
}

namespace detail {
// Raise flag (e, id) for `who`: one already raised is a collision (two users of one ID), a hang or a
// wrong wakeup on the hardware.
inline void raise_flag(HardEvent e, int32_t id, const std::string& who) {
    auto& k = ak::core();
    const int f = flag_slot(e, id);
    if (k.flags[f])
        ak::fail("events", "event " + event_str(e, id) + " set by " + who + " while " + k.flag_by[f] +
                 " still holds it (no WaitFlag between): the two collide on the hardware");
    k.flags[f] = 1;
    k.flag_by[f] = who;
    k.flag_at[f] = std::max(k.c.at[event_src(e)], k.c.at[ak::SCALAR]);
    const int src = event_src(e);
    const uint64_t now = ++k.seq;
    for (int x = 0; x < ak::NPIPES; ++x) k.flag_safe[f][x] = x == src ? now : k.safe[x][src];
}
// Clear flag (e, id); when the signalling pipe reached the SetFlag.
inline double lower_flag(HardEvent e, int32_t id) {
    auto& k = ak::core();
    const int f = flag_slot(e, id);
    if (k.flags[f] == 0) ak::fail("queue discipline", "WaitFlag on event " + event_str(e, id) + " that was never set");
    k.flags[f] = 0;
    // the waiting pipe sees what the setter saw; a wait of the scalar unit holds back the issue of
    // everything after it, so every pipe does
    const int dst = event_dst(e);
    for (int p = 0; p < ak::NPIPES; ++p)
        if (p == dst || dst == ak::SCALAR)
            for (int x = 0; x < ak::NPIPES; ++x) k.safe[x][p] = std::max(k.safe[x][p], k.flag_safe[f][x]);
    return k.flag_at[f];
}
// The waiting pipe resumes when the signalling pipe got to the SetFlag (set_at), also for a queue's
// own events: an AllocTensor's copy in waits for the FreeTensor's place in the vector pipe's program
// order, not only for the buffer's last read (the pipe executes in order and sets the flag there).
inline void wait_pipe(HardEvent e, double set_at) {
    auto& c = ak::core().c;
    c.at[event_dst(e)] = std::max({c.at[event_dst(e)], c.at[ak::SCALAR], set_at});
}
// An ID of e from the pipe's pool, held for `who` until given back.
// The pool's first free ID of e (as AllocEventID and FetchEventID pick it); all taken is an error.
inline int32_t free_id(HardEvent e, const std::string& who) {
    for (int32_t id = 0; id < ak::Core::IDS; ++id)
        if (!(ak::core().pool[int(e)] & (1u << id))) return id;
    ak::fail("events", "all 8 IDs of " + std::string(event_name(e)) + " are taken (" + who + "): release one first");
}
inline int32_t take_id(HardEvent e, const std::string& who) {
    auto& k = ak::core();
    const int32_t id = free_id(e, who);
    k.pool[int(e)] |= uint8_t(1u << id);
    k.pool_by[flag_slot(e, id)] = who;
    return id;
}
inline void give_id(HardEvent e, int32_t id, const char* api) {
    auto& k = ak::core();
    flag_slot(e, id);   // the ID's range
    if (!(k.pool[int(e)] & (1u << id)))
        ak::fail("events", std::string(api) + " of " + event_str(e, id) + ", which the pool had not handed out");
    k.pool[int(e)] &= uint8_t(~(1u << id));
}
}  // namespace detail

// With a TPipe its queues take IDs from the pipe's pool for their own SetFlag/WaitFlag, so the kernel
// must take its IDs from the same pool (AllocEventID, or FetchEventID for one SetFlag): a hand-picked
// ID can be one a queue holds (the documented rule; without a TPipe IDs are the kernel's to manage).
template <HardEvent event> inline void SetFlag(int32_t eventID) {
    auto& k = ak::core();
    const int f = detail::flag_slot(event, eventID);
    if (k.pipe) {
        const bool held = k.pool[int(event)] & (1u << eventID);
        if (held && k.pool_by[f] != "AllocEventID")
            ak::fail("events", "SetFlag on " + detail::event_str(event, eventID) + ", a hand-picked ID that " + k.pool_by[f] +
                     " holds: take IDs from GetTPipePtr()->AllocEventID / FetchEventID");
        if (!held && k.fetched[int(event)] != eventID)
            ak::fail("events", "SetFlag on " + detail::event_str(event, eventID) + ", an ID not taken from the TPipe's pool: "
                     "its queues draw theirs from it (GetTPipePtr()->AllocEventID<" + detail::event_name(event) +
                     ">() or FetchEventID)");
        if (!held) k.fetched[int(event)] = -1;   // a fetched ID is good for one SetFlag
    }
    detail::raise_flag(event, eventID, "a SetFlag of the kernel");
}
template <HardEvent event> inline void WaitFlag(int32_t eventID) {
    detail::wait_pipe(event, detail::lower_flag(event, eventID));
}

// ---- TPipe / TQue / TBuf -----------------------------------------------------------------------
namespace detail {
inline const char* position_name(TPosition p) {
    return p == TPosition::VECIN ? "VECIN" : p == TPosition::VECOUT ? "VECOUT" : p == TPosition::VECCALC ? "VECCALC"
         : p == TPosition::A1 ? "A1" : p == TPosition::B1 ? "B1" : p == TPosition::A2 ? "A2" : p == TPosition::B2 ? "B2"
         : p == TPosition::CO1 ? "CO1" : "other";
}
// The events a queue between two positions synchronises with: EnQue sets `enque` (DeQue waits on it),
// FreeTensor sets `free` (the next AllocTensor of that buffer waits on it); each with an ID from the
// pipe's pool, held until the wait. VECCALC queues stay on the vector pipe: no events.
struct QueueEvents { bool synced; HardEvent enque, free; };
constexpr QueueEvents queue_events(TPosition src, TPosition dst) {
    return src == TPosition::VECIN && dst == TPosition::VECOUT ? QueueEvents{true, HardEvent::MTE2_MTE3, HardEvent::MTE3_MTE2}
         : src == TPosition::VECIN ? QueueEvents{true, HardEvent::MTE2_V, HardEvent::V_MTE2}
         : src == TPosition::VECOUT ? QueueEvents{true, HardEvent::V_MTE3, HardEvent::MTE3_V}
         : src == TPosition::A1 || src == TPosition::B1 ? QueueEvents{true, HardEvent::MTE2_MTE1, HardEvent::MTE1_MTE2}
         : src == TPosition::A2 || src == TPosition::B2 ? QueueEvents{true, HardEvent::MTE1_M, HardEvent::M_MTE1}
         : src == TPosition::CO1 ? QueueEvents{true, HardEvent::M_FIX, HardEvent::FIX_M}
         : QueueEvents{false, HardEvent::V_V, HardEvent::V_V};
}
}  // namespace detail

// A queue of `num` UB buffers between positions src and dst (TQue: src = dst = pos).
template <TPosition src, TPosition dst, int32_t depth> class TQueImpl {
    static constexpr detail::QueueEvents ev = detail::queue_events(src, dst);
 public:
    void init(uint8_t num, uint32_t len, int index) {
        num_ = num; len_ = len;
        for (int i = 0; i < num; ++i) {
            std::string name = "InitBuffer #" + std::to_string(index) + " (" + (src == dst ? std::string("TQue ") +
                               detail::position_name(src) : std::string("TQueBind ") + detail::position_name(src) + "->" +
                               detail::position_name(dst)) + ", buffer " + std::to_string(i) + " of " +
                               std::to_string(num) + ", " + std::to_string(len) + " B)";
            static_assert(detail::memory_of(src) != ak::NMEMS, "a queue at a position the emulator does not model");
            bufs_.push_back(ak::core().alloc(len, name, detail::memory_of(src)));
            slots_.push_back(ak::core().new_slot(name, detail::memory_of(src)));
            busy_.push_back(false);
            free_id_.push_back(-1);
        }
    }
    // Buffers are handed out round robin from a cursor (skipping busy ones), as AscendC's TQue does:
    // with two buffers, CopyIn(i + 1) lands in the other buffer from the one Compute(i) still reads,
    // which is what lets double buffering overlap the pipes.
    template <typename T> LocalTensor<T> AllocTensor() {
        for (size_t k = 0; k < bufs_.size(); ++k) {
            const size_t i = (cursor_ + k) % bufs_.size();
            if (!busy_[i]) {
                busy_[i] = true;
                cursor_ = (i + 1) % bufs_.size();
                if (free_id_[i] >= 0) {   // the wait on this buffer's FreeTensor
                    detail::wait_pipe(ev.free, detail::lower_flag(ev.free, free_id_[i]));
                    detail::give_id(ev.free, free_id_[i], "AllocTensor");
                    free_id_[i] = -1;
                }
                return LocalTensor<T>(reinterpret_cast<T*>(bufs_[i]), len_ / sizeof(T), slots_[i]);
            }
        }
        ak::fail("queue discipline", "AllocTensor beyond the " + std::to_string(num_) + " buffer(s) of " +
                 (slots_.empty() ? std::string("an uninitialised queue") : slots_[0]->name) + " without a FreeTensor");
    }
    template <typename T> void FreeTensor(LocalTensor<T>& t) {
        for (size_t i = 0; i < bufs_.size(); ++i)
            if (slots_[i] == t.slot()) {
                if (!busy_[i]) ak::fail("queue discipline", "FreeTensor of a buffer that is not allocated (" + slots_[i]->name + ")");
                busy_[i] = false;
                if constexpr (ev.synced) {
                    const std::string who = "the FreeTensor of " + slots_[i]->name;
                    free_id_[i] = detail::take_id(ev.free, who);
                    detail::raise_flag(ev.free, free_id_[i], who);
                }
                return;
            }
        ak::fail("queue discipline", "FreeTensor of a tensor from another queue");
    }
    template <typename T> bool EnQue(const LocalTensor<T>& t) {
        if (depth > 0 && int32_t(queued_.size()) >= std::max<int32_t>(depth, 1) && int32_t(queued_.size()) >= num_)
            ak::fail("queue discipline", "EnQue beyond the queue depth " + std::to_string(depth) + " (" + t.slot()->name + ")");
        int32_t id = -1;
        if constexpr (ev.synced) {
            const std::string who = "the EnQue of " + t.slot()->name;
            id = detail::take_id(ev.enque, who);
            detail::raise_flag(ev.enque, id, who);
        }
        queued_.push_back({reinterpret_cast<uint8_t*>(t.ak_ptr()), t.slot(), t.GetSize() * uint32_t(sizeof(T)), id});
        return true;
    }
    template <typename T> LocalTensor<T> DeQue() {
        if (queued_.empty())
            ak::fail("queue discipline", "DeQue of an empty queue (" + (slots_.empty() ? std::string("uninitialised") : slots_[0]->name) + ")");
        auto e = queued_.front();
        queued_.erase(queued_.begin());
        if constexpr (ev.synced) {
            detail::wait_pipe(ev.enque, detail::lower_flag(ev.enque, e.id));
            detail::give_id(ev.enque, e.id, "DeQue");
        }
        return LocalTensor<T>(reinterpret_cast<T*>(e.ptr), e.bytes / sizeof(T), e.slot);
    }
    template <typename T> void DeQue(LocalTensor<T>& t) { t = DeQue<T>(); }
    bool VacantInQue() { return std::any_of(busy_.begin(), busy_.end(), [](bool b) { return !b; }); }
    bool HasTensorInQue() { return !queued_.empty(); }
 private:
    struct Entry { uint8_t* ptr; ak::Slot* slot; uint32_t bytes; int32_t id; };
    int32_t num_ = 0;
    uint32_t len_ = 0;
    std::vector<uint8_t*> bufs_;
    std::vector<ak::Slot*> slots_;
    std::vector<bool> busy_;
    std::vector<int32_t> free_id_;   // per buffer: the ID its FreeTensor holds until the next AllocTensor
    size_t cursor_ = 0;
    std::vector<Entry> queued_;
};
template <TPosition pos, int32_t depth, auto mask = 0> class TQue : public TQueImpl<pos, pos, depth> {};
template <TPosition src, TPosition dst, int32_t depth, auto mask = 0> class TQueBind : public TQueImpl<src, dst, depth> {};

template <TPosition pos = TPosition::VECCALC> class TBuf {
 public:
    void init(uint32_t len, int index) {
        len_ = len;
        static_assert(detail::memory_of(pos) != ak::NMEMS, "a TBuf at a position the emulator does not model");
        std::string name = "InitBuffer #" + std::to_string(index) + " (TBuf, " + std::to_string(len) + " B)";
        buf_ = ak::core().alloc(len, name, detail::memory_of(pos));
        slot_ = ak::core().new_slot(name, detail::memory_of(pos));
    }
    template <typename T> LocalTensor<T> Get() { return LocalTensor<T>(reinterpret_cast<T*>(buf_), len_ / sizeof(T), slot_); }
    template <typename T> LocalTensor<T> Get(uint32_t len) {
        if (len * sizeof(T) > len_) ak::fail("UB bounds", "TBuf::Get of " + std::to_string(len * sizeof(T)) + " B from " + slot_->name);
        return LocalTensor<T>(reinterpret_cast<T*>(buf_), len, slot_);
    }
    template <typename T> LocalTensor<T> GetWithOffset(uint32_t size, uint32_t bufOffset) {
        if (bufOffset + size * sizeof(T) > len_) ak::fail("UB bounds", "TBuf::GetWithOffset beyond " + slot_->name);
        return LocalTensor<T>(reinterpret_cast<T*>(buf_ + bufOffset), size, slot_);
    }
 private:
    uint8_t* buf_ = nullptr;
    uint32_t len_ = 0;
    ak::Slot* slot_ = nullptr;
};

class TPipe {
 public:
    template <class Q> bool InitBuffer(Q& que, uint8_t num, uint32_t len) {
        que.init(num, (len + 31) / 32 * 32, ++ak::core().init_count);   // sizes round up to 32 B
        return true;
    }
    template <TPosition pos> bool InitBuffer(TBuf<pos>& buf, uint32_t len) {
        buf.init((len + 31) / 32 * 32, ++ak::core().init_count);
        return true;
    }
    TPipe() {
        if (ak::core().pipe) ak::fail("queue discipline", "a second TPipe in one kernel");
        ak::core().pipe = this;
    }
    ~TPipe() { if (ak::core().pipe == this) ak::core().pipe = nullptr; }
    template <HardEvent evt> TEventID AllocEventID() { return TEventID(detail::take_id(evt, "AllocEventID")); }
    template <HardEvent evt> void ReleaseEventID(TEventID id) {
        if (ak::core().flags[detail::flag_slot(evt, id)])
            ak::fail("events", "ReleaseEventID of " + detail::event_str(evt, id) + " while its SetFlag still waits for a WaitFlag");
        detail::give_id(evt, id, "ReleaseEventID");
    }
    // the first ID of evt the pool has free, not taken: good for the next SetFlag<evt> only
    TEventID FetchEventID(HardEvent evt) {
        const int32_t id = detail::free_id(evt, "FetchEventID");
        ak::core().fetched[int(evt)] = id;
        return TEventID(id);
    }
    template <HardEvent evt> TEventID FetchEventID() { return FetchEventID(evt); }
    void Init() {}
    void Destroy() {}
    void Reset() {}
};
inline TPipe* GetTPipePtr() {
    if (!ak::core().pipe) ak::fail("queue discipline", "GetTPipePtr before the kernel's TPipe exists");
    return static_cast<TPipe*>(ak::core().pipe);
}

// ---- core indexing and synchronisation ---------------------------------------------------------
// On a split-core chip the AIC and each AIV run the kernel as separate programs: ASCEND_IS_AIV /
// ASCEND_IS_AIC (or g_coreType) pick each one's part. An AIV's GetBlockIdx counts vector cores
// (block * GetTaskRatio() + GetSubBlockIdx()); GetBlockNum is the launch's block count either way.
constexpr int32_t MIX = 0, AIC = 1, AIV = 2;
#define g_coreType (::ak::core().kind)
#define ASCEND_IS_AIV (g_coreType == ::AscendC::AIV)
#define ASCEND_IS_AIC (g_coreType == ::AscendC::AIC)
#define ASCEND_IS_NOT_AIV (g_coreType != ::AscendC::AIV)
#define ASCEND_IS_NOT_AIC (g_coreType != ::AscendC::AIC)
inline int64_t GetTaskRatio() { auto& k = ak::core(); return k.kind == AIV ? k.aiv_per_block : 1; }
inline int64_t GetBlockIdx() { auto& k = ak::core(); return k.kind == AIV ? k.block_idx * k.aiv_per_block + k.sub_idx : k.block_idx; }
inline int64_t GetBlockNum() { return ak::core().block_num; }
inline int64_t GetSubBlockIdx() { return ak::core().sub_idx; }
inline int64_t GetSubBlockNum() { return GetTaskRatio(); }
constexpr int16_t GetDataBlockSizeInBytes() { return 32; }

namespace detail {
inline ak::Pipe pipe_of(pipe_t p) {
    switch (p) {
        case PIPE_V: return ak::VEC; case PIPE_M: return ak::CUBE; case PIPE_MTE1: return ak::MTE1;
        case PIPE_MTE2: return ak::MTE2; case PIPE_MTE3: return ak::MTE3; case PIPE_FIX: return ak::FIX;
        default: return ak::SCALAR;
    }
}
inline void check_cross_core(uint8_t mode, uint16_t flag, const char* api) {
    if (mode > 2) ak::fail(api, "modeId " + std::to_string(mode) + ": Atlas A2/A3 have modes 0 (every core of a kind), "
                           "1 (the two AIVs of an AI core) and 2 (an AIC and its AIVs); mode 4 is Ascend 950's");
    if (flag > 10) ak::fail(api, "flagId " + std::to_string(flag) + " outside 0..10 (the Atlas A2/A3 range; 11-14 are SyncAll's)");
    const int type = ak::core().kernel_type;
    if (type != KERNEL_TYPE_MIX_AIV_1_0 && type != KERNEL_TYPE_MIX_AIC_1_0 && type != KERNEL_TYPE_MIX_AIC_1_1 &&
        type != KERNEL_TYPE_MIX_AIC_1_2)
        ak::fail(api, "in a kernel not declared a mix type (KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2), or "
                 "MIX_AIV_1_0 / MIX_AIC_1_0 for one kind of core): the cores it syncs with are not launched for it");
    if (mode == 1 && ak::core().kind != AIV) ak::fail(api, "mode 1 syncs the two AIVs of an AI core: not for the AIC");
}
}  // namespace detail

// Cross-core flags (documented for Atlas A2/A3): each flagId is a counter per receiving core, at
// most 15 sets ahead of its waits. Mode 0: a wait returns once every core of the waiter's kind set
// the flag; mode 1: once both AIVs of its AI core did; mode 2: an AIV's once its AIC did, the AIC's
// once both its AIVs did. The setter's pipe signals when it reaches the set.
template <uint8_t modeId, pipe_t pipe> inline void CrossCoreSetFlag(uint16_t flagId) {
    static_assert(pipe != PIPE_S && pipe != PIPE_ALL, "CrossCoreSetFlag on Atlas A2/A3 takes a pipe (PIPE_S is Ascend 950's)");
    detail::check_cross_core(modeId, flagId, "CrossCoreSetFlag");
    auto& c = ak::core().c;
    ak::cross_core_set(modeId, flagId, std::max(c.at[detail::pipe_of(pipe)], c.at[ak::SCALAR]));
}
template <uint8_t modeId = 0, pipe_t pipe = PIPE_S> inline void CrossCoreWaitFlag(uint16_t flagId) {
    static_assert(pipe != PIPE_ALL, "CrossCoreWaitFlag takes one pipe");
    detail::check_cross_core(modeId, flagId, "CrossCoreWaitFlag");
    if (modeId == 0 && !ak::batch_mode)
        ak::fail("CrossCoreWaitFlag", "mode 0 in a kernel launched without batch mode (the tiling's SetScheduleMode(1)):"
                 " cores another stream holds may never arrive");
    const double at = ak::cross_core_wait(modeId, flagId);
    auto& c = ak::core().c;   // the waiting pipe resumes then; a scalar wait holds back everything after it
    const ak::Pipe p = detail::pipe_of(pipe);
    for (int q = 0; q < ak::NPIPES; ++q)
        if (q == p || p == ak::SCALAR) c.at[q] = std::max({c.at[q], c.at[ak::SCALAR], at});
}

template <pipe_t pipe> inline void PipeBarrier() {
    static_assert(pipe != PIPE_S, "PipeBarrier takes PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_M, PIPE_MTE1, PIPE_FIX or PIPE_ALL");
    auto& c = ak::core().c;
    if (pipe == PIPE_ALL) {
        const double t = c.makespan();
        for (double& a : c.at) a = t;
        auto& k = ak::core();
        const uint64_t now = ++k.seq;
        for (auto& row : k.safe) for (uint64_t& v : row) v = now;
    }
}
// The hard SyncAll: every AIV (isAIVOnly) or every core waits for the others, then goes on from the
// last one's arrival. The hardware needs the kernel declared a mix type (vector-only:
// KERNEL_TYPE_MIX_AIV_1_0; Cube + Vector: MIX_AIC_1_1 / 1_2) and the launch in batch mode
// (SetScheduleMode(1)), or cores another stream holds never arrive.
template <bool isAIVOnly = true> void SyncAll() {
    auto& k = ak::core();
    if (isAIVOnly && k.kernel_type != KERNEL_TYPE_MIX_AIV_1_0 && k.kernel_type != KERNEL_TYPE_MIX_AIC_1_1 &&
        k.kernel_type != KERNEL_TYPE_MIX_AIC_1_2)
        ak::fail("SyncAll", "SyncAll<true> in a kernel not declared KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0)"
                 " (or a Cube + Vector mix type): without it the cores hang");
    if (isAIVOnly && k.kind != AIV) ak::fail("SyncAll", "SyncAll<true> syncs the AIVs: not for the AIC (SyncAll<false> syncs every core)");
    if (!isAIVOnly && k.kernel_type != KERNEL_TYPE_MIX_AIC_1_1 && k.kernel_type != KERNEL_TYPE_MIX_AIC_1_2)
        ak::fail("SyncAll", "SyncAll<false> in a kernel not declared KERNEL_TYPE_MIX_AIC_1_1 or KERNEL_TYPE_MIX_AIC_1_2");
    if (!ak::batch_mode)
        ak::fail("SyncAll", "SyncAll in a kernel launched without batch mode (the tiling's SetScheduleMode(1)):"
                 " blocks another stream holds may never start, and the ones waiting hang");
    const double at = ak::sync_all(isAIVOnly, k.c.makespan());
    for (double& a : k.c.at) a = std::max(a, at);
}

// ---- data movement -----------------------------------------------------------------------------
namespace detail {
// A store of n elements to GM: a copy, or with SetAtomicAdd<T> on, an atomic add of each (the NPU
// adds in the memory system, so cores adding to the same GM at once all count). The atomic type
// must be the stored one.
template <typename T> void atomic_add(T* at, T v) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4);
    using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
    auto* word = reinterpret_cast<Bits*>(at);
    Bits seen = __atomic_load_n(word, __ATOMIC_RELAXED), next;
    do {
        T cur;
        std::memcpy(&cur, &seen, sizeof(T));
        const T sum = T(float(cur) + float(v));
        std::memcpy(&next, &sum, sizeof(T));
    } while (!__atomic_compare_exchange_n(word, &seen, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}
template <typename T> constexpr int atomic_tag() {
    return std::is_same_v<T, float> ? 1 : std::is_same_v<T, half> ? 2 : std::is_same_v<T, bfloat16_t> ? 3 : -1;
}
// whether GM stores of T by `api` add (SetAtomicAdd is on), checking it is on for T
template <typename T> bool atomic_on(const char* api) {
    const int atomic = ak::core().atomic;
    if (atomic && atomic != atomic_tag<T>())
        ak::fail("atomic", std::string(api) + " of another type than SetAtomicAdd's: the add would read the bits as that type");
    return atomic != 0;
}
template <typename T> void gm_store(T* dst, const T* src, uint64_t n, const char* api) {
    if (!atomic_on<T>(api)) { std::memcpy(dst, src, n * sizeof(T)); return; }
    if constexpr (atomic_tag<T>() > 0) {
        for (uint64_t i = 0; i < n; ++i) atomic_add(dst + i, src[i]);
    }
}

// GM traffic of `bytes` at `gm`: HBM traffic, or L2 traffic where the launch keeps that buffer in L2
// (a workspace small enough to stay there: the build's l2_args; or a vector core's read of a buffer
// whose same bytes its AI core's Cube side read just before: l2_vector_reads); the MTE cycles of
// `moved` bytes at that level's rate (HBM: the core's share; L2: the core's own MTE limit)
inline double gm_cycles(const void* gm, uint64_t bytes, bool write, uint64_t moved) {
    auto& c = ak::core().c;
    const bool l2 = ak::gm_in_l2(gm, !write && ak::core().kind == 2);
    (l2 ? (write ? c.l2_written : c.l2_read) : (write ? c.gm_written : c.gm_read)) += bytes;
    return AK_MTE_LATENCY + double(moved) / (l2 ? AK_L2_BYTES_PER_CYCLE : ak::hbm_bytes_per_cycle);
}
// the count form moves count * size bytes only when that is a multiple of 32 B
inline void check_copy_32b(uint32_t count, size_t size, const char* dir, const ak::Slot* slot) {
    if ((uint64_t(count) * size) % 32 != 0)
        ak::fail("DataCopy 32 B", std::string(dir) + " DataCopy of " + std::to_string(count) + " x " + std::to_string(size) +
                 " B is not a multiple of 32 B (hardware rounds it down; use DataCopyPad) (" + slot->name + ")");
}
}

// SetAtomicAdd<T>: the GM writes that follow (UB -> GM copies, Fixpipe) add to what is there, as T
// (float, half, bfloat16_t here); DisableDmaAtomic turns it off. GM is not cleared first.
template <typename T> inline void SetAtomicAdd() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>,
                  "SetAtomicAdd here: float, half or bfloat16_t");
    ak::core().atomic = detail::atomic_tag<T>();
}
inline void DisableDmaAtomic() { ak::core().atomic = 0; }

template <typename T> void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const uint32_t count) {
    detail::check_copy_32b(count, sizeof(T), "GM->UB", dst.slot());
    dst.check_in(dst.mem() == ak::L1 ? ak::L1 : ak::UB, count, "DataCopy");   /* GM -> UB, or GM -> A1 / B1 */
    src.check(0, count);
    std::memcpy(dst.ak_ptr(), src.ak_ptr(), count * sizeof(T));
    ak::core().issue(ak::MTE2, detail::gm_cycles(src.ak_ptr(), count * sizeof(T), false, count * sizeof(T)), {}, {dst.slot()});
}
template <typename T> void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count) {
    detail::check_copy_32b(count, sizeof(T), "UB->GM", src.slot());
    src.check(count, "DataCopy");
    dst.check(0, count);
    detail::gm_store(dst.ak_ptr(), src.ak_ptr(), count, "DataCopy");
    ak::core().issue(ak::MTE3, detail::gm_cycles(dst.ak_ptr(), count * sizeof(T), true, count * sizeof(T)), {src.slot()}, {});
}
template <typename T> void DataCopy(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count) {
    detail::check_copy_32b(count, sizeof(T), "UB->UB", src.slot());
    dst.check(count, "DataCopy"); src.check(count, "DataCopy");
    std::memmove(dst.ak_ptr(), src.ak_ptr(), count * sizeof(T));
    ak::core().issue(ak::VEC, AK_VEC_ISSUE + double(count * sizeof(T)) / 256.0, {src.slot()}, {dst.slot()});
}
// strided bursts: blockLen and strides in 32 B blocks
template <typename T> void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyParams& p) {
    const uint32_t blk = 32 / sizeof(T);
    dst.check(uint32_t(p.blockCount) * (p.blockLen + p.dstStride) * blk - p.dstStride * blk, "DataCopy");
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        src.check(uint64_t(i) * (p.blockLen + p.srcStride) * blk, p.blockLen * blk);
        std::memcpy(dst.ak_ptr() + i * (p.blockLen + p.dstStride) * blk,
                    src.GetPhyAddr(uint64_t(i) * (p.blockLen + p.srcStride) * blk), p.blockLen * 32);
    }
    const uint64_t bytes = uint64_t(p.blockCount) * p.blockLen * 32;
    ak::core().issue(ak::MTE2, detail::gm_cycles(src.ak_ptr(), bytes, false, bytes), {}, {dst.slot()});
}
template <typename T> void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyParams& p) {
    const uint32_t blk = 32 / sizeof(T);
    src.check(uint32_t(p.blockCount) * (p.blockLen + p.srcStride) * blk - p.srcStride * blk, "DataCopy");
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        dst.check(uint64_t(i) * (p.blockLen + p.dstStride) * blk, p.blockLen * blk);
        std::memcpy(dst.GetPhyAddr(uint64_t(i) * (p.blockLen + p.dstStride) * blk),
                    src.ak_ptr() + i * (p.blockLen + p.srcStride) * blk, p.blockLen * 32);
    }
    const uint64_t bytes = uint64_t(p.blockCount) * p.blockLen * 32;
    ak::core().issue(ak::MTE3, detail::gm_cycles(dst.ak_ptr(), bytes, true, bytes), {src.slot()}, {});
}
// GM -> UB with padding: blockLen and srcStride (GM) in bytes, dstStride (UB) in 32 B blocks. Each block
// lands in UB as [leftPadding][data][rightPadding][dummy] up to 32 B alignment: with isPad the paddings
// and the dummy are paddingValue; without, they are undefined (poisoned here: NaN for floats). With
// no left or right padding the dummy repeats the block's first element, isPad or not (as documented).
template <typename T> void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                                       const DataCopyPadExtParams<T>& pad) {
    if (p.blockLen % sizeof(T) != 0) ak::fail("DataCopyPad", "blockLen " + std::to_string(p.blockLen) + " B is not a multiple of the element size");
    if (p.blockCount > 4095) ak::fail("DataCopyPad", "blockCount " + std::to_string(p.blockCount) + " > 4095");
    if (pad.leftPadding * sizeof(T) > 32 || pad.rightPadding * sizeof(T) > 32)
        ak::fail("DataCopyPad", "leftPadding " + std::to_string(pad.leftPadding) + " / rightPadding " +
                 std::to_string(pad.rightPadding) + " elements: each may cover at most 32 B");
    const uint32_t left = pad.leftPadding, right = pad.rightPadding, n = p.blockLen / sizeof(T);
    const uint32_t padded = ((left + n + right) * sizeof(T) + 31) / 32 * 32 / sizeof(T);
    const uint32_t pitch = padded + p.dstStride * (32 / sizeof(T));
    if (p.blockCount == 0 || p.blockLen == 0) return;
    dst.check((p.blockCount - 1) * pitch + padded, "DataCopyPad");
    T poison;
    std::memset(&poison, 0xff, sizeof(T));
    const uint8_t* g = reinterpret_cast<const uint8_t*>(src.ak_ptr());
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        const uint64_t goff = uint64_t(i) * (p.blockLen + p.srcStride);
        src.check(goff / sizeof(T), n);
        T* row = dst.ak_ptr() + i * pitch;
        std::memcpy(row + left, g + goff, p.blockLen);
        const T side = pad.isPad ? pad.paddingValue : poison;
        const T dummy = left == 0 && right == 0 ? row[0] : side;
        for (uint32_t j = 0; j < left; ++j) row[j] = side;
        for (uint32_t j = left + n; j < left + n + right; ++j) row[j] = side;
        for (uint32_t j = left + n + right; j < padded; ++j) row[j] = dummy;
    }
    ak::core().issue(ak::MTE2, detail::gm_cycles(src.ak_ptr(), uint64_t(p.blockCount) * p.blockLen, false,
                                                 uint64_t(p.blockCount) * padded * sizeof(T)), {}, {dst.slot()});
}
// UB -> GM: only blockLen bytes per block are written; srcStride (UB) in 32 B blocks, dstStride (GM) in bytes.
template <typename T> void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
    if (p.blockLen % sizeof(T) != 0) ak::fail("DataCopyPad", "blockLen " + std::to_string(p.blockLen) + " B is not a multiple of the element size");
    if (p.blockCount > 4095) ak::fail("DataCopyPad", "blockCount " + std::to_string(p.blockCount) + " > 4095");
    const uint32_t n = p.blockLen / sizeof(T), padded = (p.blockLen + 31) / 32 * 32 / sizeof(T);
    const uint32_t pitch = padded + p.srcStride * (32 / sizeof(T));
    if (p.blockCount == 0 || p.blockLen == 0) return;
    src.check((p.blockCount - 1) * pitch + padded, "DataCopyPad");
    uint8_t* g = reinterpret_cast<uint8_t*>(dst.ak_ptr());
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        const uint64_t goff = uint64_t(i) * (p.blockLen + p.dstStride);
        dst.check(goff / sizeof(T), n);
        detail::gm_store(reinterpret_cast<T*>(g + goff), src.ak_ptr() + i * pitch, n, "DataCopyPad");
    }
    ak::core().issue(ak::MTE3, detail::gm_cycles(dst.ak_ptr(), uint64_t(p.blockCount) * p.blockLen, true,
                                                 uint64_t(p.blockCount) * padded * sizeof(T)), {src.slot()}, {});
}

// ---- vector compute (count form and level-0 form) ----------------------------------------------
namespace detail {
inline double vec_cycles(uint64_t bytes, double factor) {
    const double repeats = __builtin_ceil(double(bytes) / ONE_REPEAT_BYTE_SIZE);
    ak::core().c.vec_repeats += uint64_t(repeats);
    return AK_VEC_ISSUE + repeats * factor;
}
template <typename T> void check_dtype_arith() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, int32_t> || std::is_same_v<T, int16_t>,
                  "vector arithmetic on A2/A3 takes half, float, int16_t or int32_t: Cast bfloat16_t to float first");
}
inline void check_repeat(int32_t repeat) {
    if (repeat > MAX_REPEAT_TIMES || repeat < 0)
        ak::fail("repeat <= 255", "a level-0 call with repeatTime " + std::to_string(repeat));
}
// elements of repeat r, block b, lane j for a level-0 operand with strides in 32 B blocks
template <typename T> inline uint32_t l0_index(uint32_t r, uint32_t b, uint32_t j, uint32_t blkStride, uint32_t repStride) {
    return (r * repStride + b * blkStride) * (32 / sizeof(T)) + j;
}
// elements from a level-0 operand's start that a call of `lanes` lanes x repeatTime repeats touches
// (one past the highest index): the UB bounds rule for the strided form
template <typename T> inline uint32_t l0_extent(uint64_t lanes, int32_t repeatTime, uint32_t blkStride, uint32_t repStride) {
    const uint32_t per_blk = 32 / sizeof(T);
    uint32_t top = 0;
    if (repeatTime <= 0 || lanes == 0) return 0;
    for (uint32_t lane = 0; lane < uint32_t(std::min<uint64_t>(lanes, 8 * per_blk)); ++lane)
        top = std::max(top, l0_index<T>(uint32_t(repeatTime - 1), lane / per_blk, lane % per_blk, blkStride, repStride) + 1);
    return top;
}
// a level-0 call: fn(r, blk, j) for every repeat and every lane the (continuous-mode) mask enables
template <typename T, typename F> void level0(uint64_t mask, int32_t repeatTime, F&& fn) {
    check_repeat(repeatTime);
    const uint32_t per_blk = 32 / sizeof(T), lanes = uint32_t(std::min<uint64_t>(mask, 8 * per_blk));
    for (uint32_t r = 0; r < uint32_t(repeatTime); ++r)
        for (uint32_t lane = 0; lane < lanes; ++lane) fn(r, lane / per_blk, lane % per_blk);
}
}  // namespace detail

#define AK_BINARY(NAME, EXPR)                                                                                  \
    template <typename T> void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, \
                                    const int32_t& count) {                                                    \
        detail::check_dtype_arith<T>();                                                                        \
        dst.check(count, #NAME); src0.check(count, #NAME); src1.check(count, #NAME);                           \
        T* d = dst.ak_ptr(); const T* a = src0.ak_ptr(); const T* b = src1.ak_ptr();              \
        for (int32_t i = 0; i < count; ++i) { const T x = a[i], y = b[i]; d[i] = (EXPR); }                    \
        ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), FACTOR_##NAME),               \
                         {src0.slot(), src1.slot()}, {dst.slot()});                                            \
    }                                                                                                          \
    template <typename T, bool isSetMask = true> void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src0, \
            const LocalTensor<T>& src1, uint64_t mask, const uint8_t repeatTime, const BinaryRepeatParams& p) { \
        detail::check_dtype_arith<T>();                                                                        \
        dst.check(detail::l0_extent<T>(mask, repeatTime, p.dstBlkStride, p.dstRepStride), #NAME);               \
        src0.check(detail::l0_extent<T>(mask, repeatTime, p.src0BlkStride, p.src0RepStride), #NAME);            \
        src1.check(detail::l0_extent<T>(mask, repeatTime, p.src1BlkStride, p.src1RepStride), #NAME);            \
        detail::level0<T>(mask, repeatTime, [&](uint32_t r, uint32_t blk, uint32_t j) {                        \
            const T x = src0.ak_ptr()[detail::l0_index<T>(r, blk, j, p.src0BlkStride, p.src0RepStride)];   \
            const T y = src1.ak_ptr()[detail::l0_index<T>(r, blk, j, p.src1BlkStride, p.src1RepStride)];   \
            dst.ak_ptr()[detail::l0_index<T>(r, blk, j, p.dstBlkStride, p.dstRepStride)] = (EXPR);        \
        });                                                                                                    \
        ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(repeatTime) * 256, FACTOR_##NAME),                \
                         {src0.slot(), src1.slot()}, {dst.slot()});                                            \
    }

constexpr double FACTOR_Add = 1, FACTOR_Sub = 1, FACTOR_Mul = 1, FACTOR_Max = 1, FACTOR_Min = 1, FACTOR_Div = AK_VEC_SLOW_FACTOR;
AK_BINARY(Add, T(x + y))
AK_BINARY(Sub, T(x - y))
AK_BINARY(Mul, T(x * y))
AK_BINARY(Div, T(x / y))
AK_BINARY(Max, (x > y ? x : y))
AK_BINARY(Min, (x < y ? x : y))
#undef AK_BINARY

#define AK_SCALAR_BINARY(NAME, EXPR)                                                                           \
    template <typename T> void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalarValue, \
                                    const int32_t& count) {                                                    \
        detail::check_dtype_arith<T>();                                                                        \
        dst.check(count, #NAME); src.check(count, #NAME);                                                      \
        T* d = dst.ak_ptr(); const T* a = src.ak_ptr(); const T s = scalarValue;                      \
        for (int32_t i = 0; i < count; ++i) { const T x = a[i]; d[i] = (EXPR); }                              \
        ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {src.slot()}, {dst.slot()}); \
    }                                                                                                          \
    template <typename T, bool isSetMask = true> void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, \
            const T& scalarValue, uint64_t mask, const uint8_t repeatTime, const UnaryRepeatParams& p) {        \
        detail::check_dtype_arith<T>(); const T s = scalarValue;                                               \
        dst.check(detail::l0_extent<T>(mask, repeatTime, p.dstBlkStride, p.dstRepStride), #NAME);               \
        src.check(detail::l0_extent<T>(mask, repeatTime, p.srcBlkStride, p.srcRepStride), #NAME);               \
        detail::level0<T>(mask, repeatTime, [&](uint32_t r, uint32_t blk, uint32_t j) {                        \
            const T x = src.ak_ptr()[detail::l0_index<T>(r, blk, j, p.srcBlkStride, p.srcRepStride)];      \
            dst.ak_ptr()[detail::l0_index<T>(r, blk, j, p.dstBlkStride, p.dstRepStride)] = (EXPR);         \
        });                                                                                                    \
        ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(repeatTime) * 256, 1.0), {src.slot()}, {dst.slot()}); \
    }
AK_SCALAR_BINARY(Adds, T(x + s))
AK_SCALAR_BINARY(Muls, T(x * s))
AK_SCALAR_BINARY(Maxs, (x > s ? x : s))
AK_SCALAR_BINARY(Mins, (x < s ? x : s))
#undef AK_SCALAR_BINARY

#define AK_UNARY(NAME, EXPR, FACTOR)                                                                           \
    template <typename T> void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t& count) { \
        detail::check_dtype_arith<T>();                                                                        \
        dst.check(count, #NAME); src.check(count, #NAME);                                                      \
        T* d = dst.ak_ptr(); const T* a = src.ak_ptr();                                                \
        for (int32_t i = 0; i < count; ++i) { const float x = float(a[i]); d[i] = T(EXPR); }                  \
        ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), FACTOR), {src.slot()}, {dst.slot()}); \
    }                                                                                                          \
    template <typename T, bool isSetMask = true> void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, \
            uint64_t mask, const uint8_t repeatTime, const UnaryRepeatParams& p) {                             \
        detail::check_dtype_arith<T>();                                                                        \
        dst.check(detail::l0_extent<T>(mask, repeatTime, p.dstBlkStride, p.dstRepStride), #NAME);               \
        src.check(detail::l0_extent<T>(mask, repeatTime, p.srcBlkStride, p.srcRepStride), #NAME);               \
        detail::level0<T>(mask, repeatTime, [&](uint32_t r, uint32_t blk, uint32_t j) {                        \
            const float x = float(src.ak_ptr()[detail::l0_index<T>(r, blk, j, p.srcBlkStride, p.srcRepStride)]);\
            dst.ak_ptr()[detail::l0_index<T>(r, blk, j, p.dstBlkStride, p.dstRepStride)] = T(EXPR);        \
        });                                                                                                    \
        ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(repeatTime) * 256, FACTOR), {src.slot()}, {dst.slot()}); \
    }
AK_UNARY(Exp, __builtin_expf(x), AK_VEC_SLOW_FACTOR)
AK_UNARY(Ln, __builtin_logf(x), AK_VEC_SLOW_FACTOR)
AK_UNARY(Sqrt, __builtin_sqrtf(x), AK_VEC_SLOW_FACTOR)
AK_UNARY(Rsqrt, 1.0f / __builtin_sqrtf(x), AK_VEC_SLOW_FACTOR)
AK_UNARY(Reciprocal, 1.0f / x, AK_VEC_SLOW_FACTOR)
AK_UNARY(Abs, __builtin_fabsf(x), 1.0)
AK_UNARY(Relu, (x > 0.0f ? x : 0.0f), 1.0)
#undef AK_UNARY

// Multiply-accumulate into dst, one vector pass each (count form; dst and sources of one type here):
//   Axpy       dst = src * scalarValue + dst
//   MulAddDst  dst = src0 * src1 + dst
template <typename T, typename U> void Axpy(const LocalTensor<T>& dst, const LocalTensor<U>& src, const U& scalarValue,
                                            const int32_t& count) {
    static_assert(std::is_same_v<T, U> && (std::is_same_v<T, float> || std::is_same_v<T, half>),
                  "Axpy: emulated for half or float, dst and src of one type");
    dst.check(count, "Axpy"); src.check(count, "Axpy");
    T* d = dst.ak_ptr(); const U* a = src.ak_ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = T(float(a[i]) * float(scalarValue) + float(d[i]));
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {src.slot(), dst.slot()}, {dst.slot()});
}
template <typename T, typename U> void MulAddDst(const LocalTensor<T>& dst, const LocalTensor<U>& src0, const LocalTensor<U>& src1,
                                                 const int32_t& count) {
    static_assert(std::is_same_v<T, U> && (std::is_same_v<T, float> || std::is_same_v<T, half>),
                  "MulAddDst: emulated for half or float, dst and sources of one type");
    dst.check(count, "MulAddDst"); src0.check(count, "MulAddDst"); src1.check(count, "MulAddDst");
    T* d = dst.ak_ptr(); const U* a = src0.ak_ptr(); const U* b = src1.ak_ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = T(float(a[i]) * float(b[i]) + float(d[i]));
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {src0.slot(), src1.slot(), dst.slot()},
                     {dst.slot()});
}

namespace detail {
template <typename T> float to_f(T v) { return float(v); }
template <typename T> uint16_t bits16(T v) { uint16_t b; std::memcpy(&b, &v, 2); return b; }
template <typename T> T from_bits16(uint16_t b) { T v; std::memcpy(&v, &b, 2); return v; }
// the 16-bit float next to v toward +inf (up) or -inf (down)
template <typename T> T step16(T v, bool up) {
    uint16_t b = bits16(v);
    if ((b & 0x7fff) == 0) return from_bits16<T>(up ? 0x0001 : 0x8001);
    const bool neg = b & 0x8000;
    b = up != neg ? uint16_t(b + 1) : uint16_t(b - 1);   // magnitude up for (up, +) and (down, -)
    return from_bits16<T>(b);
}
// f rounded to the 16-bit float T in `mode` (the modes round to T's precision, not to an integer)
template <typename T> T round16(float f, RoundMode mode) {
    const T r = T(f);   // nearest even
    const float rf = float(r);
    if (rf == f || f != f || mode == RoundMode::CAST_NONE || mode == RoundMode::CAST_RINT) return r;
    const T lo = rf < f ? r : step16(r, false), hi = rf < f ? step16(r, true) : r;
    switch (mode) {
        case RoundMode::CAST_FLOOR: return lo;
        case RoundMode::CAST_CEIL: return hi;
        case RoundMode::CAST_TRUNC: return f > 0 ? lo : hi;
        case RoundMode::CAST_ROUND: {   // nearest, ties away from zero
            const float dl = f - float(lo), dh = float(hi) - f;
            return dl < dh ? lo : dh < dl ? hi : (f > 0 ? hi : lo);
        }
        case RoundMode::CAST_ODD: return (bits16(lo) & 1) ? lo : hi;   // inexact: the neighbour with an odd last bit
        default: return r;
    }
}
template <typename T> T from_f(float f, RoundMode mode) {
    if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>) {
        return round16<T>(f, mode);
    } else {   // integers, and float -> float: rounded to an integer in the mode
        float r = f;
        switch (mode) {
            case RoundMode::CAST_FLOOR: r = __builtin_floorf(f); break;
            case RoundMode::CAST_CEIL: r = __builtin_ceilf(f); break;
            case RoundMode::CAST_ROUND: r = __builtin_roundf(f); break;
            case RoundMode::CAST_TRUNC: r = __builtin_truncf(f); break;
            case RoundMode::CAST_RINT: r = __builtin_nearbyintf(f); break;
            default: if constexpr (std::is_integral_v<T>) r = __builtin_nearbyintf(f); break;
        }
        return T(r);
    }
}

// The (source, destination, round mode) combinations Atlas A2/A3 document for the vector Cast.
template <typename S, typename D> constexpr bool cast_mode_ok(RoundMode m) {
    const bool none = m == RoundMode::CAST_NONE;
    const bool rounding = m == RoundMode::CAST_RINT || m == RoundMode::CAST_FLOOR || m == RoundMode::CAST_CEIL ||
                          m == RoundMode::CAST_ROUND || m == RoundMode::CAST_TRUNC;
    if constexpr (std::is_same_v<D, float>) {
        if constexpr (std::is_same_v<S, half> || std::is_same_v<S, bfloat16_t> || std::is_same_v<S, int16_t>) return none;
        if constexpr (std::is_same_v<S, int32_t>) return none || rounding;
        if constexpr (std::is_same_v<S, float> || std::is_same_v<S, int64_t>) return rounding;
    } else if constexpr (std::is_same_v<S, float>) {
        if constexpr (std::is_same_v<D, half>) return none || rounding || m == RoundMode::CAST_ODD;
        if constexpr (std::is_same_v<D, bfloat16_t> || std::is_same_v<D, int16_t> || std::is_same_v<D, int32_t> ||
                      std::is_same_v<D, int64_t>) return rounding;
    } else if constexpr (std::is_same_v<S, half>) {
        if constexpr (std::is_same_v<D, int8_t> || std::is_same_v<D, uint8_t>) return none || rounding;
        if constexpr (std::is_same_v<D, int16_t> || std::is_same_v<D, int32_t>) return rounding;
    } else if constexpr (std::is_same_v<D, half>) {
        if constexpr (std::is_same_v<S, int8_t> || std::is_same_v<S, uint8_t>) return none;
        if constexpr (std::is_same_v<S, int16_t>) return none || rounding;
    } else if constexpr (std::is_same_v<S, bfloat16_t> && std::is_same_v<D, int32_t>) {
        return rounding;
    } else if constexpr ((std::is_same_v<S, int32_t> && std::is_same_v<D, int16_t>) ||
                         (std::is_same_v<S, int32_t> && std::is_same_v<D, int64_t>) ||
                         (std::is_same_v<S, int64_t> && std::is_same_v<D, int32_t>)) {
        return none;
    }
    return false;
}
inline const char* mode_name(RoundMode m) {
    static const char* names[] = {"CAST_NONE", "CAST_RINT", "CAST_FLOOR", "CAST_CEIL", "CAST_ROUND", "CAST_TRUNC", "CAST_ODD"};
    return names[int(m)];
}
template <typename T> const char* type_name() {
    if constexpr (std::is_same_v<T, float>) return "float";
    else if constexpr (std::is_same_v<T, half>) return "half";
    else if constexpr (std::is_same_v<T, bfloat16_t>) return "bfloat16_t";
    else if constexpr (std::is_same_v<T, int32_t>) return "int32_t";
    else if constexpr (std::is_same_v<T, int16_t>) return "int16_t";
    else if constexpr (std::is_same_v<T, int64_t>) return "int64_t";
    else if constexpr (std::is_same_v<T, int8_t>) return "int8_t";
    else if constexpr (std::is_same_v<T, uint8_t>) return "uint8_t";
    else return "another type";
}
}  // namespace detail

template <typename T, typename U> void Cast(const LocalTensor<T>& dst, const LocalTensor<U>& src, const RoundMode& roundMode,
                                            const uint32_t count) {
    if (!detail::cast_mode_ok<U, T>(roundMode))
        ak::fail("Cast", std::string("Cast from ") + detail::type_name<U>() + " to " + detail::type_name<T>() + " with " +
                 detail::mode_name(roundMode) + ": not a combination Atlas A2/A3 support (their Cast table)");
    dst.check(count, "Cast"); src.check(count, "Cast");
    T* d = dst.ak_ptr(); const U* s = src.ak_ptr();
    for (uint32_t i = 0; i < count; ++i) d[i] = detail::from_f<T>(detail::to_f(s[i]), roundMode);
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * std::max(sizeof(T), sizeof(U)), 1.0), {src.slot()}, {dst.slot()});
}

// Gather (count form): dst[i] = src[(srcBaseAddr + srcOffset[i]) / sizeof(T)], offsets in bytes, each a
// whole element inside src (16- and 32-bit types on A2/A3). Cost: the slow-op rate per 256 B (ESTIMATE).
template <typename T> void Gather(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<uint32_t>& srcOffset,
                                  const uint32_t srcBaseAddr, const uint32_t count) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Gather on A2/A3 takes 16- or 32-bit elements");
    dst.check(count, "Gather"); srcOffset.check(count, "Gather"); src.check(0, "Gather");
    const uint32_t* off = srcOffset.ak_ptr();
    for (uint32_t i = 0; i < count; ++i) {
        const uint64_t byte = uint64_t(srcBaseAddr) + off[i];
        if (byte % sizeof(T) != 0)
            ak::fail("Gather", "offset " + std::to_string(byte) + " B of element " + std::to_string(i) + " is not a whole element");
        if (byte / sizeof(T) >= src.GetSize())
            ak::fail("UB bounds", "Gather of element " + std::to_string(byte / sizeof(T)) + " from a LocalTensor of " +
                     std::to_string(src.GetSize()));
        dst.ak_ptr()[i] = src.ak_ptr()[byte / sizeof(T)];
    }
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), AK_VEC_SLOW_FACTOR), {src.slot(), srcOffset.slot()},
                     {dst.slot()});
}

// Copy (level 0, continuous mask): a bit-exact UB -> UB copy of `mask` lanes per repeat, the strides
// in 32 B blocks as CopyRepeatParams gives them (16- and 32-bit elements)
template <typename T, bool isSetMask = true> void Copy(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint64_t mask,
                                                       const uint8_t repeatTime, const CopyRepeatParams& p) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Copy on A2/A3 takes 16- or 32-bit elements");
    dst.check(detail::l0_extent<T>(mask, repeatTime, p.dstStride, p.dstRepeatSize), "Copy");
    src.check(detail::l0_extent<T>(mask, repeatTime, p.srcStride, p.srcRepeatSize), "Copy");
    detail::level0<T>(mask, repeatTime, [&](uint32_t r, uint32_t blk, uint32_t j) {
        dst.ak_ptr()[detail::l0_index<T>(r, blk, j, p.dstStride, p.dstRepeatSize)] =
            src.ak_ptr()[detail::l0_index<T>(r, blk, j, p.srcStride, p.srcRepeatSize)];
    });
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(repeatTime) * 256, 1.0), {src.slot()}, {dst.slot()});
}

// ---- sorting: (score, index) structures of 8 B, the score in the low bytes (float: 4 B; half: 2 B,
// then 2 reserved), the uint32 index in the high 4 B; always in descending score order ----------------
namespace detail {
template <typename T> inline float sort_score(const uint8_t* entry) { T v; std::memcpy(&v, entry, sizeof(T)); return to_f(v); }
// the order of two scores: larger first; NaN (its order the documentation leaves open) after every number
inline bool sorts_before(float a, float b) { return a == a && (b != b || a > b); }
template <typename T> void check_sort_type() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, half>, "Sort32 / MrgSort on A2/A3 take half or float scores");
}
}  // namespace detail

// Sort32: per repeat, 32 scores of src0 with their indices of src1 sorted by score, largest first (of
// equal scores the earlier one first) into 32 structures of dst; repeats step 32 elements of src0 and
// src1 and 256 B of dst. Cost: the slow-op rate per 256 B written (ESTIMATE).
template <typename T> void Sort32(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<uint32_t>& src1,
                                  const int32_t repeatTime) {
    detail::check_sort_type<T>();
    detail::check_repeat(repeatTime);
    const uint32_t n = uint32_t(repeatTime) * 32, per_entry = 8 / sizeof(T);
    src0.check(n, "Sort32"); src1.check(n, "Sort32"); dst.check(n * per_entry, "Sort32");
    std::vector<uint8_t> out(size_t(n) * 8, 0);
    for (uint32_t r = 0; r < uint32_t(repeatTime); ++r) {
        uint32_t order[32];
        for (uint32_t i = 0; i < 32; ++i) order[i] = r * 32 + i;
        std::stable_sort(order, order + 32, [&](uint32_t a, uint32_t b) {
            return detail::sorts_before(detail::to_f(src0.ak_ptr()[a]), detail::to_f(src0.ak_ptr()[b])); });
        for (uint32_t i = 0; i < 32; ++i) {
            uint8_t* e = out.data() + (size_t(r) * 32 + i) * 8;
            std::memcpy(e, &src0.ak_ptr()[order[i]], sizeof(T));
            std::memcpy(e + 4, &src1.ak_ptr()[order[i]], 4);
        }
    }
    std::memcpy(dst.ak_ptr(), out.data(), out.size());
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(n) * 8, AK_VEC_SLOW_FACTOR), {src0.slot(), src1.slot()}, {dst.slot()});
}

constexpr int32_t MRG_SORT_ELEMENT_LEN = 4;
struct MrgSort4Info {
    MrgSort4Info() {}
    MrgSort4Info(const uint16_t elementLengthsIn[MRG_SORT_ELEMENT_LEN], const bool ifExhaustedSuspensionIn,
                 const uint16_t validBitIn, const uint16_t repeatTimesIn)
        : ifExhaustedSuspension(ifExhaustedSuspensionIn), validBit(validBitIn), repeatTimes(uint8_t(repeatTimesIn)) {
        for (int32_t i = 0; i < MRG_SORT_ELEMENT_LEN; ++i) elementLengths[i] = elementLengthsIn[i];
    }
    uint16_t elementLengths[MRG_SORT_ELEMENT_LEN] = {0};
    bool ifExhaustedSuspension = false;
    uint16_t validBit = 0;
    uint8_t repeatTimes = 1;
};
template <typename T> struct MrgSortSrcList {
    MrgSortSrcList() {}
    MrgSortSrcList(const LocalTensor<T>& a, const LocalTensor<T>& b, const LocalTensor<T>& c, const LocalTensor<T>& d)
        : src1(a), src2(b), src3(c), src4(d) {}
    LocalTensor<T> src1, src2, src3, src4;
};

// MrgSort: the first 2, 3 or 4 queues (validBit 3 / 7 / 15) of sorted structures merged into one,
// largest first (of equal scores the earlier queue's first); with ifExhaustedSuspension it stops when
// a queue runs out. repeatTimes > 1 only for four equal, contiguous queues without suspension (each
// repeat steps the four queues' length); any other use of it is rejected. Queues need 8 B alignment,
// dst 32 B and no overlap with a queue. Cost: the slow-op rate per 256 B written (ESTIMATE).
template <typename T> void MrgSort(const LocalTensor<T>& dst, const MrgSortSrcList<T>& src, const MrgSort4Info& params) {
    detail::check_sort_type<T>();
    const uint32_t per_entry = 8 / sizeof(T);
    const int queues = params.validBit == 3 ? 2 : params.validBit == 7 ? 3 : params.validBit == 15 ? 4 : 0;
    if (queues == 0)
        ak::fail("MrgSort", "validBit " + std::to_string(params.validBit) + ": 3, 7 or 15 (the first 2, 3 or 4 queues)");
    const int32_t repeats = params.repeatTimes;
    if (repeats < 1) ak::fail("MrgSort", "repeatTimes 0: 1 to 255");
    const LocalTensor<T>* q[4] = {&src.src1, &src.src2, &src.src3, &src.src4};
    uint32_t len[4], total = 0;
    for (int i = 0; i < queues; ++i) {
        len[i] = params.elementLengths[i];
        if (len[i] > 4095) ak::fail("MrgSort", "elementLengths[" + std::to_string(i) + "] " + std::to_string(len[i]) + " > 4095");
        total += len[i];
    }
    if (repeats > 1) {
        const bool contiguous = queues == 4 && !params.ifExhaustedSuspension && len[1] == len[0] && len[2] == len[0] &&
                                len[3] == len[0] && q[1]->ak_ptr() == q[0]->ak_ptr() + len[0] * per_entry &&
                                q[2]->ak_ptr() == q[1]->ak_ptr() + len[0] * per_entry &&
                                q[3]->ak_ptr() == q[2]->ak_ptr() + len[0] * per_entry;
        if (!contiguous)
            ak::fail("MrgSort", "repeatTimes " + std::to_string(repeats) + " needs four valid queues of equal length, "
                     "stored one after the other, and no ifExhaustedSuspension");
    }
    const uint32_t span = total * uint32_t(repeats);   // structures a repeated call reads from src1 on, and writes
    dst.check(span * per_entry, "MrgSort");
    const uint8_t* dlo = reinterpret_cast<const uint8_t*>(dst.ak_ptr());
    for (int i = 0; i < queues; ++i) {
        const uint32_t reads = repeats > 1 ? span - uint32_t(i) * len[0] : len[i];   // structures from queue i on
        q[i]->check(reads * per_entry, "MrgSort", 8);
        const uint8_t* lo = reinterpret_cast<const uint8_t*>(q[i]->ak_ptr());
        if (lo < dlo + span * 8 && dlo < lo + reads * 8)
            ak::fail("MrgSort", "dst overlaps queue " + std::to_string(i + 1) + " (" + q[i]->slot()->name + ")");
    }
    std::vector<uint8_t> out;
    for (int32_t r = 0; r < repeats; ++r) {
        const uint8_t* base[4];
        uint32_t at[4] = {0, 0, 0, 0};
        for (int i = 0; i < queues; ++i)
            base[i] = reinterpret_cast<const uint8_t*>(q[i]->ak_ptr()) + size_t(r) * total * 8;
        for (;;) {
            int best = -1;
            bool exhausted = false;
            for (int i = 0; i < queues; ++i) {
                if (at[i] == len[i]) { exhausted = true; continue; }
                if (best < 0 || detail::sorts_before(detail::sort_score<T>(base[i] + at[i] * 8),
                                                     detail::sort_score<T>(base[best] + at[best] * 8))) best = i;
            }
            if (best < 0 || (exhausted && params.ifExhaustedSuspension)) break;
            out.insert(out.end(), base[best] + at[best] * 8, base[best] + at[best] * 8 + 8);
            ++at[best];
        }
    }
    std::memcpy(dst.ak_ptr(), out.data(), out.size());
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(span) * 8, AK_VEC_SLOW_FACTOR),
                     {q[0]->slot(), q[1]->slot(), queues > 2 ? q[2]->slot() : nullptr, queues > 3 ? q[3]->slot() : nullptr},
                     {dst.slot()});
}

template <typename T> void Duplicate(const LocalTensor<T>& dst, const T& scalarValue, const int32_t& count) {
    dst.check(count, "Duplicate");
    T* d = dst.ak_ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = scalarValue;
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {}, {dst.slot()});
}

// per repeat i, element src[i*8+j] fills one 32 B block of dst at block i*dstRepStride + j*dstBlkStride
template <typename T> void Brcb(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const uint8_t repeatTime,
                                const BrcbRepeatParams& p) {
    detail::check_repeat(repeatTime);
    src0.check(uint32_t(repeatTime) * 8, "Brcb");
    const uint32_t per_blk = 32 / sizeof(T), bs = p.dstBlkStride == 0 ? 1 : p.dstBlkStride;
    dst.check(((repeatTime - 1) * p.dstRepStride + 7 * bs + 1) * per_blk, "Brcb");
    for (uint32_t i = 0; i < repeatTime; ++i)
        for (uint32_t j = 0; j < 8; ++j)
            for (uint32_t k = 0; k < per_blk; ++k)
                dst.ak_ptr()[(i * p.dstRepStride + j * bs) * per_blk + k] = src0.ak_ptr()[i * 8 + j];
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(repeatTime) * 256, 1.0), {src0.slot()}, {dst.slot()});
}

// count form: the result in dst[0]; the sum runs as the hardware's pairwise tree per 256 B repeat,
// then over the repeat results.
namespace detail {
template <typename T> T tree_sum(const T* v, uint32_t n) {
    if (n == 0) return T(0);
    if (n == 1) return v[0];
    const uint32_t h = (n + 1) / 2;
    std::vector<T> next(h);
    for (uint32_t i = 0; i < h; ++i) next[i] = (2 * i + 1 < n) ? T(v[2 * i] + v[2 * i + 1]) : v[2 * i];
    return tree_sum(next.data(), h);
}
}  // namespace detail
template <typename T, bool isSetMask = true> void ReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src,
                                                            const LocalTensor<T>& sharedTmpBuffer, const int32_t count) {
    detail::check_dtype_arith<T>();
    dst.check(1, "ReduceSum", sizeof(T)); src.check(count, "ReduceSum");
    sharedTmpBuffer.check(std::min<uint32_t>(uint32_t(count), (uint32_t(count) * sizeof(T) + 255) / 256), "ReduceSum");
    const uint32_t per_rep = 256 / sizeof(T);
    std::vector<T> partial;
    for (uint32_t i = 0; i < uint32_t(count); i += per_rep)
        partial.push_back(detail::tree_sum(src.ak_ptr() + i, std::min<uint32_t>(per_rep, count - i)));
    dst.ak_ptr()[0] = detail::tree_sum(partial.data(), uint32_t(partial.size()));
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0) + 2 * AK_VEC_ISSUE,
                     {src.slot()}, {dst.slot(), sharedTmpBuffer.slot()});
}
template <typename T> void ReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& sharedTmpBuffer,
                                     const int32_t count, bool calIndex = 0) {
    detail::check_dtype_arith<T>();
    dst.check(calIndex ? 2 : 1, "ReduceMax", 2 * sizeof(T)); src.check(count, "ReduceMax");
    uint32_t best = 0;
    for (uint32_t i = 1; i < uint32_t(count); ++i) if (src.ak_ptr()[i] > src.ak_ptr()[best]) best = i;
    dst.ak_ptr()[0] = src.ak_ptr()[best];
    if (calIndex) { uint32_t idx = best; std::memcpy(dst.ak_ptr() + 1, &idx, std::min(sizeof(T), sizeof(idx))); }
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0) + 2 * AK_VEC_ISSUE,
                     {src.slot()}, {dst.slot(), sharedTmpBuffer.slot()});
}
// level-0: each repeat sums (max) the first `mask` lanes of up to 256 B of src into dst[r * dstRepStride]
template <typename T, bool isSetMask = true> void WholeReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src,
        const int32_t mask, const int32_t repeatTime, const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride) {
    detail::check_dtype_arith<T>();
    detail::check_repeat(repeatTime);
    const uint32_t per_blk = 32 / sizeof(T);
    if (uint32_t(mask) > 8 * per_blk) ak::fail("mask", "WholeReduceSum mask " + std::to_string(mask) + " > " + std::to_string(8 * per_blk));
    src.check(detail::l0_extent<T>(uint64_t(mask), repeatTime, srcBlkStride, srcRepStride), "WholeReduceSum");
    if (repeatTime > 0) dst.check(uint32_t((repeatTime - 1) * dstRepStride + 1), "WholeReduceSum", sizeof(T));
    for (int32_t r = 0; r < repeatTime; ++r) {
        std::vector<T> v(mask);
        for (int32_t lane = 0; lane < mask; ++lane)
            v[lane] = src.ak_ptr()[detail::l0_index<T>(r, lane / per_blk, lane % per_blk, srcBlkStride, srcRepStride)];
        dst.ak_ptr()[r * dstRepStride] = detail::tree_sum(v.data(), uint32_t(mask));
    }
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(repeatTime) * 256, 1.0), {src.slot()}, {dst.slot()});
}
template <typename T, bool isSetMask = true> void WholeReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src,
        const int32_t mask, const int32_t repeatTime, const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
        ReduceOrder order = ReduceOrder::ORDER_VALUE_INDEX) {
    detail::check_dtype_arith<T>();
    detail::check_repeat(repeatTime);
    const uint32_t per_blk = 32 / sizeof(T);
    if (uint32_t(mask) > 8 * per_blk) ak::fail("mask", "WholeReduceMax mask " + std::to_string(mask) + " > " + std::to_string(8 * per_blk));
    src.check(detail::l0_extent<T>(uint64_t(mask), repeatTime, srcBlkStride, srcRepStride), "WholeReduceMax");
    // dstRepStride counts what one repeat writes: a value-index pair (2 elements), a value (1), or an
    // index, which is a uint32_t (4 B)
    const uint32_t unit = order == ReduceOrder::ORDER_ONLY_VALUE ? 1 : order == ReduceOrder::ORDER_ONLY_INDEX ? 4 / sizeof(T) : 2;
    if (repeatTime > 0) dst.check(uint32_t((repeatTime - 1) * dstRepStride * unit + unit), "WholeReduceMax", 2 * sizeof(T));
    for (int32_t r = 0; r < repeatTime; ++r) {
        uint32_t best = 0;
        T bv = src.ak_ptr()[detail::l0_index<T>(r, 0, 0, srcBlkStride, srcRepStride)];
        for (int32_t lane = 1; lane < mask; ++lane) {
            const T v = src.ak_ptr()[detail::l0_index<T>(r, lane / per_blk, lane % per_blk, srcBlkStride, srcRepStride)];
            if (v > bv) { bv = v; best = lane; }
        }
        T idx; std::memset(&idx, 0, sizeof(T)); std::memcpy(&idx, &best, std::min(sizeof(T), sizeof(best)));   // in T's bits
        T* d = dst.ak_ptr() + size_t(r) * dstRepStride * unit;
        if (order == ReduceOrder::ORDER_ONLY_VALUE) d[0] = bv;
        else if (order == ReduceOrder::ORDER_ONLY_INDEX) std::memcpy(d, &best, 4);
        else if (order == ReduceOrder::ORDER_INDEX_VALUE) { d[0] = idx; d[1] = bv; }
        else { d[0] = bv; d[1] = idx; }
    }
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(repeatTime) * 256, 1.0), {src.slot()}, {dst.slot()});
}

namespace detail {
inline bool compare(float a, float b, CMPMODE mode) {
    switch (mode) {
        case CMPMODE::LT: return a < b;
        case CMPMODE::GT: return a > b;
        case CMPMODE::EQ: return a == b;
        case CMPMODE::LE: return a <= b;
        case CMPMODE::GE: return a >= b;
        case CMPMODE::NE: return a != b;
    }
    return false;
}
}  // namespace detail

// Compare writes one bit per element (bit i of byte i/8); count * sizeof(T) must be 256 B aligned.
template <typename T, typename U> void Compare(const LocalTensor<U>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1,
                                               CMPMODE cmpMode, uint32_t count) {
    if ((count * sizeof(T)) % 256 != 0)
        ak::fail("Compare 256 B", "Compare of " + std::to_string(count * sizeof(T)) + " B is not a multiple of 256 B");
    src0.check(count, "Compare"); src1.check(count, "Compare");
    dst.check((count / 8 + sizeof(U) - 1) / sizeof(U), "Compare");
    uint8_t* bits = reinterpret_cast<uint8_t*>(dst.ak_ptr());
    std::memset(bits, 0, count / 8);
    for (uint32_t i = 0; i < count; ++i) {
        const float a = float(src0.ak_ptr()[i]), b = float(src1.ak_ptr()[i]);
        if (detail::compare(a, b, cmpMode)) bits[i / 8] |= uint8_t(1u << (i % 8));
    }
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {src0.slot(), src1.slot()}, {dst.slot()});
}
// CompareScalar: src0 against one scalar; same bit mask and 256 B rule as Compare
template <typename T, typename U> void CompareScalar(const LocalTensor<U>& dst, const LocalTensor<T>& src0, const T src1Scalar,
                                                     CMPMODE cmpMode, uint32_t count) {
    if ((count * sizeof(T)) % 256 != 0)
        ak::fail("Compare 256 B", "CompareScalar of " + std::to_string(count * sizeof(T)) + " B is not a multiple of 256 B");
    src0.check(count, "CompareScalar");
    dst.check((count / 8 + sizeof(U) - 1) / sizeof(U), "CompareScalar");
    uint8_t* bits = reinterpret_cast<uint8_t*>(dst.ak_ptr());
    std::memset(bits, 0, count / 8);
    const float b = float(src1Scalar);
    for (uint32_t i = 0; i < count; ++i) {
        const float a = float(src0.ak_ptr()[i]);
        if (detail::compare(a, b, cmpMode)) bits[i / 8] |= uint8_t(1u << (i % 8));
    }
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {src0.slot()}, {dst.slot()});
}
// bit 1 -> src0, 0 -> src1 (tensor-tensor mode), consecutive mask bits
template <typename T, typename U> void Select(const LocalTensor<T>& dst, const LocalTensor<U>& selMask, const LocalTensor<T>& src0,
                                              const LocalTensor<T>& src1, SELMODE selMode, uint32_t count) {
    dst.check(count, "Select"); src0.check(count, "Select"); src1.check(count, "Select");
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(selMask.ak_ptr());
    for (uint32_t i = 0; i < count; ++i)
        dst.ak_ptr()[i] = (bits[i / 8] >> (i % 8)) & 1 ? src0.ak_ptr()[i] : src1.ak_ptr()[i];
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {selMask.slot(), src0.slot(), src1.slot()}, {dst.slot()});
}
// scalar mode: bit 1 -> src0, 0 -> the scalar src1
template <typename T, typename U> void Select(const LocalTensor<T>& dst, const LocalTensor<U>& selMask, const LocalTensor<T>& src0,
                                              T src1, SELMODE selMode, uint32_t count) {
    dst.check(count, "Select"); src0.check(count, "Select");
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(selMask.ak_ptr());
    for (uint32_t i = 0; i < count; ++i)
        dst.ak_ptr()[i] = (bits[i / 8] >> (i % 8)) & 1 ? src0.ak_ptr()[i] : src1;
    ak::core().issue(ak::VEC, detail::vec_cycles(uint64_t(count) * sizeof(T), 1.0), {selMask.slot(), src0.slot()}, {dst.slot()});
}

// ---- the Cube side (AIC): GM -> L1 in NZ, L1 -> L0A / L0B, Mmad into L0C, Fixpipe out to GM ---------
// The fractal layouts as the NPU stores them (Mmad's documentation; C0 = 32 B / sizeof(T) elements):
//   L1 / L0A (NZ / ZZ): fractals of 16 rows x C0, row-major inside; in L0A (ZZ) the fractals of a
//       matrix [m][k] row-major too: fractal (m / 16, k / C0) at index (m / 16) * K1 + k / C0
//   L0B (ZN): fractals of C0 x 16 ([k][n]) column-major inside (16 columns of C0), row-major across:
//       fractal (k / C0, n / 16) at index (k / C0) * N1 + n / 16
//   L0C (NZ): fp32 fractals of 16 x 16, row-major inside, column-major across: (n / 16) * M1 + m / 16
// with M1 = ceil(m / 16), K1 = ceil(k / C0), N1 = ceil(n / 16); a fractal is 512 B in L0A / L0B.
struct Nd2NzParams {
    Nd2NzParams() {}
    Nd2NzParams(uint16_t ndNumIn, uint16_t nValueIn, uint16_t dValueIn, uint16_t srcNdMatrixStrideIn, uint16_t srcDValueIn,
                uint16_t dstNzC0StrideIn, uint16_t dstNzNStrideIn, uint16_t dstNzMatrixStrideIn)
        : ndNum(ndNumIn), nValue(nValueIn), dValue(dValueIn), srcNdMatrixStride(srcNdMatrixStrideIn), srcDValue(srcDValueIn),
          dstNzC0Stride(dstNzC0StrideIn), dstNzNStride(dstNzNStrideIn), dstNzMatrixStride(dstNzMatrixStrideIn) {}
    uint16_t ndNum = 0, nValue = 0, dValue = 0, srcNdMatrixStride = 0, srcDValue = 0;
    uint16_t dstNzC0Stride = 0, dstNzNStride = 0, dstNzMatrixStride = 0;
};
struct LoadData2DParams {
    LoadData2DParams() {}
    LoadData2DParams(uint16_t startIndexIn, uint8_t repeatTimesIn, uint16_t srcStrideIn, uint8_t sidIn, uint16_t dstGapIn,
                     bool ifTransposeIn, uint8_t addrModeIn)
        : startIndex(startIndexIn), dstGap(dstGapIn), srcStride(srcStrideIn), ifTranspose(ifTransposeIn),
          repeatTimes(repeatTimesIn), sid(sidIn), addrMode(addrModeIn) {}
    uint16_t startIndex = 0, dstGap = 0, srcStride = 0;
    bool ifTranspose = false;
    uint8_t repeatTimes = 0, sid = 0, addrMode = 0;
};
using LoadData2dParams = LoadData2DParams;
struct MmadParams {
    MmadParams() {}
    MmadParams(uint16_t mIn, uint16_t nIn, uint16_t kIn, bool isBiasIn, int32_t fmOffsetIn, bool enSsparseIn,
               bool enWinogradAIn, bool enWinogradBIn)
        : m(mIn), n(nIn), k(kIn), isBias(isBiasIn), fmOffset(fmOffsetIn), enSsparse(enSsparseIn), enWinogradA(enWinogradAIn),
          enWinogradB(enWinogradBIn) {}
    MmadParams(uint16_t mIn, uint16_t nIn, uint16_t kIn, uint8_t unitFlagIn, bool cmatrixSourceIn, bool cmatrixInitValIn)
        : m(mIn), n(nIn), k(kIn), unitFlag(unitFlagIn), cmatrixSource(cmatrixSourceIn), cmatrixInitVal(cmatrixInitValIn) {}
    uint16_t m = 0, n = 0, k = 0;
    bool isBias = false;
    int32_t fmOffset = 0;
    bool enSsparse = false, enWinogradA = false, enWinogradB = false;
    uint8_t unitFlag = 0;
    bool kDirectionAlign = false;
    bool cmatrixSource = false;   // the initial C from the bias table (C2): not emulated
    bool cmatrixInitVal = true;   // true: C = A B; false: C += A B
};
enum QuantMode_t : uint8_t { NoQuant = 0, F322F16, F322BF16, DEQF16, VDEQF16, QF322B8_PRE, VQF322B8_PRE, REQ8, VREQ8 };
enum class CO2Layout : uint8_t { NZ = 0, ROW_MAJOR, COLUMN_MAJOR };
struct FixpipeConfig { CO2Layout format; };
constexpr FixpipeConfig CFG_NZ = {CO2Layout::NZ};
constexpr FixpipeConfig CFG_ROW_MAJOR = {CO2Layout::ROW_MAJOR};
constexpr FixpipeConfig CFG_COLUMN_MAJOR = {CO2Layout::COLUMN_MAJOR};
struct FixpipeParamsV220 {
    FixpipeParamsV220() {}
    FixpipeParamsV220(uint16_t nSizeIn, uint16_t mSizeIn, uint16_t srcStrideIn, uint32_t dstStrideIn, bool reluEnIn)
        : nSize(nSizeIn), mSize(mSizeIn), srcStride(srcStrideIn), dstStride(dstStrideIn), reluEn(reluEnIn) {}
    FixpipeParamsV220(uint16_t nSizeIn, uint16_t mSizeIn, uint16_t srcStrideIn, uint32_t dstStrideIn, bool reluEnIn,
                      QuantMode_t quantPreIn, int64_t deqScalarIn, uint16_t ndNumIn, uint16_t srcNdStrideIn,
                      uint16_t dstNdStrideIn, uint8_t unitFlagIn)
        : nSize(nSizeIn), mSize(mSizeIn), srcStride(srcStrideIn), dstStride(dstStrideIn), quantPre(quantPreIn),
          deqScalar(uint64_t(deqScalarIn)), ndNum(ndNumIn), srcNdStride(srcNdStrideIn), dstNdStride(dstNdStrideIn),
          reluEn(reluEnIn), unitFlag(unitFlagIn) {}
    uint16_t nSize = 0, mSize = 0, srcStride = 0;
    uint32_t dstStride = 0;
    QuantMode_t quantPre = QuantMode_t::NoQuant;
    uint64_t deqScalar = 0;
    uint16_t ndNum = 1, srcNdStride = 0, dstNdStride = 0;
    bool reluEn = false;
    uint8_t unitFlag = 0;
    bool isChannelSplit = false;
};

namespace detail {
template <typename T> constexpr uint32_t c0_of() { return 32 / sizeof(T); }
inline void range(const char* api, const char* field, uint64_t v, uint64_t lo, uint64_t hi) {
    if (v < lo || v > hi)
        ak::fail(api, std::string(field) + " " + std::to_string(v) + " outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}
}  // namespace detail

// DataCopy with Nd2NzParams (GM -> A1 / B1, or GM -> UB): ndNum matrices of nValue rows x dValue
// elements, row r of matrix i at i * srcNdMatrixStride + r * srcDValue; its 32 B column blocks go to
// i * dstNzMatrixStride + (r * dstNzNStride + c * dstNzC0Stride) * C0 (strides in 32 B blocks, the last
// block zero-filled past dValue). Cost: MTE2, a copy per row.
template <typename T> void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const Nd2NzParams& p) {
    const char* api = "DataCopy Nd2Nz";
    detail::range(api, "ndNum", p.ndNum, 0, 4095);
    detail::range(api, "nValue", p.nValue, 0, 16384);
    detail::range(api, "srcDValue", p.srcDValue, 1, 65535);
    detail::range(api, "dstNzC0Stride", p.dstNzC0Stride, 1, 16384);
    detail::range(api, "dstNzNStride", p.dstNzNStride, 1, 16384);
    detail::range(api, "dstNzMatrixStride", p.dstNzMatrixStride, 1, 65535);
    constexpr uint32_t c0 = detail::c0_of<T>();
    const uint32_t blocks = (p.dValue + c0 - 1) / c0;
    if (p.ndNum > 0 && p.nValue > 0 && blocks > 0) {   /* the strides are non-negative: the last row reaches furthest */
        src.check(uint64_t(p.ndNum - 1) * p.srcNdMatrixStride + uint64_t(p.nValue - 1) * p.srcDValue, p.dValue);
        dst.check_in(dst.mem() == ak::UB ? ak::UB : ak::L1, uint32_t(uint64_t(p.ndNum - 1) * p.dstNzMatrixStride +
                     (uint64_t(p.nValue - 1) * p.dstNzNStride + uint64_t(blocks - 1) * p.dstNzC0Stride + 1) * c0), api);
    }
    for (uint32_t i = 0; i < p.ndNum; ++i)
        for (uint32_t r = 0; r < p.nValue; ++r)
            for (uint32_t c = 0; c < blocks; ++c)
                for (uint32_t e = 0; e < c0; ++e) {
                    const uint32_t col = c * c0 + e;
                    dst.ak_ptr()[uint64_t(i) * p.dstNzMatrixStride + (uint64_t(r) * p.dstNzNStride + uint64_t(c) * p.dstNzC0Stride) * c0 + e] =
                        col < p.dValue ? src.ak_ptr()[uint64_t(i) * p.srcNdMatrixStride + uint64_t(r) * p.srcDValue + col] : T(0);
                }
    const uint64_t bytes = uint64_t(p.ndNum) * p.nValue * p.dValue * sizeof(T);
    ak::core().issue(ak::MTE2, detail::gm_cycles(src.ak_ptr(), bytes, false, bytes), {}, {dst.slot()});
}

// LoadData (2D): repeatTimes fractals of 512 B from L1 (A1 / B1) to L0A (A2) or L0B (B2): fractal
// startIndex + r * srcStride (addrMode 1: minus) of src to fractal r * (1 + dstGap) of dst; with
// ifTranspose each 16 x 16 fractal transposed, documented for uint16_t / int16_t / half only (bf16:
// reinterpret its bits as half). Cost: MTE1, 512 B per repeat at the profile's L1 -> L0 rate.
template <typename T> void LoadData(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LoadData2DParams& p) {
    const char* api = "LoadData";
    detail::range(api, "repeatTimes", p.repeatTimes, 1, 255);
    if (p.ifTranspose && !(std::is_same_v<T, half> || std::is_same_v<T, int16_t> || std::is_same_v<T, uint16_t>))
        ak::fail(api, std::string("ifTranspose with ") + detail::type_name<T>() +
                 ": the documented transpose takes uint16_t / int16_t / half (reinterpret 16-bit data as half)");
    if (dst.mem() != ak::L0A && dst.mem() != ak::L0B)
        ak::fail("position", std::string("LoadData writes A2 (L0A) or B2 (L0B), not ") + ak::mem_name(dst.mem()) +
                 " (" + dst.slot()->name + ")");
    constexpr uint32_t f = 512 / sizeof(T);
    const int64_t last = int64_t(p.startIndex) + (p.addrMode ? -1 : 1) * int64_t(p.repeatTimes - 1) * p.srcStride;
    if (last < 0) ak::fail(api, "the last repeat reads fractal " + std::to_string(last) + " (before the source)");
    src.check_in(ak::L1, uint32_t((std::max<int64_t>(last, p.startIndex) + 1) * f), api);
    dst.check_in(dst.mem(), uint32_t((uint64_t(p.repeatTimes - 1) * (1 + p.dstGap) + 1) * f), api, 512);
    for (int64_t r = 0; r < p.repeatTimes; ++r) {
        const T* s = src.ak_ptr() + (int64_t(p.startIndex) + (p.addrMode ? -r : r) * int64_t(p.srcStride)) * f;
        T* d = dst.ak_ptr() + uint64_t(r) * (1 + p.dstGap) * f;
        if (p.ifTranspose) {
            for (uint32_t a = 0; a < 16; ++a)
                for (uint32_t b = 0; b < 16; ++b) d[b * 16 + a] = s[a * 16 + b];
        } else {
            std::memcpy(d, s, 512);
        }
    }
    ak::core().issue(ak::MTE1, AK_VEC_ISSUE + p.repeatTimes * 512.0 / AK_MTE1_BYTES_PER_CYCLE, {src.slot()}, {dst.slot()});
}

// Mmad: C (L0C, fp32) = A (L0A, m x k) B (L0B, k x n), or C += A B (cmatrixInitVal false), in the
// layouts above; products and sums in fp32 in k order (half / bf16 / fp32 operands; the fp32 modes'
// reduced-precision variants are not modelled). m, n, k <= 4095; A and B start 512 B aligned, C 256
// elements. The rows and columns of C's fractals past m and n are poisoned (NaN): what Fixpipe or a
// wrong index reads there is wrong. Cost: the Cube, M1 N1 K1 fractal products at the profile's MACs
// per cycle.
template <typename T, typename U, typename S>
void Mmad(const LocalTensor<T>& dst, const LocalTensor<U>& fm, const LocalTensor<S>& filter, const MmadParams& p) {
    static_assert(std::is_same_v<T, float> && std::is_same_v<U, S> &&
                  (std::is_same_v<U, half> || std::is_same_v<U, bfloat16_t> || std::is_same_v<U, float>),
                  "Mmad here: half, bfloat16_t or float operands into a float L0C");
    const char* api = "Mmad";
    detail::range(api, "m", p.m, 0, 4095);
    detail::range(api, "n", p.n, 0, 4095);
    detail::range(api, "k", p.k, 0, 4095);
    if (p.cmatrixSource) ak::fail(api, "cmatrixSource: a C matrix from the bias table (C2) is not emulated");
    constexpr uint32_t c0 = detail::c0_of<U>();
    const uint32_t m1 = (p.m + 15) / 16, n1 = (p.n + 15) / 16, k1 = (p.k + c0 - 1) / c0;
    fm.check_in(ak::L0A, m1 * k1 * 16 * c0, api, 512);
    filter.check_in(ak::L0B, k1 * n1 * 16 * c0, api, 512);
    dst.check_in(ak::L0C, m1 * n1 * 256, api, 256 * sizeof(T));
    const U* a = fm.ak_ptr();
    const S* b = filter.ak_ptr();
    T* c = dst.ak_ptr();
    // The fractals unpacked once into dense fp32 (A: row i's k values; B: per k, the n1 x 16 columns),
    // then each output row accumulated over k in order, 16 columns at a time: every output is the
    // same sequence of fp32 adds as one dot product at a time, without the fractal index arithmetic
    // per MAC (most of a Cube kernel's emulation time).
    const uint32_t cols = n1 * 16;
    thread_local std::vector<float> af, bt;
    af.resize(size_t(p.m) * p.k);
    bt.resize(size_t(p.k) * cols);
    for (uint32_t i = 0; i < p.m; ++i)
        for (uint32_t kk = 0; kk < p.k; ++kk)
            af[size_t(i) * p.k + kk] = detail::to_f(a[((i / 16) * k1 + kk / c0) * 16 * c0 + (i % 16) * c0 + kk % c0]);
    for (uint32_t kk = 0; kk < p.k; ++kk)
        for (uint32_t j = 0; j < cols; ++j)
            bt[size_t(kk) * cols + j] = detail::to_f(b[((kk / c0) * n1 + j / 16) * c0 * 16 + (j % 16) * c0 + kk % c0]);
    auto at = [&](uint32_t i, uint32_t j) -> T& { return c[((j / 16) * m1 + i / 16) * 256 + (i % 16) * 16 + j % 16]; };
    for (uint32_t i = 0; i < m1 * 16; ++i) {
        if (i >= p.m) {
            for (uint32_t j = 0; j < cols; ++j) at(i, j) = __builtin_nanf("");
            continue;
        }
        const float* __restrict ar = &af[size_t(i) * p.k];
        for (uint32_t jb = 0; jb < cols; jb += 16) {
            float acc[16];   // one fractal row of C, in registers
            for (uint32_t jj = 0; jj < 16; ++jj) acc[jj] = p.cmatrixInitVal || jb + jj >= p.n ? 0.0f : float(at(i, jb + jj));
            const float* __restrict br = &bt[jb];
            for (uint32_t kk = 0; kk < p.k; ++kk, br += cols) {
                const float x = ar[kk];
                for (uint32_t jj = 0; jj < 16; ++jj) acc[jj] += x * br[jj];
            }
            for (uint32_t jj = 0; jj < 16; ++jj) at(i, jb + jj) = jb + jj < p.n ? acc[jj] : __builtin_nanf("");
        }
    }
    const double macs = double(m1) * 16 * n1 * 16 * k1 * c0;
    ak::core().issue(ak::CUBE, AK_VEC_ISSUE + macs / (sizeof(U) == 4 ? AK_CUBE_MACS_FP32 : AK_CUBE_MACS_16BIT),
                     {fm.slot(), filter.slot(), p.cmatrixInitVal ? nullptr : dst.slot()}, {dst.slot()});
}

// Fixpipe (FixpipeParamsV220, L0C -> GM): an mSize x nSize fp32 NZ matrix of L0C (column blocks of 16
// srcStride x 16 elements apart), ReLU if reluEn, then to T (float: NoQuant; half: F322F16; bf16:
// F322BF16, round to nearest even); CFG_ROW_MAJOR writes it ND (row i at i * dstStride elements),
// CFG_NZ as NZ (column blocks dstStride x 32 B apart, nSize a multiple of 16); ndNum matrices,
// srcNdStride x 256 elements / dstNdStride elements apart. Cost: FIX, the bytes written at its rate (into
// HBM no faster than the core's share of HBM).
template <typename T, typename U, const FixpipeConfig& config = CFG_ROW_MAJOR>
void Fixpipe(const GlobalTensor<T>& dst, const LocalTensor<U>& src, const FixpipeParamsV220& p) {
    static_assert(std::is_same_v<U, float> && (std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>),
                  "Fixpipe here: a float L0C to float, half or bfloat16_t");
    static_assert(config.format != CO2Layout::COLUMN_MAJOR, "Fixpipe CFG_COLUMN_MAJOR (NZ2DN) is not on Atlas A2/A3");
    const char* api = "Fixpipe";
    const QuantMode_t want = std::is_same_v<T, float> ? NoQuant : std::is_same_v<T, half> ? F322F16 : F322BF16;
    if (p.quantPre != want)
        ak::fail(api, std::string("float to ") + detail::type_name<T>() + " takes quantPre " +
                 (want == NoQuant ? "NoQuant" : want == F322F16 ? "F322F16" : "F322BF16"));
    const bool nd = config.format == CO2Layout::ROW_MAJOR;
    detail::range(api, "nSize", p.nSize, 1, 4095);
    detail::range(api, "mSize", p.mSize, 1, nd ? 8192 : 65535);
    detail::range(api, "ndNum", p.ndNum, 1, 65535);
    if (!nd && p.nSize % 16 != 0) ak::fail(api, "nSize " + std::to_string(p.nSize) + ": a multiple of 16 without NZ2ND");
    if (p.dstStride == 0) ak::fail(api, "dstStride 0");
    const uint32_t blk = 32 / sizeof(T), last = p.ndNum - 1;   /* the last matrix reaches furthest */
    src.check_in(ak::L0C, uint32_t(uint64_t(last) * p.srcNdStride * 256 + uint64_t((p.nSize - 1) / 16) * p.srcStride * 16 +
                                   uint64_t(p.mSize) * 16), api, 64);
    dst.check(0, nd ? uint64_t(last) * p.dstNdStride + uint64_t(p.mSize - 1) * p.dstStride + p.nSize
                    : uint64_t(last) * p.dstNdStride + uint64_t((p.nSize - 1) / 16) * p.dstStride * blk + uint64_t(p.mSize) * 16);
    const bool atomic = detail::atomic_on<T>("Fixpipe");   /* once, not per element */
    for (uint32_t t = 0; t < p.ndNum; ++t)
        for (uint32_t i = 0; i < p.mSize; ++i)
            for (uint32_t j = 0; j < p.nSize; ++j) {
                float v = src.ak_ptr()[uint64_t(t) * p.srcNdStride * 256 + uint64_t(j / 16) * p.srcStride * 16 + i * 16 + j % 16];
                if (p.reluEn && v < 0) v = 0.0f;
                const uint64_t at = nd ? uint64_t(t) * p.dstNdStride + uint64_t(i) * p.dstStride + j
                                       : uint64_t(t) * p.dstNdStride + uint64_t(j / 16) * p.dstStride * blk + uint64_t(i) * 16 + j % 16;
                const T out = std::is_same_v<T, float> ? T(v) : detail::from_f<T>(v, RoundMode::CAST_RINT);   /* to nearest even */
                if (atomic) detail::atomic_add(dst.ak_ptr() + at, out);
                else dst.ak_ptr()[at] = out;
            }
    const uint64_t bytes = uint64_t(p.ndNum) * p.mSize * p.nSize * sizeof(T);
    detail::gm_cycles(dst.ak_ptr(), bytes, true, bytes);   /* counted as HBM or L2 traffic */
    /* timed at the Fixpipe's rate; into HBM no faster than the core's share of it */
    const double hbm = ak::gm_in_l2(dst.ak_ptr(), false) ? 0.0 : double(bytes) / ak::hbm_bytes_per_cycle;
    ak::core().issue(ak::FIX, AK_VEC_ISSUE + std::max(double(bytes) / AK_FIX_BYTES_PER_CYCLE, hbm), {src.slot()}, {});
}

}  // namespace AscendC

// The APIs above, by name: the template-coverage test checks every call a template makes against it.
#define AK_EMULATED_APIS "GlobalTensor LocalTensor TPipe TQue TQueBind TBuf InitBuffer AllocTensor FreeTensor EnQue DeQue Get GetWithOffset " \
    "SetGlobalBuffer GetValue SetValue ReinterpretCast GetSize SetSize GetPhyAddr DataCopy DataCopyPad Add Sub Mul Div Max Min " \
    "Adds Muls Maxs Mins Exp Ln Sqrt Rsqrt Reciprocal Abs Relu Axpy MulAddDst Gather Copy Sort32 MrgSort Cast Duplicate Brcb ReduceSum ReduceMax WholeReduceSum " \
    "LoadData Mmad Fixpipe Nd2NzParams LoadData2DParams MmadParams FixpipeParamsV220 FixpipeConfig CFG_ROW_MAJOR CFG_NZ QuantMode_t " \
    "WholeReduceMax Compare CompareScalar Select PipeBarrier SetFlag WaitFlag GetBlockIdx GetBlockNum SyncAll GetDataBlockSizeInBytes "\
    "GetSubBlockIdx GetSubBlockNum GetTaskRatio CrossCoreSetFlag CrossCoreWaitFlag ASCEND_IS_AIV ASCEND_IS_AIC g_coreType "\
    "SetAtomicAdd DisableDmaAtomic " \
    "GetTPipePtr AllocEventID ReleaseEventID FetchEventID KERNEL_TASK_TYPE_DEFAULT " \
    "DataCopyParams DataCopyExtParams DataCopyPadExtParams UnaryRepeatParams BinaryRepeatParams BrcbRepeatParams CopyRepeatParams " \
    "MrgSort4Info MrgSortSrcList"
