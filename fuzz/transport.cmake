# transport wire formats: addresses, remote keys, message headers (src/transport/wire.h),
# and the token handshake's frame.
if(TARGET ferry_transport)
  ferry_fuzz(fuzz_transport_wire SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/transport_wire_fuzz.cpp DEPS ferry_transport)
  ferry_fuzz(fuzz_transport_handshake SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/transport_handshake_fuzz.cpp DEPS ferry_transport)
endif()
