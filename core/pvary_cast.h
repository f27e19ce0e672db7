// What an Op::kPvary node casts its operand to, kept in its CollectiveAttrs::dimension (pvary
// has no dimension of its own; a separate header so that only the few files that read it
// rebuild). Each cast is an identity at runtime (JAX lowers pvary, vary_unreduced_cast and
// preduced to their operand, jax/_src/lax/parallel.py); only the body value's type changes:
//   kVarying: lax.pvary / pcast(to='varying'): invariant -> varying along the axes, or
//     reduced -> varying (reduced_vary_cast) when the operand is reduced over them.
//   kUnreduced: pcast(to='unreduced') (vary_unreduced_cast): varying along the axes ->
//     unreduced over them (each device's block becomes its term of a pending sum).
//   kReduced: pcast(to='reduced') (preduced): invariant -> reduced over the axes; also the
//     second half of all_gather(to='reduced') (all_gather_reduced), whose gathered blocks are
//     the same on every device along the axes: varying -> reduced there.
//   kInvariant: the second half of all_gather(to='invarying') (all_gather_invariant), whose
//     gathered blocks are the same on every device along the axes: varying -> invariant there
//     (JAX's only Varying -> Invariant cast besides psum; no pcast reaches it).
#ifndef TESSERA_CORE_PVARY_CAST_H_
#define TESSERA_CORE_PVARY_CAST_H_

#include <cstdint>

namespace tessera {

enum class PvaryCast : int64_t { kVarying = 0, kUnreduced = 1, kReduced = 2, kInvariant = 3 };

// The cast of a CollectiveAttrs::dimension, or false when it names none.
inline bool pvary_cast_of(int64_t dimension, PvaryCast* cast) {
  if (dimension < 0 || dimension > static_cast<int64_t>(PvaryCast::kInvariant)) return false;
  *cast = static_cast<PvaryCast>(dimension);
  return true;
}

inline const char* pvary_cast_name(PvaryCast cast) {
  switch (cast) {
    case PvaryCast::kVarying:
      return "varying";
    case PvaryCast::kUnreduced:
      return "unreduced";
    case PvaryCast::kReduced:
      return "reduced";
    case PvaryCast::kInvariant:
      return "invariant";
  }
  return "?";
}

}  // namespace tessera

#endif  // TESSERA_CORE_PVARY_CAST_H_
