#include "worker/collectives/peer_view.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "proto/auth.h"

namespace tessera {
namespace {

constexpr char kRule[] =
    "a worker takes collective data only from the current incarnations of the cluster's registered devices";

std::string describe(const StreamClaim& c) {
  return absl::StrCat("device ", c.device, " (incarnation ", c.incarnation, " of coordinator epoch ", c.epoch, ")");
}

}  // namespace

void PeerView::set_refresh(std::function<void()> refresh) {
  absl::MutexLock lock(&mu_);
  refresh_ = std::move(refresh);
}

uint64_t PeerView::ask() {
  absl::MutexLock lock(&mu_);
  return ++asked_;
}

int PeerView::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiting_.size());
}

PeerView::Verdict PeerView::judge_locked(const StreamClaim& c, bool fresh, std::string* why) const {
  if (!known_) return Verdict::kAdmit;  // nothing to check against
  if (c.device < 0 || c.epoch == 0 || c.incarnation == 0) {
    *why = absl::StrCat("Exchange: the stream does not declare its sender ('tessera-device' ", c.device,
                        ", 'tessera-epoch' ", c.epoch, ", 'tessera-incarnation' ", c.incarnation, "); ", kRule);
    return Verdict::kRefuse;
  }
  const std::string refused = absl::StrCat("Exchange: refused a stream from ", describe(c), ": ");
  if (c.epoch < epoch_) {
    *why =
        absl::StrCat(refused, "an earlier coordinator epoch than this worker's registration (", epoch_, "); ", kRule);
    return Verdict::kRefuse;
  }
  auto it = peers_.find(c.device);
  if (c.epoch == epoch_ && it != peers_.end()) {
    if (c.incarnation == it->second) return Verdict::kAdmit;
    if (c.incarnation < it->second) {
      *why = absl::StrCat(refused, "an earlier incarnation of device ", c.device, ", whose current one is ", it->second,
                          "; ", kRule);
      return Verdict::kRefuse;
    }
  }
  if (!fresh) return Verdict::kWait;  // this worker may not have heard of it yet
  if (c.epoch != epoch_) {
    *why = absl::StrCat(refused, "another coordinator epoch than this worker's registration (", epoch_, "); ", kRule);
  } else if (it == peers_.end()) {
    std::vector<int> alive;
    for (const auto& [device, incarnation] : peers_) alive.push_back(device);
    *why =
        absl::StrCat(refused, "device ", c.device,
                     " is not a registered device of this cluster (alive: ", absl::StrJoin(alive, ", "), "); ", kRule);
  } else {
    *why = absl::StrCat(refused, "the coordinator says device ", c.device, "'s current incarnation is ", it->second,
                        "; ", kRule);
  }
  return Verdict::kRefuse;
}

void PeerView::admit(const StreamClaim& claim, std::function<void(absl::Status)> decided) {
  absl::Status status;
  bool waits = false;
  std::function<void()> refresh;
  {
    absl::MutexLock lock(&mu_);
    std::string why;
    switch (judge_locked(claim, false, &why)) {
      case Verdict::kAdmit:
        break;
      case Verdict::kRefuse:
        status = absl::PermissionDeniedError(why);
        break;
      case Verdict::kWait:
        if (static_cast<int>(waiting_.size()) >= kMaxWaiting) {
          status = absl::ResourceExhaustedError(absl::StrCat(
              "Exchange: ", kMaxWaiting, " streams already wait for this worker to hear of their senders; refused ",
              describe(claim)));
          break;
        }
        waiting_.push_back({claim, asked_ + 1, absl::Now(), std::move(decided)});
        waits = true;
        refresh = refresh_;
        break;
    }
  }
  if (!waits) {
    decided(status);
  } else if (refresh) {
    refresh();
  }
}

absl::Status PeerView::update(uint64_t ticket, uint64_t epoch, absl::string_view text) {
  using Peers = std::map<int, uint64_t>;
  TESSERA_ASSIGN_OR_RETURN(Peers peers, parse_peers(text));
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> decided;
  {
    absl::MutexLock lock(&mu_);
    known_ = true;
    epoch_ = epoch;
    peers_ = std::move(peers);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      std::string why;
      const Verdict v = judge_locked(it->claim, ticket >= it->needed_ticket, &why);
      if (v == Verdict::kWait) {
        ++it;
        continue;
      }
      decided.emplace_back(std::move(it->decided),
                           v == Verdict::kAdmit ? absl::OkStatus() : absl::PermissionDeniedError(why));
      it = waiting_.erase(it);
    }
  }
  for (auto& [done, status] : decided) done(status);
  return absl::OkStatus();
}

void PeerView::expire(absl::Time now) {
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> decided;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (now - it->since < kMaxWait) {
        ++it;
        continue;
      }
      decided.emplace_back(
          std::move(it->decided),
          absl::UnavailableError(
              absl::StrCat("Exchange: a stream from ", describe(it->claim), " waited ", absl::FormatDuration(kMaxWait),
                           " for this worker to hear from the coordinator whether its sender is registered; ",
                           "none came (is the coordinator answering heartbeats?)")));
      it = waiting_.erase(it);
    }
  }
  for (auto& [done, status] : decided) done(status);
}

}  // namespace tessera
