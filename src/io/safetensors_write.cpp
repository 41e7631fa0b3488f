// write_safetensors: the reference layout, written to a temporary file then renamed.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <set>
#include <system_error>

#include <nlohmann/json.hpp>

#include "ferry/safetensors.h"
#include "io/utf8.h"

namespace ferry {
namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// A JSON string literal (input is valid UTF-8, so nothing is replaced; `replace` only
// guarantees dump() never throws).
std::string quote(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Status write_all(int fd, const std::byte* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return io_error("write: {}", errno_text(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

std::atomic<uint64_t> g_tmp_counter{0};

}  // namespace

Result<std::string> encode_safetensors_header(const std::vector<SafetensorsEntry>& tensors,
                                              const std::map<std::string, std::string>& metadata,
                                              std::vector<size_t>* order_out) {
  std::set<std::string_view> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    if (name.empty()) return invalid_argument("write_safetensors: tensor {} has an empty name", i);
    if (name == "__metadata__") return invalid_argument("write_safetensors: '__metadata__' is not a tensor name");
    if (!io::is_valid_utf8(name)) return invalid_argument("write_safetensors: tensor {} has a name that is not valid UTF-8", i);
    if (!names.insert(name).second) return invalid_argument("write_safetensors: tensor '{}' appears twice", name);
    if (!t.ok()) return t.status().with_context(fmt::format("write_safetensors: tensor '{}'", name));
    if (!t.is_real()) {
      return invalid_argument("write_safetensors: tensor '{}' is recording ({}): it has no bytes to write", name,
                              t.describe());
    }
  }
  for (const auto& [k, v] : metadata) {
    if (!io::is_valid_utf8(k) || !io::is_valid_utf8(v)) {
      return invalid_argument("write_safetensors: __metadata__ entry is not valid UTF-8");
    }
  }

  // The reference order: larger dtypes first (keeps every tensor aligned), then name.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t sa = dtype_size(tensors[a].tensor.dtype()), sb = dtype_size(tensors[b].tensor.dtype());
    if (sa != sb) return sa > sb;
    return tensors[a].name < tensors[b].name;
  });

  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (!first) h += ',';
      first = false;
      h += quote(k);
      h += ':';
      h += quote(v);
    }
    h += '}';
    first = false;
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    const uint64_t nbytes = static_cast<uint64_t>(t.nbytes());
    if (!first) h += ',';
    first = false;
    h += quote(name);
    h += fmt::format(R"(:{{"dtype":"{}","shape":[)", dtype_name(t.dtype()));
    for (size_t d = 0; d < t.shape().size(); ++d) {
      if (d) h += ',';
      h += std::to_string(t.shape()[d]);
    }
    h += fmt::format(R"(],"data_offsets":[{},{}]}})", offset, offset + nbytes);
    offset += nbytes;
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  if (h.size() > kSafetensorsMaxHeaderSize) {
    return invalid_argument("write_safetensors: header of {} bytes exceeds the limit of {} bytes", h.size(),
                            kSafetensorsMaxHeaderSize);
  }

  std::string out(8, '\0');
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += h;
  if (order_out) *order_out = std::move(order);
  return out;
}

Status write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  std::vector<size_t> order;
  auto header = encode_safetensors_header(tensors, metadata, &order);
  if (!header.ok()) return header.status();

  const std::string tmp =
      fmt::format("{}.tmp.{}.{}", path, static_cast<long>(::getpid()), g_tmp_counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("write_safetensors: {}: create {}: {}", path, tmp, errno_text(errno));

  auto body = [&]() -> Status {
    FERRY_RETURN_IF_ERROR(write_all(fd, reinterpret_cast<const std::byte*>(header->data()), header->size()));
    for (size_t i : order) {
      const auto& [name, t] = tensors[i];
      if (t.numel() == 0) continue;
      Tensor c = t.is_contiguous() ? t : t.clone();
      if (!c.ok()) return c.status().with_context(fmt::format("tensor '{}'", name));
      auto p = c.data_ptr();
      if (!p.ok()) return p.status().with_context(fmt::format("tensor '{}'", name));
      FERRY_RETURN_IF_ERROR(write_all(fd, *p, static_cast<size_t>(c.nbytes())));
    }
    if (::fsync(fd) != 0) return io_error("fsync: {}", errno_text(errno));
    return Status::Ok();
  };
  Status st = body();
  if (::close(fd) != 0 && st.ok()) st = io_error("close: {}", errno_text(errno));
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) st = io_error("rename {}: {}", tmp, errno_text(errno));
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st.with_context(fmt::format("write_safetensors: {}", path));
  }
  return Status::Ok();
}

}  // namespace ferry
