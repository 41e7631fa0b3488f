// read_checkpoint_dir over ferry_io's SafetensorsDir (built only when the io module is).
#include "ferry/models.h"
#include "ferry/safetensors.h"

namespace ferry {

Result<TensorMap> read_checkpoint_dir(const std::string& dir) {
  FERRY_ASSIGN_OR_RETURN(SafetensorsDir d, SafetensorsDir::open(dir));
  TensorMap out;
  out.reserve(d.size());
  for (const auto& e : d.tensors()) out.emplace(e.name, e.tensor);
  return out;
}

}  // namespace ferry
