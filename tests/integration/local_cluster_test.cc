// Integration tests of device_put, fetch, shards and deletion on an embedded 8-device cluster
// (Client::local: a real coordinator and real workers over gRPC's in-process transport), including host
// data in and out through views, device_get and xtensor containers.
#include <cstring>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tessera/xtensor.h"
#include "tests/integration/jit_support.h"
#include "xtensor/xview.hpp"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A host array of `dtype` with varied values (not just arange), from a fixed seed.
HostArray random_array(DType dtype, const Shape& shape, uint32_t seed) {
  HostArray a = HostArray::zeros(dtype, shape);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-1000, 1000);
  for (int64_t i = 0; i < a.size(); ++i) {
    const int v = dist(rng);
    switch (dtype) {
      case DType::kF32:
        a.mutable_values<float>()[i] = static_cast<float>(v) / 7.0f;
        break;
      case DType::kF64:
        a.mutable_values<double>()[i] = static_cast<double>(v) / 7.0;
        break;
      case DType::kI32:
        a.mutable_values<int32_t>()[i] = v * 1000003;
        break;
      case DType::kI64:
        a.mutable_values<int64_t>()[i] = int64_t{v} * (int64_t{1} << 40);
        break;
      case DType::kBool:
        a.mutable_values<bool>()[i] = v % 2 == 0;
        break;
      case DType::kU32:
        a.mutable_values<uint32_t>()[i] = static_cast<uint32_t>(v) * 2654435761u;  // high bits set too
        break;
      case DType::kBF16:
        a.mutable_values<BFloat16>()[i] = BFloat16(static_cast<float>(v) / 7.0f);
        break;
      case DType::kF16:
        a.mutable_values<Float16>()[i] = Float16(static_cast<float>(v) / 7.0f);
        break;
      case DType::kU8:
        a.mutable_values<uint8_t>()[i] = static_cast<uint8_t>(v);
        break;
      case DType::kI8:
        a.mutable_values<int8_t>()[i] = static_cast<int8_t>(v);
        break;
      case DType::kI16:
        a.mutable_values<int16_t>()[i] = static_cast<int16_t>(v * 31);
        break;
    }
  }
  return a;
}

// Reference block of a 2-D array, element by element (independent of core/slicing).
HostArray reference_block_2d(const HostArray& global, const Index& index) {
  const int64_t esize = dtype_size(global.dtype());
  HostArray out(global.dtype(), {index[0].stop - index[0].start, index[1].stop - index[1].start});
  int64_t k = 0;
  for (int64_t r = index[0].start; r < index[0].stop; ++r) {
    for (int64_t c = index[1].start; c < index[1].stop; ++c, ++k) {
      std::memcpy(out.data() + k * esize, global.data() + (r * global.shape()[1] + c) * esize,
                  static_cast<size_t>(esize));
    }
  }
  return out;
}

std::vector<PartitionSpec> all_layouts() {
  return {P("data", None),          P(None, "model"),         P("data", "model"),
          P(Axes{"data", "model"}), P(Axes{"model", "data"}), P()};
}

class LocalClusterTest : public jit_support::LocalJitSuite {
 protected:
  int64_t total_buffers() {
    int64_t n = 0;
    for (int d = 0; d < 8; ++d) {
      absl::StatusOr<DeviceStats> stats = client_->device_stats(d);
      EXPECT_TRUE(stats.ok()) << stats.status();
      if (stats.ok()) n += stats->buffer_count;
    }
    return n;
  }
};

TEST_F(LocalClusterTest, DevicesAreNumberedAndAlive) {
  absl::StatusOr<std::vector<Device>> devices = client_->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  ASSERT_EQ(devices->size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ((*devices)[i].id, i);
    EXPECT_TRUE((*devices)[i].alive);
    EXPECT_THAT((*devices)[i].address, HasSubstr("in-process:"));  // proto/in_process.h
  }
  EXPECT_EQ(mesh_->device_ids(), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST_F(LocalClusterTest, RoundTripOfEveryDtypeAndLayout) {
  uint32_t seed = 1;
  for (DType dtype : kAllDTypes) {
    for (const Shape& shape : {Shape{16, 8}, Shape{8, 2}}) {
      for (const PartitionSpec& spec : all_layouts()) {
        SCOPED_TRACE(dtype_name(dtype) + " " + shape_to_string(shape) + " " + spec.to_string());
        const HostArray host = random_array(dtype, shape, seed++);
        absl::StatusOr<Array> array = client_->device_put(host, NamedSharding(*mesh_, spec));
        ASSERT_TRUE(array.ok()) << array.status();
        EXPECT_EQ(array->shape(), shape);
        EXPECT_EQ(array->dtype(), dtype);
        EXPECT_EQ(array->sharding().spec(), spec);
        absl::StatusOr<HostArray> back = array->fetch();
        ASSERT_TRUE(back.ok()) << back.status();
        EXPECT_TRUE(*back == host);
      }
    }
  }
}

TEST_F(LocalClusterTest, EachDeviceHoldsExactlyItsShard) {
  const HostArray host = random_array(DType::kF32, {16, 8}, 42);
  for (const PartitionSpec& spec : all_layouts()) {
    SCOPED_TRACE(spec.to_string());
    NamedSharding sharding(*mesh_, spec);
    absl::StatusOr<Array> array = client_->device_put(host, sharding);
    ASSERT_TRUE(array.ok()) << array.status();
    std::vector<Shard> shards = array->addressable_shards();
    ASSERT_EQ(shards.size(), 8u);
    for (const Shard& shard : shards) {
      EXPECT_EQ(shard.shape(), sharding.shard_shape(host.shape()));
      absl::StatusOr<HostArray> data = shard.data();
      ASSERT_TRUE(data.ok()) << data.status();
      EXPECT_TRUE(*data == reference_block_2d(host, shard.index())) << "device " << shard.device_id();
    }
  }
}

TEST_F(LocalClusterTest, SeedLayoutShardsMatchJax) {
  // jax: device_put(ones((16, 8)), NamedSharding(mesh, P('data', 'model'))) on a (4, 2) mesh:
  // 8 shards of shape (4, 4); device 5 holds rows 8:12, columns 4:8.
  absl::StatusOr<Array> y =
      client_->device_put(HostArray::ones(DType::kF32, {16, 8}), NamedSharding(*mesh_, P("data", "model")));
  ASSERT_TRUE(y.ok()) << y.status();
  std::vector<Shard> shards = y->addressable_shards();
  ASSERT_EQ(shards.size(), 8u);
  EXPECT_EQ(shards[0].shape(), (Shape{4, 4}));
  EXPECT_EQ(shards[5].device_id(), 5);
  EXPECT_EQ(shards[5].index(), (Index{{8, 12}, {4, 8}}));
  EXPECT_EQ(y->sharding().spec().to_string(), "P('data', 'model')");
}

TEST_F(LocalClusterTest, Array256MiBRoundTrips) {
  const Shape shape = {8192, 8192};  // float32: 256 MiB
  HostArray host(DType::kF32, shape);
  auto values = host.mutable_values<float>();
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 1000003);
  for (const PartitionSpec& spec : {P("data", "model"), P(Axes{"data", "model"})}) {
    SCOPED_TRACE(spec.to_string());
    absl::StatusOr<Array> array = client_->device_put(host, NamedSharding(*mesh_, spec));
    ASSERT_TRUE(array.ok()) << array.status();
    absl::StatusOr<HostArray> back = array->fetch();
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == host);
  }
}

TEST_F(LocalClusterTest, InvalidShardingsAreRejectedBeforeAnythingIsAllocated) {
  const int64_t before = total_buffers();
  struct Case {
    Shape shape;
    PartitionSpec spec;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {{16, 8}, P("batch", None), {"axis 'batch'", "not in the mesh"}},
      {{16, 8}, P("data", "data"), {"'data'", "more than once"}},
      {{16, 8}, P(Axes{"data", "model"}, "model"), {"'model'", "more than once"}},
      {{16}, P("data", "model"), {"2 entries", "rank 1"}},
      {{10, 8}, P("data", None), {"dimension 0 of size 10", "mesh axis 'data' of size 4"}},
      {{16, 3}, P(None, "model"), {"dimension 1 of size 3", "mesh axis 'model' of size 2"}},
      {{12, 8}, P(Axes{"data", "model"}), {"dimension 0 of size 12", "('data', 'model') of total size 8"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec.to_string() + " on " + shape_to_string(c.shape));
    absl::StatusOr<Array> array =
        client_->device_put(HostArray::zeros(DType::kF32, c.shape), NamedSharding(*mesh_, c.spec));
    ASSERT_FALSE(array.ok());
    EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& part : c.message) EXPECT_THAT(std::string(array.status().message()), HasSubstr(part));
  }
  EXPECT_EQ(total_buffers(), before);
}

TEST_F(LocalClusterTest, BuffersAreReleasedWithTheLastHandle) {
  const int64_t before = total_buffers();
  {
    absl::StatusOr<Array> a =
        client_->device_put(HostArray::ones(DType::kF64, {16, 8}), NamedSharding(*mesh_, P("data", None)));
    ASSERT_TRUE(a.ok()) << a.status();
    Array copy = *a;
    EXPECT_EQ(total_buffers(), before + 8);
    a = absl::UnknownError("drop the first handle");
    EXPECT_EQ(total_buffers(), before + 8);  // `copy` still holds it
    EXPECT_TRUE(copy.fetch().ok());
  }
  EXPECT_EQ(total_buffers(), before);
}

// jax.make_mesh (jax/_src/sharding_impls.py): more devices than the cluster has is an error
// ("Number of devices 8 must be >= the product of mesh_shape"); fewer takes the first ones.
TEST_F(LocalClusterTest, MakeMeshTakesTheFirstDevices) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 4}, {"a", "b"});
  ASSERT_FALSE(mesh.ok());
  EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mesh.status().message()), AllOf(HasSubstr("16 devices"), HasSubstr("8 alive")));
  absl::StatusOr<Mesh> first = client_->make_mesh({2, 2}, {"a", "b"});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->device_ids(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(first->to_string(), "Mesh('a': 2, 'b': 2, axis_types=(Explicit, Explicit))");
  absl::StatusOr<Array> on_first =
      client_->device_put(HostArray::arange(DType::kF32, {4, 2}), NamedSharding(*first, P("a", "b")));
  ASSERT_TRUE(on_first.ok()) << on_first.status();
  EXPECT_EQ(on_first->addressable_shards().size(), 4u);
  EXPECT_EQ(on_first->addressable_shards()[3].device_id(), 3);
  absl::StatusOr<Mesh> subset = client_->make_mesh({2}, {"x"}, {6, 3});
  ASSERT_TRUE(subset.ok()) << subset.status();
  const HostArray host = HostArray::arange(DType::kI32, {6});
  absl::StatusOr<Array> a = client_->device_put(host, NamedSharding(*subset, P("x")));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->addressable_shards()[0].device_id(), 6);
  EXPECT_TRUE(*a->fetch() == host);
}

TEST_F(LocalClusterTest, UnknownDeviceInMeshIsNotFound) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({2}, {"x"}, {0, 42});
  ASSERT_TRUE(mesh.ok());
  absl::StatusOr<Array> a = client_->device_put(HostArray::zeros(DType::kF32, {4}), NamedSharding(*mesh, P("x")));
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("device 42"));
}

// The picture of a placed array is its sharding's (metadata only). Expected: derived from
// jax/_src/debugging.py's visualize_sharding for a (16, 8) array on (4, 2) (JAX shows no such
// picture; tests/client/visualize_test.cc checks the algorithm against JAX's own pictures).
TEST_F(LocalClusterTest, VisualizeMatchesJaxPictures) {
  absl::StatusOr<Array> x =
      client_->device_put(HostArray::arange(DType::kF32, {16, 8}), NamedSharding(*mesh_, P("data", "model")));
  ASSERT_TRUE(x.ok()) << x.status();
  absl::StatusOr<std::string> grid = visualize_array_sharding(*x);
  ASSERT_TRUE(grid.ok()) << grid.status();
  EXPECT_EQ(*grid,
            "┌───────┬───────┐\n"
            "│ CPU 0 │ CPU 1 │\n"
            "├───────┼───────┤\n"
            "│ CPU 2 │ CPU 3 │\n"
            "├───────┼───────┤\n"
            "│ CPU 4 │ CPU 5 │\n"
            "├───────┼───────┤\n"
            "│ CPU 6 │ CPU 7 │\n"
            "└───────┴───────┘\n");
  absl::StatusOr<std::string> vector = visualize_sharding({8}, NamedSharding(*mesh_, P("model")));
  ASSERT_TRUE(vector.ok());
  EXPECT_EQ(*vector,
            "┌───────────┬───────────┐\n"
            "│CPU 0,2,4,6│CPU 1,3,5,7│\n"
            "└───────────┴───────────┘\n");
}

TEST(LocalClusterMemory, OutOfMemoryIsResourceExhaustedAndLosesNothing) {
  LocalOptions options;
  options.memory_bytes_per_device = 1 << 20;
  absl::StatusOr<Client> client = Client::local(2, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({2}, {"x"});
  ASSERT_TRUE(mesh.ok());
  const HostArray first = HostArray::arange(DType::kF32, {128, 1024});  // 512 KiB, replicated
  absl::StatusOr<Array> a = client->device_put(first, NamedSharding(*mesh, P()));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<Array> b = client->device_put(HostArray::ones(DType::kF32, {192, 1024}), NamedSharding(*mesh, P()));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(b.status().message()), AllOf(HasSubstr("786432 bytes"), HasSubstr("524288")));
  absl::StatusOr<HostArray> back = a->fetch();
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == first);
  for (int d = 0; d < 2; ++d) {
    absl::StatusOr<DeviceStats> stats = client->device_stats(d);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->buffer_count, 1);
    EXPECT_EQ(stats->bytes_used, first.nbytes());
    EXPECT_EQ(stats->memory_limit_bytes, 1 << 20);
  }
}

TEST(LocalClusterStartup, RejectsBadDeviceCounts) {
  absl::StatusOr<Client> client = Client::local(0);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
}

// Every layout, including those whose blocks are not contiguous in the host array (split
// columns): device_put reads the caller's vector and fetch_into writes another in place.
TEST_F(LocalClusterTest, ViewsOfTheCallersMemoryGoInAndOut) {
  for (const PartitionSpec& spec : all_layouts()) {
    SCOPED_TRACE(spec.to_string());
    std::vector<int64_t> mine(16 * 8);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<int64_t>(i * i) - 500;
    absl::StatusOr<Array> array =
        client_->device_put(HostView{DType::kI64, {16, 8}, mine.data()}, NamedSharding(*mesh_, spec));
    ASSERT_TRUE(array.ok()) << array.status();
    std::vector<int64_t> back(mine.size(), 7);
    ASSERT_TRUE(array->fetch_into(MutableHostView{DType::kI64, {16, 8}, back.data()}).ok());
    EXPECT_EQ(back, mine);
  }
}

// Foreign bool memory may hold bytes other than 0 and 1: they arrive as true.
TEST_F(LocalClusterTest, BoolViewsArriveAsZerosAndOnes) {
  std::vector<uint8_t> bytes(16 * 8);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i % 3 == 0 ? 0 : i);
  absl::StatusOr<Array> array =
      client_->device_put(HostView{DType::kBool, {16, 8}, bytes.data()}, NamedSharding(*mesh_, P(None, "model")));
  ASSERT_TRUE(array.ok()) << array.status();
  absl::StatusOr<HostArray> back = array->fetch();
  ASSERT_TRUE(back.ok()) << back.status();
  for (size_t i = 0; i < bytes.size(); ++i) {
    EXPECT_EQ(static_cast<int>(std::to_integer<uint8_t>(back->data()[i])), bytes[i] != 0 ? 1 : 0) << i;
  }
}

TEST_F(LocalClusterTest, BadViewsAreRefusedNamingTheMismatch) {
  std::vector<float> mine(16 * 8, 1.0f);
  const NamedSharding sharding(*mesh_, P("data", None));
  absl::StatusOr<Array> null = client_->device_put(HostView{DType::kF32, {16, 8}, nullptr}, sharding);
  EXPECT_EQ(null.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(null.status().message()), HasSubstr("device_put: the view of float32 (16, 8) has no data"));
  absl::StatusOr<Array> negative = client_->device_put(HostView{DType::kF32, {16, -8}, mine.data()}, sharding);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<Array> array = client_->device_put(HostView{DType::kF32, {16, 8}, mine.data()}, sharding);
  ASSERT_TRUE(array.ok()) << array.status();
  std::vector<double> wrong(16 * 8);
  absl::Status status = array->fetch_into(MutableHostView{DType::kF64, {16, 8}, wrong.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("fetch_into: the destination is float64 (16, 8) but the array is float32 (16, 8)"));
  status = array->fetch_into(MutableHostView{DType::kF32, {8, 16}, mine.data()});
  EXPECT_THAT(std::string(status.message()), HasSubstr("the destination is float32 (8, 16)"));
  EXPECT_EQ(mine, std::vector<float>(16 * 8, 1.0f)) << "a refused fetch_into wrote its destination";
}

TEST_F(LocalClusterTest, DeviceGetFetchesSeveralArraysInOrder) {
  std::vector<HostArray> hosts;
  std::vector<Array> arrays;
  uint32_t seed = 40;
  for (DType dtype : kAllDTypes) {
    for (const PartitionSpec& spec : {P("data", None), P(None, "model"), P()}) {
      hosts.push_back(random_array(dtype, {8, 4}, seed++));
      absl::StatusOr<Array> a = client_->device_put(hosts.back(), NamedSharding(*mesh_, spec));
      ASSERT_TRUE(a.ok()) << a.status();
      arrays.push_back(*a);
    }
  }
  absl::StatusOr<std::vector<HostArray>> got = device_get(arrays);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), hosts.size());
  for (size_t i = 0; i < hosts.size(); ++i) EXPECT_TRUE((*got)[i] == hosts[i]) << "array " << i;

  // An array whose data is gone fails the whole call, naming its position.
  JitOptions donate;
  donate.donate_argnums = {0};
  absl::StatusOr<std::vector<Array>> out =
      jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; }, donate)({arrays[1]});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<std::vector<HostArray>> failed = device_get({arrays[0], arrays[1], (*out)[0]});
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("device_get: array 1: "));
}

TEST_F(LocalClusterTest, XtensorContainersAndExpressions) {
  xt::xarray<float> x = xt::zeros<float>({16, 8});
  for (size_t r = 0; r < 16; ++r) {
    for (size_t c = 0; c < 8; ++c) x(r, c) = static_cast<float>(r) * 10.0f + static_cast<float>(c);
  }
  // A dense container is read in place; a transposed or strided view is not dense row-major
  // and is evaluated first. Either way the cluster holds the expression's values.
  EXPECT_TRUE(is_dense_row_major(x));
  auto transposed = xt::transpose(x);
  auto every_other_column = xt::view(x, xt::all(), xt::range(0, 8, 2));
  EXPECT_FALSE(is_dense_row_major(transposed));
  EXPECT_FALSE(is_dense_row_major(every_other_column));
  const NamedSharding sharding(*mesh_, P("data", "model"));
  for (auto [name, result] : {std::pair{"container", device_put(*client_, x, sharding)},
                              std::pair{"transpose", device_put(*client_, transposed, sharding)},
                              std::pair{"strided view", device_put(*client_, every_other_column, sharding)},
                              std::pair{"expression", device_put(*client_, x * 2.0f + 1.0f, sharding)}}) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(result.ok()) << result.status();
    absl::StatusOr<xt::xarray<float>> back = fetch_xarray<float>(*result);
    ASSERT_TRUE(back.ok()) << back.status();
    const std::string which = name;
    xt::xarray<float> want = which == "container"    ? xt::xarray<float>(x)
                             : which == "transpose"  ? xt::xarray<float>(transposed)
                             : which == "expression" ? xt::xarray<float>(x * 2.0f + 1.0f)
                                                     : xt::xarray<float>(every_other_column);
    EXPECT_EQ(*back, want);
  }
  absl::StatusOr<Array> ints =
      device_put(*client_, xt::xarray<int32_t>{{1, 2}, {3, 4}, {5, 6}, {7, 8}}, NamedSharding(*mesh_, P("data", None)));
  ASSERT_TRUE(ints.ok()) << ints.status();
  absl::StatusOr<xt::xarray<float>> wrong = fetch_xarray<float>(*ints);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("fetch_xarray: the array is int32, not float32"));
  EXPECT_EQ(*fetch_xarray<int32_t>(*ints), (xt::xarray<int32_t>{{1, 2}, {3, 4}, {5, 6}, {7, 8}}));
}

}  // namespace
}  // namespace tessera
