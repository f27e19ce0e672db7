// The Tessera client SDK: everything an application needs, in one include.
//
//   #include "tessera/tessera.h"
//   using namespace tessera;
//   absl::StatusOr<Client> client = Client::local(8);          // or Client::connect("host:port")
//   absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
//   absl::StatusOr<Array> x = client->device_put(HostArray::ones(DType::kF32, {16, 8}),
//                                                NamedSharding(*mesh, P("data", None)));
//   std::cout << *visualize_array_sharding(*x);
//   absl::StatusOr<HostArray> back = x->fetch();
#ifndef TESSERA_TESSERA_H_
#define TESSERA_TESSERA_H_

#include "core/collective.h"
#include "core/dtype.h"
#include "core/host_array.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "core/shape.h"
#include "core/sharding.h"
#include "core/status.h"
#include "tessera/array.h"
#include "tessera/client.h"
#include "tessera/collective.h"
#include "tessera/grad.h"
#include "tessera/jit.h"
#include "tessera/mesh_context.h"
#include "tessera/nn.h"
#include "tessera/optim.h"
#include "tessera/random.h"
#include "tessera/shard_map.h"
#include "tessera/trace.h"
#include "tessera/tree.h"
#include "tessera/version.h"
#include "tessera/visualize.h"
#include "tessera/vmap.h"

#endif  // TESSERA_TESSERA_H_
