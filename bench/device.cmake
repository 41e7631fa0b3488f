ferry_bench(bench_device_copy SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/device_copy.cpp DEPS ferry_models ferry_plan)
target_compile_definitions(bench_device_copy PRIVATE FERRY_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
