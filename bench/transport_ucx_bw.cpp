// bench_transport_ucx — ferry's UCX read (get) and write (put) bandwidth between two
// processes on this host, in the shape of ucx_perftest's ucp_get / ucp_put_bw:
// the same message size repeated `iters` times with up to `window` operations in
// flight, one buffer reused (warm), writes flushed once at the end.
//
//   bench_transport_ucx [--tls sm,self] [--op read|write|both] [--sizes 65536,1048576]
//                       [--iters N] [--bytes-per-size B] [--window W] [--memory ucx|user]
//
// Buffers come from Transport::allocate_memory on both sides (as ucx_perftest's come
// from ucp_mem_map(ALLOCATE)); --memory user registers plain heap buffers instead.
//
// Prints one line per (op, size): "ferry <op> <size> <MB/s>" (MB = 2^20 bytes, as
// ucx_perftest). Without arguments: a quick run over shm and tcp (used by `make bench`).
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/transport.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string tls = "sm,self";
  std::string op = "both";
  std::vector<uint64_t> sizes = {65536, 1 << 20, 16 << 20, 64 << 20};
  uint64_t iters = 0;                 // 0: derived from bytes_per_size
  uint64_t bytes_per_size = 2ull << 30;
  int window = 16;
  bool user_memory = false;  // --memory user: register malloc'd buffers instead of allocate_memory
};

Result<MemoryRegion> buffer(Transport& t, const Args& a, uint64_t bytes, std::vector<std::byte>& keep) {
  if (!a.user_memory) return t.allocate_memory(bytes);
  keep.assign(bytes, std::byte{1});
  return t.register_memory(keep.data(), keep.size());
}

TransportOptions options(const Args& a) {
  TransportOptions o;
  o.backend = "ucx";
  o.params = {{"tls", a.tls}, {"net_devices", "lo"}};
  return o;
}

bool write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return false;
    off += size_t(n);
  }
  return true;
}

std::string hex(std::span<const std::byte> b) {
  std::string s;
  char buf[3];
  for (std::byte x : b) {
    std::snprintf(buf, sizeof buf, "%02x", unsigned(x));
    s += buf;
  }
  return s;
}

std::vector<std::byte> unhex(const std::string& s) {
  std::vector<std::byte> out;
  for (size_t i = 0; i + 1 < s.size(); i += 2) out.push_back(std::byte(std::stoul(s.substr(i, 2), nullptr, 16)));
  return out;
}

// The target: registers a region, sends "address key\n" up the pipe, serves (its
// progress thread does) until the parent closes its end.
int serve(const Args& a, uint64_t bytes, int to_parent, int from_parent) {
  auto t = Transport::create(options(a));
  if (!t.ok()) {
    std::fprintf(stderr, "target: %s\n", t.status().to_string().c_str());
    return 1;
  }
  std::vector<std::byte> mem;
  auto mr = buffer(**t, a, bytes, mem);
  if (!mr.ok()) return 1;
  std::memset(mr->base, 1, bytes);
  auto key = (*t)->export_key(*mr);
  if (!key.ok()) return 1;
  if (!write_all(to_parent, hex((*t)->address()) + " " + hex(*key) + "\n")) return 1;
  char c;
  while (::read(from_parent, &c, 1) > 0) {
  }
  return 0;
}

double run_op(Transport& t, bool is_write, const MemoryRegion& mr, const RemoteRegion& rr, PeerId peer,
              uint64_t size, uint64_t iters, int window) {
  std::vector<Completion> ring(static_cast<size_t>(window));
  auto go = [&](uint64_t n) -> bool {
    for (uint64_t i = 0; i < n; ++i) {
      Completion& slot = ring[i % ring.size()];
      if (slot.valid() && !slot.wait(std::chrono::seconds(60)).ok()) return false;
      auto c = is_write ? t.write(mr, 0, rr, 0, size) : t.read(mr, 0, rr, 0, size);
      if (!c.ok()) return false;
      slot = *c;
    }
    for (auto& c : ring) {
      if (c.valid() && !c.wait(std::chrono::seconds(60)).ok()) return false;
      c = Completion();
    }
    if (is_write) {
      auto f = t.flush(peer);
      if (!f.ok() || !f->wait(std::chrono::seconds(60)).ok()) return false;
    }
    return true;
  };
  if (!go(std::max<uint64_t>(2, iters / 10))) return -1;  // warm-up
  auto t0 = Clock::now();
  if (!go(iters)) return -1;
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  return double(size) * double(iters) / secs / (1024.0 * 1024.0);
}

int bench(const Args& a) {
  uint64_t max_size = 0;
  for (uint64_t s : a.sizes) max_size = std::max(max_size, s);
  int up[2], down[2];
  if (pipe(up) != 0 || pipe(down) != 0) return 1;
  pid_t pid = fork();  // before any UCX state exists in this process
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    _exit(serve(a, max_size, up[1], down[0]));
  }
  close(up[1]);
  close(down[0]);
  std::string line;
  char c;
  while (::read(up[0], &c, 1) == 1 && c != '\n') line += c;
  int rc = 1;
  {
    auto sp = line.find(' ');
    auto t = Transport::create(options(a));
    if (sp != std::string::npos && t.ok()) {
      auto peer = (*t)->connect(unhex(line.substr(0, sp)));
      auto rr = peer.ok() ? (*t)->import_key(unhex(line.substr(sp + 1))) : Result<RemoteRegion>(peer.status());
      std::vector<std::byte> mem;
      auto mr = buffer(**t, a, max_size, mem);
      if (mr.ok()) std::memset(mr->base, 2, max_size);
      if (rr.ok() && mr.ok()) {
        rc = 0;
        for (int w = 0; w < 2; ++w) {
          bool is_write = w == 1;
          if ((is_write && a.op == "read") || (!is_write && a.op == "write")) continue;
          for (uint64_t size : a.sizes) {
            uint64_t iters = a.iters ? a.iters : std::max<uint64_t>(8, a.bytes_per_size / size);
            double mbs = run_op(**t, is_write, *mr, *rr, *peer, size, iters, a.window);
            std::printf("ferry %s %llu %.1f\n", is_write ? "write" : "read", (unsigned long long)size, mbs);
            std::fflush(stdout);
            if (mbs < 0) rc = 1;
          }
        }
      } else {
        std::fprintf(stderr, "bench: setup failed: %s %s\n", rr.status().to_string().c_str(),
                     mr.status().to_string().c_str());
      }
    } else {
      std::fprintf(stderr, "bench: no target\n");
    }
  }
  close(down[1]);
  close(up[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  return rc;
}

std::vector<uint64_t> parse_sizes(const std::string& s) {
  std::vector<uint64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoull(item));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (argc == 1) {
    // Quick default for `make bench`: a few sizes, both transports.
    a.sizes = {65536, 1 << 20, 16 << 20};
    a.bytes_per_size = 256 << 20;
    int rc = 0;
    for (const char* tls : {"sm,self", "sm,tcp,self", "tcp,self"}) {
      a.tls = tls;
      std::printf("# UCX_TLS=%s\n", tls);
      rc |= bench(a);
    }
    return rc;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--tls") a.tls = v;
    else if (k == "--op") a.op = v;
    else if (k == "--sizes") a.sizes = parse_sizes(v);
    else if (k == "--iters") a.iters = std::stoull(v);
    else if (k == "--bytes-per-size") a.bytes_per_size = std::stoull(v);
    else if (k == "--window") a.window = std::stoi(v);
    else if (k == "--memory") a.user_memory = v == "user";
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  return bench(a);
}
