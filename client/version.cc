#include "tessera/version.h"

#include "proto/rpc.h"

namespace tessera {

const char* version() { return TESSERA_VERSION_STRING; }

int protocol_version() { return static_cast<int>(kProtocolVersion); }

}  // namespace tessera
