// Randomized jit: random small graphs (a few chained ops on random shapes whose dimensions
// divide the mesh, random valid input shardings, now and then a with_sharding_constraint)
// run through jit on Client::local(8) and compared with the host reference. The ops include
// issue #15's (take, scatter_add, lax.gather / scatter_add with dimension numbers, dynamic_slice /
// dynamic_update_slice, rem, clamp, erf, stop_gradient, cumulative scans, pad, sort, argsort, argmin, top_k, tril /
// triu, einsum, scan, fori_loop, while_loop, switch / cond, x.at[i].set / lax.scatter, and tessera::random's bits,
// uniform, normal and bernoulli from keys made, folded in and split in the graph). The host
// reference is evaluate_on_host (tests/support/host_eval.h): the worker kernels on whole arrays
// (random_bits' threefry is checked against JAX's known answers in tests/worker/kernels_test.cc),
// loops and branches run by their definitions, nothing of the partitioner involved.
//
// Graph i of a run is built from seed base + i; the base is TESSERA_RANDOM_SEED when set (else
// a fixed default), and every failure (a crash too) prints its graph's seed and program, so
//   TESSERA_RANDOM_SEED=<seed> TESSERA_RANDOM_GRAPHS=1 build/bin/jit_ops_test --gtest_filter='Random*<mesh>'
// replays exactly that graph. TESSERA_RANDOM_GRAPHS sets the number of graphs per mesh.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

constexpr uint32_t kDefaultSeed = 20261130;
constexpr int kDefaultGraphsPerMesh = 150;
constexpr int64_t kMaxElements = 4096;
constexpr const char* kCollectives[] = {"all_reduce", "reduce_scatter",     "all_gather",
                                        "all_to_all", "collective_permute", "local_slice"};
// Ops whose graphs the summary counts (the rarer kinds: each is drawn in about one graph in ten).
constexpr const char* kCountedOps[] = {"random_bits", "switch", "while", "scan", "scatter"};

int env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? static_cast<int>(fallback) : static_cast<int>(std::strtoll(v, nullptr, 10));
}

struct MeshParam {
  const char* name;
  std::vector<int64_t> shape;
  std::vector<std::string> axes;
  std::vector<int> device_ids;  // empty: in id order
};

void PrintTo(const MeshParam& p, std::ostream* os) { *os << p.name; }

// A random layout of `shape` on `mesh`: each dimension unsplit, over one unused axis or over
// a tuple of unused axes, always dividing the dimension.
PartitionSpec random_spec(const Shape& shape, const Mesh& mesh, std::mt19937& rng) {
  std::vector<std::string> free = mesh.axis_names();
  std::shuffle(free.begin(), free.end(), rng);
  std::vector<Axes> dims(shape.size());
  std::vector<size_t> order(shape.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = d;
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t d : order) {
    const int choice = static_cast<int>(rng() % 4);  // 0: None, 1-2: one axis, 3: every free axis
    if (choice == 0 || free.empty()) continue;
    Axes axes = choice == 3 ? free : Axes{free.front()};
    if (shape[d] % mesh.axes_size(axes) != 0) continue;
    for (const std::string& a : axes) free.erase(std::find(free.begin(), free.end(), a));
    dims[d] = std::move(axes);
  }
  return PartitionSpec(std::move(dims));
}

Shape random_shape(std::mt19937& rng) {
  // Mostly sizes every mesh axis divides; 3, 6 and 12 stay whole on some axes or all.
  static const int64_t kSizes[] = {4, 8, 16, 2, 6, 12, 3};
  const int rank = 1 + static_cast<int>(rng() % 3);
  Shape s;
  for (int d = 0; d < rank; ++d) s.push_back(kSizes[rng() % (rank == 3 ? 5 : 7)]);
  return s;
}

// The inputs of graph `seed`: one to three float32 arrays with their layouts.
struct RandomInputs {
  std::vector<ArrayType> types;
  std::vector<PartitionSpec> specs;
};

RandomInputs random_inputs(uint32_t seed, const Mesh& mesh) {
  std::mt19937 rng(seed);
  RandomInputs out;
  const int n = 1 + static_cast<int>(rng() % 3);
  // One graph in four computes on int32: its results must be exact whatever the layout.
  const DType dtype = rng() % 4 == 0 ? DType::kI32 : DType::kF32;
  for (int i = 0; i < n; ++i) {
    Shape s = random_shape(rng);
    out.specs.push_back(random_spec(s, mesh, rng));
    out.types.push_back({dtype, std::move(s)});
  }
  return out;
}

// A value of the graph being built, and whether it is bitwise reproducible: computed without
// a sum, whose rounding depends on how it is split over devices. Only those are compared
// (a comparison is discontinuous: a last-bit difference could flip it).
struct Slot {
  Value v;
  bool exact;
};

// Builds graph `seed` on `in`: 2 to 6 ops, each on a random earlier value. Deterministic in
// the seed, so jit's trace and the reference's trace record the same graph.
std::vector<Value> random_graph(const std::vector<Value>& in, const Mesh& mesh, uint32_t seed) {
  std::mt19937 rng(seed ^ 0x9e3779b9u);
  const DType dtype = in[0].dtype();
  const bool integer = dtype == DType::kI32;
  // Float values are scaled to stay O(1) along the chain; integers wrap, exactly.
  auto scaled = [&](const Value& v, double c) { return integer ? v : v * c; };
  std::vector<Slot> pool;
  for (const Value& v : in) pool.push_back({v, true});
  std::vector<Slot> made;
  auto pick = [&]() -> const Slot& {
    // Mostly the newest value, so ops chain.
    if (!made.empty() && rng() % 3 != 0) return made.back();
    const size_t k = rng() % (pool.size());
    return pool[k];
  };
  auto same_shape = [&](const Value& v) -> std::optional<Slot> {
    std::vector<Slot> c;
    for (const Slot& s : pool) {
      if (s.v.shape() == v.shape()) c.push_back(s);
    }
    if (c.empty()) return std::nullopt;
    return c[rng() % c.size()];
  };
  const int steps = 2 + static_cast<int>(rng() % 5);
  for (int step = 0; step < steps; ++step) {
    const Slot x = pick();
    const Value& v = x.v;
    const Shape s = v.shape();
    const int r = v.rank();
    std::optional<Slot> y;
    const uint32_t op = rng() % 31;
    switch (op) {
      case 0: {
        Value (*const kFloat[])(const Value&) = {tanh, sin, cos, neg, abs, logistic};
        Value (*const kInteger[])(const Value&) = {neg, abs, sign};
        y = Slot{integer ? kInteger[rng() % 3](v) : kFloat[rng() % 6](v), x.exact};
        break;
      }
      case 1: {
        std::optional<Slot> o = same_shape(v);
        if (!o) break;
        Value (*const kBinary[])(const Value&, const Value&) = {add, sub, mul, maximum, minimum};
        y = Slot{kBinary[rng() % 5](v, o->v), x.exact && o->exact};
        break;
      }
      case 2:
        // (Integer scalars for integer graphs: a double would make an int32 value float32.)
        y = Slot{integer ? v * 3 + 1 : v * 0.5 + 1.0, x.exact};
        break;
      case 3: {
        if (r < 2) break;
        std::vector<int64_t> perm(r);
        for (int d = 0; d < r; ++d) perm[d] = d;
        std::shuffle(perm.begin(), perm.end(), rng);
        y = Slot{transpose(v, perm), x.exact};
        break;
      }
      case 4: {
        Shape t = s;
        const int d = static_cast<int>(rng() % r);
        if (r >= 2 && d + 1 < r && rng() % 2 == 0) {  // merge d and d + 1
          t[d] *= t[d + 1];
          t.erase(t.begin() + d + 1);
        } else if (r < 3 && s[d] % 2 == 0) {  // split d
          t[d] = s[d] / 2;
          t.insert(t.begin() + d + 1, 2);
          if (rng() % 2 == 0) std::swap(t[d], t[d + 1]);
        }
        y = Slot{reshape(v, t), x.exact};
        break;
      }
      case 5: {
        if (r < 2) break;
        const int64_t axis = static_cast<int64_t>(rng() % r);
        switch (rng() % 3) {
          case 0:
            y = Slot{integer ? sum(v, {axis}) : mean(v, {axis}), false};
            break;
          case 1:
            y = Slot{max(v, {axis}), x.exact};
            break;
          default:
            y = Slot{min(v, {axis}, true), x.exact};
            break;
        }
        break;
      }
      case 6: {
        if (r != 2) break;
        // With a value whose first dimension is v's last, else with v's own transpose;
        // scaled by 1/k so values stay O(1) along the chain.
        Value w;
        for (const Slot& c : pool) {
          if (c.v.rank() == 2 && c.v.shape()[0] == s[1]) w = c.v;
        }
        if (!w.ok()) w = transpose(v, {1, 0});
        y = Slot{scaled(matmul(v, w), 1.0 / static_cast<double>(s[1])), false};
        break;
      }
      case 7: {
        const int d = static_cast<int>(rng() % r);
        if (s[d] < 2) break;
        std::vector<int64_t> start(r, 0), limit(s.begin(), s.end());
        start[d] = rng() % 2 == 0 ? 0 : s[d] / 2;
        limit[d] = start[d] + s[d] / 2;
        y = Slot{slice(v, start, limit), x.exact};
        break;
      }
      case 8: {
        if (num_elements(s) * 2 > kMaxElements) break;
        std::optional<Slot> o = same_shape(v);
        const int64_t axis = static_cast<int64_t>(rng() % r);
        y = Slot{concatenate({v, o ? o->v : v}, axis), x.exact && (!o || o->exact)};
        break;
      }
      case 9: {
        if (r >= 3 || num_elements(s) * 4 > kMaxElements) break;
        Shape t = s;
        t.insert(t.begin(), rng() % 2 == 0 ? 2 : 4);
        std::vector<int64_t> dims;
        for (int d = 0; d < r; ++d) dims.push_back(d + 1);
        y = Slot{broadcast_in_dim(v, t, dims), x.exact};
        break;
      }
      case 10:
        y = Slot{with_sharding_constraint(v, NamedSharding(mesh, random_spec(s, mesh, rng))), x.exact};
        break;
      case 11: {
        if (!x.exact) break;
        std::optional<Slot> o = same_shape(v);
        y = Slot{where(v > full(s, 0.25, dtype), v, o ? scaled(o->v, 0.5) : -v), o ? o->exact : true};
        break;
      }
      case 12:
        if (!x.exact) break;
        y = integer ? Slot{convert(convert(v, DType::kF32) * 0.5, DType::kI32) + v, true}
                    : Slot{convert(convert(v * 4.0, DType::kI32), DType::kF32) + v, true};
        break;
      case 13: {
        if (r != 3) break;
        // Batched: (B, M, K) x (B, K, N), with a partner from the pool or v's own transpose.
        Value w;
        for (const Slot& c : pool) {
          if (c.v.rank() == 3 && c.v.shape()[0] == s[0] && c.v.shape()[1] == s[2]) w = c.v;
        }
        if (!w.ok()) w = transpose(v, {0, 2, 1});
        y = Slot{scaled(dot_general(v, w, DotDims{{0}, {0}, {2}, {1}}), 1.0 / static_cast<double>(s[2])), false};
        break;
      }
      case 14: {
        if (!x.exact || r < 2) break;
        y = Slot{scaled(convert(argmax(v, static_cast<int64_t>(rng() % r)), dtype), 0.25), true};
        break;
      }
      case 15: {
        const int64_t d = static_cast<int64_t>(rng() % r);
        y = Slot{v + scaled(iota(dtype, s, d), 0.125), x.exact};
        break;
      }
      case 16:
        if (r >= 3) break;
        y = Slot{expand_dims(v, static_cast<int64_t>(rng() % (r + 1))), x.exact};
        break;
      case 17: {
        if (r < 3) break;
        std::vector<int64_t> axes = {0, 1, 2};
        axes.erase(axes.begin() + rng() % 3);
        y = rng() % 2 == 0 ? Slot{scaled(sum(v, axes), 1.0 / static_cast<double>(s[axes[0]] * s[axes[1]])), false}
                           : Slot{max(v, axes), x.exact};
        break;
      }
      case 18:
      case 19: {
        // take along a random dimension at 4 indices, some clamped (-2, and past the end);
        // or the transposed scatter_add of those rows back into v (repeats add up). Case 19:
        // the same through lax.gather / scatter_add's dimension numbers, with a window of half
        // the next dimension at a second index (x[i, j:j+w]), clamped too.
        const int64_t d = static_cast<int64_t>(rng() % r);
        if (s[d] < 2 || num_elements(s) / s[d] * 4 > kMaxElements) break;
        const Value idx = iota(DType::kI32, {4}, 0) * static_cast<int32_t>(s[d] / 2) - 2;
        if (op == 18 || r < 2) {
          const Value rows = take(v, idx, d, IndexMode::kClip);
          y = rng() % 2 == 0 ? Slot{rows, x.exact}
                             : Slot{scatter_add(v, idx, scaled(rows, 0.5), d, IndexMode::kClip), integer};
          break;
        }
        const int64_t e = (d + 1) % r;
        const Value second = iota(DType::kI32, {4}, 0) * static_cast<int32_t>(s[e] / 2 + 1) - 1;
        const Value starts = concatenate({reshape(idx, {4, 1}), reshape(second, {4, 1})}, 1);
        std::vector<int64_t> sizes = s, window_dims;
        sizes[d] = 1;
        sizes[e] = std::max<int64_t>(1, s[e] / 2);
        for (int64_t k = 1; k < r; ++k) window_dims.push_back(k);
        const Value windows =
            gather(v, starts, GatherDimensionNumbers{window_dims, {d}, {d, e}}, sizes, IndexMode::kClip);
        y = rng() % 2 == 0 ? Slot{windows, x.exact}
                           : Slot{scatter_add(v, starts, scaled(windows, 0.5),
                                              ScatterDimensionNumbers{window_dims, {d}, {d, e}}, IndexMode::kClip),
                                  integer};
        break;
      }
      case 20: {
        // A cumulative scan along a random dimension, either way (issue #15).
        const int64_t d = static_cast<int64_t>(rng() % r);
        const bool reverse = rng() % 2 == 0;
        switch (rng() % 3) {
          case 0:
            y = Slot{scaled(cumsum(v, d, reverse), 1.0 / static_cast<double>(s[d])), false};
            break;
          case 1:
            y = Slot{cummax(v, d, reverse), x.exact};
            break;
          default:
            y = Slot{cummin(v, d, reverse), x.exact};
            break;
        }
        break;
      }
      case 21: {
        // A shape-keeping pad (shifted by one along a dimension), a sort of the last dimension,
        // or the argsort of a random one (exact values only: near ties could reorder).
        const int64_t d = static_cast<int64_t>(rng() % r);
        switch (rng() % 3) {
          case 0: {
            std::vector<PadDim> config(r);
            config[d] = rng() % 2 == 0 ? PadDim{1, -1, 0} : PadDim{-1, 1, 0};
            y = Slot{pad(v, full({}, 0.5, dtype), config), x.exact};
            break;
          }
          case 1:
            y = Slot{sort(v), x.exact};
            break;
          default:
            if (!x.exact) break;
            y = Slot{scaled(convert(argsort(v, d), dtype), 0.125), true};
            break;
        }
        break;
      }
      case 22: {
        // lax.dynamic_slice of half a random dimension at traced starts, some past either end
        // (lax clamps them so the window fits), or dynamic_update_slice writing that window back
        // elsewhere; on exact values one start is data-dependent (an argmax's remainder).
        const int64_t d = static_cast<int64_t>(rng() % r);
        if (s[d] < 2) break;
        std::vector<int64_t> sizes(s.begin(), s.end());
        sizes[d] = s[d] / 2;
        auto starts = [&]() {
          std::vector<Value> out;
          for (int k = 0; k < r; ++k) {
            out.push_back(full({}, static_cast<double>(static_cast<int64_t>(rng() % (s[k] + 4)) - 2), DType::kI32));
          }
          if (x.exact) out[d] = rem(argmax(reshape(v, {num_elements(s)}), 0), full({}, s[d] + 2.0, DType::kI32)) - 1;
          return out;
        };
        const Value window = dynamic_slice(v, starts(), sizes);
        y = rng() % 2 == 0 ? Slot{window, x.exact}
                           : Slot{dynamic_update_slice(v, scaled(window, 0.5) + 1, starts()), x.exact};
        break;
      }
      case 23: {
        // Issue #15's elementwise ops: lax.rem and Python's % (by a weak scalar), clamp,
        // stop_gradient, and erf on floats (its rounding may differ from the host's: not exact).
        switch (rng() % 4) {
          case 0:
            y = integer ? Slot{rem(v, full({}, 5.0, dtype)) + v % 3, true}
                        : Slot{rem(v, full({}, 0.75)) + v % 0.5, x.exact};
            break;
          case 1:
            y = Slot{clamp(full({}, -0.5, dtype), v, full({}, integer ? 3.0 : 0.5, dtype)), x.exact};
            break;
          case 2:
            y = Slot{stop_gradient(v), x.exact};
            break;
          default:
            y = integer ? Slot{stop_gradient(v) % 7, true} : Slot{erf(v), false};
            break;
        }
        break;
      }
      case 24: {
        // tril / triu over the last two dimensions at a random diagonal; argmin along a random
        // dimension (exact values only, as argmax); cumprod of floats along one (a product's
        // rounding follows its order: not exact).
        const int64_t d = static_cast<int64_t>(rng() % r);
        const int64_t k = static_cast<int64_t>(rng() % 5) - 2;
        switch (rng() % 3) {
          case 0:
            if (r < 2) break;
            y = Slot{rng() % 2 == 0 ? tril(v, k) : triu(v, k), x.exact};
            break;
          case 1:
            if (!x.exact || r < 2) break;
            y = Slot{scaled(convert(argmin(v, d), dtype), 0.25), true};
            break;
          default:
            if (integer) break;
            y = Slot{cumprod(tanh(v) * 0.5 + 0.75, d, rng() % 2 == 0), false};
            break;
        }
        break;
      }
      case 25: {
        // lax.top_k along the last dimension: its values, or its indices on exact values; or
        // einsum of v with itself (rank 2: 'ij,kj->ik', rank 3: 'bij,bkj->bik').
        const int64_t last = s[r - 1];
        const int64_t k = 1 + static_cast<int64_t>(rng() % last);
        switch (rng() % 3) {
          case 0:
            y = Slot{top_k(v, k).first, x.exact};
            break;
          case 1:
            if (!x.exact) break;
            y = Slot{scaled(convert(top_k(v, k).second, dtype), 0.125), true};
            break;
          default:
            if (r == 2) y = Slot{scaled(einsum("ij,kj->ik", v, v), 1.0 / static_cast<double>(last)), false};
            if (r == 3) y = Slot{scaled(einsum("bij,bkj->bik", v, v), 1.0 / static_cast<double>(last)), false};
            break;
        }
        break;
      }
      case 26: {
        // lax.scan over the leading dimension: a decaying running sum carried row to row (its
        // carry and stacked outputs keep the row's layout), either way.
        if (r < 2) break;
        const Shape row(s.begin() + 1, s.end());
        const bool reverse = rng() % 2 == 0;
        ScanResult sc = scan(
            [&](const std::vector<Value>& c, const std::vector<Value>& xs) {
              const Value h = integer ? c[0] * 2 + xs[0] : c[0] * 0.5 + xs[0];
              return ScanStep{{h}, {h}};
            },
            {full(row, 0.0, dtype)}, {v}, std::nullopt, reverse);
        y = Slot{rng() % 2 == 0 ? sc.ys[0] : sc.carry[0], x.exact};
        break;
      }
      case 27: {
        // tessera::random (JAX's partitionable threefry): a key from a constant seed or, on exact
        // values, from a data-dependent one (an argmax), now and then folded in or split; then
        // bits, uniform, normal or bernoulli of v's shape, now and then pinned to a random layout
        // (a sample made in place must equal the unsharded one bit for bit).
        Value k = random::key(static_cast<int64_t>(rng() % 1000));
        if (x.exact && rng() % 2 == 0) k = random::key(argmax(reshape(v, {num_elements(s)}), 0));
        switch (rng() % 3) {
          case 0:
            k = random::fold_in(k, static_cast<int64_t>(rng() % 100));
            break;
          case 1:
            k = random::key_at(random::split(k, 3), static_cast<int64_t>(rng() % 3));
            break;
          default:
            break;
        }
        auto placed = [&](const Value& sample) {
          return rng() % 2 == 0 ? with_sharding_constraint(sample, NamedSharding(mesh, random_spec(s, mesh, rng)))
                                : sample;
        };
        switch (rng() % 4) {
          case 0: {  // the top 4 bits of bits()
            const Value b = convert(shift_right_logical(placed(random::bits(k, s)), full({}, 28, DType::kU32)), dtype);
            y = Slot{v + scaled(b, 0.125), x.exact};
            break;
          }
          case 1:
            y = integer ? Slot{v + convert(placed(random::uniform(k, s)) * 8.0, DType::kI32), x.exact}
                        : Slot{v + placed(random::uniform(k, s, DType::kF32, -1.0, 1.0)), x.exact};
            break;
          case 2:
            // erf_inv's rounding may differ from the host's (as erf's): not exact.
            if (integer) break;
            y = Slot{v * 0.5 + placed(random::normal(k, s)) * 0.5, false};
            break;
          default:
            y = Slot{where(placed(random::bernoulli(k, 0.3, s)), v, integer ? v * 3 + 1 : v * 0.5 + 1.0), x.exact};
            break;
        }
        break;
      }
      case 28: {
        // lax.switch / lax.cond on v: two or three branches from a menu of shape-keeping functions
        // (one with a reduction, so a collective may run inside the branch; one pinning a layout
        // of its own; one reading an outer value). switch's index comes from the data on exact
        // values (argmax's remainder minus one: -1 clamps to branch 0), else is a constant, some
        // out of range (clamped); cond's predicate is a max (exact) against 0.25.
        const int64_t d = static_cast<int64_t>(rng() % r);
        const PartitionSpec own = random_spec(s, mesh, rng);
        std::optional<Slot> o = same_shape(v);
        const Value outer = o ? o->v : v;
        const std::vector<Branch> menu = {
            [&](const std::vector<Value>& a) { return std::vector<Value>{integer ? a[0] * 3 + 1 : a[0] * 0.5 + 1.0}; },
            [&](const std::vector<Value>& a) { return std::vector<Value>{integer ? neg(a[0]) : tanh(a[0])}; },
            [&](const std::vector<Value>& a) { return std::vector<Value>{a[0] - max(a[0], {d}, true)}; },
            [&](const std::vector<Value>& a) {
              return std::vector<Value>{scaled(with_sharding_constraint(a[0], NamedSharding(mesh, own)), -2.0)};
            },
            [&](const std::vector<Value>& a) { return std::vector<Value>{a[0] - outer}; },
        };
        std::vector<size_t> order = {0, 1, 2, 3, 4};
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<Branch> branches;
        const int64_t n = 2 + static_cast<int64_t>(rng() % 2);
        for (int64_t b = 0; b < n; ++b) branches.push_back(menu[order[b]]);
        const bool exact = x.exact && (!o || o->exact);
        if (x.exact && rng() % 3 == 0) {
          y = Slot{cond(max(v) > full({}, 0.25, dtype), branches[0], branches[1], {v})[0], exact};
          break;
        }
        const Value index = x.exact
                                ? rem(argmax(reshape(v, {num_elements(s)}), 0), full({}, n + 1.0, DType::kI32)) - 1
                                : full({}, static_cast<double>(static_cast<int64_t>(rng() % (n + 3)) - 1), DType::kI32);
        y = Slot{switch_(index, branches, {v})[0], exact};
        break;
      }
      case 29: {
        // lax.fori_loop (1 to 3 iterations, its index used in the body, now and then as a
        // dynamic_update_slice's traced start), or lax.while_loop over (i, v) until i reaches a
        // limit (from the data on exact values) or, half the time, v's max passes a bound; its
        // body now and then pins v to a layout of its own or subtracts a reduction (a collective
        // per iteration), so the carry's layout must be a fixed point.
        const int64_t d = static_cast<int64_t>(rng() % r);
        if (rng() % 2 == 0) {
          const int64_t trips = 1 + static_cast<int64_t>(rng() % 3);
          const bool update = s[d] >= trips && rng() % 2 == 0;
          y = Slot{fori_loop(0, trips,
                             [&](const Value& i, const std::vector<Value>& c) {
                               Value h = integer ? c[0] * 2 + i : c[0] * 0.5 + convert(i, DType::kF32) * 0.25;
                               if (update) {  // row 0 along d, plus one, written at row i
                                 std::vector<int64_t> start(r, 0), limit(s.begin(), s.end());
                                 limit[d] = 1;
                                 std::vector<Value> starts(r, full({}, 0, DType::kI32));
                                 starts[d] = i;
                                 h = dynamic_update_slice(h, slice(h, start, limit) + 1, starts);
                               }
                               return std::vector<Value>{h};
                             },
                             {v})[0],
                   x.exact};
          break;
        }
        const Value limit = x.exact ? rem(argmax(reshape(v, {num_elements(s)}), 0), full({}, 3, DType::kI32)) + 1
                                    : full({}, 1.0 + static_cast<double>(rng() % 3), DType::kI32);
        const bool bounded = rng() % 2 == 0;
        const int body = static_cast<int>(rng() % 3);
        const PartitionSpec own = random_spec(s, mesh, rng);
        const std::vector<Value> out = while_loop(
            [&](const std::vector<Value>& c) {
              const Value more = c[0] < limit;
              return bounded ? logical_and(more, max(c[1]) < full({}, integer ? 50.0 : 3.0, dtype)) : more;
            },
            [&](const std::vector<Value>& c) {
              Value h = integer ? c[1] * 3 + 1 : c[1] * 0.5 + 1.0;
              if (body == 1) h = with_sharding_constraint(h, NamedSharding(mesh, own));
              if (body == 2) h = h - max(h, {d}, true);
              return std::vector<Value>{c[0] + 1, h};
            },
            {full({}, 0, DType::kI32), v});
        y = Slot{out[1], x.exact};
        break;
      }
      case 30: {
        // x.at[i].set(u) along a random dimension (negative indices wrap, out-of-range updates are
        // dropped) or lax.scatter (no wrapping: negatives are out of range too). Indices are
        // unique once wrapped (repeated ones leave which update wins unspecified): constants,
        // some out of range, or on exact values the first half of the argsort of one of v's lines
        // (data-dependent), half of them made negative. Updates: a scalar, or rows of v.
        const int64_t d = static_cast<int64_t>(rng() % r);
        const int64_t n = s[d];
        if (num_elements(s) / n * 4 > kMaxElements) break;
        const bool at_form = rng() % 2 == 0;
        Value idx;
        if (x.exact && rng() % 2 == 0) {
          std::vector<int64_t> start(r, 0), limit(r, 1);
          limit[d] = n;
          const int64_t m = std::max<int64_t>(1, n / 2);
          idx = slice(argsort(reshape(slice(v, start, limit), {n})), {0}, {m});
          if (at_form) idx = where(iota(DType::kI32, {m}, 0) % 2 == 0, idx, idx - static_cast<int32_t>(n));
        } else {
          std::vector<int64_t> ks = {-1, 0, n + 1, -n - 3};
          if (n / 2 > 0 && n / 2 < n - 1) ks.push_back(n / 2);
          std::shuffle(ks.begin(), ks.end(), rng);
          std::vector<Value> parts;
          for (int64_t k : ks) parts.push_back(full({1}, static_cast<double>(k), DType::kI32));
          idx = concatenate(parts, 0);
        }
        Shape us = s;
        us[d] = idx.shape()[0];
        const Value updates = rng() % 2 == 0 ? full(us, 0.5, dtype)
                                             : scaled(take(v, iota(DType::kI32, {us[d]}, 0), d, IndexMode::kClip), 0.5);
        y = Slot{at_form ? at(v, idx, d).set(updates) : scatter(v, idx, updates, d), x.exact};
        break;
      }
    }
    if (y && integer) y->exact = true;
    // A sum just made (contraction, mean) is often partial: pin it half the time, so its
    // pending reduction meets every kind of wanted layout (reduce_scatter among them).
    if (y && y->v.ok() && !y->exact && rng() % 2 == 0) {
      y->v = with_sharding_constraint(y->v, NamedSharding(mesh, random_spec(y->v.shape(), mesh, rng)));
    }
    if (y && y->v.ok()) {
      made.push_back(*y);
      pool.push_back(*y);
    }
  }
  if (made.empty()) made.push_back({neg(in[0]), true});
  std::vector<Value> out = {made.back().v};
  if (made.size() > 2 && rng() % 2 == 0) out.push_back(made[rng() % (made.size() - 1)].v);
  return out;
}

// What a crash prints (a kernel's fault or a CHECK in Client::local's in-process daemons ends
// the test before gtest reports anything): the graph being run, its seed and replay command,
// set before each graph. The handler only write(2)s it and raises the signal again (both
// async-signal-safe); SA_RESETHAND has restored the default action, which ends the process.
char crash_note[1 << 15];
std::atomic<size_t> crash_note_size{0};
constexpr int kCrashSignals[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL};
struct sigaction previous_actions[std::size(kCrashSignals)];

void print_crash_note(int signal) {
  const size_t n = crash_note_size.load();
  if (n > 0) {
    const ssize_t written = write(STDERR_FILENO, crash_note, n);
    (void)written;  // a failed write leaves nothing else to do
  }
  raise(signal);  // pending until the handler returns: then the default action, also for a kill(2)
}

void set_crash_note(const std::string& text) {
  crash_note_size.store(0);
  const size_t n = std::min(text.size(), sizeof(crash_note));
  std::memcpy(crash_note, text.data(), n);
  crash_note_size.store(n);
}

class RandomGraphTest : public ::testing::TestWithParam<MeshParam> {
 protected:
  static void SetUpTestSuite() {
    client_ = start_local_client().release();
    struct sigaction action = {};
    action.sa_handler = print_crash_note;
    action.sa_flags = SA_RESETHAND;
    for (size_t i = 0; i < std::size(kCrashSignals); ++i) sigaction(kCrashSignals[i], &action, &previous_actions[i]);
  }
  static void TearDownTestSuite() {
    for (size_t i = 0; i < std::size(kCrashSignals); ++i) sigaction(kCrashSignals[i], &previous_actions[i], nullptr);
    crash_note_size.store(0);
    delete client_;
    client_ = nullptr;
  }
  static Client* client_;
};
Client* RandomGraphTest::client_ = nullptr;

TEST_P(RandomGraphTest, MatchesHostReference) {
  ASSERT_NE(client_, nullptr);
  // Auto axes: random layouts meet in random ops, and the compiler reconciles them (GSPMD); on
  // make_mesh's Explicit axes JAX >= 0.9 refuses operands split differently.
  absl::StatusOr<Mesh> mesh = GetParam().device_ids.empty()
                                  ? client_->make_mesh(GetParam().shape, GetParam().axes)
                                  : client_->make_mesh(GetParam().shape, GetParam().axes, GetParam().device_ids);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  mesh = with_auto_axes(*mesh);
  const uint32_t base = static_cast<uint32_t>(env_int("TESSERA_RANDOM_SEED", kDefaultSeed));
  const int graphs = env_int("TESSERA_RANDOM_GRAPHS", kDefaultGraphsPerMesh);
  int failed = 0;
  std::map<std::string, int> seen;   // graphs whose plan has each collective
  std::map<std::string, int> drawn;  // graphs with each of kCountedOps
  for (int i = 0; i < graphs && failed < 3; ++i) {
    const uint32_t seed = base + static_cast<uint32_t>(i);
    const std::string replay = absl::StrCat("graph seed ", seed, " (replay: TESSERA_RANDOM_SEED=", seed,
                                            " TESSERA_RANDOM_GRAPHS=1 --gtest_filter='*", GetParam().name, "')");
    SCOPED_TRACE(replay);
    set_crash_note(absl::StrCat("\ncrashed in random ", replay, "\n"));
    const RandomInputs r = random_inputs(seed, *mesh);
    std::mt19937 rng(seed);
    const Mesh& m = *mesh;
    const TracedFunction f = [&m, seed](const std::vector<Value>& in) { return random_graph(in, m, seed); };
    absl::StatusOr<Graph> graph = trace(f, r.types);
    ASSERT_TRUE(graph.ok()) << graph.status();
    std::string specs;
    for (const PartitionSpec& s : r.specs) absl::StrAppend(&specs, " ", s.to_string());
    SCOPED_TRACE(absl::StrCat("inputs", specs, "\n", graph->to_text()));
    set_crash_note(absl::StrCat("\ncrashed in random ", replay, "\ninputs", specs, "\n", graph->to_text()));
    for (const char* op : kCountedOps)
      drawn[op] += graph->to_text().find(absl::StrCat(" = ", op, "(")) != std::string::npos;
    JitOptions options;
    if (rng() % 3 == 0) {  // now and then the first output's layout is asked for
      const Node& out = graph->node(graph->outputs()[0]);
      options.out_shardings = std::vector<std::optional<PartitionSpec>>(graph->outputs().size());
      options.out_shardings[0] = random_spec(out.shape, m, rng);
    }
    SCOPED_TRACE(options.out_shardings.empty() ? std::string("no out_shardings")
                                               : "out_shardings[0] = " + options.out_shardings[0]->to_string());
    // One graph in four runs twice: the second call, on new values, runs the cached program.
    const int calls = rng() % 4 == 0 ? 2 : 1;
    bool ok = true;
    for (int call = 0; call < calls && ok; ++call) {
      SCOPED_TRACE(absl::StrCat("call ", call + 1, " of ", calls));
      std::vector<HostArray> inputs;
      std::vector<const HostArray*> ptrs;
      for (const ArrayType& t : r.types) inputs.push_back(random_array(t.dtype, t.shape, Domain::kSigned, rng));
      for (const HostArray& a : inputs) ptrs.push_back(&a);
      absl::StatusOr<JitCheck> check = run_against_host(*client_, m, f, ptrs, r.specs, options);
      EXPECT_TRUE(check.ok()) << check.status();
      if (!check.ok()) {
        ok = false;
        break;
      }
      if (call == 0) {
        for (const char* c : kCollectives) seen[c] += check->plan_text.find(std::string("= ") + c) != std::string::npos;
      }
      if (options.out_shardings.size() > 0) {
        EXPECT_EQ(check->out_specs[0], *options.out_shardings[0]) << check->out_specs[0].to_string();
      }
      for (size_t k = 0; k < check->got.size(); ++k) {
        ::testing::AssertionResult match = results_match(check->got[k], check->want[k], kF32Tolerance);
        EXPECT_TRUE(match) << "output " << k;
        ok = ok && match;
      }
      if (!ok) ADD_FAILURE() << "plan:\n" << check->plan_text;
    }
    if (!ok) ++failed;
  }
  std::cout << graphs << " graphs on " << GetParam().name << "; with";
  for (const char* c : kCollectives) std::cout << " " << c << ": " << seen[c];
  std::cout << "; drawn";
  for (const char* op : kCountedOps) std::cout << " " << op << ": " << drawn[op];
  std::cout << "\n";
}

INSTANTIATE_TEST_SUITE_P(
    Random, RandomGraphTest,
    ::testing::Values(MeshParam{"m8", {8}, {"data"}, {}}, MeshParam{"m4x2", {4, 2}, {"data", "model"}, {}},
                      MeshParam{"m2x4", {2, 4}, {"data", "model"}, {}},
                      // Devices out of order: blocks live elsewhere than on id order.
                      MeshParam{"m4x2_shuffled", {4, 2}, {"data", "model"}, {5, 2, 7, 0, 3, 6, 1, 4}},
                      // Three axes; and six of the eight devices, in groups of three.
                      MeshParam{"m2x2x2", {2, 2, 2}, {"x", "y", "z"}, {}},
                      MeshParam{"m3x2_of_6", {3, 2}, {"data", "model"}, {1, 2, 3, 4, 5, 6}}),
    [](const ::testing::TestParamInfo<MeshParam>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tessera
