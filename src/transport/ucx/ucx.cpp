#include "transport/backend.h"
namespace ferry::detail {
Result<std::unique_ptr<TransportBackend>> make_ucx_backend(const TransportOptions&) {
  return unimplemented("ucx backend: not yet");
}
}  // namespace ferry::detail
