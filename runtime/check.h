// Errors. Every failure a user can cause is an exception that says what was
// expected and what was found; library code never aborts.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tessera {

// The one exception type Tessera throws for bad input and misuse.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
[[noreturn]] void throw_error(const std::string& message);
[[noreturn]] void throw_call_error(const char* file, int line, const char* call,
                                   const std::string& detail);
}  // namespace detail

}  // namespace tessera

// TS_CHECK(cond, "fmt", args...): throws tessera::Error with the formatted message.
#define TS_CHECK(cond, ...)                                          \
  do {                                                               \
    if (!(cond)) ::tessera::detail::throw_error(fmt::format(__VA_ARGS__)); \
  } while (0)

// For internal invariants that user input cannot break; still an exception, never an abort.
#define TS_ASSERT(cond)                                                                   \
  do {                                                                                    \
    if (!(cond))                                                                          \
      ::tessera::detail::throw_call_error(__FILE__, __LINE__, #cond, "internal invariant"); \
  } while (0)
