#include "common/trace/span_context.h"

#include <random>

namespace knapserve::trace {
namespace {

template <size_t N>
bool NonZero(const std::array<uint8_t, N>& bytes) {
  for (uint8_t b : bytes) {
    if (b != 0) return true;
  }
  return false;
}

template <size_t N>
std::string Hex(const std::array<uint8_t, N>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * N, '0');
  for (size_t i = 0; i < N; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 0xf];
  }
  return out;
}

// One lower-case hex digit, or -1.
int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// `text` (exactly 2 N lower-case hex digits) into `out`.
template <size_t N>
bool ParseHex(std::string_view text, std::array<uint8_t, N>& out) {
  if (text.size() != 2 * N) return false;
  for (size_t i = 0; i < N; ++i) {
    const int hi = HexDigit(text[2 * i]);
    const int lo = HexDigit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

std::mt19937_64& Generator() {
  thread_local std::mt19937_64 generator = [] {
    std::random_device device;
    std::seed_seq seed{device(), device(), device(), device()};
    return std::mt19937_64(seed);
  }();
  return generator;
}

template <size_t N>
std::array<uint8_t, N> RandomNonZero() {
  std::array<uint8_t, N> id{};
  do {
    for (size_t i = 0; i < N; i += 8) {
      uint64_t word = Generator()();
      for (size_t j = i; j < N && j < i + 8; ++j) {
        id[j] = static_cast<uint8_t>(word);
        word >>= 8;
      }
    }
  } while (!NonZero(id));
  return id;
}

}  // namespace

bool IsValid(const TraceId& id) { return NonZero(id); }
bool IsValid(const SpanId& id) { return NonZero(id); }
std::string ToHex(const TraceId& id) { return Hex(id); }
std::string ToHex(const SpanId& id) { return Hex(id); }
TraceId RandomTraceId() { return RandomNonZero<16>(); }
SpanId RandomSpanId() { return RandomNonZero<8>(); }

std::string FormatTraceparent(const SpanContext& context) {
  if (!context.valid()) return "";
  return "00-" + Hex(context.trace_id) + "-" + Hex(context.span_id) +
         (context.sampled ? "-01" : "-00");
}

std::optional<SpanContext> ParseTraceparent(std::string_view header) {
  while (!header.empty() && (header.front() == ' ' || header.front() == '\t'))
    header.remove_prefix(1);
  while (!header.empty() && (header.back() == ' ' || header.back() == '\t'))
    header.remove_suffix(1);
  // version "-" trace-id "-" parent-id "-" flags: 2 + 1 + 32 + 1 + 16 + 1 + 2.
  constexpr size_t kLength = 55;
  if (header.size() < kLength) return std::nullopt;
  std::array<uint8_t, 1> version{};
  std::array<uint8_t, 1> flags{};
  SpanContext context;
  if (!ParseHex(header.substr(0, 2), version) || header[2] != '-' ||
      !ParseHex(header.substr(3, 32), context.trace_id) || header[35] != '-' ||
      !ParseHex(header.substr(36, 16), context.span_id) || header[52] != '-' ||
      !ParseHex(header.substr(53, 2), flags)) {
    return std::nullopt;
  }
  if (version[0] == 0xff) return std::nullopt;
  // Version 00 is exactly 55 characters; a later version may append fields
  // after another '-', which this parser does not know and skips.
  if (version[0] == 0x00 && header.size() != kLength) return std::nullopt;
  if (header.size() > kLength && header[kLength] != '-') return std::nullopt;
  if (!context.valid()) return std::nullopt;
  context.sampled = (flags[0] & 0x01) != 0;
  return context;
}

}  // namespace knapserve::trace
