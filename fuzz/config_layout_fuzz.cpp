// Untrusted text as an HF config.json (ModelConfig::parse and the loader it selects)
// and as the --trainer and --inference layout strings: never a crash, an overflow or an
// unbounded allocation; a layout that parses prints to a string that parses to the
// same layout, within the rank bound.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "ferry/models.h"
#include "ferry/source.h"

using namespace ferry;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto t = TrainerLayout::parse(text); t.ok()) {
    if (t->world_size() <= 0 || t->world_size() > TrainerLayout::kMaxRanks) std::abort();
    auto again = TrainerLayout::parse(t->to_string());
    if (!again.ok() || again->to_string() != t->to_string()) std::abort();
  }
  if (auto i = InferenceLayout::parse(text); i.ok()) {
    if (i->world_size() <= 0 || i->world_size() > (1 << 20)) std::abort();
    auto again = InferenceLayout::parse(i->to_string());
    if (!again.ok() || again->to_string() != i->to_string()) std::abort();
  }
  if (auto c = ModelConfig::parse(text, "fuzz.json"); c.ok()) {
    (void)model_info_from_config(c->json());
    (void)c->get_int_or("num_hidden_layers", 0);
    (void)c->get_int_list_or("layer_types", {});
  }
  return 0;
}
