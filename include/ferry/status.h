// ferry/status.h — error reporting for the whole core.
//
// Contract:
//  * Every fallible call returns `Status` or `Result<T>`; the core throws no exceptions.
//  * A Status message is meant for a person: it names the op, the tensor and the
//    argument that was wrong ("narrow: start 5 + length 4 exceeds size 8 of dim 0 of
//    [8, 2] (source 'model.embed_tokens.weight')").
//  * Both types are cheap to move and safe to copy; they carry no thread affinity.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace ferry {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // the caller passed something malformed
  kNotFound,           // a named thing does not exist
  kAlreadyExists,      // a name is taken
  kOutOfRange,         // an index or byte range is outside what is allowed
  kFailedPrecondition, // the object is not in a state that allows the call
  kCorrupt,            // bytes from outside (file, network) failed validation
  kIoError,            // the operating system refused
  kTimeout,            // a bounded wait ran out
  kUnavailable,        // a peer or service cannot be reached now
  kPeerFailed,         // a peer died or broke the protocol
  kPermissionDenied,   // authentication failed
  kCancelled,          // the operation was stopped on purpose
  kUnimplemented,      // not supported (yet) by this build or backend
  kInternal,           // a bug in ferry
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "InvalidArgument: narrow: ..." or "OK".
  std::string to_string() const;

  // A copy with `context` prepended to the message ("loading q_proj: narrow: ...").
  Status with_context(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

  void ignore() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kCorrupt: return "Corrupt";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kPeerFailed: return "PeerFailed";
    case StatusCode::kPermissionDenied: return "PermissionDenied";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

inline std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(status_code_name(code_)) + ": " + message_;
}

// fmt-style constructors: ferry::invalid_argument("narrow: dim {} out of range", d).
#define FERRY_STATUS_CTOR(fn, code)                                              \
  template <typename... Args>                                                    \
  Status fn(fmt::format_string<Args...> f, Args&&... args) {                     \
    return Status(StatusCode::code, fmt::format(f, std::forward<Args>(args)...)); \
  }
FERRY_STATUS_CTOR(invalid_argument, kInvalidArgument)
FERRY_STATUS_CTOR(not_found, kNotFound)
FERRY_STATUS_CTOR(already_exists, kAlreadyExists)
FERRY_STATUS_CTOR(out_of_range, kOutOfRange)
FERRY_STATUS_CTOR(failed_precondition, kFailedPrecondition)
FERRY_STATUS_CTOR(corrupt, kCorrupt)
FERRY_STATUS_CTOR(io_error, kIoError)
FERRY_STATUS_CTOR(timeout_error, kTimeout)
FERRY_STATUS_CTOR(unavailable, kUnavailable)
FERRY_STATUS_CTOR(peer_failed, kPeerFailed)
FERRY_STATUS_CTOR(permission_denied, kPermissionDenied)
FERRY_STATUS_CTOR(cancelled, kCancelled)
FERRY_STATUS_CTOR(unimplemented, kUnimplemented)
FERRY_STATUS_CTOR(internal_error, kInternal)
#undef FERRY_STATUS_CTOR

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}                        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).ok()); }  // NOLINT

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }

  // The error; Status::Ok() when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  T& value() & { assert(ok()); return std::get<T>(v_); }
  const T& value() const& { assert(ok()); return std::get<T>(v_); }
  T&& value() && { assert(ok()); return std::get<T>(std::move(v_)); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  T value_or(T other) const& { return ok() ? std::get<T>(v_) : std::move(other); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ferry

#define FERRY_CONCAT_INNER(a, b) a##b
#define FERRY_CONCAT(a, b) FERRY_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function when `expr` is not OK.
#define FERRY_RETURN_IF_ERROR(expr)               \
  do {                                            \
    ::ferry::Status _ferry_st = (expr);           \
    if (!_ferry_st.ok()) return _ferry_st;        \
  } while (0)

// `FERRY_ASSIGN_OR_RETURN(auto x, f());` — binds the value or returns the error.
#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
  FERRY_ASSIGN_OR_RETURN_IMPL(FERRY_CONCAT(_ferry_res_, __LINE__), lhs, expr)
#define FERRY_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
