#include "worker/collectives/peer_view.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/bounded_join.h"
#include "proto/rpc.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace {

constexpr char kRule[] =
    "a worker takes collective data only from the current incarnations of the cluster's registered devices";

std::string describe(const StreamClaim& c) {
  return absl::StrCat("device ", c.device, " (incarnation ", c.incarnation, " of coordinator epoch ", c.epoch, ")");
}

// The alive devices of a view, for a refusal: at most the first kNamed, so that a refusal at a
// cluster of thousands still fits the status trailer (gRPC's 8 KiB of metadata).
std::string alive_devices(const std::map<int, uint64_t>& peers) {
  return absl::StrCat("alive: ", join_at_most(peers, 32, ", ", [](std::string* out, const auto& peer) {
                        absl::StrAppend(out, peer.first);
                      }));
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

int PeerView::admitted() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(admitted_.size());
}

void PeerView::ended(uint64_t id) {
  absl::MutexLock lock(&mu_);
  waiting_.erase(id);
  admitted_.erase(id);
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
    *why = absl::StrCat(refused, "device ", c.device, " is not a registered device of this cluster (",
                        alive_devices(peers_), "); ", kRule);
  } else {
    *why = absl::StrCat(refused, "the coordinator says device ", c.device, "'s current incarnation is ", it->second,
                        "; ", kRule);
  }
  return Verdict::kRefuse;
}

bool PeerView::replaced_locked(const StreamClaim& c, std::string* why) const {
  if (!known_) return false;
  const std::string ended =
      absl::StrCat("Exchange: ended the stream from ", describe(c), " at a new view of the cluster: ");
  if (c.device < 0 || c.epoch == 0 || c.incarnation == 0) {
    *why = absl::StrCat(ended, "it does not declare its sender; ", kRule);
    return true;
  }
  if (c.epoch > epoch_) return false;  // a view behind the stream's: it says nothing of it
  auto it = peers_.find(c.device);
  const std::string now = it == peers_.end() ? std::string("none") : absl::StrCat(it->second);
  if (c.epoch < epoch_) {
    *why = absl::StrCat(ended, "this worker now holds a registration of coordinator epoch ", epoch_,
                        ", whose current incarnation of device ", c.device, " is ", now, "; ", kRule);
    return true;
  }
  if (it == peers_.end()) {
    *why = absl::StrCat(ended, "device ", c.device, " is no longer a registered device of this cluster (",
                        alive_devices(peers_), "; its current incarnation: none); ", kRule);
    return true;
  }
  if (it->second > c.incarnation) {
    *why = absl::StrCat(ended, "the coordinator says device ", c.device, "'s current incarnation is ", it->second,
                        ", which replaced incarnation ", c.incarnation, "; ", kRule);
    return true;
  }
  return false;
}

uint64_t PeerView::admit(const StreamClaim& claim, std::function<void(absl::Status)> decided,
                         std::function<void(absl::Status)> replaced) {
  absl::Status status;
  bool waits = false;
  uint64_t id = 0;
  std::function<void()> refresh;
  {
    absl::MutexLock lock(&mu_);
    std::string why;
    switch (judge_locked(claim, false, &why)) {
      case Verdict::kAdmit:
        // Checked by every view from now on: one applied before decided(OK) below may already
        // call `replaced` (the caller orders the two).
        id = ++next_id_;
        admitted_.emplace(id, Admitted{claim, std::move(replaced), /*named=*/known_, asked_ + 1});
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
        id = ++next_id_;
        waiting_.emplace(id, Waiting{claim, asked_ + 1, absl::Now(), std::move(decided), std::move(replaced)});
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
  return id;
}

uint64_t PeerView::view_version(uint64_t epoch) const {
  absl::MutexLock lock(&mu_);
  return known_ && epoch_ == epoch ? version_ : 0;
}

absl::Status PeerView::update(uint64_t ticket, uint64_t epoch, uint64_t held, const pb::ClusterPeers* peers,
                              absl::string_view reply) {
  if (peers != nullptr) return update(ticket, epoch, *peers);
  if (held == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the coordinator's ", reply, " names no peers (ClusterPeers, protocol version ", kProtocolVersion,
                     ") though the request held no view of epoch ", epoch, "; the view is unchanged"));
  }
  // The coordinator says the view of version `held` is current: the view held, if it is still
  // that one, is as fresh as one this reply would have carried.
  Decided decided;
  {
    absl::MutexLock lock(&mu_);
    if (known_ && epoch_ == epoch && version_ == held) judge_streams_locked(ticket, &decided);
  }
  for (auto& [done, status] : decided) done(status);
  return absl::OkStatus();
}

absl::Status PeerView::update(uint64_t ticket, uint64_t epoch, const pb::ClusterPeers& view) {
  std::map<int, uint64_t> peers;
  for (int i = 0; i < view.devices_size(); ++i) {
    const pb::PeerRegistration& p = view.devices(i);
    if (p.device_id() < 0 || p.incarnation() == 0 || !peers.emplace(p.device_id(), p.incarnation()).second) {
      return absl::InvalidArgumentError(absl::StrCat("the coordinator's ClusterPeers entry ", i, " (device ",
                                                     p.device_id(), ", incarnation ", p.incarnation(),
                                                     ") is not a distinct device (id from 0) with an incarnation "
                                                     "from 1; the view is unchanged"));
    }
  }
  Decided decided;
  {
    absl::MutexLock lock(&mu_);
    known_ = true;
    epoch_ = epoch;
    version_ = view.version();
    peers_ = std::move(peers);
    judge_streams_locked(ticket, &decided);
  }
  for (auto& [done, status] : decided) done(status);
  return absl::OkStatus();
}

void PeerView::judge_streams_locked(uint64_t ticket, Decided* decided) {
  // The streams read so far whose registration this view says was replaced end first, before
  // anything else of this view is acted on.
  for (auto it = admitted_.begin(); it != admitted_.end();) {
    Admitted& a = it->second;
    std::string why;
    bool ends = false;
    if (a.named) {
      ends = replaced_locked(a.claim, &why);
    } else {
      const Verdict v = judge_locked(a.claim, ticket >= a.needed_ticket, &why);
      a.named = v == Verdict::kAdmit;
      ends = v == Verdict::kRefuse;
    }
    if (!ends) {
      ++it;
      continue;
    }
    if (it->second.replaced) decided->emplace_back(std::move(it->second.replaced), absl::PermissionDeniedError(why));
    it = admitted_.erase(it);
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiting& w = it->second;
    std::string why;
    const Verdict v = judge_locked(w.claim, ticket >= w.needed_ticket, &why);
    if (v == Verdict::kWait) {
      ++it;
      continue;
    }
    if (v == Verdict::kAdmit) admitted_.emplace(it->first, Admitted{w.claim, std::move(w.replaced), true, 0});
    decided->emplace_back(std::move(w.decided),
                          v == Verdict::kAdmit ? absl::OkStatus() : absl::PermissionDeniedError(why));
    it = waiting_.erase(it);
  }
}

void PeerView::expire(absl::Time now) {
  Decided decided;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (now - it->second.since < kMaxWait) {
        ++it;
        continue;
      }
      decided.emplace_back(
          std::move(it->second.decided),
          absl::UnavailableError(absl::StrCat(
              "Exchange: a stream from ", describe(it->second.claim), " waited ", absl::FormatDuration(kMaxWait),
              " for this worker to hear from the coordinator whether its sender is registered; ",
              "none came (is the coordinator answering heartbeats?)")));
      it = waiting_.erase(it);
    }
  }
  for (auto& [done, status] : decided) done(status);
}

}  // namespace tessera
