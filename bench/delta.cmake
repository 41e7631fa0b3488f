ferry_bench(bench_delta_patch SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/delta_patch.cpp DEPS ferry_delta)
