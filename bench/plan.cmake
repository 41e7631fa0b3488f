ferry_bench(bench_plan_replay SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/plan_replay.cpp DEPS ferry_plan)
