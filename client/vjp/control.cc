// VJP rules of control flow.
#include "client/vjp/vjp.h"

namespace tessera::internal {

absl::Span<const VjpEntry> control_vjps() {
  static const VjpEntry kRules[] = {
      // Not built yet: grad refuses it by name rather than passing no cotangent.
      {Op::kScan,
       [](const VjpArgs&) {
         return absl::UnimplementedError("scan has no VJP yet (differentiating through a scan is not built)");
       }},
  };
  return kRules;
}

}  // namespace tessera::internal
