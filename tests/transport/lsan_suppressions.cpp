// LeakSanitizer suppressions for the transport test binaries: UCX keeps some global
// allocations (its config parser, memory-type cache, and the libraries it dlopen()s)
// until process exit. Only UCX-internal frames are suppressed, never ferry's.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:libucs.so\n"
         "leak:libuct.so\n"
         "leak:libucp.so\n"
         "leak:libucm.so\n";
}
