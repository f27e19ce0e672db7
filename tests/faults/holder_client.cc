// holder_client: a client process for the lease drill (tests/faults/lease_test.cc). Connects,
// places two arrays, compiles and runs a program (its plan loaded on every device, its output
// held), prints "holding 3 arrays" and then holds them until stdin closes or it is killed.
#include <cstdio>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "tessera/tessera.h"

ABSL_FLAG(std::string, coordinator, "", "host:port of the coordinator");
ABSL_FLAG(int, devices, 4, "how many devices the mesh spans");
ABSL_FLAG(std::string, token_file, "", "the file holding the client token");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace tessera;
  const int n = absl::GetFlag(FLAGS_devices);
  ConnectOptions options;
  options.min_devices = n;
  options.timeout = absl::Seconds(20);
  options.token_file = absl::GetFlag(FLAGS_token_file);
  absl::StatusOr<Client> client = Client::connect(absl::GetFlag(FLAGS_coordinator), options);
  if (!client.ok()) {
    std::printf("error %s\n", client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<Mesh> mesh = client->make_mesh({n}, {"x"});
  if (!mesh.ok()) {
    std::printf("error %s\n", mesh.status().ToString().c_str());
    return 1;
  }
  const HostArray host = HostArray::arange(DType::kF32, {n, 1 << 16});
  absl::StatusOr<Array> a = client->device_put(host, NamedSharding(*mesh, P("x")));
  absl::StatusOr<Array> b = client->device_put(host, NamedSharding(*mesh, P("x")));
  if (!a.ok() || !b.ok()) {
    std::printf("error %s\n", (a.ok() ? b.status() : a.status()).ToString().c_str());
    return 1;
  }
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  absl::StatusOr<std::vector<Array>> out = twice({*a});
  absl::Status ran = out.ok() ? (*out)[0].block_until_ready() : out.status();
  if (!ran.ok()) {
    std::printf("error %s\n", ran.ToString().c_str());
    return 1;
  }
  std::printf("holding 3 arrays\n");
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
  }
  return 0;
}
