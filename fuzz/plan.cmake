ferry_fuzz(fuzz_plan_decode SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/plan_decode_fuzz.cpp DEPS ferry_plan)
