// A set of mesh axis names printed as Python prints one, for messages worded as JAX's (which
// print PartitionSpec's unreduced / reduced frozensets):
//
//   axis_set_repr({"X", "Y"})  // "{'X', 'Y'}"
//
// Kept out of core/partition_spec.h, which nearly every file includes.
#ifndef TESSERA_CORE_AXIS_SET_REPR_H_
#define TESSERA_CORE_AXIS_SET_REPR_H_

#include <string>
#include <vector>

namespace tessera {

// "{'X', 'Y'}": each name quoted, in the order given (callers pass sorted sets, where Python
// prints its hash order); "{}" for none.
std::string axis_set_repr(const std::vector<std::string>& axes);

}  // namespace tessera

#endif  // TESSERA_CORE_AXIS_SET_REPR_H_
