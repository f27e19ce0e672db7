// visualize_array_sharding: the text picture of a layout that jax.debug.visualize_array_sharding
// prints — a boxed grid, one tile per block, labelled with the devices that hold it — sized as
// jax/_src/debugging.py sizes it: 10 lines tall, 2.5 * 10 * (columns / rows) characters wide,
// each tile its share of that, at least 9 and at most 80 characters, drawn as rich draws a
// table without colour (what JAX prints when its output is not a colour terminal).
//
//   std::cout << *visualize_array_sharding(x);   // x: (16, 8) under P('data', 'model') on (4, 2)
//   ┌───────┬───────┐
//   │ CPU 0 │ CPU 1 │
//   ├───────┼───────┤
//   ...
//
// Surprising: a picture wider than 80 columns (ten or more narrow tiles side by side) is drawn at its
// width, where rich squeezes it into 80 columns and cuts labels short ("C…").
#ifndef TESSERA_VISUALIZE_H_
#define TESSERA_VISUALIZE_H_

#include <string>

#include "absl/status/statusor.h"
#include "core/sharding.h"
#include "tessera/array.h"

namespace tessera {

// The picture of an array of `shape` laid out by `sharding`, lines ending in '\n'; a tile
// held by several devices lists them all ("CPU 0,4"). INVALID_ARGUMENT for a shape of rank
// other than 1 or 2, or a sharding that does not fit it (NamedSharding::validate).
absl::StatusOr<std::string> visualize_sharding(const Shape& shape, const NamedSharding& sharding);
// visualize_sharding(array.shape(), array.sharding()); metadata only: never waits for the
// array's data.
absl::StatusOr<std::string> visualize_array_sharding(const Array& array);

}  // namespace tessera

#endif  // TESSERA_VISUALIZE_H_
