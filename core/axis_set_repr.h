// Sets and tuples of mesh axis names printed as Python prints them, for messages worded as
// JAX's:
//
//   axis_set_repr({"X", "Y"})        // "{'X', 'Y'}": a set (check_unreduced_args' axes)
//   axis_frozenset_repr({"X", "Y"})  // "frozenset({'X', 'Y'})": a PartitionSpec's unreduced or
//                                    // reduced axes, a type's varying axes (jax.typeof(x).mat)
//   axis_tuple_repr({"X"})           // "('X',)": an axis_name tuple
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

// "frozenset({'X', 'Y'})", as Python prints a frozenset; "frozenset()" for none.
std::string axis_frozenset_repr(const std::vector<std::string>& axes);

// "('X', 'Y')", "('X',)" (a one-element tuple keeps its comma), "()".
std::string axis_tuple_repr(const std::vector<std::string>& axes);

}  // namespace tessera

#endif  // TESSERA_CORE_AXIS_SET_REPR_H_
