// lockstep's CUDA emulator, host side: the parts of the CUDA driver API, NVRTC and cuBLAS that
// lockstep calls through cudarc, done on the CPU. Built as one shared library that answers to
// the names cudarc loads (libcuda.so, libnvrtc.so, libcublas.so); see README.md beside it.
//
// - Memory is host memory; a device pointer is a host address. New allocations are filled with
//   0xFF bytes (NaN as f32) so a read of memory nothing wrote shows up.
// - Every call runs at once, in order: streams and events only keep times.
// - A stream capture records kernel launches, device copies, memsets and GEMMs instead of running
//   them, and a graph launch runs them again in order. Memory allocated while capturing belongs to
//   the graph (the same addresses every launch; released with the graph); a copy to or from the
//   host, a synchronization or a free of other memory while capturing is refused, as the driver
//   refuses what a graph cannot hold (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), and ends the capture
//   invalidated.
// - NVRTC compiles a kernel source with g++ against device.h into a shared object; a kernel
//   launch calls its wrapper, one launch at a time in the process.
// - cuBLAS's SGEMMs sum each output element in FP64 and round it once to FP32.
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <fcntl.h>
#include <functional>
#include <map>
#include <set>
#include <mutex>
#include <spawn.h>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#ifndef EMU_DIR
#error "build with -DEMU_DIR=\"<folder of device.h>\""
#endif

#define EXPORT extern "C" __attribute__((visibility("default")))

extern char **environ;

namespace {

struct Launch {
    unsigned grid[3], block[3];
    unsigned shared_bytes;
    void **params;
    char error[256];
};
using LaunchFn = int (*)(Launch *);
using SizesFn = int (*)(size_t *, size_t);

struct Function {
    LaunchFn launch;
    SizesFn sizes; // the parameters' byte sizes, for a graph capture to copy them
    std::string name;
};
struct Module {
    void *handle;
    std::map<std::string, Function *> functions;
};

std::mutex alloc_mu;
std::map<uintptr_t, size_t> allocations; // start -> bytes
std::mutex launch_mu;                    // one kernel at a time: kernels share fiber state
// Per device: the sticky error of a failed kernel (as CUDA's, every later call on that device's
// context returns it), 0 while the device is well.
std::atomic<int> lost[16];

bool verbose() { return getenv("LOCKSTEP_CUDA_EMU_VERBOSE") != nullptr; }

void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda-emu: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

// Whether [p, p + n) lies inside one live allocation.
bool inside(uintptr_t p, size_t n) {
    std::lock_guard<std::mutex> g(alloc_mu);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}

int check_range(uintptr_t p, size_t n, const char *what) {
    if (n == 0 || inside(p, n)) return 0;
    say("%s: %zu bytes at 0x%lx are outside every device allocation", what, n, (unsigned long)p);
    return 1; // CUDA_ERROR_INVALID_VALUE
}

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

int device_count() {
    const char *s = getenv("LOCKSTEP_CUDA_EMU_DEVICES");
    return s ? atoi(s) : 1;
}


// Calls per entry point (and launches per kernel), written at exit to the file that
// LOCKSTEP_CUDA_EMU_CALLS names: what a change does to the host's driver traffic, counted
// without a GPU (the counts are the program's; the emulator's timings are not).
std::mutex tally_mu;
std::map<std::string, uint64_t> *tallies = new std::map<std::string, uint64_t>;
bool tallying() {
    static const bool on = getenv("LOCKSTEP_CUDA_EMU_CALLS") != nullptr;
    return on;
}
// LOCKSTEP_CUDA_EMU_SKIP_WORK=1: kernels and GEMMs are checked and counted but not run (their
// outputs keep what the memory held), so a program's own host time can be profiled without the
// emulated work drowning it. Nothing it computes is meaningful; with LOCKSTEP_CUDA_EMU_FILL=0
// memory starts zeroed, which keeps an engine's numbers finite. Kernels whose names
// LOCKSTEP_CUDA_EMU_RUN_KERNELS lists (comma-separated) still run: those whose outputs steer the
// host (an engine's expert routing, say).
bool skipping_work() {
    static const bool on = getenv("LOCKSTEP_CUDA_EMU_SKIP_WORK") != nullptr;
    return on;
}
// An environment variable's comma-separated list, as ",a,b," (",," when unset), and whether
// `name` is one of its items.
static std::string comma_list(const char *var) {
    const char *v = getenv(var);
    return std::string(",") + (v ? v : "") + ",";
}
static bool listed(const std::string &list, const std::string &name) {
    return list.find("," + name + ",") != std::string::npos;
}
bool skipping_kernel(const std::string &name) {
    static const std::string keep = comma_list("LOCKSTEP_CUDA_EMU_RUN_KERNELS");
    return skipping_work() && !listed(keep, name);
}
// LOCKSTEP_CUDA_EMU_RAISE_ON=alloc,copy,memset: a SIGPROF at each such call (device allocation,
// device-to-device copy, memset), for a sampler that records the stack on it
// (scripts/host-profile with HOSTPROF_US=0): those calls counted by call site.
void raise_on(const char *what) {
    static const std::string on = comma_list("LOCKSTEP_CUDA_EMU_RAISE_ON");
    if (listed(on, what)) raise(SIGPROF);
}
void tally(const std::string &name) {
    if (!tallying()) return;
    std::lock_guard<std::mutex> g(tally_mu);
    (*tallies)[name]++;
}
struct TallyWriter {
    ~TallyWriter() {
        const char *path = getenv("LOCKSTEP_CUDA_EMU_CALLS");
        if (!path) return;
        std::lock_guard<std::mutex> g(tally_mu);
        FILE *f = fopen(path, "w");
        if (!f) return;
        for (auto &kv : *tallies) fprintf(f, "%llu %s\n", (unsigned long long)kv.second, kv.first.c_str());
        fclose(f);
    }
} tally_writer;

} // namespace

// =============================================================================================
// Driver API
// =============================================================================================
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
struct EmuCtx { int device; };
struct Graph {
    std::vector<std::function<CUresult()>> ops; // recorded work, replayed in order
    std::vector<uintptr_t> owned;              // allocations made while capturing
    size_t nodes = 0;                          // ops and allocations, as cuGraphGetNodes counts
};
struct EmuStream {
    int device;
    Graph *capture = nullptr; // the graph being captured on this stream
    bool invalid = false;     // a refused call ended the capture's use
};
struct EmuEvent { double ms; };
struct EmuPool { int unused; };
static EmuCtx contexts[16];
static thread_local EmuCtx *current_ctx = nullptr;
static int current_device() { return current_ctx ? current_ctx->device : 0; }
static int device_of(EmuStream *s) { return s ? s->device : current_device(); }
// The stream this thread is capturing on (a THREAD_LOCAL capture: synchronous calls of the same
// thread are refused while it lasts).
static thread_local EmuStream *capturing_here = nullptr;
static std::mutex graph_mu;
static std::set<uintptr_t> graph_owned; // addresses a graph holds: freed with the graph
static bool recording(EmuStream *s) { return s && s->capture; }
// Refuse a call a capture cannot hold: the capture is invalidated.
static CUresult refuse(EmuStream *s, const char *what) {
    EmuStream *c = recording(s) ? s : capturing_here;
    if (c) c->invalid = true;
    say("%s while capturing a graph: refused", what);
    return 900; // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
}
// Run `op` now, or record it into the stream's capture.
static CUresult run_or_record(EmuStream *s, std::function<CUresult()> op) {
    if (!recording(s)) return op();
    s->capture->ops.push_back(std::move(op));
    s->capture->nodes++;
    return 0;
}
static CUresult sticky(int device) { return lost[device].load(); }
static EmuPool pools[16];

EXPORT CUresult cuInit(unsigned) { return 0; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
EXPORT CUresult cuDeviceGetCount(int *n) { *n = device_count(); return 0; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return 101; // CUDA_ERROR_INVALID_DEVICE
    *d = ordinal;
    return 0;
}
EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    snprintf(name, len, "lockstep CUDA emulator (CPU) %d", d);
    return 0;
}
EXPORT CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) {
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xE0 + i + d * 16);
    return 0;
}
EXPORT CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice) { *bytes = (size_t)8 << 30; return 0; }
EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    *total = (size_t)8 << 30;
    *free_b = (size_t)7 << 30;
    return 0;
}

// The attributes lockstep reads, as an A100-class device (compute capability 8.0: the kernels'
// portable paths; the sm_89+/sm_90 instructions are not emulated).
EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    switch (attr) {
    case 1: *v = 1024; break;          // MAX_THREADS_PER_BLOCK
    case 2: *v = 1024; break;          // MAX_BLOCK_DIM_X
    case 3: case 4: *v = 1024; break;  // MAX_BLOCK_DIM_Y/Z
    case 5: *v = 2147483647; break;    // MAX_GRID_DIM_X
    case 6: case 7: *v = 65535; break; // MAX_GRID_DIM_Y/Z
    case 8: *v = 48 * 1024; break;     // MAX_SHARED_MEMORY_PER_BLOCK
    case 10: *v = 32; break;           // WARP_SIZE
    case 13: *v = 1410000; break;      // CLOCK_RATE (kHz)
    case 16: *v = 8; break;            // MULTIPROCESSOR_COUNT
    case 20: *v = 0; break;            // COMPUTE_MODE: default
    case 33: *v = 0; break;            // PCI_BUS_ID
    case 34: *v = d; break;            // PCI_DEVICE_ID
    case 50: *v = 0; break;            // PCI_DOMAIN_ID
    case 75: *v = 8; break;            // COMPUTE_CAPABILITY_MAJOR
    case 76: *v = 0; break;            // COMPUTE_CAPABILITY_MINOR
    case 97: *v = 163 * 1024; break;   // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    case 115: *v = 1; break;           // MEMORY_POOLS_SUPPORTED: stream-ordered allocation, as a GPU
    default: *v = 0; break;
    }
    return 0;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(EmuCtx **c, CUdevice d) {
    contexts[d].device = d;
    *c = &contexts[d];
    return 0;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return 0; }
EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice) { return 0; }
EXPORT CUresult cuCtxSetCurrent(EmuCtx *c) { current_ctx = c; return 0; }
EXPORT CUresult cuCtxGetCurrent(EmuCtx **c) { *c = current_ctx; return 0; }
EXPORT CUresult cuCtxPushCurrent_v2(EmuCtx *c) { current_ctx = c; return 0; }
EXPORT CUresult cuCtxPopCurrent_v2(EmuCtx **c) { if (c) *c = current_ctx; return 0; }
EXPORT CUresult cuCtxGetDevice(CUdevice *d) { *d = current_ctx ? current_ctx->device : 0; return 0; }
EXPORT CUresult cuCtxSynchronize() { tally("cuCtxSynchronize"); return capturing_here ? refuse(nullptr, "cuCtxSynchronize") : sticky(current_device()); }
EXPORT CUresult cuCtxSetFlags(unsigned) { return 0; }
EXPORT CUresult cuCtxGetStreamPriorityRange(int *lo, int *hi) { *lo = 0; *hi = 0; return 0; }
EXPORT CUresult cuCtxSetLimit(int, size_t) { return 0; }
EXPORT CUresult cuCtxGetLimit(size_t *v, int) { *v = 0; return 0; }

EXPORT CUresult cuDeviceGetMemPool(EmuPool **p, CUdevice d) { *p = &pools[d]; return 0; }
EXPORT CUresult cuDeviceGetDefaultMemPool(EmuPool **p, CUdevice d) { *p = &pools[d]; return 0; }
EXPORT CUresult cuMemPoolSetAttribute(EmuPool *, int, void *) { return 0; }
EXPORT CUresult cuMemPoolGetAttribute(EmuPool *, int, void *v) { memset(v, 0, 8); return 0; }
EXPORT CUresult cuMemPoolTrimTo(EmuPool *, size_t) { return 0; }

EXPORT CUresult cuStreamCreate(EmuStream **s, unsigned) { *s = new EmuStream{current_device()}; return 0; }
EXPORT CUresult cuStreamCreateWithPriority(EmuStream **s, unsigned, int) { *s = new EmuStream{current_device()}; return 0; }
EXPORT CUresult cuStreamDestroy_v2(EmuStream *s) { delete s; return 0; }
EXPORT CUresult cuStreamSynchronize(EmuStream *s) { tally("cuStreamSynchronize"); return recording(s) || capturing_here ? refuse(s, "cuStreamSynchronize") : sticky(device_of(s)); }
EXPORT CUresult cuStreamQuery(EmuStream *) { return 0; }
EXPORT CUresult cuStreamWaitEvent(EmuStream *, EmuEvent *, unsigned) { tally("cuStreamWaitEvent"); return 0; }
EXPORT CUresult cuStreamIsCapturing(EmuStream *s, int *status) { *status = recording(s) ? 1 : 0; return 0; }
EXPORT CUresult cuStreamBeginCapture_v2(EmuStream *s, int) {
    tally("cuStreamBeginCapture_v2");
    if (!s || recording(s) || capturing_here) return 1;
    s->capture = new Graph;
    s->invalid = false;
    capturing_here = s;
    return 0;
}
static void release_graph(Graph *g);
EXPORT CUresult cuStreamEndCapture(EmuStream *s, Graph **out) {
    tally("cuStreamEndCapture");
    if (!recording(s)) return 1;
    Graph *g = s->capture;
    s->capture = nullptr;
    if (capturing_here == s) capturing_here = nullptr;
    *out = nullptr;
    if (s->invalid) {
        s->invalid = false;
        release_graph(g);
        return 901; // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    }
    *out = g;
    return 0;
}
// An executable graph is its graph: instantiation copies nothing here.
EXPORT CUresult cuGraphInstantiateWithFlags(Graph **exec, Graph *g, unsigned long long) { *exec = g; return 0; }
EXPORT CUresult cuGraphUpload(Graph *, EmuStream *) { return 0; }
EXPORT CUresult cuGraphLaunch(Graph *g, EmuStream *s) {
    tally("cuGraphLaunch");
    if (recording(s)) return refuse(s, "cuGraphLaunch");
    if (int e = sticky(device_of(s))) return e;
    for (auto &op : g->ops)
        if (CUresult e = op()) return e;
    return 0;
}
EXPORT CUresult cuGraphGetNodes(Graph *g, void **nodes, size_t *count) {
    if (nodes) return 1; // only the count is emulated
    *count = g->nodes;
    return 0;
}
EXPORT CUresult cuGraphExecDestroy(Graph *) { return 0; }
EXPORT CUresult cuGraphDestroy(Graph *g) { release_graph(g); return 0; }


EXPORT CUresult cuEventCreate(EmuEvent **e, unsigned) { *e = new EmuEvent{now_ms()}; return 0; }
EXPORT CUresult cuEventRecord(EmuEvent *e, EmuStream *) { tally("cuEventRecord"); e->ms = now_ms(); return 0; }
EXPORT CUresult cuEventRecordWithFlags(EmuEvent *e, EmuStream *, unsigned) { tally("cuEventRecordWithFlags"); e->ms = now_ms(); return 0; }
EXPORT CUresult cuEventSynchronize(EmuEvent *) { tally("cuEventSynchronize"); return 0; }
EXPORT CUresult cuEventQuery(EmuEvent *) { return 0; }
EXPORT CUresult cuEventElapsedTime(float *ms, EmuEvent *a, EmuEvent *b) { *ms = (float)(b->ms - a->ms); return 0; }
EXPORT CUresult cuEventElapsedTime_v2(float *ms, EmuEvent *a, EmuEvent *b) { return cuEventElapsedTime(ms, a, b); }
EXPORT CUresult cuEventDestroy_v2(EmuEvent *e) { delete e; return 0; }

static CUresult alloc(CUdeviceptr *p, size_t bytes) {
    raise_on("alloc");
    size_t n = bytes == 0 ? 1 : bytes;
    void *m = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!m) return 2; // CUDA_ERROR_OUT_OF_MEMORY
    const char *fill = getenv("LOCKSTEP_CUDA_EMU_FILL");
    memset(m, fill ? (int)strtol(fill, nullptr, 0) : 0xFF, n);
    std::lock_guard<std::mutex> g(alloc_mu);
    allocations[(uintptr_t)m] = bytes;
    *p = (CUdeviceptr)(uintptr_t)m;
    return 0;
}
static CUresult release(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(alloc_mu);
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end()) {
        say("free of 0x%llx, which is not an allocation", p);
        return 1;
    }
    allocations.erase(it);
    free((void *)(uintptr_t)p);
    return 0;
}
static void release_graph(Graph *g) {
    if (!g) return;
    for (uintptr_t p : g->owned) {
        {
            std::lock_guard<std::mutex> l(graph_mu);
            graph_owned.erase(p);
        }
        release(p);
    }
    delete g;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) { tally("cuMemAlloc_v2"); return alloc(p, bytes); }
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t bytes, EmuStream *s) { tally("cuMemAllocAsync");
    if (int e = sticky(device_of(s))) return e;
    CUresult rc = alloc(p, bytes);
    if (rc == 0 && recording(s)) {
        std::lock_guard<std::mutex> g(graph_mu);
        s->capture->owned.push_back((uintptr_t)*p);
        s->capture->nodes++;
        graph_owned.insert((uintptr_t)*p);
    }
    return rc;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { tally("cuMemFree_v2"); return release(p); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, EmuStream *s) { tally("cuMemFreeAsync");
    {
        // A graph's memory stays while the graph does (its launches write there).
        std::lock_guard<std::mutex> g(graph_mu);
        if (graph_owned.count((uintptr_t)p)) return 0;
    }
    if (recording(s)) return refuse(s, "a free of memory the graph did not allocate");
    return release(p);
}
EXPORT CUresult cuMemAllocHost_v2(void **p, size_t bytes) { *p = malloc(bytes ? bytes : 1); return *p ? 0 : 2; }
EXPORT CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned) { return cuMemAllocHost_v2(p, bytes); }
EXPORT CUresult cuMemFreeHost(void *p) { free(p); return 0; }
EXPORT CUresult cuMemHostRegister_v2(void *, size_t, unsigned) { return 0; }
EXPORT CUresult cuMemHostUnregister(void *) { return 0; }

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { tally("cuMemcpyHtoD_v2");
    if (capturing_here) return refuse(nullptr, "a copy to the device");
    if (check_range(d, n, "copy to the device")) return 1;
    memcpy((void *)(uintptr_t)d, h, n);
    return 0;
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, EmuStream *s) { tally("cuMemcpyHtoDAsync_v2"); if (recording(s)) return refuse(s, "a copy to the device"); return sticky(device_of(s)) ? sticky(device_of(s)) : cuMemcpyHtoD_v2(d, h, n); }
EXPORT CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { tally("cuMemcpyDtoH_v2");
    if (capturing_here) return refuse(nullptr, "a copy to the host");
    if (check_range(d, n, "copy from the device")) return 1;
    memcpy(h, (void *)(uintptr_t)d, n);
    return 0;
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, EmuStream *s) { tally("cuMemcpyDtoHAsync_v2"); if (recording(s)) return refuse(s, "a copy to the host"); return sticky(device_of(s)) ? sticky(device_of(s)) : cuMemcpyDtoH_v2(h, d, n); }
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
    if (check_range(d, n, "device copy's target") || check_range(s, n, "device copy's source")) return 1;
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return 0;
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, EmuStream *st) { tally("cuMemcpyDtoDAsync_v2"); raise_on("copy"); return run_or_record(st, [=] { return cuMemcpyDtoD_v2(d, s, n); }); }
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr d, EmuCtx *, CUdeviceptr s, EmuCtx *, size_t n, EmuStream *) { return cuMemcpyDtoD_v2(d, s, n); }
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    if (check_range(d, n, "memset")) return 1;
    memset((void *)(uintptr_t)d, v, n);
    return 0;
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, EmuStream *s) { tally("cuMemsetD8Async"); raise_on("memset"); return run_or_record(s, [=] { return cuMemsetD8_v2(d, v, n); }); }
EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) {
    if (check_range(d, n * 4, "memset")) return 1;
    unsigned *p = (unsigned *)(uintptr_t)d;
    for (size_t i = 0; i < n; i++) p[i] = v;
    return 0;
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, EmuStream *s) { tally("cuMemsetD32Async"); return run_or_record(s, [=] { return cuMemsetD32_v2(d, v, n); }); }
EXPORT CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, EmuStream *s) { tally("cuMemsetD16Async");
    return run_or_record(s, [=] {
        if (check_range(d, n * 2, "memset")) return 1;
        unsigned short *p = (unsigned short *)(uintptr_t)d;
        for (size_t i = 0; i < n; i++) p[i] = v;
        return 0;
    });
}
EXPORT CUresult cuPointerGetAttribute(void *, int, CUdeviceptr) { return 1; }

// A module image from the emulated NVRTC names the shared object it built.
static const char IMAGE_TAG[] = "// lockstep-cuda-emu module: ";

EXPORT CUresult cuModuleLoadData(Module **m, const void *image) {
    const char *s = (const char *)image;
    if (strncmp(s, IMAGE_TAG, sizeof IMAGE_TAG - 1) != 0) {
        say("cuModuleLoadData: not an image from the emulated NVRTC");
        return 200; // CUDA_ERROR_INVALID_IMAGE
    }
    std::string path(s + sizeof IMAGE_TAG - 1);
    while (!path.empty() && (path.back() == '\n' || path.back() == '\0')) path.pop_back();
    void *h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        say("cuModuleLoadData: %s", dlerror());
        return 200;
    }
    *m = new Module{h, {}};
    return 0;
}
EXPORT CUresult cuModuleLoad(Module **, const char *) { return 200; }
EXPORT CUresult cuModuleUnload(Module *) { return 0; } // kept loaded: functions may outlive it
EXPORT CUresult cuModuleGetFunction(Function **f, Module *m, const char *name) {
    auto it = m->functions.find(name);
    if (it != m->functions.end()) {
        *f = it->second;
        return 0;
    }
    std::string sym = std::string("__emu_launch_") + name;
    void *p = dlsym(m->handle, sym.c_str());
    if (!p) return 500; // CUDA_ERROR_NOT_FOUND
    void *sz = dlsym(m->handle, (std::string("__emu_sizes_") + name).c_str());
    Function *fn = new Function{(LaunchFn)p, (SizesFn)sz, name};
    m->functions[name] = fn;
    *f = fn;
    return 0;
}
EXPORT CUresult cuFuncGetAttribute(int *v, int attr, Function *) {
    *v = attr == 0 ? 1024 : 0; // MAX_THREADS_PER_BLOCK
    return 0;
}
EXPORT CUresult cuFuncSetAttribute(Function *, int, int) { return 0; }
EXPORT CUresult cuFuncSetCacheConfig(Function *, int) { return 0; }
EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, Function *, int, size_t) { *n = 2; return 0; }
EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, Function *, int, size_t, unsigned) { *n = 2; return 0; }

// Run one kernel launch now (the launch's checks done), with `params` as cuLaunchKernel's.
static CUresult run_launch(Function *f, const unsigned g[3], const unsigned b[3], unsigned shared, int dev,
                           void **params) {
    if (sticky(dev)) return sticky(dev);
    tally("kernel " + f->name);
    if (skipping_kernel(f->name)) return 0;
    Launch l{{g[0], g[1], g[2]}, {b[0], b[1], b[2]}, shared, params, {0}};
    double t0 = verbose() ? now_ms() : 0;
    int rc;
    {
        std::lock_guard<std::mutex> lk(launch_mu);
        rc = f->launch(&l);
    }
    if (verbose()) say("%s <<<(%u,%u,%u),(%u,%u,%u)>>> %.2f ms", f->name.c_str(), g[0], g[1], g[2], b[0], b[1], b[2], now_ms() - t0);
    if (rc) {
        say("kernel %s on device %d failed: %s", f->name.c_str(), dev, l.error);
        lost[dev] = rc == 2 ? 700 : 719; // CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_LAUNCH_FAILED
        return lost[dev];
    }
    return 0;
}

EXPORT CUresult cuLaunchKernel(Function *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, EmuStream *stream, void **params, void **extra) { tally("cuLaunchKernel");
    int dev = device_of(stream);
    if (sticky(dev)) return sticky(dev);
    if (extra) {
        say("cuLaunchKernel: `extra` parameters are not emulated");
        return 1;
    }
    unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
    if (!recording(stream)) return run_launch(f, g, b, shared, dev, params);
    // Captured: the parameters' bytes are copied now, as the driver copies them into the node.
    if (!f->sizes) return refuse(stream, "a kernel whose parameter sizes are unknown");
    size_t sizes[64];
    int n = f->sizes(sizes, sizeof sizes / sizeof sizes[0]);
    if (n < 0) return refuse(stream, "a kernel of more than 64 parameters");
    std::vector<std::vector<char>> copies;
    for (int i = 0; i < n; i++) {
        const char *p = (const char *)params[i];
        copies.emplace_back(p, p + sizes[i]);
    }
    return run_or_record(stream, [=]() mutable {
        std::vector<void *> ps;
        for (auto &c : copies) ps.push_back(c.data());
        return run_launch(f, g, b, shared, dev, ps.data());
    });
}

EXPORT CUresult cuGetErrorString(CUresult e, const char **s) {
    switch (e) {
    case 0: *s = "no error"; break;
    case 1: *s = "invalid argument"; break;
    case 2: *s = "out of memory"; break;
    case 200: *s = "device kernel image is invalid"; break;
    case 500: *s = "named symbol not found"; break;
    case 700: *s = "an illegal memory access was encountered (emulated)"; break;
    case 719: *s = "unspecified launch failure (emulated kernel failed; see stderr)"; break;
    default: *s = "emulated CUDA error"; break;
    }
    return 0;
}
EXPORT CUresult cuGetErrorName(CUresult e, const char **s) {
    switch (e) {
    case 0: *s = "CUDA_SUCCESS"; break;
    case 1: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case 200: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
    case 500: *s = "CUDA_ERROR_NOT_FOUND"; break;
    case 700: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case 719: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; break;
    }
    return 0;
}

// =============================================================================================
// NVRTC
// =============================================================================================
struct Program {
    std::string src, name, log, image;
};

EXPORT int nvrtcVersion(int *major, int *minor) { *major = 13; *minor = 0; return 0; }
EXPORT const char *nvrtcGetErrorString(int r) {
    return r == 0 ? "NVRTC_SUCCESS" : r == 6 ? "NVRTC_ERROR_COMPILATION" : "NVRTC_ERROR (emulated)";
}
EXPORT int nvrtcCreateProgram(Program **p, const char *src, const char *name, int, const char *const *,
                              const char *const *) {
    *p = new Program{src, name ? name : "kernel.cu", "", ""};
    return 0;
}
EXPORT int nvrtcDestroyProgram(Program **p) { delete *p; *p = nullptr; return 0; }

namespace {

// The text of `s` from `open` (a '(') to its matching ')', exclusive; npos if unbalanced.
size_t matching(const std::string &s, size_t open) {
    int depth = 0;
    bool str = false;
    for (size_t i = open; i < s.size(); i++) {
        char c = s[i];
        if (str) {
            if (c == '\\') i++;
            else if (c == '"') str = false;
            continue;
        }
        if (c == '"') str = true;
        else if (c == '(') depth++;
        else if (c == ')' && --depth == 0) return i;
    }
    return std::string::npos;
}

// Splits `s` at top-level occurrences of `sep` (outside parentheses and strings).
std::vector<std::string> split_top(const std::string &s, char sep) {
    std::vector<std::string> out;
    int depth = 0;
    bool str = false;
    std::string cur;
    for (size_t i = 0; i < s.size(); i++) {
        char c = s[i];
        if (str) {
            cur += c;
            if (c == '\\' && i + 1 < s.size()) cur += s[++i];
            else if (c == '"') str = false;
            continue;
        }
        if (c == '"') str = true;
        if (c == '(') depth++;
        if (c == ')') depth--;
        if (c == sep && depth == 0) {
            out.push_back(cur);
            cur.clear();
        } else {
            cur += c;
        }
    }
    out.push_back(cur);
    return out;
}

std::string trim(const std::string &s) {
    size_t a = s.find_first_not_of(" \t\n\r"), b = s.find_last_not_of(" \t\n\r");
    return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// `"=f"(r)` -> `r`
std::string operand(const std::string &s) {
    std::string t = trim(s);
    size_t p = t.find('(');
    if (p == std::string::npos || t.back() != ')') return t;
    return t.substr(p + 1, t.size() - p - 2);
}

// Rewrites `asm(...)` statements into the emulator's functions: the known PTX templates become
// calls, anything else a trap that names it (so it fails only if it runs).
std::string rewrite_asm(const std::string &src) {
    std::string out;
    size_t i = 0;
    while (true) {
        size_t a = src.find("asm", i);
        if (a == std::string::npos) break;
        bool word = (a == 0 || !(isalnum((unsigned char)src[a - 1]) || src[a - 1] == '_')) &&
                    !(isalnum((unsigned char)src[a + 3]) || src[a + 3] == '_');
        size_t p = a + 3;
        while (p < src.size() && isspace((unsigned char)src[p])) p++;
        if (word && src.compare(p, 8, "volatile") == 0) {
            p += 8;
            while (p < src.size() && isspace((unsigned char)src[p])) p++;
        }
        if (!word || p >= src.size() || src[p] != '(') {
            out += src.substr(i, a + 3 - i);
            i = a + 3;
            continue;
        }
        size_t close = matching(src, p);
        if (close == std::string::npos) break;
        std::string body = src.substr(p + 1, close - p - 1);
        auto parts = split_top(body, ':');
        std::string tmpl;
        { // the concatenated string literals of the template
            bool in = false;
            for (size_t k = 0; k < parts[0].size(); k++) {
                char c = parts[0][k];
                if (c == '"') { in = !in; continue; }
                if (in) tmpl += c;
            }
        }
        std::vector<std::string> outs, ins;
        if (parts.size() > 1 && !trim(parts[1]).empty())
            for (auto &o : split_top(parts[1], ',')) outs.push_back(operand(o));
        if (parts.size() > 2 && !trim(parts[2]).empty())
            for (auto &o : split_top(parts[2], ',')) ins.push_back(operand(o));
        std::string rep;
        if (tmpl == "max.NaN.f32 %0, %1, %2;" && outs.size() == 1 && ins.size() == 2)
            rep = "(" + outs[0] + " = emu::max_nan_f32(" + ins[0] + ", " + ins[1] + "))";
        else if (tmpl == "min.NaN.f32 %0, %1, %2;" && outs.size() == 1 && ins.size() == 2)
            rep = "(" + outs[0] + " = emu::min_nan_f32(" + ins[0] + ", " + ins[1] + "))";
        else {
            std::string shown;
            for (char c : tmpl) shown += (c == '"' || c == '\\' || c == '\n' || c == '\t') ? ' ' : c;
            rep = "emu::unsupported_asm(\"" + shown.substr(0, 120) + "\")";
        }
        out += src.substr(i, a - i) + rep;
        i = close + 1;
    }
    out += src.substr(i);
    return out;
}

bool run(const std::vector<std::string> &argv, std::string &log) {
    std::string logf = "/tmp/cuda-emu-log-" + std::to_string(getpid()) + "-" +
                       std::to_string((uintptr_t)&log) + ".txt";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logf.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char *> args;
    for (auto &a : argv) args.push_back((char *)a.c_str());
    args.push_back(nullptr);
    pid_t pid;
    int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
        log += "cannot start " + argv[0] + ": " + strerror(rc) + "\n";
        return false;
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    FILE *f = fopen(logf.c_str(), "r");
    if (f) {
        char buf[4096];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, f)) > 0) log.append(buf, n);
        fclose(f);
    }
    unlink(logf.c_str());
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool write_file(const std::string &path, const std::string &text) {
    FILE *f = fopen(path.c_str(), "w");
    if (!f) return false;
    fwrite(text.data(), 1, text.size(), f);
    return fclose(f) == 0;
}

std::string read_file(const std::string &path) {
    std::string s;
    FILE *f = fopen(path.c_str(), "r");
    if (!f) return s;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
    fclose(f);
    return s;
}

uint64_t fnv1a(const std::string &s, uint64_t h = 1469598103934665603ull) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
}

std::string cache_dir() {
    const char *d = getenv("LOCKSTEP_CUDA_EMU_CACHE");
    std::string dir = d ? d : "/tmp/lockstep-cuda-emu-" + std::to_string(getuid());
    mkdir(dir.c_str(), 0700);
    return dir;
}

// The names of the kernels (`__global__` functions) in a preprocessed source.
std::vector<std::string> kernel_names(const std::string &pre) {
    std::vector<std::string> names;
    const std::string mark = "__emu_global__";
    for (size_t i = pre.find(mark); i != std::string::npos; i = pre.find(mark, i + 1)) {
        size_t p = i + mark.size();
        auto skip = [&] { while (p < pre.size() && isspace((unsigned char)pre[p])) p++; };
        skip();
        if (pre.compare(p, 4, "void") != 0) continue;
        p += 4;
        skip();
        size_t s = p;
        while (p < pre.size() && (isalnum((unsigned char)pre[p]) || pre[p] == '_')) p++;
        if (p > s) names.push_back(pre.substr(s, p - s));
    }
    return names;
}

} // namespace

EXPORT int nvrtcCompileProgram(Program *prog, int nopts, const char *const *opts) {
    std::string arch = "800";
    for (int i = 0; i < nopts; i++) {
        std::string o = opts[i];
        size_t c = o.find("compute_");
        if (c != std::string::npos) arch = o.substr(c + 8) + "0";
    }
    std::string dir = EMU_DIR;
    std::string shim = read_file(dir + "/device.h");
    std::string src = rewrite_asm(prog->src);
    const char *opt = getenv("LOCKSTEP_CUDA_EMU_OPT");
    std::string level = opt ? opt : "-O2";
    std::string key = std::to_string(fnv1a(src + "\n" + arch + "\n" + level + "\n" + shim));
    std::string base = cache_dir() + "/" + key;
    std::string so = base + ".so";
    struct stat sb;
    if (stat(so.c_str(), &sb) == 0) {
        prog->image = IMAGE_TAG + so + "\n";
        return 0;
    }
    std::string tag = "." + std::to_string(getpid()) + "." + std::to_string((uintptr_t)prog);
    std::string cu = base + tag + ".cpp";
    if (!write_file(cu, "#line 1 \"" + prog->name + "\"\n" + src)) {
        prog->log = "cannot write " + cu;
        return 6;
    }
    std::string cxx = getenv("CXX") ? getenv("CXX") : "g++";
    std::vector<std::string> common = {cxx, "-std=c++17", "-w", "-fPIC", "-ffp-contract=off", "-fno-fast-math",
                                       "-fvisibility=hidden", "-D__CUDA_ARCH__=" + arch, "-D__CUDACC__",
                                       "-include", dir + "/device.h"};
    // Pass 1: preprocess with `__global__` kept visible, to learn the kernels' names.
    std::vector<std::string> scan = common;
    scan.insert(scan.end(), {"-DEMU_SCAN", "-E", "-P", "-x", "c++", cu, "-o", base + tag + ".ii"});
    std::string log;
    if (!run(scan, log)) {
        prog->log = log;
        unlink(cu.c_str());
        return 6;
    }
    std::string pre = read_file(base + tag + ".ii");
    unlink((base + tag + ".ii").c_str());
    std::string wrappers = "\n";
    for (auto &n : kernel_names(pre))
        wrappers += "extern \"C\" __attribute__((visibility(\"default\"))) int __emu_launch_" + n +
                    "(emu::Launch *l) { return emu::launch(" + n + ", l); }\n" +
                    "extern \"C\" __attribute__((visibility(\"default\"))) int __emu_sizes_" + n +
                    "(size_t *out, size_t cap) { return emu::param_sizes(" + n + ", out, cap); }\n";
    write_file(cu, "#line 1 \"" + prog->name + "\"\n" + src + wrappers);
    // Pass 2: compile with the launch wrappers.
    std::vector<std::string> build = common;
    build.insert(build.end(), {level, "-g0", "-shared", "-x", "c++", cu, "-o", base + tag + ".so"});
    if (!run(build, log)) {
        prog->log = log;
        unlink(cu.c_str());
        return 6;
    }
    unlink(cu.c_str());
    rename((base + tag + ".so").c_str(), so.c_str()); // atomic: concurrent compiles race harmlessly
    prog->image = IMAGE_TAG + so + "\n";
    return 0;
}
EXPORT int nvrtcGetPTXSize(Program *p, size_t *n) { *n = p->image.size() + 1; return 0; }
EXPORT int nvrtcGetPTX(Program *p, char *out) { memcpy(out, p->image.c_str(), p->image.size() + 1); return 0; }
EXPORT int nvrtcGetProgramLogSize(Program *p, size_t *n) { *n = p->log.size() + 1; return 0; }
EXPORT int nvrtcGetProgramLog(Program *p, char *out) { memcpy(out, p->log.c_str(), p->log.size() + 1); return 0; }

// =============================================================================================
// cuBLAS (column-major SGEMM)
// =============================================================================================
struct Blas { int math_mode; EmuStream *stream; };

EXPORT int cublasCreate_v2(Blas **h) { *h = new Blas{0, nullptr}; return 0; }
EXPORT int cublasDestroy_v2(Blas *h) { delete h; return 0; }
EXPORT int cublasSetStream_v2(Blas *h, EmuStream *s) { h->stream = s; return 0; }
EXPORT int cublasSetMathMode(Blas *h, int m) { h->math_mode = m; return 0; }
EXPORT int cublasGetMathMode(Blas *h, int *m) { *m = h->math_mode; return 0; }
EXPORT int cublasSetPointerMode_v2(Blas *, int) { return 0; }
EXPORT int cublasSetWorkspace_v2(Blas *, void *, size_t) { return 0; }
EXPORT int cublasGetVersion_v2(Blas *, int *v) { *v = 130000; return 0; }
EXPORT const char *cublasGetStatusString(int s) { return s == 0 ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_ERROR (emulated)"; }
EXPORT const char *cublasGetStatusName(int s) { return cublasGetStatusString(s); }

// A dot product summed in FP64 and rounded once: about the exact value, so the emulator's GEMMs
// sit as close to the CPU's as the CPU's own rounding allows (cuBLAS's order is not public).
static inline float dot(const float *x, const float *y, int k) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int c = k / 8 * 8;
    for (int l = 0; l < c; l += 8)
        for (int u = 0; u < 8; u++) acc[u] += (double)x[l + u] * (double)y[l + u];
    double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (int l = c; l < k; l++) s += (double)x[l] * (double)y[l];
    return (float)s;
}

static inline float load(float x) { return x; }
static inline float load(uint16_t bf16) {
    uint32_t u = (uint32_t)bf16 << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// C = alpha op(A) op(B) + beta C, column-major; op(A) is m x k, op(B) k x n; ta/tb: 0 = N,
// otherwise T; A and B hold FP32 or BF16 (uint16_t) values, C FP32. Operands are first copied
// (as FP32) so that each output is a dot product of two contiguous rows. C is not read when beta
// is 0 (as cuBLAS: it may hold anything).
template <typename T>
static void sgemm(int ta, int tb, int m, int n, int k, float alpha, const T *A, int lda, const T *B,
                  int ldb, float beta, float *C, int ldc) {
    std::vector<float> a((size_t)m * k), b((size_t)n * k);
    for (int i = 0; i < m; i++)
        for (int l = 0; l < k; l++)
            a[(size_t)i * k + l] = load(ta ? A[l + (size_t)i * lda] : A[i + (size_t)l * lda]);
    for (int j = 0; j < n; j++)
        for (int l = 0; l < k; l++)
            b[(size_t)j * k + l] = load(tb ? B[j + (size_t)l * ldb] : B[l + (size_t)j * ldb]);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = dot(&a[(size_t)i * k], &b[(size_t)j * k], k);
            float &c = C[i + (size_t)j * ldc];
            c = beta == 0.0f ? alpha * s : alpha * s + beta * c;
        }
}

EXPORT int cublasSgemm_v2(Blas *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *A, int lda,
                          const float *B, int ldb, const float *beta, float *C, int ldc) { tally("cublasSgemm_v2");
    float al = *alpha, be = *beta;
    return run_or_record(h->stream, [=] {
        if (skipping_work()) return 0;
        sgemm(ta, tb, m, n, k, al, A, lda, B, ldb, be, C, ldc);
        return 0;
    });
}
EXPORT int cublasSgemmStridedBatched(Blas *h, int ta, int tb, int m, int n, int k, const float *alpha,
                                     const float *A, int lda, long long sa, const float *B, int ldb, long long sb,
                                     const float *beta, float *C, int ldc, long long sc, int batch) { tally("cublasSgemmStridedBatched");
    float al = *alpha, be = *beta;
    return run_or_record(h->stream, [=] {
        if (skipping_work()) return 0;
        for (int b = 0; b < batch; b++)
            sgemm(ta, tb, m, n, k, al, A + b * sa, lda, B + b * sb, ldb, be, C + b * sc, ldc);
        return 0;
    });
}

// cublasGemmStridedBatchedEx for what the engine asks of it: A and B FP32 (CUDA_R_32F, 0) or
// BF16 (CUDA_R_16BF, 14) alike, C FP32, FP32 compute (CUBLAS_COMPUTE_32F, 68). Summed as the
// SGEMM above: a BF16 GEMM of operands that hold BF16 values gives the SGEMM's bits.
EXPORT int cublasGemmStridedBatchedEx(Blas *h, int ta, int tb, int m, int n, int k, const void *alpha,
                                      const void *A, int at, int lda, long long sa, const void *B, int bt,
                                      int ldb, long long sb, const void *beta, void *C, int ct, int ldc,
                                      long long sc, int batch, int compute, int) {
    tally("cublasGemmStridedBatchedEx");
    if (at != bt || (at != 0 && at != 14) || ct != 0 || compute != 68) return 7; // INVALID_VALUE
    float al = *(const float *)alpha, be = *(const float *)beta;
    float *c = (float *)C;
    return run_or_record(h->stream, [=] {
        if (skipping_work()) return 0;
        for (int b = 0; b < batch; b++) {
            if (at == 14)
                sgemm(ta, tb, m, n, k, al, (const uint16_t *)A + b * sa, lda, (const uint16_t *)B + b * sb, ldb,
                      be, c + b * sc, ldc);
            else
                sgemm(ta, tb, m, n, k, al, (const float *)A + b * sa, lda, (const float *)B + b * sb, ldb, be,
                      c + b * sc, ldc);
        }
        return 0;
    });
}
