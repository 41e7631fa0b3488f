ferry_fuzz(fuzz_store_frame SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/store_frame_fuzz.cpp DEPS ferry_store)
