// The timeline's HTML viewer (Client::stop_profile writes it next to the trace): one page, its
// script and style inline and the trace embedded, so it opens with no network.
#ifndef TESSERA_CLIENT_PROFILE_HTML_H_
#define TESSERA_CLIENT_PROFILE_HTML_H_

#include <string>

namespace tessera::internal {

// The page for `trace_json` (Chrome trace-event JSON without a "<": client/profile.cc escapes
// it in strings): a row per process (the client, the coordinator, each device), a sub-row per
// thread, spans by time and coloured by category, the messages' flow arrows, details on hover.
std::string timeline_html(const std::string& trace_json);

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_PROFILE_HTML_H_
