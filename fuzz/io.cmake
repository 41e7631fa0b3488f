# io: safetensors header parsing (src/io/safetensors_parse.cpp).
ferry_fuzz(fuzz_safetensors_header SOURCES ${PROJECT_SOURCE_DIR}/fuzz/safetensors_header_fuzz.cpp DEPS ferry_io)
