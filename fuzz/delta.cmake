ferry_fuzz(fuzz_delta_patch SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/delta_patch_fuzz.cpp DEPS ferry_delta)
