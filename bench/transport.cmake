# bench_transport_ucx: ferry's UCX read/write bandwidth between two local processes
# (the binary forks its own target). bench/transport_vs_perftest.sh runs it side by
# side with ucx_perftest.
if(TARGET ferry_transport)
  ferry_bench(bench_transport_ucx SOURCES ${CMAKE_CURRENT_LIST_DIR}/transport_ucx_bw.cpp DEPS ferry_transport)
endif()
