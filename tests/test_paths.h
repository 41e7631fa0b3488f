// Where a test finds the files of the build it runs in: the source tree, the configs, the
// ferry binary, the emulated CUDA plugin. Looked up at run time from one small generated
// source (test_paths.cpp in the build tree, library ferry_test_paths), not compiled into
// the tests' own sources: a compile command that names this clone's folder would miss the
// compiler cache in every other clone (Makefile, CCACHE_BASEDIR).
#pragma once

namespace ferry::test_paths {
const char* source_dir();            // the source tree this build was configured from
const char* configs_dir();           // <source>/configs
const char* test_configs_dir();      // <source>/tests/models/configs
const char* ferry_binary();          // the `ferry` executable of this build
const char* emulated_cuda_plugin();  // the emulated CUDA plugin of this build; "" without one
}  // namespace ferry::test_paths

#define FERRY_SOURCE_DIR ::ferry::test_paths::source_dir()
#define FERRY_CONFIGS_DIR ::ferry::test_paths::configs_dir()
#define FERRY_TEST_CONFIGS_DIR ::ferry::test_paths::test_configs_dir()
#define FERRY_BINARY ::ferry::test_paths::ferry_binary()
#define FERRY_BIN ::ferry::test_paths::ferry_binary()
