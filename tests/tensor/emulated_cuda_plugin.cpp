// libferry_cuda_emulated.so: a stand-in for the CUDA plugin (src/tensor/device_plugin.h)
// that runs on the CPU, for ferry's own tests on machines without a GPU. Loaded through
// FERRY_CUDA_PLUGIN, it reports emulated devices whose memory is host memory, so every
// path that takes GPU memory — the batch kernel (run thread by thread as the real one
// runs it: BatchCursor and copy_word of batch_layout.h), FP8 tiles (fp8_blocks.h), the
// engine's staged and GPU-staging paths, CUDA IPC between processes — runs end to end
// and is checked bit for bit. What it cannot show is anything about a real GPU: launch
// limits, device memory semantics, speed. Those are the device checks
// (scripts/device-check.sh). Never installed.
//
// Device memory is a shared memory file (memfd) mapped into this process, so that CUDA
// IPC can be emulated too: a handle names the exporting process and the file's
// descriptor, and another process of this host maps the same file through
// /proc/<pid>/fd/<fd> (the same user, as CUDA IPC needs).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "tensor/device_plugin.h"
#include "tensor/fp8_blocks.h"

namespace {

using ferry::batch::BatchCursor;
using ferry::batch::BlockTask;
using ferry::batch::CopyDesc;
using ferry::batch::kThreadsPerBlock;

struct Mapping {
  size_t bytes;
  int fd;  // the memfd of an allocation; -1 for a mapping opened from a handle
};
std::mutex mu;
std::map<void*, Mapping> mappings;

struct Handle {
  char magic[8];  // "FERRYEMU"
  uint64_t pid;
  int64_t fd;
  uint64_t bytes;
  char pad[32];
};
static_assert(sizeof(Handle) == 64, "CUDA IPC handles are 64 bytes");

int say(char* err, size_t len, const char* what) {
  std::snprintf(err, len, "emulated CUDA: %s", what);
  return 1;
}

int devices() {
  const char* n = std::getenv("FERRY_EMULATED_CUDA_DEVICES");
  return n != nullptr ? std::atoi(n) : 1;
}

int device_count(char*, size_t) { return devices(); }

int device_name(int device, char* out, size_t out_len) {
  std::snprintf(out, out_len, "ferry emulated CUDA device %d (host memory; tests only)", device);
  return 0;
}

int alloc(int device, size_t bytes, void** out, char* err, size_t err_len) {
  if (device < 0 || device >= devices()) return say(err, err_len, "no such device");
  // One descriptor per allocation (CUDA IPC maps it from other processes): raise the soft
  // limit to the hard one once, so that a model of many tensors does not run out.
  static const bool raised = [] {
    rlimit r{};
    if (getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
      r.rlim_cur = r.rlim_max;
      setrlimit(RLIMIT_NOFILE, &r);
    }
    return true;
  }();
  (void)raised;
  const size_t n = bytes == 0 ? 1 : bytes;
  const int fd = memfd_create("ferry-emulated-cuda", MFD_CLOEXEC);
  if (fd < 0) return say(err, err_len, "memfd_create failed");
  if (ftruncate(fd, static_cast<off_t>(n)) != 0) {
    close(fd);
    return say(err, err_len, "out of memory (ftruncate)");
  }
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return say(err, err_len, "out of memory (mmap)");
  }
  std::lock_guard<std::mutex> lk(mu);
  mappings[p] = Mapping{n, fd};
  *out = p;
  return 0;
}

int unmap(void* ptr) {
  Mapping m;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = mappings.find(ptr);
    if (it == mappings.end()) return 1;
    m = it->second;
    mappings.erase(it);
  }
  munmap(ptr, m.bytes);
  if (m.fd >= 0) close(m.fd);
  return 0;
}

int release(void* ptr) { return unmap(ptr); }

int copy_bytes(void* dst, const void* src, size_t bytes, char*, size_t) {
  std::memmove(dst, src, bytes);
  return 0;
}

int host_register(int, void*, size_t, char*, size_t) { return 0; }  // host memory is the device's
int host_release(void*) { return 0; }

// The kernel's loop, block by block and thread by thread (as emulate_batch).
int run_batch(int device, const CopyDesc* descs, uint64_t, const BlockTask* tasks, uint64_t num_tasks, void*, char* err,
              size_t err_len) {
  if (device < 0 || device >= devices()) return say(err, err_len, "no such device");
  for (uint64_t b = 0; b < num_tasks; ++b) {
    const BlockTask& task = tasks[b];
    const CopyDesc& d = descs[task.desc];
    for (uint32_t t = 0; t < kThreadsPerBlock && t < task.count; ++t) {
      BatchCursor cur(&d, task.first + t);
      for (uint32_t w = t; w < task.count; w += kThreadsPerBlock) {
        ferry::batch::copy_word(d, cur.src_offset(), cur.dst_offset());
        cur.advance(kThreadsPerBlock);
      }
    }
  }
  return 0;
}

// The tile kernel's arithmetic: amax over the tile, then each value encoded.
int fp8_blocks(int device, const void* src, uint8_t type, int64_t batch, int64_t rows, int64_t cols, int64_t block,
               uint8_t format, void* q, void* scales, void*, char* err, size_t err_len) {
  using namespace ferry::batch;
  if (device < 0 || device >= devices()) return say(err, err_len, "no such device");
  fp8_quantize_tiles(static_cast<const unsigned char*>(src), type, batch, rows, cols, block, format,
                     static_cast<unsigned char*>(q), static_cast<unsigned char*>(scales));
  return 0;
}

int ipc_export(void* ptr, void* handle, char* err, size_t err_len) {
  Handle h{};
  std::memcpy(h.magic, "FERRYEMU", 8);
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = mappings.find(ptr);
    if (it == mappings.end() || it->second.fd < 0) return say(err, err_len, "not the start of an allocation");
    h.fd = it->second.fd;
    h.bytes = it->second.bytes;
  }
  h.pid = static_cast<uint64_t>(getpid());
  std::memcpy(handle, &h, sizeof(h));
  return 0;
}

int ipc_open(int device, const void* handle, void** out, char* err, size_t err_len) {
  if (device < 0 || device >= devices()) return say(err, err_len, "no such device");
  Handle h;
  std::memcpy(&h, handle, sizeof(h));
  if (std::memcmp(h.magic, "FERRYEMU", 8) != 0) return say(err, err_len, "not an emulated handle");
  if (h.pid == static_cast<uint64_t>(getpid())) return say(err, err_len, "a handle of this process (invalid context)");
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%llu/fd/%lld", static_cast<unsigned long long>(h.pid),
                static_cast<long long>(h.fd));
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return say(err, err_len, "the exporting process or its memory is gone");
  void* p = mmap(nullptr, h.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return say(err, err_len, "mmap of the exported memory failed");
  std::lock_guard<std::mutex> lk(mu);
  mappings[p] = Mapping{h.bytes, -1};
  *out = p;
  return 0;
}

int ipc_close(void* ptr) { return unmap(ptr); }

const FerryCudaPlugin kPlugin = {FERRY_CUDA_PLUGIN_ABI, sizeof(CopyDesc), device_count, device_name, alloc,
                                 release, copy_bytes, host_register, host_release, run_batch, fp8_blocks,
                                 ipc_export, ipc_open, ipc_close};

}  // namespace

extern "C" __attribute__((visibility("default"))) const FerryCudaPlugin* ferry_cuda_plugin_v1(void) { return &kPlugin; }
