// Asynchronous dispatch (issue #4 items 6 and 10(d)): a jitted call returns its outputs before
// it has run; reading them waits; dependent calls wait for their inputs; failures reach every
// array a failed call would have produced and every call that consumes one; dropped outputs
// and a destroyed client free what they held. Embedded clusters (Client::local) and real
// processes (ProcessCluster, a worker killed by pid). Ordering is asserted through readiness
// (Array::is_ready), never through timing thresholds; every wait has a deadline.
#include <signal.h>

#include <cmath>
#include <optional>
#include <random>
#include <thread>

#include "absl/synchronization/notification.h"
#include "client/execution.h"
#include "coordinator/coordinator_server.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"
#include "tests/integration/process_cluster_fixture.h"
#include "worker/worker_server.h"

namespace tessera {
namespace {

using ::tessera::jit_support::expect_near;
using ::tessera::jit_support::random_f32;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

HostArray identity_f32(int64_t n) {
  HostArray a = HostArray::zeros(DType::kF32, {n, n});
  for (int64_t i = 0; i < n; ++i) a.mutable_values<float>()[i * n + i] = 1.0f;
  return a;
}

// The slow program: `kLayers` times y = tanh(y @ w). With w the identity its result is tanh
// applied kLayers times, cheap on the host; on the devices it is kLayers (128, 512) x (512,
// 512) matmuls per device (about 0.5 GFLOP per layer in all, on a 2-core machine): far longer
// than dispatching the call takes.
constexpr int kLayers = 8;
constexpr int64_t kSlowN = 512;
std::vector<Value> slow_layers(const std::vector<Value>& in) {
  Value y = in[0];
  for (int i = 0; i < kLayers; ++i) y = tanh(matmul(y, in[1]));
  return {y};
}
std::vector<double> slow_reference(const HostArray& x) {
  std::vector<double> out;
  for (float v : x.values<float>()) {
    double y = v;
    for (int i = 0; i < kLayers; ++i) y = std::tanh(static_cast<float>(y));
    out.push_back(y);
  }
  return out;
}

// What each device of `client`'s cluster reports in `field` (device_stats flushes the
// client's deletions first).
std::vector<int64_t> per_device(const Client& client, int devices, int64_t DeviceStats::*field) {
  std::vector<int64_t> out;
  for (int d = 0; d < devices; ++d) {
    absl::StatusOr<DeviceStats> stats = client.device_stats(d);
    EXPECT_TRUE(stats.ok()) << stats.status();
    out.push_back(stats.ok() ? (*stats).*field : -1);
  }
  return out;
}
// Buffers held, and bytes in use, on each device.
std::vector<int64_t> buffer_counts(const Client& client, int devices) {
  return per_device(client, devices, &DeviceStats::buffer_count);
}
std::vector<int64_t> bytes_used(const Client& client, int devices) {
  return per_device(client, devices, &DeviceStats::bytes_used);
}

class AsyncTest : public jit_support::LocalJitSuite {};

TEST_F(AsyncTest, CallReturnsBeforeASlowExecutionFinishes) {
  const HostArray x = random_f32({kSlowN, kSlowN}, 1);
  Array xs = put(x, P("data", None));
  Array w = put(identity_f32(kSlowN), P());
  Jitted slow = jit(slow_layers);
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  ASSERT_TRUE(slow({xs, w}).ok());  // compiles (synchronously) and runs once
  ASSERT_TRUE(twice({xs}).ok());

  absl::StatusOr<std::vector<Array>> y = slow({xs, w});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_FALSE((*y)[0].is_ready()) << "the call waited for its execution";
  // Metadata is there at once.
  EXPECT_EQ((*y)[0].shape(), (Shape{kSlowN, kSlowN}));
  EXPECT_EQ((*y)[0].sharding().spec(), P("data", None));
  // A consumer is dispatched at once too, and runs after its producer.
  absl::StatusOr<std::vector<Array>> z = twice({(*y)[0]});
  ASSERT_TRUE(z.ok()) << z.status();
  ASSERT_TRUE((*z)[0].block_until_ready().ok());
  EXPECT_TRUE((*y)[0].is_ready());
  ASSERT_TRUE(block_until_ready(*y).ok());

  std::vector<double> want = slow_reference(x);
  absl::StatusOr<HostArray> got = (*y)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(*got, want);
  for (double& v : want) v *= 2;
  got = (*z)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(*got, want);
}

TEST_F(AsyncTest, ChainsOfDependentCallsMatchTheHost) {
  const HostArray x = random_f32({16, 8}, 2), w = random_f32({8, 8}, 3), b = random_f32({16, 8}, 4);
  Array wd = put(w, P(None, "model"));
  Array bd = put(b, P("data", None));
  Jitted layer = jit([](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; });
  Jitted axpy = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 0.5 + in[1]}; });
  Jitted sum2 = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; });

  // Two chains of 6 dependent calls each, issued back to back without waiting; the layer's
  // output is P('data', 'model'), so calls after the first also reshard (all_reduce).
  Array a = put(x, P("data", None));
  Array c = put(b, P("data", None));
  std::vector<double> ha(x.values<float>().begin(), x.values<float>().end());
  std::vector<double> hc(b.values<float>().begin(), b.values<float>().end());
  for (int step = 0; step < 6; ++step) {
    absl::StatusOr<std::vector<Array>> next = layer({a, wd});
    ASSERT_TRUE(next.ok()) << next.status();
    a = (*next)[0];
    next = axpy({c, bd});
    ASSERT_TRUE(next.ok()) << next.status();
    c = (*next)[0];
    std::vector<double> t(16 * 8, 0.0);
    for (int64_t i = 0; i < 16; ++i) {
      for (int64_t j = 0; j < 8; ++j) {
        double s = 0;
        for (int64_t l = 0; l < 8; ++l) s += ha[i * 8 + l] * w.values<float>()[l * 8 + j];
        t[i * 8 + j] = std::tanh(s);
      }
    }
    ha = t;
    for (size_t i = 0; i < hc.size(); ++i) hc[i] = hc[i] * 0.5 + b.values<float>()[i];
  }
  // Joins both chains while both may still be running.
  absl::StatusOr<std::vector<Array>> joined = sum2({a, c});
  ASSERT_TRUE(joined.ok()) << joined.status();
  std::vector<double> want(ha.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = ha[i] + hc[i];
  absl::StatusOr<HostArray> got = (*joined)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(*got, want, 1e-4);
  got = a.fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(*got, ha, 1e-4);
  // Each shard of an unfinished output waits too.
  std::vector<Shard> shards = (*joined)[0].addressable_shards();
  ASSERT_EQ(shards.size(), 8u);
  absl::StatusOr<HostArray> block = shards[0].data();
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ(block->shape(), shards[0].shape());
}

TEST_F(AsyncTest, ACallBeyondTheInFlightCapWaitsForOneToFinish) {
  // A client of its own: nothing else of it is in flight.
  absl::StatusOr<Client> own = Client::connect(client_->coordinator_address());
  ASSERT_TRUE(own.ok()) << own.status();
  absl::StatusOr<Array> x = own->device_put(random_f32({kSlowN, kSlowN}, 10), NamedSharding(*mesh_, P("data", None)));
  absl::StatusOr<Array> w = own->device_put(identity_f32(kSlowN), NamedSharding(*mesh_, P()));
  ASSERT_TRUE(x.ok() && w.ok());
  Jitted slow = jit(slow_layers);
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  // 16 calls in flight: a slow one, and 15 waiting on it in a chain.
  absl::StatusOr<std::vector<Array>> head = slow({*x, *w});
  ASSERT_TRUE(head.ok()) << head.status();
  Array last = (*head)[0];
  for (int i = 1; i < 16; ++i) {
    absl::StatusOr<std::vector<Array>> next = twice({last});
    ASSERT_TRUE(next.ok()) << next.status();
    last = (*next)[0];
  }
  EXPECT_FALSE((*head)[0].is_ready());
  // The 17th returns only once one of them (the head, which the others wait for) finished.
  absl::StatusOr<std::vector<Array>> extra = twice({*x});
  ASSERT_TRUE(extra.ok()) << extra.status();
  EXPECT_TRUE((*head)[0].is_ready());
  ASSERT_TRUE(block_until_ready({last, (*extra)[0]}).ok());
}

// The tests that count buffers run on clusters of their own: the shared one may still be
// deleting what earlier tests dropped (asynchronously, once their calls finished).
TEST(AsyncBuffers, InputsOfAnUnfinishedCallOutliveTheirHandles) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok());
  const std::vector<int64_t> baseline = buffer_counts(*client, 8);
  const HostArray x = random_f32({kSlowN, kSlowN}, 5);
  Jitted slow = jit(slow_layers);
  absl::StatusOr<Array> xp = client->device_put(x, NamedSharding(*mesh, P("data", None)));
  absl::StatusOr<Array> wp = client->device_put(identity_f32(kSlowN), NamedSharding(*mesh, P()));
  ASSERT_TRUE(xp.ok() && wp.ok());
  std::optional<Array> xs = *std::move(xp);
  std::optional<Array> w = *std::move(wp);
  absl::StatusOr<std::vector<Array>> y = slow({*xs, *w});
  ASSERT_TRUE(y.ok()) << y.status();
  // Dropping the arguments' last handles while the call may still run: it still reads them.
  xs.reset();
  w.reset();
  absl::StatusOr<HostArray> got = (*y)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(*got, slow_reference(x));
  y->clear();  // the last handle of a finished output: freed at once
  EXPECT_EQ(buffer_counts(*client, 8), baseline);
}

// Drops go in the background (docs/design.md, "Sessions and leases"): once flush_deletes
// returns, every dropped array's memory is free on the workers again, whether the arrays were
// put, outputs of finished calls or outputs of calls still running when dropped. The baseline
// is the workers' own count of their bytes, taken before anything was put.
TEST(AsyncBuffers, DroppedArraysAreFreedOnTheWorkersWhenAFlushReturns) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok());
  const std::vector<int64_t> baseline = bytes_used(*client, 8);
  const std::vector<int64_t> baseline_buffers = buffer_counts(*client, 8);
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  {
    std::vector<Array> arrays;
    for (int i = 0; i < 100; ++i) {
      absl::StatusOr<Array> a =
          client->device_put(random_f32({16, 8 * (1 + i % 4)}, i), NamedSharding(*mesh, P("data", "model")));
      ASSERT_TRUE(a.ok()) << a.status();
      arrays.push_back(*a);
    }
    std::vector<Array> outputs;
    for (int i = 0; i < 100; ++i) {
      absl::StatusOr<std::vector<Array>> y = twice({arrays[i]});
      ASSERT_TRUE(y.ok()) << y.status();
      outputs.push_back((*y)[0]);
      if (i % 2 == 0) {
        ASSERT_TRUE(outputs.back().block_until_ready().ok());
      }
    }
    // Everything goes here: inputs, finished outputs and perhaps unfinished ones.
  }
  const absl::Status flushed = client->flush_deletes();
  ASSERT_TRUE(flushed.ok()) << flushed;
  // An output of a call still running when dropped is deleted when that call finishes, which
  // may be after the flush: flush again until the workers are back (each flush a round trip).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (bytes_used(*client, 8) != baseline && absl::Now() < deadline) {
    ASSERT_TRUE(client->flush_deletes().ok());
  }
  EXPECT_EQ(client->failed_deletes(), 0);
  EXPECT_EQ(bytes_used(*client, 8), baseline);
  EXPECT_EQ(buffer_counts(*client, 8), baseline_buffers);
}

TEST_F(AsyncTest, AKernelErrorReachesTheOutputsAndTheirConsumers) {
  // Devices of 512 KiB: the broadcast's 1 MiB output block cannot be stored.
  LocalOptions options;
  options.memory_bytes_per_device = 512 << 10;
  absl::StatusOr<Client> client = Client::local(8, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok());
  const HostArray x = random_f32({16, 8}, 6);
  absl::StatusOr<Array> xs = client->device_put(x, NamedSharding(*mesh, P("data", None)));
  ASSERT_TRUE(xs.ok()) << xs.status();
  Jitted big = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{broadcast_in_dim(in[0], {16, 8, 8192}, {0, 1}), in[0] + 1.0};
  });
  Jitted neg1 = jit([](const std::vector<Value>& in) { return std::vector<Value>{-in[0]}; });
  absl::StatusOr<std::vector<Array>> y = big({*xs});
  ASSERT_TRUE(y.ok()) << y.status();
  // Consumes an output of the failing call: when the failure is known by then (a loaded
  // machine), the call itself fails with it; otherwise its output does.
  absl::StatusOr<std::vector<Array>> z = neg1({(*y)[1]});

  for (const Array& out : *y) {
    absl::Status status = out.block_until_ready();
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("device "));
    EXPECT_THAT(std::string(status.message()), HasSubstr("bytes"));
    EXPECT_TRUE(out.is_ready());
    EXPECT_EQ(out.fetch().status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(out.addressable_shards()[0].data().status().code(), absl::StatusCode::kResourceExhausted);
  }
  absl::Status consumer = z.ok() ? (*z)[0].block_until_ready() : z.status();
  EXPECT_EQ(consumer.code(), absl::StatusCode::kResourceExhausted) << consumer;
  EXPECT_THAT(std::string(consumer.message()), HasSubstr("argument 0 is an output of a failed call"));
  // The worker refuses the run before it starts: its peak does not fit (worker/plan_peak.h's
  // peak_memory): the broadcast's (4, 8, 8192) f32 block, 1048576 bytes, and in[0] + 1's
  // (4, 8) f32 block, 128 bytes (the add writes over its constant operand).
  EXPECT_THAT(std::string(consumer.message()), HasSubstr("needs 1048704 bytes at once"));
  // A chain of consumers issued at once reports the root cause, once, at its end.
  absl::Status chained = absl::OkStatus();
  Array last = (*y)[1];
  for (int i = 0; i < 5 && chained.ok(); ++i) {
    absl::StatusOr<std::vector<Array>> next = neg1({last});
    if (next.ok()) {
      last = (*next)[0];
    } else {
      chained = next.status();  // the failure was known by then: the call itself fails
    }
  }
  if (chained.ok()) chained = last.block_until_ready();
  EXPECT_EQ(chained.code(), absl::StatusCode::kResourceExhausted) << chained;
  const std::string message(chained.message());
  EXPECT_THAT(message, HasSubstr("needs 1048704 bytes at once"));
  EXPECT_EQ(message.find("failed call"), message.rfind("failed call")) << message;
  // Passing a failed output to a call now fails the call itself, with the original error.
  absl::StatusOr<std::vector<Array>> again = neg1({(*y)[1]});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted) << again.status();
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("needs 1048704 bytes at once"));
  // Other arrays are unaffected.
  absl::StatusOr<HostArray> back = xs->fetch();
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == x);
  absl::StatusOr<std::vector<Array>> fine = neg1({*xs});
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_TRUE((*fine)[0].block_until_ready().ok());
}

TEST(AsyncBuffers, DroppedUnfinishedOutputsAndADestroyedClientFreeEverything) {
  absl::StatusOr<Client> owner = Client::local(8);
  ASSERT_TRUE(owner.ok()) << owner.status();
  const std::vector<int64_t> baseline = buffer_counts(*owner, 8);
  {
    // A second client of the cluster, destroyed with its calls in flight: it waits for them
    // and frees the outputs nobody holds (and the arguments they kept alive).
    absl::StatusOr<Client> other = Client::connect(owner->coordinator_address());
    ASSERT_TRUE(other.ok()) << other.status();
    absl::StatusOr<Mesh> mesh = other->make_mesh({4, 2}, {"data", "model"});
    ASSERT_TRUE(mesh.ok());
    absl::StatusOr<Array> x = other->device_put(random_f32({kSlowN, kSlowN}, 7), NamedSharding(*mesh, P("data", None)));
    absl::StatusOr<Array> w = other->device_put(identity_f32(kSlowN), NamedSharding(*mesh, P()));
    ASSERT_TRUE(x.ok() && w.ok());
    Jitted slow = jit(slow_layers);
    Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
    absl::StatusOr<std::vector<Array>> y = slow({*x, *w});
    ASSERT_TRUE(y.ok()) << y.status();
    absl::StatusOr<std::vector<Array>> z = twice({(*y)[0]});
    ASSERT_TRUE(z.ok()) << z.status();
    absl::StatusOr<std::vector<Array>> kept = twice({(*z)[0]});
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_FALSE((*y)[0].is_ready());
    EXPECT_FALSE((*kept)[0].is_ready());
    y->clear();  // unfinished outputs dropped: freed when their calls finish
    z->clear();
    // `kept`, x, w and `other` go at the end of this scope, the calls still running.
  }
  EXPECT_EQ(buffer_counts(*owner, 8), baseline);
}

// The deletion queue's linger (client/execution.h, kDeleteLinger): a drop with nothing in
// flight waits for the next call's Execute to carry it, and only what is still queued when the
// linger ends, with no call in flight, goes in a DeleteArray of its own. One linger at a time;
// none while a DeleteArray is in flight (its reply sends what queued meanwhile).
TEST(DeleteQueue, ADropWithNothingInFlightLingersAndTheNextCallCarriesIt) {
  internal::InFlight queue;
  bool linger = false;
  ASSERT_TRUE(queue.queue_delete(7, "grant 7", &linger));
  EXPECT_TRUE(linger) << "nothing in flight: a linger starts, no DeleteArray";
  linger = false;
  ASSERT_TRUE(queue.queue_delete(8, "grant 8", &linger));
  EXPECT_FALSE(linger) << "one linger at a time";
  ASSERT_TRUE(queue.begin_execution(absl::Now() + absl::Seconds(30), "test").ok());
  EXPECT_THAT(queue.take_deletes(), ElementsAre(Pair(7, "grant 7"), Pair(8, "grant 8")));
  EXPECT_THAT(queue.end_linger(), IsEmpty()) << "the call carried them: nothing for a DeleteArray";
  EXPECT_FALSE(queue.end_execution()) << "nothing waits: no linger";
  EXPECT_TRUE(queue.await_deletes(absl::Now() + absl::Seconds(5)).ok());
}

TEST(DeleteQueue, WhatALingerLeavesGoesInOneDeleteArrayAfterTheCallsInFlight) {
  internal::InFlight queue;
  bool linger = false;
  ASSERT_TRUE(queue.queue_delete(7, "grant 7", &linger));
  ASSERT_TRUE(linger);
  // A call in flight when the linger ends, sent before the drop: the deletion waits for the
  // next call, or for the last call's end, which lingers again.
  ASSERT_TRUE(queue.begin_execution(absl::Now() + absl::Seconds(30), "test").ok());
  EXPECT_THAT(queue.end_linger(), IsEmpty());
  EXPECT_TRUE(queue.end_execution()) << "the last call ended with a deletion queued: a linger";
  EXPECT_THAT(queue.end_linger(), ElementsAre(Pair(7, "grant 7"))) << "nothing in flight: one DeleteArray";
  // While that DeleteArray is in flight a drop neither lingers nor sends: its reply sends it.
  linger = false;
  ASSERT_TRUE(queue.queue_delete(8, "grant 8", &linger));
  EXPECT_FALSE(linger);
  EXPECT_THAT(queue.next_delete_batch(), ElementsAre(Pair(8, "grant 8")));
  EXPECT_THAT(queue.next_delete_batch(), IsEmpty());
  EXPECT_TRUE(queue.await_deletes(absl::Now() + absl::Seconds(5)).ok());
}

// The linger's end sends by itself: an array dropped with nothing in flight, and no call or
// flush after it, is freed on the workers. Another client of the cluster watches their bytes
// (device_stats flushes only its own client's deletions).
TEST(AsyncBuffers, AnArrayDroppedWithNothingInFlightIsFreedWithoutAFlushOrACall) {
  absl::StatusOr<Client> owner = Client::local(8);
  ASSERT_TRUE(owner.ok()) << owner.status();
  absl::StatusOr<Client> watcher = Client::connect(owner->coordinator_address());
  ASSERT_TRUE(watcher.ok()) << watcher.status();
  absl::StatusOr<Mesh> mesh = owner->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok());
  const std::vector<int64_t> baseline = bytes_used(*watcher, 8);
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  std::optional<Array> x;
  {
    absl::StatusOr<Array> put = owner->device_put(random_f32({64, 64}, 11), NamedSharding(*mesh, P("data", None)));
    ASSERT_TRUE(put.ok()) << put.status();
    absl::StatusOr<std::vector<Array>> y = twice({*put});
    ASSERT_TRUE(y.ok()) << y.status();
    ASSERT_TRUE((*y)[0].block_until_ready().ok());
    x = *std::move(put);
    // y's last handle goes here, the call finished: nothing in flight.
  }
  ASSERT_NE(bytes_used(*watcher, 8), baseline) << "x is held";
  x.reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (bytes_used(*watcher, 8) != baseline && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));  // polling the workers' state, not synchronising
  }
  EXPECT_EQ(bytes_used(*watcher, 8), baseline);
  EXPECT_EQ(owner->failed_deletes(), 0);
}

TEST(AsyncClient, DestroyingALocalClientWithCallsInFlight) {
  // The embedded cluster goes with the client: the calls in flight finish first.
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok());
  absl::StatusOr<Array> x = client->device_put(random_f32({kSlowN, kSlowN}, 8), NamedSharding(*mesh, P("data", None)));
  absl::StatusOr<Array> w = client->device_put(identity_f32(kSlowN), NamedSharding(*mesh, P()));
  ASSERT_TRUE(x.ok() && w.ok());
  Jitted slow = jit(slow_layers);
  std::vector<Array> outputs;
  Array y = *x;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::vector<Array>> next = slow({y, *w});
    ASSERT_TRUE(next.ok()) << next.status();
    y = (*next)[0];
    outputs.push_back(y);
  }
  EXPECT_FALSE(y.is_ready());
  // Everything goes here: the client, the arguments and the unfinished outputs.
}

// Real processes: a worker killed by pid while a call runs.
class AsyncProcessTest : public ProcessClusterTest {};

void expect_names_lost_device(const absl::Status& status, const std::string& device) {
  EXPECT_THAT(status.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded)) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(device));
}

TEST_F(AsyncProcessTest, AWorkerKilledDuringACallFailsItsOutputsAndTheirConsumers) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Mesh> low = client_->make_mesh({2, 2}, {"a", "b"}, {0, 1, 2, 3});
  ASSERT_TRUE(low.ok());
  const HostArray values = HostArray::arange(DType::kI32, {16, 8});
  absl::StatusOr<Array> elsewhere = client_->device_put(values, NamedSharding(*low, P("a", "b")));
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  absl::StatusOr<Array> x = client_->device_put(random_f32({kSlowN, kSlowN}, 9), NamedSharding(*mesh, P("data", None)));
  absl::StatusOr<Array> w = client_->device_put(identity_f32(kSlowN), NamedSharding(*mesh, P()));
  ASSERT_TRUE(x.ok() && w.ok());
  Jitted slow = jit(slow_layers);
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  ASSERT_TRUE(twice({*x}).ok());  // compiled before the failure

  absl::StatusOr<std::vector<Array>> y = slow({*x, *w});
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<std::vector<Array>> z = twice({(*y)[0]});
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_FALSE((*y)[0].is_ready());
  cluster_.workers[7]->kill();

  // The heartbeat timeout is 1.5 s; a dead process fails its RPC at once. Either way the
  // bound is far below the call's 60 s timeout.
  const absl::Time start = absl::Now();
  absl::Status failed = (*y)[0].block_until_ready();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  expect_names_lost_device(failed, "device 7");
  absl::Status consumer = (*z)[0].block_until_ready();
  expect_names_lost_device(consumer, "device 7");
  EXPECT_THAT(std::string(consumer.message()), HasSubstr("argument 0 is an output of a failed call"));
  expect_names_lost_device((*y)[0].fetch().status(), "device 7");
  expect_names_lost_device(twice({(*y)[0]}).status(), "device 7");

  // A call issued after the death that needs device 7 fails naming it too.
  absl::StatusOr<std::vector<Array>> after = twice({*x});
  if (after.ok()) {
    expect_names_lost_device((*after)[0].block_until_ready(), "device 7");
  } else {
    expect_names_lost_device(after.status(), "device 7");
  }
  // Arrays on other devices still fetch.
  absl::StatusOr<HostArray> kept = elsewhere->fetch();
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(*kept == values);
}

// Chains sent at once (issue #18 item 1): a call whose input is an output of a call still in
// flight is sent without waiting for that call's reply; the coordinator forwards it to the
// workers, which run it after its producer on each RunPlans stream.
std::vector<double> halve_plus_one(std::vector<double> v, int times) {
  for (int t = 0; t < times; ++t) {
    for (double& e : v) e = static_cast<float>(static_cast<float>(e) * 0.5f + 1.0f);
  }
  return v;
}

TEST_F(AsyncProcessTest, AChainOfFiftyCallsSentAtOnceMatchesTheHostAndFreesItsIntermediates) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = random_f32({16, 8}, 11);
  absl::StatusOr<Array> x = client_->device_put(host, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(x.ok()) << x.status();
  absl::StatusOr<Array> w = client_->device_put(identity_f32(kSlowN), NamedSharding(*mesh, P()));
  absl::StatusOr<Array> big =
      client_->device_put(random_f32({kSlowN, kSlowN}, 12), NamedSharding(*mesh, P("data", None)));
  ASSERT_TRUE(w.ok() && big.ok());
  Jitted step = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 0.5 + 1.0}; });
  Jitted slow = jit(slow_layers);
  ASSERT_TRUE(step({*x}).ok());  // compiled (and its plans loaded) before the chain
  absl::StatusOr<std::vector<Array>> warm = slow({*big, *w});
  ASSERT_TRUE(warm.ok() && (*warm)[0].block_until_ready().ok());
  warm->clear();
  const std::vector<int64_t> baseline = buffer_counts(*client_, 8);

  // A slow call first, so that the chain behind it is in flight; then 50 dependent calls.
  absl::StatusOr<std::vector<Array>> head = slow({*big, *w});
  ASSERT_TRUE(head.ok()) << head.status();
  Array y = *x;
  std::vector<Array> every_tenth;
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<std::vector<Array>> next = step({y});
    ASSERT_TRUE(next.ok()) << next.status();
    y = (*next)[0];  // the previous link's handle goes: freed once nothing reads it
    if (i % 10 == 9) every_tenth.push_back(y);
  }
  const std::vector<double> start(host.values<float>().begin(), host.values<float>().end());
  for (size_t k = 0; k < every_tenth.size(); ++k) {
    absl::StatusOr<HostArray> got = every_tenth[k].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    expect_near(*got, halve_plus_one(start, static_cast<int>(10 * (k + 1))), 1e-6);
  }
  absl::StatusOr<HostArray> slow_result = (*head)[0].fetch();
  ASSERT_TRUE(slow_result.ok()) << slow_result.status();
  head->clear();
  // Only the five kept links remain (y is the last of them): every other intermediate was
  // freed on every device. Deletions go asynchronously: wait for them, bounded.
  std::vector<int64_t> want = baseline;
  for (int64_t& n : want) n += 5;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  std::vector<int64_t> counts = buffer_counts(*client_, 8);
  while (counts != want && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));  // polling a count, with a deadline
    counts = buffer_counts(*client_, 8);
  }
  EXPECT_EQ(counts, want);
}

// A chained call's deletions ride on its runs (issue #18, chained calls; design.md, "Chained
// calls like for like"): the drops queued while its producer runs go with its Execute, and
// the coordinator hands them to the workers with its runs (free_buffers), as for an
// independent call, not as a StreamDelete of their own on every device's stream (which cost a
// link of a chain as much again as its runs). A coordinator and 4 workers in this process,
// on 127.0.0.1 ports; the counter is the coordinator's metric.
TEST(AsyncChain, AChainedCallsDeletionsRideOnItsRuns) {
  absl::StatusOr<std::unique_ptr<CoordinatorServer>> coordinator = CoordinatorServer::start(CoordinatorOptions{});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  auto deletes_on_runs = [&] {
    for (const MetricSample& m : (*coordinator)->metrics()) {
      if (m.name == "tessera_coordinator_deletes_on_runs_total") return m.value;
    }
    ADD_FAILURE() << "no metric tessera_coordinator_deletes_on_runs_total";
    return -1.0;
  };
  constexpr int kDevices = 4;
  std::vector<std::unique_ptr<WorkerServer>> workers;
  for (int d = 0; d < kDevices; ++d) {
    WorkerOptions options;
    options.coordinator_address = (*coordinator)->address();
    options.memory_bytes = int64_t{64} << 20;
    options.shm = false;
    options.device_id = d;
    absl::StatusOr<std::unique_ptr<WorkerServer>> w = WorkerServer::start(options);  // returns once registered
    ASSERT_TRUE(w.ok()) << w.status();
    workers.push_back(*std::move(w));
  }
  {
    ConnectOptions connect;
    connect.min_devices = kDevices;
    absl::StatusOr<Client> client = Client::connect((*coordinator)->address(), connect);
    ASSERT_TRUE(client.ok()) << client.status();
    absl::StatusOr<Mesh> mesh = client->make_mesh({kDevices}, {"data"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const HostArray host = random_f32({kSlowN, kSlowN}, 21);
    absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("data", None)));
    absl::StatusOr<Array> w = client->device_put(identity_f32(kSlowN), NamedSharding(*mesh, P()));
    std::optional<Array> junk =
        *client->device_put(HostArray::ones(DType::kF32, {8, 4}), NamedSharding(*mesh, P("data")));
    ASSERT_TRUE(x.ok() && w.ok());
    Jitted slow = jit(slow_layers);
    Jitted step = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 0.5 + 1.0}; });
    {  // both compiled and their plans loaded; nothing left queued to delete
      absl::StatusOr<std::vector<Array>> warm = slow({*x, *w});
      ASSERT_TRUE(warm.ok() && (*warm)[0].block_until_ready().ok());
      absl::StatusOr<std::vector<Array>> warm_step = step({(*warm)[0]});
      ASSERT_TRUE(warm_step.ok() && (*warm_step)[0].block_until_ready().ok());
    }
    // Whether a link overlaps its producer, and whether the coordinator reads the producer's
    // Execute before the chained one (two unary calls, handed to its handlers in either
    // order; the chained one's deletions then go at once, as they must not wait for a call
    // that may never come), depends on timing: each attempt that overlapped counts 0 or 4,
    // and one must count 4 (never on the old code, where a chained call's deletions were
    // StreamDeletes of their own).
    const std::vector<double> want = [&] {
      std::vector<double> v = slow_reference(host);
      for (double& e : v) e = static_cast<float>(static_cast<float>(e) * 0.5f + 1.0f);
      return v;
    }();
    bool rode = false;
    for (int attempt = 0; attempt < 5 && !rode; ++attempt) {
      SCOPED_TRACE(absl::StrCat("attempt ", attempt));
      if (!junk.has_value()) {
        junk = *client->device_put(HostArray::ones(DType::kF32, {8, 4}), NamedSharding(*mesh, P("data")));
      }
      ASSERT_TRUE(client->flush_deletes().ok());
      const std::vector<int64_t> baseline = buffer_counts(*client, kDevices);  // junk's block on each
      const double before = deletes_on_runs();
      absl::StatusOr<std::vector<Array>> head = slow({*x, *w});
      ASSERT_TRUE(head.ok()) << head.status();
      junk.reset();  // a call is in flight: its deletion waits for the next Execute
      absl::StatusOr<std::vector<Array>> chained = step({(*head)[0]});
      ASSERT_TRUE(chained.ok()) << chained.status();
      const bool overlapped = !(*head)[0].is_ready();  // the chained call was sent while its producer ran
      absl::StatusOr<HostArray> got = (*chained)[0].fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      expect_near(*got, want, 1e-5);
      if (!overlapped) continue;  // an independent call: its deletions ride as ever
      const double rides = deletes_on_runs() - before;
      EXPECT_TRUE(rides == 0 || rides == kDevices) << rides;
      if (rides != kDevices) continue;
      rode = true;
      // Deleted when each worker read the run, before it ran: junk's block went, head's and
      // chained's outputs are there.
      std::vector<int64_t> now = baseline;
      for (int64_t& n : now) n += 1;
      EXPECT_EQ(buffer_counts(*client, kDevices), now);
    }
    EXPECT_TRUE(rode) << "no chained call of 5 carried its deletions on its runs";
  }
  for (auto& w : workers) w->shutdown();
  (*coordinator)->shutdown();
}

// A drop never waits for the coordinator: with the coordinator process stopped (SIGSTOP), a
// synchronous DeleteArray could not return before its 10 s deadline, yet dropping the last
// handles of 20 arrays returns (asserted with a 5 s bound). Once the coordinator runs again a
// flush returns with every buffer freed on the workers (their bytes back to the baseline).
TEST_F(AsyncProcessTest, DropsReturnWhileTheCoordinatorIsStoppedAndAreFreedOnceItRunsAgain) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const std::vector<int64_t> baseline = bytes_used(*client_, 8);
  std::vector<Array> arrays;
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<Array> a = client_->device_put(random_f32({64, 64}, 100 + i), NamedSharding(*mesh, P("data", None)));
    ASSERT_TRUE(a.ok()) << a.status();
    arrays.push_back(*std::move(a));
  }
  ASSERT_NE(bytes_used(*client_, 8), baseline);
  const pid_t coordinator = cluster_.coordinator->pid();
  ASSERT_TRUE(sigstop_and_wait(coordinator).ok());
  absl::Notification dropped;
  std::thread dropper([&] {
    arrays.clear();
    dropped.Notify();
  });
  const bool returned = dropped.WaitForNotificationWithTimeout(absl::Seconds(5));
  ASSERT_EQ(kill(coordinator, SIGCONT), 0);
  dropper.join();
  EXPECT_TRUE(returned) << "dropping arrays waited for the stopped coordinator";
  const absl::Status flushed = client_->flush_deletes();
  EXPECT_TRUE(flushed.ok()) << flushed;
  EXPECT_EQ(client_->failed_deletes(), 0);
  EXPECT_EQ(bytes_used(*client_, 8), baseline);
}

// A background deletion that fails does not vanish: with the coordinator gone, the drop still
// returns, and the flush reports the DeleteArray's error, counted in failed_deletes (and the
// array's id logged to stderr) once the client gave up: UNAVAILABLE may pass, so the
// deletion was sent 6 times more (100 ms doubling, 6.3 s) before.
TEST_F(AsyncProcessTest, AFailedBackgroundDeletionIsCountedAndReportedByTheFlush) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  std::optional<Array> a;
  {
    absl::StatusOr<Array> put = client_->device_put(random_f32({8, 8}, 3), NamedSharding(*mesh, P("data", None)));
    ASSERT_TRUE(put.ok()) << put.status();
    a = *std::move(put);
  }
  EXPECT_EQ(client_->failed_deletes(), 0);
  cluster_.coordinator->kill();
  a.reset();
  const absl::Status flushed = client_->flush_deletes();
  EXPECT_EQ(flushed.code(), absl::StatusCode::kUnavailable) << flushed;
  EXPECT_THAT(std::string(flushed.message()), HasSubstr("DeleteArray: "));
  EXPECT_THAT(std::string(flushed.message()), HasSubstr("(7 attempts in a row were refused)"));
  EXPECT_EQ(client_->retried_deletes(), 6);
  EXPECT_EQ(client_->failed_deletes(), 1);
  EXPECT_TRUE(client_->flush_deletes().ok()) << "an error is reported once";
}

TEST_F(AsyncProcessTest, AFailingProducerFailsTheWholeChainSentAfterItWithItsError) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Array> x = client_->device_put(random_f32({16, 8}, 13), NamedSharding(*mesh, P("data", None)));
  ASSERT_TRUE(x.ok()) << x.status();
  // Each device's block of the broadcast is (4, 8, 2^22) f32, 512 MiB: more than the
  // workers' 256 MiB (--memory_bytes), so every device refuses the run.
  Jitted big = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{broadcast_in_dim(in[0], {16, 8, 1 << 22}, {0, 1}), in[0] + 1.0};
  });
  Jitted neg = jit([](const std::vector<Value>& in) { return std::vector<Value>{-in[0]}; });
  ASSERT_TRUE(neg({*x}).ok());
  absl::StatusOr<std::vector<Array>> y = big({*x});
  ASSERT_TRUE(y.ok()) << y.status();
  std::vector<Array> chain;
  Array last = (*y)[1];
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<std::vector<Array>> next = neg({last});
    if (!next.ok()) {  // the failure was known by then: the call itself fails, with it
      EXPECT_EQ(next.status().code(), absl::StatusCode::kResourceExhausted) << next.status();
      EXPECT_THAT(std::string(next.status().message()), HasSubstr("bytes at once"));
      break;
    }
    last = (*next)[0];
    chain.push_back(last);
  }
  for (const Array& a : chain) {
    absl::Status status = a.block_until_ready();
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    const std::string message(status.message());
    EXPECT_THAT(message, HasSubstr("argument 0 is an output of a failed call"));
    EXPECT_THAT(message, HasSubstr("device "));
    EXPECT_THAT(message, HasSubstr("bytes at once"));
  }
  // The cluster goes on: a new chain on the same input is right.
  absl::StatusOr<std::vector<Array>> a = neg({*x});
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::vector<Array>> b = neg({(*a)[0]});
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<HostArray> got = (*b)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<HostArray> want = x->fetch();
  ASSERT_TRUE(want.ok());
  EXPECT_TRUE(*got == *want);
}

TEST_F(AsyncProcessTest, AWorkerKilledMidChainFailsTheRestOfItNamingTheDevice) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Array> x =
      client_->device_put(random_f32({kSlowN, kSlowN}, 14), NamedSharding(*mesh, P("data", None)));
  absl::StatusOr<Array> w = client_->device_put(identity_f32(kSlowN), NamedSharding(*mesh, P()));
  ASSERT_TRUE(x.ok() && w.ok());
  Jitted slow = jit(slow_layers);
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  ASSERT_TRUE(twice({*x}).ok());
  absl::StatusOr<std::vector<Array>> y = slow({*x, *w});
  ASSERT_TRUE(y.ok()) << y.status();
  std::vector<Array> chain;
  Array last = (*y)[0];
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<std::vector<Array>> next = twice({last});
    ASSERT_TRUE(next.ok()) << next.status();
    last = (*next)[0];
    chain.push_back(last);
  }
  EXPECT_FALSE(last.is_ready());
  workers_[7]->kill();
  const absl::Time start = absl::Now();
  for (const Array& a : chain) {
    absl::Status status = a.block_until_ready();
    expect_names_lost_device(status, "device 7");
    EXPECT_THAT(std::string(status.message()), HasSubstr("argument 0 is an output of a failed call"));
  }
  // The heartbeat timeout is 1.5 s; far below the calls' 60 s timeout.
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace tessera
