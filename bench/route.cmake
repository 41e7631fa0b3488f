if(TARGET ferry_models)
  ferry_bench(bench_route_scale SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/route_scale.cpp DEPS ferry_route ferry_models)
  target_compile_definitions(bench_route_scale PRIVATE FERRY_CONFIGS_DIR="${PROJECT_SOURCE_DIR}/configs")
endif()
