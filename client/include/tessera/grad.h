// Reverse-mode differentiation of traced functions, as jax.grad and jax.value_and_grad.
//
// grad(f, argnums) is itself a traced function: called inside jit (or any trace) it records
// f's ops and then, from f's scalar result back to the arguments, the vector-Jacobian product
// of each op, so the gradient program is compiled, partitioned and run like any other.
//
//   TracedFunction loss = [](const std::vector<Value>& in) {
//     Value err = matmul(in[0], in[1]) - in[2];                  // in[0]: weights
//     return std::vector<Value>{mean(err * err)};
//   };
//   Jitted step = jit(value_and_grad(loss, {0}));   // {loss, d loss / d in[0]}
//
// Rules: every differentiable op of trace.h (the elementwise functions, arithmetic, max/min
// with ties split evenly as in JAX, select, convert between floats, broadcasts, reshape,
// transpose, the reductions, dot_general, slice, concatenate, with_sharding_constraint).
// Integer and bool values carry no gradient (comparisons, argmax, floor, sign give zero).
// shard_map bodies too: each device's block is a variable of its own and the collectives
// transpose as linear maps (psum <-> psum, all_gather <-> psum_scatter, ppermute <-> the
// inverse permutation, all_to_all <-> all_to_all with the axes swapped; pmax/pmin send the
// cotangent to the devices holding the extreme); an output replicated over axes its out_spec
// leaves out passes each device its share, an argument read by several devices gets their sum.
#ifndef TESSERA_GRAD_H_
#define TESSERA_GRAD_H_

#include <vector>

#include "tessera/trace.h"

namespace tessera {

// A traced function returning the gradients of f's first result, a float scalar, with
// respect to the arguments `argnums` (in that order), each of its argument's shape and
// sharding; f's other results are dropped. Errors fail the enclosing trace with
// INVALID_ARGUMENT: f returns no value of the trace or a first result that is not a float
// scalar, an argnum is out of range, or a differentiated argument is not float (JAX: "grad
// requires real-valued inputs"). Called outside a trace it records nothing and returns
// invalid Values.
TracedFunction grad(TracedFunction f, std::vector<int> argnums = {0});

// As grad, but returns {f's first result, then the gradients}.
TracedFunction value_and_grad(TracedFunction f, std::vector<int> argnums = {0});

}  // namespace tessera

#endif  // TESSERA_GRAD_H_
