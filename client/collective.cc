#include "tessera/collective.h"

#include "absl/strings/str_cat.h"
#include "client/client_impl.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/rpc.h"

namespace tessera {

absl::StatusOr<Array> run_collective(const Array& input, const CollectiveSpec& spec, absl::Duration timeout,
                                     CollectiveTiming* timing) {
  const internal::ArrayState& state = internal::array_state(input);
  TESSERA_ASSIGN_OR_RETURN(uint64_t input_id, state.ready_id());
  pb::RunCollectiveRequest req;
  req.set_array_id(input_id);
  to_proto(spec, req.mutable_spec());
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  req.set_session_id(state.client->session());
  if (timing != nullptr) req.set_barrier_first(timing->barrier_first);
  pb::RunCollectiveReply reply;
  TESSERA_RETURN_IF_ERROR(internal::with_adoption(state, input_id, [&] {
    grpc::ClientContext ctx;
    set_deadline(&ctx, timeout + absl::Seconds(10));
    return from_grpc(state.client->coordinator()->RunCollective(&ctx, req, &reply),
                     absl::StrCat("coordinator ", state.client->coordinator_address()));
  }));
  if (timing != nullptr) timing->collective = absl::Nanoseconds(reply.collective_ns());
  const pb::ArrayInfo& info = reply.result();
  TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(info.dtype()));
  TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(info.shape(), dtype));
  state.client->track(info.array_id(), info);
  state.client->remember_grant(info.array_id(), info.grant());
  return internal::make_array(
      internal::ArrayState::placed(state.client, info.array_id(), dtype, shape, state.sharding));
}

}  // namespace tessera
