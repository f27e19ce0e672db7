// ShmSegment: one block of bytes handed between a client and a worker of the same host
// through a memfd (docs/design.md, "Co-located clients"). The client creates the segment (a
// page of header: a magic number, a random token and the block's byte count; then the block)
// and names it on its PutShard or GetShard call by its pid, its fd and the token; the worker
// opens it as /proc/<pid>/fd/<fd> and checks that it is a Tessera memfd with that token and
// room for the block. A put's segment that its client sealed once written (no write, shrink or
// grow, ever again, by anyone: ConnectOptions::adopt_puts) is adopted: the worker maps the
// block privately as the buffer's storage (no copy; the mapping keeps the pages after the
// client closes its fd or dies). An unsealed segment is copied out with pread, and a fetch's
// is written with pwrite: never through a mapping of a file its owner may still shrink, so
// that is an error, never SIGBUS. The memfd has no name: it goes when its last holder closes or
// unmaps it, so a client or worker killed mid-transfer leaves nothing behind.
// A direct segment (create_direct) holds only the header, naming where the block is in its
// client's memory; the worker reads a put's block from there (process_vm_readv) or writes a
// fetch's block there (process_vm_writev): no copy on the client.
//
//   auto seg = ShmSegment::create(bytes);                          // client
//   seg->write_block(src);  seg->seal();
//   ... PutShard(header with {getpid(), seg->fd(), seg->token()}) ...
//   auto peer = ShmSegment::open(pid, fd, token, bytes, false);    // worker
//   if (peer->sealed()) array = peer->map_block(dtype, shape); else peer->read_block(dst);
#ifndef TESSERA_CORE_SHM_TRANSFER_H_
#define TESSERA_CORE_SHM_TRANSFER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/dtype.h"
#include "core/host_array.h"
#include "core/shape.h"

namespace tessera {

// This process's host as far as shared memory goes: the boot id and the IPC and network
// namespaces (so that network namespaces on one machine, which share /dev/shm, count as
// different hosts and keep using gRPC). Containers that share IPC but not the network (a
// compose file's workers) name one host explicitly instead (tessera-worker --shm_host).
// With `pid_namespace`, the PID namespace too, which a
// worker needs to reach a client's /proc/<pid>/fd.
std::string shm_host_identity(bool pid_namespace = false);

// The identity a worker announces for client transfers (HandshakeReply.transfer_host) and a
// client compares with its own: shm_host_identity(true).
std::string shm_transfer_host();

class ShmSegment {
 public:
  // Where the block starts in the segment (after the header page).
  static constexpr int64_t kDataOffset = 4096;
  // Largest block: a shard's bytes, as the workers' memory limit allows.
  static constexpr int64_t kMaxBytes = int64_t{1} << 40;

  // A new memfd of `bytes` bytes of block (sparse until written) with a fresh random token.
  // INVALID_ARGUMENT for a size outside [0, kMaxBytes]; INTERNAL with errno's text if the
  // kernel refuses.
  static absl::StatusOr<ShmSegment> create(int64_t bytes);
  // A segment that names `bytes` bytes at `data` in this process's memory instead of holding
  // them (direct(): its header page alone, under another magic number, so that a reader that
  // knows only segments holding their block refuses it). A worker reads a put's block straight
  // from there (process_vm_readv) or writes a fetch's there (process_vm_writev): no copy into
  // or out of the segment. A put's bytes must stay as they are until every worker named it
  // answered; a fetch's memory must stay writable until withdraw(). INVALID_ARGUMENT for a
  // size outside [1, kMaxBytes]; INTERNAL with errno's text if the kernel refuses.
  static absl::StatusOr<ShmSegment> create_direct(const std::byte* data, int64_t bytes);
  // Process `pid`'s segment `fd` (as /proc/<pid>/fd/<fd>): NOT_FOUND if it cannot be opened
  // here (another host or PID namespace after all, or the process is gone); INVALID_ARGUMENT
  // if it is not a Tessera memfd, holds another token or byte count than `bytes`, or is too
  // small for them. `writable`: opened for writing (a fetch). A direct() segment also holds a
  // pidfd of `pid`, taken before anything else, so that its process is the one whose memory
  // read_block / write_block move, though a pid may be reused meanwhile (FAILED_PRECONDITION
  // if the kernel gives none: pidfd_open, Linux 5.3).
  static absl::StatusOr<ShmSegment> open(int32_t pid, int32_t fd, uint64_t token, int64_t bytes, bool writable);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // closes the fd

  int fd() const { return fd_; }
  uint64_t token() const { return token_; }
  int64_t bytes() const { return bytes_; }
  // The largest block this segment holds (create's bytes).
  int64_t capacity() const { return capacity_; }

  // Makes a created segment (its owner's, no longer named to any worker) hold a block of
  // `bytes` under a fresh token, keeping its pages: a later transfer of a size at most
  // capacity() writes into memory already allocated. INVALID_ARGUMENT beyond capacity();
  // FAILED_PRECONDITION for a sealed segment.
  absl::Status reuse(int64_t bytes);

  // Makes a created segment immutable for good: trims it to its header and block (a reused
  // segment's capacity beyond goes), then seals it against writing, shrinking and growing
  // (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW), so that a worker may adopt its pages as a
  // buffer. Afterwards write_block and reuse fail; the segment is its owner's to close, not to
  // pool. INTERNAL with errno's text if the kernel refuses (EBUSY: a writable shared mapping
  // of it exists).
  absl::Status seal();
  // Whether the segment is sealed as seal() does (an opened one: as its file was when opened;
  // seals are never removed), so that map_block may map it.
  bool sealed() const { return sealed_; }
  // Whether the segment names the block in its process's memory (create_direct) rather than
  // holding it; such a segment is neither reused nor sealed.
  bool direct() const { return address_ != 0; }

  // The block as a HostArray of `dtype` and `shape` whose storage is a private mapping of the
  // segment (copy-on-write: writing the array never reaches the file), unmapped when the array
  // goes; the mapping keeps the file's pages after every fd is closed. A block of 0 bytes is an
  // ordinary empty array. FAILED_PRECONDITION if the segment is not sealed() or the page size
  // does not divide kDataOffset; INVALID_ARGUMENT if `shape` does not hold bytes(); INTERNAL
  // (RESOURCE_EXHAUSTED for ENOMEM) if mmap fails.
  absl::StatusOr<HostArray> map_block(DType dtype, Shape shape) const;

  // The whole block, from `src` into the segment or from the segment into `dst` (bytes() each). DATA_LOSS if the
  // segment ended early (it was shrunk meanwhile); INTERNAL with errno's text otherwise (ENOSPC, EPERM once sealed,
  // ...); FAILED_PRECONDITION for a created direct() segment (it holds no block). An opened direct() segment's block is
  // moved from/into its process's memory: FAILED_PRECONDITION if this process may not (process_vm_readv/writev's
  // ptrace check), NOT_FOUND if the process is gone, INVALID_ARGUMENT if the range named is not readable memory of it;
  // NOT_FOUND too if the process exited since open() (its pid may name another process by then): the exit is seen by
  // polling the segment's pidfd right before and right after the move, and nothing is moved once it is seen, a read's
  // bytes are not to be used. The kernel has no process_vm_writev by pidfd, so if the process exits, is reaped and
  // its pid is reused between the first poll and process_vm_writev, the pid's new holder can still receive the write;
  // the poll after it reports that (NOT_FOUND "the bytes written may have reached another process"). Into an opened
  // direct() segment's process, write_block writes under the segment's lock (flock) once it has checked that the
  // header still names that memory: ABORTED if the owner withdrew it (withdraw()), FAILED_PRECONDITION / NOT_FOUND as
  // for a read, INVALID_ARGUMENT if the range is not writable memory of it (wholly or from some byte on: the bytes
  // written before are named).
  absl::Status write_block(const std::byte* src);
  absl::Status read_block(std::byte* dst) const;

  // How long withdraw() waits for a worker's lock before it warns, and again between warnings.
  static constexpr absl::Duration kWithdrawWarnEvery = absl::Seconds(5);

  // Of a created direct() segment: no worker writes into the memory it names once this
  // returns. Takes the segment's lock and overwrites the header, so that a worker that opened
  // the segment but has not written yet finds it withdrawn. A fetch calls it before its
  // destination may be read or freed, whatever the call's outcome (a call that timed out may
  // still have a worker about to write). It waits for as long as a worker holds the lock (a
  // write under way, which may not end after the memory is reused: no deadline, so a worker
  // stopped while holding it holds this call up), and says so: after `warn_every`, and again
  // every `warn_every`, it passes `warn` (by default, a line on stderr) a message naming
  // `who` (the fetch's device), the segment and the process holding its lock.
  // If the kernel refuses the lock or the header's write, the process aborts with a message
  // naming them: returning would let the caller reuse memory a worker may still write, so
  // there is no error to return.
  // REQUIRES: a segment made by create_direct in this process (else the process aborts).
  void withdraw(absl::string_view who = "", absl::Duration warn_every = kWithdrawWarnEvery,
                const std::function<void(const std::string&)>& warn = nullptr);

 private:
  ShmSegment(int fd, uint64_t token, int64_t bytes) : fd_(fd), token_(token), bytes_(bytes), capacity_(bytes) {}
  // read_block / write_block of an opened direct() segment: `local` into (read) or out of
  // (write) the process's memory.
  absl::Status move_process_memory(std::byte* local, bool write) const;
  absl::Status write_process_memory(const std::byte* src) const;
  // OK while the process pidfd_ refers to (the one pid_ named when opened) has not exited;
  // NOT_FOUND prefixed with `what` once it has, saying whether the move `began`.
  absl::Status same_process(const std::string& what, bool began, bool write) const;

  int fd_ = -1;
  int32_t pid_ = 0;       // an opened segment's process
  int pidfd_ = -1;        // an opened direct() segment's: that process, however its pid is reused
  uint64_t address_ = 0;  // direct(): where the block is in that process (or, created, in this one)
  uint64_t token_ = 0;
  int64_t bytes_ = 0;
  int64_t capacity_ = 0;
  bool sealed_ = false;
};

}  // namespace tessera

#endif  // TESSERA_CORE_SHM_TRANSFER_H_
