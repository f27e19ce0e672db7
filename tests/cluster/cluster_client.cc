// cluster_client: the client side of the cluster test (tests/cluster/netns_cluster_test.cc),
// run inside the client's network namespace and driven one command per stdin line, each
// answered with one stdout line:
//
//   setup           connect, place x and w, compile the program -> "ready <collectives in the plan>"
//   run             execute it, fetch, check against the host    -> "ok <ms>" | "error <ms> <status>"
//   wait_devices N  wait (server-side, 30 s) for N alive devices -> "devices N" | "error ..."
//   shm             collective messages the 8 devices received through shared-memory rings
//                   (DeviceStats::shm_messages_received, summed)  -> "shm <n>" | "error ..."
//   quit
//
// The program is collective-heavy: a matmul over a split contraction dimension (all_reduce),
// a change of the split dimension (all_to_all), and a gather to every device (all_gather).
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/daemon.h"
#include "tessera/tessera.h"

ABSL_FLAG(std::string, coordinator, "", "host:port of the coordinator (env TESSERA_COORDINATOR)");

namespace tessera {
namespace {

HostArray pattern(Shape shape, double scale) {
  HostArray a(DType::kF32, std::move(shape));
  int64_t i = 0;
  for (float& v : a.mutable_values<float>()) v = static_cast<float>(std::sin(scale * static_cast<double>(++i)));
  return a;
}

class Session {
 public:
  explicit Session(std::string address) : address_(std::move(address)) {}

  std::string setup() {
    absl::StatusOr<Client> client = Client::connect(address_, {.min_devices = 8, .timeout = absl::Seconds(30)});
    if (!client.ok()) return absl::StrCat("error 0 ", client.status().ToString());
    client_ = *client;
    absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
    if (!mesh.ok()) return absl::StatusOr<std::string>(mesh.status()).status().ToString();
    mesh_ = *mesh;
    absl::StatusOr<Array> x = client_->device_put(x_host_, NamedSharding(*mesh_, P("data", "model")));
    absl::StatusOr<Array> w = client_->device_put(w_host_, NamedSharding(*mesh_, P("model", None)));
    if (!x.ok() || !w.ok()) return absl::StrCat("error 0 ", (x.ok() ? w.status() : x.status()).ToString());
    x_ = *x;
    w_ = *w;
    const Mesh m = *mesh_;
    program_ = jit([m](const std::vector<Value>& in) {
      // make_mesh's axes are Explicit: out_sharding resolves the sum over 'model' (all_reduce).
      Value h = tanh(matmul(in[0], in[1], P("data", None)));
      Value t = with_sharding_constraint(h, NamedSharding(m, P(None, "data")));  // all_to_all
      Value g = with_sharding_constraint(t, NamedSharding(m, P()));              // all_gather
      return std::vector<Value>{sum(g * g, {1}), t};
    });
    std::string answer = run();
    if (!absl::StartsWith(answer, "ok")) return answer;
    const std::string text = program_->as_text();
    std::string kinds;
    for (const char* kind : {"all_reduce", "all_to_all", "all_gather", "reduce_scatter"}) {
      if (absl::StrContains(text, kind)) absl::StrAppend(&kinds, " ", kind);
    }
    return absl::StrCat("ready", kinds);
  }

  std::string run() {
    if (!program_.has_value()) return "error 0 run before setup";
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<Array>> out = (*program_)({*x_, *w_});
    auto ms = [&] { return absl::ToInt64Milliseconds(absl::Now() - start); };
    if (!out.ok()) return absl::StrCat("error ", ms(), " ", out.status().ToString());
    absl::StatusOr<HostArray> s = (*out)[0].fetch();
    absl::StatusOr<HostArray> t = (*out)[1].fetch();
    if (!s.ok() || !t.ok()) return absl::StrCat("error ", ms(), " ", (s.ok() ? t.status() : s.status()).ToString());
    // The host reference, in double: h = tanh(x @ w), s = rowwise sum of h * h.
    constexpr int64_t kM = 64, kK = 32, kN = 16;
    for (int64_t i = 0; i < kM; ++i) {
      double row = 0;
      for (int64_t j = 0; j < kN; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < kK; ++k)
          acc += double(x_host_.values<float>()[i * kK + k]) * w_host_.values<float>()[k * kN + j];
        const double h = std::tanh(acc);
        row += h * h;
        if (std::abs(t->values<float>()[i * kN + j] - h) > 1e-5) {
          return absl::StrCat("error ", ms(), " wrong value t[", i, ", ", j, "] = ", t->values<float>()[i * kN + j],
                              ", expected ", h);
        }
      }
      if (std::abs(s->values<float>()[i] - row) > 1e-4 * (1 + row)) {
        return absl::StrCat("error ", ms(), " wrong value s[", i, "] = ", s->values<float>()[i], ", expected ", row);
      }
    }
    return absl::StrCat("ok ", ms());
  }

  std::string shm() {
    if (!client_.has_value()) return "error 0 shm before setup";
    int64_t messages = 0;
    for (int d = 0; d < 8; ++d) {
      absl::StatusOr<DeviceStats> stats = client_->device_stats(d);
      if (!stats.ok()) return absl::StrCat("error 0 ", stats.status().ToString());
      messages += stats->shm_messages_received;
    }
    return absl::StrCat("shm ", messages);
  }

  std::string wait_devices(int n) {
    absl::StatusOr<Client> c = Client::connect(address_, {.min_devices = n, .timeout = absl::Seconds(30)});
    if (!c.ok()) return absl::StrCat("error 0 ", c.status().ToString());
    return absl::StrCat("devices ", n);
  }

 private:
  const std::string address_;
  const HostArray x_host_ = pattern({64, 32}, 0.37);
  const HostArray w_host_ = pattern({32, 16}, 0.11);
  std::optional<Client> client_;
  std::optional<Mesh> mesh_;
  std::optional<Array> x_, w_;
  std::optional<Jitted> program_;
};

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("The client side of the netns cluster test; commands on stdin (see the source).");
  tessera::parse_flags(argc, argv, "cluster_client", {{"coordinator", "TESSERA_COORDINATOR"}});
  tessera::Session session(absl::GetFlag(FLAGS_coordinator));
  for (std::string line; std::getline(std::cin, line);) {
    std::string answer;
    int n = 0;
    if (line == "setup") {
      answer = session.setup();
    } else if (line == "run") {
      answer = session.run();
    } else if (absl::StartsWith(line, "wait_devices ") && absl::SimpleAtoi(line.substr(13), &n)) {
      answer = session.wait_devices(n);
    } else if (line == "shm") {
      answer = session.shm();
    } else if (line == "quit") {
      break;
    } else {
      answer = absl::StrCat("error 0 unknown command '", line, "'");
    }
    std::printf("%s\n", answer.c_str());
    std::fflush(stdout);
  }
  return 0;
}
