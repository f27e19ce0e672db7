#include "tessera/array.h"

#include <algorithm>
#include <map>
#include <new>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_impl.h"
#include "client/transfer.h"
#include "core/slicing.h"
#include "core/status.h"
#include "proto/in_process.h"
#include "proto/rpc.h"
#include "tessera/jit.h"

namespace tessera {
namespace {

using internal::ArrayState;

// The devices of the array's mesh as the coordinator sees them now. A device whose worker
// restarted since the array was placed is reported LOST for this array, and in `restarted`.
// `grant` gets the array's grant for the workers.
absl::StatusOr<std::map<int, pb::DeviceInfo>> array_devices(const ArrayState& state, uint64_t id,
                                                            std::set<int>* restarted, std::string* grant) {
  pb::GetArrayRequest req;
  req.set_array_id(id);
  pb::GetArrayReply reply;
  TESSERA_RETURN_IF_ERROR(internal::with_adoption(state, id, [&] {
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    return from_grpc(state.client->coordinator()->GetArray(&ctx, req, &reply),
                     absl::StrCat("coordinator ", state.client->coordinator_address()));
  }));
  *grant = reply.info().grant();
  std::map<int, pb::DeviceInfo> out;
  for (const pb::DeviceInfo& d : reply.devices()) out[d.id()] = d;
  for (int id : reply.info().lost_devices()) {
    out[id].set_state(pb::LOST);
    restarted->insert(id);
  }
  return out;
}

std::string describe(const pb::DeviceInfo& d) { return absl::StrCat("device ", d.id(), " (", d.address(), ")"); }

}  // namespace

Shape Shard::shape() const { return block_shape(shard_.index); }

absl::StatusOr<HostArray> Shard::data() const {
  TESSERA_ASSIGN_OR_RETURN(const uint64_t id, array_->ready_id());
  std::set<int> restarted;
  std::string grant;
  TESSERA_ASSIGN_OR_RETURN(auto devices, array_devices(*array_, id, &restarted, &grant));
  const pb::DeviceInfo& d = devices[shard_.device_id];
  const std::string who = absl::StrCat("shard of array ", id, " on ", describe(d));
  if (restarted.count(d.id()) > 0) {
    return absl::FailedPreconditionError(absl::StrCat(who, ": the worker restarted and the shard is gone"));
  }
  if (d.state() != pb::ALIVE) {
    return absl::UnavailableError(absl::StrCat(who, d.state() == pb::LEFT
                                                        ? ": the device left (its worker drained and deregistered)"
                                                        : ": the device is lost"));
  }
  TESSERA_ASSIGN_OR_RETURN(pb::Worker::Stub * stub, array_->client->worker(d.address(), who));
  HostArray out(array_->dtype, shape());
  Index whole;
  for (int64_t n : out.shape()) whole.push_back({0, n});
  TESSERA_RETURN_IF_ERROR(internal::get_shard(stub, id, grant, whole, out.mutable_view(), who,
                                              array_->client->transfer_path(d.address()),
                                              array_->client->writes_our_memory(d.address())));
  return out;
}

namespace internal {
const ArrayState& array_state(const Array& array) { return *array.state_; }
Array make_array(std::shared_ptr<ArrayState> state) { return Array(std::move(state)); }
}  // namespace internal

uint64_t Array::id() const {
  absl::StatusOr<uint64_t> id = state_->ready_id();
  return id.ok() ? *id : 0;
}

bool Array::is_ready() const { return state_->buffers->ready(); }

absl::Status Array::block_until_ready() const { return state_->ready_id().status(); }

bool Array::await_ready(absl::Duration max_wait) const {
  return state_->buffers->donated() || state_->buffers->await_ready(max_wait);
}

absl::Status block_until_ready(const std::vector<Array>& arrays) {
  absl::Status first;
  for (const Array& a : arrays) first.Update(a.block_until_ready());
  return first;
}
const Shape& Array::shape() const { return state_->shape; }
DType Array::dtype() const { return state_->dtype; }
const NamedSharding& Array::sharding() const { return state_->sharding; }
bool Array::committed() const { return state_->committed; }

std::vector<Shard> Array::addressable_shards() const {
  std::vector<Shard> out;
  for (DeviceShard& s : state_->sharding.device_shards(state_->shape)) out.push_back(Shard(state_, std::move(s)));
  return out;
}

absl::StatusOr<HostArray> Array::fetch() const {
  std::optional<HostArray> out;
  try {
    out.emplace(state_->dtype, state_->shape);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("fetch: no host memory for ", type_to_string(state_->dtype, state_->shape)));
  }
  TESSERA_RETURN_IF_ERROR(fetch_into(out->mutable_view()));
  return *std::move(out);
}

absl::Status Array::fetch_into(const MutableHostView& out) const {
  TESSERA_RETURN_IF_ERROR(validate_view(out.dtype, out.shape, out.data, "fetch_into"));
  if (out.dtype != state_->dtype || out.shape != state_->shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fetch_into: the destination is ", dtype_name(out.dtype), " ", shape_to_string(out.shape), " but the array is ",
        dtype_name(state_->dtype), " ", shape_to_string(state_->shape), "; they must match"));
  }
  if (!state_->sharding.spec().unreduced().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fetch: the array is ", type_of(*this).to_string(), ", unreduced over ",
        axes_to_string(state_->sharding.spec().unreduced()),
        ": its devices hold terms of a sum, not its value; reshard it first (reshard(x, P(...)) runs the sum), or "
        "read each device's term with addressable_shards()"));
  }
  TESSERA_ASSIGN_OR_RETURN(const uint64_t id, state_->ready_id());
  ProfileSpan span(&state_->client->profile(), "client", [] { return std::string("fetch"); });
  span.arg("bytes", absl::StrCat(num_elements(out.shape) * dtype_size(out.dtype)));
  std::set<int> restarted;
  std::string grant;
  TESSERA_ASSIGN_OR_RETURN(auto devices, array_devices(*state_, id, &restarted, &grant));
  // Each distinct block once, from its lowest-numbered alive replica.
  struct Source {
    Index index;
    const pb::DeviceInfo* device = nullptr;
    std::vector<std::string> lost;
    bool restarted = true;  // every lost replica's worker restarted: the block is gone for good
  };
  std::vector<Source> sources;
  std::map<std::vector<int64_t>, size_t> by_block;
  for (const DeviceShard& s : state_->sharding.device_shards(state_->shape)) {
    std::vector<int64_t> key;
    for (const Slice& sl : s.index) key.push_back(sl.start);
    auto [it, inserted] = by_block.emplace(key, sources.size());
    if (inserted) sources.push_back({s.index, nullptr, {}});
    Source& src = sources[it->second];
    const pb::DeviceInfo& d = devices[s.device_id];
    if (d.state() != pb::ALIVE) {
      src.lost.push_back(describe(d));
      src.restarted = src.restarted && restarted.count(d.id()) > 0;
    } else if (src.device == nullptr) {
      src.device = &d;
    }
  }
  for (const Source& src : sources) {
    if (src.device == nullptr) {
      // Gone for good (the workers restarted) is FAILED_PRECONDITION: put the array again; a
      // device that is only unreachable may come back (UNAVAILABLE).
      const std::string where = absl::StrCat("fetch of array ", id, ": block ", index_to_string(src.index),
                                             " is only on ", absl::StrJoin(src.lost, ", "));
      if (src.restarted) return absl::FailedPreconditionError(absl::StrCat(where, ", whose worker restarted since"));
      return absl::UnavailableError(absl::StrCat(where, ", which is lost"));
    }
  }
  return internal::run_parallel(static_cast<int>(sources.size()), [&](int i) -> absl::Status {
    const Source& src = sources[i];
    const std::string who = absl::StrCat("fetch of array ", id, " from ", describe(*src.device));
    TESSERA_ASSIGN_OR_RETURN(pb::Worker::Stub * stub, state_->client->worker(src.device->address(), who));
    return internal::get_shard(stub, id, grant, src.index, out, who,
                               state_->client->transfer_path(src.device->address()),
                               state_->client->writes_our_memory(src.device->address()));
  });
}

absl::StatusOr<std::vector<HostArray>> device_get(const std::vector<Array>& arrays) {
  // A few arrays at a time (each fetch already reads its blocks in parallel): a thread per
  // array would not scale to thousands of them.
  constexpr int kLanes = 8;
  const int n = static_cast<int>(arrays.size());
  std::vector<HostArray> out(arrays.size());
  std::vector<absl::Status> errors(arrays.size());
  TESSERA_RETURN_IF_ERROR(internal::run_parallel(std::min(n, kLanes), [&](int lane) -> absl::Status {
    for (int i = lane; i < n; i += kLanes) {
      absl::StatusOr<HostArray> one = arrays[i].fetch();
      if (one.ok()) {
        out[i] = *std::move(one);
      } else {
        errors[i] =
            absl::Status(one.status().code(), absl::StrCat("device_get: array ", i, ": ", one.status().message()));
      }
    }
    return absl::OkStatus();
  }));
  for (const absl::Status& e : errors) TESSERA_RETURN_IF_ERROR(e);
  return out;
}

}  // namespace tessera
