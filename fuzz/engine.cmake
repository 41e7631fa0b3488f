# Engine wire and store formats: typed messages, leases, the in-place table.
if(TARGET ferry_engine)
  ferry_fuzz(fuzz_engine_protocol SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/engine_protocol_fuzz.cpp DEPS ferry_engine)
endif()
# Metadata and holdings JSON published in the store (src/engine/rendezvous.h).
if(TARGET ferry_engine)
  ferry_fuzz(fuzz_rendezvous SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/rendezvous_fuzz.cpp DEPS ferry_engine)
endif()
