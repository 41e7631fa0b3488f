// Whether this test is built with a sanitizer, as gcc says it (__SANITIZE_ADDRESS__,
// __SANITIZE_THREAD__) or clang does (__has_feature): the sanitizer build is clang's
// (Makefile, `make asan`), a developer's may be either.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define FERRY_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FERRY_TEST_ASAN 1
#endif
#endif
#ifndef FERRY_TEST_ASAN
#define FERRY_TEST_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__)
#define FERRY_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TEST_TSAN 1
#endif
#endif
#ifndef FERRY_TEST_TSAN
#define FERRY_TEST_TSAN 0
#endif

// ASan or TSan: shadow memory reserved up front, so no address-space cap applies.
#define FERRY_TEST_SANITIZED (FERRY_TEST_ASAN || FERRY_TEST_TSAN)
