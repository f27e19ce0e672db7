// Status helpers: the one TESSERA_RETURN_IF_ERROR / TESSERA_ASSIGN_OR_RETURN pair
// (Abseil 20220623 ships no status macros).
//
//   TESSERA_RETURN_IF_ERROR(sharding.validate(shape));
//   TESSERA_ASSIGN_OR_RETURN(Mesh mesh, Mesh::create({4, 2}, {"data", "model"}, ids));
#ifndef TESSERA_CORE_STATUS_H_
#define TESSERA_CORE_STATUS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TESSERA_STATUS_CONCAT_INNER_(a, b) a##b
#define TESSERA_STATUS_CONCAT_(a, b) TESSERA_STATUS_CONCAT_INNER_(a, b)

#define TESSERA_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status tessera_status_ = (expr);           \
    if (!tessera_status_.ok()) return tessera_status_; \
  } while (false)

#define TESSERA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) return statusor.status();             \
  lhs = std::move(statusor).value()

#define TESSERA_ASSIGN_OR_RETURN(lhs, expr) \
  TESSERA_ASSIGN_OR_RETURN_IMPL_(TESSERA_STATUS_CONCAT_(tessera_statusor_, __LINE__), lhs, expr)

#endif  // TESSERA_CORE_STATUS_H_
