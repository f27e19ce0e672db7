// WriteQueue: the outgoing messages of one gRPC callback stream, which allows one write in
// flight at a time. The owner keeps it under its own lock and starts the write it is handed
// outside that lock (gRPC may run the write on the calling thread).
//
//   const Msg* first;
//   { absl::MutexLock lock(&mu_); first = writes_.push(std::move(msg)); }
//   if (first != nullptr) StartWrite(first);
//   // OnWriteDone(ok): { lock; next = writes_.pop(!ok); }  if (next) StartWrite(next);
#ifndef TESSERA_PROTO_WRITE_QUEUE_H_
#define TESSERA_PROTO_WRITE_QUEUE_H_

#include <deque>
#include <utility>

namespace tessera {

template <typename Message>
class WriteQueue {
 public:
  // Queues `message`. Returns it if its write is to start now (none was in flight), else
  // null: the write in flight hands it on when it is done. A deque's elements stay put while
  // others are added, so the pointer stays valid until its write is done.
  const Message* push(Message message) {
    queue_.push_back(std::move(message));
    if (writing_) return nullptr;
    writing_ = true;
    return &queue_.front();
  }

  // The write in flight is done. Returns the next message to write, or null when none is
  // left or `stop` (the stream is ending: whatever is queued is dropped).
  const Message* pop(bool stop) {
    queue_.pop_front();
    if (stop || queue_.empty()) {
      queue_.clear();
      writing_ = false;
      return nullptr;
    }
    return &queue_.front();
  }

  // Whether a write is in flight.
  bool writing() const { return writing_; }

 private:
  std::deque<Message> queue_;  // the front is in flight while writing_
  bool writing_ = false;
};

}  // namespace tessera

#endif  // TESSERA_PROTO_WRITE_QUEUE_H_
