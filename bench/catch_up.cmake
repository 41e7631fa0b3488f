# A joiner's catch-up from the replicas against a plain sync (issue 45; docs/elastic.md).
if(TARGET ferry_tools)
  add_executable(bench_catch_up ${CMAKE_CURRENT_SOURCE_DIR}/catch_up.cpp)
  target_include_directories(bench_catch_up PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(bench_catch_up PRIVATE ferry_tools ferry_engine CLI11::CLI11 nlohmann_json::nlohmann_json
                        PkgConfig::XXHASH ferry_warnings)
  target_compile_definitions(bench_catch_up PRIVATE FERRY_CONFIGS_DIR="${PROJECT_SOURCE_DIR}/configs")
endif()
