ferry_fuzz(fuzz_store_frame SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/store_frame_fuzz.cpp DEPS ferry_store)
# Redis replies (RESP2 bytes through hiredis' reader, then store/redis/replies.h).
pkg_check_modules(FUZZ_HIREDIS REQUIRED IMPORTED_TARGET hiredis)
ferry_fuzz(fuzz_redis_reply SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/redis_reply_fuzz.cpp DEPS ferry_store PkgConfig::FUZZ_HIREDIS)
