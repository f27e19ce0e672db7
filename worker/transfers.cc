#include "worker/transfers.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/handoff.h"
#include "core/run_tag.h"
#include "core/shm_transfer.h"
#include "core/slicing.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/in_process.h"
#include "proto/rpc.h"
#include "worker/put_shard.h"

namespace tessera {

// The transport remembers the ends of fan-outs apart from the runs' ordered op ids.
static_assert(Transfers::kFanOutOpBit == Transport::kUnorderedOps);

namespace {

using internal::TcpEndpoint;

// The endpoint of a gRPC peer ("ipv4:127.0.0.1:54321", "ipv6:[::1]:54321", '%'-escaped or
// not); nullopt for any other (unix:, inproc:, ...).
std::optional<TcpEndpoint> peer_endpoint(const std::string& peer) {
  std::string text;  // unescaped
  for (size_t i = 0; i < peer.size(); ++i) {
    int byte = 0;
    if (peer[i] == '%' && i + 2 < peer.size() && absl::SimpleHexAtoi(peer.substr(i + 1, 2), &byte)) {
      text.push_back(static_cast<char>(byte));
      i += 2;
    } else {
      text.push_back(peer[i]);
    }
  }
  const size_t colon = text.rfind(':');
  TcpEndpoint end;
  if (colon == std::string::npos || !absl::SimpleAtoi(text.substr(colon + 1), &end.port) || end.port <= 0 ||
      end.port > 65535) {
    return std::nullopt;
  }
  absl::string_view host = absl::string_view(text).substr(0, colon);
  if (absl::ConsumePrefix(&host, "ipv4:")) {
    in_addr v4;
    if (inet_pton(AF_INET, std::string(host).c_str(), &v4) != 1) return std::nullopt;
    return TcpEndpoint::v4(&v4, end.port);
  }
  if (!absl::ConsumePrefix(&host, "ipv6:[") || !absl::ConsumeSuffix(&host, "]")) return std::nullopt;
  host = host.substr(0, host.find('%'));  // a zone
  if (inet_pton(AF_INET6, std::string(host).c_str(), end.address.data()) != 1) return std::nullopt;
  return end;
}

// An endpoint as /proc/net/tcp{,6} print it: the address's 32-bit words in hex, each in this
// host's byte order, ':', the port in hex.
std::optional<TcpEndpoint> proc_endpoint(absl::string_view text) {
  const size_t colon = text.find(':');
  TcpEndpoint end;
  if (colon == absl::string_view::npos || !absl::SimpleHexAtoi(text.substr(colon + 1), &end.port)) return std::nullopt;
  const absl::string_view hex = text.substr(0, colon);
  if (hex.size() != 8 && hex.size() != 32) return std::nullopt;
  if (hex.size() == 8) end = TcpEndpoint::v4("\0\0\0\0", end.port);
  unsigned char* at = end.address.data() + (hex.size() == 8 ? 12 : 0);
  for (size_t i = 0; i < hex.size(); i += 8) {
    uint32_t word = 0;
    if (!absl::SimpleHexAtoi(hex.substr(i, 8), &word)) return std::nullopt;
    std::memcpy(at + i / 2, &word, sizeof word);
  }
  return end;
}

bool is_v4_mapped(const TcpEndpoint& end) {
  static constexpr std::array<unsigned char, 12> kPrefix{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::equal(kPrefix.begin(), kPrefix.end(), end.address.begin());
}

// A sock_diag request: the header and the request proper (inet_diag_req_v2, or the older
// inet_diag_req).
template <typename Diag>
struct DiagRequest {
  nlmsghdr header;
  Diag diag;
};

// Sends `diag`, a dump request of netlink type `type` and sequence number `seq`, to the kernel.
template <typename Diag>
absl::Status send_dump(int fd, uint16_t type, uint32_t seq, const Diag& diag) {
  DiagRequest<Diag> request{};
  request.header.nlmsg_len = sizeof request;
  request.header.nlmsg_type = type;
  request.header.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
  request.header.nlmsg_seq = seq;
  request.diag = diag;
  static_assert(sizeof request == NLMSG_LENGTH(sizeof(Diag)));
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  ssize_t sent;
  do {
    sent = sendto(fd, &request, sizeof request, 0, reinterpret_cast<const sockaddr*>(&kernel), sizeof kernel);
  } while (sent < 0 && errno == EINTR);
  if (sent != static_cast<ssize_t>(sizeof request)) {
    return absl::UnavailableError(absl::StrCat("sending an inet_diag request: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// One NETLINK_SOCK_DIAG dump of the established TCP sockets from local port `local.port` to
// remote port `remote_port`, the inodes of those whose local address is `local`'s appended to
// `inodes`. The kernel's walk of its established hash skips the sockets whose ports differ from
// the request's (inet_diag's id.idiag_sport / idiag_dport, when not 0), so the answer holds the
// matches only; the state, ports and address are checked here again all the same. `family`
// AF_INET or AF_INET6: that family's sockets (SOCK_DIAG_BY_FAMILY); AF_UNSPEC: both in one walk
// of the hash, through the older TCPDIAG_GETSOCK request, which dumps every family. Only the
// kernel's answers count (sender port 0, the request's sequence number, not truncated).
absl::Status sock_diag_dump(int fd, int family, const TcpEndpoint& local, int remote_port,
                            std::vector<uint64_t>* inodes) {
  inet_diag_sockid id{};
  id.idiag_sport = htons(static_cast<uint16_t>(local.port));
  id.idiag_dport = htons(static_cast<uint16_t>(remote_port));
  const uint32_t states = 1u << TCP_ESTABLISHED;
  const uint32_t seq = static_cast<uint32_t>(random_run_tag());  // not guessable by another process
  const uint16_t type = family == AF_UNSPEC ? TCPDIAG_GETSOCK : SOCK_DIAG_BY_FAMILY;
  if (family == AF_UNSPEC) {
    inet_diag_req every_family{};
    every_family.idiag_states = states;
    every_family.id = id;
    TESSERA_RETURN_IF_ERROR(send_dump(fd, type, seq, every_family));
  } else {
    inet_diag_req_v2 by_family{};
    by_family.sdiag_family = static_cast<uint8_t>(family);
    by_family.sdiag_protocol = IPPROTO_TCP;
    by_family.idiag_states = states;
    by_family.id = id;
    TESSERA_RETURN_IF_ERROR(send_dump(fd, type, seq, by_family));
  }
  alignas(nlmsghdr) char buffer[32768];  // the kernel's dump messages are at most 32 KiB
  while (true) {
    sockaddr_nl from{};
    iovec io{buffer, sizeof buffer};
    msghdr message{};
    message.msg_name = &from;
    message.msg_namelen = sizeof from;
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    ssize_t got;
    do {
      got = recvmsg(fd, &message, 0);
    } while (got < 0 && errno == EINTR);
    if (got < 0) return absl::UnavailableError(absl::StrCat("reading inet_diag's answer: ", std::strerror(errno)));
    if (got == 0) return absl::UnavailableError("reading inet_diag's answer: the socket closed");
    if ((message.msg_flags & MSG_TRUNC) != 0) {
      return absl::UnavailableError("reading inet_diag's answer: a message longer than 32 KiB");
    }
    if (from.nl_pid != 0) continue;  // not the kernel's
    int left = static_cast<int>(got);
    for (const nlmsghdr* m = reinterpret_cast<const nlmsghdr*>(buffer); NLMSG_OK(m, left); m = NLMSG_NEXT(m, left)) {
      if (m->nlmsg_seq != seq) continue;
      if (m->nlmsg_type == NLMSG_DONE) {
        // A dump that failed on the way (tcp_diag not loadable, say) ends with a negative errno.
        const int* error = static_cast<const int*>(NLMSG_DATA(m));
        if (m->nlmsg_len >= NLMSG_LENGTH(sizeof *error) && *error < 0) {
          return absl::UnavailableError(absl::StrCat("inet_diag's dump failed: ", std::strerror(-*error)));
        }
        return absl::OkStatus();
      }
      if (m->nlmsg_type == NLMSG_ERROR) {
        const auto* error = static_cast<const nlmsgerr*>(NLMSG_DATA(m));
        return absl::UnavailableError(
            absl::StrCat("inet_diag refused the request: ",
                         std::strerror(m->nlmsg_len >= NLMSG_LENGTH(sizeof *error) ? -error->error : EPROTO)));
      }
      if (m->nlmsg_type != type || m->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) continue;
      const auto* socket = static_cast<const inet_diag_msg*>(NLMSG_DATA(m));
      TcpEndpoint end = TcpEndpoint::v4(socket->id.idiag_src, ntohs(socket->id.idiag_sport));
      if (socket->idiag_family != AF_INET) std::memcpy(end.address.data(), socket->id.idiag_src, 16);
      if (socket->idiag_state == TCP_ESTABLISHED && end == local && ntohs(socket->id.idiag_dport) == remote_port &&
          socket->idiag_inode != 0) {
        inodes->push_back(socket->idiag_inode);
      }
    }
  }
}

}  // namespace

namespace internal {

absl::StatusOr<std::vector<uint64_t>> sock_diag_established_tcp_inodes(const TcpEndpoint& local, int remote_port,
                                                                       SockDiag dumps) {
  const int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(NETLINK_SOCK_DIAG): ", std::strerror(errno)));
  const absl::Cleanup closed = [fd] { close(fd); };
  // The kernel answers a dump at once; the timeout bounds a recv that would not return.
  const timeval timeout{2, 0};
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout) != 0) {
    return absl::UnavailableError(absl::StrCat("setsockopt(SO_RCVTIMEO) on NETLINK_SOCK_DIAG: ", std::strerror(errno)));
  }
  std::vector<uint64_t> inodes;
  // Both families in one walk of the kernel's hash table; else (asked, or the kernel has not
  // the older request) a walk per family. An IPv4 socket has an IPv4 local end; an IPv6 one
  // either (an IPv4 one v4-mapped).
  // A kernel that refused the one dump while the dumps per family answered is not asked it again.
  static std::atomic<bool> one_dump_refused{false};
  const bool one_dump =
      dumps == SockDiag::kOneDump || (dumps == SockDiag::kEither && !one_dump_refused.load(std::memory_order_relaxed));
  absl::Status status = absl::UnavailableError("not asked");
  if (one_dump) status = sock_diag_dump(fd, AF_UNSPEC, local, remote_port, &inodes);
  if (!status.ok() && dumps != SockDiag::kOneDump) {
    inodes.clear();
    status = absl::OkStatus();
    for (const int family : {AF_INET, AF_INET6}) {
      if (family == AF_INET && !is_v4_mapped(local)) continue;
      status = sock_diag_dump(fd, family, local, remote_port, &inodes);
      if (!status.ok()) break;
    }
    if (status.ok() && one_dump) one_dump_refused.store(true, std::memory_order_relaxed);
  }
  if (!status.ok()) return status;
  std::sort(inodes.begin(), inodes.end());
  inodes.erase(std::unique(inodes.begin(), inodes.end()), inodes.end());
  return inodes;
}

absl::StatusOr<std::vector<uint64_t>> proc_established_tcp_inodes(const TcpEndpoint& local, int remote_port) {
  std::vector<uint64_t> inodes;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    if (!in) return absl::FailedPreconditionError(absl::StrCat("cannot read ", table));
    std::string line;
    std::getline(in, line);  // the column names
    while (std::getline(in, line)) {
      // "sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ..."
      const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.size() < 10 || fields[3] != "01") continue;  // TCP_ESTABLISHED
      const std::optional<TcpEndpoint> end = proc_endpoint(fields[1]);
      if (!end.has_value() || !(*end == local)) continue;
      const std::optional<TcpEndpoint> remote = proc_endpoint(fields[2]);
      uint64_t inode = 0;
      if (remote.has_value() && remote->port == remote_port && absl::SimpleAtoi(fields[9], &inode) && inode != 0) {
        inodes.push_back(inode);
      }
    }
  }
  // Not a snapshot: read in pieces while sockets come and go, a line can be read twice.
  std::sort(inodes.begin(), inodes.end());
  inodes.erase(std::unique(inodes.begin(), inodes.end()), inodes.end());
  return inodes;
}

absl::StatusOr<std::vector<uint64_t>> established_tcp_inodes(const TcpEndpoint& local, int remote_port) {
  absl::StatusOr<std::vector<uint64_t>> asked = sock_diag_established_tcp_inodes(local, remote_port);
  if (asked.ok()) return asked;
  static std::atomic<bool> said{false};
  if (!said.exchange(true, std::memory_order_relaxed)) {
    std::fprintf(stderr,
                 "tessera-worker: asking the kernel for a caller's connection (NETLINK_SOCK_DIAG) failed (%s): "
                 "it is read from /proc/net/tcp{,6} instead, this time and whenever the kernel's answer fails "
                 "(slower with many sockets)\n",
                 std::string(asked.status().message()).c_str());
  }
  return proc_established_tcp_inodes(local, remote_port);
}

}  // namespace internal

namespace {

// Lookups that may miss the caller's connection (check_peer_process): /proc/net/tcp is read
// in pieces while sockets come and go, and an inet_diag dump walks the table bucket by bucket
// without holding it still.
constexpr int kPeerScans = 3;

// Refuses a put reading, or a fetch writing, process `pid`'s memory (a direct segment,
// ShmSegment::create_direct) unless `pid` holds this call's own connection: the one
// established TCP socket of this host whose local end is the call's `peer` and whose remote
// end is this worker's port `listening_port` (internal::established_tcp_inodes). Else a
// process could name another one holding a copy of its memfd (a worker it put through, say)
// and have the block read from that one's memory, or written into it. PERMISSION_DENIED naming
// `pid` and `peer` if `pid` does not hold it; FAILED_PRECONDITION if it cannot be told (a peer
// that is not TCP, the sockets not readable), so that the client copies the block through the
// segment instead.
absl::Status check_peer_process(int32_t pid, const std::string& peer, int listening_port) {
  const std::string cannot = absl::StrCat("cannot tell whether process ", pid, " is the caller (peer '", peer,
                                          "') before reading or writing its memory: ");
  const std::optional<TcpEndpoint> caller = peer_endpoint(peer);
  if (!caller.has_value()) return absl::FailedPreconditionError(absl::StrCat(cannot, "not a TCP peer"));
  if (listening_port <= 0) return absl::FailedPreconditionError(absl::StrCat(cannot, "this worker has no port"));
  // The sockets matching, by inode. The call's own connection is established while the call
  // lasts, so a lookup without any match is made again. Two sockets are never resolved by
  // looking again (a lookup that missed one of them would pass a process holding the other).
  std::vector<uint64_t> inodes;
  for (int attempt = 0; attempt < kPeerScans && inodes.empty(); ++attempt) {
    absl::StatusOr<std::vector<uint64_t>> found = internal::established_tcp_inodes(*caller, listening_port);
    if (!found.ok()) return absl::FailedPreconditionError(absl::StrCat(cannot, found.status().message()));
    inodes = *std::move(found);
  }
  if (inodes.size() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat(cannot, inodes.size(), " established sockets from ", peer, " to port ", listening_port,
                     " here, not one", inodes.empty() ? absl::StrCat(" (looked up ", kPeerScans, " times)") : ""));
  }
  const std::string socket = absl::StrCat("socket:[", inodes[0], "]");
  const std::string fds = absl::StrCat("/proc/", pid, "/fd");
  DIR* dir = opendir(fds.c_str());
  if (dir == nullptr && (errno == EACCES || errno == EPERM)) {
    return absl::FailedPreconditionError(absl::StrCat(cannot, "cannot list ", fds, ": ", std::strerror(errno)));
  }
  bool holds = false;
  if (dir != nullptr) {
    char target[64];
    while (const dirent* entry = readdir(dir)) {
      const std::string path = absl::StrCat(fds, "/", entry->d_name);
      const ssize_t n = readlink(path.c_str(), target, sizeof target);
      if (n > 0 && absl::string_view(target, n) == socket) {
        holds = true;
        break;
      }
    }
    closedir(dir);
  }
  if (!holds) {
    return absl::PermissionDeniedError(absl::StrCat("process ", pid, " does not hold this call's connection (peer '",
                                                    peer, "'): it may not name memory of that process"));
  }
  return absl::OkStatus();
}

}  // namespace

Transfers::Transfers(BufferStore* store, const Authenticator* auth, const WorkerDevice* device, Transport* transport,
                     ProfileRecorder* profile, absl::Duration put_stall_timeout, bool in_process, bool shm_transfers,
                     bool client_memory)
    : store_(store),
      auth_(auth),
      device_(device),
      profile_(profile),
      put_stall_timeout_(put_stall_timeout),
      in_process_(in_process),
      shm_transfers_(shm_transfers),
      client_memory_(client_memory),
      transport_(transport) {
  const absl::Duration every = std::clamp(put_stall_timeout_ / 4, absl::Milliseconds(10), absl::Seconds(1));
  stall_watch_ = std::thread([this, every] {
    while (!stopping_.WaitForNotificationWithTimeout(every)) cancel_stalled_puts(absl::Now());
  });
}

Transfers::~Transfers() {
  stopping_.Notify();
  stall_watch_.join();
}

grpc::Status Transfers::put(grpc::ServerContext* ctx, const Caller& caller, grpc::ServerReader<pb::ShardChunk>* reader,
                            pb::PutShardReply* reply) {
  // Watched from its start: a stream that stalls, before its header or after it, is cancelled
  // (see cancel_stalled_puts), and its thread and its reservation go with it.
  std::shared_ptr<PutWatch> watch = watch_put(ctx);
  pb::ShardChunk chunk;
  const bool first = reader->Read(&chunk);
  watch->progress = absl::ToUnixNanos(absl::Now());
  absl::Status header = first ? absl::OkStatus() : absl::InvalidArgumentError("PutShard: empty stream");
  if (header.ok() && !chunk.has_header()) {
    header = absl::InvalidArgumentError("PutShard: the first message must carry the shard header");
  }
  if (header.ok() && !caller.at_least(Role::kDaemon)) {
    header = auth_->check_grant(chunk.header().buffer_id(), chunk.header().grant(), "PutShard");
  }
  // A fan-out's broadcast, checked before anything is reserved.
  std::optional<CollectiveRun> fan_out_of;
  if (header.ok() && chunk.header().has_fan_out()) {
    absl::StatusOr<CollectiveRun> run = fan_out_run(ctx, chunk.header());
    if (run.ok()) fan_out_of = *std::move(run);
    header = run.status();
  }
  ProfileSpan span(profile_, "transfer", [] { return std::string("put_shard"); });
  if (const uint64_t token = in_process_ ? handoff_token(*ctx) : 0; header.ok() && token != 0) {
    unwatch_put(watch);
    // Named by the client, as begin_put's errors.
    absl::StatusOr<std::shared_ptr<const HostArray>> data = take_handed_over(chunk, token);
    if (!data.ok()) return to_grpc(data.status());
    if (fan_out_of.has_value()) return to_grpc(fan_out(*fan_out_of, chunk.header(), *data, reply));
    commit_put(chunk.header().buffer_id(), *std::move(data), reply);
    return grpc::Status::OK;
  }
  if (header.ok() && chunk.header().has_shm()) {
    // A co-located client's block waits in its memfd: the stream ends after the header (the
    // stall watch bounds a client that keeps it open), then one read.
    pb::ShardChunk extra;
    const bool more = reader->Read(&extra);
    unwatch_put(watch);
    if (watch->cancelled) return to_grpc(stalled(std::nullopt));
    if (more) {
      return to_grpc(absl::InvalidArgumentError(
          "PutShard: a header naming a shared-memory segment must be the stream's only message"));
    }
    if (fan_out_of.has_value() && fan_out_of->self != fan_out_of->spec.groups[0][0]) {
      return to_grpc(absl::InvalidArgumentError(
          "PutShard: a fan-out member other than the uploader (fan_out.members[0]) takes no shared-memory segment"));
    }
    bool direct = false;
    absl::StatusOr<std::shared_ptr<const HostArray>> data = read_client_segment(chunk, ctx->peer(), &direct);
    if (!data.ok()) return to_grpc(data.status());
    const uint64_t id = chunk.header().buffer_id();
    if (ctx->IsCancelled()) {  // the client went while we read: nobody holds the array
      store_->cancel(id);
      return to_grpc(absl::CancelledError(absl::StrCat("PutShard: buffer ", id, ": the client went away")));
    }
    if (span) {
      span.arg("buffer", absl::StrCat(id));
      span.arg("bytes", absl::StrCat((*data)->nbytes()));
      span.arg("path", "shm");
    }
    const int64_t bytes = (*data)->nbytes();
    absl::Status stored;
    if (fan_out_of.has_value()) {
      stored = fan_out(*fan_out_of, chunk.header(), *data, reply);
    } else {
      commit_put(id, *std::move(data), reply);
    }
    if (stored.ok()) {  // as bytes_put, once committed
      shm_bytes_put_.fetch_add(bytes, std::memory_order_relaxed);
      if (direct) client_memory_bytes_read_.fetch_add(bytes, std::memory_order_relaxed);
    }
    return to_grpc(stored);
  }
  if (header.ok() && fan_out_of.has_value() && fan_out_of->self != fan_out_of->spec.groups[0][0]) {
    // A member that receives from its peers: the stream holds the header alone.
    pb::ShardChunk extra;
    if (!chunk.data().empty() || reader->Read(&extra)) {
      header = absl::InvalidArgumentError(
          "PutShard: a fan-out member other than the uploader (fan_out.members[0]) takes no data from the stream");
    }
    unwatch_put(watch);
    if (watch->cancelled) return to_grpc(stalled(std::nullopt));
    if (!header.ok()) return to_grpc(header);
    return to_grpc(fan_out(*fan_out_of, chunk.header(), nullptr, reply));
  }
  absl::StatusOr<std::shared_ptr<HostArray>> data = header.ok() ? begin_put(chunk.header()) : header;
  if (!data.ok()) {
    unwatch_put(watch);
    if (watch->cancelled) return to_grpc(stalled(std::nullopt));
    return to_grpc(data.status());
  }
  const uint64_t id = chunk.header().buffer_id();
  // read_put_shard reads the later messages into `chunk`: a fan-out keeps the header.
  pb::ShardHeader header_of_put;
  if (fan_out_of.has_value()) header_of_put = chunk.header();
  if (span) {
    span.arg("buffer", absl::StrCat(id));
    span.arg("bytes", absl::StrCat((*data)->nbytes()));
  }
  auto next = [reader, &watch](pb::ShardChunk* next) {
    const bool more = reader->Read(next);
    watch->progress = absl::ToUnixNanos(absl::Now());
    return more;
  };
  if (fan_out_of.has_value()) {
    // The uploader forwards each chunk of the broadcast as soon as its bytes arrived, and its
    // last only once the stream ended with the shard whole. The reservation made by begin_put
    // carries over: fan_out commits or releases it.
    PutShardStream stream(&chunk, next, data->get());
    const int64_t total = (*data)->nbytes();
    int64_t forwarded = 0;  // bytes handed to the broadcast so far
    // The stall watch times the client's stream only while the broadcast waits for its bytes
    // (here): between, the broadcast waits on the members, each bound by the same stall
    // deadline (CollectiveRun::stall_timeout), which names the member that made no progress.
    std::function<absl::Status(int64_t)> input_ready = [&](int64_t bytes) -> absl::Status {
      watch->progress = absl::ToUnixNanos(absl::Now());
      watch->paused = false;
      const bool had_all = stream.received() == total;
      absl::Status read = bytes < total ? stream.read_until(bytes) : stream.finish();
      watch->paused = true;
      if (bytes == total) unwatch_put(watch);
      if (watch->cancelled) return stalled(id);
      // What the pipelining gained, on the timeline (tests/integration/replicated_put_test.cc).
      if (span && !had_all && stream.received() == total) {
        span.arg("forwarded_before_last_byte", absl::StrCat(forwarded));
      }
      forwarded = bytes;
      return read;
    };
    absl::Status status = fan_out(*fan_out_of, header_of_put, *std::move(data), reply, std::move(input_ready));
    unwatch_put(watch);
    if (watch->cancelled) status = stalled(id);
    return to_grpc(status);
  }
  absl::Status status = read_put_shard(&chunk, next, data->get());
  unwatch_put(watch);
  if (!status.ok() || watch->cancelled) {
    store_->cancel(id);
    if (watch->cancelled) status = stalled(id);
    return to_grpc(status);
  }
  commit_put(id, *std::move(data), reply);
  return grpc::Status::OK;
}

void Transfers::commit_put(uint64_t id, std::shared_ptr<const HostArray> data, pb::PutShardReply* reply) {
  reply->set_bytes(data->nbytes());
  bytes_put_.fetch_add(data->nbytes(), std::memory_order_relaxed);
  store_->commit(id, std::move(data));
}

absl::StatusOr<CollectiveRun> Transfers::fan_out_run(grpc::ServerContext* ctx, const pb::ShardHeader& header) const {
  const pb::ShardFanOut& f = header.fan_out();
  const uint64_t id = header.buffer_id();
  if (f.members_size() < 2 || f.members_size() > kMaxFanOut) {
    return absl::InvalidArgumentError(
        absl::StrCat("PutShard: a fan-out has ", f.members_size(), " members; it takes 2 to ", kMaxFanOut));
  }
  // Its op is the buffer id with bit 63 set: id 2^63 - 1 would make op 2^64 - 1, whose range
  // [op, op + 1) is empty (the claim and the end of the op would do nothing), and an id with
  // bit 63 would share its op with the id without it. The coordinator's ids are below 2^62.
  if (id >= kFanOutOpBit - 1) {
    return absl::InvalidArgumentError(absl::StrCat("PutShard: the fan-out of buffer ", id,
                                                   " runs under op id buffer id | 2^63, so its buffer id ",
                                                   "must be below 2^63 - 1 (", kFanOutOpBit - 1, ")"));
  }
  // Its messages carry the client's tag, as a run's carry the coordinator's: the op id (the
  // buffer's, with bit 63) is predictable, and a fan-out of tag 0 would take anyone's messages.
  if (f.run_tag() == 0) {
    return run_tag_0_refusal(absl::StrCat("PutShard: the fan-out of buffer ", id), "ShardFanOut.run_tag");
  }
  CollectiveRun run;
  run.op = id | kFanOutOpBit;
  run.run_tag = f.run_tag();
  run.self = device_->id();
  run.spec.kind = CollectiveKind::kBroadcast;
  run.spec.root = 0;
  std::vector<int>& members = run.spec.groups.emplace_back();
  for (const pb::PeerAddress& m : f.members()) {
    if (m.device_id() < 0 || !run.peers.emplace(m.device_id(), m.address()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("PutShard: fan-out member device ", m.device_id(), " is negative or named twice"));
    }
    TESSERA_RETURN_IF_ERROR(auth_->check_address_grant(id, m.device_id(), m.address(), m.grant(), "PutShard fan-out"));
    members.push_back(m.device_id());
  }
  if (run.peers.count(run.self) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PutShard: device ", run.self, " is not a member of the fan-out of buffer ", id));
  }
  // A member waits through the uploader's upload and then the broadcast: the client's timeout
  // covers both (and its call's deadline bounds it too).
  const int64_t timeout_ms = f.timeout_ms() > 0 ? std::min<int64_t>(f.timeout_ms(), 3'600'000) : 10'000;
  run.start = absl::Now();
  run.deadline = run.start + absl::Milliseconds(timeout_ms);
  run.cancelled = [ctx] { return ctx->IsCancelled(); };
  return run;
}

absl::Status Transfers::fan_out(const CollectiveRun& fan_out, const pb::ShardHeader& header,
                                std::shared_ptr<const HostArray> data, pb::PutShardReply* reply,
                                std::function<absl::Status(int64_t)> input_ready) {
  const uint64_t id = header.buffer_id();
  CollectiveRun run = fan_out;
  run.input_ready = std::move(input_ready);
  run.stall_timeout = put_stall_timeout_;
  if (data == nullptr) {
    TESSERA_ASSIGN_OR_RETURN(ArrayType type, reserve_put(header));
    run.broadcast_into = std::make_shared<HostArray>(type.dtype, std::move(type.shape));
    data = run.broadcast_into;
  }
  // From this part's start: the uploader's upload came first.
  run.start = absl::Now();
  run.deadline = run.start + (fan_out.deadline - fan_out.start);
  // Claimed with its tag from now on, on every member: the uploader, the broadcast's root,
  // never receives, so a forged message of its op id is counted, not held as an early one.
  transport_->begin_run_ops(run.op, run.op + 1, run.run_tag);
  absl::StatusOr<std::shared_ptr<const HostArray>> out = run_collective(*transport_, run, data);
  transport_->finish_op(run.op);
  transport_->end_run_ops(run.op, run.op + 1, run.run_tag);
  if (!out.ok()) {
    store_->cancel(id);
    return absl::Status(out.status().code(),
                        absl::StrCat("PutShard fan-out of buffer ", id, ": ", out.status().message()));
  }
  if (run.broadcast_into == nullptr) {
    commit_put(id, *std::move(out), reply);
  } else {
    reply->set_bytes((*out)->nbytes());
    bytes_fanned_out_.fetch_add((*out)->nbytes(), std::memory_order_relaxed);
    store_->commit(id, *std::move(out));
  }
  return absl::OkStatus();
}

grpc::Status Transfers::get(grpc::ServerContext* ctx, const Caller& caller, const pb::GetShardRequest* req,
                            grpc::ServerWriter<pb::ShardChunk>* writer) {
  if (!caller.at_least(Role::kDaemon)) {
    absl::Status granted = auth_->check_grant(req->buffer_id(), req->grant(), "GetShard");
    if (!granted.ok()) return to_grpc(device_->name_in(granted));
  }
  absl::StatusOr<std::shared_ptr<const HostArray>> buffer = store_->get(req->buffer_id());
  if (!buffer.ok()) return to_grpc(buffer.status());
  const HostArray& data = **buffer;
  ProfileSpan span(profile_, "transfer", [] { return std::string("get_shard"); });
  if (span) {
    span.arg("buffer", absl::StrCat(req->buffer_id()));
    span.arg("bytes", absl::StrCat(data.nbytes()));
  }
  pb::ShardChunk chunk;
  chunk.mutable_header()->set_buffer_id(req->buffer_id());
  chunk.mutable_header()->set_dtype(to_proto(data.dtype()));
  to_proto(data.shape(), chunk.mutable_header()->mutable_shape());
  if (req->has_shm()) {
    // A co-located client named its memfd: the block goes there, the stream carries the header.
    if (!shm_transfers_) {
      return to_grpc(absl::FailedPreconditionError(
          "GetShard: this worker takes no shared-memory transfers (--shm_transfers=false or in process)"));
    }
    // A segment naming the block's place in the client's memory (contiguous there) gets it
    // written there, process_vm_writev; else into the memfd, pwrite.
    const pb::ShmSegment& named = req->shm();
    bool direct = false;
    const absl::Status wrote = [&]() -> absl::Status {
      TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, ShmSegment::open(named.pid(), named.fd(), named.token(),
                                                                    data.nbytes(), /*writable=*/true));
      // Before writing any memory of the process named: it must be the caller. The segment
      // took a pidfd of it before this check, and write_block moves nothing once that process
      // has exited (its pid may be another's by then).
      direct = segment.direct();
      if (segment.direct()) TESSERA_RETURN_IF_ERROR(check_client_memory(named.pid(), ctx->peer()));
      return segment.write_block(data.data());
    }();
    if (!wrote.ok()) {
      return to_grpc(
          absl::Status(wrote.code(), absl::StrCat("GetShard: buffer ", req->buffer_id(), " ",
                                                  type_to_string(data.dtype(), data.shape()), ": ", wrote.message())));
    }
    *chunk.mutable_header()->mutable_shm() = named;
    if (span) span.arg("path", "shm");
    if (ctx->IsCancelled() || !writer->Write(chunk)) {
      return to_grpc(absl::CancelledError("GetShard: the reader went away"));
    }
    bytes_fetched_.fetch_add(data.nbytes(), std::memory_order_relaxed);
    shm_bytes_fetched_.fetch_add(data.nbytes(), std::memory_order_relaxed);
    if (direct) client_memory_bytes_written_.fetch_add(data.nbytes(), std::memory_order_relaxed);
    return grpc::Status::OK;
  }
  if (in_process_ && handoff_requested(*ctx)) {
    // The reader shares the buffer and copies it once, where it wants it; a full table streams.
    if (absl::StatusOr<uint64_t> token = Handoff::deposit(*buffer); token.ok()) {
      ctx->AddInitialMetadata(kHandoffKey, absl::StrCat(*token));
      if (ctx->IsCancelled() || !writer->Write(chunk)) {
        Handoff::take(*token);
        return to_grpc(absl::CancelledError("GetShard: the reader went away"));
      }
      bytes_fetched_.fetch_add(data.nbytes(), std::memory_order_relaxed);
      return grpc::Status::OK;
    }
  }
  int64_t offset = 0;
  do {
    const int64_t n = std::min(kMaxChunkBytes, data.nbytes() - offset);
    chunk.set_data(data.data() + offset, static_cast<size_t>(n));
    offset += n;
    if (ctx->IsCancelled() || !writer->Write(chunk)) {
      return to_grpc(absl::CancelledError("GetShard: the reader went away"));
    }
    chunk.clear_header();
  } while (offset < data.nbytes());
  bytes_fetched_.fetch_add(data.nbytes(), std::memory_order_relaxed);
  return grpc::Status::OK;
}

absl::Status Transfers::stalled(std::optional<uint64_t> id) const {
  if (!id.has_value()) {
    return absl::DeadlineExceededError(absl::StrCat("PutShard: the stream sent no shard header for ",
                                                    absl::FormatDuration(put_stall_timeout_),
                                                    " and was cancelled (--put_stall_ms)"));
  }
  return absl::DeadlineExceededError(absl::StrCat("PutShard: buffer ", *id, " received no data for ",
                                                  absl::FormatDuration(put_stall_timeout_),
                                                  "; its reservation was released (--put_stall_ms)"));
}

void Transfers::cancel_stalled_puts(absl::Time now) {
  absl::MutexLock lock(&puts_mu_);
  for (const std::shared_ptr<PutWatch>& w : puts_) {
    if (now - absl::FromUnixNanos(w->progress.load()) <= put_stall_timeout_ || w->cancelled || w->paused) continue;
    w->cancelled = true;
    w->ctx->TryCancel();
  }
}

std::shared_ptr<Transfers::PutWatch> Transfers::watch_put(grpc::ServerContext* ctx) {
  auto w = std::make_shared<PutWatch>();
  w->ctx = ctx;
  w->progress = absl::ToUnixNanos(absl::Now());
  absl::MutexLock lock(&puts_mu_);
  puts_.insert(w);
  return w;
}

void Transfers::unwatch_put(const std::shared_ptr<PutWatch>& w) {
  absl::MutexLock lock(&puts_mu_);  // cancel_stalled_puts never touches its context after this
  puts_.erase(w);
}

absl::StatusOr<ArrayType> Transfers::reserve_put(const pb::ShardHeader& header) {
  TESSERA_ASSIGN_OR_RETURN(ArrayType type, put_shard_type(header));
  const int64_t bytes = num_elements(type.shape) * dtype_size(type.dtype);
  absl::Status reserved = store_->reserve(header.buffer_id(), bytes);
  if (!reserved.ok()) {
    return absl::Status(reserved.code(),
                        absl::StrCat("shard ", type_to_string(type.dtype, type.shape), ": ", reserved.message()));
  }
  return type;
}

absl::StatusOr<std::shared_ptr<HostArray>> Transfers::begin_put(const pb::ShardHeader& header) {
  TESSERA_ASSIGN_OR_RETURN(ArrayType type, reserve_put(header));
  return std::make_shared<HostArray>(type.dtype, std::move(type.shape));
}

absl::StatusOr<std::shared_ptr<const HostArray>> Transfers::read_client_segment(const pb::ShardChunk& first,
                                                                                const std::string& peer, bool* direct) {
  if (!shm_transfers_) {
    return absl::FailedPreconditionError(
        "PutShard: this worker takes no shared-memory transfers (--shm_transfers=false or in process)");
  }
  if (!first.data().empty()) {
    return absl::InvalidArgumentError("PutShard: a header naming a shared-memory segment carries no data");
  }
  const pb::ShardHeader& header = first.header();
  TESSERA_ASSIGN_OR_RETURN(ArrayType type, reserve_put(header));
  const uint64_t id = header.buffer_id();
  const std::string what = absl::StrCat("PutShard: buffer ", id, " ", type_to_string(type.dtype, type.shape), ": ");
  absl::StatusOr<std::shared_ptr<const HostArray>> data = [&]() -> absl::StatusOr<std::shared_ptr<const HostArray>> {
    const int64_t bytes = num_elements(type.shape) * dtype_size(type.dtype);
    TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, ShmSegment::open(header.shm().pid(), header.shm().fd(),
                                                                  header.shm().token(), bytes, false));
    // Before reading any memory of the process named: it must be the caller (the segment's
    // pidfd, taken before this check, keeps the read to that process: see the fetch's).
    *direct = segment.direct();
    if (segment.direct()) TESSERA_RETURN_IF_ERROR(check_client_memory(header.shm().pid(), peer));
    if (segment.sealed()) {
      // Adopted: the buffer is the client's pages, mapped; no copy, however many replicas map
      // them. The mapping keeps them once the segment's fds are closed (ours below, the client's
      // when its call returns or it dies).
      TESSERA_ASSIGN_OR_RETURN(HostArray mapped, segment.map_block(type.dtype, type.shape));
      return std::make_shared<const HostArray>(std::move(mapped));
    }
    // An unsealed segment (an older client's): its owner may still write or shrink it, so the
    // block is copied out of it, with pread.
    auto copy = std::make_shared<HostArray>(type.dtype, type.shape);
    TESSERA_RETURN_IF_ERROR(segment.read_block(copy->data()));
    return std::shared_ptr<const HostArray>(std::move(copy));
  }();
  if (!data.ok()) {
    store_->cancel(id);
    return absl::Status(data.status().code(), absl::StrCat(what, data.status().message()));
  }
  return data;
}

absl::Status Transfers::check_client_memory(int32_t pid, const std::string& peer) const {
  if (!client_memory_) {
    return absl::FailedPreconditionError(
        absl::StrCat("this worker neither reads nor writes clients' memory (--shm_client_memory=false): process ", pid,
                     " is to copy its block through the memfd"));
  }
  return check_peer_process(pid, peer, listening_port_.load(std::memory_order_relaxed));
}

absl::StatusOr<std::shared_ptr<const HostArray>> Transfers::take_handed_over(const pb::ShardChunk& first,
                                                                             uint64_t token) {
  std::shared_ptr<const HostArray> data = Handoff::take(token);
  if (data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("PutShard: no buffer waits under handoff token ", token, " (core/handoff.h)"));
  }
  const uint64_t id = first.header().buffer_id();
  TESSERA_ASSIGN_OR_RETURN(ArrayType type, reserve_put(first.header()));
  if (type.dtype != data->dtype() || type.shape != data->shape() || !first.data().empty()) {
    store_->cancel(id);
    return absl::InvalidArgumentError(absl::StrCat(
        "PutShard: the header announces ", type_to_string(type.dtype, type.shape), " but the buffer handed over is ",
        type_to_string(data->dtype(), data->shape()), first.data().empty() ? "" : " (and the message carries data)"));
  }
  return data;
}

}  // namespace tessera
