// SafetensorsFile (one mmap'd file) and SafetensorsDir (a folder of shards).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>

#include "ferry/safetensors.h"

namespace ferry {
namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// Read-only pages holding a whole file (a mapping of it, or anonymous pages it was read
// into); unmapped when the last Tensor (or file) lets go.
struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr != nullptr) ::munmap(addr, size);
  }
};

using Index = std::map<std::string, size_t, std::less<>>;

const Tensor* find_in(const Index& index, const std::vector<SafetensorsEntry>& tensors, std::string_view name) {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second].tensor;
}

}  // namespace

struct SafetensorsFile::State {
  std::string path;
  std::shared_ptr<const Mapping> mapping;
  SafetensorsHeader header;
  std::vector<SafetensorsEntry> tensors;
  Index index;
};

namespace {

// The whole file read with pread into memory this process owns. Why not the mapping:
// a file truncated while mapped makes every later touch of a page past the new end
// raise SIGBUS, anywhere in the program (the executor, a compare, a copy), and no
// check made before a touch can rule out a truncation right after it. Reading is
// sound: a truncation during the read is a short read, reported naming the file, and
// one after it cannot change bytes already copied.
Status read_whole(int fd, const std::string& path, std::byte* out, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out + done, size - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("{}: read at byte {} of {}: {}", path, done, size, errno_text(errno));
    }
    if (n == 0) {
      return io_error("{}: the file shrank while being read (truncated to {} of the {} bytes it had when opened)",
                      path, done, size);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path, SafetensorsAccess access) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return not_found("{}: no such file", path);
    return io_error("{}: open: {}", path, errno_text(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return io_error("{}: stat: {}", path, errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("{}: not a regular file", path);
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0 && access == SafetensorsAccess::kRead) {
    // Anonymous pages filled by read_whole, then made read-only like a file mapping.
    void* addr = ::mmap(nullptr, mapping->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (addr == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return io_error("{}: allocating {} bytes to read it into: {}", path, mapping->size, errno_text(err));
    }
    mapping->addr = addr;
    if (auto rd = read_whole(fd, path, static_cast<std::byte*>(addr), mapping->size); !rd.ok()) {
      ::close(fd);
      return rd;
    }
    ::mprotect(addr, mapping->size, PROT_READ);
  } else if (mapping->size > 0) {
    void* addr = ::mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return io_error("{}: mmap of {} bytes: {}", path, mapping->size, errno_text(err));
    }
    mapping->addr = addr;
  }
  ::close(fd);  // the mapping stays valid

  auto state = std::make_shared<State>();
  state->path = path;
  const auto* base = static_cast<const std::byte*>(mapping->addr);
  auto header = parse_safetensors_header(std::span<const std::byte>(base, mapping->size));
  if (!header.ok()) return header.status().with_context(path);
  state->header = std::move(header).value();
  state->mapping = mapping;

  // Tensors hold the mapping through a shared_ptr<const void> that aliases it.
  std::shared_ptr<const void> keepalive = mapping;
  state->tensors.reserve(state->header.tensors.size());
  for (const auto& info : state->header.tensors) {
    const std::byte* p = base + state->header.data_start() + info.begin;
    Tensor t = Tensor::borrow_readonly(p, info.shape, info.dtype, keepalive, info.name);
    if (!t.ok()) return t.status().with_context(fmt::format("{}: tensor '{}'", path, info.name));
    state->index.emplace(info.name, state->tensors.size());
    state->tensors.push_back(SafetensorsEntry{info.name, std::move(t)});
  }
  return SafetensorsFile(std::move(state));
}

const std::string& SafetensorsFile::path() const { return state_->path; }
const SafetensorsHeader& SafetensorsFile::header() const { return state_->header; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return state_->header.metadata; }
const std::vector<SafetensorsEntry>& SafetensorsFile::tensors() const { return state_->tensors; }
std::span<const std::byte> SafetensorsFile::bytes() const {
  return {static_cast<const std::byte*>(state_->mapping->addr), state_->mapping->size};
}
bool SafetensorsFile::contains(std::string_view name) const { return find(name) != nullptr; }
const Tensor* SafetensorsFile::find(std::string_view name) const {
  return find_in(state_->index, state_->tensors, name);
}
Result<Tensor> SafetensorsFile::get(std::string_view name) const {
  if (const Tensor* t = find(name)) return *t;
  return not_found("tensor '{}' is not in {}", name, state_->path);
}

// ---------------------------------------------------------------------------------------

struct SafetensorsDir::State {
  std::string dir;
  std::vector<SafetensorsFile> files;
  std::vector<SafetensorsEntry> tensors;
  std::vector<size_t> file_of;  // per tensor, index into files
  Index index;
};

Result<SafetensorsDir> SafetensorsDir::open(const std::string& dir, SafetensorsAccess access) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (ec || !fs::exists(st)) {
    if (!ec || ec == std::errc::no_such_file_or_directory) return not_found("{}: no such directory", dir);
    return io_error("{}: {}", dir, ec.message());
  }
  if (!fs::is_directory(st)) return invalid_argument("{}: not a directory", dir);

  std::vector<std::string> names;
  fs::directory_iterator it(dir, ec);
  if (ec) return io_error("{}: {}", dir, ec.message());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() != ".safetensors") continue;
    std::error_code ec2;
    if (!it->is_regular_file(ec2)) continue;
    names.push_back(p.filename().string());
  }
  if (ec) return io_error("{}: {}", dir, ec.message());
  if (names.empty()) return not_found("{}: no *.safetensors files", dir);
  std::sort(names.begin(), names.end());

  auto state = std::make_shared<State>();
  state->dir = dir;
  for (const auto& name : names) {
    auto f = SafetensorsFile::open((fs::path(dir) / name).string(), access);
    if (!f.ok()) return f.status();
    const size_t fi = state->files.size();
    for (const auto& e : f->tensors()) {
      auto [pos, inserted] = state->index.emplace(e.name, state->tensors.size());
      if (!inserted) {
        return corrupt("tensor '{}' appears in both '{}' and '{}'", e.name,
                       state->files[state->file_of[pos->second]].path(), f->path());
      }
      state->tensors.push_back(e);
      state->file_of.push_back(fi);
    }
    state->files.push_back(std::move(f).value());
  }
  return SafetensorsDir(std::move(state));
}

const std::string& SafetensorsDir::dir() const { return state_->dir; }
const std::vector<SafetensorsFile>& SafetensorsDir::files() const { return state_->files; }
const std::vector<SafetensorsEntry>& SafetensorsDir::tensors() const { return state_->tensors; }
bool SafetensorsDir::contains(std::string_view name) const { return find(name) != nullptr; }
const Tensor* SafetensorsDir::find(std::string_view name) const {
  return find_in(state_->index, state_->tensors, name);
}
Result<Tensor> SafetensorsDir::get(std::string_view name) const {
  if (const Tensor* t = find(name)) return *t;
  return not_found("tensor '{}' is not in any *.safetensors file of {}", name, state_->dir);
}
const SafetensorsFile* SafetensorsDir::file_of(std::string_view name) const {
  auto it = state_->index.find(name);
  return it == state_->index.end() ? nullptr : &state_->files[state_->file_of[it->second]];
}

}  // namespace ferry
