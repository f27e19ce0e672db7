// jit end to end on Client::local(8): compiled programs against host computations written
// out here, across layouts that need no communication, all_reduce, reduce_scatter,
// all_to_all, all_gather and local slices; compilation caching; errors.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/slicing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"

namespace tessera {
namespace {

// lax.pad on the host (numpy's definition): `x` of shape `shape`, row-major, padded by
// (low, high, interior) per dimension with `fill`; negative low / high crop.
std::vector<double> host_pad(const std::vector<double>& x, const std::vector<int64_t>& shape,
                             const std::vector<std::array<int64_t, 3>>& config, double fill) {
  std::vector<int64_t> out(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    out[d] = config[d][0] + config[d][1] + shape[d] + std::max<int64_t>(shape[d] - 1, 0) * config[d][2];
  }
  int64_t size = 1;
  for (int64_t n : out) size *= n;
  std::vector<double> r(static_cast<size_t>(size), fill);
  std::vector<int64_t> at(shape.size(), 0);
  for (size_t i = 0; i < x.size(); ++i) {
    int64_t flat = 0;
    bool inside = true;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t o = config[d][0] + at[d] * (config[d][2] + 1);
      inside = inside && o >= 0 && o < out[d];
      flat = flat * out[d] + o;
    }
    if (inside) r[static_cast<size_t>(flat)] = x[i];
    for (size_t d = shape.size(); d-- > 0;) {
      if (++at[d] < shape[d]) break;
      at[d] = 0;
    }
  }
  return r;
}

using ::tessera::jit_support::expect_near;
using ::tessera::jit_support::matmul_ref;
using ::tessera::jit_support::random_f32;
using ::testing::HasSubstr;

class JitTest : public jit_support::LocalJitSuite {};

std::vector<Value> layer(const std::vector<Value>& in) { return {tanh(matmul(in[0], in[1]))}; }

// On Auto axes the compiler chooses each layout's collectives (GSPMD); on make_mesh's Explicit
// axes JAX >= 0.9 refuses a contraction split on both operands without out_sharding
// (ExplicitJitTest covers those).
TEST_F(JitTest, LayerUnderEveryWeightLayout) {
  const HostArray x = random_f32({16, 8}, 1), w = random_f32({8, 4}, 2);
  std::vector<double> want = matmul_ref(x, w);
  for (double& v : want) v = std::tanh(v);
  struct Case {
    PartitionSpec x, w;
    const char* collective;  // expected in the plan, or "" for none
  };
  for (const Case& c :
       {Case{P("data", None), P(None, "model"), ""}, Case{P(None, "model"), P("model", None), "all_reduce"},
        Case{P("data", "model"), P("model", None), "all_reduce"}, Case{P(), P(), ""},
        Case{P(Axes{"data", "model"}), P(), ""}}) {
    SCOPED_TRACE(c.x.to_string() + " @ " + c.w.to_string());
    Jitted f = jit(layer);
    absl::StatusOr<std::vector<Array>> y = f({put_on(*auto_mesh_, x, c.x), put_on(*auto_mesh_, w, c.w)});
    ASSERT_TRUE(y.ok()) << y.status();
    expect_near(fetch((*y)[0]), want);
    if (*c.collective) {
      EXPECT_THAT(f.as_text(), HasSubstr(c.collective));
    } else {
      EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("all_")));
    }
  }
}

// Pending sums are over a set of mesh axes: sum(a) of a P('data', 'model') and sum(b) of a
// P('model', 'data') are both pending over {'data', 'model'}, however each listed them, so
// their sum passes through the add and one all_reduce resolves it (JAX's unreduced axes are a
// set: partition_spec.py keeps them as a frozenset).
TEST_F(JitTest, PendingSumsOverTheSameAxesInAnotherOrderAddWithOneAllReduce) {
  const HostArray a = random_f32({8, 4}, 5), b = random_f32({8, 4}, 6);
  double want = 0;
  for (float v : a.values<float>()) want += v;
  for (float v : b.values<float>()) want += v;
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0]) + sum(in[1])}; });
  absl::StatusOr<std::vector<Array>> y =
      f({put_on(*auto_mesh_, a, P("data", "model")), put_on(*auto_mesh_, b, P("model", "data"))});
  ASSERT_TRUE(y.ok()) << y.status();
  expect_near(fetch((*y)[0]), std::vector<double>{want});
  const std::string text = f.as_text();
  size_t all_reduces = 0;
  for (size_t at = text.find("all_reduce"); at != std::string::npos; at = text.find("all_reduce", at + 1)) {
    ++all_reduces;
  }
  EXPECT_EQ(all_reduces, 1u) << text;
}

// Auto axes: jit's out_shardings decide how the partial product is resolved (on Explicit axes
// matmul's out_sharding does; ExplicitJitTest).
TEST_F(JitTest, PartialProductWantedShardedIsReduceScattered) {
  const HostArray x = random_f32({16, 8}, 3), w = random_f32({8, 4}, 4);
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
                 {.out_shardings = {P(None, "model")}});
  absl::StatusOr<std::vector<Array>> y =
      f({put_on(*auto_mesh_, x, P(None, "model")), put_on(*auto_mesh_, w, P("model", None))});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ((*y)[0].sharding().spec(), P(None, "model"));
  EXPECT_THAT(f.as_text(), HasSubstr("reduce_scatter"));
  expect_near(fetch((*y)[0]), matmul_ref(x, w));
}

TEST_F(JitTest, ElementwiseReductionsAndLayoutChanges) {
  const HostArray a = random_f32({16, 8}, 5), b = random_f32({16, 8}, 6);
  Jitted f = jit([this](const std::vector<Value>& in) {
    Value s = in[0] * in[1] + 2.0;                                                  // b is replicated: sliced locally
    Value t = with_sharding_constraint(s, NamedSharding(*mesh_, P(None, "data")));  // all_to_all
    return std::vector<Value>{sum(t, {1}), transpose(exp(in[0]), {1, 0}), reshape(in[0], {16, 2, 4})};
  });
  absl::StatusOr<std::vector<Array>> y = f({put(a, P("data", None)), put(b, P())});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_THAT(f.as_text(), HasSubstr("all_to_all"));
  std::vector<double> sums(16, 0.0), transposed(128), reshaped(128);
  for (int64_t i = 0; i < 16; ++i) {
    for (int64_t j = 0; j < 8; ++j) {
      sums[i] += double(a.values<float>()[i * 8 + j]) * b.values<float>()[i * 8 + j] + 2.0;
      transposed[j * 16 + i] = std::exp(double(a.values<float>()[i * 8 + j]));
      reshaped[i * 8 + j] = a.values<float>()[i * 8 + j];
    }
  }
  expect_near(fetch((*y)[0]), sums);
  expect_near(fetch((*y)[1]), transposed);
  expect_near(fetch((*y)[2]), reshaped);
}

// A (4, 1) mesh: splits over the size-1 'one' axis are no splits, so the plan moves nothing
// for them (#15) and slices only the replicated operand along 'data'; the values are still
// the host's.
TEST_F(JitTest, AxesOfSizeOneNeedNoReshard) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 1}, {"data", "one"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray a = random_f32({16, 8}, 41), b = random_f32({16, 8}, 42), c = random_f32({16, 8}, 43);
  Jitted f = jit([&](const std::vector<Value>& in) {
    Value t = with_sharding_constraint(in[0] * in[1] + in[2], NamedSharding(*mesh, P("data", "one")));
    return std::vector<Value>{exp(t)};
  });
  absl::StatusOr<std::vector<Array>> y =
      f({put_on(*mesh, a, P("data", None)), put_on(*mesh, b, P("data", "one")), put_on(*mesh, c, P())});
  ASSERT_TRUE(y.ok()) << y.status();
  const std::string text = f.as_text();
  EXPECT_EQ(text.find("local_slice"), text.rfind("local_slice")) << "only c is sliced: " << text;
  EXPECT_THAT(text, HasSubstr("local_slice(P(None, None) -> P('data', ")) << text;
  EXPECT_THAT(text, ::testing::Not(HasSubstr("all_")));
  std::vector<double> want(128);
  for (int64_t i = 0; i < 128; ++i) {
    want[i] = std::exp(double(a.values<float>()[i]) * b.values<float>()[i] + c.values<float>()[i]);
  }
  expect_near(fetch((*y)[0]), want);
}

TEST_F(JitTest, SameSignatureNeverRecompiles) {
  const HostArray x = random_f32({16, 8}, 7), w = random_f32({8, 4}, 8);
  Jitted f = jit(layer);
  ASSERT_TRUE(f({put(x, P("data", None)), put(w, P(None, "model"))}).ok());
  const int64_t after_first = f.compilations();
  ASSERT_TRUE(f({put(x, P("data", None)), put(w, P(None, "model"))}).ok());
  EXPECT_EQ(f.compilations(), after_first);
  // A second Jitted of the same function hits the coordinator's cache too.
  Jitted g = jit(layer);
  ASSERT_TRUE(g({put(x, P("data", None)), put(w, P(None, "model"))}).ok());
  EXPECT_EQ(g.compilations(), after_first);
  // The same specs on a mesh with another device order are another program, and compute right.
  absl::StatusOr<Mesh> reversed = client_->make_mesh({4, 2}, {"data", "model"}, {7, 6, 5, 4, 3, 2, 1, 0});
  ASSERT_TRUE(reversed.ok());
  absl::StatusOr<Array> rx = client_->device_put(x, NamedSharding(*reversed, P("data", None)));
  absl::StatusOr<Array> rw = client_->device_put(w, NamedSharding(*reversed, P(None, "model")));
  ASSERT_TRUE(rx.ok() && rw.ok());
  absl::StatusOr<std::vector<Array>> ry = f({*rx, *rw});
  ASSERT_TRUE(ry.ok()) << ry.status();
  EXPECT_EQ(f.compilations(), after_first + 1);
  std::vector<double> want = matmul_ref(x, w);
  for (double& v : want) v = std::tanh(v);
  expect_near(fetch((*ry)[0]), want);
  // Another sharding is another program (one no other test here uses; on Auto axes, where a
  // contraction split on both operands is the compiler's to resolve).
  ASSERT_TRUE(f({put_on(*auto_mesh_, x, P(None, "data")), put_on(*auto_mesh_, w, P("data", "model"))}).ok());
  EXPECT_EQ(f.compilations(), after_first + 2);
}

TEST_F(JitTest, ErrorsAreReported) {
  const HostArray x = random_f32({16, 8}, 9);
  Jitted f = jit(layer);
  absl::StatusOr<std::vector<Array>> y = f({put(x, P("data", None)), put(x, P())});
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(y.status().message()), HasSubstr("contracting dimensions 1 (size 8) and 0 (size 16) differ"));
  absl::StatusOr<Mesh> other = client_->make_mesh({8}, {"x"});
  ASSERT_TRUE(other.ok());
  absl::StatusOr<Array> z = client_->device_put(random_f32({8, 4}, 10), NamedSharding(*other, P()));
  ASSERT_TRUE(z.ok());
  y = f({put(x, P("data", None)), *z});
  ASSERT_FALSE(y.ok());
  EXPECT_THAT(std::string(y.status().message()), HasSubstr("every argument must be on one mesh"));
}

// in_shardings pins the arguments' layouts: a matching argument runs (P('data') and
// P('data', None) lay a matrix out alike: NamedSharding.is_equivalent_to, as JAX compares a
// committed argument with in_shardings), a mismatch is INVALID_ARGUMENT naming both specs,
// and a list of the wrong length is refused.
TEST_F(JitTest, InShardingsAreChecked) {
  const HostArray x = random_f32({16, 8}, 11), w = random_f32({8, 4}, 12);
  JitOptions options;
  options.in_shardings = {P("data"), std::nullopt};
  Jitted f = jit(layer, options);
  absl::StatusOr<std::vector<Array>> y = f({put(x, P("data", None)), put(w, P(None, "model"))});
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<HostArray> got = (*y)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  std::vector<double> want = matmul_ref(x, w);
  for (double& v : want) v = std::tanh(v);
  expect_near(*got, want, 1e-5);

  y = f({put(x, P(None, "model")), put(w, P())});
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(y.status().message()),
              HasSubstr("argument 0 has sharding P(None, 'model') but in_shardings[0] is P('data',)"));

  options.in_shardings = {P("data")};
  y = jit(layer, options)({put(x, P("data", None)), put(w, P())});
  ASSERT_FALSE(y.ok());
  EXPECT_THAT(std::string(y.status().message()), HasSubstr("in_shardings has 1 entries for 2 arguments"));
}

// The checks of NamedSharding::validate, and its message, for in_shardings as for
// out_shardings (jax.jit raises for either alike): a repeated axis, an unknown one, a spec
// longer than the rank (P(None, None) on a vector), a split that does not divide. Each is
// refused at the call, once ("jit:" once, no coordinator address).
TEST_F(JitTest, InShardingsAreValidatedAsOutShardingsAre) {
  const HostArray x = random_f32({16, 8}, 13);
  const HostArray v = random_f32({8}, 14);
  auto same = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; };
  struct Case {
    HostArray host;
    PartitionSpec spec;
    std::string rule;
  };
  std::vector<Case> cases;
  cases.push_back({x.clone(), P("data", "data"), "mesh axis 'data' is used more than once"});
  cases.push_back({x.clone(), P("nope"), "axis 'nope' of dimension 0 is not in the mesh"});
  cases.push_back({x.clone(), P(None, None, None), "has 3 entries but the array of shape (16, 8) has rank 2"});
  cases.push_back({random_f32({6, 8}, 18), P("data"), "dimension 0 of size 6 is not divisible by mesh axis 'data'"});
  cases.push_back({v.clone(), P(None, None), "has 2 entries but the array of shape (8,) has rank 1"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec.to_string());
    const Array a = put(c.host, P());
    const std::string validated(NamedSharding(*mesh_, c.spec).validate(c.host.shape()).message());
    ASSERT_THAT(validated, HasSubstr(c.rule));
    JitOptions in;
    in.in_shardings = {c.spec};
    absl::StatusOr<std::vector<Array>> y = jit(same, in)({a});
    ASSERT_FALSE(y.ok());
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string in_message(y.status().message());
    EXPECT_EQ(in_message, absl::StrCat("jit: input 0 ", type_to_string(DType::kF32, c.host.shape()), ": ", validated,
                                       " (in_shardings[0])"));
    JitOptions out;
    out.out_shardings = {c.spec};
    y = jit(same, out)({a});
    ASSERT_FALSE(y.ok());
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(y.status().message()),
              absl::StrCat("jit: output 0 ", type_to_string(DType::kF32, c.host.shape()), ": ", validated));
  }
}

// Two meshes that print alike (same shape and names, the same devices in another order) are
// told apart in messages by their device ids, as JAX's "device ids [0, 1, 2, 3]" in its
// mismatch errors.
TEST_F(JitTest, MeshesInMessagesShowTheirDevicesWhenTheyWouldLookAlike) {
  absl::StatusOr<Mesh> up = client_->make_mesh({4}, {"x"}, {0, 1, 2, 3});
  absl::StatusOr<Mesh> down = client_->make_mesh({4}, {"x"}, {3, 2, 1, 0});
  ASSERT_TRUE(up.ok() && down.ok());
  const HostArray x = random_f32({8}, 15);
  absl::StatusOr<Array> a = client_->device_put(x, NamedSharding(*up, P("x")));
  absl::StatusOr<Array> b = client_->device_put(x, NamedSharding(*down, P("x")));
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<std::vector<Array>> y =
      jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; })({*a, *b});
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(y.status().message()),
            "jit: argument 1 is on Mesh('x': 4, axis_types=(Explicit,), device_ids=[3, 2, 1, 0]), argument 0 on "
            "Mesh('x': 4, axis_types=(Explicit,), device_ids=[0, 1, 2, 3]); every argument must be on one mesh");
}

// Committed arrays on different devices passed together: JAX's jit refuses them naming both
// device lists ("Received incompatible devices for jitted computation. Got argument x of f
// with shape float32[8] and device ids [0, 1, 2, 3] ... and argument y ... device ids [4, 5,
// 6, 7]", jax/_src/interpreters/pxla.py's _raise_incompatible_devices). device_put of one onto
// the other's sharding then makes the call work.
TEST_F(JitTest, CommittedArraysOnDifferentDevicesAreRefusedNamingBothDeviceLists) {
  absl::StatusOr<Mesh> low = client_->make_mesh({4}, {"x"}, {0, 1, 2, 3});
  absl::StatusOr<Mesh> high = client_->make_mesh({2, 2}, {"a", "b"}, {4, 5, 6, 7});
  ASSERT_TRUE(low.ok() && high.ok());
  const HostArray x = random_f32({8}, 15);
  const HostArray w = random_f32({8}, 16);
  absl::StatusOr<Array> a = client_->device_put(x, NamedSharding(*low, P("x")));
  absl::StatusOr<Array> b = client_->device_put(w, NamedSharding(*high, P("a")));
  ASSERT_TRUE(a.ok() && b.ok());
  Jitted add = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; });
  absl::StatusOr<std::vector<Array>> y = add({*a, *b});
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(y.status().message()),
            "jit: incompatible devices: argument 1 (f32[8]) is on device ids [4, 5, 6, 7] (Mesh('a': 2, 'b': 2, "
            "axis_types=(Explicit, Explicit))) and argument 0 (f32[8]) on device ids [0, 1, 2, 3] (Mesh('x': 4, "
            "axis_types=(Explicit,))); every argument must be on one mesh: device_put one onto the other's sharding");
  absl::StatusOr<Array> moved = client_->device_put(*b, a->sharding());
  ASSERT_TRUE(moved.ok()) << moved.status();
  y = add({*a, *moved});
  ASSERT_TRUE(y.ok()) << y.status();
  std::vector<double> want;
  for (int i = 0; i < 8; ++i) want.push_back(double{x.values<float>()[i]} + w.values<float>()[i]);
  expect_near(fetch((*y)[0]), want);
}

// Shard bytes clients put on or fetched from the cluster's 8 devices so far (the workers count
// both, GetStats); a reshard that moves data worker to worker changes neither.
int64_t client_transfer_bytes(const Client& client) {
  int64_t bytes = 0;
  for (int d = 0; d < 8; ++d) {
    absl::StatusOr<DeviceStats> stats = client.device_stats(d);
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (stats.ok()) bytes += stats->bytes_put + stats->bytes_fetched;
  }
  return bytes;
}

// Every device's block of `a` (each replica's, read from that device) is its block of `host`.
void expect_blocks_of(const Array& a, const HostArray& host) {
  for (const Shard& shard : a.addressable_shards()) {
    absl::StatusOr<HostArray> block = shard.data();
    ASSERT_TRUE(block.ok()) << block.status();
    EXPECT_TRUE(*block == extract_block(host, shard.index()))
        << "device " << shard.device_id() << " block " << index_to_string(shard.index());
  }
}

// jax.device_put(x, sharding) of an array already on devices (JAX's
// tests/array_test.py/pjit_test.py device_put resharding: the values are unchanged, the
// sharding is the new one, on the new devices): onto other devices, a mesh of another shape
// over the same devices, a subset and a superset of them, a replicated layout and back, within
// the mesh (a jitted reshard). The client neither puts nor fetches a byte for it: the workers'
// counts of client transfers stay put until the test reads the blocks back.
TEST_F(JitTest, DevicePutOfAnArrayMovesItWorkerToWorkerOntoAnyDevices) {
  const HostArray host = random_f32({8, 12}, 21);
  absl::StatusOr<Mesh> low = client_->make_mesh({4}, {"x"}, {0, 1, 2, 3});
  ASSERT_TRUE(low.ok());
  absl::StatusOr<Array> x = client_->device_put(host, NamedSharding(*low, P("x", None)));
  ASSERT_TRUE(x.ok()) << x.status();
  struct Case {
    std::vector<int64_t> shape;
    std::vector<std::string> names;
    std::vector<int> devices;
    PartitionSpec spec;
  };
  const std::vector<Case> cases = {
      {{4}, {"x"}, {4, 5, 6, 7}, P("x", None)},                    // other devices, same layout
      {{2, 2}, {"a", "b"}, {4, 5, 6, 7}, P("b", "a")},             // other devices, other shape
      {{2, 2}, {"a", "b"}, {0, 1, 2, 3}, P("a", "b")},             // same devices, other shape
      {{4}, {"x"}, {3, 2, 1, 0}, P(None, "x")},                    // same devices, other order
      {{2}, {"x"}, {1, 2}, P(None, "x")},                          // a subset
      {{4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7}, P()},  // a superset, replicated
      {{4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7}, P(Axes{"model", "data"}, None)},
      {{3}, {"x"}, {5, 6, 7}, P(None, "x")},  // devices partly shared
  };
  for (const Case& c : cases) {
    absl::StatusOr<Mesh> mesh = client_->make_mesh(c.shape, c.names, c.devices);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const NamedSharding target(*mesh, c.spec);
    SCOPED_TRACE(target.to_string() + " " + mesh->to_string());
    const int64_t before = client_transfer_bytes(*client_);
    absl::StatusOr<Array> y = client_->device_put(*x, target);
    ASSERT_TRUE(y.ok()) << y.status();
    ASSERT_TRUE(y->block_until_ready().ok());
    EXPECT_EQ(client_transfer_bytes(*client_), before);
    EXPECT_TRUE(y->sharding() == target);
    EXPECT_EQ(y->shape(), host.shape());
    expect_blocks_of(*y, host);
    EXPECT_GT(client_transfer_bytes(*client_), before);  // the counts do see the client's reads
    // And back from there onto the first layout, from whichever replicas hold it.
    const int64_t again = client_transfer_bytes(*client_);
    absl::StatusOr<Array> back = client_->device_put(*y, x->sharding());
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_TRUE(back->block_until_ready().ok());
    EXPECT_EQ(client_transfer_bytes(*client_), again);
    expect_blocks_of(*back, host);
  }
  // Within its own mesh: a jitted reshard (collectives), no client transfer either.
  const int64_t before = client_transfer_bytes(*client_);
  absl::StatusOr<Array> columns = client_->device_put(*x, NamedSharding(*low, P(None, "x")));
  ASSERT_TRUE(columns.ok()) << columns.status();
  ASSERT_TRUE(columns->block_until_ready().ok());
  EXPECT_EQ(client_transfer_bytes(*client_), before);
  expect_blocks_of(*columns, host);
  // Its own sharding: x itself, as JAX returns an array already laid out so.
  absl::StatusOr<Array> same = client_->device_put(*x, x->sharding());
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->id(), x->id());
  expect_blocks_of(*x, host);  // the source is untouched
}

// device_put of an array: a sharding that does not fit is refused on the client with the
// rule; a device outside the cluster is NOT_FOUND; the output of a jitted call is moved once
// that call has finished; a bare spec resolves against the ambient mesh.
TEST_F(JitTest, DevicePutOfAnArrayChecksTheShardingAndWaitsForItsInput) {
  const HostArray host = random_f32({6, 4}, 22);
  absl::StatusOr<Mesh> pair = client_->make_mesh({2}, {"x"}, {0, 1});
  absl::StatusOr<Mesh> four = client_->make_mesh({4}, {"x"}, {4, 5, 6, 7});
  absl::StatusOr<Mesh> outside = client_->make_mesh({2}, {"x"}, {6, 42});
  ASSERT_TRUE(pair.ok() && four.ok() && outside.ok());
  absl::StatusOr<Array> x = client_->device_put(host, NamedSharding(*pair, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  absl::StatusOr<Array> bad = client_->device_put(*x, NamedSharding(*four, P("x")));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(bad.status().message()),
            absl::StrCat("device_put: f32[6,4]: ", NamedSharding(*four, P("x")).validate(host.shape()).message()));
  bad = client_->device_put(*x, NamedSharding(*outside, P(None, "x")));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("device 42"));
  absl::StatusOr<std::vector<Array>> doubled =
      jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; })({*x});
  ASSERT_TRUE(doubled.ok()) << doubled.status();
  MeshScope scope = set_mesh(*four);
  absl::StatusOr<Array> y = client_->device_put((*doubled)[0], P(None, "x"));
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(y->sharding() == NamedSharding(*four, P(None, "x")));
  std::vector<double> want;
  for (float v : host.values<float>()) want.push_back(2.0 * v);
  expect_near(fetch(*y), want);
}

// JAX's sharded-computation tutorial constrains a value of a (4, 2) mesh onto an (8,) mesh of
// the same devices. Tessera moves values within one mesh only: it refuses that at the call,
// naming both meshes, once, without the coordinator's address.
TEST_F(JitTest, AConstraintOntoAnotherMeshIsRefusedAtTheCall) {
  const HostArray x = random_f32({16, 8}, 16);
  const Array a = put(x, P("data", None));
  for (const Mesh& other :
       {*client_->make_mesh({8}, {"i"}), *client_->make_mesh({4, 2}, {"data", "model"}, {7, 6, 5, 4, 3, 2, 1, 0})}) {
    SCOPED_TRACE(other.to_string());
    absl::StatusOr<std::vector<Array>> y = jit([other](const std::vector<Value>& in) {
      return std::vector<Value>{with_sharding_constraint(in[0] * 2.0, NamedSharding(other, P()))};
    })({a});
    ASSERT_FALSE(y.ok());
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(y.status().message());
    const auto [theirs, ours] = distinguish(other, *mesh_);
    EXPECT_EQ(message, absl::StrCat("jit: a with_sharding_constraint onto ", theirs,
                                    " in a function whose arguments are on ", ours,
                                    "; Tessera moves values within one mesh: put the arguments on that mesh, or "
                                    "name theirs"));
    EXPECT_EQ(message.find(client_->coordinator_address()), std::string::npos);
  }
}

// Explicit axes (issue 16 item 2): a mesh's type, printed and compared as JAX does; on such a
// mesh jit traces in explicit mode, the values' types carry their shardings over the Explicit
// axes, and the program lays each result out as its type says. Values against the host.
class ExplicitJitTest : public jit_support::LocalJitSuite {
 protected:
  static Mesh explicit_mesh() {
    absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"X", "Y"}, {AxisType::kExplicit, AxisType::kExplicit});
    EXPECT_TRUE(mesh.ok()) << mesh.status();
    return *mesh;
  }

  // Runs `f`, whose one result is unreduced over 'Y', on `args`: the result leaves jit unreduced
  // with no sum run on the way (no all_reduce or reduce_scatter in the program), and resharded
  // to P() out of jit it is `want`.
  static void expect_unreduced_result(const Jitted& f, const std::vector<Array>& args,
                                      const std::vector<double>& want) {
    absl::StatusOr<std::vector<Array>> y = f(args);
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ((*y)[0].sharding().spec().unreduced(), std::vector<std::string>{"Y"});
    EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("all_reduce")));
    EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("reduce_scatter")));
    absl::StatusOr<Array> summed = reshard((*y)[0], P());
    ASSERT_TRUE(summed.ok()) << summed.status();
    expect_near(fetch(*summed), want, 1e-4);
  }
};

TEST_F(ExplicitJitTest, ALayerRunsLaidOutByItsTypes) {
  const Mesh mesh = explicit_mesh();
  EXPECT_EQ(mesh.to_string(), "Mesh('X': 4, 'Y': 2, axis_types=(Explicit, Explicit))");
  const HostArray x = random_f32({16, 8}, 1), w = random_f32({8, 4}, 2);
  std::vector<double> want = matmul_ref(x, w);
  for (double& v : want) v = std::tanh(v);
  std::vector<std::string> seen;
  Jitted f = jit([&](const std::vector<Value>& in) {
    Value y = tanh(matmul(in[0], in[1]));
    seen = {type_of(in[0]).to_string(), type_of(in[1]).to_string(), type_of(y).to_string()};
    return std::vector<Value>{y};
  });
  const Array xs = put_on(mesh, x, P("X", None)), ws = put_on(mesh, w, P(None, "Y"));
  EXPECT_EQ(type_of(xs).to_string(), "f32[16@X,8]");
  absl::StatusOr<std::vector<Array>> y = f({xs, ws});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_THAT(seen, ::testing::ElementsAre("f32[16@X,8]", "f32[8,4@Y]", "f32[16@X,4@Y]"));
  EXPECT_TRUE((*y)[0].sharding().is_equivalent_to(NamedSharding(mesh, P("X", "Y")), 2));
  EXPECT_EQ((*y)[0].sharding().mesh(), mesh);
  EXPECT_EQ(type_of((*y)[0]).to_string(), "f32[16@X,4@Y]");
  expect_near(fetch((*y)[0]), want);
  EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("all_")));
}

// With out_sharding JAX's dot_general checks no split (jax/_src/lax/lax.py,
// _dot_general_sharding_rule returns out_sharding first): a contraction split over 'X' on one
// operand and over 'Y' on the other runs, and its result is laid out as out_sharding says.
TEST_F(ExplicitJitTest, OutShardingAcceptsContractingSplitsThatDisagree) {
  const Mesh mesh = explicit_mesh();
  const HostArray x = random_f32({16, 8}, 21), w = random_f32({8, 4}, 22);
  std::string type;
  absl::StatusOr<std::vector<Array>> y = jit([&type](const std::vector<Value>& in) {
    Value p = matmul(in[0], in[1], P("X", None));
    type = type_of(p).to_string();
    return std::vector<Value>{p};
  })({put_on(mesh, x, P(None, "X")), put_on(mesh, w, P("Y", None))});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(type, "f32[16@X,4]");
  EXPECT_EQ((*y)[0].sharding().spec(), P("X", None));
  expect_near(fetch((*y)[0]), matmul_ref(x, w));
}

// The scaling book's example (jax-ml/scaling-book, "Programming TPUs in JAX"): a contraction
// split on both operands is refused until out_sharding says how to resolve the sum: P('X', 'Y')
// is a reduce-scatter, P('X', None) an all-reduce (the book's two readings).
TEST_F(ExplicitJitTest, OutShardingResolvesAContractionSplitOnBothSides) {
  const Mesh mesh = explicit_mesh();
  const HostArray a = random_f32({8, 16}, 3), w = random_f32({16, 32}, 4);
  std::vector<double> want(8 * 32, 0.0);
  for (int64_t b = 0; b < 8; ++b) {
    for (int64_t d = 0; d < 16; ++d) {
      const double sq = double(a.values<float>()[b * 16 + d]) * a.values<float>()[b * 16 + d];
      for (int64_t f = 0; f < 32; ++f) want[b * 32 + f] += sq * w.values<float>()[d * 32 + f];
    }
  }
  const Array as = put_on(mesh, a, P("X", "Y")), ws = put_on(mesh, w, P("Y", None));
  absl::StatusOr<std::vector<Array>> bad = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{einsum("bd,df->bf", in[0] * in[0], in[1])};
  })({as, ws});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              ::testing::AllOf(HasSubstr("dot_general: contracting dimensions are split on both operands"),
                               HasSubstr("(operands f32[8@X,16@Y], f32[16@Y,32])"), HasSubstr("give out_sharding")));
  struct Case {
    PartitionSpec out;
    const char* type;
    const char* collective;
  };
  for (const Case& c :
       {Case{P("X", "Y"), "f32[8@X,32@Y]", "reduce_scatter"}, Case{P("X", None), "f32[8@X,32]", "all_reduce"}}) {
    SCOPED_TRACE(c.out.to_string());
    std::string type;
    Jitted f = jit([&](const std::vector<Value>& in) {
      Value out = einsum("bd,df->bf", in[0] * in[0], in[1], c.out);
      type = type_of(out).to_string();
      return std::vector<Value>{out};
    });
    absl::StatusOr<std::vector<Array>> y = f({as, ws});
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(type, c.type);
    EXPECT_TRUE((*y)[0].sharding().is_equivalent_to(NamedSharding(mesh, c.out), 2));
    EXPECT_THAT(f.as_text(), HasSubstr(c.collective));
    expect_near(fetch((*y)[0]), want, 1e-4);
  }
}

// jax.sharding.reshard outside jit moves an array on the ambient mesh, here its own
// (collectives on the workers); its type follows. Inside jit it is the program's move, and the
// type is the spec. (Without an ambient mesh: out_sharding_test's ReshardOfAnArrayTakesTheAmbientMesh.)
TEST_F(ExplicitJitTest, ReshardMovesArraysAndValues) {
  const Mesh mesh = explicit_mesh();
  MeshScope scope = set_mesh(mesh);
  const HostArray x = random_f32({16, 8}, 5);
  const Array xs = put_on(mesh, x, P("X", None));
  absl::StatusOr<Array> moved = reshard(xs, P(None, "Y"));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(type_of(*moved).to_string(), "f32[16,8@Y]");
  EXPECT_TRUE(moved->sharding().is_equivalent_to(NamedSharding(mesh, P(None, "Y")), 2));
  EXPECT_TRUE(fetch(*moved) == x);
  absl::StatusOr<Array> same = reshard(xs, P("X", None));
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(fetch(*same) == x);
  absl::StatusOr<Array> bad = reshard(xs, P("X", "X"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("reshard: f32[16,8] to P('X', 'X')"));
  std::string inside;
  absl::StatusOr<std::vector<Array>> y = jit([&](const std::vector<Value>& in) {
    Value r = reshard(in[0] * 2.0, P(Axes{"X", "Y"}, None));
    inside = type_of(r).to_string();
    return std::vector<Value>{r};
  })({xs});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(inside, "f32[16@(X,Y),8]");
  EXPECT_TRUE((*y)[0].sharding().is_equivalent_to(NamedSharding(mesh, P(Axes{"X", "Y"}, None)), 2));
  std::vector<double> want(x.size());
  for (int64_t i = 0; i < x.size(); ++i) want[i] = 2.0 * x.values<float>()[i];
  expect_near(fetch((*y)[0]), want);
}

// Unreduced specs (issue 16 item 2), as JAX's sharding-AD note (docs/new_docs/301/
// sharding-ad.md): a contraction split over Y on both operands with out_sharding
// P(None, None, unreduced={'Y'}) leaves each device's partial sum, typed f32[8,4]{U:Y}, with no
// collective; "an unreduced array is a reduction waiting to happen": reshard to P() is the
// all-reduce, to P('Y', None) a reduce-scatter, inside jit and out of it. Adding two arrays
// unreduced alike stays unreduced and pays one all-reduce; a nonlinear op is refused (the note's
// jnp.cos(c)). Values against the host.
TEST_F(ExplicitJitTest, UnreducedContractionsAreSumsWaitingToHappen) {
  const Mesh mesh = explicit_mesh();  // ('X': 4, 'Y': 2)
  MeshScope scope = set_mesh(mesh);
  const HostArray a = random_f32({8, 16}, 41), b = random_f32({16, 4}, 42);
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  // Device k along Y holds rows 8k..8k+7 of b (columns of a): its partial sum is over those.
  std::vector<std::vector<double>> partial(2, std::vector<double>(8 * 4, 0.0));
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      for (int64_t l = 0; l < 16; ++l) {
        partial[l / 8][i * 4 + j] += double(a.values<float>()[i * 16 + l]) * b.values<float>()[l * 4 + j];
      }
    }
  }
  const std::vector<double> full = matmul_ref(a, b);
  const Array as = put_on(mesh, a, P(None, "Y")), bs = put_on(mesh, b, P("Y", None));

  std::string type;
  Jitted partial_sums = jit([&](const std::vector<Value>& in) {
    Value c = matmul(in[0], in[1], unreduced);
    type = type_of(c).to_string();
    return std::vector<Value>{c};
  });
  absl::StatusOr<std::vector<Array>> c = partial_sums({as, bs});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(type, "f32[8,4]{U:Y}");  // the note's float32[2,2]{U:X}
  EXPECT_EQ(type_of((*c)[0]).to_string(), "f32[8,4]{U:Y}");
  EXPECT_EQ((*c)[0].sharding().spec().unreduced(), std::vector<std::string>{"Y"});
  EXPECT_THAT(partial_sums.as_text(), ::testing::Not(HasSubstr("all_reduce")));
  EXPECT_THAT(partial_sums.as_text(), ::testing::Not(HasSubstr("reduce_scatter")));
  // "for shard in c.addressable_shards: print(shard.data)": each device its partial sum.
  for (const Shard& shard : (*c)[0].addressable_shards()) {
    const auto& ids = mesh.device_ids();
    const int64_t position = std::find(ids.begin(), ids.end(), shard.device_id()) - ids.begin();
    absl::StatusOr<HostArray> data = shard.data();
    ASSERT_TRUE(data.ok()) << data.status();
    SCOPED_TRACE(absl::StrCat("device ", shard.device_id()));
    expect_near(*data, partial[position % 2]);
  }
  // Its value is not on any one device: fetching it asks for the reshard.
  absl::StatusOr<HostArray> whole = (*c)[0].fetch();
  EXPECT_EQ(whole.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(whole.status().message()), HasSubstr("f32[8,4]{U:Y}, unreduced over ('Y',)"));

  // Out of jit: reshard cashes it in, all-reduced or reduce-scattered.
  absl::StatusOr<Array> summed = reshard((*c)[0], P());
  ASSERT_TRUE(summed.ok()) << summed.status();
  EXPECT_EQ(type_of(*summed).to_string(), "f32[8,4]");
  expect_near(fetch(*summed), full, 1e-4);
  absl::StatusOr<Array> scattered = reshard((*c)[0], P("Y", None));
  ASSERT_TRUE(scattered.ok()) << scattered.status();
  EXPECT_EQ(type_of(*scattered).to_string(), "f32[8@Y,4]");
  expect_near(fetch(*scattered), full, 1e-4);

  // In jit: c + c2 (c2 = (2a) @ b) stays unreduced, and one reshard sums it once.
  for (const auto& [to, collective, text] :
       {std::tuple{P(), "all_reduce", "f32[8,4]"}, std::tuple{P("Y", None), "reduce_scatter", "f32[8@Y,4]"}}) {
    SCOPED_TRACE(to.to_string());
    std::vector<std::string> types;
    Jitted sum = jit([&](const std::vector<Value>& in) {
      Value c1 = matmul(in[0], in[1], unreduced);
      Value c2 = matmul(in[0] * 2.0, in[1], unreduced);
      Value s = c1 + c2;
      Value r = reshard(s, to);
      types = {type_of(s).to_string(), type_of(r).to_string()};
      return std::vector<Value>{r};
    });
    absl::StatusOr<std::vector<Array>> y = sum({as, bs});
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_THAT(types, ::testing::ElementsAre("f32[8,4]{U:Y}", text));
    const std::string program = sum.as_text();
    size_t count = 0;
    for (size_t at = program.find(collective); at != std::string::npos; at = program.find(collective, at + 1)) ++count;
    EXPECT_EQ(count, 1u) << program;
    std::vector<double> want = full;
    for (double& v : want) v *= 3.0;
    expect_near(fetch((*y)[0]), want, 1e-4);
  }
}

// jnp.matmul's out_sharding is its dot_general's (jax/_src/numpy/tensor_contractions.py), in
// the product's order: f32[4,8,16] @ f32[2,4,16,8] is a product [4 (batch), 8, 2, 8] transposed
// into [2,4,8,8], so P('X') splits the dimension of 4, JAX's float32[2,4@X,8,8]. With
// P(unreduced={'Y'}) over the contraction split on both, the dot_general leaves each device's
// partial sum and the transpose keeps it unreduced: no collective until the reshard (as
// tests/pjit_test.py test_jnp_matmul_out_sharding_unreduced: no all-reduce in the program).
// Values against host loops.
TEST_F(ExplicitJitTest, MatmulOutShardingIsItsDotGeneralsInTheProductsOrder) {
  const Mesh mesh = explicit_mesh();  // ('X': 4, 'Y': 2)
  MeshScope scope = set_mesh(mesh);
  const HostArray l = random_f32({4, 8, 16}, 51), r = random_f32({2, 4, 16, 8}, 52);
  std::vector<double> want(2 * 4 * 8 * 8, 0.0);  // want[b0, b1, i, j] = sum_k l[b1, i, k] r[b0, b1, k, j]
  for (int64_t b0 = 0; b0 < 2; ++b0) {
    for (int64_t b1 = 0; b1 < 4; ++b1) {
      for (int64_t i = 0; i < 8; ++i) {
        for (int64_t j = 0; j < 8; ++j) {
          for (int64_t k = 0; k < 16; ++k) {
            want[((b0 * 4 + b1) * 8 + i) * 8 + j] +=
                double(l.values<float>()[(b1 * 8 + i) * 16 + k]) * r.values<float>()[((b0 * 4 + b1) * 16 + k) * 8 + j];
          }
        }
      }
    }
  }
  const std::vector<Array> args = {put_on(mesh, l, P(None, None, "Y")), put_on(mesh, r, P(None, None, "Y", None))};
  for (const auto& [out, text] :
       {std::pair{P("X"), "f32[2,4@X,8,8]"}, std::pair{P().with_unreduced({"Y"}), "f32[2,4,8,8]{U:Y}"}}) {
    SCOPED_TRACE(out.to_string());
    std::string type;
    Jitted f = jit([&](const std::vector<Value>& in) {
      Value y = matmul(in[0], in[1], out);
      type = type_of(y).to_string();
      return std::vector<Value>{y};
    });
    absl::StatusOr<std::vector<Array>> y = f(args);
    if (!y.ok()) {
      ADD_FAILURE() << y.status();
      continue;
    }
    EXPECT_EQ(type, text);
    EXPECT_EQ(type_of((*y)[0]).to_string(), text);
    if (!out.unreduced().empty()) {
      EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("all_reduce")));
      EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("reduce_scatter")));
    }
    absl::StatusOr<Array> whole = reshard((*y)[0], P());
    EXPECT_TRUE(whole.ok()) << whole.status();
    if (whole.ok()) expect_near(fetch(*whole), want, 1e-4);
  }
}

// grad through an unreduced contraction: the cotangent of an unreduced value is reduced, laid
// out as a replicated one (JAX's sharding-AD note, "reduced {R:X} -> unreduced {U:X}, unreduced
// {U:X} -> reduced {R:X}"; Tessera types it replicated), so the
// contraction's VJP is the ordinary one and each gradient comes back laid out as its primal.
// d/da sum(a @ b) = ones @ b^T (row sums of b), d/db = a^T @ ones (column sums of a), twice
// over for c1 + c2 = a @ b + a @ b.
TEST_F(ExplicitJitTest, GradientsFlowThroughUnreducedContractions) {
  const Mesh mesh = explicit_mesh();
  const HostArray a = random_f32({8, 16}, 45), b = random_f32({16, 4}, 46);
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  std::vector<double> want_a(8 * 16, 0.0), want_b(16 * 4, 0.0);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t l = 0; l < 16; ++l) {
      for (int64_t j = 0; j < 4; ++j) {
        want_a[i * 16 + l] += 2.0 * b.values<float>()[l * 4 + j];
        want_b[l * 4 + j] += 2.0 * a.values<float>()[i * 16 + l];
      }
    }
  }
  Jitted step = jit(grad(
      [&](const std::vector<Value>& p) {
        Value c = matmul(p[0], p[1], unreduced) + matmul(p[0], p[1], unreduced);
        return std::vector<Value>{sum(reshard(c, P()))};
      },
      {0, 1}));
  absl::StatusOr<std::vector<Array>> g = step({put_on(mesh, a, P(None, "Y")), put_on(mesh, b, P("Y", None))});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(type_of((*g)[0]).to_string(), "f32[8,16@Y]");
  EXPECT_EQ(type_of((*g)[1]).to_string(), "f32[16@Y,4]");
  expect_near(fetch((*g)[0]), want_a, 1e-4);
  expect_near(fetch((*g)[1]), want_b, 1e-4);
}

// grad through a pad of an unreduced value: pad is linear (jax/_src/lax/lax.py,
// ad.deflinear2(pad_p, _pad_transpose): the operand's cotangent is the padded cotangent's
// interior), and the unreduced operand's cotangent is reduced. L = sum(reshard(pad(a @ b, 0),
// P()) * W) with W nonzero in the padded region, so a cotangent that kept the fills, or cropped
// the wrong rows or columns, shows: dL/d(a @ b) is W's interior Wc; dL/da = Wc b^T and
// dL/db = a^T Wc. (With a padding value unreduced over the same axes, sum(a @ b), the forward
// runs, UnreducedValuesPassThroughLinearOps, but its grad is refused: see docs/design.md.)
TEST_F(ExplicitJitTest, GradientsFlowThroughAPadOfAnUnreducedValue) {
  const Mesh mesh = explicit_mesh();
  const HostArray a = random_f32({8, 16}, 63), b = random_f32({16, 4}, 64), w = random_f32({11, 6}, 65);
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  // Padding (1, 2) rows and (2, 0) columns: the product sits at rows 1..8, columns 2..5.
  std::vector<double> want_a(8 * 16, 0.0), want_b(16 * 4, 0.0);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t l = 0; l < 16; ++l) {
      for (int64_t j = 0; j < 4; ++j) {
        const double g_c = w.values<float>()[(i + 1) * 6 + j + 2];
        want_a[i * 16 + l] += g_c * b.values<float>()[l * 4 + j];
        want_b[l * 4 + j] += a.values<float>()[i * 16 + l] * g_c;
      }
    }
  }
  std::string type;
  Jitted step = jit(grad(
      [&](const std::vector<Value>& p) {
        const Value padded = pad(matmul(p[0], p[1], unreduced), full({}, 0.0, DType::kF32), {{1, 2, 0}, {2, 0, 0}});
        type = type_of(padded).to_string();
        return std::vector<Value>{sum(reshard(padded, P()) * p[2])};
      },
      {0, 1}));
  absl::StatusOr<std::vector<Array>> g =
      step({put_on(mesh, a, P(None, "Y")), put_on(mesh, b, P("Y", None)), put_on(mesh, w, P())});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(type, "f32[11,6]{U:Y}");
  EXPECT_EQ(type_of((*g)[0]).to_string(), "f32[8,16@Y]");
  EXPECT_EQ(type_of((*g)[1]).to_string(), "f32[16@Y,4]");
  expect_near(fetch((*g)[0]), want_a, 1e-4);
  expect_near(fetch((*g)[1]), want_b, 1e-4);
}

// What JAX refuses of unreduced values (jax/_src/lax/lax.py): a nonlinear op (unop_ur_rule /
// nary_ur_rule: "unreduced rule for cos is not implemented"; the note's jnp.cos(c)), sub
// (standard_naryop, no unreduced rule), add of an unreduced and a reduced operand
// (_add_ur_rule), and an unreduced out_sharding over other axes than the contracting splits
// (_dot_general_unreduced_rule). Each names the op, the operands' types and the fix.
TEST_F(ExplicitJitTest, UnreducedOperandsOfOtherOpsAreRefused) {
  const Mesh mesh = explicit_mesh();
  const HostArray a = random_f32({8, 16}, 43), b = random_f32({16, 4}, 44);
  const Array as = put_on(mesh, a, P(None, "Y")), bs = put_on(mesh, b, P("Y", None));
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  auto refusal = [&](const std::function<Value(const Value&, const Value&)>& f) {
    absl::StatusOr<std::vector<Array>> y =
        jit([&](const std::vector<Value>& in) { return std::vector<Value>{f(in[0], in[1])}; })({as, bs});
    EXPECT_FALSE(y.ok());
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(y.status().message());
  };
  EXPECT_THAT(refusal([&](const Value& x, const Value& w) { return cos(matmul(x, w, unreduced)); }),
              ::testing::AllOf(HasSubstr("cos: unreduced rule for cos is not implemented"),
                               HasSubstr("(operand f32[8,4]{U:Y})"), HasSubstr("reshard the unreduced operand first")));
  EXPECT_THAT(
      refusal([&](const Value& x, const Value& w) { return matmul(x, w, unreduced) - matmul(x, w, unreduced); }),
      ::testing::AllOf(HasSubstr("sub: unreduced rule for sub is not implemented"),
                       HasSubstr("(operands f32[8,4]{U:Y}, f32[8,4]{U:Y})")));
  EXPECT_THAT(refusal([&](const Value& x, const Value& w) { return matmul(x, w, unreduced) + matmul(x, w, P()); }),
              ::testing::AllOf(HasSubstr("add: lhs is unreduced while rhs is not. `add` operation does not allow "
                                         "this because there will be implicit communication"),
                               HasSubstr("(operands f32[8,4]{U:Y}, f32[8,4])"), HasSubstr("reduce lhs via `reshard`")));
  EXPECT_THAT(
      refusal([&](const Value& x, const Value& w) { return matmul(x, w, P(None, None).with_unreduced({"X"})); }),
      HasSubstr("dot_general: out_sharding's unreduced axes should be equal to the contracting specs. Got "
                "unreduced axes=frozenset({'X'}) and contracting specs over {'Y'}"));
  // A value unreduced over some axes is not resharded onto others (JAX refuses it too).
  EXPECT_THAT(refusal([&](const Value& x, const Value& w) {
                return reshard(matmul(x, w, unreduced), P(None, None).with_unreduced({"X"}));
              }),
              HasSubstr("makes an unreduced value from one unreduced over {'Y'}"));
}

// device_put onto an unreduced spec as JAX's (jax/_src/dispatch.py: a jit resharding onto it):
// each block's value on the first device along the unreduced axes and zeros on the others, so
// the terms sum to the array. tests/pjit_test.py test_device_put_unreduced_via_jit: on a mesh
// (2,) 'x', jnp.arange(4) (an uncommitted array) put onto P(unreduced={'x'}) holds [0, 1, 2, 3]
// on the first device and zeros on the second; a host array likewise; and on (4, 2) a block
// split over 'X' and unreduced over 'Y'.
TEST_F(ExplicitJitTest, DevicePutOntoAnUnreducedSpecPutsTheValueOnTheFirstDeviceAlongItAsJax) {
  absl::StatusOr<Mesh> line = client_->make_mesh({2}, {"x"}, {0, 1}, {AxisType::kExplicit});
  ASSERT_TRUE(line.ok()) << line.status();
  // Each shard of `put` is its block of `host` on the first device along the unreduced axis
  // (position 0: even device ids on both meshes here) and zeros elsewhere; summed, `host`.
  auto check = [&](const absl::StatusOr<Array>& put, const HostArray& host, const std::string& type) {
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(type_of(*put).to_string(), type);
    for (const Shard& shard : put->addressable_shards()) {
      absl::StatusOr<HostArray> block = shard.data();
      ASSERT_TRUE(block.ok()) << block.status();
      HostArray want = extract_block(host, shard.index());
      if (shard.device_id() % 2 != 0) want = HostArray::zeros(want.dtype(), want.shape());
      EXPECT_TRUE(*block == want) << "device " << shard.device_id() << " block " << index_to_string(shard.index());
    }
    absl::StatusOr<Array> summed = reshard(*put, NamedSharding(put->sharding().mesh(), P()));
    ASSERT_TRUE(summed.ok()) << summed.status();
    EXPECT_TRUE(fetch(*summed) == host);
  };
  const HostArray four = HostArray::arange(DType::kF32, {4});
  const NamedSharding unreduced(*line, P().with_unreduced({"x"}));
  check(client_->device_put(four, unreduced), four, "f32[4]{U:x}");
  absl::StatusOr<Array> uncommitted = client_->array(four);
  ASSERT_TRUE(uncommitted.ok()) << uncommitted.status();
  check(client_->device_put(*uncommitted, unreduced), four, "f32[4]{U:x}");
  const HostArray a = random_f32({8, 3}, 45);
  check(client_->device_put(a, NamedSharding(explicit_mesh(), P("X", None).with_unreduced({"Y"}))), a,
        "f32[8@X,3]{U:Y}");
}

// device_put of an unreduced Array onto another mesh (issue 16 item 2b). tests/pjit_test.py
// test_device_put_unreduced_via_runtime_transfer: x = jnp.dot of a (2, 4) P(None, 'x') and a
// (4, 2) P('x', None) with out_sharding P(unreduced={'x'}) on a (2,) mesh, put onto
// P(unreduced={'x'}) of another (2,) mesh: each shard of the result is the shard of x at the
// same place (its partial sum, not a replica) and both sum to the same value. Tessera matches
// the terms by coordinates along the unreduced axes, so the target may split other dimensions
// over other axes; onto other unreduced axes (JAX: a jitted reshard, which cannot span meshes)
// the sum runs first on x's mesh. A reduced array moves as a replicated one.
TEST_F(ExplicitJitTest, DevicePutOfAnUnreducedArrayOntoAnotherMeshMovesEachTermToItsCounterpartAsJax) {
  absl::StatusOr<Mesh> line = client_->make_mesh({2}, {"x"}, {0, 1}, {AxisType::kExplicit});
  ASSERT_TRUE(line.ok()) << line.status();
  // The same devices in the other order: device 1 takes the term of device 0 (not its own).
  absl::StatusOr<Mesh> other = client_->make_mesh({2}, {"x"}, {1, 0}, {AxisType::kExplicit});
  ASSERT_TRUE(other.ok()) << other.status();
  const HostArray a = random_f32({4, 6}, 61), b = random_f32({6, 4}, 62);
  // Device k along 'x' holds columns 3k..3k+2 of a and rows 3k..3k+2 of b: its partial sum.
  std::vector<HostArray> partial;
  for (int k = 0; k < 2; ++k) partial.push_back(HostArray::zeros(DType::kF32, {4, 4}));
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      for (int64_t l = 0; l < 6; ++l) {
        partial[l / 3].mutable_values<float>()[i * 4 + j] +=
            a.values<float>()[i * 6 + l] * b.values<float>()[l * 4 + j];
      }
    }
  }
  const std::vector<double> full = matmul_ref(a, b);
  const PartitionSpec unreduced = P().with_unreduced({"x"});
  Jitted dot = jit([&](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1], unreduced)}; });
  absl::StatusOr<std::vector<Array>> c = dot({put_on(*line, a, P(None, "x")), put_on(*line, b, P("x", None))});
  ASSERT_TRUE(c.ok()) << c.status();
  const Array x = (*c)[0];
  ASSERT_EQ(type_of(x).to_string(), "f32[4,4]{U:x}");
  // Each shard of `put` is its block of the partial sum of the device at its coordinate along
  // `axis` of its mesh; summed on its mesh, the product.
  auto check_terms = [&](const absl::StatusOr<Array>& put, const std::string& axis, const std::string& type) {
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(type_of(*put).to_string(), type);
    const Mesh& mesh = put->sharding().mesh();
    for (const Shard& shard : put->addressable_shards()) {
      const auto& ids = mesh.device_ids();
      const int64_t position = std::find(ids.begin(), ids.end(), shard.device_id()) - ids.begin();
      const int64_t term = mesh.coords(position)[mesh.axis_index(axis)];
      absl::StatusOr<HostArray> data = shard.data();
      ASSERT_TRUE(data.ok()) << data.status();
      SCOPED_TRACE(absl::StrCat("device ", shard.device_id(), " block ", index_to_string(shard.index())));
      const HostArray want = extract_block(partial[term], shard.index());
      expect_near(*data, std::vector<double>(want.values<float>().begin(), want.values<float>().end()), 1e-5);
    }
    absl::StatusOr<Array> summed = reshard(*put, NamedSharding(mesh, P()));
    ASSERT_TRUE(summed.ok()) << summed.status();
    expect_near(fetch(*summed), full, 1e-4);
  };
  check_terms(x, "x", "f32[4,4]{U:x}");
  // JAX's case: the same spec on another mesh of the same size.
  absl::StatusOr<Array> moved = client_->device_put(x, NamedSharding(*other, unreduced));
  check_terms(moved, "x", "f32[4,4]{U:x}");
  ASSERT_TRUE(moved.ok());
  for (size_t k = 0; k < 2; ++k) {
    absl::StatusOr<HostArray> before = x.addressable_shards()[k].data(), after = moved->addressable_shards()[k].data();
    ASSERT_TRUE(before.ok() && after.ok());
    EXPECT_TRUE(*before == *after) << "shard " << k;
  }
  // Onto a (2, 2) mesh of other devices, rows split over 'y': by coordinates along 'x' (7 and 6
  // take device 0's term, 3 and 4 device 1's).
  absl::StatusOr<Mesh> square =
      client_->make_mesh({2, 2}, {"x", "y"}, {7, 6, 3, 4}, {AxisType::kExplicit, AxisType::kExplicit});
  ASSERT_TRUE(square.ok()) << square.status();
  check_terms(client_->device_put(x, NamedSharding(*square, P("y", None).with_unreduced({"x"}))), "x",
              "f32[4@y,4]{U:x}");
  // Onto no unreduced axis, or another one: the sum first, then the move.
  absl::StatusOr<Array> plain = client_->device_put(x, NamedSharding(*other, P(None, "x")));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(type_of(*plain).to_string(), "f32[4,4@x]");
  expect_near(fetch(*plain), full, 1e-4);
  absl::StatusOr<Mesh> four = client_->make_mesh({4}, {"z"}, {4, 5, 6, 7}, {AxisType::kExplicit});
  ASSERT_TRUE(four.ok()) << four.status();
  absl::StatusOr<Array> onto_z = client_->device_put(x, NamedSharding(*four, P().with_unreduced({"z"})));
  ASSERT_TRUE(onto_z.ok()) << onto_z.status();
  EXPECT_EQ(type_of(*onto_z).to_string(), "f32[4,4]{U:z}");
  absl::StatusOr<Array> z_summed = reshard(*onto_z, NamedSharding(*four, P()));
  ASSERT_TRUE(z_summed.ok()) << z_summed.status();
  expect_near(fetch(*z_summed), full, 1e-4);
  // A reduced array is replicated over its reduced axes: every device of the target holds its
  // block of the value.
  const Array reduced = put_on(*line, a, P().with_reduced({"x"}));
  for (const PartitionSpec& spec : {P().with_reduced({"x"}), P("x", None)}) {
    absl::StatusOr<Array> put = client_->device_put(reduced, NamedSharding(*other, spec));
    ASSERT_TRUE(put.ok()) << put.status();
    EXPECT_EQ(put->sharding(), NamedSharding(*other, spec));
    for (const Shard& shard : put->addressable_shards()) {
      absl::StatusOr<HostArray> data = shard.data();
      ASSERT_TRUE(data.ok()) << data.status();
      EXPECT_TRUE(*data == extract_block(a, shard.index())) << "device " << shard.device_id();
    }
  }
}

// Reduced types (issue 16 item 2; JAX's docs/new_docs/301/sharding-ad.md): a value typed
// P(..., reduced={'x'}) is laid out replicated over 'x', printed `f32[4]{R:x}`, and its
// cotangent is unreduced over 'x'. The elementwise rules are JAX's default_nary_reduced_rule
// (jax/_src/lax/lax.py), with its errors; a scalar meeting a reduced value is reduced alike
// (core.py's insert_reduced_reshard). Cases from tests/pjit_test.py:
// test_reduced_mul_scalar_fwd, test_mul_reduced_error, test_one_input_reduced_another_replicated.
TEST_F(ExplicitJitTest, ReducedValuesAreReplicatedAndTypedAsJax) {
  absl::StatusOr<Mesh> line = client_->make_mesh({2}, {"x"}, {0, 1}, {AxisType::kExplicit});
  ASSERT_TRUE(line.ok()) << line.status();
  const HostArray four = HostArray::arange(DType::kF32, {4}), eight = HostArray::arange(DType::kF32, {8});
  const Array arr = put_on(*line, four, P().with_reduced({"x"}));
  EXPECT_EQ(type_of(arr).to_string(), "f32[4]{R:x}");
  // Every device holds the whole value.
  for (const Shard& shard : arr.addressable_shards()) {
    absl::StatusOr<HostArray> data = shard.data();
    ASSERT_TRUE(data.ok()) << data.status();
    expect_near(*data, {0, 1, 2, 3});
  }
  std::vector<std::string> types;
  Jitted twice = jit([&](const std::vector<Value>& in) {
    Value y = in[0] * 2.0;
    types = {type_of(in[0]).to_string(), type_of(y).to_string()};
    return std::vector<Value>{y};
  });
  absl::StatusOr<std::vector<Array>> out = twice({arr});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[4]{R:x}", "f32[4]{R:x}"));
  EXPECT_EQ((*out)[0].sharding().spec(), P(None).with_reduced({"x"}));  // JAX: P(None, reduced={'x'})
  expect_near(fetch((*out)[0]), {0, 2, 4, 6});

  auto refusal = [&](const Mesh& mesh, const std::function<Value(const Value&, const Value&)>& f,
                     const std::vector<Array>& args) {
    absl::StatusOr<std::vector<Array>> y =
        jit([&](const std::vector<Value>& in) { return std::vector<Value>{f(in[0], in[1])}; })(args);
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument) << mesh.to_string();
    return std::string(y.status().message());
  };
  auto mul = [](const Value& a, const Value& b) { return a * b; };
  auto add = [](const Value& a, const Value& b) { return a + b; };
  EXPECT_THAT(refusal(*line, mul, {arr, put_on(*line, four, P())}),
              ::testing::AllOf(HasSubstr("mul: Inputs cannot be replicated on the same axes that another input is "
                                         "reduced on. Got input type: f32[4] and reduced spec: frozenset({'x'})"),
                               HasSubstr("(operands f32[4]{R:x}, f32[4])")));
  const Array split = put_on(*line, eight, P("x")), reduced8 = put_on(*line, eight, P().with_reduced({"x"}));
  for (const auto& args : {std::vector<Array>{reduced8, split}, std::vector<Array>{split, reduced8}}) {
    EXPECT_THAT(refusal(*line, mul, args),
                HasSubstr("Inputs cannot be sharded/varying on the same axes that another input is reduced on. "
                          "Reshard the input which is reduced to be sharded on the mesh axes it is reduced on"));
  }
  absl::StatusOr<Mesh> square =
      client_->make_mesh({2, 2}, {"x", "y"}, {0, 1, 2, 3}, {AxisType::kExplicit, AxisType::kExplicit});
  ASSERT_TRUE(square.ok()) << square.status();
  const HostArray m = HostArray::arange(DType::kF32, {4, 2});
  const Array r = put_on(*square, m, P("x").with_reduced({"y"})), rep = put_on(*square, m, P("x", None));
  EXPECT_EQ(type_of(r).to_string(), "f32[4@x,2]{R:y}");
  for (const auto& f :
       {std::function<Value(const Value&, const Value&)>(mul), std::function<Value(const Value&, const Value&)>(add)}) {
    EXPECT_THAT(refusal(*square, [&](const Value& a, const Value& b) { return sum(f(a, b)); }, {r, rep}),
                HasSubstr("Inputs cannot be replicated on the same axes that another input is reduced on. Got input "
                          "type: f32[4@x,2] and reduced spec: frozenset({'y'})"));
  }
  // An op with no reduced rule refuses a reduced operand, as JAX's call_ur_rule (reduce_prod_p
  // has no ur_rule; reduce_max keeps the axes since session 27: reduced_test.cc).
  EXPECT_THAT(refusal(*line, [](const Value& a, const Value&) { return prod(a); }, {arr, arr}),
              HasSubstr("reduce_prod: unreduced/reduced rule for reduce_prod is not implemented"));
}

// d/dx sum(sin(x) @ sin(y)) with x reduced over 'x' and y split over 'x' (tests/pjit_test.py,
// test_reduced_sin_fwd_mul_bwd): the gradient of x is unreduced over 'x' (the contraction's
// partial sums, times cos(x), which is reduced), and the program runs no all_reduce; resharded
// to P() it is the host's gradient, as is y's.
TEST_F(ExplicitJitTest, GradOfAReducedValueIsUnreducedAndSummedByTheReshard) {
  absl::StatusOr<Mesh> line = client_->make_mesh({2}, {"x"}, {0, 1}, {AxisType::kExplicit});
  ASSERT_TRUE(line.ok()) << line.status();
  const HostArray a = HostArray::arange(DType::kF32, {4, 2}), b = HostArray::arange(DType::kF32, {2, 8});
  std::vector<double> want_a(8), want_b(16);
  double value = 0;
  for (int i = 0; i < 4; ++i) {
    for (int k = 0; k < 2; ++k) {
      for (int j = 0; j < 8; ++j) {
        const double x = a.values<float>()[i * 2 + k], y = b.values<float>()[k * 8 + j];
        value += std::sin(x) * std::sin(y);
        want_a[i * 2 + k] += std::cos(x) * std::sin(y);
        want_b[k * 8 + j] += std::sin(x) * std::cos(y);
      }
    }
  }
  const Array x = put_on(*line, a, P().with_reduced({"x"})), y = put_on(*line, b, P(None, "x"));
  auto f = [](const std::vector<Value>& p) { return std::vector<Value>{sum(matmul(sin(p[0]), sin(p[1])))}; };
  absl::StatusOr<std::vector<Array>> loss = jit(f)({x, y});
  ASSERT_TRUE(loss.ok()) << loss.status();
  expect_near(fetch((*loss)[0]), {value}, 1e-4);
  Jitted step = jit(grad(f, {0, 1}));
  absl::StatusOr<std::vector<Array>> g = step({x, y});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)[0].sharding().spec(), P(None, None).with_unreduced({"x"}));
  EXPECT_EQ(type_of((*g)[0]).to_string(), "f32[4,2]{U:x}");
  EXPECT_EQ((*g)[1].sharding().spec(), P(None, "x"));
  EXPECT_THAT(step.as_text(), ::testing::Not(HasSubstr("all_reduce")));
  absl::StatusOr<Array> summed = reshard((*g)[0], NamedSharding(*line, P()));
  ASSERT_TRUE(summed.ok()) << summed.status();
  expect_near(fetch(*summed), want_a, 1e-4);
  expect_near(fetch((*g)[1]), want_b, 1e-4);
}

// The cotangent of a reshard of a reduced value (tests/pjit_test.py,
// test_reduced_reshard_unreduced_bwd and _sharded): each device's term is its block of the
// cotangent, zero-padded (JAX's shards [1,1,0,0] / [0,0,1,1]), typed unreduced; the user's
// reshard sums it. Also a broadcast of a reduced value with out_sharding
// (test_broadcast_reduced_inp_unreduced_out), whose cotangent's sum over the split dimension is
// left pending, and reshards onto unreduced axes of whole values (test_scalar_to_unreduced,
// test_sharded_unreduced_roundtrip).
TEST_F(ExplicitJitTest, ReshardsOfReducedValuesHaveUnreducedCotangents) {
  absl::StatusOr<Mesh> square =
      client_->make_mesh({2, 2}, {"x", "y"}, {0, 1, 2, 3}, {AxisType::kExplicit, AxisType::kExplicit});
  ASSERT_TRUE(square.ok()) << square.status();
  const HostArray four = HostArray::arange(DType::kF32, {4});
  const Array arr = put_on(*square, four, P(None).with_reduced({"x"}));
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{reshard(in[0], P("x"))}; });
  absl::StatusOr<std::vector<Array>> out = f({arr});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].sharding().spec(), P("x"));
  expect_near(fetch((*out)[0]), {0, 1, 2, 3});
  Jitted g = jit(grad([](const std::vector<Value>& in) { return std::vector<Value>{sum(reshard(in[0], P("x")))}; }));
  absl::StatusOr<std::vector<Array>> ct = g({arr});
  ASSERT_TRUE(ct.ok()) << ct.status();
  EXPECT_EQ((*ct)[0].sharding().spec(), P(None).with_unreduced({"x"}));
  const std::vector<std::vector<double>> terms = {{1, 1, 0, 0}, {1, 1, 0, 0}, {0, 0, 1, 1}, {0, 0, 1, 1}};
  for (const Shard& shard : (*ct)[0].addressable_shards()) {
    const auto& ids = square->device_ids();
    const int64_t position = std::find(ids.begin(), ids.end(), shard.device_id()) - ids.begin();
    absl::StatusOr<HostArray> data = shard.data();
    ASSERT_TRUE(data.ok()) << data.status();
    SCOPED_TRACE(absl::StrCat("device ", shard.device_id()));
    expect_near(*data, terms[position]);
  }
  absl::StatusOr<Array> summed = reshard((*ct)[0], NamedSharding(*square, P()));
  ASSERT_TRUE(summed.ok()) << summed.status();
  expect_near(fetch(*summed), {1, 1, 1, 1});  // d/dx sum(x)

  // Sharded: P('x', None, reduced={'y'}) resharded to P('x', 'y'); the gradient is
  // P('x', None, unreduced={'y'}), and resharded to P('x', None) the host's d/dx sum(2 * x).
  const HostArray m = HostArray::arange(DType::kF32, {4, 2});
  const Array sharded = put_on(*square, m, P("x", None).with_reduced({"y"}));
  Jitted h = jit(
      grad([](const std::vector<Value>& in) { return std::vector<Value>{sum(reshard(in[0], P("x", "y")) * 2.0)}; }));
  absl::StatusOr<std::vector<Array>> hg = h({sharded});
  ASSERT_TRUE(hg.ok()) << hg.status();
  EXPECT_EQ((*hg)[0].sharding().spec(), P("x", None).with_unreduced({"y"}));
  absl::StatusOr<Array> rows = reshard((*hg)[0], NamedSharding(*square, P("x", None)));
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->sharding().spec(), P("x", None));
  expect_near(fetch(*rows), std::vector<double>(8, 2.0));

  // broadcast_in_dim of a reduced value onto P('x', None): the gradient is unreduced over 'x'.
  absl::StatusOr<Mesh> line = client_->make_mesh({2}, {"x"}, {0, 1}, {AxisType::kExplicit});
  ASSERT_TRUE(line.ok()) << line.status();
  const HostArray eight = HostArray::arange(DType::kF32, {8});
  const Array r8 = put_on(*line, eight, P().with_reduced({"x"}));
  auto bcast = [](const Value& v) { return broadcast_in_dim(v, {2, 8}, {1}, P("x", None)); };
  absl::StatusOr<std::vector<Array>> b =
      jit([&](const std::vector<Value>& in) { return std::vector<Value>{bcast(in[0])}; })({r8});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)[0].sharding().spec(), P("x", None));
  Jitted bg = jit(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(bcast(in[0]) * 3.0)}; }));
  absl::StatusOr<std::vector<Array>> bgs = bg({r8});
  ASSERT_TRUE(bgs.ok()) << bgs.status();
  EXPECT_EQ((*bgs)[0].sharding().spec(), P(None).with_unreduced({"x"}));
  EXPECT_THAT(bg.as_text(), ::testing::Not(HasSubstr("all_reduce")));
  absl::StatusOr<Array> bsum = reshard((*bgs)[0], NamedSharding(*line, P()));
  ASSERT_TRUE(bsum.ok()) << bsum.status();
  expect_near(fetch(*bsum), std::vector<double>(8, 6.0));  // two rows, times 3

  // A whole scalar onto P(unreduced={'x'}): the value on the first device, 0 on the other.
  const Array one = put_on(*line, HostArray::from_vector<float>({}, {1.0f}), P());
  absl::StatusOr<Array> u = reshard(one, NamedSharding(*line, P().with_unreduced({"x"})));
  ASSERT_TRUE(u.ok()) << u.status();
  std::vector<double> held;
  for (const Shard& shard : u->addressable_shards()) held.push_back(shard.data()->values<float>()[0]);
  EXPECT_THAT(held, ::testing::UnorderedElementsAre(1.0, 0.0));
  absl::StatusOr<Array> back = reshard(*u, NamedSharding(*line, P()));
  ASSERT_TRUE(back.ok()) << back.status();
  expect_near(fetch(*back), {1.0});
  // P('x', 'y') -> P('x', None, unreduced={'y'}) -> P('x', 'y'): the same array.
  const Array xy = put_on(*square, m, P("x", "y"));
  absl::StatusOr<Array> xu = reshard(xy, NamedSharding(*square, P("x", None).with_unreduced({"y"})));
  ASSERT_TRUE(xu.ok()) << xu.status();
  EXPECT_EQ(xu->sharding().spec(), P("x", None).with_unreduced({"y"}));
  absl::StatusOr<Array> round = reshard(*xu, NamedSharding(*square, P("x", "y")));
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(round->sharding().spec(), P("x", "y"));
  expect_near(fetch(*round), {0, 1, 2, 3, 4, 5, 6, 7});

  // A mesh axis of size 1 in the source or the target splits nothing: the terms are those of
  // the mesh without it (each value counted once in the sum; review of session 26: the step
  // counted a size-1 axis as pending and left every device the whole value, twice the sum).
  absl::StatusOr<Mesh> flat =
      client_->make_mesh({1, 2}, {"z", "x"}, {0, 1}, {AxisType::kExplicit, AxisType::kExplicit});
  ASSERT_TRUE(flat.ok()) << flat.status();
  struct UnitCase {
    PartitionSpec from, to;
    std::vector<std::vector<double>> terms;  // by position in the mesh
  };
  const UnitCase unit_cases[] = {
      {P("z"), P(None).with_unreduced({"x"}), {{0, 1, 2, 3}, {0, 0, 0, 0}}},
      {P("x"), P("z").with_unreduced({"x"}), {{0, 1, 0, 0}, {0, 0, 2, 3}}},
      {P(Axes{"z", "x"}), P(None).with_unreduced({"x"}), {{0, 1, 0, 0}, {0, 0, 2, 3}}},
  };
  for (const UnitCase& c : unit_cases) {
    SCOPED_TRACE(absl::StrCat(c.from.to_string(), " -> ", c.to.to_string()));
    const Array placed = put_on(*flat, four, c.from);
    absl::StatusOr<Array> pending = reshard(placed, NamedSharding(*flat, c.to));
    ASSERT_TRUE(pending.ok()) << pending.status();
    for (const Shard& shard : pending->addressable_shards()) {
      const auto& ids = flat->device_ids();
      const int64_t position = std::find(ids.begin(), ids.end(), shard.device_id()) - ids.begin();
      absl::StatusOr<HostArray> data = shard.data();
      ASSERT_TRUE(data.ok()) << data.status();
      SCOPED_TRACE(absl::StrCat("device ", shard.device_id()));
      expect_near(*data, c.terms[position]);
    }
    absl::StatusOr<Array> summed = reshard(*pending, NamedSharding(*flat, P()));
    ASSERT_TRUE(summed.ok()) << summed.status();
    expect_near(fetch(*summed), {0, 1, 2, 3});
  }
}

// The linear ops JAX lets an unreduced value through (jax/_src/lax/lax.py: _transpose_ur_rule,
// _reshape_unreduced_rule, _reduce_sum_ur_rule, _convert_element_type_ur_rule,
// _broadcast_in_dim_unreduced_rule, _concatenate_unreduced_rule; the reduce_sum of an
// unreduced value is tests/pjit_test.py's test_reduce_sum_unreduced_error, case 2, the
// broadcast its test_broadcast_unreduced, the concatenate its test_concat_unreduced): each
// device's term goes through the op, so the result is unreduced alike, and its sum, run later,
// is the op of the sum. Each result leaves jit unreduced with no collective; resharding it to
// P() out of jit gives the host's op of a @ b. Inside jit a reshard after the chain pays one
// all_reduce, at the chain's end (also after a broadcast, where a sum not typed unreduced is
// run first, at the smaller shape).
TEST_F(ExplicitJitTest, UnreducedValuesPassThroughLinearOps) {
  const Mesh mesh = explicit_mesh();  // ('X': 4, 'Y': 2)
  MeshScope scope = set_mesh(mesh);
  const HostArray a = random_f32({8, 16}, 47), b = random_f32({16, 4}, 48);
  const Array as = put_on(mesh, a, P(None, "Y")), bs = put_on(mesh, b, P("Y", None));
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  const std::vector<double> full = matmul_ref(a, b);  // 8 x 4, row-major
  std::vector<double> transposed(32), column_sums(4, 0.0), total(1, 0.0), spread(8 * 3 * 4), side_by_side(8 * 8);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      transposed[j * 8 + i] = full[i * 4 + j];
      column_sums[j] += full[i * 4 + j];
      total[0] += full[i * 4 + j];
      for (int64_t k = 0; k < 3; ++k) spread[(i * 3 + k) * 4 + j] = full[i * 4 + j];
    }
  }
  // [c, reshape(c^T, (8, 4))] along dimension 1.
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      side_by_side[i * 8 + j] = full[i * 4 + j];
      side_by_side[i * 8 + 4 + j] = transposed[i * 4 + j];
    }
  }
  auto repeated = [&](int times) {
    std::vector<double> r;
    for (int t = 0; t < times; ++t) r.insert(r.end(), full.begin(), full.end());
    return r;
  };
  // lax.pad of the 8 x 4 product on the host (numpy's definition: `fill` around and between).
  const std::vector<double> padded_rows = host_pad(full, {8, 4}, {{1, 2, 0}, {0, 0, 0}}, 0.0);
  const std::vector<double> padded_both = host_pad(full, {8, 4}, {{-1, 2, 1}, {1, 0, 0}}, 0.0);
  const std::vector<double> padded_with_total = host_pad(full, {8, 4}, {{2, 1, 0}, {1, 2, 0}}, total[0]);
  struct Case {
    const char* name;
    std::function<Value(const Value&)> op;
    const char* type;
    std::vector<double> want;
  };
  const Case cases[] = {
      {"transpose",
       [](const Value& c) {
         return transpose(c, {1, 0});
       },
       "f32[4,8]{U:Y}", transposed},
      {"reshape", [](const Value& c) { return reshape(c, {32}); }, "f32[32]{U:Y}", full},
      {"reshape with out_sharding",
       [&](const Value& c) {
         return reshape(c, {4, 8}, P(None, None).with_unreduced({"Y"}));
       },
       "f32[4,8]{U:Y}", full},
      {"sum over dimension 0", [](const Value& c) { return sum(c, {0}); }, "f32[4]{U:Y}", column_sums},
      {"sum of all", [](const Value& c) { return sum(c); }, "f32[]{U:Y}", total},
      {"convert to f64 and back", [](const Value& c) { return convert(convert(c, DType::kF64), DType::kF32); },
       "f32[8,4]{U:Y}", full},
      {"chain",
       [](const Value& c) {
         return sum(reshape(transpose(c, {1, 0}), {32}), {0});
       },
       "f32[]{U:Y}", total},
      {"broadcast_to",
       [](const Value& c) {
         return broadcast_to(c, {2, 8, 4});
       },
       "f32[2,8,4]{U:Y}", repeated(2)},
      {"broadcast_in_dim with out_sharding",
       [](const Value& c) {
         return broadcast_in_dim(c, {8, 3, 4}, {0, 2}, P(None, None, None).with_unreduced({"Y"}));
       },
       "f32[8,3,4]{U:Y}", spread},
      {"concatenate",
       [](const Value& c) {
         return concatenate({c, c}, 0);
       },
       "f32[16,4]{U:Y}", repeated(2)},
      {"concatenate of two values along 1",
       [](const Value& c) {
         return concatenate({c, reshape(transpose(c, {1, 0}), {8, 4})}, 1);
       },
       "f32[8,8]{U:Y}", side_by_side},
      // JAX's _pad_ur_rule (jax/_src/lax/lax.py) keeps the operand's unreduced axes: with a
      // zero padding value (jnp.pad's default; lax.pad with interior and negative padding) and
      // with one unreduced over the same axes (each device pads its term with its term).
      {"jnp.pad with zeros",
       [](const Value& c) {
         return pad(c, {{1, 2}, {0, 0}});
       },
       "f32[11,4]{U:Y}", padded_rows},
      {"lax.pad with interior and negative padding",
       [](const Value& c) {
         return pad(c, tessera::full({}, 0.0, DType::kF32), {{-1, 2, 1}, {1, 0, 0}});
       },
       "f32[16,5]{U:Y}", padded_both},
      {"lax.pad with an unreduced padding value",
       [](const Value& c) {
         return pad(c, sum(c), {{2, 1, 0}, {1, 2, 0}});
       },
       "f32[11,7]{U:Y}", padded_with_total},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    std::string type;
    Jitted f = jit([&](const std::vector<Value>& in) {
      Value y = k.op(matmul(in[0], in[1], unreduced));
      type = type_of(y).to_string();
      return std::vector<Value>{y};
    });
    expect_unreduced_result(f, {as, bs}, k.want);
    EXPECT_EQ(type, k.type);
  }
  // In jit: the transposed column sums, resharded once: one all_reduce, of the 4 sums.
  Jitted once = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{reshard(sum(transpose(matmul(in[0], in[1], unreduced), {1, 0}), {1}), P())};
  });
  auto all_reduces = [](const std::string& program) {
    size_t count = 0;
    for (size_t at = program.find("all_reduce"); at != std::string::npos; at = program.find("all_reduce", at + 1))
      ++count;
    return count;
  };
  absl::StatusOr<std::vector<Array>> y = once({as, bs});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(all_reduces(once.as_text()), 1u) << once.as_text();
  expect_near(fetch((*y)[0]), column_sums, 1e-4);
  // Broadcasts and a concatenate of them, resharded once: one all_reduce, of the (3, 8, 4) result.
  Jitted joined = jit([&](const std::vector<Value>& in) {
    const Value c = matmul(in[0], in[1], unreduced);
    return std::vector<Value>{reshard(concatenate({broadcast_to(c, {2, 8, 4}), broadcast_to(c, {1, 8, 4})}, 0), P())};
  });
  y = joined({as, bs});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(all_reduces(joined.as_text()), 1u) << joined.as_text();
  expect_near(fetch((*y)[0]), repeated(3), 1e-4);
  // A pending sum not typed unreduced (the row sums of a split over 'Y', typed f32[8,1]) is
  // still run before its broadcast, at the (8, 1) shape.
  Jitted centred =
      jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] - sum(in[0], {1}, /*keepdims=*/true)}; });
  y = centred({as});
  ASSERT_TRUE(y.ok()) << y.status();
  const std::string text = centred.as_text();
  ASSERT_EQ(all_reduces(text), 1u) << text;
  const size_t at = text.find("all_reduce");
  EXPECT_THAT(text.substr(at, text.find('\n', at) - at), HasSubstr("f32[8,1]")) << text;
  std::vector<double> centred_want(8 * 16);
  for (int64_t i = 0; i < 8; ++i) {
    double row = 0;
    for (int64_t l = 0; l < 16; ++l) row += a.values<float>()[i * 16 + l];
    for (int64_t l = 0; l < 16; ++l) centred_want[i * 16 + l] = a.values<float>()[i * 16 + l] - row;
  }
  expect_near(fetch((*y)[0]), centred_want, 1e-4);
}

// grad through unreduced values that pass through broadcast_in_dim and concatenate, as
// tests/pjit_test.py's test_concat_unreduced (grad part: out_g typed P(None, reduced={'x'}),
// equal to the gradient of the same function on replicated inputs) and
// test_broadcast_reduced_inp_unreduced_out (whose grad types the transposed broadcast's
// cotangent unreduced, the dual of reduced). The cotangent of an unreduced value is reduced,
// laid out as a replicated one (Tessera types it so): the transposes of the broadcast
// (a sum over the new dimension) and of the concatenate (slices) see replicated cotangents, and
// each gradient comes back laid out as its primal. Weights w make the cotangent differ per
// element, so a wrong slice or summed dimension shows. With G = dL/dc (c = a @ b) computed on
// the host from w, dL/da = G @ b^T and dL/db = a^T @ G.
TEST_F(ExplicitJitTest, GradientsFlowThroughUnreducedBroadcastsAndConcatenates) {
  const Mesh mesh = explicit_mesh();  // ('X': 4, 'Y': 2)
  MeshScope scope = set_mesh(mesh);
  const HostArray a = random_f32({8, 16}, 51), b = random_f32({16, 4}, 52);
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  struct Case {
    const char* name;
    std::function<Value(const Value&)> op;
    Shape out;
    // Adds w's contribution to G (8 x 4, row-major).
    std::function<void(absl::Span<const float>, std::vector<double>&)> cotangent;
  };
  const Case cases[] = {
      {"broadcast_in_dim with out_sharding",
       [](const Value& c) {
         return broadcast_in_dim(c, {8, 3, 4}, {0, 2}, P(None, None, None).with_unreduced({"Y"}));
       },
       {8, 3, 4},
       [](absl::Span<const float> w, std::vector<double>& g) {
         for (int64_t i = 0; i < 8; ++i)
           for (int64_t k = 0; k < 3; ++k)
             for (int64_t j = 0; j < 4; ++j) g[i * 4 + j] += w[(i * 3 + k) * 4 + j];
       }},
      {"concatenate of two values along 1",
       [](const Value& c) {
         return concatenate({c, reshape(transpose(c, {1, 0}), {8, 4})}, 1);
       },
       {8, 8},
       [](absl::Span<const float> w, std::vector<double>& g) {
         for (int64_t i = 0; i < 8; ++i) {
           for (int64_t j = 0; j < 4; ++j) {
             g[i * 4 + j] += w[i * 8 + j];
             const int64_t m = j * 8 + i;  // c[i, j] is element m of reshape(c^T, (8, 4))
             g[i * 4 + j] += w[(m / 4) * 8 + 4 + m % 4];
           }
         }
       }},
      {"concatenate of broadcasts along 0",
       [](const Value& c) {
         return concatenate({broadcast_to(c, {2, 8, 4}), broadcast_to(c, {1, 8, 4})}, 0);
       },
       {3, 8, 4},
       [](absl::Span<const float> w, std::vector<double>& g) {
         for (int64_t t = 0; t < 3; ++t)
           for (int64_t e = 0; e < 32; ++e) g[e] += w[t * 32 + e];
       }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const HostArray w = random_f32(k.out, 53);
    std::vector<double> g(8 * 4, 0.0), want_a(8 * 16, 0.0), want_b(16 * 4, 0.0);
    k.cotangent(w.values<float>(), g);
    for (int64_t i = 0; i < 8; ++i) {
      for (int64_t l = 0; l < 16; ++l) {
        for (int64_t j = 0; j < 4; ++j) {
          want_a[i * 16 + l] += g[i * 4 + j] * b.values<float>()[l * 4 + j];
          want_b[l * 4 + j] += a.values<float>()[i * 16 + l] * g[i * 4 + j];
        }
      }
    }
    std::string type;
    Jitted step = jit(grad(
        [&](const std::vector<Value>& p) {
          Value y = k.op(matmul(p[0], p[1], unreduced));
          type = type_of(y).to_string();
          return std::vector<Value>{sum(reshard(y, P()) * p[2])};
        },
        {0, 1}));
    absl::StatusOr<std::vector<Array>> got =
        step({put_on(mesh, a, P(None, "Y")), put_on(mesh, b, P("Y", None)), put_on(mesh, w, P())});
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_THAT(type, ::testing::EndsWith("{U:Y}"));
    EXPECT_EQ(type_of((*got)[0]).to_string(), "f32[8,16@Y]");
    EXPECT_EQ(type_of((*got)[1]).to_string(), "f32[16@Y,4]");
    expect_near(fetch((*got)[0]), want_a, 1e-4);
    expect_near(fetch((*got)[1]), want_b, 1e-4);
  }
  // test_concat_unreduced itself: two unreduced arrays (here jit outputs c = a @ b, unreduced over
  // 'Y') concatenated and summed; the gradient of the unreduced sum with respect to each is ones,
  // typed reduced, as there (P(None, reduced={'x'}): the cotangent of an unreduced argument).
  Jitted product =
      jit([&](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1], unreduced)}; });
  absl::StatusOr<std::vector<Array>> c = product({put_on(mesh, a, P(None, "Y")), put_on(mesh, b, P("Y", None))});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(type_of((*c)[0]).to_string(), "f32[8,4]{U:Y}");
  Jitted concat_grad = jit(grad(
      [](const std::vector<Value>& p) {
        return std::vector<Value>{sum(concatenate({p[0], p[1]}, 0))};
      },
      {0, 1}));
  absl::StatusOr<std::vector<Array>> g = concat_grad({(*c)[0], (*c)[0]});
  ASSERT_TRUE(g.ok()) << g.status();
  for (const Array& x : *g) {
    EXPECT_EQ(type_of(x).to_string(), "f32[8,4]{R:Y}");
    expect_near(fetch(x), std::vector<double>(8 * 4, 1.0));
  }
}

// Slices, squeezes and selects of unreduced values, as JAX types them: jax/_src/lax/slicing.py's
// _slice_ur_rule and lax.py's _squeeze_ur_rule keep the operand's unreduced axes, _select_ur_rule
// the cases' (tests/pjit_test.py's test_slice_unreduced and test_select_unreduced, forward and
// grad), and _dynamic_slice_ur_rule refuses ("unreduced rule for dynamic_slice is not
// implemented"), as does _select_sharding_rule for cases unreduced differently ("select cases
// must have the same shardings"); pad, which JAX's _pad_ur_rule lets through, Tessera refuses. Each result leaves jit
// unreduced with no sum run on the way; resharded to P() it is the host's op of a @ b, also on dimensions split over
// 'X'. The gradients with respect to an unreduced jit output are those of the same function on the whole value (the
// host's 0/1 masks here), typed replicated (JAX's reduced).
TEST_F(ExplicitJitTest, UnreducedValuesPassThroughSlicesSqueezesAndSelects) {
  const Mesh mesh = explicit_mesh();  // ('X': 4, 'Y': 2)
  MeshScope scope = set_mesh(mesh);
  const HostArray a = random_f32({8, 16}, 54), b = random_f32({16, 4}, 55), w = random_f32({8, 4}, 56);
  const Array as = put_on(mesh, a, P(None, "Y")), bs = put_on(mesh, b, P("Y", None));
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  const std::vector<double> ab = matmul_ref(a, b);  // c = a @ b, 8 x 4, row-major
  // c2 = reshape(c^T, (8, 4)): c2[i, j] = c[m % 8, m / 8] with m = i * 4 + j.
  std::vector<double> sliced, row_block, column, picked(32), picked_mask(32);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t m = i * 4 + j;
      const double c = ab[m], c2 = ab[(m % 8) * 4 + m / 8];
      if (j < 3) sliced.push_back(c);
      if (i >= 2 && i < 6) row_block.push_back(c);
      if (j == 1) column.push_back(c);
      picked_mask[m] = w.values<float>()[m] > 0 ? 1.0 : 0.0;
      picked[m] = picked_mask[m] > 0 ? c : c2;
    }
  }
  struct Case {
    const char* name;
    PartitionSpec c_spec;  // c's out_sharding (its unreduced axes are 'Y')
    PartitionSpec w_spec;
    std::function<Value(const Value& c, const Value& w)> op;
    const char* type;
    const std::vector<double>& want;
  };
  const Case cases[] = {
      {"slice", unreduced, P(),
       [](const Value& c, const Value&) {
         return slice(c, {0, 0}, {8, 3});
       },
       "f32[8,3]{U:Y}", sliced},
      {"slice of rows split over X", P("X", None).with_unreduced({"Y"}), P(),
       [](const Value& c, const Value&) {
         return slice(c, {2, 0}, {6, 4});
       },
       "f32[4@X,4]{U:Y}", row_block},
      {"squeeze", unreduced, P(),
       [](const Value& c, const Value&) {
         return squeeze(slice(c, {0, 1}, {8, 2}), {1});
       },
       "f32[8]{U:Y}", column},
      {"select", unreduced, P(),
       [](const Value& c, const Value& w) {
         return where(w > 0.0, c, reshape(transpose(c, {1, 0}), {8, 4}));
       },
       "f32[8,4]{U:Y}", picked},
      {"select by a predicate split over X", unreduced, P("X", None),
       [](const Value& c, const Value& w) {
         return where(w > 0.0, c, reshape(transpose(c, {1, 0}), {8, 4}));
       },
       "f32[8@X,4]{U:Y}", picked},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    std::string type;
    Jitted f = jit([&](const std::vector<Value>& in) {
      Value y = k.op(matmul(in[0], in[1], k.c_spec), in[2]);
      type = type_of(y).to_string();
      return std::vector<Value>{y};
    });
    expect_unreduced_result(f, {as, bs, put_on(mesh, w, k.w_spec)}, k.want);
    EXPECT_EQ(type, k.type);
  }
  // The grads: of sum(slice(c)) (test_slice_unreduced), and of sum(select(pred, c1, c2)) with
  // respect to both cases (test_select_unreduced), c1 = c2 = c an unreduced jit output.
  Jitted product =
      jit([&](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1], unreduced)}; });
  absl::StatusOr<std::vector<Array>> c = product({as, bs});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(type_of((*c)[0]).to_string(), "f32[8,4]{U:Y}");
  std::vector<double> slice_mask(32), not_picked(32);
  for (int64_t m = 0; m < 32; ++m) {
    slice_mask[m] = m % 4 < 3 ? 1.0 : 0.0;
    not_picked[m] = 1.0 - picked_mask[m];
  }
  absl::StatusOr<std::vector<Array>> g = jit(grad(
      [](const std::vector<Value>& p) {
        return std::vector<Value>{sum(slice(p[0], {0, 0}, {8, 3}))};
      },
      {0}))({(*c)[0]});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(type_of((*g)[0]).to_string(), "f32[8,4]{R:Y}");
  expect_near(fetch((*g)[0]), slice_mask);
  g = jit(grad([](const std::vector<Value>& p) { return std::vector<Value>{sum(where(p[2] > 0.0, p[0], p[1]))}; },
               {0, 1}))({(*c)[0], (*c)[0], put_on(mesh, w, P())});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(type_of((*g)[0]).to_string(), "f32[8,4]{R:Y}");
  EXPECT_EQ(type_of((*g)[1]).to_string(), "f32[8,4]{R:Y}");
  expect_near(fetch((*g)[0]), picked_mask);
  expect_near(fetch((*g)[1]), not_picked);
  // What JAX refuses.
  auto refusal = [&](const std::function<Value(const Value& c, const Value& w)>& f) {
    absl::StatusOr<std::vector<Array>> y = jit([&](const std::vector<Value>& in) {
      return std::vector<Value>{f(matmul(in[0], in[1], unreduced), in[2])};
    })({as, bs, put_on(mesh, w, P())});
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument) << y.status();
    return std::string(y.status().message());
  };
  EXPECT_THAT(refusal([](const Value& c, const Value&) {
                return dynamic_slice(c, {full({}, 2, DType::kI32), full({}, 0, DType::kI32)}, {4, 4});
              }),
              ::testing::AllOf(HasSubstr("dynamic_slice: unreduced rule for dynamic_slice is not implemented"),
                               HasSubstr("f32[8,4]{U:Y}"), HasSubstr("reshard the unreduced operand first")));
  EXPECT_THAT(refusal([](const Value& c, const Value& w) { return where(w > 0.0, c, reshard(c, P())); }),
              ::testing::AllOf(HasSubstr("select: select cases must have the same shardings, got [f32[8,4]{U:Y}, "
                                         "f32[8,4]]"),
                               HasSubstr("reshard the unreduced operand first")));
  // And what Tessera refuses where JAX goes on: pad with a value neither zero nor unreduced over
  // the same axes (_pad_ur_rule keeps the operand's unreduced axes, and each device's term is
  // padded with the value: the sum would hold it once per device).
  for (const double fill : {1.0, -2.5}) {
    EXPECT_THAT(refusal([&](const Value& c, const Value&) {
                  return pad(c, {{1, 1}, {0, 0}}, fill);
                }),
                ::testing::AllOf(HasSubstr("pad: padding an operand unreduced over {'Y'} with a padding value "
                                           "that is neither zero nor unreduced over the same axes"),
                                 HasSubstr("(operand f32[8,4]{U:Y}); pad with zero and add the padding afterwards")));
  }
  EXPECT_THAT(refusal([](const Value& c, const Value& w) {
                return pad(c, sum(w), {{1, 1, 0}, {0, 0, 0}});
              }),
              HasSubstr("pad: padding an operand unreduced over {'Y'} with a padding value that is neither zero"));
}

// What JAX refuses of an unreduced operand of the other ops, each with JAX's words, the op, the
// operand types and the fix (jax/_src/lax/lax.py): neg (unop_ur_rule), mul by an operand not
// reduced over the same axes or of two unreduced ones (_mul_ur_rule; Tessera has no reduced
// types, so `c * 2` is refused as JAX refuses it), div (_div_ur_rule), reshape with an
// out_sharding over other unreduced axes (_reshape_unreduced_rule), concatenate of operands
// unreduced over different axes (_concatenate_unreduced_rule: "All operands should be unreduced
// along the same mesh axes"). And what Tessera refuses where JAX goes on: reduce_max (JAX's
// rule is a TODO passing the axes through), a reduce_sum of a dimension split over another axis
// (the pending sum would grow), broadcast_in_dim with an out_sharding over other unreduced axes
// and a concatenate of an unreduced operand with one that is not (JAX allows them for *reduced*
// operands, which Tessera does not have).
TEST_F(ExplicitJitTest, UnreducedOperandsOfNonlinearUsesAreRefused) {
  const Mesh mesh = explicit_mesh();
  MeshScope scope = set_mesh(mesh);
  const HostArray a = random_f32({8, 16}, 49), b = random_f32({16, 4}, 50);
  const Array as = put_on(mesh, a, P(None, "Y")), bs = put_on(mesh, b, P("Y", None));
  const PartitionSpec unreduced = P(None, None).with_unreduced({"Y"});
  auto refusal = [&](const std::function<Value(const Value&)>& f, const PartitionSpec& out = P(None, None)) {
    absl::StatusOr<std::vector<Array>> y = jit([&](const std::vector<Value>& in) {
      return std::vector<Value>{f(matmul(in[0], in[1], out.with_unreduced({"Y"})))};
    })({as, bs});
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument) << y.status();
    return std::string(y.status().message());
  };
  EXPECT_THAT(refusal([](const Value& c) { return -c; }),
              ::testing::AllOf(HasSubstr("neg: unreduced rule for neg is not implemented"),
                               HasSubstr("(operand f32[8,4]{U:Y}); reshard the unreduced operand first")));
  EXPECT_THAT(refusal([](const Value& c) { return c * 2.0; }),
              ::testing::AllOf(HasSubstr("mul: RHS should be reduced along the same axes LHS is unreduced on. Got "
                                         "lhs=f32[8,4]{U:Y} and rhs=f32[8,4]"),
                               HasSubstr("reshard the other operand to P(..., reduced={...})")));
  EXPECT_THAT(refusal([](const Value& c) { return c * c; }),
              HasSubstr("mul: lhs and rhs to `mul` cannot be unreduced since mul is bilinear. Got "
                        "lhs=frozenset({'Y'}), rhs=frozenset({'Y'})"));
  EXPECT_THAT(refusal([](const Value& c) { return c / 2.0; }),
              HasSubstr("div: Denominator should be reduced along the same axes numerator is unreduced on. Got "
                        "x=f32[8,4]{U:Y}, y=f32[8,4]"));
  EXPECT_THAT(refusal([](const Value& c) { return reshape(c, {32}, P(None)); }),
              HasSubstr("reshape: out_sharding passed to reshape must be unreduced over the same mesh axes as "
                        "operand. Got out_sharding's unreduced axes {} and operand type: f32[8,4]{U:Y}"));
  // A cast of each term to an integer or half type is not the cast of the sum (Tessera's
  // compiler sums first, so explicit mode refuses rather than types it unreduced).
  EXPECT_THAT(
      refusal([](const Value& c) { return convert(c, DType::kBF16); }),
      ::testing::AllOf(HasSubstr("convert: casting an unreduced value to bfloat16 would cast each device's term"),
                       HasSubstr("(operand f32[8,4]{U:Y})")));
  EXPECT_THAT(refusal([](const Value& c) { return convert(c, DType::kI32); }),
              HasSubstr("convert: casting an unreduced value to int32"));
  EXPECT_THAT(refusal([](const Value& c) { return max(c, {0}); }),
              HasSubstr("reduce_max: unreduced rule for reduce_max is not implemented"));
  EXPECT_THAT(refusal([](const Value& c) { return sum(c, {0}); }, P("X", None)),
              ::testing::AllOf(HasSubstr("reduce_sum: summing dimension 0, split over ('X',), of an operand unreduced "
                                         "over {'Y'} would leave a sum pending over both"),
                               HasSubstr("(operand f32[8@X,4]{U:Y})")));
  EXPECT_THAT(refusal([](const Value& c) {
                return broadcast_to(c, {2, 8, 4}, P(None, None, None));
              }),
              ::testing::AllOf(HasSubstr("broadcast_in_dim: out_sharding passed to broadcast_in_dim must be unreduced "
                                         "over the same mesh axes as operand. Got out_sharding's unreduced axes {} "
                                         "and operand type: f32[8,4]{U:Y}"),
                               HasSubstr("give out_sharding=P(..., unreduced={'Y'})")));
  EXPECT_THAT(refusal([](const Value& c) {
                return concatenate({c, reshard(c, P())}, 0);
              }),
              ::testing::AllOf(HasSubstr("concatenate: operand 1 is not unreduced while others are unreduced over "
                                         "{'Y'}"),
                               HasSubstr("(operands f32[8,4]{U:Y}, f32[8,4]); reshard the unreduced operand first")));
  // Unreduced over 'Y' (a contraction split over 'Y') and over 'X' (one split over 'X').
  const Array ax = put_on(mesh, a, P(None, "X")), bx = put_on(mesh, b, P("X", None));
  absl::StatusOr<std::vector<Array>> mixed = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{
        concatenate({matmul(in[0], in[1], unreduced), matmul(in[2], in[3], P(None, None).with_unreduced({"X"}))}, 0)};
  })({as, bs, ax, bx});
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument) << mixed.status();
  EXPECT_THAT(mixed.status().message(),
              ::testing::AllOf(HasSubstr("concatenate: All operands should be unreduced along the same mesh axes. "
                                         "Got unreduced specs: {frozenset({'Y'}), frozenset({'X'})}"),
                               HasSubstr("(operands f32[8,4]{U:Y}, f32[8,4]{U:X})")));
  // _add_ur_rule (jax/_src/lax/lax.py) prints the operands' unreduced frozensets.
  absl::StatusOr<std::vector<Array>> added = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{matmul(in[0], in[1], unreduced) +
                              matmul(in[2], in[3], P(None, None).with_unreduced({"X"}))};
  })({as, bs, ax, bx});
  EXPECT_EQ(added.status().code(), absl::StatusCode::kInvalidArgument) << added.status();
  EXPECT_THAT(added.status().message(),
              HasSubstr("add: lhs and rhs to `add` must be unreduced along the same mesh axes. Got "
                        "lhs=frozenset({'Y'}), rhs=frozenset({'X'})"));
}

// grad in explicit mode: each cotangent takes its primal's type, so d/dw sum(tanh(x @ w)) =
// x^T (1 - tanh(x w)^2) comes back laid out as w, equal to the host's.
TEST_F(ExplicitJitTest, GradientsComeBackLaidOutAsTheirPrimals) {
  const Mesh mesh = explicit_mesh();
  const HostArray x = random_f32({16, 8}, 6), w = random_f32({8, 4}, 7);
  const std::vector<double> xw = matmul_ref(x, w);
  std::vector<double> want(8 * 4, 0.0);
  for (int64_t i = 0; i < 16; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      const double t = std::tanh(xw[i * 4 + j]);
      for (int64_t k = 0; k < 8; ++k) want[k * 4 + j] += double(x.values<float>()[i * 8 + k]) * (1.0 - t * t);
    }
  }
  Jitted step =
      jit(grad([](const std::vector<Value>& p) { return std::vector<Value>{sum(tanh(matmul(p[0], p[1])))}; }, {1}));
  absl::StatusOr<std::vector<Array>> g = step({put_on(mesh, x, P("X", None)), put_on(mesh, w, P(None, "Y"))});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE((*g)[0].sharding().is_equivalent_to(NamedSharding(mesh, P(None, "Y")), 2));
  EXPECT_EQ(type_of((*g)[0]).to_string(), "f32[8,4@Y]");
  expect_near(fetch((*g)[0]), want, 1e-4);
}

// The explicit-sharding notebook's auto_axes examples (docs/notebooks/explicit-sharding.ipynb,
// jax-ml/jax) with their printed values: some_x P("X", None) + some_y P(None, "X") (both
// arange(16).reshape(4, 4)) under auto_axes with out_shardings=P("X", None) is int32[4@X,4];
// and f(some_x) = g(sin(x)) + 1, g = auto_axes(y * 2, axes='X', out_shardings=P("X", "Y")),
// prints "Array([[ 1.        ,  2.682942  ,  2.818595  ,  1.28224   ], [-0.513605  , ...".
// explicit_axes (the notebook's next example) on an Auto mesh: sin, then y * 2 typed inside,
// then + 1 back in Auto mode, the same values.
TEST_F(ExplicitJitTest, AutoAxesAndExplicitAxesRunAsTheNotebookPrints) {
  const Mesh mesh = explicit_mesh();
  const HostArray ints = HostArray::arange(DType::kI32, {4, 4});
  TracedFunction add = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; };
  absl::StatusOr<std::vector<Array>> sum =
      jit(auto_axes(add, {}, {P("X", None)}))({put_on(mesh, ints, P("X", None)), put_on(mesh, ints, P(None, "X"))});
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(type_of((*sum)[0]).to_string(), "i32[4@X,4]");
  std::vector<int32_t> twice(16);
  for (int i = 0; i < 16; ++i) twice[i] = 2 * i;
  EXPECT_TRUE(fetch((*sum)[0]) == HostArray::from_vector<int32_t>({4, 4}, twice));

  std::vector<double> want(16);
  for (int i = 0; i < 16; ++i) want[i] = 2.0 * std::sin(double(i)) + 1.0;
  // The notebook's first row and the first of the second, as printed.
  for (auto [i, printed] :
       std::vector<std::pair<int, double>>{{0, 1.0}, {1, 2.682942}, {2, 2.818595}, {3, 1.28224}, {4, -0.513605}}) {
    EXPECT_NEAR(want[i], printed, 1e-6);
  }
  const HostArray x = HostArray::arange(DType::kF32, {4, 4});
  std::string inside;
  TracedFunction g = auto_axes(
      [&](const std::vector<Value>& y) {
        inside = type_of(y[0]).to_string();
        return std::vector<Value>{y[0] * 2.0};
      },
      {"X"}, {P("X", "Y")});
  absl::StatusOr<std::vector<Array>> z = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{g({sin(in[0])})[0] + 1.0};
  })({put_on(mesh, x, P("X", "Y"))});
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_EQ(inside, "f32[4,4@Y]");
  EXPECT_EQ(type_of((*z)[0]).to_string(), "f32[4@X,4@Y]");
  expect_near(fetch((*z)[0]), want);

  absl::StatusOr<Mesh> autos = client_->make_mesh({4, 2}, {"X", "Y"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(autos.ok()) << autos.status();
  MeshScope scope = set_mesh(*autos);
  TracedFunction explicit_g = explicit_axes(
      [&](const std::vector<Value>& y) {
        const Value r = y[0] * 2.0;
        inside = type_of(r).to_string();
        return std::vector<Value>{r};
      },
      {"X", "Y"}, {P("X", "Y")});
  z = jit([&](const std::vector<Value>& in) { return std::vector<Value>{explicit_g({sin(in[0])})[0] + 1.0}; })(
      {put_on(*autos, x, P("X", "Y"))});
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_EQ(inside, "f32[4@X,4@Y]");
  EXPECT_EQ(type_of((*z)[0]).to_string(), "f32[4,4]");
  expect_near(fetch((*z)[0]), want);
}

// auto_axes and explicit_axes called on arrays outside jit, as JAX runs them eagerly
// (jax/_src/pjit.py _auto_axes / _explicit_axes). Mirrors tests/pjit_test.py
// test_auto_axes_no_context_mesh (`h(arr)` with axes='x' and out_sharding P('x', 'y'): inside,
// the type is P(None, 'y'); out.sharding is NamedSharding(mesh, P('x', 'y'))) and
// test_auto_axes_computation_follows_data, and the explicit-sharding notebook's
// add_with_out_sharding_kwarg(some_x, some_y, out_sharding=P("X", None)) called at top level:
// int32[4@X,4] holding 2 * arange(16). explicit_axes on arrays of an Auto mesh under set_mesh
// (test_explicit_axes_top_level's matmul with in_sharding P('x', None) for both: typed
// P('x', None) inside). Values against the host.
TEST_F(ExplicitJitTest, AutoAxesAndExplicitAxesRunOnArraysOutsideJit) {
  const Mesh mesh = explicit_mesh();
  const HostArray x = random_f32({16, 8}, 31);
  std::string inside, inside_mesh;
  AxesSwitched h = auto_axes(
      [&](const std::vector<Value>& y) {
        const Value z = sin(y[0]);
        inside = type_of(z).to_string();
        inside_mesh = get_abstract_mesh().to_string();
        return std::vector<Value>{z};
      },
      {"X"}, {P("X", "Y")});
  absl::StatusOr<std::vector<Array>> out = h({put_on(mesh, x, P("X", "Y"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(inside, "f32[16,8@Y]");
  EXPECT_EQ(inside_mesh, "AbstractMesh('X': 4, 'Y': 2, axis_types=(Auto, Explicit))");
  EXPECT_EQ((*out)[0].sharding(), NamedSharding(mesh, P("X", "Y")));
  std::vector<double> want(x.size());
  for (int64_t i = 0; i < x.size(); ++i) want[i] = std::sin(double(x.values<float>()[i]));
  expect_near(fetch((*out)[0]), want);

  const HostArray ints = HostArray::arange(DType::kI32, {4, 4});
  absl::StatusOr<std::vector<Array>> sum =
      auto_axes([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; }, {},
                {P("X", None)})({put_on(mesh, ints, P("X", None)), put_on(mesh, ints, P(None, "X"))});
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(type_of((*sum)[0]).to_string(), "i32[4@X,4]");
  std::vector<int32_t> twice(16);
  for (int i = 0; i < 16; ++i) twice[i] = 2 * i;
  EXPECT_TRUE(fetch((*sum)[0]) == HostArray::from_vector<int32_t>({4, 4}, twice));

  absl::StatusOr<Mesh> autos = client_->make_mesh({4, 2}, {"X", "Y"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(autos.ok()) << autos.status();
  const HostArray w = random_f32({8, 16}, 32);
  {
    MeshScope scope = set_mesh(*autos);
    absl::StatusOr<std::vector<Array>> prod = explicit_axes(
        [&](const std::vector<Value>& in) {
          const Value r = matmul(in[0], in[1]);
          inside = type_of(r).to_string();
          inside_mesh = get_abstract_mesh().to_string();
          return std::vector<Value>{r};
        },
        {}, {P("X", None), P("X", None)})({put_on(*autos, x, P("X", "Y")), put_on(*autos, w, P("Y", "X"))});
    ASSERT_TRUE(prod.ok()) << prod.status();
    EXPECT_EQ(inside, "f32[16@X,16]");
    EXPECT_EQ(inside_mesh, "AbstractMesh('X': 4, 'Y': 2, axis_types=(Explicit, Explicit))");
    EXPECT_EQ(type_of((*prod)[0]).to_string(), "f32[16,16]");  // Auto again outside
    expect_near(fetch((*prod)[0]), matmul_ref(x, w), 1e-4);
  }
  // Without a mesh explicit_axes on an Auto mesh's arrays fails as JAX's does.
  absl::StatusOr<std::vector<Array>> none = explicit_axes([](const std::vector<Value>& in) { return in; }, {},
                                                          {P("X", None)})({put_on(*autos, x, P("X", "Y"))});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("Context mesh cannot be empty"));
}

// jax.sharding.get_abstract_mesh() in a trace shows the axis types in force there: under
// set_mesh at the top of a jitted function the mesh's (the explicit-sharding notebook prints
// "mesh inside f: AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))" and, inside
// auto_axes(axes='X'), "(Auto, Explicit)"); in a shard_map body the manual axes Manual and the
// others as the mesh has them (tests/shard_map_test.py test_shmap_partial_manual_explicit:
// axis_names={'x'} on an Explicit (2, 2) mesh gives manual_axes ('x',), explicit_axes ('y',);
// test_shmap_full_manual_context_auto: manual_axes ('x', 'y') on an Auto mesh); outside
// everything, empty (tests/pjit_test.py test_set_mesh_none: empty_abstract_mesh).
TEST_F(ExplicitJitTest, GetAbstractMeshShowsTheAxisTypesWhereItIsCalled) {
  const Mesh mesh = explicit_mesh();
  const HostArray x = random_f32({16, 8}, 33);
  EXPECT_EQ(get_abstract_mesh(), AbstractMesh());
  std::vector<std::string> seen;
  auto note = [&] { seen.push_back(get_abstract_mesh().to_string()); };
  {
    MeshScope scope = set_mesh(mesh);
    AxesSwitched g = auto_axes(
        [&](const std::vector<Value>& y) {
          note();
          return std::vector<Value>{y[0] * 2.0};
        },
        {"X"}, {P("X", "Y")});
    ShardMapped partial = shard_map(
        [&](const std::vector<Value>& in) {
          note();
          return std::vector<Value>{in[0] * 3.0};
        },
        mesh, {P("X")}, {P("X")}, ShardMapOptions{.axis_names = {"X"}});
    absl::StatusOr<std::vector<Array>> out = jit([&](const std::vector<Value>& in) {
      note();
      const Value a = g({in[0]})[0];
      note();
      return std::vector<Value>{a, partial({in[0]})[0]};
    })({put_on(mesh, x, P("X", "Y"))});
    ASSERT_TRUE(out.ok()) << out.status();
    std::vector<double> twice(x.size()), thrice(x.size());
    for (int64_t i = 0; i < x.size(); ++i) {
      twice[i] = 2.0 * x.values<float>()[i];
      thrice[i] = 3.0 * x.values<float>()[i];
    }
    expect_near(fetch((*out)[0]), twice);
    expect_near(fetch((*out)[1]), thrice);
    EXPECT_EQ(get_abstract_mesh(), mesh.abstract_mesh());
  }
  EXPECT_THAT(seen, ::testing::ElementsAre("AbstractMesh('X': 4, 'Y': 2, axis_types=(Explicit, Explicit))",
                                           "AbstractMesh('X': 4, 'Y': 2, axis_types=(Auto, Explicit))",
                                           "AbstractMesh('X': 4, 'Y': 2, axis_types=(Explicit, Explicit))",
                                           "AbstractMesh('X': 4, 'Y': 2, axis_types=(Manual, Explicit))"));
  absl::StatusOr<Mesh> autos = client_->make_mesh({4, 2}, {"X", "Y"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(autos.ok()) << autos.status();
  seen.clear();
  ShardMapped full = shard_map(
      [&](const std::vector<Value>& in) {
        note();
        return in;
      },
      *autos, {P("X", "Y")}, {P("X", "Y")});
  ASSERT_TRUE(full({put_on(*autos, x, P("X", "Y"))}).ok());
  EXPECT_THAT(seen, ::testing::ElementsAre("AbstractMesh('X': 4, 'Y': 2, axis_types=(Manual, Manual))"));
  EXPECT_EQ(get_abstract_mesh().to_string(), "AbstractMesh((), axis_types=())");
}

// The families given explicit rules after the first ones (client/explicit/{sort,reduction,
// layout,placement}.cc), each on split operands of the (4, 2) mesh: its type and its values
// against the host.
TEST_F(ExplicitJitTest, SortCumulativePadDynamicSlicesAndScatterRunByTheirTypes) {
  const Mesh mesh = explicit_mesh();
  const HostArray x = random_f32({16, 8}, 11), u = random_f32({16, 4}, 12), upd = random_f32({6, 8}, 13);
  const HostArray idx = HostArray::from_vector<int32_t>({6}, {3, 0, 3, 15, 7, 0});
  std::vector<std::string> types;
  absl::StatusOr<std::vector<Array>> out = jit([&](const std::vector<Value>& in) {
    const Value i4 = full({}, 4.0, DType::kI32), i2 = full({}, 2.0, DType::kI32), i0 = full({}, 0.0, DType::kI32);
    std::vector<Value> r = {sort(in[0]),
                            top_k(in[0], 3).first,
                            cumsum(in[0], 1),
                            pad(in[0], full({}, -1.0), {{0, 0, 0}, {1, 2, 1}}),
                            dynamic_slice(in[0], {i4, i2}, {8, 4}),
                            dynamic_update_slice(in[0], in[1], {i0, i2}),
                            scatter_add(reshard(in[0], P(None, "Y")), in[2], in[3], 0)};
    for (const Value& v : r) types.push_back(type_of(v).to_string());
    return r;
  })({put_on(mesh, x, P("X", None)), put_on(mesh, u, P("X", None)), put_on(mesh, idx, P()),
      put_on(mesh, upd, P(None, "Y"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[16@X,8]", "f32[16@X,3]", "f32[16@X,8]", "f32[16@X,18]", "f32[8@X,4]",
                                            "f32[16@X,8]", "f32[16,8@Y]"));
  const float* xv = x.values<float>().data();
  std::vector<double> sorted, top, cum, padded, sliced, updated(xv, xv + 128), scattered(xv, xv + 128);
  for (int r = 0; r < 16; ++r) {
    std::vector<double> row(xv + r * 8, xv + r * 8 + 8);
    double acc = 0;
    for (double v : row) cum.push_back(acc += v);
    padded.push_back(-1.0);
    for (int c = 0; c < 8; ++c) {
      padded.push_back(row[c]);
      if (c < 7) padded.push_back(-1.0);
    }
    padded.insert(padded.end(), {-1.0, -1.0});
    std::sort(row.begin(), row.end());
    sorted.insert(sorted.end(), row.begin(), row.end());
    top.insert(top.end(), {row[7], row[6], row[5]});
    for (int c = 0; c < 4; ++c) updated[r * 8 + 2 + c] = u.values<float>()[r * 4 + c];
  }
  for (int r = 4; r < 12; ++r) {
    for (int c = 2; c < 6; ++c) sliced.push_back(xv[r * 8 + c]);
  }
  for (int k = 0; k < 6; ++k) {
    for (int c = 0; c < 8; ++c) scattered[idx.values<int32_t>()[k] * 8 + c] += upd.values<float>()[k * 8 + c];
  }
  for (const auto& [i, want] : std::vector<std::pair<int, const std::vector<double>*>>{
           {0, &sorted}, {1, &top}, {2, &cum}, {3, &padded}, {4, &sliced}, {5, &updated}, {6, &scattered}}) {
    SCOPED_TRACE(i);
    expect_near(fetch((*out)[i]), *want);
  }
  EXPECT_TRUE((*out)[6].sharding().is_equivalent_to(NamedSharding(mesh, P(None, "Y")), 2));
}

// type_of of a value of the enclosing trace, asked inside a loop body, is that value's type
// there (JAX's typeof of a closed-over value: its aval), without capturing it. It used to read the
// enclosing trace's types at the index of the body's capturing parameter: another value's type.
TEST_F(ExplicitJitTest, TypeOfAnEnclosingValueInsideALoopBodyIsItsOwnType) {
  const Mesh mesh = explicit_mesh();
  std::vector<std::string> types;
  absl::StatusOr<std::vector<Array>> out = jit([&](const std::vector<Value>& in) {
    const Value looped =
        fori_loop(0, 2,
                  [&](const Value&, const std::vector<Value>& c) {
                    types = {type_of(in[0]).to_string(), type_of(in[1]).to_string(), type_of(in[2]).to_string()};
                    return std::vector<Value>{c[0] + 1.0};
                  },
                  {in[2]})[0];
    return std::vector<Value>{looped};
  })({put_on(mesh, random_f32({16, 8}, 41), P("X", None)), put_on(mesh, random_f32({5, 16, 8}, 42), P(None, "X", None)),
      put_on(mesh, random_f32({16, 8}, 43), P("X", "Y"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[16@X,8]", "f32[5,16@X,8]", "f32[16@X,8@Y]"));
}

// Control flow in explicit mode (client/explicit/control.cc) on the (4, 2) mesh: a scan over
// xs split along a later dimension carries h f32[16@X,8] (its type kept, as JAX's
// _check_carry_type requires) and stacks ys f32[5,16@X] (the row type with an unsplit leading
// dimension, as _scan_abstract_eval's unmapped avals); its gradient comes back as its primal's
// type (tests/pjit_test.py test_scan); fori_loop, while_loop, cond and checkpoint keep split
// operands' types. Values against a host computation in double.
TEST_F(ExplicitJitTest, ControlFlowRunsByItsTypes) {
  const Mesh mesh = explicit_mesh();
  const HostArray h0 = random_f32({16, 8}, 31), xs = random_f32({5, 16, 8}, 32), w = random_f32({16, 8}, 33);
  std::vector<std::string> types;
  auto recurrence = [](const Value& h, const Value& x) {
    ScanResult r = scan(
        [](const std::vector<Value>& c, const std::vector<Value>& row) {
          const Value next = tanh(c[0] + row[0] * 0.5);
          return ScanStep{{next}, {sum(next, {1})}};
        },
        {h}, {x});
    return r;
  };
  absl::StatusOr<std::vector<Array>> out = jit([&](const std::vector<Value>& in) {
    const ScanResult r = recurrence(in[0], in[1]);
    const Value dh = grad([&](const std::vector<Value>& p) {
      return std::vector<Value>{sum(recurrence(p[0], in[1]).carry[0])};
    })({in[0]})[0];
    const Value looped =
        fori_loop(0, 3, [](const Value&, const std::vector<Value>& c) { return std::vector<Value>{c[0] * 0.5 + 1.0}; },
                  {in[2]})[0];
    const Value doubled =
        while_loop([](const std::vector<Value>& c) { return sum(c[0]) < full({}, 1000.0); },
                   [](const std::vector<Value>& c) { return std::vector<Value>{c[0] * 2.0}; }, {abs(in[2]) + 1.0})[0];
    const Value chosen = cond(
        sum(in[2]) > full({}, 0.0), [](const std::vector<Value>& a) { return std::vector<Value>{a[0] * 2.0}; },
        [](const std::vector<Value>& a) { return std::vector<Value>{a[0] - 1.0}; }, {in[2]})[0];
    const Value remat =
        checkpoint([](const std::vector<Value>& a) { return std::vector<Value>{tanh(a[0])}; })({in[2]})[0];
    std::vector<Value> results = {r.carry[0], r.ys[0], dh, looped, doubled, chosen, remat};
    for (const Value& v : results) types.push_back(type_of(v).to_string());
    return results;
  })({put_on(mesh, h0, P("X", None)), put_on(mesh, xs, P(None, "X", None)), put_on(mesh, w, P("X", "Y"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(types, ::testing::ElementsAre("f32[16@X,8]", "f32[5,16@X]", "f32[16@X,8]", "f32[16@X,8@Y]",
                                            "f32[16@X,8@Y]", "f32[16@X,8@Y]", "f32[16@X,8@Y]"));
  // The host: h_{t+1} = tanh(h_t + x_t / 2), ys_t = the rows' sums of h_{t+1}; d sum(h_5) / d h_0
  // is the product over t of (1 - h_{t+1}^2).
  const float *hv = h0.values<float>().data(), *xv = xs.values<float>().data(), *wv = w.values<float>().data();
  std::vector<double> h(hv, hv + 128), dh(128, 1.0), ys;
  for (int t = 0; t < 5; ++t) {
    for (int i = 0; i < 128; ++i) {
      h[i] = std::tanh(h[i] + 0.5 * xv[t * 128 + i]);
      dh[i] *= 1 - h[i] * h[i];
    }
    for (int r = 0; r < 16; ++r) ys.push_back(std::accumulate(h.begin() + r * 8, h.begin() + r * 8 + 8, 0.0));
  }
  std::vector<double> looped(wv, wv + 128), doubled, chosen, remat;
  double total = 0, doubled_total = 0;
  for (int i = 0; i < 128; ++i) {
    for (int k = 0; k < 3; ++k) looped[i] = looped[i] * 0.5 + 1.0;
    total += wv[i];
    doubled.push_back(std::abs(wv[i]) + 1.0);
    doubled_total += doubled.back();
    remat.push_back(std::tanh(wv[i]));
  }
  while (doubled_total < 1000.0) {
    for (double& v : doubled) v *= 2;
    doubled_total *= 2;
  }
  for (int i = 0; i < 128; ++i) chosen.push_back(total > 0 ? wv[i] * 2.0 : wv[i] - 1.0);
  for (const auto& [i, want] : std::vector<std::pair<int, const std::vector<double>*>>{
           {0, &h}, {1, &ys}, {2, &dh}, {3, &looped}, {4, &doubled}, {5, &chosen}, {6, &remat}}) {
    SCOPED_TRACE(i);
    expect_near(fetch((*out)[i]), *want, 1e-4);
  }
  EXPECT_TRUE((*out)[0].sharding().is_equivalent_to(NamedSharding(mesh, P("X", None)), 2));
  EXPECT_TRUE((*out)[1].sharding().is_equivalent_to(NamedSharding(mesh, P(None, "X")), 2));
  EXPECT_TRUE((*out)[2].sharding().is_equivalent_to(NamedSharding(mesh, P("X", None)), 2));
  EXPECT_TRUE((*out)[4].sharding().is_equivalent_to(NamedSharding(mesh, P("X", "Y")), 2));
}

// shard_map on an Explicit mesh (jax/_src/shard_map.py, JAX >= 0.9), as tests/shard_map_test.py's
// test_shmap_full_manual_context_explicit: in_specs omitted, the argument enters as its type
// P('X', 'Y'); the block is typed varying over both axes, printed as JAX's shard_map notebook
// prints it (docs/notebooks/shard_map.md: `print(jax.typeof(x))  # f32[2,2]{V:(i,j)}`); the
// result is typed and laid out by out_specs; values x * 2 against the host. An in_spec that is
// not the argument's type is refused rather than resharded.
TEST_F(ExplicitJitTest, ShardMapTakesItsArgumentsAsTheirTypesSay) {
  const Mesh mesh = explicit_mesh();
  const HostArray x = random_f32({16, 8}, 41);
  const Array xs = put_on(mesh, x, P("X", "Y"));
  std::string block;
  ShardMapped f = shard_map(
      [&block](const std::vector<Value>& b) {
        block = type_of(b[0]).to_string();
        return std::vector<Value>{b[0] * 2.0};
      },
      mesh, {}, {P("X", "Y")});
  absl::StatusOr<std::vector<Array>> y = f({xs});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(block, "f32[4,4]{V:(X,Y)}");
  EXPECT_EQ(type_of((*y)[0]).to_string(), "f32[16@X,8@Y]");
  std::vector<double> want;
  for (float v : x.values<float>()) want.push_back(2.0 * v);
  expect_near(fetch((*y)[0]), want);
  absl::StatusOr<std::vector<Array>> refused =
      shard_map([](const std::vector<Value>& b) { return std::vector<Value>{b[0] * 2.0}; }, mesh, {P("X", None)},
                {P("X", None)})({xs});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("in_specs passed to shard_map: P('X', None) does not match the specs of the input: P('X', 'Y') "
                        "for arg: f32[16@X,8@Y]"));
}

// Total buffers on the mesh's devices, from their stats.
int64_t buffers_on_devices(const Client& client) {
  int64_t n = 0;
  for (int d = 0; d < 8; ++d) {
    absl::StatusOr<DeviceStats> s = client.device_stats(d);
    EXPECT_TRUE(s.ok()) << s.status();
    n += s.ok() ? s->buffer_count : 0;
  }
  return n;
}

TEST_F(JitTest, DonatedArgumentsAreFreedAndCannotBeUsedAgain) {
  const HostArray p0 = random_f32({16, 8}, 21), g = random_f32({16, 8}, 22);
  JitOptions options;
  options.donate_argnums = {0};
  Jitted sgd = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] - in[1] * 0.5}; }, options);
  Array p = put(p0, P("data", "model"));
  const Array grad = put(g, P("data", None));
  const Array kept_handle = p;  // a copy of the handle is donated too
  // Ten steps, each donating the previous parameters, while a handle to the first ones is
  // kept: only the current parameters and the gradient stay on the devices (deletions are
  // asynchronous: wait, with a deadline, for the count to settle).
  const int64_t before = buffers_on_devices(*client_);  // p0 and grad, and other tests' arrays
  absl::StatusOr<std::vector<Array>> out;
  for (int step = 0; step < 10; ++step) {
    out = sgd({p, grad});
    ASSERT_TRUE(out.ok()) << out.status();
    p = (*out)[0];
  }
  ASSERT_TRUE(p.block_until_ready().ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  int64_t now = buffers_on_devices(*client_);
  while (now != before && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    now = buffers_on_devices(*client_);
  }
  EXPECT_EQ(now, before) << "buffers of donated parameters are still on the devices";
  std::vector<double> want(p0.size());
  for (int64_t i = 0; i < p0.size(); ++i) want[i] = p0.values<float>()[i] - 10 * 0.5 * g.values<float>()[i];
  expect_near(fetch(p), want, 1e-5);

  // The donated array, through any handle: fetch, readiness and another call all say so.
  absl::StatusOr<HostArray> gone = kept_handle.fetch();
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr("the array f32[16,8] was donated to a jitted call"));
  EXPECT_EQ(kept_handle.block_until_ready().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::vector<Array>> again = sgd({kept_handle, grad});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("argument 0 (f32[16,8]) was donated"));
}

// jnp: int32 * 0.5 computes in float32, int32 * 3 + 1 stays int32 (weak scalars), and
// int32 / 4 is true division, in float32.
TEST_F(JitTest, ScalarsMeetIntegerArraysAsInJax) {
  std::vector<int32_t> values(16 * 8);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<int32_t>(i) - 60;
  const Array x = put(HostArray::from_vector<int32_t>({16, 8}, values), P("data", "model"));
  Jitted f = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{in[0] * 0.5, in[0] * 3 + 1, in[0] / 4};
  });
  absl::StatusOr<std::vector<Array>> out = f({x});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].dtype(), DType::kF32);
  EXPECT_EQ((*out)[1].dtype(), DType::kI32);
  EXPECT_EQ((*out)[2].dtype(), DType::kF32);
  const HostArray halves = fetch((*out)[0]), affine = fetch((*out)[1]), quarters = fetch((*out)[2]);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(halves.values<float>()[i], 0.5f * static_cast<float>(values[i])) << i;
    EXPECT_EQ(affine.values<int32_t>()[i], values[i] * 3 + 1) << i;
    EXPECT_EQ(quarters.values<float>()[i], static_cast<float>(values[i]) / 4.0f) << i;
  }
}

TEST_F(JitTest, ADonatedInputsMemoryServesTheOutput) {
  // Devices of 1 MiB, parameters of 640 KiB per device: the step's output fits only in the
  // memory of the parameters it replaces (the worker writes the update over them). No scalar
  // constants: a plan makes each at the block's shape (640 KiB more), which the worker counts
  // in the run's peak before it starts.
  LocalOptions local;
  local.memory_bytes_per_device = 1 << 20;
  absl::StatusOr<Client> client = Client::local(8, local);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({8}, {"data"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray p0 = random_f32({8, 160 << 10}, 24);
  absl::StatusOr<Array> p = client->device_put(p0, NamedSharding(*mesh, P("data", None)));
  ASSERT_TRUE(p.ok()) << p.status();
  auto step = [](const std::vector<Value>& in) { return std::vector<Value>{-tanh(in[0])}; };

  absl::StatusOr<std::vector<Array>> kept = jit(step)({*p});
  ASSERT_TRUE(kept.ok()) << kept.status();
  absl::Status full = (*kept)[0].block_until_ready();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;

  JitOptions options;
  options.donate_argnums = {0};
  absl::StatusOr<std::vector<Array>> donated = jit(step, options)({*p});
  ASSERT_TRUE(donated.ok()) << donated.status();
  std::vector<double> want(p0.size());
  for (int64_t i = 0; i < p0.size(); ++i) want[i] = -std::tanh(double(p0.values<float>()[i]));
  expect_near(fetch((*donated)[0]), want, 1e-6);

  // A donated input still live when an intermediate is made counts in the run's peak (computed
  // per run for a plan with donated inputs; one without has its peak computed once, when
  // loaded): exp(q) * q holds q (the step's output, donated) and exp(q) at once, 1.25 MiB on a
  // 1 MiB device, refused before it runs.
  absl::StatusOr<std::vector<Array>> both = jit(
      [](const std::vector<Value>& in) { return std::vector<Value>{exp(in[0]) * in[0]}; }, options)({(*donated)[0]});
  const absl::Status too_big = both.ok() ? (*both)[0].block_until_ready() : both.status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted) << too_big;
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("needs 1310720 bytes at once")) << too_big;
}

TEST_F(JitTest, DonationWaitsForEarlierReadersAndChecksItsArguments) {
  const HostArray x0 = random_f32({16, 8}, 23);
  Jitted read = jit([](const std::vector<Value>& in) { return std::vector<Value>{exp(in[0])}; });
  JitOptions options;
  options.donate_argnums = {0};
  Jitted consume = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; }, options);
  // Calls reading x issued before the one donating it still see it.
  const Array x = put(x0, P("data", None));
  std::vector<Array> reads;
  for (int i = 0; i < 4; ++i) reads.push_back((*read({x}))[0]);
  absl::StatusOr<std::vector<Array>> doubled = consume({x});
  ASSERT_TRUE(doubled.ok()) << doubled.status();
  std::vector<double> want_exp(x0.size()), want_double(x0.size());
  for (int64_t i = 0; i < x0.size(); ++i) {
    want_exp[i] = std::exp(double(x0.values<float>()[i]));
    want_double[i] = 2.0 * x0.values<float>()[i];
  }
  for (const Array& r : reads) expect_near(fetch(r), want_exp, 1e-5);
  expect_near(fetch((*doubled)[0]), want_double, 1e-6);

  const Array y = put(x0, P());
  absl::StatusOr<std::vector<Array>> bad =
      jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; }, options)({y, y});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("argument 0 is donated and also passed as argument 1"));
  options.donate_argnums = {3};
  bad = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0]}; }, options)({y});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("donate_argnums names argument 3 of a call with 1"));
  EXPECT_TRUE(y.fetch().ok());  // a call refused before it ran takes nothing
}

// Issue 14 item 1: programs that differ only in a constant are different programs, whichever
// Jitted or client compiles them. The coordinator's cache was keyed by a hash of the graph's
// text, where constants printed with 6 digits: jit(x * 0.1234568) ran jit(x * 0.1234567).
// Every result is checked against the same arithmetic on the host, bit for bit.
TEST_F(JitTest, ProgramsDifferingOnlyInAConstantNeverShareAnExecutable) {
  absl::StatusOr<Client> other = Client::connect(client_->coordinator_address());
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<Mesh> other_mesh = other->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(other_mesh.ok()) << other_mesh.status();
  const std::vector<double> xf = {1, -2, 3.5, 1e6, 0.25, -7, 9, 11};
  const std::vector<int64_t> xi = {0, 1, -1, 2, 5, -9, 100, 7};
  struct Case {
    std::string name;
    std::function<Value(const Value&)> f;    // x -> x op constant
    std::function<double(double)> host_f;    // on float64 x
    std::function<int64_t(int64_t)> host_i;  // on int64 x (when the case is integer)
  };
  auto mul = [](double c) {
    return Case{absl::StrCat("x * ", Scalar(c).to_string()), [c](const Value& x) { return x * c; },
                [c](double x) { return x * c; }, nullptr};
  };
  auto add = [](double c) {
    return Case{absl::StrCat("x + ", Scalar(c).to_string()), [c](const Value& x) { return x + c; },
                [c](double x) { return x + c; }, nullptr};
  };
  auto add_int = [](int64_t c) {
    return Case{absl::StrCat("x + ", c), [c](const Value& x) { return x + c; }, nullptr,
                [c](int64_t x) { return x + c; }};
  };
  // Pairs that printed alike: the 7th significant digit, 1e+06, the sign of zero, and int64
  // constants past 2^53 (which a double cannot tell apart).
  const std::vector<std::pair<Case, Case>> pairs = {
      {mul(0.1234567), mul(0.1234568)},
      {add(1000000), add(1000001)},
      {mul(0.0), mul(-0.0)},
      {add_int((int64_t{1} << 53) + 1), add_int(int64_t{1} << 53)},
  };
  auto run = [&](const Client& c, const Mesh& mesh, const Case& k) -> absl::StatusOr<HostArray> {
    const bool integer = k.host_i != nullptr;
    const HostArray host = integer ? HostArray::from_vector<int64_t>({8}, xi) : HostArray::from_vector<double>({8}, xf);
    TESSERA_ASSIGN_OR_RETURN(Array x, c.device_put(host, NamedSharding(mesh, P("data"))));
    Jitted f = jit([&k](const std::vector<Value>& in) { return std::vector<Value>{k.f(in[0])}; });
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> y, f({x}));
    return y[0].fetch();
  };
  auto expect_exact = [&](const HostArray& got, const Case& k) {
    for (size_t i = 0; i < 8; ++i) {
      if (k.host_i) {
        EXPECT_EQ(got.values<int64_t>()[i], k.host_i(xi[i])) << k.name << " element " << i;
      } else {
        const double want = k.host_f(xf[i]), have = got.values<double>()[i];
        EXPECT_EQ(std::memcmp(&want, &have, sizeof want), 0)
            << k.name << " element " << i << ": " << have << " (bits differ from " << want << ")";
      }
    }
  };
  for (const auto& [a, b] : pairs) {
    SCOPED_TRACE(a.name + " then " + b.name);
    // a on this client, b on the other, then b again here through a third Jitted.
    absl::StatusOr<HostArray> ra = run(*client_, *mesh_, a);
    ASSERT_TRUE(ra.ok()) << ra.status();
    expect_exact(*ra, a);
    absl::StatusOr<HostArray> rb = run(*other, *other_mesh, b);
    ASSERT_TRUE(rb.ok()) << rb.status();
    expect_exact(*rb, b);
    absl::StatusOr<HostArray> rb2 = run(*client_, *mesh_, b);
    ASSERT_TRUE(rb2.ok()) << rb2.status();
    expect_exact(*rb2, b);
  }
  // The loop of the report: x + (i + 0.5) for i from 100000, each call its own program.
  for (int i = 100000; i < 100020; ++i) {
    const Case k = add(i + 0.5);
    absl::StatusOr<HostArray> r = run(i % 2 ? *other : *client_, i % 2 ? *other_mesh : *mesh_, k);
    ASSERT_TRUE(r.ok()) << r.status();
    expect_exact(*r, k);
  }
}

// The passes on the cluster: gradients all-reduced as one combined message come back equal to
// the host's, and a program whose duplicated and dead parts were removed still computes
// everything it returns.
TEST_F(JitTest, CombinedAndDeduplicatedProgramsMatchTheHost) {
  const HostArray w = random_f32({8, 4}, 11), v = random_f32({8, 4}, 12), x = random_f32({16, 8}, 13);
  // d/dw sum(x @ w) = x^T 1 and d/dv sum((x @ v) * 2) = 2 x^T 1: two all_reduces over 'data'.
  Jitted f = jit(grad(
      [](const std::vector<Value>& in) {
        Value unused = exp(in[2]);  // dead
        (void)unused;
        return std::vector<Value>{sum(matmul(in[2], in[0])) + sum(matmul(in[2], in[1]) * 2.0)};
      },
      {0, 1}));
  absl::StatusOr<std::vector<Array>> g = f({put(w, P()), put(v, P()), put(x, P("data", None))});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(f.as_text(), HasSubstr("combined 2 all_reduces"));
  EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("exp(")));
  std::vector<double> col(8 * 4, 0.0);
  for (int i = 0; i < 8; ++i) {
    double s = 0;
    for (int r = 0; r < 16; ++r) s += x.values<float>()[r * 8 + i];
    for (int j = 0; j < 4; ++j) col[i * 4 + j] = s;
  }
  expect_near(fetch((*g)[0]), col);
  for (double& c : col) c *= 2;
  expect_near(fetch((*g)[1]), col);
}

// A norm's scale under FSDP with tensor parallelism (the transformer's layer norms under
// fsdp_tp): w gathered for use scales x (batch over 'data') before a matmul whose weight splits
// columns over 'model', so w's gradient is a sum over both axes, laid out as w: against the
// host for w stored over 'data', 'model' and both in each order (the reduce-scatter creator
// rewrites some of these plans; PartitionTest has the rewrite itself, and transformer_test's
// fsdp_tp runs compare the whole step with the one-device run and central differences).
// d/dw_j sum(tanh((x * w) @ v)) = sum_b x[b, j] sum_k v[j, k] (1 - tanh^2(y[b, k])).
TEST_F(JitTest, AGradientPendingOverBothAxesAndStoredOverOneMatchesTheHost) {
  const HostArray x = random_f32({16, 8}, 14), w = random_f32({8}, 15), v = random_f32({8, 4}, 16);
  const auto X = x.values<float>(), W = w.values<float>(), V = v.values<float>();
  std::vector<double> want(8, 0.0);
  for (int64_t b = 0; b < 16; ++b) {
    for (int64_t k = 0; k < 4; ++k) {
      double y = 0;
      for (int64_t j = 0; j < 8; ++j) y += double(X[b * 8 + j]) * W[j] * V[j * 4 + k];
      const double t = std::tanh(y);
      for (int64_t j = 0; j < 8; ++j) want[j] += double(X[b * 8 + j]) * V[j * 4 + k] * (1 - t * t);
    }
  }
  Jitted f = jit(grad(
      [](const std::vector<Value>& in) {
        const Value scaled = in[0] * with_sharding_constraint(in[1], NamedSharding(*mesh_, P()));
        return std::vector<Value>{sum(tanh(matmul(scaled, in[2])))};
      },
      {1}));
  for (const PartitionSpec& stored : {P("data"), P("model"), P(Axes{"model", "data"}), P(Axes{"data", "model"})}) {
    SCOPED_TRACE(stored.to_string());
    absl::StatusOr<std::vector<Array>> g = f({put(x, P("data", None)), put(w, stored), put(v, P(None, "model"))});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ((*g)[0].sharding().spec(), stored);
    expect_near(fetch((*g)[0]), want);
    if (stored == P("data")) {
      EXPECT_THAT(f.as_text(), HasSubstr("= reduce_scatter(sum, dim=0, axes=('data',))")) << f.as_text();
      EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("local_slice"))) << f.as_text();
    }
  }
}

// FSDP gradients of three weights, each gathered for use and laid out back as stored: the
// combiner sends their reduce_scatters as one (PartitionTest.IndependentReduceScattersAreCombined
// has the plan), w2's scattered on dimension 1 through a transposed layout; against the host,
// and with w2 over 'model' and the batch over both axes (reduce_scatters over 'data' and over
// 'model', then all_reduces of the blocks). With h = tanh(x w1 + b), o = tanh(h w2):
// dL/dw2 = h^T (1 - o^2), dz = ((1 - o^2) w2^T) (1 - h^2), dL/dw1 = x^T dz, dL/db = sum_rows dz.
TEST_F(JitTest, FsdpGradientsReduceScatteredAsOneMatchTheHost) {
  const HostArray x = random_f32({32, 8}, 31), w1 = random_f32({8, 16}, 32), b = random_f32({16}, 33),
                  w2 = random_f32({16, 8}, 34);
  const auto X = x.values<float>(), W1 = w1.values<float>(), B = b.values<float>(), W2 = w2.values<float>();
  std::vector<double> dw1(8 * 16, 0.0), db(16, 0.0), dw2(16 * 8, 0.0);
  for (int r = 0; r < 32; ++r) {
    std::vector<double> h(16), gy(8), dz(16);
    for (int j = 0; j < 16; ++j) {
      double z = B[j];
      for (int i = 0; i < 8; ++i) z += double(X[r * 8 + i]) * W1[i * 16 + j];
      h[j] = std::tanh(z);
    }
    for (int k = 0; k < 8; ++k) {
      double y = 0;
      for (int j = 0; j < 16; ++j) y += h[j] * W2[j * 8 + k];
      const double o = std::tanh(y);
      gy[k] = 1 - o * o;
    }
    for (int j = 0; j < 16; ++j) {
      double dh = 0;
      for (int k = 0; k < 8; ++k) {
        dh += gy[k] * W2[j * 8 + k];
        dw2[j * 8 + k] += h[j] * gy[k];
      }
      dz[j] = dh * (1 - h[j] * h[j]);
      db[j] += dz[j];
      for (int i = 0; i < 8; ++i) dw1[i * 16 + j] += double(X[r * 8 + i]) * dz[j];
    }
  }
  Jitted f = jit(grad(
      [](const std::vector<Value>& in) {
        const NamedSharding whole(*mesh_, P());
        const Value h =
            tanh(matmul(in[0], with_sharding_constraint(in[1], whole)) + with_sharding_constraint(in[2], whole));
        return std::vector<Value>{sum(tanh(matmul(h, with_sharding_constraint(in[3], whole))))};
      },
      {1, 2, 3}));
  // The weights' gathers are combined too (w2's gathered on dimension 1: laid back out by a
  // transpose), so these gradients also check the gathered weights the forward pass used.
  struct Case {
    PartitionSpec x, w2;
    const char* combined;
    const char* gathers;
  };
  for (const Case& c : {Case{P("data", None), P(None, "data"), "combined 3 reduce_scatters", "combined 3 all_gathers"},
                        Case{P(Axes{"data", "model"}, None), P(None, "model"), "combined 2 reduce_scatters",
                             "combined 2 all_gathers"}}) {
    SCOPED_TRACE(c.x.to_string() + " " + c.w2.to_string());
    absl::StatusOr<std::vector<Array>> g = f({put(x, c.x), put(w1, P("data", None)), put(b, P("data")), put(w2, c.w2)});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_THAT(f.as_text(), HasSubstr(c.combined)) << f.as_text();
    EXPECT_THAT(f.as_text(), HasSubstr(c.gathers)) << f.as_text();
    EXPECT_EQ((*g)[0].sharding().spec(), P("data", None));
    EXPECT_EQ((*g)[1].sharding().spec(), P("data"));
    EXPECT_EQ((*g)[2].sharding().spec(), c.w2);
    expect_near(fetch((*g)[0]), dw1);
    expect_near(fetch((*g)[1]), db);
    expect_near(fetch((*g)[2]), dw2);
  }
}

// The ambient mesh (jax.set_mesh, jax.sharding.get_mesh / get_abstract_mesh; JAX's "Explicit sharding"
// guide uses `with jax.set_mesh(mesh):` so that device_put, with_sharding_constraint and
// shard_map take bare P's): scopes nest and end, bare specs resolve against the innermost, a
// jitted function traced under one mesh is traced again under another, and without a mesh a
// bare spec is an error that says how to give one.
TEST_F(JitTest, TheAmbientMeshResolvesBareSpecs) {
  EXPECT_FALSE(get_mesh().has_value());
  EXPECT_TRUE(get_abstract_mesh().empty());
  absl::StatusOr<Mesh> other = client_->make_mesh({8}, {"data"});
  ASSERT_TRUE(other.ok()) << other.status();
  const HostArray x = random_f32({16, 8}, 21);
  std::vector<double> want(x.size());
  for (int64_t i = 0; i < x.size(); ++i) want[i] = x.values<float>()[i] * 2.0;
  Jitted f = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{with_sharding_constraint(in[0] * 2.0, P("data", None))};
  });
  {
    MeshScope scope = set_mesh(*mesh_);
    ASSERT_TRUE(get_mesh().has_value());
    EXPECT_EQ(*get_mesh(), *mesh_);
    EXPECT_EQ(get_abstract_mesh(), mesh_->abstract_mesh());
    absl::StatusOr<Array> a = client_->device_put(x, P(None, "model"));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->sharding(), NamedSharding(*mesh_, P(None, "model")));
    absl::StatusOr<std::vector<Array>> y = f({*a});
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ((*y)[0].sharding(), NamedSharding(*mesh_, P("data", None)));
    expect_near(fetch((*y)[0]), want);
    const int64_t first = f.compilations();  // the coordinator's count at this compilation
    {
      MeshScope inner = set_mesh(*other);
      EXPECT_EQ(*get_mesh(), *other);
      absl::StatusOr<Array> b = client_->device_put(x, P("data"));
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_EQ(b->sharding(), NamedSharding(*other, P("data")));
      // The same function under another ambient mesh is traced again, onto that mesh.
      absl::StatusOr<std::vector<Array>> z = f({*b});
      ASSERT_TRUE(z.ok()) << z.status();
      EXPECT_EQ((*z)[0].sharding(), NamedSharding(*other, P("data", None)));
      expect_near(fetch((*z)[0]), want);
      EXPECT_GT(f.compilations(), first);
      // shard_map without a mesh takes the ambient one: each of the 8 blocks sums its 2 rows.
      absl::StatusOr<ShardMapped> g =
          shard_map([](const std::vector<Value>& in) { return std::vector<Value>{psum(sum(in[0]), "data")}; },
                    {P("data")}, {P()});
      ASSERT_TRUE(g.ok()) << g.status();
      absl::StatusOr<std::vector<Array>> s = (*g)({*b});
      ASSERT_TRUE(s.ok()) << s.status();
      double total = 0;
      for (float v : x.values<float>()) total += v;
      expect_near(fetch((*s)[0]), {total}, 1e-4);
    }
    EXPECT_EQ(*get_mesh(), *mesh_);  // the inner scope ended
    // Under the outer mesh again the call hits the first compilation: nothing is compiled.
    const int64_t second = f.compilations();
    ASSERT_TRUE(f({*a}).ok());
    EXPECT_EQ(f.compilations(), second);
  }
  EXPECT_FALSE(get_mesh().has_value());
  absl::StatusOr<Array> none = client_->device_put(x, P("data"));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("device_put: the bare PartitionSpec "));
  EXPECT_THAT(none.status().message(), HasSubstr("needs a mesh"));
  absl::StatusOr<std::vector<Array>> traced = f({put(x, P())});
  EXPECT_EQ(traced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(traced.status().message(), HasSubstr("with_sharding_constraint: the bare PartitionSpec"));
  EXPECT_THAT(traced.status().message(), HasSubstr("set_mesh(mesh)"));
  absl::StatusOr<ShardMapped> g = shard_map([](const std::vector<Value>& in) { return in; }, {P("data")}, {P("data")});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(g.status().message(), HasSubstr("no ambient mesh"));
}

// JAX refuses a committed argument on other devices than the context mesh's: under jax.set_mesh
// the context mesh is the concrete mesh (pjit.py's get_ctx_mesh), and
// jax/_src/interpreters/pxla.py's _get_and_check_device_assignment compares each sharding's
// devices, in order, with `ctx_mesh._flat_devices_tuple`, which jit reports as "Received
// incompatible devices for jitted computation" (stages.py). tests/pjit_test.py asserts it for an
// argument on a (2, 2) mesh under a (4, 2) context (test_array_device_assignment_mismatch_with_mesh)
// and for an uncommitted argument beside a committed one on (4, 2) under a (2, 2) context
// (test_pjit_uncommitted_array_and_committed_array, its last block), both with the legacy `with
// mesh:` context, which pjit reads the same way. The same devices in the same order under another
// shape pass (the same flat tuple); in another order they do not. A function naming a mesh on
// other devices (a shard_map's) is checked too (dispatch.py's get_intermediate_shardings).
TEST_F(JitTest, ACommittedArgumentOffTheContextMeshIsRefused) {
  const HostArray x = random_f32({8, 2}, 22);
  std::vector<double> want;
  for (float v : x.values<float>()) want.push_back(2.0 * v);
  const Mesh low = *make_mesh({2, 2}, {"x", "y"}, {0, 1, 2, 3});
  const Mesh reversed = *make_mesh({4, 2}, {"data", "model"}, {7, 6, 5, 4, 3, 2, 1, 0});
  const Mesh flat = *make_mesh({8}, {"i"}, {0, 1, 2, 3, 4, 5, 6, 7});
  const std::string all = "device_ids=[0, 1, 2, 3, 4, 5, 6, 7]";
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  Jitted g = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1] * 0.0 + in[0]}; });
  const Array on_low = put_on(low, x, P("x", "y"));
  {
    MeshScope scope = set_mesh(*mesh_);
    absl::StatusOr<std::vector<Array>> y = f({on_low});
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(y.status().message(),
              absl::StrCat("jit: incompatible devices: argument 0 (f32[8,2]) is committed to Mesh('x': 2, 'y': 2, "
                           "axis_types=(Explicit, Explicit), device_ids=[0, 1, 2, 3]) but the context mesh (set_mesh) "
                           "is Mesh('data': 4, 'model': 2, axis_types=(Explicit, Explicit), ",
                           all,
                           "); a committed argument must be on the context mesh's devices, in its order (JAX: "
                           "\"Received incompatible devices for jitted computation\"): device_put it onto the context "
                           "mesh, or call outside the set_mesh scope"));
    // The same devices in another order.
    y = f({put_on(reversed, x, P())});
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(y.status().message(), HasSubstr("device_ids=[7, 6, 5, 4, 3, 2, 1, 0]) but the context mesh"));
    EXPECT_THAT(y.status().message(), HasSubstr(all));
    // The same devices in the same order, another shape: JAX's check passes, and so does ours.
    y = f({put_on(flat, x, P("i"))});
    ASSERT_TRUE(y.ok()) << y.status();
    expect_near(fetch((*y)[0]), want);
    EXPECT_EQ((*y)[0].sharding().mesh(), flat);
  }
  {
    // An uncommitted argument beside a committed one on (4, 2) under a (2, 2) context: the
    // committed one is named, as argument 1.
    MeshScope scope = set_mesh(low);
    absl::StatusOr<Array> u = client_->array(x);
    ASSERT_TRUE(u.ok()) << u.status();
    absl::StatusOr<std::vector<Array>> y = g({*u, put(x, P("data", None))});
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(y.status().message(),
                HasSubstr("argument 1 (f32[8,2]) is committed to Mesh('data': 4, 'model': 2, axis_types=(Explicit, "
                          "Explicit), device_ids=[0, 1, 2, 3, 4, 5, 6, 7]) but the context mesh (set_mesh) is "
                          "Mesh('x': 2, 'y': 2, axis_types=(Explicit, Explicit), device_ids=[0, 1, 2, 3])"));
    EXPECT_FALSE(u->committed());  // nothing was moved
    // On the context mesh it runs, the uncommitted argument moved there.
    y = g({*u, on_low});
    ASSERT_TRUE(y.ok()) << y.status();
    expect_near(fetch((*y)[0]), want);
    EXPECT_EQ((*y)[0].sharding().mesh(), low);
    // A function whose shard_map names a mesh on other devices than the context mesh's.
    ShardMapped body = shard_map([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; }, *mesh_,
                                 {P("data")}, {P("data")});
    y = jit([body](const std::vector<Value>& in) { return body(in); })({*u});
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(y.status().message(),
                HasSubstr("jit: incompatible devices: the function names Mesh('data': 4, 'model': 2, "
                          "axis_types=(Explicit, Explicit), device_ids=[0, 1, 2, 3, 4, 5, 6, 7]) (a shard_map's or a "
                          "with_sharding_constraint's) but the context mesh (set_mesh) is Mesh('x': 2, 'y': 2, "
                          "axis_types=(Explicit, Explicit), device_ids=[0, 1, 2, 3])"));
  }
  // Without a context mesh the argument runs where it is.
  absl::StatusOr<std::vector<Array>> y = f({on_low});
  ASSERT_TRUE(y.ok()) << y.status();
  expect_near(fetch((*y)[0]), want);
  EXPECT_EQ((*y)[0].sharding().mesh(), low);
}

}  // namespace
}  // namespace tessera
