// TruncationGuard (io/mapping_guard.h): SIGBUS in a watched file mapping is an error exit.
#include "io/mapping_guard.h"

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace ferry::io {
namespace {

constexpr int kSlots = 64;
constexpr size_t kMessageBytes = 1024;

// One watched range. The handler reads `begin` and `end` (lock-free atomics) and then the
// message, which watch() wrote before publishing `begin` (release) and which is not
// touched again until `begin` is 0 again.
struct Slot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<int> exit_code{1};
  char message[kMessageBytes] = {};
  size_t message_len = 0;
  bool used = false;  // under g_mu
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free);

std::array<Slot, kSlots> g_slots;
std::mutex g_mu;
struct sigaction g_previous {};
bool g_installed = false;  // under g_mu

using SigactionFn = int (*)(int, const struct sigaction*, struct sigaction*);

// libc's sigaction itself, not an override of it (UCX's keeps its own SIGBUS handler).
SigactionFn libc_sigaction() {
  static const SigactionFn fn = [] {
    void* libc = ::dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void* sym = libc != nullptr ? ::dlsym(libc, "sigaction") : nullptr;
    return sym != nullptr ? reinterpret_cast<SigactionFn>(sym) : &::sigaction;
  }();
  return fn;
}

void write_all(const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, p, n);
    if (w <= 0) return;
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Decimal digits of `v` into `out` (at least 21 bytes); returns the length.
size_t format_u64(uint64_t v, char* out) {
  char tmp[24];
  size_t n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  for (size_t i = 0; i < n; ++i) out[i] = tmp[n - 1 - i];
  return n;
}

// Async-signal-safe only: atomics, write, _exit, sigaction, raise.
void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    const uintptr_t b = s.begin.load(std::memory_order_acquire);
    const uintptr_t e = s.end.load(std::memory_order_acquire);
    if (b == 0 || addr < b || addr >= e) continue;
    char tail[96];
    size_t n = 0;
    const auto put = [&](const char* text) {
      const size_t len = std::strlen(text);
      std::memcpy(tail + n, text, len);
      n += len;
    };
    put(" (byte ");
    n += format_u64(addr - b, tail + n);
    put(" of the ");
    n += format_u64(e - b, tail + n);
    put(" mapped)\n");
    write_all(s.message, s.message_len);
    write_all(tail, n);
    ::_exit(s.exit_code.load(std::memory_order_relaxed));
  }
  // Not a watched range: whoever handled SIGBUS before, or the default action.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  libc_sigaction()(SIGBUS, &dfl, nullptr);
  // A fault repeats when the handler returns and then takes the default action; a SIGBUS
  // sent by kill does not repeat, so it is raised again.
  if (info->si_code <= 0) ::raise(sig);
}

Status install_locked() {
  if (g_installed) return Status::Ok();
  struct sigaction sa {};
  sa.sa_sigaction = &on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  if (libc_sigaction()(SIGBUS, &sa, &g_previous) != 0) {
    return internal_error("installing the SIGBUS handler for mapped files: {}", std::strerror(errno));
  }
  g_installed = true;
  return Status::Ok();
}

}  // namespace

Result<TruncationGuard> TruncationGuard::watch(const void* base, size_t size, const std::string& message,
                                               int exit_code) {
  if (base == nullptr || size == 0) return TruncationGuard();
  std::lock_guard<std::mutex> lock(g_mu);
  FERRY_RETURN_IF_ERROR(install_locked());
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[static_cast<size_t>(i)];
    if (s.used) continue;
    s.used = true;
    s.message_len = std::min(message.size(), kMessageBytes);
    std::memcpy(s.message, message.data(), s.message_len);
    s.exit_code.store(exit_code, std::memory_order_relaxed);
    s.end.store(reinterpret_cast<uintptr_t>(base) + size, std::memory_order_release);
    s.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return TruncationGuard(i);
  }
  return failed_precondition("{} file mappings are watched already (the limit)", kSlots);
}

TruncationGuard& TruncationGuard::operator=(TruncationGuard&& other) noexcept {
  if (this != &other) {
    this->~TruncationGuard();
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

TruncationGuard::~TruncationGuard() {
  if (slot_ < 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Slot& s = g_slots[static_cast<size_t>(slot_)];
  s.begin.store(0, std::memory_order_release);
  s.end.store(0, std::memory_order_release);
  s.used = false;
  slot_ = -1;
}

}  // namespace ferry::io
