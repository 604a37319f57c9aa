// The two-sample chi-square test of homogeneity the sampling-losslessness
// tests use (tests/executor/engine/speculation_step_test.cc,
// logits_processors_lossless_test.cc): histograms of output token tuples from
// two samplers, the statistic, its p-value. Header-only, stateless.
#ifndef KNAPSERVE_TESTS_TESTING_CHI_SQUARE_H_
#define KNAPSERVE_TESTS_TESTING_CHI_SQUARE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace knapserve::testing {

// Regularized upper incomplete gamma function Q(a, x) (series for x < a+1,
// Lentz's continued fraction otherwise), enough for chi-square p-values.
inline double UpperGammaQ(double a, double x) {
  if (x <= 0) return 1.0;
  const double log_prefactor = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 10000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::abs(term) < std::abs(sum) * 1e-15) break;
    }
    return std::max(0.0, 1.0 - sum * std::exp(log_prefactor));
  }
  constexpr double kTiny = 1e-300;
  double b = x + 1 - a, c = 1 / kTiny, d = 1 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::abs(d) < kTiny) d = kTiny;
    c = b + an / c;
    if (std::abs(c) < kTiny) c = kTiny;
    d = 1 / d;
    const double delta = d * c;
    h *= delta;
    if (std::abs(delta - 1) < 1e-15) break;
  }
  return std::exp(log_prefactor) * h;
}

inline double ChiSquarePValue(double statistic, int df) {
  return UpperGammaQ(df / 2.0, statistic / 2.0);
}

// Counts of output tuples (one bin per tuple of token ids).
using Histogram = std::map<std::vector<int32_t>, int64_t>;

struct ChiSquare {
  double statistic = 0;
  int df = 0;
  double p_value = 1;
  std::string Describe() const {
    return absl::StrCat("chi2 ", statistic, " df ", df, " p ", p_value);
  }
};

// Two-sample chi-square test of homogeneity (Numerical Recipes' chstwo with
// unequal sizes): bins whose pooled count is below 10 (expected count below 5
// per sample for equal sizes) are merged into one, and that one into the
// smallest other bin if it is still below 10.
inline ChiSquare TwoSampleChiSquare(const Histogram& a, const Histogram& b) {
  Histogram pooled = a;
  for (const auto& [key, count] : b) pooled[key] += count;
  std::vector<std::pair<int64_t, int64_t>> bins;  // (count in a, count in b)
  std::pair<int64_t, int64_t> other = {0, 0};
  for (const auto& [key, total] : pooled) {
    const int64_t ca = a.count(key) ? a.at(key) : 0;
    const int64_t cb = b.count(key) ? b.at(key) : 0;
    if (total < 10) {
      other.first += ca;
      other.second += cb;
    } else {
      bins.push_back({ca, cb});
    }
  }
  if (other.first + other.second > 0) {
    if (other.first + other.second >= 10 || bins.empty()) {
      bins.push_back(other);
    } else {
      auto smallest = std::min_element(
          bins.begin(), bins.end(), [](const auto& x, const auto& y) {
            return x.first + x.second < y.first + y.second;
          });
      smallest->first += other.first;
      smallest->second += other.second;
    }
  }
  double na = 0, nb = 0;
  for (const auto& [ca, cb] : bins) {
    na += ca;
    nb += cb;
  }
  ChiSquare result;
  const double ka = std::sqrt(nb / na), kb = std::sqrt(na / nb);
  for (const auto& [ca, cb] : bins) {
    const double diff = ka * ca - kb * cb;
    result.statistic += diff * diff / (ca + cb);
  }
  result.df = std::max<int>(1, static_cast<int>(bins.size()) - 1);
  result.p_value = ChiSquarePValue(result.statistic, result.df);
  return result;
}

// The histogram of output positions `positions` of `outputs` (one joint bin
// per tuple; -1 for a position past an output's end).
inline Histogram Tally(const std::vector<std::vector<int32_t>>& outputs,
                       const std::vector<int>& positions) {
  Histogram h;
  for (const auto& out : outputs) {
    std::vector<int32_t> key;
    for (int p : positions)
      key.push_back(p < static_cast<int>(out.size()) ? out[p] : -1);
    ++h[key];
  }
  return h;
}

}  // namespace knapserve::testing

#endif  // KNAPSERVE_TESTS_TESTING_CHI_SQUARE_H_
