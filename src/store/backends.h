// Internal: the backend factories Store::open dispatches to.
#pragma once

#include <memory>

#include "ferry/store.h"

namespace ferry::store_detail {

Result<std::unique_ptr<Store>> open_tcp_store(const StoreUrl& url, const StoreOptions& options);
Result<std::unique_ptr<Store>> open_redis_store(const StoreUrl& url, const StoreOptions& options);

}  // namespace ferry::store_detail
