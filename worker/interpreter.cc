#include "worker/interpreter.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/slicing.h"
#include "core/status.h"
#include "worker/collectives/engine.h"
#include "worker/kernels/kernels.h"

namespace tessera {

namespace {

absl::StatusOr<std::shared_ptr<const HostArray>> shared(absl::StatusOr<HostArray> a) {
  if (!a.ok()) return a.status();
  return std::make_shared<const HostArray>(*std::move(a));
}

// The operand an elementwise kernel can write its result over: one whose slot dies at the
// kernel and that nothing outside the slot holds (not the store, a send, or another slot).
int reusable_operand(const DevicePlan& plan, size_t k, const std::vector<std::shared_ptr<const HostArray>>& slots) {
  const Instruction& inst = plan.code[k];
  for (size_t j = 0; j < inst.in.size(); ++j) {
    const std::shared_ptr<const HostArray>& a = slots[inst.in[j]];
    if (can_run_in_place(inst.node, *a) && a.use_count() == 1 && freed_after(plan, k, inst.in[j])) {
      // use_count() is a relaxed load: order it before our writes, after the last holder's
      // reads (a gRPC thread dropping a zero-copy send's reference).
      std::atomic_thread_fence(std::memory_order_acquire);
      return static_cast<int>(j);
    }
  }
  return -1;
}

}  // namespace

std::string instruction_name(const Instruction& i) {
  return i.kind == Instruction::Kind::kCollective   ? collective_name(i.collective.kind)
         : i.kind == Instruction::Kind::kLocalSlice ? std::string("local_slice")
         : i.kind == Instruction::Kind::kLoop       ? std::string(i.branches.empty() ? "loop" : "while")
         : i.kind == Instruction::Kind::kSwitch     ? std::string("switch")
         : i.kind == Instruction::Kind::kFree       ? std::string("free")
                                                    : op_name(i.node.op);
}

namespace {

// Whether `plan` is within runs_inline's cost bounds, with no loop or switch and no collective
// other than all_reduces (none at all unless `all_reduces`).
bool within_inline_bounds(const DevicePlan& plan, int64_t input_bytes, bool all_reduces) {
  if (plan.code.size() > kInlineInstructions) return false;
  int64_t bytes = input_bytes;
  for (const Instruction& inst : plan.code) {
    if (inst.kind == Instruction::Kind::kLoop || inst.kind == Instruction::Kind::kSwitch) return false;
    if (inst.kind == Instruction::Kind::kCollective &&
        (!all_reduces || inst.collective.kind != CollectiveKind::kAllReduce)) {
      return false;
    }
    if (inst.kind != Instruction::Kind::kFree) bytes += num_elements(inst.node.shape) * dtype_size(inst.node.dtype);
  }
  return bytes <= kInlineBytes;
}

}  // namespace

bool runs_inline(const DevicePlan& plan, int64_t input_bytes) {
  return within_inline_bounds(plan, input_bytes, /*all_reduces=*/false);
}

bool runs_stepped(const DevicePlan& plan, int64_t input_bytes) {
  return within_inline_bounds(plan, input_bytes, /*all_reduces=*/true);
}

uint64_t plan_op_id(uint64_t execution, size_t index) { return execution + 1 + static_cast<uint64_t>(index); }

namespace {

using Arrays = std::vector<std::shared_ptr<const HostArray>>;

// Whether `run` has been given up on: CANCELLED once its `cancelled` says so, DEADLINE_EXCEEDED
// once its deadline has passed, OK otherwise. One call and one clock read (none without a
// deadline): cheap beside a kernel, so it is asked before each instruction that computes and
// each loop iteration (a straight-line plan of heavy kernels ends too, not only a loop).
absl::StatusCode given_up(const PlanRun& run) {
  if (run.cancelled && run.cancelled()) return absl::StatusCode::kCancelled;
  if (run.deadline != absl::Time() && absl::Now() > run.deadline) return absl::StatusCode::kDeadlineExceeded;
  return absl::StatusCode::kOk;
}

// given_up's `code` as an error, `where` (" at iteration 3 of 10") naming where it was seen.
absl::Status given_up_error(absl::StatusCode code, absl::string_view where) {
  return absl::Status(
      code, absl::StrCat(code == absl::StatusCode::kCancelled ? "the run was cancelled" : "the run's deadline passed",
                         where));
}

absl::StatusOr<Arrays> run_plan_at(const DevicePlan& plan, Arrays inputs, Transport& transport, const PlanRun& run,
                                   uint64_t first_op);

int64_t row_bytes(const ArrayType& stacked) {
  return stacked.shape.empty() || stacked.shape[0] == 0
             ? 0
             : num_elements(stacked.shape) / stacked.shape[0] * dtype_size(stacked.dtype);
}

std::string type_text(const HostArray& a) { return type_to_string(a.dtype(), a.shape()); }

// A loop instruction (a scan) on its operands: the body once per row, its collectives'
// op ids from `first_op` (iteration t's from first_op + t * the body's span). Checks the
// types the body gives back, and the run's cancellation and deadline before every iteration,
// so a long loop without collectives still ends when its run is given up on.
absl::StatusOr<Arrays> run_loop(const Instruction& inst, const std::vector<const HostArray*>& in,
                                const Arrays& operands, Transport& transport, const PlanRun& run, uint64_t first_op) {
  const DevicePlan& body = *inst.body;
  const size_t carries = static_cast<size_t>(inst.num_carry);
  Arrays carry(operands.begin(), operands.begin() + carries);
  std::vector<ArrayType> rows;  // of each xs
  for (size_t k = carries; k < in.size(); ++k) {
    if (in[k]->shape().empty() || in[k]->shape()[0] != inst.trip_count) {
      return absl::InvalidArgumentError(
          absl::StrCat("input ", k, " is ", type_text(*in[k]), ", not ", inst.trip_count, " rows"));
    }
    Shape row(in[k]->shape().begin() + 1, in[k]->shape().end());
    rows.push_back({in[k]->dtype(), std::move(row)});
  }
  std::vector<HostArray> stacked;
  for (size_t j = carries; j < inst.out_types.size(); ++j) {
    stacked.emplace_back(inst.out_types[j].dtype, inst.out_types[j].shape);
  }
  const uint64_t span = plan_op_span(body);
  for (int64_t t = 0; t < inst.trip_count; ++t) {
    if (const absl::StatusCode code = given_up(run); code != absl::StatusCode::kOk) {
      return given_up_error(code, absl::StrCat(" at iteration ", t, " of ", inst.trip_count));
    }
    const int64_t row = inst.reverse ? inst.trip_count - 1 - t : t;
    Arrays args = carry;
    for (size_t k = carries; k < in.size(); ++k) {
      auto x = std::make_shared<HostArray>(rows[k - carries].dtype, rows[k - carries].shape);
      std::memcpy(x->data(), in[k]->data() + row * x->nbytes(), static_cast<size_t>(x->nbytes()));
      args.push_back(std::move(x));
    }
    absl::StatusOr<Arrays> outs = run_plan_at(body, std::move(args), transport, run, first_op + t * span);
    if (!outs.ok()) {
      return absl::Status(outs.status().code(), absl::StrCat("iteration ", t, ": ", outs.status().message()));
    }
    if (outs->size() != inst.out_types.size()) {
      return absl::InternalError(
          absl::StrCat("the body returned ", outs->size(), " values, not ", inst.out_types.size()));
    }
    for (size_t j = 0; j < outs->size(); ++j) {
      const HostArray& v = *(*outs)[j];
      ArrayType want = inst.out_types[j];
      if (j >= carries) want.shape.erase(want.shape.begin());
      if (v.dtype() != want.dtype || v.shape() != want.shape) {
        return absl::InvalidArgumentError(absl::StrCat("iteration ", t, ": the body's result ", j, " is ", type_text(v),
                                                       ", not ", type_to_string(want.dtype, want.shape)));
      }
      if (j < carries) {
        carry[j] = (*outs)[j];
      } else {
        HostArray& dst = stacked[j - carries];
        const int64_t bytes = row_bytes(inst.out_types[j]);
        std::memcpy(dst.data() + row * bytes, v.data(), static_cast<size_t>(bytes));
      }
    }
  }
  for (size_t c = 0; c < carries; ++c) {  // a loop of no iterations returns its initial carries
    if (carry[c]->dtype() != inst.out_types[c].dtype || carry[c]->shape() != inst.out_types[c].shape) {
      return absl::InvalidArgumentError(absl::StrCat("carry ", c, " is ", type_text(*carry[c]), ", not ",
                                                     type_to_string(inst.out_types[c].dtype, inst.out_types[c].shape)));
    }
  }
  Arrays results = std::move(carry);
  for (HostArray& s : stacked) results.push_back(std::make_shared<const HostArray>(std::move(s)));
  return results;
}

// The results of a sub-plan (a while's body, a switch's branch) checked against `types`.
absl::Status check_results(const Arrays& outs, const std::vector<ArrayType>& types, const std::string& what) {
  if (outs.size() != types.size()) {
    return absl::InternalError(absl::StrCat(what, " returned ", outs.size(), " values, not ", types.size()));
  }
  for (size_t j = 0; j < outs.size(); ++j) {
    if (outs[j]->dtype() != types[j].dtype || outs[j]->shape() != types[j].shape) {
      return absl::InvalidArgumentError(absl::StrCat(what, "'s result ", j, " is ", type_text(*outs[j]), ", not ",
                                                     type_to_string(types[j].dtype, types[j].shape)));
    }
  }
  return absl::OkStatus();
}

// A while loop (lax.while_loop): the predicate on the carries, then the body while it holds.
// The predicate is replicated (the compiler makes it so), so every device stops at the same
// iteration. Before each iteration: the run's cancellation and deadline (so a loop that never
// ends is ended when its run is given up on), and the bound a loop with collectives has.
absl::StatusOr<Arrays> run_while(const Instruction& inst, Arrays carry, Transport& transport, const PlanRun& run,
                                 uint64_t first_op) {
  const DevicePlan& pred = *inst.branches[0];
  const uint64_t pred_span = plan_op_span(pred), span = pred_span + plan_op_span(*inst.body);
  for (int64_t t = 0;; ++t) {
    if (const absl::StatusCode code = given_up(run); code != absl::StatusCode::kOk) {
      return given_up_error(code, absl::StrCat(" at iteration ", t, " of a while loop"));
    }
    const uint64_t at = first_op + static_cast<uint64_t>(t) * span;
    absl::StatusOr<Arrays> p = run_plan_at(pred, carry, transport, run, at);
    if (!p.ok())
      return absl::Status(p.status().code(), absl::StrCat("iteration ", t, "'s predicate: ", p.status().message()));
    TESSERA_RETURN_IF_ERROR(check_results(*p, {{DType::kBool, {}}}, "the predicate"));
    if ((*p)[0]->data()[0] == std::byte{0}) break;
    if (inst.trip_count > 0 && t >= inst.trip_count) {
      return absl::OutOfRangeError(absl::StrCat("a while loop with collectives reached its bound of ", inst.trip_count,
                                                " iterations (the op ids a run reserves for them)"));
    }
    absl::StatusOr<Arrays> outs = run_plan_at(*inst.body, carry, transport, run, at + pred_span);
    if (!outs.ok())
      return absl::Status(outs.status().code(), absl::StrCat("iteration ", t, ": ", outs.status().message()));
    TESSERA_RETURN_IF_ERROR(check_results(*outs, inst.out_types, absl::StrCat("iteration ", t, ": the body")));
    carry = *std::move(outs);
  }
  TESSERA_RETURN_IF_ERROR(check_results(carry, inst.out_types, "the loop"));
  return carry;
}

// A switch (lax.switch): the branch at the index, clamped into range as lax.switch does.
absl::StatusOr<Arrays> run_switch(const Instruction& inst, const Arrays& operands, Transport& transport,
                                  const PlanRun& run, uint64_t first_op) {
  const HostArray& index = *operands[0];
  if (index.dtype() != DType::kI32 || !index.shape().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the index is ", type_text(index), ", not i32[]"));
  }
  int32_t k = 0;
  std::memcpy(&k, index.data(), sizeof(k));
  const int64_t n = static_cast<int64_t>(inst.branches.size());
  const int64_t b = std::clamp<int64_t>(k, 0, n - 1);
  absl::StatusOr<Arrays> outs =
      run_plan_at(*inst.branches[b], Arrays(operands.begin() + 1, operands.end()), transport, run, first_op);
  if (!outs.ok()) return absl::Status(outs.status().code(), absl::StrCat("branch ", b, ": ", outs.status().message()));
  TESSERA_RETURN_IF_ERROR(check_results(*outs, inst.out_types, absl::StrCat("branch ", b)));
  return outs;
}

absl::StatusOr<Arrays> run_plan_at(const DevicePlan& plan, Arrays inputs, Transport& transport, const PlanRun& run,
                                   uint64_t first_op) {
  SteppedPlanRun stepped(plan, std::move(inputs), transport, run, first_op, /*nested=*/true);
  stepped.advance(nullptr);  // waits: always done
  return stepped.take_result();
}

}  // namespace

SteppedPlanRun::SteppedPlanRun(const DevicePlan& plan, std::vector<std::shared_ptr<const HostArray>> inputs,
                               Transport& transport, const PlanRun& run, uint64_t first_op, bool nested)
    : plan_(plan),
      transport_(transport),
      run_(run),
      op_(first_op),
      first_op_(first_op),
      end_op_(first_op + plan_op_span(plan)),
      nested_(nested),
      slots_(static_cast<size_t>(plan.num_slots)) {
  // Peers' messages of this run's ops are awaited from now on, however far ahead they run.
  if (holds_ops()) transport_.begin_run_ops(first_op_, end_op_, run_.run_tag);
  if (inputs.size() != plan.input_slots.size()) {
    result_ = absl::InvalidArgumentError(
        absl::StrCat("run: the plan takes ", plan.input_slots.size(), " inputs, got ", inputs.size()));
    k_ = plan.code.size();
    return;
  }
  for (size_t i = 0; i < inputs.size(); ++i) slots_[plan.input_slots[i]] = std::move(inputs[i]);
}

SteppedPlanRun::~SteppedPlanRun() {
  if (holds_ops()) transport_.end_run_ops(first_op_, end_op_, run_.run_tag);
}

void SteppedPlanRun::fail(const Instruction& inst, const absl::Status& status) {
  // The ops of the instructions it will not run: peers' messages for them go, now and later.
  // A run without collectives has none that a peer sends to (it claimed no range either).
  if (run_.has_collectives) transport_.finish_ops(op_, end_op_);
  result_ = absl::Status(status.code(),
                         absl::StrCat("instruction ", k_, " (", instruction_name(inst), "): ", status.message()));
  k_ = plan_.code.size();
}

void SteppedPlanRun::abandon(const absl::Status& status) {
  if (k_ >= plan_.code.size()) return;
  collective_.reset();
  fail(plan_.code[k_], status);
}

SteppedPlanRun::State SteppedPlanRun::advance(const ParkFn& park) {
  const DevicePlan& plan = plan_;
  Arrays& slots = slots_;
  for (; k_ < plan.code.size(); ++k_) {
    const size_t k = k_;
    const Instruction& inst = plan.code[k];
    const uint64_t this_op = op_;
    if (park && (inst.kind == Instruction::Kind::kLoop || inst.kind == Instruction::Kind::kSwitch)) {
      return State::kNeedsThread;  // its body may wait
    }
    // Given up on (cancelled, or past its deadline): stop before the next instruction that
    // computes, not only at a loop's next iteration or a collective's wait. Not before a free
    // (bookkeeping, not worth a clock read), nor when resuming a parked collective (it watches
    // both itself while it waits).
    if (inst.kind != Instruction::Kind::kFree && collective_ == nullptr) {
      if (const absl::StatusCode code = given_up(run_); code != absl::StatusCode::kOk) {
        fail(inst, given_up_error(code, " before it ran"));
        return State::kDone;
      }
    }
    std::vector<const HostArray*>& in = operands_;  // reused: no allocation per instruction
    in.clear();
    for (int s : inst.in) in.push_back(slots[s].get());
    // Set by every case with a result; a case that missed it would fail the run (a default
    // StatusOr is UNKNOWN, not OK), with its instruction named.
    absl::StatusOr<std::shared_ptr<const HostArray>> out;
    // Kernels and local slices are timed here, collectives by the engine (with their bytes).
    ProfileSpan span(inst.kind == Instruction::Kind::kKernel || inst.kind == Instruction::Kind::kLocalSlice
                         ? &transport_.profile()
                         : nullptr,
                     "kernel", [&] { return instruction_name(inst); });
    if (span) {
      span.arg("result", type_to_string(inst.node.dtype, inst.node.shape));
      span.arg("instruction", absl::StrCat(k));
    }
    bool has_out = true;  // whether `out` is the instruction's result (not for frees, loops, switches)
    switch (inst.kind) {
      case Instruction::Kind::kFree:
        slots[inst.in[0]].reset();
        has_out = false;
        break;
      case Instruction::Kind::kKernel:
        if (const int reuse = reusable_operand(plan, k, slots); reuse >= 0) {
          absl::Status done = run_kernel_in_place(inst.node, in, reuse);
          out = done.ok() ? absl::StatusOr<std::shared_ptr<const HostArray>>(slots[inst.in[reuse]]) : done;
        } else {
          out = shared(run_kernel(inst.node, in));
        }
        break;
      case Instruction::Kind::kLocalSlice: {
        absl::Status valid = validate_index(inst.slice, in[0]->shape());
        out = valid.ok() ? shared(extract_block(*in[0], inst.slice)) : valid;
        break;
      }
      case Instruction::Kind::kCollective: {
        if (collective_ == nullptr) {
          CollectiveRun c;
          c.op = this_op;
          c.run_tag = run_.run_tag;
          c.spec = inst.collective;
          c.peers = run_.peers;
          c.self = run_.self;
          c.start = absl::Now();
          c.deadline = run_.deadline;
          c.cancelled = run_.cancelled;
          for (size_t j = 1; j < inst.in.size(); ++j) c.ragged_operands.push_back(slots[inst.in[j]]);
          if (!park) {
            out = run_collective(transport_, c, slots[inst.in[0]]);
          } else if (absl::StatusOr<std::unique_ptr<SteppedCollective>> stepped =
                         SteppedCollective::start(transport_, std::move(c), slots[inst.in[0]]);
                     !stepped.ok()) {
            out = stepped.status();
          } else if (*stepped == nullptr) {
            return State::kNeedsThread;  // nothing of it ran: run_collective it where it may wait
          } else {
            collective_ = *std::move(stepped);
          }
        }
        if (collective_ != nullptr) {
          out = collective_->advance(park);
          // Parked: whoever resumes the run may be running it already; touch nothing of it.
          if (out.ok() && *out == nullptr) return State::kParked;
          collective_.reset();
        }
        transport_.finish_op(this_op);
        break;
      }
      case Instruction::Kind::kSwitch:
      case Instruction::Kind::kLoop: {
        Arrays operands;
        for (int s : inst.in) operands.push_back(slots[s]);
        absl::StatusOr<Arrays> results =
            inst.kind == Instruction::Kind::kSwitch ? run_switch(inst, operands, transport_, run_, this_op + 1)
            : inst.branches.empty()                 ? run_loop(inst, in, operands, transport_, run_, this_op + 1)
                                                    : run_while(inst, operands, transport_, run_, this_op + 1);
        if (results.ok()) {
          slots[inst.out] = (*results)[0];
          for (size_t j = 0; j < inst.extra_out.size(); ++j) slots[inst.extra_out[j]] = (*results)[j + 1];
          has_out = false;
          break;
        }
        out = results.status();
        break;
      }
    }
    if (has_out && !out.ok()) {
      fail(inst, out.status());
      return State::kDone;
    }
    if (has_out) slots[inst.out] = *std::move(out);
    op_ += instruction_op_span(inst);
  }
  if (result_.ok()) {  // not failed (by the constructor's check, or an instruction)
    Arrays outputs;
    for (int s : plan.output_slots) outputs.push_back(slots[s]);
    result_ = std::move(outputs);
  }
  return State::kDone;
}

absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> SteppedPlanRun::take_result() {
  return std::move(result_);
}

absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> run_plan(
    const DevicePlan& plan, std::vector<std::shared_ptr<const HostArray>> inputs, Transport& transport,
    const PlanRun& run) {
  ProfileSpan span(&transport.profile(), "plan", [] { return std::string("plan"); });
  if (span) span.arg("execution", absl::StrCat(run.execution));  // when recording only: an allocation per run
  SteppedPlanRun stepped(plan, std::move(inputs), transport, run, plan_op_id(run.execution, 0));
  stepped.advance(nullptr);  // waits: always done
  return stepped.take_result();
}

}  // namespace tessera
